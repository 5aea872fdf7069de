//! One rank's collectives through NCCL or RCCL, written once for every GPU backend: the in-place layouts of
//! all-gather and reduce-scatter, the registered symmetric windows, which of the library's all-reduce paths can
//! run a call, the capture rule for registration, the collectives over validated arguments ([`CclBackend`]), the
//! barrier and the non-blocking query. The CUDA and ROCm backends each hold a [`CclRank`] and add only what is
//! vendor-specific (their runtime, streams, and custom kernels).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyccl_core::comm::{
    AllGatherArgs, AllReduceArgs, AllReduceCall, BroadcastArgs, CommBackend, RecvArgs, ReduceArgs, ReduceScatterArgs,
    SendArgs,
};
use anyccl_core::validate::InOutDesc;
use anyccl_core::{
    Algorithm, BufferDesc, Capabilities, CapabilityReport, DataType, Error, InOut, MemoryRuntime, ReduceOp, Result,
    Teardown,
};

use crate::{sys, AbortOutcome, CclComm, CclLibrary, CclReduction};

/// How long a failed wait waits for the library's abort before it returns and leaves the abort running in the
/// background: [`CclRank::wait_or_abort`] returns within its timeout plus this.
pub const ABORT_GRACE: Duration = Duration::from_secs(2);

/// Device memory a collective can take: its device address.
///
/// # Safety
/// `device_addr` returns the start of memory that holds at least the buffer's [`anyccl_core::runtime::BufferLike`] length
/// and stays allocated while the value is borrowed.
pub unsafe trait DeviceAddress {
    /// The start address on the device.
    fn device_addr(&self) -> u64;
}

/// A GPU backend's stream as the shared rank drives it.
pub trait CclStream {
    /// The handle the library takes (`cudaStream_t`, `hipStream_t`).
    fn ccl_handle(&self) -> sys::Stream;
    /// Whether the stream is being captured into a graph (a query that is legal during capture).
    fn is_capturing(&self) -> Result<bool>;
    /// Blocks until the stream's work is done.
    fn synchronize(&self) -> Result<()>;
    /// Whether the stream's work is done, without blocking; refused while the stream captures.
    fn query(&self) -> Result<bool>;
}

/// A backend whose collectives go through a [`CclRank`]: its buffers have device addresses, its streams are
/// [`CclStream`]s and its reductions [`CclReduction`]s. Implemented for every such backend.
pub trait CclBackend:
    CommBackend<Reduction = CclReduction, Runtime: MemoryRuntime<Buffer: DeviceAddress, Stream: CclStream>>
{
}

impl<B> CclBackend for B where
    B: CommBackend<Reduction = CclReduction, Runtime: MemoryRuntime<Buffer: DeviceAddress, Stream: CclStream>> + ?Sized
{
}

/// The (send, recv) pointers of an all-reduce, broadcast or reduce call.
pub fn io_ptrs<B: DeviceAddress + ?Sized>(bufs: &InOut<'_, B>) -> (*const c_void, *mut c_void) {
    match bufs {
        InOut::InPlace(b) => (b.device_addr() as *const c_void, b.device_addr() as *mut c_void),
        InOut::Separate { send, recv } => (send.device_addr() as *const c_void, recv.device_addr() as *mut c_void),
    }
}

/// The symmetric windows registered on one communicator, and a generation that changes with them.
#[derive(Default)]
struct Windows {
    /// (start, len) of each window.
    list: Mutex<Vec<(usize, usize)>>,
    /// Bumped on every registration and release, so a cached eligibility answer can tell it is stale.
    generation: AtomicU64,
}

impl Windows {
    fn list(&self) -> std::sync::MutexGuard<'_, Vec<(usize, usize)>> {
        // A panic while holding the lock left a plain Vec behind: still consistent.
        self.list.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn add(&self, start: usize, len: usize) {
        self.list().push((start, len));
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    fn remove(&self, start: usize) {
        self.list().retain(|(s, _)| *s != start);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }
}

/// Whether a communicator still lives, for the symmetric memory that may outlive it.
#[derive(Default)]
struct Life {
    /// Set when the rank is dropped or closed.
    gone: AtomicBool,
    /// The communicator's background destroy, when it was closed that way ([`CclRank::close_in_background_with`]).
    /// Set under this lock together with `gone`.
    closing: Mutex<Option<Teardown>>,
}

impl Life {
    fn closing(&self) -> std::sync::MutexGuard<'_, Option<Teardown>> {
        // Only ever holds an `Option`: consistent after a panic too.
        self.closing.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One rank of a NCCL/RCCL communicator, with its registered symmetric windows.
pub struct CclRank {
    ccl: CclComm,
    rank: usize,
    world: usize,
    /// Registered symmetric windows on this communicator.
    windows: Arc<Windows>,
    /// Shared with the symmetric memory that may outlive this rank.
    life: Arc<Life>,
}

impl Drop for CclRank {
    fn drop(&mut self) {
        // Runs before the communicator is destroyed: the library drops its windows with it, and deregistering
        // them afterwards would touch a freed communicator.
        self.life.gone.store(true, Ordering::SeqCst);
    }
}

impl CclRank {
    /// For a backend's non-blocking query whose stream still has work queued: `Ok(false)` while the communicator is
    /// healthy; the library's asynchronous error (a peer that died) as [`Error::PeerFailure`], without aborting
    /// (the backend's `wait` sees it again and aborts).
    pub fn still_running(&self) -> Result<bool> {
        self.ccl.async_error().map_err(|e| {
            Error::PeerFailure(format!(
                "rank {} of {}: the collective library reported an error while the work ran: {e}; call wait to abort \
                 the communicator",
                self.rank, self.world
            ))
        })?;
        Ok(false)
    }

    /// Waits until `done` (the backend's stream query: `Ok(true)` once the queued work has finished) says so,
    /// watching the library for asynchronous errors. When the library reports one, or `timeout` passes first (a
    /// peer died or never arrived), the communicator is aborted, which stops the library's kernels, and the error
    /// is returned; every later call fails with [`Error::PeerFailure`]. It returns within `timeout` plus
    /// [`ABORT_GRACE`], also when the abort itself blocks (the error then says so).
    /// `before_abort` runs first when it comes to that (the backend stops kernels of its own there).
    ///
    /// An error of `done` itself (the stream refused because it is being captured, a runtime error) is returned
    /// as it is: nothing is aborted and `before_abort` does not run. A backend that keeps state it selects by
    /// should change it only when this rank was aborted (`self.ccl().is_aborted()`), never on any error: every
    /// later call on an aborted rank fails, so its selection cannot differ from its peers' for a call that runs.
    pub fn wait_or_abort(
        &mut self,
        timeout: Duration,
        done: &mut dyn FnMut() -> Result<bool>,
        before_abort: &mut dyn FnMut(),
    ) -> Result<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(20);
        loop {
            if done()? {
                return Ok(());
            }
            if let Err(e) = self.ccl.async_error() {
                before_abort();
                let aborted = self.abort_for_wait();
                return Err(Error::PeerFailure(format!(
                    "rank {} of {}: the collective library reported an error while waiting: {e}; {aborted}",
                    self.rank, self.world
                )));
            }
            if start.elapsed() >= timeout {
                before_abort();
                let aborted = self.abort_for_wait();
                return Err(Error::Timeout {
                    what: format!(
                        "rank {} of {}: queued collectives to finish (a peer may have died or never called); {aborted}",
                        self.rank, self.world
                    ),
                    after: timeout,
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    fn abort_for_wait(&mut self) -> String {
        match self.ccl.abort_within(ABORT_GRACE) {
            AbortOutcome::Done(Ok(())) => "the communicator was aborted".into(),
            AbortOutcome::Done(Err(e)) => format!("aborting the communicator failed too: {e}"),
            AbortOutcome::StillRunning { after } => {
                tracing::error!(
                    "rank {} of {}: the communicator's abort had not returned after {after:?}; it goes on in the \
                     background",
                    self.rank,
                    self.world
                );
                format!(
                    "the communicator's abort had not returned after {after:?} and goes on in the background (it \
                     waits for work still queued on this device, such as a kernel waiting for the dead peer; exit \
                     the process to end it)"
                )
            }
        }
    }

    /// Wraps rank `rank` of `world`.
    pub fn new(ccl: CclComm, rank: usize, world: usize) -> Self {
        CclRank { ccl, rank, world, windows: Arc::default(), life: Arc::default() }
    }

    /// Destroys the communicator on a thread of its own, returning at once ([`CclComm::close_in_background`]).
    pub fn close_in_background(self) -> Teardown {
        self.close_in_background_with(())
    }

    /// Destroys the communicator on a thread of its own and drops `keep` there afterwards
    /// ([`CclComm::close_in_background_with`]), returning at once. Symmetric memory of this rank dropped while the
    /// destroy runs waits for it before it frees its memory.
    pub fn close_in_background_with<K: Send + 'static>(mut self, keep: K) -> Teardown {
        let life = self.life.clone();
        let mut closing = life.closing();
        life.gone.store(true, Ordering::SeqCst);
        let teardown = self.ccl.take().close_in_background_with(keep);
        *closing = Some(teardown.clone());
        drop(closing);
        // `self` drops here holding no communicator: nothing is destroyed twice.
        teardown
    }

    /// The communicator.
    pub fn ccl(&self) -> &CclComm {
        &self.ccl
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Allocates `bytes` with the library's allocator (`ncclMemAlloc`, rounded up to 4 KiB) and registers it as a
    /// symmetric window (`NCCL_WIN_COLL_SYMMETRIC`). Collective: every rank calls it with the same size.
    /// `capturing` is whether the caller's stream captures: allocation and registration are refused then.
    /// `bind` makes this rank's device current; it runs first here, and again before the memory is deregistered
    /// and freed on drop. `range` asks the device runtime for the allocation that contains an address (its base
    /// and size): what the library returned is used only once it is known to be real memory that spans the size.
    ///
    /// A size whose round-up exceeds [`anyccl_core::runtime::MAX_ALLOCATION`] is refused with
    /// [`anyccl_core::InvalidArgument::SizeTooLarge`] before any library call.
    pub fn symmetric_memory(
        &self,
        backend: &str,
        caps: &CapabilityReport,
        bytes: usize,
        capturing: bool,
        bind: Box<dyn Fn() -> Result<()> + Send>,
        range: &dyn Fn(u64) -> Result<(u64, usize)>,
    ) -> Result<SymmetricMemory> {
        caps.require(Capabilities::SYMMETRIC_WINDOWS)?;
        anyccl_core::capture::refuse_if("symmetric_buffer (ncclMemAlloc)", capturing)?;
        let size = anyccl_core::round_allocation("a symmetric buffer", bytes, 4096)?;
        bind()?;
        let lib = self.ccl.library().clone();
        let ptr = crate::mem_alloc(&lib, size)?;
        // A null address is refused by the check without asking the runtime about it.
        let range = if ptr.is_null() { Ok((0, 0)) } else { range(ptr as u64) };
        let checked = range.and_then(|r| anyccl_core::check_allocation(backend, "ncclMemAlloc", ptr as u64, size, r));
        if let Err(e) = checked {
            if !ptr.is_null() {
                // SAFETY: allocated just above by ncclMemAlloc, never used, freed once.
                if let Err(f) = unsafe { crate::mem_free(&lib, ptr) } {
                    tracing::warn!(error = %f, "freeing a symmetric buffer that failed its check failed");
                }
            }
            return Err(e);
        }
        // SAFETY: `ptr` is `size` bytes from ncclMemAlloc on this device, page aligned, freed only after the window.
        let window = match unsafe { self.ccl.window_register(ptr, size) } {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: allocated just above, freed once.
                if let Err(f) = unsafe { crate::mem_free(&lib, ptr) } {
                    tracing::warn!(error = %f, "freeing a symmetric buffer after a failed registration failed");
                }
                return Err(e);
            }
        };
        self.windows.add(ptr as usize, size);
        Ok(SymmetricMemory {
            ptr,
            size,
            window: Some(window),
            lib,
            comm: self.ccl.raw(),
            life: self.life.clone(),
            windows: self.windows.clone(),
            bind,
        })
    }

    /// Whether `[d.addr, +bytes)` lies inside one registered window.
    pub fn in_window(&self, d: &BufferDesc, bytes: usize) -> bool {
        self.windows.list().iter().any(|(s, l)| d.addr >= *s && d.addr.saturating_add(bytes) <= s + l)
    }

    /// Changes whenever a window is registered or released here, so an answer of [`Self::eligible`] about
    /// `ccl-symmetric` can be kept until it does.
    pub fn windows_generation(&self) -> u64 {
        self.windows.generation.load(Ordering::Acquire)
    }

    /// With one rank, avg is the identity, exactly like sum. NCCL 2.28.3 left the last element of out-of-place
    /// f64 avg all-reduce, reduce-scatter and reduce of 65537 elements unwritten at world 1 (seen on an H200), so
    /// anyccl asks for sum there.
    pub fn effective_op(&self, op: ReduceOp) -> ReduceOp {
        if self.world == 1 && op == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            op
        }
    }

    /// Whether the library's own paths can run `call`: `ccl` always, `ccl-symmetric` when windows are enabled and
    /// the buffers lie in registered windows. `None` for algorithms the library does not implement.
    pub fn eligible(
        &self,
        algorithm: Algorithm,
        call: &AllReduceCall,
        caps: &CapabilityReport,
        register_hint: &str,
    ) -> Option<std::result::Result<(), String>> {
        match algorithm {
            Algorithm::Ccl => Some(Ok(())),
            Algorithm::CclSymmetric => Some((|| {
                caps.require(Capabilities::SYMMETRIC_WINDOWS).map_err(|e| e.to_string())?;
                let in_windows = match &call.bufs {
                    None => false,
                    Some(InOutDesc::InPlace(b)) => self.in_window(b, call.bytes),
                    Some(InOutDesc::Separate { send, recv }) => {
                        self.in_window(send, call.bytes) && self.in_window(recv, call.bytes)
                    }
                };
                if in_windows {
                    Ok(())
                } else {
                    Err(format!("the buffers are not in a registered symmetric window (use {register_hint})"))
                }
            })()),
            _ => None,
        }
    }

    /// Maps `op` on `dtype` to the loaded library's codes once per call, refusing what it lacks (fp8 before it
    /// had fp8, avg on fp8, …); avg at world 1 is asked for as sum ([`Self::effective_op`]).
    pub fn check_reduction(&self, dtype: DataType, op: ReduceOp) -> Result<CclReduction> {
        // What the caller asked for is checked as asked, so avg on fp8 stays refused at world 1.
        let asked = CclReduction::new(self.ccl.library(), dtype, op)?;
        match self.effective_op(op) {
            same if same == op => Ok(asked),
            other => CclReduction::new(self.ccl.library(), dtype, other),
        }
    }

    /// All-reduce through the library (`ccl`, and `ccl-symmetric`: the library picks its symmetric kernels when
    /// the buffers lie in a registered window). Nothing is bound first: the backend makes its device current where
    /// its library needs it.
    ///
    /// # Safety
    /// `args` was made by the `Communicator` of the backend that holds this rank (validated against this rank:
    /// both buffers hold `count` elements of its device and do not overlap unless in place).
    pub unsafe fn all_reduce<B: CclBackend + ?Sized>(&self, args: AllReduceArgs<'_, B>) -> Result<()> {
        let (s, r) = io_ptrs(args.bufs());
        // SAFETY: the caller's contract; the stream is borrowed for the call, so live.
        unsafe { self.ccl.all_reduce(s, r, args.count(), args.reduction(), args.stream().ccl_handle()) }
    }

    /// All-gather; in place, the send part is this rank's slot of the output.
    ///
    /// # Safety
    /// `args` was made by the `Communicator` of the backend that holds this rank (the output holds world × count
    /// elements of its device).
    pub unsafe fn all_gather<B: CclBackend + ?Sized>(&self, args: AllGatherArgs<'_, B>) -> Result<()> {
        let (count, dtype) = (args.count(), args.dtype());
        let (s, r) = match args.bufs() {
            InOut::InPlace(b) => {
                let part = (self.rank * count * dtype.size_bytes()) as u64;
                ((b.device_addr() + part) as *const c_void, b.device_addr() as *mut c_void)
            }
            bufs @ InOut::Separate { .. } => io_ptrs(bufs),
        };
        // SAFETY: the caller's contract; in place, send is this rank's slot of recv.
        unsafe { self.ccl.all_gather(s, r, count, dtype, args.stream().ccl_handle()) }
    }

    /// Reduce-scatter; in place, the output is this rank's slot of the input.
    ///
    /// # Safety
    /// `args` was made by the `Communicator` of the backend that holds this rank (the input holds world × count
    /// elements of its device).
    pub unsafe fn reduce_scatter<B: CclBackend + ?Sized>(&self, args: ReduceScatterArgs<'_, B>) -> Result<()> {
        let (count, reduction) = (args.count(), args.reduction());
        let (s, r) = match args.bufs() {
            InOut::InPlace(b) => {
                let part = (self.rank * count * reduction.dtype().size_bytes()) as u64;
                (b.device_addr() as *const c_void, (b.device_addr() + part) as *mut c_void)
            }
            bufs @ InOut::Separate { .. } => io_ptrs(bufs),
        };
        // SAFETY: the caller's contract; in place, recv is this rank's slot of send.
        unsafe { self.ccl.reduce_scatter(s, r, count, reduction, args.stream().ccl_handle()) }
    }

    /// Broadcast from the root.
    ///
    /// # Safety
    /// `args` was made by the `Communicator` of the backend that holds this rank (sizes and root).
    pub unsafe fn broadcast<B: CclBackend + ?Sized>(&self, args: BroadcastArgs<'_, B>) -> Result<()> {
        let (s, r) = io_ptrs(args.bufs());
        let stream = args.stream().ccl_handle();
        // SAFETY: the caller's contract.
        unsafe { self.ccl.broadcast(s, r, args.count(), args.dtype(), args.root(), stream) }
    }

    /// Reduce to the root.
    ///
    /// # Safety
    /// `args` was made by the `Communicator` of the backend that holds this rank (sizes and root).
    pub unsafe fn reduce<B: CclBackend + ?Sized>(&self, args: ReduceArgs<'_, B>) -> Result<()> {
        let (s, r) = io_ptrs(args.bufs());
        let stream = args.stream().ccl_handle();
        // SAFETY: the caller's contract.
        unsafe { self.ccl.reduce(s, r, args.count(), args.reduction(), args.root(), stream) }
    }

    /// Send `count` elements to the peer.
    ///
    /// # Safety
    /// `args` was made by the `Communicator` of the backend that holds this rank (size and peer).
    pub unsafe fn send<B: CclBackend + ?Sized>(&self, args: SendArgs<'_, B>) -> Result<()> {
        let buf = args.buf().device_addr() as *const c_void;
        // SAFETY: the caller's contract.
        unsafe { self.ccl.send(buf, args.count(), args.dtype(), args.peer(), args.stream().ccl_handle()) }
    }

    /// Receive `count` elements from the peer.
    ///
    /// # Safety
    /// `args` was made by the `Communicator` of the backend that holds this rank (size and peer).
    pub unsafe fn recv<B: CclBackend + ?Sized>(&self, args: RecvArgs<'_, B>) -> Result<()> {
        let (count, dtype, peer, stream) = (args.count(), args.dtype(), args.peer(), args.stream().ccl_handle());
        let buf = args.into_buf().device_addr() as *mut c_void;
        // SAFETY: the caller's contract; the buffer was borrowed mutably for the call.
        unsafe { self.ccl.recv(buf, count, dtype, peer, stream) }
    }

    /// A barrier: an in-place all-reduce of one f32 in `scratch` (4 bytes of this rank's device, allocated up front
    /// so a barrier never allocates), then a wait for `stream`, unless it is being captured: inside a capture the
    /// all-reduce is the barrier, and synchronising would break the capture. Every rank has arrived when it
    /// returns (eagerly) or when the captured all-reduce completes.
    ///
    /// # Safety
    /// `scratch` holds at least 4 bytes of this rank's device memory; `stream` is a stream of this rank's device.
    pub unsafe fn barrier<B, S>(&self, scratch: &B, stream: &S) -> Result<()>
    where
        B: DeviceAddress + ?Sized,
        S: CclStream + ?Sized,
    {
        let p = scratch.device_addr() as *mut c_void;
        let reduction = CclReduction::new(self.ccl.library(), DataType::F32, ReduceOp::Sum)?;
        // SAFETY: the caller's contract; the stream is borrowed for the call, so live.
        unsafe { self.ccl.all_reduce(p, p, 1, reduction, stream.ccl_handle()) }?;
        if stream.is_capturing()? {
            return Ok(());
        }
        stream.synchronize()
    }

    /// A backend's non-blocking query: `Ok(true)` once `stream`'s queued work has finished; while it runs,
    /// [`Self::still_running`] (the library's asynchronous error, if any). The stream refuses the query while it
    /// captures, before the library is asked anything.
    pub fn query<S: CclStream + ?Sized>(&self, stream: &S) -> Result<bool> {
        if stream.query()? {
            return Ok(true);
        }
        self.still_running()
    }
}

/// Memory from `ncclMemAlloc`, registered as a symmetric window on its communicator. Deregistered (while the
/// communicator lives) and freed on drop, with its device made current first.
pub struct SymmetricMemory {
    ptr: *mut c_void,
    size: usize,
    window: Option<crate::Window>,
    lib: Arc<CclLibrary>,
    comm: sys::ncclComm_t,
    life: Arc<Life>,
    windows: Arc<Windows>,
    bind: Box<dyn Fn() -> Result<()> + Send>,
}

// SAFETY: device memory plus opaque library handles, usable from any thread; the communicator handle is only
// used to deregister, after checking it is alive.
unsafe impl Send for SymmetricMemory {}

impl SymmetricMemory {
    /// The device address.
    pub fn ptr(&self) -> *mut c_void {
        self.ptr
    }

    /// The allocated size (the requested size rounded up to 4 KiB).
    pub fn size(&self) -> usize {
        self.size
    }
}

impl Drop for SymmetricMemory {
    fn drop(&mut self) {
        // Deregistration and ncclMemFree act on the current device.
        if let Err(e) = (self.bind)() {
            tracing::warn!(error = %e, "binding the device to free a symmetric buffer failed");
        }
        self.windows.remove(self.ptr as usize);
        let comm_alive = !self.life.gone.load(Ordering::SeqCst);
        if !comm_alive {
            // Closed in the background: the library may still be destroying the communicator, and with it this
            // window. Free the memory only after that.
            let closing = self.life.closing().clone();
            if let Some(Err(e)) = closing.map(|t| t.wait()) {
                tracing::warn!(error = %e, "the communicator of a symmetric buffer failed to close");
            }
        }
        if let Some(w) = self.window.take().filter(|_| comm_alive) {
            if let Some(f) = self.lib.table().optional.comm_window_deregister {
                // SAFETY: the window was registered on this communicator, which is still alive (checked above; a
                // communicator is used from one thread at a time), and is deregistered once.
                let st = unsafe { f(self.comm, w.into_raw()) };
                if st != 0 {
                    tracing::warn!(status = st, "ncclCommWindowDeregister failed");
                }
            }
        }
        // SAFETY: allocated by ncclMemAlloc in `symmetric_memory`, freed once.
        if let Err(e) = unsafe { crate::mem_free(&self.lib, self.ptr) } {
            tracing::warn!(error = %e, size = self.size, "ncclMemFree failed");
        }
    }
}

/// A symmetric buffer as a backend's collectives take it: a view of type `B` (the backend's device buffer) over
/// [`SymmetricMemory`]. All-reduce on it can run the library's symmetric kernels, zero-copy. Deregistered and freed
/// on drop (never during capture: it is created outside one).
pub struct SymmetricBuffer<B> {
    // Declared first, so it drops first: a view that owns nothing, of the memory below.
    view: B,
    _mem: SymmetricMemory,
}

impl<B> SymmetricBuffer<B> {
    /// Pairs `mem` with `view`, which must be a non-owning view of exactly that memory.
    pub fn new(view: B, mem: SymmetricMemory) -> Self {
        SymmetricBuffer { view, _mem: mem }
    }

    /// The buffer as the collectives take it.
    pub fn buffer(&self) -> &B {
        &self.view
    }

    /// The buffer, mutably.
    pub fn buffer_mut(&mut self) -> &mut B {
        &mut self.view
    }
}

/// One operation of a grouped point-to-point call, as the library takes it.
struct GroupOp {
    recv: bool,
    ptr: u64,
    count: usize,
    dtype: DataType,
    peer: usize,
}

impl GroupOp {
    /// `"send of 16 × f32 to rank 2"`.
    fn describe(&self) -> String {
        let (kind, dir) = if self.recv { ("receive", "from") } else { ("send", "to") };
        format!("{kind} of {} × {} {dir} rank {}", self.count, self.dtype, self.peer)
    }
}

/// `e`, saying which operation `i` of a group of `n` it is the error of.
fn in_group(e: Error, i: usize, n: usize, op: &GroupOp) -> Error {
    let what = format!("operation {i} of {n} in a group: {}", op.describe());
    match e {
        Error::Backend { backend, call, code, message } => {
            Error::Backend { backend, call: format!("{call} ({what})"), code, message }
        }
        Error::PeerFailure(m) => Error::PeerFailure(format!("{what}: {m}")),
        other => other,
    }
}

impl CclRank {
    /// A grouped point-to-point call: `ncclGroupStart`, one `ncclSend`/`ncclRecv` per operation in the caller's
    /// order, `ncclGroupEnd`, so that the library runs them as one and a rank may list a receive before the send
    /// its peer waits for. Every element type is mapped before the group opens; `ncclGroupEnd` is called whatever
    /// happens once it is open, and an operation the library refuses is returned as the error, naming it (its
    /// index, kind, size and peer).
    ///
    /// # Safety
    /// `args` was made by the `Communicator` of the backend that holds this rank (every buffer holds its
    /// operation's elements on this rank's device; receive buffers overlap nothing else of the group).
    pub unsafe fn p2p<B: CclBackend + ?Sized>(&self, mut args: anyccl_core::comm::P2pArgs<'_, '_, B>) -> Result<()> {
        use anyccl_core::comm::P2pItem;
        let stream = args.stream().ccl_handle();
        let mut ops = Vec::new();
        ops.try_reserve_exact(args.len())
            .map_err(|_| Error::OutOfMemory { what: "a point-to-point group".into(), bytes: args.len() as u64 })?;
        for item in args.items() {
            ops.push(match item {
                P2pItem::Send(s) => GroupOp {
                    recv: false,
                    ptr: s.buf().device_addr(),
                    count: s.count(),
                    dtype: s.dtype(),
                    peer: s.peer(),
                },
                P2pItem::Recv(r) => {
                    let (count, dtype, peer) = (r.count(), r.dtype(), r.peer());
                    GroupOp { recv: true, ptr: r.into_buf().device_addr(), count, dtype, peer }
                }
            });
        }
        let lib = self.ccl.library();
        for op in &ops {
            crate::nccl_dtype(lib, op.dtype)?;
        }
        let n = ops.len();
        crate::group_start(lib)?;
        let mut failed = None;
        for (i, op) in ops.iter().enumerate() {
            // SAFETY: the caller's contract: each buffer holds `count` elements of this device for the group.
            let r = unsafe {
                if op.recv {
                    self.ccl.recv(op.ptr as *mut c_void, op.count, op.dtype, op.peer, stream)
                } else {
                    self.ccl.send(op.ptr as *const c_void, op.count, op.dtype, op.peer, stream)
                }
            };
            if let Err(e) = r {
                failed = Some(in_group(e, i, n, op));
                break;
            }
        }
        let ended = crate::group_end(lib);
        match (failed, ended) {
            (Some(e), ended) => {
                if let Err(end) = ended {
                    tracing::warn!(error = %end, "ncclGroupEnd after a failed operation of the group failed too");
                }
                Err(e)
            }
            (None, Err(Error::Backend { backend, call, code, message })) => Err(Error::Backend {
                backend,
                call: format!("{call} (a group of {n} sends and receives)"),
                code,
                message,
            }),
            (None, ended) => ended,
        }
    }

    /// A sub-communicator over `ncclCommSplit` ([`CclComm::split`]): the ranks with the same `color` form a new
    /// communicator, ranked by `(key, rank here)`; `None` for a rank that passes no color. Collective over this
    /// communicator. Refused with [`Error::Unsupported`] and the reason (`ncclCommSplit` missing from the loaded
    /// release, NCCL < 2.18, or turned off) where `caps` has [`Capabilities::COMM_SPLIT`] off, before the library
    /// is asked. The new rank has no symmetric windows; its rank and world are the library's answer.
    pub fn split(&self, caps: &CapabilityReport, color: Option<u32>, key: u32) -> Result<Option<CclRank>> {
        caps.require(Capabilities::COMM_SPLIT)?;
        let Some(comm) = self.ccl.split(color, key)? else { return Ok(None) };
        let (rank, world) = (comm.user_rank()?, comm.count()?);
        if world == 0 || rank >= world {
            return Err(Error::backend(
                crate::backend_name(comm.library()),
                "ncclCommSplit",
                None,
                format!("made a communicator that reports rank {rank} of {world}"),
            ));
        }
        tracing::debug!(parent_rank = self.rank, parent_world = self.world, rank, world, ?color, key, "split");
        Ok(Some(CclRank::new(comm, rank, world)))
    }
}
