//! anyccl's own all-reduce inside the drop-in: per communicator created through the drop-in, a [`GpuComm`] that
//! borrows the caller's `ncclComm_t`, and the selector's choice for each `ncclAllReduce`.
//!
//! - **State**: a map from the communicator's handle to its [`Slot`] (a sharded concurrent map, `dashmap`, so a
//!   forwarded call costs one shard's read lock; with no communicator registered at all, one atomic load). A slot
//!   is `Pending` (nothing allocated yet), `Ready` (the custom kernels set up: a [`Communicator`] over a
//!   [`GpuComm`] that wraps the caller's communicator through [`CclComm::from_raw_borrowed`]) or `Off` with the
//!   reason. Communicators the drop-in did not see created (a non-blocking init still in progress, or made by a
//!   library it does not intercept) have no slot and are forwarded.
//! - **Vendor**: CUDA ([`anyccl_cuda::Cuda`]) when the library underneath is NCCL, HIP ([`anyccl_rocm::Hip`]) when it
//!   is RCCL. When the runtime cannot be loaded the slot is `Off` with the reason.
//! - **Lifetime**: `ncclCommDestroy`, `ncclCommAbort` and `ncclCommFinalize` remove the slot and drop it first (the
//!   custom kernels told to stop on abort; buffers freed, IPC mappings closed, module unloaded), then forward: the
//!   borrowed handle never destroys anything.
//! - **Agreement at creation** ([`crate::agree`]): right after the library created the communicator (every rank
//!   calls that collectively, outside capture), one `ncclAllGather` of a fixed-size fingerprint of every
//!   rank-local input of the lazy decision below (`ANYCCL_DISABLE`, `ANYCCL_CUSTOM_MAX_BYTES`,
//!   `ANYCCL_CUSTOM_MAX_BLOCKS`, the `ANYCCL_TUNE_FILE` table, `ANYCCL_ALLREDUCE_ALGO`, the architecture and
//!   kernels); ranks where anyccl is off locally take part too. Unless every rank is on with equal fingerprints,
//!   every rank marks the communicator off with the same reason. No round (and off) for a communicator created
//!   inside `ncclGroupStart`/`ncclGroupEnd` (the all-gather would join the caller's group), a non-blocking one
//!   (`ncclInProgress`), one of world 1, and those of `ncclCommInitAll`. A rank whose device runtime cannot be
//!   loaded (or sees no device) cannot take part: it is off, and a peer that can would wait for it (documented).
//! - **Setup**: lazily, at the first call the selector would run on the custom kernels, outside capture and
//!   outside a group. That decision reads the call's shape and the world (the same on every rank) and the
//!   settings the agreement round found equal on every rank, so every rank sets up at the same call. The setup is
//!   [`GpuComm::enable_custom_ipc_over_ccl`]: the one-host check and the handles travel over the communicator
//!   itself ([`anyccl_gpu::CclBootstrap`]), and its agreement rounds turn the kernels on or off on every rank
//!   alike. Off once means forwarded for good.
//! - **Capture**: nothing is set up, allocated or registered while the caller's stream captures. Set up already:
//!   captured calls run the custom kernels through the graph-input tables, which stay on staging copies (graph
//!   buffers are never registered: the C ABI has no end-of-capture hook, and registering at a later call would
//!   depend on rank-local state). Not set up yet: forwarded.
//! - **Groups**: calls between `ncclGroupStart` and `ncclGroupEnd` on this thread are forwarded (NCCL defers them
//!   to the group's end; a setup inside would join the caller's group).

use std::cell::Cell;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use anyccl_ccl::{CclComm, CclLibrary, CclStream, CclVendor};
use anyccl_core::selector::SelectionQuery;
use anyccl_core::{Algorithm, AllReduceOutcome, Communicator, DataType, Error, InOut, ReduceOp, Selection, Selector};
use anyccl_gpu::device::GpuBuffer;
use anyccl_gpu::{GpuComm, GpuPlatform, StreamOf};
use dashmap::DashMap;

use crate::agree::{agree, participant, verdict, Local};
use crate::api::{self, Comm, Stream};
use crate::last_error::Failure;
use crate::AllReduceCall;

/// What the drop-in did with one `ncclAllReduce`.
#[derive(Debug)]
pub enum Outcome {
    /// Forward to the library underneath; why, for the log (no allocation on the frequent paths).
    Forward(Why),
    /// Ran on anyccl's kernels (the algorithm, and the selector's rule).
    Ran(Algorithm, String),
    /// anyccl failed the call itself.
    Failed(Failure),
}

/// Why a call was forwarded: a fixed or shared text on the paths every forwarded call takes (nothing allocated),
/// a formatted one on rare paths.
#[derive(Debug, Clone)]
pub enum Why {
    /// A fixed text.
    Static(&'static str),
    /// A text kept by the communicator's state (why anyccl is off for it).
    Shared(Arc<str>),
    /// A text made for this call.
    Owned(String),
}

impl std::fmt::Display for Why {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Why::Static(s) => s,
            Why::Shared(s) => s,
            Why::Owned(s) => s,
        })
    }
}

/// One communicator's anyccl state, behind its lock.
trait Accel: Send {
    /// Decides (and runs, when anyccl runs it) one all-reduce.
    /// `verbose`: the log wants the reason (otherwise a forwarded call's reason may be left empty).
    fn all_reduce(&mut self, call: &AllReduceCall, verbose: bool) -> Outcome;
    /// A window registered on the communicator (`ncclCommWindowRegister` succeeded).
    fn window_registered(&mut self, base: usize, size: usize, win: usize);
    /// A window deregistered.
    fn window_deregistered(&mut self, win: usize);
    /// Tells the custom kernels to stop waiting for peers (before an abort).
    fn stop(&mut self);
}

type Entry = Arc<Mutex<Box<dyn Accel>>>;

/// The map's hasher: its keys are communicator handles (heap addresses the library chose, not input an attacker
/// picks to collide), so a multiply-and-fold of the address spreads them over the shards at a fraction of the
/// default SipHash's cost on every call. Hand-written: a dozen lines, where a hashing crate would add a dependency
/// for one integer mix.
#[derive(Clone, Copy, Default)]
struct PointerHash;

impl std::hash::BuildHasher for PointerHash {
    type Hasher = PointerHasher;
    fn build_hasher(&self) -> PointerHasher {
        PointerHasher(0)
    }
}

/// See [`PointerHash`].
#[derive(Default)]
struct PointerHasher(u64);

impl std::hash::Hasher for PointerHasher {
    fn finish(&self) -> u64 {
        // Fibonacci hashing, folded so both the high bits (dashmap's shard) and the low bits (the table's bucket)
        // depend on every bit of the address.
        let h = self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        h ^ (h >> 32)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8 | u64::from(*b)).rotate_left(5);
        }
    }
    fn write_usize(&mut self, v: usize) {
        self.0 ^= v as u64;
    }
}

/// Communicators with a slot, by handle.
fn map() -> &'static DashMap<usize, Entry, PointerHash> {
    static MAP: OnceLock<DashMap<usize, Entry, PointerHash>> = OnceLock::new();
    MAP.get_or_init(|| DashMap::with_hasher(PointerHash))
}

/// How many slots exist: zero means every call forwards without a lookup.
static LIVE: AtomicUsize = AtomicUsize::new(0);
/// `ncclAllReduce` calls run on anyccl's kernels ([`crate::anyccl_nccl_dropin_custom_calls`]).
pub static CUSTOM_CALLS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static GROUP_DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// `ncclGroupStart` on this thread.
pub fn group_start() {
    let _ = GROUP_DEPTH.try_with(|d| d.set(d.get().saturating_add(1)));
}

/// `ncclGroupEnd` (or `ncclGroupSimulateEnd`) on this thread.
pub fn group_end() {
    let _ = GROUP_DEPTH.try_with(|d| d.set(d.get().saturating_sub(1)));
}

fn in_group() -> bool {
    GROUP_DEPTH.try_with(|d| d.get() > 0).unwrap_or(false)
}

fn lock(e: &Entry) -> std::sync::MutexGuard<'_, Box<dyn Accel>> {
    // A panic inside a call is caught at the boundary; the slot stays as consistent as the call left it.
    e.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether any communicator has a slot (if not, every call forwards without a lookup).
#[inline]
pub fn any_registered() -> bool {
    LIVE.load(Ordering::Acquire) != 0
}

/// Decides one `ncclAllReduce`.
pub fn all_reduce(call: &AllReduceCall) -> Outcome {
    if LIVE.load(Ordering::Acquire) == 0 {
        return Outcome::Forward(Why::Static("no communicator was created through the drop-in"));
    }
    let Some(entry) = map().get(&(call.comm as usize)).map(|e| e.value().clone()) else {
        return Outcome::Forward(Why::Static("a communicator the drop-in did not see created"));
    };
    if in_group() {
        return Outcome::Forward(Why::Static("inside ncclGroupStart/ncclGroupEnd (the group runs it)"));
    }
    let out = lock(&entry).all_reduce(call, tracing::enabled!(tracing::Level::DEBUG));
    if matches!(out, Outcome::Ran(..)) {
        CUSTOM_CALLS.fetch_add(1, Ordering::Relaxed);
    }
    out
}

/// Drops the slot of `comm` (before its destroy, abort or finalize is forwarded); `abort`: tell the custom kernels
/// to stop waiting for peers first.
pub fn release(comm: Comm, abort: bool) {
    if LIVE.load(Ordering::Acquire) == 0 {
        return;
    }
    if let Some((_, entry)) = map().remove(&(comm as usize)) {
        LIVE.fetch_sub(1, Ordering::AcqRel);
        let mut slot = lock(&entry);
        if abort {
            slot.stop();
        }
        // Replaced by an empty slot: the GpuComm (buffers, mappings, module) drops here, under the lock.
        *slot = Box::new(Off::new("released"));
        tracing::debug!(?comm, abort, "anyccl state of the communicator released");
    }
}

/// Notes a window registered on `comm`.
pub fn window_registered(comm: Comm, base: *mut c_void, size: usize, win: api::Window) {
    if let Some(e) = slot(comm) {
        lock(&e).window_registered(base as usize, size, win as usize);
    }
}

/// Notes a window deregistered from `comm`.
pub fn window_deregistered(comm: Comm, win: api::Window) {
    if let Some(e) = slot(comm) {
        lock(&e).window_deregistered(win as usize);
    }
}

fn slot(comm: Comm) -> Option<Entry> {
    if LIVE.load(Ordering::Acquire) == 0 {
        return None;
    }
    map().get(&(comm as usize)).map(|e| e.value().clone())
}

/// A communicator the caller just created through the drop-in (`ncclCommInitRank` and the others, after the
/// library returned success): the creation-time agreement round over it (see [`crate::agree`]), then its slot,
/// `Pending` or `Off` with the reason. Collective over the new communicator, like the call that created it; never
/// fails the caller's call.
pub fn register(lib: &Arc<CclLibrary>, api: &api::Api, comm: Comm) {
    if comm.is_null() {
        return;
    }
    if in_group() {
        // The library defers what is called inside a group to its end (the new communicator is not even usable
        // before): an all-gather now would join the caller's group. No round; every rank of a communicator
        // created in a group forwards.
        return register_off(
            comm,
            "created inside ncclGroupStart/ncclGroupEnd (the agreement round would join the caller's group)",
        );
    }
    // Never fails the caller's call: a panic in a vendor runtime's loading becomes "off" with the reason.
    let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match lib.vendor() {
        CclVendor::Rccl => pending::<anyccl_rocm::Hip>(lib, api, comm),
        _ => pending::<anyccl_cuda::Cuda>(lib, api, comm),
    }));
    let slot: Box<dyn Accel> =
        made.unwrap_or_else(|_| Box::new(Off::new("internal error while setting up anyccl's state (a panic, caught)")));
    insert(comm, slot);
}

fn insert(comm: Comm, slot: Box<dyn Accel>) {
    if map().insert(comm as usize, Arc::new(Mutex::new(slot))).is_none() {
        LIVE.fetch_add(1, Ordering::AcqRel);
    }
}

/// A communicator the caller created through the drop-in that anyccl leaves alone: forwarded with `why` (one thread
/// driving every device of `ncclCommInitAll` could not reach the collective setup on every rank at once).
pub fn register_off(comm: Comm, why: &str) {
    if comm.is_null() {
        return;
    }
    insert(comm, Box::new(Off::new(why)));
}

/// A non-blocking communicator (its creation returned `ncclInProgress`): forwarded, no round (its collectives may
/// return `ncclInProgress` too, and it is not usable before its init has finished).
pub fn register_off_nonblocking(comm: Comm) {
    register_off(comm, "a non-blocking communicator (its creation returned ncclInProgress)");
}

/// What the drop-in needs of a vendor beyond [`GpuPlatform`]: the device current on this thread and the caller's
/// stream as the runtime's stream type.
pub trait DropinPlatform: GpuPlatform {
    /// Whether the vendor's runtime can be used at all (checked before anything of it is touched).
    fn usable() -> Result<(), String> {
        Ok(())
    }
    /// The device current on this thread (where NCCL creates a communicator).
    fn current_device() -> anyccl_core::Result<i32>;
    /// What is current on the calling thread (a device, a context).
    type Current;
    /// Reads what is current on the calling thread, so the drop-in can put it back after it used the
    /// communicator's device inside the caller's call; `None` when it cannot be read (nothing is put back).
    fn save_current() -> Option<Self::Current>;
    /// Puts back what [`DropinPlatform::save_current`] read (a failure is logged, not returned).
    ///
    /// # Safety
    /// `saved` is what `save_current` returned on this thread, during the same call of the caller's.
    unsafe fn restore_current(saved: Self::Current);
    /// The device's ordinal of a runtime (the buffers' device).
    fn device_ordinal(runtime: &Self::Runtime) -> u32;
    /// The caller's stream, borrowed (never destroyed).
    ///
    /// # Safety
    /// `raw` is a live stream of the runtime's device, used only while the value lives.
    unsafe fn borrow_stream(runtime: &Self::Runtime, raw: *mut c_void) -> StreamOf<Self>;
}

impl DropinPlatform for anyccl_rocm::Hip {
    fn usable() -> Result<(), String> {
        if let Err(e) = anyccl_rocm::platform::hip_library() {
            return Err(format!("the HIP runtime could not be loaded: {e}"));
        }
        match <Self as GpuPlatform>::device_count() {
            Ok(n) if n > 0 => Ok(()),
            Ok(_) => Err("the HIP runtime sees no device".into()),
            Err(e) => Err(format!("the HIP runtime sees no device: {e}")),
        }
    }

    fn current_device() -> anyccl_core::Result<i32> {
        let lib = anyccl_rocm::platform::hip_library().as_ref().map_err(|e| Error::Unsupported {
            capability: "hip-runtime".into(),
            reason: anyccl_core::Reason::Unavailable { component: "HIP runtime".into(), detail: e.to_string() },
        })?;
        let mut d: c_int = -1;
        // SAFETY: hipGetDevice writes one int.
        let st = unsafe { (lib.table().get_device)(&mut d) };
        if st != 0 || d < 0 {
            return Err(Error::backend("rocm", "hipGetDevice", None, format!("status {st}, device {d}")));
        }
        Ok(d)
    }

    type Current = c_int;

    fn save_current() -> Option<c_int> {
        let lib = anyccl_rocm::platform::hip_library().as_ref().ok()?;
        let mut d: c_int = -1;
        // SAFETY: hipGetDevice writes one int.
        let st = unsafe { (lib.table().get_device)(&mut d) };
        (st == 0 && d >= 0).then_some(d)
    }

    unsafe fn restore_current(saved: c_int) {
        if let Ok(lib) = anyccl_rocm::platform::hip_library().as_ref() {
            // SAFETY: hipSetDevice takes a device ordinal the runtime itself returned.
            let st = unsafe { (lib.table().set_device)(saved) };
            if st != 0 {
                tracing::warn!(device = saved, status = st, "could not make the caller's device current again");
            }
        }
    }

    fn device_ordinal(runtime: &anyccl_rocm::runtime::HipRuntime) -> u32 {
        u32::try_from(runtime.device().ordinal()).unwrap_or(u32::MAX)
    }

    unsafe fn borrow_stream(runtime: &anyccl_rocm::runtime::HipRuntime, raw: *mut c_void) -> StreamOf<Self> {
        // SAFETY: the caller's contract.
        unsafe { anyccl_rocm::runtime::HipStream::from_raw(raw, runtime.device()) }
    }
}

impl DropinPlatform for anyccl_cuda::Cuda {
    fn usable() -> Result<(), String> {
        anyccl_cuda::available().map(|_| ()).map_err(|r| format!("the CUDA driver is not usable: {r}"))
    }

    fn current_device() -> anyccl_core::Result<i32> {
        Err(Error::backend(
            "cuda",
            "ncclCommCuDevice",
            None,
            "the library did not say which device the communicator is on",
        ))
    }

    /// The current context (null: none).
    type Current = anyccl_cuda::cudarc::driver::sys::CUcontext;

    fn save_current() -> Option<Self::Current> {
        match anyccl_cuda::cudarc::driver::result::ctx::get_current() {
            Ok(c) => Some(c.unwrap_or(std::ptr::null_mut())),
            Err(_) => None,
        }
    }

    unsafe fn restore_current(saved: Self::Current) {
        // SAFETY: the caller's contract: the context the driver returned as current on this thread a moment ago
        // (or null: none), which the caller still holds (the drop-in runs inside the caller's own call).
        if let Err(e) = unsafe { anyccl_cuda::cudarc::driver::result::ctx::set_current(saved) } {
            tracing::warn!(error = %e, "could not make the caller's CUDA context current again");
        }
    }

    fn device_ordinal(runtime: &anyccl_cuda::CudaRuntime) -> u32 {
        u32::try_from(runtime.context().ordinal()).unwrap_or(u32::MAX)
    }

    unsafe fn borrow_stream(runtime: &anyccl_cuda::CudaRuntime, raw: *mut c_void) -> StreamOf<Self> {
        // SAFETY: the caller's contract.
        unsafe { anyccl_cuda::CudaStream::from_raw(raw, runtime.context()) }
    }
}

/// A slot whose anyccl state is off: every call forwards with the reason (kept whole, shared with each call).
struct Off {
    why: Arc<str>,
}

impl Off {
    fn new(why: &str) -> Self {
        Off { why: Arc::from(format!("anyccl is off for this communicator: {why}")) }
    }
}

impl Accel for Off {
    fn all_reduce(&mut self, _call: &AllReduceCall, verbose: bool) -> Outcome {
        Outcome::Forward(if verbose { Why::Shared(self.why.clone()) } else { Why::Static("") })
    }
    fn window_registered(&mut self, _: usize, _: usize, _: usize) {}
    fn window_deregistered(&mut self, _: usize) {}
    fn stop(&mut self) {}
}

/// The environment anyccl reads (`ANYCCL_CUSTOM_MAX_BYTES`, `ANYCCL_HOST_ID`, …).
fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn pending<P: DropinPlatform>(lib: &Arc<CclLibrary>, api: &api::Api, comm: Comm) -> Box<dyn Accel>
where
    StreamOf<P>: CclStream,
{
    match Slot::<P>::agreed(lib, api, comm) {
        Ok(p) => {
            tracing::debug!(?comm, rank = p.rank, world = p.world, backend = P::NAME, "anyccl state: pending");
            Box::new(p)
        }
        Err(why) => {
            tracing::debug!(?comm, %why, "anyccl state: off");
            Box::new(Off::new(&why))
        }
    }
}

/// Why a rank without a usable device runtime is off (and what that means for its peers).
fn cannot_take_part(why: String) -> String {
    format!(
        "{why}; this rank cannot hold its fingerprint in device memory, so it did not take part in the agreement \
         round at creation (a peer that could would wait for it: see the drop-in's README on settings)"
    )
}

/// Windows registered through the drop-in on one communicator: (base, size, handle).
#[derive(Default)]
struct Windows(Vec<(usize, usize, usize)>);

impl Windows {
    fn holds(&self, ptr: usize, bytes: usize) -> bool {
        self.0.iter().any(|&(b, s, _)| ptr >= b && ptr.checked_add(bytes).is_some_and(|e| e <= b.saturating_add(s)))
    }
}

/// One communicator's state: what it is (rank, world, device, the selector) and, once set up, the communicator
/// that runs the custom kernels.
struct Slot<P: DropinPlatform> {
    lib: Arc<CclLibrary>,
    comm: Comm,
    rank: usize,
    world: usize,
    device: P::DeviceSpec,
    runtime: P::Runtime,
    arch: String,
    caps: Arc<anyccl_core::CapabilityReport>,
    selector: Arc<Selector>,
    capacity: usize,
    windows: Windows,
    /// Set up: the custom kernels over IPC, on a [`GpuComm`] borrowing `comm`.
    ready: Option<Communicator<GpuComm<P>>>,
    /// Why the custom kernels are off for good (their setup failed, on some rank), as the log shows it.
    off: Option<Arc<str>>,
}

// SAFETY: `comm` is a handle used only under the slot's lock (one call at a time, as NCCL requires of one
// communicator); the rest is Send.
unsafe impl<P: DropinPlatform> Send for Slot<P> {}

impl<P: DropinPlatform> Slot<P>
where
    StreamOf<P>: CclStream,
{
    /// The slot of a communicator just created: this rank's settings, the agreement round over the communicator
    /// (every rank takes part, also one where anyccl is off locally), then `Ok` only if every rank is on with
    /// the same settings; otherwise why not (the same verdict on every rank).
    fn agreed(lib: &Arc<CclLibrary>, api: &api::Api, comm: Comm) -> Result<Self, String> {
        // Without a usable runtime this rank cannot take part (checked before anything else is asked).
        P::usable().map_err(cannot_take_part)?;
        // The round uses the communicator's device; the caller's current device (or context) is put back after.
        let _current = crate::agree::KeepCurrent::<P>::new();
        // SAFETY: `comm` was just created by `lib`; the caller destroys it only through the drop-in, which drops
        // every borrowed value first. This one answers two queries and is dropped at once.
        let probe = unsafe { CclComm::from_raw_borrowed(lib.clone(), comm) }.map_err(|e| e.to_string())?;
        let (rank, world) = (probe.rank(), probe.world());
        drop(probe);
        if world < 2 {
            // Every rank sees the same world: no round, nothing to agree on.
            return Err(format!("one rank (world {world})"));
        }
        let (device, runtime) = participant::<P>(api, comm).map_err(cannot_take_part)?;
        let local = Local::read::<P>(lib, &device, &runtime, world);
        let mine = local.fingerprint();
        let all = agree::<P>(lib, comm, world, &runtime, &mine)
            .map_err(|e| format!("the agreement round at creation failed: {e}"))?;
        let verdict = verdict(&all, world, &local);
        match &verdict {
            Ok(()) => tracing::debug!(?comm, rank, world, verdict = "on", "anyccl agreement"),
            // On here but off by the round: the ranks' settings differ (a misconfiguration worth seeing).
            Err(why) if local.on.is_ok() => {
                tracing::info!(?comm, rank, world, verdict = "off", %why, "anyccl agreement")
            }
            Err(why) => tracing::debug!(?comm, rank, world, verdict = "off", %why, "anyccl agreement"),
        }
        verdict?;
        let Ok(on) = local.on else {
            // Unreachable: the verdict is "on" only when this rank's own state is on.
            return Err("internal error: agreed on while off locally".into());
        };
        Ok(Slot {
            lib: lib.clone(),
            comm,
            rank,
            world,
            device,
            runtime,
            arch: on.arch,
            caps: on.caps,
            selector: on.selector,
            capacity: on.capacity,
            windows: Windows::default(),
            ready: None,
            off: None,
        })
    }

    /// What the selector would choose for a call of this shape once the kernels are set up: the same on every
    /// rank (it reads the call's shape, the world, and the settings every rank shares).
    fn would_choose(&self, dtype: DataType, op: ReduceOp, bytes: usize) -> anyccl_core::Result<Selection> {
        let q = SelectionQuery {
            vendor: P::VENDOR,
            arch: &self.arch,
            world: self.world,
            bytes: bytes as u64,
            dtype,
            capturing: false,
        };
        self.selector.select(&q, |a| match a {
            Algorithm::Ccl => Ok(()),
            Algorithm::OneShot | Algorithm::TwoShot => custom_fits::<P>(dtype, op, bytes, self.world, self.capacity),
            // The push one-shot, where the platform offers it (its own limit is checked once it is set up; where
            // it is not, the same rule's one-shot runs).
            Algorithm::OneShotPush if P::ALGORITHMS.contains(&Algorithm::OneShotPush) => {
                custom_fits::<P>(dtype, op, bytes, self.world, self.capacity)
            }
            _ => Err("not offered by the drop-in".into()),
        })
    }

    /// The custom kernels' setup over the communicator itself (collective; the outcome agreed by every rank).
    fn setup(&self) -> anyccl_core::Result<Communicator<GpuComm<P>>> {
        // SAFETY: `comm` is the caller's live communicator of `lib`; the GpuComm made from it lives in this slot,
        // which ncclCommDestroy/Abort/Finalize drop before they forward; calls on it run under the slot's lock,
        // inside the caller's own call on this communicator.
        let ccl = unsafe { CclComm::from_raw_borrowed(self.lib.clone(), self.comm) }?;
        let mut gpu = GpuComm::<P>::from_ccl(ccl, &self.device, self.caps.clone())?;
        let stream = P::stream(&self.runtime)?;
        gpu.enable_custom_ipc_over_ccl(&stream, &env)?;
        Ok(Communicator::new(gpu, self.selector.clone()))
    }
}

/// An anyccl error inside `ncclAllReduce` as an NCCL code and a text ([`crate::dispatch_all_reduce`] puts the name
/// of the function called in front).
fn failure(e: &Error) -> Failure {
    let code = match e {
        Error::InvalidArgument(_) => api::NCCL_INVALID_ARGUMENT,
        Error::Backend { .. } => api::NCCL_UNHANDLED_CUDA_ERROR,
        _ => api::NCCL_INTERNAL_ERROR,
    };
    Failure { code, message: format!("the anyccl drop-in's custom all-reduce failed: {e}") }
}

impl<P: DropinPlatform> Accel for Slot<P>
where
    StreamOf<P>: CclStream,
{
    fn all_reduce(&mut self, call: &AllReduceCall, verbose: bool) -> Outcome {
        if let Some(why) = &self.off {
            return Outcome::Forward(if verbose { Why::Shared(why.clone()) } else { Why::Static("") });
        }
        let (dtype, op, bytes) = match shape(call) {
            Ok(s) => s,
            Err(why) => return Outcome::Forward(Why::Static(why)),
        };
        // What the custom kernels cannot take at all is forwarded without asking the selector.
        if let Err(why) = custom_fits::<P>(dtype, op, bytes, self.world, self.capacity) {
            return Outcome::Forward(Why::Owned(why));
        }
        if self.windows.holds(call.sendbuff as usize, bytes) && self.windows.holds(call.recvbuff as usize, bytes) {
            return Outcome::Forward(Why::Static("ccl-symmetric: the buffers lie in symmetric windows"));
        }
        if self.ready.is_none() {
            match self.would_choose(dtype, op, bytes) {
                Ok(s) if runs_here(s.algorithm) => {}
                Ok(s) => {
                    return Outcome::Forward(Why::Owned(format!("the selector chose {} ({})", s.algorithm, s.why)))
                }
                Err(e) => return Outcome::Forward(Why::Owned(e.to_string())),
            }
            match capturing::<P>(&self.runtime, call.stream) {
                Ok(false) => {}
                Ok(true) => {
                    return Outcome::Forward(Why::Static(
                        "the custom kernels are not set up yet, and nothing is set up during capture",
                    ))
                }
                Err(e) => return Outcome::Forward(Why::Owned(format!("the capture state is unknown ({e})"))),
            }
            // Every rank reaches this call (it was decided from what every rank shares): the setup is collective.
            match self.setup() {
                Ok(c) => {
                    tracing::debug!(comm = ?self.comm, rank = self.rank, world = self.world, "custom kernels set up");
                    self.ready = Some(c);
                }
                Err(e) => {
                    let why = e.to_string();
                    tracing::info!(comm = ?self.comm, %why, "custom all-reduce kernels off for this communicator");
                    let text: Arc<str> = Arc::from(format!("the custom kernels are off for this communicator: {why}"));
                    self.off = Some(text.clone());
                    return Outcome::Forward(Why::Shared(text));
                }
            }
        }
        let Some(comm) = self.ready.as_mut() else {
            return Outcome::Forward(Why::Static("the custom kernels are not set up"));
        };
        let ordinal = P::device_ordinal(comm.runtime());
        // SAFETY: the caller's stream, live for the call (nccl.h's contract); dropped before returning.
        let stream = unsafe { P::borrow_stream(comm.runtime(), call.stream) };
        let in_place = call.sendbuff == call.recvbuff.cast_const();
        // SAFETY: nccl.h's contract: `sendbuff` and `recvbuff` hold `count` elements of device memory of the
        // communicator's device, allocated for the call's duration (and for a captured call, for as long as its
        // graph is replayed). The views free nothing.
        let (send, mut recv) = unsafe {
            (
                GpuBuffer::from_raw(call.sendbuff as u64, bytes, ordinal),
                GpuBuffer::from_raw(call.recvbuff as u64, bytes, ordinal),
            )
        };
        let bufs = if in_place { InOut::InPlace(&mut recv) } else { InOut::Separate { send: &send, recv: &mut recv } };
        // The selector is asked once (its decision remembered for a repeat of this call) and the plan it chose
        // runs, unless it chose what the library underneath runs: that is forwarded.
        match comm.all_reduce_if(bufs, call.count, dtype, op, &stream, |s| runs_here(s.algorithm)) {
            Ok(AllReduceOutcome::Ran(sel)) => Outcome::Ran(sel.algorithm, sel.why.to_string()),
            Ok(AllReduceOutcome::Declined(sel)) => {
                Outcome::Forward(Why::Owned(format!("the selector chose {} ({})", sel.algorithm, sel.why)))
            }
            Ok(AllReduceOutcome::Unselected(e)) => Outcome::Forward(Why::Owned(e.to_string())),
            Err(e) => Outcome::Failed(failure(&e)),
        }
    }

    fn window_registered(&mut self, base: usize, size: usize, win: usize) {
        self.windows.0.push((base, size, win));
    }

    fn window_deregistered(&mut self, win: usize) {
        self.windows.0.retain(|w| w.2 != win);
    }

    fn stop(&mut self) {
        if let Some(c) = &self.ready {
            if let Err(e) = c.backend().stop_custom_kernels() {
                tracing::warn!(error = %e, "could not tell the custom all-reduce kernels to stop before the abort");
            }
        }
    }
}

/// Whether the drop-in runs `algorithm` itself (its custom kernels); every other choice is forwarded to the
/// library underneath.
fn runs_here(algorithm: Algorithm) -> bool {
    matches!(algorithm, Algorithm::OneShot | Algorithm::TwoShot | Algorithm::OneShotPush)
}

/// Whether the custom kernels take this call (before asking the selector), else why not.
fn custom_fits<P: GpuPlatform>(
    dtype: DataType,
    op: ReduceOp,
    bytes: usize,
    world: usize,
    capacity: usize,
) -> Result<(), String> {
    if op != ReduceOp::Sum {
        return Err(format!("the custom kernels implement sum, not {op}"));
    }
    if let Some(why) = anyccl_gpu::kernels::ineligible::<P>(dtype, bytes, world) {
        return Err(why);
    }
    if bytes > capacity {
        return Err(format!(
            "{bytes} bytes exceed the custom kernels' staging buffers ({capacity} bytes; ANYCCL_CUSTOM_MAX_BYTES)"
        ));
    }
    Ok(())
}

/// The call's type and operator as anyccl's, when the custom kernels could take them at all (else why not, a fixed
/// text).
fn shape(call: &AllReduceCall) -> std::result::Result<(DataType, ReduceOp, usize), &'static str> {
    let dtype = match anyccl_ccl::dtype_of_nccl_code(call.datatype) {
        Some(d @ (DataType::F16 | DataType::F32 | DataType::Bf16)) => d,
        _ => return Err("the custom kernels handle float32, float16 and bfloat16 only"),
    };
    if call.op != 0 {
        return Err("the custom kernels implement sum only");
    }
    if call.count == 0 {
        return Err("an empty all-reduce");
    }
    if call.sendbuff.is_null() || call.recvbuff.is_null() {
        return Err("a null buffer (the library answers it)");
    }
    let bytes = call.count.checked_mul(dtype.size_bytes()).ok_or("the size overflows")?;
    Ok((dtype, ReduceOp::Sum, bytes))
}

/// Whether the caller's stream captures, asked through the runtime.
fn capturing<P: DropinPlatform>(runtime: &P::Runtime, raw: Stream) -> anyccl_core::Result<bool>
where
    StreamOf<P>: CclStream,
{
    // SAFETY: the caller's stream, live for the call (nccl.h's contract); the borrowed value is dropped here.
    let s = unsafe { P::borrow_stream(runtime, raw) };
    s.is_capturing()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(datatype: c_int, op: c_int, count: usize) -> AllReduceCall {
        let p = 0x1000 as *mut c_void;
        AllReduceCall {
            sendbuff: p,
            recvbuff: p,
            count,
            datatype,
            op,
            comm: std::ptr::null_mut(),
            stream: std::ptr::null_mut(),
        }
    }

    #[test]
    fn only_float_sums_of_something_reach_the_selector() {
        assert_eq!(shape(&call(9, 0, 8)), Ok((DataType::Bf16, ReduceOp::Sum, 16)));
        assert_eq!(shape(&call(7, 0, 4)), Ok((DataType::F32, ReduceOp::Sum, 16)));
        assert_eq!(shape(&call(6, 0, 8)), Ok((DataType::F16, ReduceOp::Sum, 16)));
        assert!(shape(&call(2, 0, 4)).is_err(), "int32");
        assert!(shape(&call(7, 2, 4)).is_err(), "max");
        assert!(shape(&call(7, 0, 0)).is_err(), "empty");
        assert!(shape(&call(7, 0, usize::MAX)).is_err(), "overflow");
        let mut null = call(7, 0, 4);
        null.recvbuff = std::ptr::null_mut();
        assert!(shape(&null).is_err(), "null buffer");
    }

    #[test]
    fn a_window_holds_only_ranges_inside_it() {
        let w = Windows(vec![(0x1000, 0x100, 1)]);
        assert!(w.holds(0x1000, 0x100));
        assert!(w.holds(0x1080, 0x10));
        assert!(!w.holds(0x1080, 0x81), "runs past the end");
        assert!(!w.holds(0xff0, 0x10), "starts before");
        assert!(!w.holds(usize::MAX, 2), "wraps");
    }

    #[test]
    fn group_depth_is_per_thread_and_never_negative() {
        group_end();
        assert!(!in_group());
        group_start();
        group_start();
        assert!(in_group());
        assert!(!std::thread::spawn(in_group).join().expect("thread"));
        group_end();
        group_end();
        assert!(!in_group());
    }
}
