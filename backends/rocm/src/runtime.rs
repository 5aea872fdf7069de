//! The HIP memory runtime: devices, buffers, streams, graphs and IPC handles over the loaded [`HipLibrary`],
//! implementing core's [`MemoryRuntime`].
//!
//! Capture rules (the same as CUDA's, enforced by HIP since ROCm 7.0), written once in [`anyccl_core::capture`]:
//! nothing here allocates, frees, copies synchronously or synchronizes while a capture it would break is running on
//! a stream of this runtime (its streams are registered with the library's
//! [`KnownStreams`](anyccl_core::capture::KnownStreams), and [`HipGraph`] records the captures it begins); such
//! calls return [`anyccl_core::InvalidArgument::DuringCapture`] before reaching HIP, so the user's capture is never
//! invalidated by anyccl. Allocation runs in relaxed capture mode where HIP has
//! `hipThreadExchangeStreamCaptureMode`, so a capture on a stream anyccl never saw is not invalidated either.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use anyccl_core::capture::{KnownStreams, StreamKey};
use anyccl_core::{CaptureMode, Error, Location, MemoryRuntime, Result};
use anyccl_gpu::{CaptureQueries, GpuAllocation, GpuBuffer, GpuView, GpuViewMut};

use crate::loader::HipLibrary;
use crate::sys;

/// Whether `raw` is being captured (`hipStreamGetCaptureInfo`, legal during capture).
fn stream_is_capturing(lib: &HipLibrary, raw: sys::hipStream_t) -> Result<bool> {
    let mut status: sys::hipStreamCaptureStatus = sys::HIP_STREAM_CAPTURE_STATUS_NONE;
    let mut id = 0u64;
    // SAFETY: `raw` is a live stream (registered streams unregister before they are destroyed); writes a status
    // and an id.
    let st = unsafe { (lib.table().stream_get_capture_info)(raw, &mut status, &mut id) };
    check(lib, "hipStreamGetCaptureInfo", st)?;
    Ok(status != sys::HIP_STREAM_CAPTURE_STATUS_NONE)
}

/// The capture rules' questions to the HIP runtime ([`CaptureQueries`]; the rules are written once in
/// anyccl-gpu). The capture mode is exchanged where HIP has `hipThreadExchangeStreamCaptureMode`.
impl CaptureQueries for HipLibrary {
    type Mode = sys::hipStreamCaptureMode;
    const RELAXED: sys::hipStreamCaptureMode = sys::HIP_STREAM_CAPTURE_MODE_RELAXED;

    fn known_streams(&self) -> &KnownStreams {
        HipLibrary::known_streams(self)
    }

    fn stream_is_capturing(&self, handle: usize) -> Result<bool> {
        stream_is_capturing(self, handle as sys::hipStream_t)
    }

    fn exchange_capture_mode(&self, mode: &mut sys::hipStreamCaptureMode) -> bool {
        let Some(exchange) = self.table().thread_exchange_stream_capture_mode else {
            return false;
        };
        // SAFETY: swaps this thread's mode with `mode` (one int, read and written).
        unsafe { exchange(mode) == sys::HIP_SUCCESS }
    }
}

/// Turns a HIP status into a `Result`, with HIP's error text.
pub(crate) fn check(lib: &HipLibrary, call: &str, status: sys::hipError_t) -> Result<()> {
    if status == sys::HIP_SUCCESS {
        return Ok(());
    }
    Err(Error::backend("rocm", call, Some(i64::from(status)), lib.error_string(status)))
}

/// One HIP device of this process.
#[derive(Debug)]
pub struct HipDevice {
    lib: Arc<HipLibrary>,
    ordinal: i32,
}

impl HipDevice {
    /// Device `ordinal` of `lib`; fails when it does not exist.
    pub fn new(lib: Arc<HipLibrary>, ordinal: i32) -> Result<Arc<Self>> {
        let n = device_count(&lib)?;
        if ordinal < 0 || ordinal as usize >= n {
            return Err(Error::backend(
                "rocm",
                "hipSetDevice",
                None,
                format!("device {ordinal} does not exist ({n} HIP devices)"),
            ));
        }
        Ok(Arc::new(HipDevice { lib, ordinal }))
    }

    /// Makes this device current on the calling thread (HIP's current device is per thread).
    pub fn bind(&self) -> Result<()> {
        // SAFETY: hipSetDevice takes any ordinal and checks it.
        check(&self.lib, "hipSetDevice", unsafe { (self.lib.table().set_device)(self.ordinal) })
    }

    /// The allocation that contains device address `ptr`: its base and size (`hipMemGetAddressRange`), so that a
    /// buffer claims only memory the runtime really has. Binds this device first.
    pub fn address_range(&self, ptr: u64) -> Result<(u64, usize)> {
        self.bind()?;
        let (mut base, mut size): (*mut c_void, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: writes the allocation's base and size; the runtime rejects an address it does not know.
        let st = unsafe { (self.lib.table().mem_get_address_range)(&mut base, &mut size, ptr as *mut c_void) };
        check(&self.lib, "hipMemGetAddressRange", st)?;
        Ok((base as u64, size))
    }

    /// The ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The runtime library.
    pub fn library(&self) -> &Arc<HipLibrary> {
        &self.lib
    }

    /// Whether this device can map `peer`'s memory.
    pub fn can_access_peer(&self, peer: &HipDevice) -> Result<bool> {
        let mut ok: c_int = 0;
        // SAFETY: writes one int.
        let st = unsafe { (self.lib.table().device_can_access_peer)(&mut ok, self.ordinal, peer.ordinal) };
        check(&self.lib, "hipDeviceCanAccessPeer", st)?;
        Ok(ok != 0)
    }
}

/// Number of HIP devices (an error carries HIP's reason, e.g. "no ROCm-capable device is detected").
pub fn device_count(lib: &HipLibrary) -> Result<usize> {
    let mut n: c_int = 0;
    // SAFETY: writes one int.
    let st = unsafe { (lib.table().get_device_count)(&mut n) };
    check(lib, "hipGetDeviceCount", st)?;
    Ok(n.max(0) as usize)
}

/// The GPU target of device `ordinal` (`"gfx90a"`, `"gfx942"`), without feature suffixes.
///
/// `hipDeviceProp_t` changed layout between HIP 5 and 6, and `gcnArchName` sits at different offsets, so this
/// passes a zeroed buffer far larger than either struct and reads the one NUL-terminated string in it that
/// starts with `gfx` (the marketing name at offset 0 never does). Written by hand because no crate binds the
/// struct for both layouts.
pub fn arch_of(lib: &HipLibrary, ordinal: i32) -> Result<String> {
    let f = lib.table().get_device_properties_r0600.or(lib.table().get_device_properties).ok_or_else(|| {
        Error::backend(
            "rocm",
            "hipGetDeviceProperties",
            None,
            format!("{} exports neither hipGetDevicePropertiesR0600 nor hipGetDeviceProperties", lib.path().display()),
        )
    })?;
    let mut buf = vec![0u8; 16 << 10];
    // SAFETY: the buffer is larger than every hipDeviceProp_t layout (about 1.5 KiB), zeroed, writable.
    let st = unsafe { f(buf.as_mut_ptr().cast::<c_void>(), ordinal) };
    check(lib, "hipGetDeviceProperties", st)?;
    Ok(find_gfx(&buf).unwrap_or_else(|| "gfx-unknown".into()))
}

fn find_gfx(buf: &[u8]) -> Option<String> {
    let mut i = 0;
    while let Some(pos) = buf[i..].windows(3).position(|w| w == b"gfx") {
        let start = i + pos;
        let at_string_start = start == 0 || buf[start - 1] == 0;
        let end = buf[start..].iter().position(|b| *b == 0).map_or(buf.len(), |e| start + e);
        let s = &buf[start..end];
        if at_string_start
            && s.get(3).is_some_and(u8::is_ascii_digit)
            && s.iter().all(|b| b.is_ascii_alphanumeric() || b":+-".contains(b))
        {
            let s = String::from_utf8_lossy(s);
            return Some(s.split(':').next().unwrap_or(&s).to_owned());
        }
        i = start + 3;
    }
    None
}

/// One `hipMalloc` allocation, freed when the last buffer or view holding it drops ([`HipBuffer`]'s owner).
#[derive(Debug)]
pub struct HipAllocation {
    ptr: u64,
    len: usize,
    dev: Arc<HipDevice>,
}

impl Drop for HipAllocation {
    fn drop(&mut self) {
        // A query that fails counts as a capture: leaking is the safe side.
        if self.dev.lib.capture_blocks_this_thread().unwrap_or(true) {
            // Freeing during a capture would invalidate it; leaking one buffer is the lesser harm.
            tracing::warn!(bytes = self.len, "a HIP buffer dropped during graph capture is leaked, not freed");
            return;
        }
        if let Err(e) = self.dev.bind() {
            tracing::warn!(error = %e, "binding the device to free a HIP buffer failed");
        }
        // SAFETY: allocated by hipMalloc in `HipBuffer::alloc`, freed once, when its last holder drops.
        let st = unsafe { (self.dev.lib.table().free)(self.ptr as *mut c_void) };
        if let Err(e) = check(&self.dev.lib, "hipFree", st) {
            tracing::warn!(error = %e, "hipFree failed");
        }
    }
}

impl GpuAllocation for HipAllocation {
    type Device = HipDevice;

    /// Allocates `bytes` on `dev` (at least one byte, so every buffer has a distinct address). Refused with
    /// [`anyccl_core::InvalidArgument::DuringCapture`] while a capture it would break runs on a stream of this
    /// runtime ([`anyccl_core::capture`]); made in relaxed capture mode otherwise, so that a capture on a stream
    /// anyccl never saw is not invalidated either.
    fn alloc(dev: &Arc<HipDevice>, bytes: usize) -> Result<HipBuffer> {
        dev.lib.refuse_unsafe_call("MemoryRuntime::alloc (hipMalloc)")?;
        let size = anyccl_core::round_allocation("a device buffer", bytes, 1)?;
        dev.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        let st = dev.lib.relaxed(|| unsafe { (dev.lib.table().malloc)(&mut p, size) });
        check(&dev.lib, "hipMalloc", st)?;
        anyccl_core::check_non_null("rocm", "hipMalloc", p as u64, size)?;
        let owner = Arc::new(HipAllocation { ptr: p as u64, len: size, dev: dev.clone() });
        // SAFETY: `size >= bytes` bytes of this device were just allocated at `p`, owned by `owner`.
        Ok(unsafe { HipBuffer::owning(p as u64, bytes, dev.ordinal.unsigned_abs(), owner) })
    }
}

/// Device memory: owned (`HipBuffer::alloc(dev, bytes)`, freed on drop), a view of memory owned elsewhere
/// (`HipBuffer::from_raw`), or a range of another buffer (`view`, `view_mut`); written once for both GPU backends
/// ([`GpuBuffer`]).
pub type HipBuffer = GpuBuffer<HipAllocation>;

/// A read-only view of a byte range of a [`HipBuffer`] (`HipBuffer::view`).
pub type HipView<'a> = GpuView<'a, HipAllocation>;

/// A writable view of a byte range of a [`HipBuffer`] (`HipBuffer::view_mut`).
pub type HipViewMut<'a> = GpuViewMut<'a, HipAllocation>;

impl anyccl_ccl::CclStream for HipStream {
    fn ccl_handle(&self) -> anyccl_ccl::sys::Stream {
        self.raw
    }

    fn is_capturing(&self) -> Result<bool> {
        HipStream::is_capturing(self)
    }

    fn synchronize(&self) -> Result<()> {
        HipStream::synchronize(self)
    }

    fn query(&self) -> Result<bool> {
        HipStream::query(self)
    }
}

/// A HIP stream: created by anyccl (non-blocking, destroyed on drop) or borrowed from the engine
/// ([`HipStream::from_raw`]). Known to its library's [`KnownStreams`](anyccl_core::capture::KnownStreams) while it
/// lives.
#[derive(Debug)]
pub struct HipStream {
    raw: sys::hipStream_t,
    dev: Arc<HipDevice>,
    key: StreamKey,
    owned: bool,
}

// SAFETY: HIP streams may be used from any thread.
unsafe impl Send for HipStream {}
// SAFETY: as above; HIP serialises work submitted to a stream.
unsafe impl Sync for HipStream {}

impl HipStream {
    /// A new stream on `dev`.
    pub fn new(dev: &Arc<HipDevice>) -> Result<Self> {
        dev.bind()?;
        let mut raw: sys::hipStream_t = std::ptr::null_mut();
        // SAFETY: writes one handle.
        let st = unsafe { (dev.lib.table().stream_create_with_flags)(&mut raw, sys::HIP_STREAM_NON_BLOCKING) };
        check(&dev.lib, "hipStreamCreateWithFlags", st)?;
        let key = dev.lib.known_streams().register(raw as usize);
        Ok(HipStream { raw, dev: dev.clone(), key, owned: true })
    }

    /// Wraps an engine's stream (`hipStream_t`) without taking ownership: nothing is destroyed on drop.
    ///
    /// # Safety
    /// `raw` is a live stream of `dev`'s device (of the same HIP runtime) and outlives the returned value.
    pub unsafe fn from_raw(raw: *mut c_void, dev: &Arc<HipDevice>) -> Self {
        let key = dev.lib.known_streams().register(raw as usize);
        HipStream { raw, dev: dev.clone(), key, owned: false }
    }

    /// The device of the stream.
    pub fn device(&self) -> &Arc<HipDevice> {
        &self.dev
    }

    /// The raw handle.
    pub fn raw(&self) -> sys::hipStream_t {
        self.raw
    }

    /// Whether the stream is capturing (`hipStreamGetCaptureInfo`, legal during capture).
    pub fn is_capturing(&self) -> Result<bool> {
        stream_is_capturing(&self.dev.lib, self.raw)
    }

    /// Waits for the stream; refused while it captures (synchronising a capturing stream is illegal).
    pub fn synchronize(&self) -> Result<()> {
        anyccl_core::capture::refuse_if("HipStream::synchronize (hipStreamSynchronize)", self.is_capturing()?)?;
        self.synchronize_not_capturing()
    }

    /// Whether the stream's work is done (`hipStreamQuery`), without blocking. Refused while capturing.
    pub fn query(&self) -> Result<bool> {
        anyccl_core::capture::refuse_if("HipStream::query (hipStreamQuery)", self.is_capturing()?)?;
        // SAFETY: the stream is live.
        match unsafe { (self.dev.lib.table().stream_query)(self.raw) } {
            sys::HIP_SUCCESS => Ok(true),
            sys::HIP_ERROR_NOT_READY => Ok(false),
            st => check(&self.dev.lib, "hipStreamQuery", st).map(|()| false),
        }
    }

    /// `hipStreamSynchronize`, for callers that have just checked the stream is not capturing.
    fn synchronize_not_capturing(&self) -> Result<()> {
        // SAFETY: the stream is live.
        check(&self.dev.lib, "hipStreamSynchronize", unsafe { (self.dev.lib.table().stream_synchronize)(self.raw) })
    }
}

impl Drop for HipStream {
    fn drop(&mut self) {
        // Forgotten first: nothing queries a destroyed (or returned) handle.
        self.dev.lib.known_streams().unregister(self.key);
        if !self.owned {
            return;
        }
        // SAFETY: created in `new`, destroyed once.
        let st = unsafe { (self.dev.lib.table().stream_destroy)(self.raw) };
        if let Err(e) = check(&self.dev.lib, "hipStreamDestroy", st) {
            tracing::warn!(error = %e, "hipStreamDestroy failed");
        }
    }
}

/// A HIP timing event (`hipEventCreate`), destroyed on drop: recorded on a stream outside capture, then the time
/// between two is read ([`HipEvent::elapsed_ms`]).
#[derive(Debug)]
pub struct HipEvent {
    raw: sys::hipEvent_t,
    dev: Arc<HipDevice>,
}

// SAFETY: HIP events may be recorded, queried and destroyed from any thread.
unsafe impl Send for HipEvent {}
// SAFETY: as above; HIP serialises the operations on an event.
unsafe impl Sync for HipEvent {}

impl HipEvent {
    /// A new timing event on `dev`.
    pub fn new(dev: &Arc<HipDevice>) -> Result<Self> {
        dev.bind()?;
        let mut raw: sys::hipEvent_t = std::ptr::null_mut();
        // SAFETY: writes one handle.
        check(&dev.lib, "hipEventCreate", unsafe { (dev.lib.table().event_create)(&mut raw) })?;
        Ok(HipEvent { raw, dev: dev.clone() })
    }

    /// Records the event on `stream`. Refused while the stream captures: an event recorded in a capture becomes a
    /// node of the graph, its time cannot be read, and waiting for it while the capture runs would invalidate it.
    pub fn record(&self, stream: &HipStream) -> Result<()> {
        anyccl_core::capture::refuse_if("HipEvent::record (hipEventRecord)", stream.is_capturing()?)?;
        // SAFETY: a live event and a live stream.
        check(&self.dev.lib, "hipEventRecord", unsafe { (self.dev.lib.table().event_record)(self.raw, stream.raw) })
    }

    /// Waits until the work before the event's last record is done.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a live event, recorded outside capture ([`Self::record`] refuses otherwise).
        check(&self.dev.lib, "hipEventSynchronize", unsafe { (self.dev.lib.table().event_synchronize)(self.raw) })
    }

    /// Milliseconds from `self` to `end` (both recorded and completed).
    pub fn elapsed_ms(&self, end: &HipEvent) -> Result<f32> {
        let mut ms = 0f32;
        // SAFETY: two live events; writes one float.
        let st = unsafe { (self.dev.lib.table().event_elapsed_time)(&mut ms, self.raw, end.raw) };
        check(&self.dev.lib, "hipEventElapsedTime", st)?;
        Ok(ms)
    }
}

impl Drop for HipEvent {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let st = unsafe { (self.dev.lib.table().event_destroy)(self.raw) };
        if let Err(e) = check(&self.dev.lib, "hipEventDestroy", st) {
            tracing::warn!(error = %e, "hipEventDestroy failed");
        }
    }
}

/// An instantiated HIP graph captured from a stream.
pub struct HipGraph {
    graph: sys::hipGraph_t,
    exec: sys::hipGraphExec_t,
    lib: Arc<HipLibrary>,
}

// SAFETY: graph handles may be launched and destroyed from any thread.
unsafe impl Send for HipGraph {}

impl HipGraph {
    /// Captures what `f` submits to `stream` (thread-local mode: other threads' calls are not checked against
    /// it) and instantiates it. The capture is always ended, also when `f` fails. [`HipGraph::capture_with`]
    /// chooses the mode.
    pub fn capture<F: FnOnce(&HipStream) -> Result<()>>(stream: &HipStream, f: F) -> Result<Self> {
        Self::capture_with(stream, CaptureMode::ThreadLocal, f)
    }

    /// [`HipGraph::capture`] in capture mode `mode`. In [`CaptureMode::Global`] (as engines capture) anyccl
    /// refuses allocation on every thread of the process while the capture lasts, and HIP invalidates the
    /// capture if another thread makes an unsafe call itself (this then returns HIP's error).
    pub fn capture_with<F: FnOnce(&HipStream) -> Result<()>>(
        stream: &HipStream,
        mode: CaptureMode,
        f: F,
    ) -> Result<Self> {
        let lib = stream.dev.lib.clone();
        let t = lib.table();
        stream.dev.bind()?;
        let hip_mode = match mode {
            CaptureMode::Global => sys::HIP_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => sys::HIP_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CaptureMode::Relaxed => sys::HIP_STREAM_CAPTURE_MODE_RELAXED,
        };
        // The mode and this thread go on record before the capture begins, so that another thread's check never
        // sees this stream capturing without them (it would count the capture as global and refuse a call HIP
        // allows); calls elsewhere are then refused exactly where HIP would refuse them. A failed begin drops the
        // record at once.
        let began = lib.known_streams().began_capture(stream.key, mode);
        // SAFETY: the stream is live and not capturing (HIP checks and returns an error otherwise).
        check(&lib, "hipStreamBeginCapture", unsafe { (t.stream_begin_capture)(stream.raw, hip_mode) })?;
        let body = f(stream);
        let mut graph: sys::hipGraph_t = std::ptr::null_mut();
        // SAFETY: ends the capture begun above; writes the graph handle.
        let end = unsafe { (t.stream_end_capture)(stream.raw, &mut graph) };
        drop(began);
        let ended = check(&lib, "hipStreamEndCapture", end);
        if let Err(e) = body {
            Self::destroy_graph(&lib, graph);
            return Err(e);
        }
        ended?;
        let mut exec: sys::hipGraphExec_t = std::ptr::null_mut();
        // SAFETY: `graph` is the live graph just captured; no error node or log buffer is requested.
        let st = unsafe { (t.graph_instantiate)(&mut exec, graph, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
        if let Err(e) = check(&lib, "hipGraphInstantiate", st) {
            Self::destroy_graph(&lib, graph);
            return Err(e);
        }
        Ok(HipGraph { graph, exec, lib })
    }

    fn destroy_graph(lib: &HipLibrary, graph: sys::hipGraph_t) {
        if graph.is_null() {
            return;
        }
        // SAFETY: a graph returned by hipStreamEndCapture, destroyed once.
        if let Err(e) = check(lib, "hipGraphDestroy", unsafe { (lib.table().graph_destroy)(graph) }) {
            tracing::warn!(error = %e, "hipGraphDestroy failed");
        }
    }

    /// Launches the graph on `stream`.
    pub fn launch(&self, stream: &HipStream) -> Result<()> {
        // SAFETY: both handles are live.
        check(&self.lib, "hipGraphLaunch", unsafe { (self.lib.table().graph_launch)(self.exec, stream.raw) })
    }
}

impl Drop for HipGraph {
    fn drop(&mut self) {
        // SAFETY: instantiated in `capture`, destroyed once, before its graph.
        let st = unsafe { (self.lib.table().graph_exec_destroy)(self.exec) };
        if let Err(e) = check(&self.lib, "hipGraphExecDestroy", st) {
            tracing::warn!(error = %e, "hipGraphExecDestroy failed");
        }
        Self::destroy_graph(&self.lib, self.graph);
    }
}

/// The memory runtime of one HIP device.
#[derive(Debug, Clone)]
pub struct HipRuntime {
    dev: Arc<HipDevice>,
}

impl HipRuntime {
    /// The runtime of `dev`.
    pub fn new(dev: Arc<HipDevice>) -> Self {
        HipRuntime { dev }
    }

    /// The device.
    pub fn device(&self) -> &Arc<HipDevice> {
        &self.dev
    }

    /// A new stream on this device.
    pub fn stream(&self) -> Result<HipStream> {
        HipStream::new(&self.dev)
    }

    /// Free and total memory of this device in bytes (`hipMemGetInfo`), as HIP sees it now. A HIP runtime that
    /// lacks the call gives [`Error::Unsupported`].
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        let Some(get) = self.dev.lib.table().mem_get_info else {
            return Err(Error::Unsupported {
                capability: "memory-info".into(),
                reason: anyccl_core::Reason::MissingSymbol {
                    symbol: "hipMemGetInfo".into(),
                    library: self.dev.lib.path().display().to_string(),
                    version: None,
                },
            });
        };
        self.dev.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two sizes for the current device.
        check(&self.dev.lib, "hipMemGetInfo", unsafe { get(&mut free, &mut total) })?;
        Ok((free, total))
    }

    fn copy(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
        kind: c_int,
        stream: &HipStream,
        what: &'static str,
    ) -> Result<()> {
        // The copy is waited for: a synchronize of the stream, refused while it captures.
        anyccl_core::capture::refuse_if(what, stream.is_capturing()?)?;
        self.dev.bind()?;
        let t = self.dev.lib.table();
        // SAFETY: the caller checked both ranges; the stream is live and not capturing.
        let st = unsafe { (t.memcpy_async)(dst as *mut c_void, src as *const c_void, bytes, kind, stream.raw) };
        check(&self.dev.lib, "hipMemcpyAsync", st)?;
        stream.synchronize_not_capturing()
    }
}

impl MemoryRuntime for HipRuntime {
    type Buffer = HipBuffer;
    type OwnedBuffer = HipBuffer;
    type Stream = HipStream;

    fn location(&self) -> Location {
        Location::Device { ordinal: self.dev.ordinal.unsigned_abs() }
    }

    fn alloc(&self, bytes: usize) -> Result<HipBuffer> {
        HipBuffer::alloc(&self.dev, bytes)
    }

    fn upload(&self, dst: &mut HipBuffer, src: &[u8], stream: &HipStream) -> Result<()> {
        check_fits("upload", src.len(), dst.len())?;
        let what = "MemoryRuntime::upload";
        self.copy(dst.device_ptr(), src.as_ptr() as u64, src.len(), sys::HIP_MEMCPY_HOST_TO_DEVICE, stream, what)
    }

    fn download(&self, src: &HipBuffer, dst: &mut [u8], stream: &HipStream) -> Result<()> {
        check_fits("download", dst.len(), src.len())?;
        let what = "MemoryRuntime::download";
        self.copy(dst.as_mut_ptr() as u64, src.device_ptr(), dst.len(), sys::HIP_MEMCPY_DEVICE_TO_HOST, stream, what)
    }

    fn synchronize(&self, stream: &HipStream) -> Result<()> {
        stream.synchronize()
    }

    fn is_capturing(&self, stream: &HipStream) -> Result<bool> {
        stream.is_capturing()
    }

    fn refuse_during_capture(&self, what: &'static str) -> Result<()> {
        self.dev.lib.refuse_unsafe_call(what)
    }

    fn query(&self, stream: &HipStream) -> Result<bool> {
        stream.query()
    }
}

impl anyccl_gpu::GpuRuntime for HipRuntime {
    type Allocation = HipAllocation;

    fn bind(&self) -> Result<()> {
        self.dev.bind()
    }

    fn address_range(&self, ptr: u64) -> Result<(u64, usize)> {
        self.dev.address_range(ptr)
    }

    fn ordinal(&self) -> u32 {
        self.dev.ordinal.unsigned_abs()
    }
}

fn check_fits(which: &'static str, bytes: usize, capacity: usize) -> Result<()> {
    if bytes > capacity {
        return Err(anyccl_core::InvalidArgument::BufferTooSmall {
            which,
            have: capacity,
            need: bytes,
            count: bytes,
            dtype: anyccl_core::DataType::U8,
        }
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::find_gfx;

    #[test]
    fn arch_string_is_found_in_either_layout() {
        let mut buf = vec![0u8; 4096];
        buf[..19].copy_from_slice(b"AMD Instinct MI300X");
        buf[1200..1222].copy_from_slice(b"gfx942:sramecc+:xnack-");
        assert_eq!(find_gfx(&buf).as_deref(), Some("gfx942"));
        let mut buf = vec![0u8; 4096];
        buf[..11].copy_from_slice(b"gfx-looking");
        buf[700..706].copy_from_slice(b"gfx90a");
        assert_eq!(find_gfx(&buf).as_deref(), Some("gfx90a"));
        assert_eq!(find_gfx(&[0u8; 64]), None);
        // Not at a string start: ignored.
        let mut buf = vec![0u8; 64];
        buf[10..19].copy_from_slice(b"xxgfx90a\0");
        assert_eq!(find_gfx(&buf), None);
    }
}
