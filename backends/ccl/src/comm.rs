//! [`CclComm`]: one rank of a NCCL/RCCL communicator, the one type a GPU backend holds. Written once for every GPU
//! backend: the communicator's life (RAII destroy, abort, background close, borrowed handles), the in-place
//! layouts of all-gather and reduce-scatter, the registered symmetric windows, which of the library's all-reduce
//! paths can run a call, the capture rule for registration, the collectives over validated arguments
//! ([`CclBackend`]), the barrier, the non-blocking query and the wait that aborts. Every library call goes
//! through [`crate::result`]; the CUDA and ROCm backends add only what is vendor-specific (their runtime, streams,
//! and custom kernels).

use std::ffi::{c_int, c_void};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyccl_core::comm::{
    AllGatherArgs, AllReduceArgs, AllReduceCall, BroadcastArgs, CommBackend, RecvArgs, ReduceArgs, ReduceScatterArgs,
    SendArgs,
};
use anyccl_core::validate::InOutDesc;
use anyccl_core::{
    Algorithm, BufferDesc, Capabilities, CapabilityReport, DataType, Error, InOut, InvalidArgument, MemoryRuntime,
    ReduceOp, Result, Teardown,
};

use crate::result::{self, backend_name};
use crate::symmetric::{Life, SymmetricMemory, Windows};
use crate::{sys, CclLibrary, CclReduction, UniqueId};

/// How long a failed wait waits for the library's abort before it returns and leaves the abort running in the
/// background: [`CclComm::wait_or_abort`] returns within its timeout plus this.
pub const ABORT_GRACE: Duration = Duration::from_secs(2);

/// How long a normal process exit waits for communicators still being destroyed in the background
/// ([`CclComm::close_in_background`]) before it goes on.
pub const EXIT_WAIT_LIMIT: Duration = Duration::from_secs(10);

/// Device memory a collective can take: its device address.
///
/// # Safety
/// `device_addr` returns the start of memory that holds at least the buffer's [`anyccl_core::runtime::BufferLike`]
/// length and stays allocated while the value is borrowed.
pub unsafe trait DeviceAddress {
    /// The start address on the device.
    fn device_addr(&self) -> u64;
}

/// A GPU backend's stream as the communicator drives it.
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

/// A backend whose collectives go through a [`CclComm`]: its buffers have device addresses, its streams are
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

/// What became of [`CclComm::abort_within`].
///
/// Not `#[non_exhaustive]`: the abort returned within the wait or it did not; there is no third outcome.
#[derive(Debug)]
pub enum AbortOutcome {
    /// The library's abort returned, with its status.
    Done(Result<()>),
    /// The abort had not returned after `after` and goes on in the background.
    StillRunning {
        /// How long the caller waited for it.
        after: Duration,
    },
}

/// One rank of a NCCL/RCCL communicator: the handle (kept loaded with its library, an `Arc`, and destroyed on
/// drop unless borrowed: [`CclComm::from_raw_borrowed`]), its rank and world, and its registered symmetric
/// windows.
pub struct CclComm {
    lib: Arc<CclLibrary>,
    /// Null once aborted, destroyed or handed to a background teardown.
    comm: sys::ncclComm_t,
    /// Made by [`CclComm::from_raw_borrowed`]: someone else owns the communicator's life, so neither drop nor
    /// destroy nor abort ever reaches the library.
    borrowed: bool,
    rank: usize,
    world: usize,
    /// Registered symmetric windows on this communicator.
    windows: Arc<Windows>,
    /// Shared with the symmetric memory that may outlive this communicator.
    life: Arc<Life>,
}

// SAFETY: an ncclComm_t may be used from any thread as long as calls on one communicator are not concurrent;
// `CclComm` is not `Sync`, and its calls that change the handle take `&mut self` or `self`.
unsafe impl Send for CclComm {}

impl CclComm {
    fn wrap(lib: Arc<CclLibrary>, comm: sys::ncclComm_t, borrowed: bool, rank: usize, world: usize) -> Self {
        CclComm { lib, comm, borrowed, rank, world, windows: Arc::default(), life: Arc::default() }
    }

    /// `ncclCommInitRank`: joins the communicator `id` as `rank` of `world`.
    pub fn init_rank(lib: Arc<CclLibrary>, world: usize, id: &UniqueId, rank: usize) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(InvalidArgument::RankOutOfRange { what: "own", rank, world }.into());
        }
        let n = c_int::try_from(world).map_err(|_| InvalidArgument::BadWorld(format!("world {world} too large")))?;
        let r = c_int::try_from(rank).map_err(|_| InvalidArgument::BadWorld(format!("rank {rank} too large")))?;
        let comm = result::comm_init_rank(&lib, n, id.raw(), r)?;
        Ok(Self::wrap(lib, comm, false, rank, world))
    }

    /// `ncclCommInitAll`: one communicator per device of this process (index = rank).
    pub fn init_all(lib: &Arc<CclLibrary>, devices: &[i32]) -> Result<Vec<CclComm>> {
        let comms = result::comm_init_all(lib, devices)?;
        let world = comms.len();
        Ok(comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| Self::wrap(lib.clone(), comm, false, rank, world))
            .collect())
    }

    /// Wraps a communicator that someone else created and will destroy (the caller of the drop-in `libnccl`),
    /// asking the library for its rank and world: every call of this type works on it, but dropping the value,
    /// [`CclComm::destroy`] and [`CclComm::close_in_background`] only forget the handle, and
    /// [`CclComm::abort_in_place`] / [`CclComm::abort_within`] forget it and return an error (its owner aborts it).
    /// Every later call through this value then fails as on an aborted communicator.
    ///
    /// # Safety
    /// `comm` is a live communicator of `lib` (created through the same loaded library), and stays live for as long
    /// as the returned value (and anything made from it) is used: its owner destroys or aborts it only after
    /// dropping this value. Calls through this value and the owner's own calls on the communicator are not
    /// concurrent (NCCL's rule for one communicator).
    pub unsafe fn from_raw_borrowed(lib: Arc<CclLibrary>, comm: sys::ncclComm_t) -> Result<Self> {
        // The value forgets the handle whatever happens below: it is borrowed.
        let mut c = Self::wrap(lib, comm, true, 0, 0);
        let world = c.count()?;
        let rank = c.user_rank()?;
        if world == 0 || rank >= world {
            return Err(Error::backend(
                backend_name(&c.lib),
                "ncclCommUserRank",
                None,
                format!("the communicator reports rank {rank} of {world}"),
            ));
        }
        (c.rank, c.world) = (rank, world);
        Ok(c)
    }

    /// Whether the value was made by [`CclComm::from_raw_borrowed`] (it never destroys the communicator).
    pub fn is_borrowed(&self) -> bool {
        self.borrowed
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The library this communicator uses.
    pub fn library(&self) -> &Arc<CclLibrary> {
        &self.lib
    }

    /// The raw `ncclComm_t` (null once aborted): see [`Self::handle`].
    pub fn raw(&self) -> sys::ncclComm_t {
        self.comm
    }

    /// The raw `ncclComm_t` for a [`crate::result`] call this type does not make, or [`Error::PeerFailure`] once
    /// [`Self::abort_in_place`] has torn it down. The handle stays live while `self` is borrowed and not aborted.
    pub fn handle(&self) -> Result<sys::ncclComm_t> {
        if self.comm.is_null() {
            return Err(Error::PeerFailure(format!(
                "this {} communicator was aborted after a peer failed or a wait timed out; create a new one",
                backend_name(&self.lib)
            )));
        }
        Ok(self.comm)
    }

    /// Whether [`Self::abort_in_place`] has torn this communicator down.
    pub fn is_aborted(&self) -> bool {
        self.comm.is_null()
    }

    /// `ncclCommCount`: the library's answer (the world the communicator was made with).
    pub fn count(&self) -> Result<usize> {
        // SAFETY: a live communicator of this library.
        unsafe { result::comm_count(&self.lib, self.handle()?) }
    }

    /// `ncclCommUserRank`: the library's answer (the rank the communicator was made with).
    pub fn user_rank(&self) -> Result<usize> {
        // SAFETY: a live communicator of this library.
        unsafe { result::comm_user_rank(&self.lib, self.handle()?) }
    }

    /// `ncclCommGetAsyncError`: `Ok` while the communicator is healthy.
    pub fn async_error(&self) -> Result<()> {
        // SAFETY: a live communicator of this library.
        unsafe { result::comm_get_async_error(&self.lib, self.handle()?) }
    }

    /// Forgets a borrowed handle instead of aborting it: `Err` saying so.
    fn refuse_borrowed_abort(&mut self) -> Result<()> {
        self.comm = std::ptr::null_mut();
        Err(Error::backend(
            backend_name(&self.lib),
            "ncclCommAbort",
            None,
            "the communicator is borrowed (its owner aborts or destroys it); this handle was forgotten instead",
        ))
    }

    /// Marks the communicator gone for the symmetric memory that may outlive it: from now on nothing deregisters
    /// a window on it.
    fn mark_gone(&self) {
        self.life.gone.store(true, Ordering::SeqCst);
    }

    /// `ncclCommAbort`: tears the communicator down without waiting for peers (after a peer failed).
    pub fn abort(mut self) -> Result<()> {
        self.abort_in_place()
    }

    /// `ncclCommAbort`, keeping the value: the library stops its kernels and frees the communicator without
    /// waiting for peers; every later call returns [`Error::PeerFailure`]. Aborting twice does nothing.
    pub fn abort_in_place(&mut self) -> Result<()> {
        if self.comm.is_null() {
            return Ok(());
        }
        // The library frees the windows with the communicator.
        self.mark_gone();
        if self.borrowed {
            return self.refuse_borrowed_abort();
        }
        let comm = std::mem::replace(&mut self.comm, std::ptr::null_mut());
        // SAFETY: `comm` was live and is aborted exactly once (the field is null from now on).
        unsafe { result::comm_abort(&self.lib, comm) }
    }

    /// `ncclCommAbort` on a thread of its own, keeping the value, waiting at most `grace` for it. Every later call
    /// returns [`Error::PeerFailure`] at once, whatever the abort does. The library's abort can block for as long
    /// as work is still queued on the device (it frees device memory, which waits for the device), and a kernel
    /// that waits for a dead peer never finishes: then this returns [`AbortOutcome::StillRunning`] after `grace`
    /// and the abort goes on in the background until it finishes or the process exits. Aborting twice does
    /// nothing.
    pub fn abort_within(&mut self, grace: Duration) -> AbortOutcome {
        if self.comm.is_null() {
            return AbortOutcome::Done(Ok(()));
        }
        self.mark_gone();
        if self.borrowed {
            return AbortOutcome::Done(self.refuse_borrowed_abort());
        }
        /// The handle moving to the aborting thread.
        struct Handle(sys::ncclComm_t);
        // SAFETY: the handle moves to the aborting thread and nothing else uses it: `self.comm` is null from now
        // on, so neither later calls nor Drop touch it.
        unsafe impl Send for Handle {}
        let handle = Handle(std::mem::replace(&mut self.comm, std::ptr::null_mut()));
        let lib = self.lib.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new().name("anyccl-ccl-abort".into()).spawn(move || {
            // A whole-value move: the closure then captures `Handle` (Send), not its raw field.
            let handle = handle;
            // SAFETY: the handle was live and is aborted exactly once, here.
            let r = unsafe { result::comm_abort(&lib, handle.0) };
            // The receiver may have stopped waiting (StillRunning); then nobody needs the result.
            let _ = tx.send(r);
        });
        if let Err(e) = spawned {
            // The closure, and the handle with it, is gone without an abort: the communicator is leaked.
            return AbortOutcome::Done(Err(Error::backend(
                backend_name(&self.lib),
                "ncclCommAbort",
                None,
                format!("could not start a thread to abort the communicator ({e}); it is leaked"),
            )));
        }
        match rx.recv_timeout(grace) {
            Ok(r) => AbortOutcome::Done(r),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => AbortOutcome::StillRunning { after: grace },
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => AbortOutcome::Done(Err(Error::backend(
                backend_name(&self.lib),
                "ncclCommAbort",
                None,
                "the aborting thread ended without a result",
            ))),
        }
    }

    /// `ncclCommDestroy` here and now, with its status (dropping the value does the same and logs a failure).
    /// An aborted communicator has nothing left to destroy: `Ok`.
    pub fn destroy(mut self) -> Result<()> {
        self.destroy_in_place()
    }

    fn destroy_in_place(&mut self) -> Result<()> {
        // Before the library destroys the communicator, and its windows with it: deregistering them afterwards
        // would touch a freed communicator.
        self.mark_gone();
        if self.comm.is_null() {
            // Aborted (or destroyed): the library has freed it already.
            return Ok(());
        }
        let comm = std::mem::replace(&mut self.comm, std::ptr::null_mut());
        if self.borrowed {
            // Its owner destroys it.
            return Ok(());
        }
        // SAFETY: `comm` was live and is destroyed exactly once (the field is null from now on).
        unsafe { result::comm_destroy(&self.lib, comm) }
    }

    /// `ncclCommDestroy` on a thread of its own (named `anyccl-ccl-destroy`), returning at once: NCCL's destroy
    /// took about 500 ms on an H200 (world 1, NCCL 2.28.3). The [`Teardown`] reports when it has returned, and its
    /// status. See [`CclComm::close_in_background_with`].
    pub fn close_in_background(self) -> Teardown {
        self.close_in_background_with(())
    }

    /// [`CclComm::close_in_background`], and then `keep` is dropped on the same thread, after the destroy: what a
    /// backend tears down after the communicator, as its plain drop does (device buffers, the device context).
    /// Symmetric memory of this communicator dropped while the destroy runs waits for it before it frees its
    /// memory.
    ///
    /// The thread holds the library (an `Arc` of it), so it stays loaded until the destroy has returned. At a
    /// normal process exit, the exit handler this registers (once per process) waits up to
    /// [`EXIT_WAIT_LIMIT`] for every destroy still running, so the vendor libraries' own exit handlers do not run
    /// under it; after a crash, a kill or that limit, the operating system reclaims what is left with the process.
    /// An aborted communicator has nothing to destroy: the teardown has finished on return (after dropping
    /// `keep`).
    pub fn close_in_background_with<K: Send + 'static>(self, keep: K) -> Teardown {
        let life = self.life.clone();
        let mut closing = life.closing();
        self.mark_gone();
        let teardown = if self.comm.is_null() {
            drop(self);
            drop(keep);
            Teardown::finished(Ok(()))
        } else {
            wait_for_destroys_at_exit();
            // The closure owns the communicator: even unrun, dropping it would destroy it, never leak it.
            Teardown::spawn("anyccl-ccl-destroy", move || {
                let r = self.destroy();
                drop(keep);
                if let Err(e) = &r {
                    tracing::warn!(error = %e, "destroying a communicator in the background failed");
                }
                r
            })
        };
        *closing = Some(teardown.clone());
        teardown
    }

    /// For a backend's non-blocking query whose stream still has work queued: `Ok(false)` while the communicator is
    /// healthy; the library's asynchronous error (a peer that died) as [`Error::PeerFailure`], without aborting
    /// (the backend's `wait` sees it again and aborts).
    pub fn still_running(&self) -> Result<bool> {
        self.async_error().map_err(|e| {
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
    /// should change it only when this communicator was aborted ([`Self::is_aborted`]), never on any error: every
    /// later call on an aborted communicator fails, so its selection cannot differ from its peers' for a call that
    /// runs.
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
            if let Err(e) = self.async_error() {
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
        match self.abort_within(ABORT_GRACE) {
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
        let lib = &self.lib;
        let ptr = result::mem_alloc(lib, size)?;
        // A null address is refused by the check without asking the runtime about it.
        let range = if ptr.is_null() { Ok((0, 0)) } else { range(ptr as u64) };
        let checked = range.and_then(|r| anyccl_core::check_allocation(backend, "ncclMemAlloc", ptr as u64, size, r));
        let registered = checked.and_then(|()| {
            let comm = self.handle()?;
            // SAFETY: a live communicator of this library; `ptr` is `size` bytes from ncclMemAlloc on this device
            // (checked above), page aligned, freed only after the window.
            unsafe { result::comm_window_register(lib, comm, ptr, size, sys::NCCL_WIN_COLL_SYMMETRIC) }
        });
        let window = match registered {
            Ok(w) => w,
            Err(e) => {
                if !ptr.is_null() {
                    // SAFETY: allocated just above by ncclMemAlloc, not registered, freed once.
                    if let Err(f) = unsafe { result::mem_free(lib, ptr) } {
                        tracing::warn!(error = %f, "freeing an unregistered symmetric buffer failed");
                    }
                }
                return Err(e);
            }
        };
        self.windows.add(ptr as usize, size);
        Ok(SymmetricMemory::new(
            ptr,
            size,
            window,
            lib.clone(),
            self.comm,
            self.life.clone(),
            self.windows.clone(),
            bind,
        ))
    }

    /// Whether `[d.addr, +bytes)` lies inside one registered window.
    pub fn in_window(&self, d: &BufferDesc, bytes: usize) -> bool {
        self.windows.contains(d.addr, bytes)
    }

    /// Changes whenever a window is registered or released here, so an answer of [`Self::eligible`] about
    /// `ccl-symmetric` can be kept until it does.
    pub fn windows_generation(&self) -> u64 {
        self.windows.generation()
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
        let asked = CclReduction::new(&self.lib, dtype, op)?;
        match self.effective_op(op) {
            same if same == op => Ok(asked),
            other => CclReduction::new(&self.lib, dtype, other),
        }
    }

    /// `root` or `peer` as the library's `int` (validated arguments always fit: the world does).
    fn c_rank(what: &str, r: usize) -> Result<c_int> {
        c_int::try_from(r).map_err(|_| InvalidArgument::BadWorld(format!("{what} {r}")).into())
    }

    /// All-reduce through the library (`ccl`, and `ccl-symmetric`: the library picks its symmetric kernels when
    /// the buffers lie in a registered window). Nothing is bound first: the backend makes its device current where
    /// its library needs it.
    ///
    /// # Safety
    /// `args` was made by the `Communicator` of the backend that holds this communicator (validated against this
    /// rank: both buffers hold `count` elements of its device and do not overlap unless in place).
    pub unsafe fn all_reduce<B: CclBackend + ?Sized>(&self, args: AllReduceArgs<'_, B>) -> Result<()> {
        let (s, r) = io_ptrs(args.bufs());
        let (d, o) = args.reduction().codes(&self.lib)?;
        let (count, stream) = (args.count(), args.stream().ccl_handle());
        // SAFETY: the caller's contract; the stream is borrowed for the call, so live; the handle is live.
        unsafe { result::all_reduce(&self.lib, s, r, count, d, o, self.handle()?, stream) }
    }

    /// All-gather; in place, the send part is this rank's slot of the output.
    ///
    /// # Safety
    /// `args` was made by the `Communicator` of the backend that holds this communicator (the output holds world ×
    /// count elements of its device).
    pub unsafe fn all_gather<B: CclBackend + ?Sized>(&self, args: AllGatherArgs<'_, B>) -> Result<()> {
        let (count, dtype) = (args.count(), args.dtype());
        let (s, r) = match args.bufs() {
            InOut::InPlace(b) => {
                let part = (self.rank * count * dtype.size_bytes()) as u64;
                ((b.device_addr() + part) as *const c_void, b.device_addr() as *mut c_void)
            }
            bufs @ InOut::Separate { .. } => io_ptrs(bufs),
        };
        let d = crate::nccl_dtype(&self.lib, dtype)?;
        // SAFETY: the caller's contract; in place, send is this rank's slot of recv.
        unsafe { result::all_gather(&self.lib, s, r, count, d, self.handle()?, args.stream().ccl_handle()) }
    }

    /// Reduce-scatter; in place, the output is this rank's slot of the input.
    ///
    /// # Safety
    /// `args` was made by the `Communicator` of the backend that holds this communicator (the input holds world ×
    /// count elements of its device).
    pub unsafe fn reduce_scatter<B: CclBackend + ?Sized>(&self, args: ReduceScatterArgs<'_, B>) -> Result<()> {
        let (count, reduction) = (args.count(), args.reduction());
        let (s, r) = match args.bufs() {
            InOut::InPlace(b) => {
                let part = (self.rank * count * reduction.dtype().size_bytes()) as u64;
                (b.device_addr() as *const c_void, (b.device_addr() + part) as *mut c_void)
            }
            bufs @ InOut::Separate { .. } => io_ptrs(bufs),
        };
        let (d, o) = reduction.codes(&self.lib)?;
        let stream = args.stream().ccl_handle();
        // SAFETY: the caller's contract; in place, recv is this rank's slot of send.
        unsafe { result::reduce_scatter(&self.lib, s, r, count, d, o, self.handle()?, stream) }
    }

    /// Broadcast from the root.
    ///
    /// # Safety
    /// `args` was made by the `Communicator` of the backend that holds this communicator (sizes and root).
    pub unsafe fn broadcast<B: CclBackend + ?Sized>(&self, args: BroadcastArgs<'_, B>) -> Result<()> {
        let (s, r) = io_ptrs(args.bufs());
        let stream = args.stream().ccl_handle();
        let d = crate::nccl_dtype(&self.lib, args.dtype())?;
        let root = Self::c_rank("root", args.root())?;
        // SAFETY: the caller's contract.
        unsafe { result::broadcast(&self.lib, s, r, args.count(), d, root, self.handle()?, stream) }
    }

    /// Reduce to the root.
    ///
    /// # Safety
    /// `args` was made by the `Communicator` of the backend that holds this communicator (sizes and root).
    pub unsafe fn reduce<B: CclBackend + ?Sized>(&self, args: ReduceArgs<'_, B>) -> Result<()> {
        let (s, r) = io_ptrs(args.bufs());
        let stream = args.stream().ccl_handle();
        let (d, o) = args.reduction().codes(&self.lib)?;
        let root = Self::c_rank("root", args.root())?;
        // SAFETY: the caller's contract.
        unsafe { result::reduce(&self.lib, s, r, args.count(), d, o, root, self.handle()?, stream) }
    }

    /// Send `count` elements to the peer.
    ///
    /// # Safety
    /// `args` was made by the `Communicator` of the backend that holds this communicator (size and peer).
    pub unsafe fn send<B: CclBackend + ?Sized>(&self, args: SendArgs<'_, B>) -> Result<()> {
        let ptr = args.buf().device_addr();
        let op = GroupOp { recv: false, ptr, count: args.count(), dtype: args.dtype(), peer: args.peer() };
        // SAFETY: the caller's contract.
        unsafe { self.point_to_point(&op, args.stream().ccl_handle()) }
    }

    /// Receive `count` elements from the peer.
    ///
    /// # Safety
    /// `args` was made by the `Communicator` of the backend that holds this communicator (size and peer).
    pub unsafe fn recv<B: CclBackend + ?Sized>(&self, args: RecvArgs<'_, B>) -> Result<()> {
        let (count, dtype, peer, stream) = (args.count(), args.dtype(), args.peer(), args.stream().ccl_handle());
        let op = GroupOp { recv: true, ptr: args.into_buf().device_addr(), count, dtype, peer };
        // SAFETY: the caller's contract; the buffer was borrowed mutably for the call.
        unsafe { self.point_to_point(&op, stream) }
    }

    /// One `ncclSend` or `ncclRecv` of `op`.
    ///
    /// # Safety
    /// `op.ptr` holds `op.count` elements of this rank's device (a receive writes them); `stream` is live.
    unsafe fn point_to_point(&self, op: &GroupOp, stream: sys::Stream) -> Result<()> {
        let d = crate::nccl_dtype(&self.lib, op.dtype)?;
        let peer = Self::c_rank("peer", op.peer)?;
        let comm = self.handle()?;
        let buf = op.ptr as *mut c_void;
        // SAFETY: the caller's contract; `comm` is live.
        unsafe {
            if op.recv {
                result::recv(&self.lib, buf, op.count, d, peer, comm, stream)
            } else {
                result::send(&self.lib, buf, op.count, d, peer, comm, stream)
            }
        }
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
        let (d, o) = CclReduction::new(&self.lib, DataType::F32, ReduceOp::Sum)?.codes(&self.lib)?;
        // SAFETY: the caller's contract; the stream is borrowed for the call, so live.
        unsafe { result::all_reduce(&self.lib, p, p, 1, d, o, self.handle()?, stream.ccl_handle()) }?;
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

    /// A grouped point-to-point call: `ncclGroupStart`, one `ncclSend`/`ncclRecv` per operation in the caller's
    /// order, `ncclGroupEnd`, so that the library runs them as one and a rank may list a receive before the send
    /// its peer waits for. Every element type is mapped before the group opens; `ncclGroupEnd` is called whatever
    /// happens once it is open, and an operation the library refuses is returned as the error, naming it (its
    /// index, kind, size and peer).
    ///
    /// # Safety
    /// `args` was made by the `Communicator` of the backend that holds this communicator (every buffer holds its
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
        let lib = &self.lib;
        for op in &ops {
            crate::nccl_dtype(lib, op.dtype)?;
        }
        let n = ops.len();
        result::group_start(lib)?;
        let mut failed = None;
        for (i, op) in ops.iter().enumerate() {
            // SAFETY: the caller's contract: each buffer holds `count` elements of this device for the group.
            if let Err(e) = unsafe { self.point_to_point(op, stream) } {
                failed = Some(in_group(e, i, n, op));
                break;
            }
        }
        let ended = result::group_end(lib);
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

    /// A sub-communicator over `ncclCommSplit`: the ranks with the same `color` form a new communicator, ranked by
    /// `(key, rank here)`; `None` for a rank that passes no color (`NCCL_SPLIT_NOCOLOR`). Collective over this
    /// communicator; blocking (the default configuration). Refused with [`Error::Unsupported`] and the reason
    /// (`ncclCommSplit` missing from the loaded release, NCCL < 2.18, or turned off) where `caps` has
    /// [`Capabilities::COMM_SPLIT`] off, before the library is asked. `color` and `key` must fit a non-negative
    /// `int`. The new communicator has no symmetric windows; its rank and world are the library's answer.
    pub fn split(&self, caps: &CapabilityReport, color: Option<u32>, key: u32) -> Result<Option<CclComm>> {
        caps.require(Capabilities::COMM_SPLIT)?;
        let max = i32::MAX as u64;
        let c = match color {
            None => sys::NCCL_SPLIT_NOCOLOR,
            Some(c) => c_int::try_from(c).map_err(|_| InvalidArgument::OutOfRange {
                what: "split color",
                value: c.into(),
                min: 0,
                max,
            })?,
        };
        let k = c_int::try_from(key).map_err(|_| InvalidArgument::OutOfRange {
            what: "split key",
            value: key.into(),
            min: 0,
            max,
        })?;
        // SAFETY: a live communicator of this library.
        let new = unsafe { result::comm_split(&self.lib, self.handle()?, c, k) }?;
        // Owned from here (destroyed on drop); rank and world are asked below.
        let owned = |comm| Self::wrap(self.lib.clone(), comm, false, 0, 0);
        let mut comm = match (color, new.is_null()) {
            (Some(_), false) => owned(new),
            (None, true) => return Ok(None),
            (Some(c), true) => {
                return Err(Error::backend(
                    backend_name(&self.lib),
                    "ncclCommSplit",
                    None,
                    format!("returned success but no communicator for color {c}"),
                ))
            }
            (None, false) => {
                // Not what NCCL documents; own the handle so it is destroyed, not leaked.
                drop(owned(new));
                return Ok(None);
            }
        };
        let (rank, world) = (comm.user_rank()?, comm.count()?);
        if world == 0 || rank >= world {
            return Err(Error::backend(
                backend_name(&self.lib),
                "ncclCommSplit",
                None,
                format!("made a communicator that reports rank {rank} of {world}"),
            ));
        }
        tracing::debug!(parent_rank = self.rank, parent_world = self.world, rank, world, ?color, key, "split");
        (comm.rank, comm.world) = (rank, world);
        Ok(Some(comm))
    }
}

impl Drop for CclComm {
    fn drop(&mut self) {
        if let Err(e) = self.destroy_in_place() {
            tracing::warn!(error = %e, "destroying a communicator failed");
        }
    }
}

/// Registers, once per process, an exit handler that waits for background teardowns
/// ([`anyccl_core::teardown::wait_for_pending`], at most [`EXIT_WAIT_LIMIT`]). It is registered after NCCL and the
/// CUDA runtime were loaded and initialised (a communicator exists), and exit handlers run in reverse order, so it
/// runs before theirs: a destroy still running is not cut off by the library's own teardown at exit.
fn wait_for_destroys_at_exit() {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    extern "C" fn at_exit() {
        // Touches no thread-local state (gone by now on the exiting thread) and cannot panic.
        let _ = anyccl_core::teardown::wait_for_pending(EXIT_WAIT_LIMIT);
    }
    REGISTERED.call_once(|| {
        // SAFETY: registers a plain function without arguments. The C library ties it to the module it is linked
        // into and runs it at exit, or earlier if that module is unloaded, so it never outlives its code.
        if unsafe { libc::atexit(at_exit) } != 0 {
            tracing::warn!("could not register the exit handler that waits for background communicator teardowns");
        }
    });
}

/// One point-to-point operation as the library takes it (alone, or one of a group).
struct GroupOp {
    recv: bool,
    /// The buffer's device address.
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
