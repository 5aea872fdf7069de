//! Core's [`MemoryRuntime`] over the CUDA driver: device buffers, streams, capture status.
//!
//! Capture rules, written once in [`anyccl_core::capture`]: every stream made or wrapped here is known to the
//! process's [`KnownStreams`] while it lives, and [`crate::graph::Graph`] records the captures it begins. A call
//! that is not capture-safe and takes no stream (allocation, freeing, registration) is refused with
//! [`InvalidArgument::DuringCapture`] before the driver sees it while a capture it would break runs on a known
//! stream, or on a blocking stream of the device (which the legacy stream reveals without disturbing it). The
//! allocation itself runs in relaxed capture mode, so a capture on a non-blocking stream anyccl never saw is not
//! invalidated by it either.

use std::sync::Arc;

use anyccl_core::capture::{KnownStreams, StreamKey};
use anyccl_core::{Error, InvalidArgument, Location, MemoryRuntime, Result};
use anyccl_gpu::{CaptureQueries, GpuAllocation, GpuBuffer, GpuView, GpuViewMut};
use cudarc::driver::{result, sys};

use crate::driver::cu_err;

/// The CUDA streams alive in this process that anyccl made or wraps (the driver is one per process).
static STREAMS: KnownStreams = KnownStreams::new();

/// The streams anyccl knows in this process, for the capture rules.
pub(crate) fn known_streams() -> &'static KnownStreams {
    &STREAMS
}

/// `CU_STREAM_LEGACY` of `cuda.h` (`(CUstream)0x1`): the legacy default stream, which cudarc does not name.
const CU_STREAM_LEGACY: sys::CUstream = std::ptr::without_provenance_mut(1);

/// Whether `raw` is being captured (`cuStreamIsCapturing`, legal during capture).
fn stream_is_capturing(raw: sys::CUstream) -> Result<bool> {
    // SAFETY: a live stream (known streams unregister before they are destroyed); the query has no side effects.
    let st = unsafe { result::stream::is_capturing(raw) }.map_err(|e| cu_err("cuStreamIsCapturing", e))?;
    Ok(st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// The capture rules' questions to the CUDA driver for one context ([`CaptureQueries`]; the rules are written
/// once in anyccl-gpu). Checking the legacy stream binds the context.
impl CaptureQueries for DeviceContext {
    type Mode = sys::CUstreamCaptureMode;
    const RELAXED: sys::CUstreamCaptureMode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;

    fn known_streams(&self) -> &KnownStreams {
        &STREAMS
    }

    fn stream_is_capturing(&self, handle: usize) -> Result<bool> {
        stream_is_capturing(handle as sys::CUstream)
    }

    /// A capture on a blocking stream of the device: asking the legacy stream answers
    /// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT` then, and the driver documents that the capture is not invalidated by
    /// the question.
    fn implicit_capture(&self) -> Result<bool> {
        self.bind()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: CU_STREAM_LEGACY is the documented handle of the legacy stream; the query writes one status.
        match unsafe { sys::cuStreamIsCapturing(CU_STREAM_LEGACY, &mut status) } {
            sys::CUresult::CUDA_SUCCESS => Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE),
            sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT => Ok(true),
            e => Err(cu_err("cuStreamIsCapturing(CU_STREAM_LEGACY)", cudarc::driver::DriverError(e))),
        }
    }

    fn exchange_capture_mode(&self, mode: &mut sys::CUstreamCaptureMode) -> bool {
        // SAFETY: swaps this thread's mode with `mode` (read and written).
        let st = unsafe { sys::cuThreadExchangeStreamCaptureMode(mode) };
        st == sys::CUresult::CUDA_SUCCESS
    }
}

/// A retained primary context of one device. Released when the last user drops it.
pub struct DeviceContext {
    ctx: sys::CUcontext,
    dev: sys::CUdevice,
    ordinal: i32,
}

// SAFETY: a CUDA context handle may be made current on any thread; the driver synchronises its use.
unsafe impl Send for DeviceContext {}
// SAFETY: as above; all methods take `&self` and only pass the handle to thread-safe driver calls.
unsafe impl Sync for DeviceContext {}

impl DeviceContext {
    /// Retains the primary context of device `ordinal`.
    pub fn new(ordinal: i32) -> Result<Arc<Self>> {
        crate::driver::probe().map_err(|reason| Error::Unsupported { capability: "cuda-runtime".into(), reason })?;
        let dev = result::device::get(ordinal).map_err(|e| cu_err("cuDeviceGet", e))?;
        // SAFETY: `dev` is a valid device; retaining its primary context is reference counted.
        let ctx = unsafe { result::primary_ctx::retain(dev) }.map_err(|e| cu_err("cuDevicePrimaryCtxRetain", e))?;
        Ok(Arc::new(DeviceContext { ctx, dev, ordinal }))
    }

    /// Makes the context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: `ctx` is a retained, live context.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(|e| cu_err("cuCtxSetCurrent", e))
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The allocation that contains device address `ptr`: its base and size (`cuMemGetAddressRange`), so that a
    /// buffer claims only memory the driver really has. Binds this context first.
    pub fn address_range(&self, ptr: u64) -> Result<(u64, usize)> {
        self.bind()?;
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: writes the allocation's base and size; the driver rejects an address it does not know.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
            .result()
            .map_err(|e| cu_err("cuMemGetAddressRange", e))?;
        Ok((base, size))
    }

    /// Whether this device can access `peer`'s memory directly (`cuDeviceCanAccessPeer`).
    pub fn can_access_peer(&self, peer: &DeviceContext) -> Result<bool> {
        let mut v = 0;
        // SAFETY: two valid device handles; writes one int.
        unsafe { sys::cuDeviceCanAccessPeer(&mut v, self.dev, peer.dev) }
            .result()
            .map_err(|e| cu_err("cuDeviceCanAccessPeer", e))?;
        Ok(v != 0)
    }

    /// Lets this context access `peer`'s memory (`cuCtxEnablePeerAccess`); already enabled is fine.
    pub fn enable_peer_access(&self, peer: &DeviceContext) -> Result<()> {
        self.bind()?;
        // SAFETY: both contexts are live; flags must be 0.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.ctx, 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            e => Err(cu_err("cuCtxEnablePeerAccess", cudarc::driver::DriverError(e))),
        }
    }
}

impl Drop for DeviceContext {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `new`.
        if let Err(e) = unsafe { result::primary_ctx::release(self.dev) } {
            tracing::warn!(error = %cu_err("cuDevicePrimaryCtxRelease", e), "releasing a CUDA context failed");
        }
    }
}

/// A CUDA stream: created by anyccl (destroyed on drop) or borrowed from the engine. Known to the capture rules
/// ([`anyccl_core::capture::KnownStreams`]) while the value lives.
pub struct CudaStream {
    raw: sys::CUstream,
    ctx: Arc<DeviceContext>,
    owned: bool,
    key: StreamKey,
}

// SAFETY: CUDA streams may be used from any thread.
unsafe impl Send for CudaStream {}
// SAFETY: as above.
unsafe impl Sync for CudaStream {}

impl CudaStream {
    /// A new non-blocking stream on `ctx`'s device.
    pub fn new(ctx: &Arc<DeviceContext>) -> Result<Self> {
        ctx.bind()?;
        let raw =
            result::stream::create(result::stream::StreamKind::NonBlocking).map_err(|e| cu_err("cuStreamCreate", e))?;
        Ok(CudaStream { raw, ctx: ctx.clone(), owned: true, key: STREAMS.register(raw as usize) })
    }

    /// Wraps an engine's stream (`cudaStream_t`/`CUstream`) without taking ownership.
    ///
    /// # Safety
    /// `raw` is a live stream of `ctx`'s device and outlives the returned value.
    pub unsafe fn from_raw(raw: *mut std::ffi::c_void, ctx: &Arc<DeviceContext>) -> Self {
        CudaStream { raw: raw as sys::CUstream, ctx: ctx.clone(), owned: false, key: STREAMS.register(raw as usize) }
    }

    /// The context of the stream's device.
    pub fn context(&self) -> &Arc<DeviceContext> {
        &self.ctx
    }

    /// Its entry in the capture rules' known streams.
    pub(crate) fn key(&self) -> StreamKey {
        self.key
    }

    /// The raw handle.
    pub fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// Blocks until the stream's work is done.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: live stream.
        unsafe { result::stream::synchronize(self.raw) }.map_err(|e| cu_err("cuStreamSynchronize", e))
    }

    /// Whether the stream's work is done (`cuStreamQuery`), without blocking. Refused while the stream is being
    /// captured (the query would invalidate the capture).
    pub fn query(&self) -> Result<bool> {
        self.refuse_if_capturing("CudaStream::query (cuStreamQuery)")?;
        self.ctx.bind()?;
        // SAFETY: live stream; the query has no side effects.
        match unsafe { sys::cuStreamQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(cu_err("cuStreamQuery", cudarc::driver::DriverError(other))),
        }
    }

    /// Polls [`Self::query`] until the stream's work is done, for at most `limit`: `Ok(false)` when it was still
    /// busy then. Refused while the stream is being captured.
    pub fn done_within(&self, limit: std::time::Duration) -> Result<bool> {
        anyccl_gpu::done_within(self, limit)
    }

    /// [`InvalidArgument::DuringCapture`] naming `call` when the stream is being captured, where `call` would
    /// break the capture ([`anyccl_core::capture`]).
    pub fn refuse_if_capturing(&self, call: &'static str) -> Result<()> {
        anyccl_core::capture::refuse_if(call, self.is_capturing()?)
    }

    /// Whether the stream is being captured into a graph.
    pub fn is_capturing(&self) -> Result<bool> {
        stream_is_capturing(self.raw)
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        // Forgotten first: nothing asks the driver about a destroyed (or returned) handle.
        STREAMS.unregister(self.key);
        if self.owned {
            // SAFETY: we created it and destroy it once.
            if let Err(e) = unsafe { result::stream::destroy(self.raw) } {
                tracing::warn!(error = %cu_err("cuStreamDestroy", e), "destroying a CUDA stream failed");
            }
        }
    }
}

/// One `cuMemAlloc` allocation, freed when the last buffer or view holding it drops ([`DeviceBuffer`]'s owner).
pub struct CudaAllocation {
    ptr: sys::CUdeviceptr,
    ctx: Arc<DeviceContext>,
}

impl Drop for CudaAllocation {
    fn drop(&mut self) {
        // A query that fails counts as a capture: leaking is the safe side.
        if self.ctx.capture_blocks_this_thread().unwrap_or(true) {
            // Freeing during a capture would invalidate it; leaking one buffer is the lesser harm.
            tracing::warn!("a CUDA buffer dropped during graph capture is leaked, not freed");
            return;
        }
        if self.ctx.bind().is_ok() {
            // SAFETY: allocated by `DeviceBuffer::alloc` and freed once, when its last holder drops.
            if let Err(e) = unsafe { result::free_sync(self.ptr) } {
                tracing::warn!(error = %cu_err("cuMemFree", e), "freeing device memory failed");
            }
        }
    }
}

impl GpuAllocation for CudaAllocation {
    type Device = DeviceContext;

    /// Allocates `len` bytes on `ctx`'s device (`cuMemAlloc`, 256-byte aligned). Refused with
    /// [`InvalidArgument::DuringCapture`] while a capture it would break runs on a stream anyccl knows or on a
    /// blocking stream of the device ([`anyccl_core::capture`]); made in relaxed capture mode otherwise, so a
    /// capture on a stream anyccl never saw is not invalidated either.
    fn alloc(ctx: &Arc<DeviceContext>, len: usize) -> Result<DeviceBuffer> {
        // cuMemAlloc refuses 0 bytes; a 1-byte allocation gives zero-length buffers a valid address.
        let bytes = anyccl_core::round_allocation("a device buffer", len, 1)?;
        // Binds the context.
        ctx.refuse_unsafe_call("MemoryRuntime::alloc (cuMemAlloc)")?;
        // SAFETY: plain allocation in the current context.
        let ptr = ctx.relaxed(|| unsafe { result::malloc_sync(bytes) }).map_err(|e| cu_err("cuMemAlloc", e))?;
        anyccl_core::runtime::check_non_null("cuda", "cuMemAlloc", ptr, bytes)?;
        let owner = Arc::new(CudaAllocation { ptr, ctx: ctx.clone() });
        // SAFETY: `bytes >= len` bytes of this device were just allocated at `ptr`, owned by `owner`.
        Ok(unsafe { DeviceBuffer::owning(ptr, len, ctx.ordinal().unsigned_abs(), owner) })
    }
}

/// Device memory: allocated by anyccl (`DeviceBuffer::alloc(ctx, len)`, freed on drop), a view of the engine's
/// memory (`DeviceBuffer::from_raw`), or a range of another buffer (`view`, `view_mut`); written once for both
/// GPU backends ([`GpuBuffer`]).
///
/// The borrow checker holds a view to its buffer: this does not compile.
/// ```compile_fail,E0597
/// # fn demo(ctx: &std::sync::Arc<anyccl_cuda::DeviceContext>) -> anyccl_core::Result<()> {
/// let view = {
///     let mut buf = anyccl_cuda::DeviceBuffer::alloc(ctx, 1024)?;
///     buf.view_mut(256..512)?
/// }; // `buf` is freed here while `view` would still point into it
/// # drop(view);
/// # Ok(())
/// # }
/// ```
pub type DeviceBuffer = GpuBuffer<CudaAllocation>;

/// A read-only view of a byte range of a [`DeviceBuffer`] (`DeviceBuffer::view`).
pub type DeviceView<'a> = GpuView<'a, CudaAllocation>;

/// A writable view of a byte range of a [`DeviceBuffer`] (`DeviceBuffer::view_mut`).
pub type DeviceViewMut<'a> = GpuViewMut<'a, CudaAllocation>;

/// The CUDA memory runtime of one device.
#[derive(Clone)]
pub struct CudaRuntime {
    ctx: Arc<DeviceContext>,
}

impl CudaRuntime {
    /// The runtime of device `ordinal`.
    pub fn new(ordinal: i32) -> Result<Self> {
        Ok(CudaRuntime { ctx: DeviceContext::new(ordinal)? })
    }

    /// The runtime of `ctx`'s device.
    pub fn from_context(ctx: Arc<DeviceContext>) -> Self {
        CudaRuntime { ctx }
    }

    /// The device context.
    pub fn context(&self) -> &Arc<DeviceContext> {
        &self.ctx
    }

    /// A new stream on this device.
    pub fn stream(&self) -> Result<CudaStream> {
        CudaStream::new(&self.ctx)
    }

    /// Free and total memory of this device in bytes (`cuMemGetInfo`), as the driver sees it now: free memory
    /// shrinks as this and other processes allocate.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.ctx.bind()?;
        result::mem_get_info().map_err(|e| cu_err("cuMemGetInfo", e))
    }
}

impl MemoryRuntime for CudaRuntime {
    type Buffer = DeviceBuffer;
    type OwnedBuffer = DeviceBuffer;
    type Stream = CudaStream;

    fn location(&self) -> Location {
        Location::Device { ordinal: self.ctx.ordinal().unsigned_abs() }
    }

    fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        DeviceBuffer::alloc(&self.ctx, bytes)
    }

    fn upload(&self, dst: &mut DeviceBuffer, src: &[u8], stream: &CudaStream) -> Result<()> {
        if src.len() > dst.len() {
            return Err(InvalidArgument::BufferTooSmall {
                which: "upload",
                have: dst.len(),
                need: src.len(),
                count: src.len(),
                dtype: anyccl_core::DataType::U8,
            }
            .into());
        }
        stream.refuse_if_capturing("MemoryRuntime::upload")?;
        self.ctx.bind()?;
        // SAFETY: `dst` holds at least `src.len()` bytes of this device; the copy completes before we return
        // (the stream is synchronised), so `src` outlives it.
        unsafe { result::memcpy_htod_async(dst.device_ptr(), src, stream.raw) }
            .map_err(|e| cu_err("cuMemcpyHtoDAsync", e))?;
        stream.synchronize()
    }

    fn download(&self, src: &DeviceBuffer, dst: &mut [u8], stream: &CudaStream) -> Result<()> {
        if dst.len() > src.len() {
            return Err(InvalidArgument::BufferTooSmall {
                which: "download",
                have: src.len(),
                need: dst.len(),
                count: dst.len(),
                dtype: anyccl_core::DataType::U8,
            }
            .into());
        }
        stream.refuse_if_capturing("MemoryRuntime::download")?;
        self.ctx.bind()?;
        // SAFETY: `src` holds at least `dst.len()` bytes; synchronised before `dst` is used.
        unsafe { result::memcpy_dtoh_async(dst, src.device_ptr(), stream.raw) }
            .map_err(|e| cu_err("cuMemcpyDtoHAsync", e))?;
        stream.synchronize()
    }

    fn synchronize(&self, stream: &CudaStream) -> Result<()> {
        stream.synchronize()
    }

    fn is_capturing(&self, stream: &CudaStream) -> Result<bool> {
        stream.is_capturing()
    }

    fn refuse_during_capture(&self, what: &'static str) -> Result<()> {
        self.ctx.refuse_unsafe_call(what)
    }

    fn query(&self, stream: &CudaStream) -> Result<bool> {
        stream.query()
    }
}

impl anyccl_gpu::GpuRuntime for CudaRuntime {
    type Allocation = CudaAllocation;

    fn bind(&self) -> Result<()> {
        self.ctx.bind()
    }

    fn address_range(&self, ptr: u64) -> Result<(u64, usize)> {
        self.ctx.address_range(ptr)
    }

    fn ordinal(&self) -> u32 {
        self.ctx.ordinal().unsigned_abs()
    }
}

impl anyccl_ccl::CclStream for CudaStream {
    fn ccl_handle(&self) -> anyccl_ccl::sys::Stream {
        self.raw.cast()
    }

    fn is_capturing(&self) -> Result<bool> {
        CudaStream::is_capturing(self)
    }

    fn synchronize(&self) -> Result<()> {
        CudaStream::synchronize(self)
    }

    fn query(&self) -> Result<bool> {
        CudaStream::query(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyccl_core::runtime::BufferLike;
    use anyccl_core::BufferDesc;

    #[test]
    fn views_cover_exactly_their_range_and_refuse_the_rest() {
        // SAFETY: never dereferenced: only addresses and lengths are computed, no driver call is made.
        let mut buf = unsafe { DeviceBuffer::from_raw(0x10_0000, 4096, 3) };
        let v = buf.view(1024..2048).expect("inside");
        assert_eq!(v.desc(), BufferDesc { addr: 0x10_0400, len: 1024, location: Location::Device { ordinal: 3 } });
        let nested = v.view(512..).expect("a view of a view");
        assert_eq!((nested.device_ptr(), nested.len()), (0x10_0600, 512));
        assert!(matches!(
            v.view(..1025).err(),
            Some(Error::InvalidArgument(InvalidArgument::RangeOutOfBounds { start: 0, end: 1025, len: 1024 }))
        ));
        drop(nested);
        drop(v);
        let m = buf.view_mut(4096..).expect("an empty view at the end");
        assert!(m.is_empty());
        drop(m);
        assert!(buf.view_mut(0..4097).is_err(), "one byte past the end");
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = buf.view(8..4);
        assert!(backwards.is_err(), "a range that ends before it starts");
        assert!(buf.view(..).expect("whole").len() == 4096);
    }
}
