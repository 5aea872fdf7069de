//! anyccl-host: N ranks as threads over host memory, or one process per rank ([`communicator_over`] a bootstrap,
//! [`from_env`] under `torchrun`; see [`ProcessComm`] for how its data moves).
//!
//! The embedded default backend — what `anyccl bench` runs when no GPU backend is available — and the reference
//! the GPU backends are tested against. It implements every collective for every data type and operator, and the
//! all-reduce algorithms one-shot, two-shot (reduce-scatter + all-gather) and ring.
//!
//! Ranks exchange data the way the custom GPU kernels do over IPC: each rank copies its input into its own
//! staging buffer and publishes it with a step counter; peers read it once every rank published the same step.
//! The two-shot all-reduce (and the one-shot one out of place) copies nothing aside: each rank exposes its own
//! buffers for the call and reads every rank's input where it lies; two-shot reduces its part and writes the result
//! straight into every rank's output (see the `direct` module for why that is sound).
//! Every reduction visits the ranks' contributions in one fixed order per element, so all ranks get bitwise
//! identical results. 8- and 16-bit floats accumulate in f32.
//!
//! **Ranks check each other.** Ranks as threads synchronise the way ranks as processes do (the same step
//! counters and descriptors, on the heap instead of in shared memory): each step carries a descriptor of the call
//! (collective, size, element type, operator, root, algorithm), and no rank reads a peer's data before it checked
//! every peer's descriptor against its own. Ranks that make different calls all get [`Error::PeerFailure`]
//! describing both calls, at once; a rank that does not come makes its peers' waits end in [`Error::Timeout`]
//! naming it; a rank that drops its communicator fails its peers' collectives with [`Error::PeerFailure`] naming
//! it, while the other pairs' point-to-point messages still flow. After a failed collective a rank refuses every
//! further collective. A wait spins (yielding to a peer on the same processor) for up to 100 µs, then sleeps on a
//! futex that the awaited peer rings when it publishes, so an oversubscribed machine still makes progress.
//!
//! ```
//! use anyccl_core::{InOut, ReduceOp};
//! use anyccl_host::{communicators, HostBuffer, HostOptions};
//!
//! let comms = communicators(4, HostOptions::default()).unwrap();
//! let results: Vec<Vec<f32>> = std::thread::scope(|s| {
//!     let handles: Vec<_> = comms
//!         .into_iter()
//!         .map(|mut comm| {
//!             s.spawn(move || {
//!                 let rank = comm.rank() as f32;
//!                 let mut buf = HostBuffer::from_elems(&[rank, 1.0, 2.0]);
//!                 comm.all_reduce(InOut::InPlace(buf.as_bytes_mut()), 3, anyccl_core::DataType::F32, ReduceOp::Sum, &())
//!                     .unwrap();
//!                 buf.to_vec::<f32>()
//!             })
//!         })
//!         .collect();
//!     handles.into_iter().map(|h| h.join().unwrap()).collect()
//! });
//! assert!(results.iter().all(|r| r == &[6.0, 4.0, 8.0]));
//! ```
// Only the shared-memory transport needs `unsafe` (a view of mapped memory as atomic words); it opts in below.
#![deny(unsafe_code)]

#[allow(unsafe_code)]
mod direct;
mod fused;
mod process;
mod reduce;
#[allow(unsafe_code)]
mod shm;
/// The operator as the host kernels know it: what the host backends' `check_reduction` resolves once per call.
pub use reduce::Op as HostReduction;
mod sync;

use std::borrow::{Borrow, BorrowMut};
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use anyccl_core::comm::{
    AllGatherArgs, AllReduceArgs, AllReduceCall, BroadcastArgs, P2pArgs, P2pItem, RecvArgs, ReduceArgs,
    ReduceScatterArgs, SendArgs,
};
use anyccl_core::{
    Algorithm, Capabilities, CapabilityReport, CommBackend, Communicator, DataType, Element, Error, InOut,
    InvalidArgument, Location, MemoryRuntime, Reason, Result, Selector, Vendor,
};

use crate::reduce::{cast, cast_mut, combine_acc, load_acc, reduce_into, resolve, store_acc, with_type, Op, Reducible};
use crate::shm::{thread_headers, Desc, Kind, ShmGroup, ThreadHeader};
use crate::sync::MailSync;

pub use crate::process::{communicator_over, from_env, ProcessComm, PROCESS_ALGORITHMS};
pub use crate::shm::{DEFAULT_SHM_CAPACITY, MAX_SHM_CAPACITY, MIN_SHM_CAPACITY};

/// The all-reduce algorithms of the host backend.
pub const ALGORITHMS: [Algorithm; 3] = [Algorithm::OneShot, Algorithm::TwoShot, Algorithm::Ring];

/// Options of a host communicator group.
///
/// Not `#[non_exhaustive]`: callers build one with `HostOptions { .., ..HostOptions::default() }`.
///
/// [`HostOptions::default`] reads no environment variable; [`HostOptions::from_env`] takes the selector from the
/// environment (`ANYCCL_ALLREDUCE_ALGO`, `ANYCCL_TUNE_FILE`, `ANYCCL_DETERMINISTIC`, `ANYCCL_FUSED_RMSNORM`), as
/// the `anyccl` command and the drop-in library do for every backend.
#[derive(Debug, Clone)]
pub struct HostOptions {
    /// How long a rank waits for its peers in a collective or for a message before it gives up with
    /// [`Error::Timeout`] naming the rank it waited for (a rank whose collective failed refuses further ones).
    pub timeout: Duration,
    /// The algorithm selector (defaults, a table file, a forced algorithm).
    pub selector: Arc<Selector>,
    /// Ranks as processes ([`communicator_over`], [`from_env`]): the data capacity of each rank's shared-memory
    /// segment in bytes, [`MIN_SHM_CAPACITY`]`..=`[`MAX_SHM_CAPACITY`] (and at least 64 × the world size);
    /// collectives larger than this move in chunks. Ranks may differ; the smallest is used. Default
    /// [`DEFAULT_SHM_CAPACITY`] (4 MiB).
    pub shm_capacity: usize,
    /// Not used any more, kept so that code setting it still builds: the shared-memory segments of ranks as
    /// processes are anonymous sealed memory files (`memfd`), passed between the ranks as descriptors, in no
    /// directory.
    pub shm_dir: Option<PathBuf>,
}

impl HostOptions {
    /// The defaults, with the selector read from the environment by [`Selector::from_env`]:
    /// `ANYCCL_ALLREDUCE_ALGO` (a forced algorithm), `ANYCCL_TUNE_FILE` (a table file), `ANYCCL_DETERMINISTIC` and
    /// `ANYCCL_FUSED_RMSNORM` — the variables the GPU backends honour when their selector comes from
    /// [`Selector::from_env`]. A bad value of any of them is [`Error::Config`] naming the variable.
    ///
    /// `ANYCCL_LOG` is not read here, nor by any backend: the library only emits `tracing` events, and the program
    /// chooses the subscriber and its filter (the `anyccl` command and the drop-in library filter theirs by
    /// `ANYCCL_LOG`).
    ///
    /// ```
    /// let options = anyccl_host::HostOptions::from_env()?;
    /// let comms = anyccl_host::communicators(2, options)?;
    /// # Ok::<(), anyccl_core::Error>(())
    /// ```
    pub fn from_env() -> Result<Self> {
        Ok(HostOptions { selector: Arc::new(Selector::from_env()?), ..HostOptions::default() })
    }
}

impl Default for HostOptions {
    /// A two-minute timeout, the default selector ([`Selector::defaults`]), a [`DEFAULT_SHM_CAPACITY`] segment in
    /// the default directory. Reads no environment variable: `ANYCCL_ALLREDUCE_ALGO`, `ANYCCL_DETERMINISTIC` and
    /// `ANYCCL_TUNE_FILE` are ignored; [`HostOptions::from_env`] honours them.
    fn default() -> Self {
        HostOptions {
            timeout: Duration::from_secs(120),
            selector: Arc::new(Selector::defaults()),
            shm_capacity: DEFAULT_SHM_CAPACITY,
            shm_dir: None,
        }
    }
}

/// Host memory, 16-byte aligned (enough for every [`DataType`] and for the 16-byte vectors the fused
/// all-reduce + RMSNorm requires of its buffers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostBuffer {
    words: Vec<u128>,
    len: usize,
}

impl HostBuffer {
    /// `len` zero bytes. Aborts the process if the memory cannot be had, like `vec!`; for a length that comes
    /// from outside, use [`HostBuffer::try_zeroed`].
    pub fn zeroed(len: usize) -> Self {
        HostBuffer { words: vec![0; len.div_ceil(16)], len }
    }

    /// `len` zero bytes, or [`Error::OutOfMemory`] if they cannot be reserved.
    pub fn try_zeroed(len: usize) -> Result<Self> {
        Ok(HostBuffer { words: try_filled(len.div_ceil(16), 0u128, "a host buffer")?, len })
    }

    /// A copy of `elems`.
    pub fn from_elems<T: Element>(elems: &[T]) -> Self {
        let bytes: &[u8] = bytemuck::cast_slice(elems);
        let mut b = Self::zeroed(bytes.len());
        b.as_bytes_mut().copy_from_slice(bytes);
        b
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    /// The bytes, mutably.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }

    /// The contents as elements (a trailing partial element is dropped).
    pub fn to_vec<T: Element>(&self) -> Vec<T> {
        let n = self.len / std::mem::size_of::<T>();
        bytemuck::cast_slice::<u8, T>(&self.as_bytes()[..n * std::mem::size_of::<T>()]).to_vec()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Borrow<[u8]> for HostBuffer {
    fn borrow(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl BorrowMut<[u8]> for HostBuffer {
    fn borrow_mut(&mut self) -> &mut [u8] {
        self.as_bytes_mut()
    }
}

/// The stream of the host backend, the type of the `stream` argument its calls take where the GPU backends take
/// their stream: the host backend has none (every call has finished when it returns), so it is `()`. Write
/// `&HostStream` (the [constant](constant@HostStream) of this type); `&()` is the same value.
///
/// ```
/// use anyccl_core::{DataType, InOut, ReduceOp};
/// use anyccl_host::{communicators, HostBuffer, HostOptions, HostStream};
///
/// let comms = communicators(1, HostOptions::default())?;
/// for mut comm in comms {
///     let mut buf = HostBuffer::from_elems(&[1.0f32; 4]);
///     comm.all_reduce(InOut::InPlace(buf.as_bytes_mut()), 4, DataType::F32, ReduceOp::Sum, &HostStream)?;
///     comm.barrier(&HostStream)?;
/// }
/// # Ok::<(), anyccl_core::Error>(())
/// ```
pub type HostStream = ();

/// The one value of the [`HostStream`](type@HostStream) type: `&HostStream` is the stream argument of the host
/// backend's calls.
#[allow(non_upper_case_globals)] // Named like its type, as a unit struct's value is.
pub const HostStream: HostStream = ();

/// The host memory runtime: buffers are byte slices, streams are [`HostStream`](type@HostStream) (`()`), nothing
/// is ever captured.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostRuntime;

impl MemoryRuntime for HostRuntime {
    type Buffer = [u8];
    type OwnedBuffer = HostBuffer;
    type Stream = HostStream;

    fn location(&self) -> Location {
        Location::Host
    }

    fn alloc(&self, bytes: usize) -> Result<HostBuffer> {
        HostBuffer::try_zeroed(bytes)
    }

    fn upload(&self, dst: &mut [u8], src: &[u8], _stream: &()) -> Result<()> {
        let have = dst.len();
        let d = dst.get_mut(..src.len()).ok_or_else(|| short_copy("upload", src.len(), have))?;
        d.copy_from_slice(src);
        Ok(())
    }

    fn download(&self, src: &[u8], dst: &mut [u8], _stream: &()) -> Result<()> {
        let s = src.get(..dst.len()).ok_or_else(|| short_copy("download", dst.len(), src.len()))?;
        dst.copy_from_slice(s);
        Ok(())
    }

    fn synchronize(&self, _stream: &()) -> Result<()> {
        Ok(())
    }

    fn is_capturing(&self, _stream: &()) -> Result<bool> {
        Ok(false)
    }
}

fn short_copy(what: &'static str, need: usize, have: usize) -> Error {
    Error::InvalidArgument(InvalidArgument::BufferTooSmall {
        which: what,
        have,
        need,
        count: need,
        dtype: DataType::U8,
    })
}

/// `n` copies of `v`, reserved fallibly: [`Error::OutOfMemory`] naming `what` instead of an abort.
pub(crate) fn try_filled<T: Clone>(n: usize, v: T, what: &str) -> Result<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(n).map_err(|_| out_of_memory::<T>(n, what))?;
    out.resize(n, v);
    Ok(out)
}

/// A copy of `src`, reserved fallibly.
fn try_copy(src: &[u8], what: &str) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    out.try_reserve_exact(src.len()).map_err(|_| out_of_memory::<u8>(src.len(), what))?;
    out.extend_from_slice(src);
    Ok(out)
}

fn out_of_memory<T>(n: usize, what: &str) -> Error {
    let bytes = (n as u64).saturating_mul(std::mem::size_of::<T>() as u64);
    Error::OutOfMemory { what: what.to_owned(), bytes }
}

/// The capability report of the host backend: the backend itself, sub-communicators ([`Communicator::split`],
/// threads and processes), the element types and operators its own kernels reduce (bf16, fp8, `avg`), and nothing
/// that needs a vendor library.
pub fn host_capabilities() -> CapabilityReport {
    let mut r = CapabilityReport::all_disabled(|c| {
        let detail = if c == Capabilities::GRAPH_CAPTURE {
            "the host backend has no streams to capture"
        } else {
            "the host backend uses no vendor library or accelerator"
        };
        Reason::NotApplicable { detail: detail.to_owned() }
    });
    r.enable(Capabilities::HOST_BACKEND);
    r.enable(Capabilities::COMM_SPLIT);
    // Its own kernels reduce every data type with every operator (`reduce.rs`); the tests check the report
    // against what an all-reduce accepts.
    r.enable(Capabilities::BF16 | Capabilities::AVG | Capabilities::FP8);
    r
}

/// Two staging buffers per rank, written only by their owner and read by peers between the steps that publish and
/// release them.
type Staging = [RwLock<Vec<u64>>; 2];

struct Shared {
    world: usize,
    /// Every rank's step header: the collectives' synchronisation (sequence counters, doorbells) and the descriptor
    /// of each step, which every rank checks against its own before it reads a peer's data.
    headers: Vec<ThreadHeader>,
    staging: Vec<Staging>,
    /// Every rank's buffers of the collective in progress, for the zero-copy two-shot all-reduce.
    exposed: Vec<direct::Exposure>,
    /// Point-to-point mailboxes, index `src * world + dst`.
    mail: Vec<Mutex<VecDeque<Vec<u8>>>>,
    /// The receives' waits, and which ranks left.
    mail_sync: MailSync,
    caps: CapabilityReport,
    /// Sub-communicators being handed out by a split ([`HostComm`]'s `split`): the leader's parent rank → the new
    /// group (or why it could not be made) and how many members have yet to take it.
    splits: Mutex<HashMap<usize, Handout>>,
}

/// A sub-communicator's shared state being handed out by a split (or why it could not be made), and how many of
/// its members have yet to take it.
type Handout = (Result<Arc<Shared>>, usize);

impl Shared {
    /// The shared state of a new group of `world` ranks.
    fn new(world: usize) -> Result<Arc<Shared>> {
        if world == 0 {
            return Err(InvalidArgument::BadWorld("a communicator needs at least one rank".into()).into());
        }
        // One mailbox per (sender, receiver): world² of them, so the count is checked and reserved fallibly.
        let boxes = world.checked_mul(world).ok_or_else(|| {
            Error::from(InvalidArgument::BadWorld(format!("a host group of {world} ranks needs {world}² mailboxes")))
        })?;
        let mut mail = Vec::new();
        mail.try_reserve_exact(boxes)
            .map_err(|_| out_of_memory::<Mutex<VecDeque<Vec<u8>>>>(boxes, "the host mailboxes"))?;
        mail.extend((0..boxes).map(|_| Mutex::new(VecDeque::new())));
        let mut staging = Vec::new();
        staging.try_reserve_exact(world).map_err(|_| out_of_memory::<Staging>(world, "the host staging buffers"))?;
        staging.extend((0..world).map(|_| [RwLock::new(Vec::new()), RwLock::new(Vec::new())]));
        Ok(Arc::new(Shared {
            world,
            headers: thread_headers(world)?,
            staging,
            exposed: (0..world).map(|_| direct::Exposure::default()).collect(),
            mail,
            mail_sync: MailSync::new(world),
            caps: host_capabilities(),
            splits: Mutex::new(HashMap::new()),
        }))
    }
}

/// The ranks of the sub-communicator of `color` in a split where rank `q` passed `entries[q]` (its color, or
/// `None`, and its key): their ranks in the parent, ordered by `(key, parent rank)` (the new ranks' order).
pub(crate) fn split_members(entries: &[(Option<u32>, u32)], color: u32) -> Vec<usize> {
    let mut members: Vec<(u32, usize)> =
        entries.iter().enumerate().filter(|(_, e)| e.0 == Some(color)).map(|(q, e)| (e.1, q)).collect();
    members.sort_unstable();
    members.into_iter().map(|(_, q)| q).collect()
}

/// One rank's part of a split, as sent to its peers: whether it has a color, the color and the key.
pub(crate) fn split_entry(color: Option<u32>, key: u32) -> [u8; 9] {
    let mut e = [0u8; 9];
    e[0] = u8::from(color.is_some());
    e[1..5].copy_from_slice(&color.unwrap_or(0).to_le_bytes());
    e[5..9].copy_from_slice(&key.to_le_bytes());
    e
}

/// A peer's split entry ([`split_entry`]), or why it is malformed.
pub(crate) fn parse_split_entry(q: usize, b: &[u8]) -> Result<(Option<u32>, u32)> {
    let bad = || Error::PeerFailure(format!("rank {q} sent a malformed split request ({} bytes)", b.len()));
    let e: [u8; 9] = b.get(..9).and_then(|b| b.try_into().ok()).ok_or_else(bad)?;
    let color = u32::from_le_bytes([e[1], e[2], e[3], e[4]]);
    let key = u32::from_le_bytes([e[5], e[6], e[7], e[8]]);
    match e[0] {
        0 => Ok((None, key)),
        1 => Ok((Some(color), key)),
        _ => Err(bad()),
    }
}

/// One rank of a host communicator group. Create a group with [`create_group`] or [`communicators`], move each
/// rank to its own thread, and call the collectives through [`Communicator`].
///
/// Dropping a rank tells its peers: their next (or current) wait fails with [`Error::PeerFailure`] instead of
/// hanging.
///
/// The backend's collectives take a validated description that only [`Communicator`] makes
/// ([`anyccl_core::args`]): holding the raw backend does not let a caller describe a 4-byte buffer as 2^20
/// elements. Neither the old loose-argument call nor a forged description compiles:
///
/// ```compile_fail,E0061
/// use anyccl_core::{Algorithm, CommBackend, DataType, InOut, ReduceOp};
///
/// let mut raw = anyccl_host::create_group(1, std::time::Duration::from_secs(1)).unwrap().remove(0);
/// let mut short = [0u8; 4];
/// raw.all_reduce(Algorithm::OneShot, InOut::InPlace(&mut short[..]), 1 << 20, DataType::F32, ReduceOp::Sum, &());
/// ```
///
/// ```compile_fail,E0624
/// use anyccl_core::comm::{AllReduceArgs, AllReduceCall};
/// use anyccl_core::{Algorithm, CommBackend, DataType, InOut, ReduceOp};
///
/// let mut raw = anyccl_host::create_group(1, std::time::Duration::from_secs(1)).unwrap().remove(0);
/// let mut short = [0u8; 4];
/// let (count, dtype, op) = (1 << 20, DataType::F32, ReduceOp::Sum);
/// let call = AllReduceCall { count, dtype, op, bytes: 4 << 20, in_place: true, capturing: false, bufs: None };
/// raw.all_reduce(AllReduceArgs::new(InOut::InPlace(&mut short[..]), &(), call, Algorithm::OneShot)).unwrap();
/// ```
///
/// Through the communicator the same call is an [`Error::InvalidArgument`] and the backend never sees it:
///
/// ```
/// use anyccl_core::{DataType, Error, InOut, ReduceOp};
///
/// let mut comm = anyccl_host::communicators(1, Default::default()).unwrap().remove(0);
/// let mut short = [0u8; 4];
/// let r = comm.all_reduce(InOut::InPlace(&mut short[..]), 1 << 20, DataType::F32, ReduceOp::Sum, &());
/// assert!(matches!(r, Err(Error::InvalidArgument(_))));
/// ```
pub struct HostComm {
    rank: usize,
    shared: Arc<Shared>,
    /// This rank's place in the group's steps: every collective is a few steps, each published with a descriptor
    /// of the call that every rank checks against its own.
    steps: ShmGroup,
    /// The ring's accumulators, kept from call to call: a fresh allocation per call cost a page fault per 4 KiB
    /// touched, which made the ring several times slower from 1 MiB on.
    scratch: Vec<u128>,
    runtime: HostRuntime,
    timeout: Duration,
}

impl HostComm {
    fn new(rank: usize, shared: Arc<Shared>, timeout: Duration) -> Result<HostComm> {
        let steps = ShmGroup::in_process(rank, &shared.headers, timeout)?;
        Ok(HostComm { rank, shared, steps, scratch: Vec::new(), runtime: HostRuntime, timeout })
    }
}

/// Creates the backends of a group of `world` ranks (index = rank).
pub fn create_group(world: usize, timeout: Duration) -> Result<Vec<HostComm>> {
    let shared = Shared::new(world)?;
    (0..world).map(|rank| HostComm::new(rank, shared.clone(), timeout)).collect()
}

/// Creates a group of `world` ranks wrapped in the validating [`Communicator`] front-end (index = rank).
pub fn communicators(world: usize, options: HostOptions) -> Result<Vec<Communicator<HostComm>>> {
    Ok(create_group(world, options.timeout)?
        .into_iter()
        .map(|b| Communicator::new(b, options.selector.clone()))
        .collect())
}

impl Drop for HostComm {
    /// Tells the peers: their receives from this rank that find no message fail, and so does their next (or
    /// current) collective, naming this rank (its step header turns closed as `steps` drops).
    fn drop(&mut self) {
        self.shared.mail_sync.leave(self.rank);
    }
}

fn read_lock(l: &RwLock<Vec<u64>>) -> RwLockReadGuard<'_, Vec<u64>> {
    // A poisoned lock only means another rank's thread panicked while holding it; the data is still bytes.
    l.read().unwrap_or_else(|e| e.into_inner())
}

fn write_lock(l: &RwLock<Vec<u64>>) -> RwLockWriteGuard<'_, Vec<u64>> {
    l.write().unwrap_or_else(|e| e.into_inner())
}

/// The first `len` bytes of a staging buffer. Every rank checked that its peers run the same call before it reads
/// their staging buffers, so they hold at least `len` bytes; anything else is an internal error, not a panic.
fn bytes_of(words: &[u64], len: usize) -> Result<&[u8]> {
    let have = words.len() * 8;
    bytemuck::cast_slice(words)
        .get(..len)
        .ok_or_else(|| reduce::internal(format!("a staging buffer of {have} bytes read as {len} bytes")))
}

/// Copies `src` into the staging buffer `slot`, growing it (fallibly) where needed.
fn publish(slot: &RwLock<Vec<u64>>, src: &[u8]) -> Result<()> {
    let mut g = write_lock(slot);
    let words = src.len().div_ceil(8);
    if g.len() < words {
        let more = words - g.len();
        g.try_reserve_exact(more).map_err(|_| out_of_memory::<u64>(words, "the host staging buffer"))?;
        g.resize(words, 0);
    }
    bytemuck::cast_slice_mut::<u64, u8>(&mut g)[..src.len()].copy_from_slice(src);
    Ok(())
}

/// The block the zero-copy two-shot reduces and copies at a time (bytes): its inputs and output stay in the cache.
const DIRECT_BLOCK: usize = 32 << 10;

/// Element range `[start, end)` of chunk `i` when `count` elements are split into `n` near-equal chunks.
fn chunk(count: usize, n: usize, i: usize) -> (usize, usize) {
    (i * count / n, (i + 1) * count / n)
}

impl HostComm {
    /// Runs one collective as `what`: refused once this rank stopped after a failure; a failure inside it stops
    /// this rank (its peers see that at their next step).
    fn run<R>(&mut self, what: &str, f: impl FnOnce(&mut Call<'_>) -> Result<R>) -> Result<R> {
        let (rank, shared, scratch) = (self.rank, &*self.shared, &mut self.scratch);
        self.steps.run(|steps| f(&mut Call { rank, world: shared.world, shared, steps, scratch })).map_err(|e| {
            tracing::warn!(rank, "host {what} failed: {e}");
            e
        })
    }
}

/// One collective in progress on one rank: its steps, and the group's staging buffers.
struct Call<'a> {
    rank: usize,
    world: usize,
    shared: &'a Shared,
    steps: &'a mut ShmGroup,
    /// This rank's scratch memory (the ring's accumulators), grown on demand and kept.
    scratch: &'a mut Vec<u128>,
}

impl Call<'_> {
    /// One step: once every peer is done reading this rank's previous data, copies `src` into this rank's staging
    /// buffer `which` and publishes the step described by `desc`; returns once every rank published the same step
    /// (every peer's descriptor checked against `desc`, so ranks running different calls get an error naming the
    /// difference, never each other's bytes). The peers' staging buffers may then be read until [`Call::done`].
    fn exchange(&mut self, desc: Desc, which: usize, src: &[u8]) -> Result<()> {
        let slot = &self.shared.staging[self.rank][which];
        self.steps.exchange(desc, |_| publish(slot, src))
    }

    /// A step that publishes no data (its descriptor is still checked).
    fn exchange_none(&mut self, desc: Desc) -> Result<()> {
        self.steps.exchange(desc, |_| Ok(()))
    }

    /// Says this rank is done reading the current step's data; does not wait.
    fn done(&mut self) -> Result<()> {
        self.steps.done()
    }

    fn staged(&self, rank: usize, which: usize) -> RwLockReadGuard<'_, Vec<u64>> {
        read_lock(&self.shared.staging[rank][which])
    }

    /// One-shot: out of place every rank reduces every rank's input where it lies (two steps: everyone exposed,
    /// everyone finished); in place (where a peer would read what this rank overwrites) through the staging buffers.
    fn one_shot<T: Reducible>(&mut self, desc: Desc, input: Option<&[u8]>, buf: &mut [u8], op: Op) -> Result<()> {
        let len = buf.len();
        if input.is_some() {
            let me = direct::Exposed::new(&self.shared.exposed[self.rank], input, buf)?;
            self.steps.step(desc)?;
            {
                let view = direct::View::lock::<T>(&self.shared.exposed, len)?;
                direct::one_shot::<T>(&view, &me, op)?;
            }
            self.steps.step(desc.chunk(1))?;
            drop(me);
            return Ok(());
        }
        self.exchange(desc, 0, input.unwrap_or(buf))?;
        {
            let guards: Vec<_> = (0..self.world).map(|q| self.staged(q, 0)).collect();
            let ins: Vec<&[T]> = guards.iter().map(|g| cast::<T>(bytes_of(g, len)?)).collect::<Result<_>>()?;
            reduce_into(&ins, cast_mut::<T>(buf)?, op, self.world);
        }
        self.done()
    }

    /// Two-shot without staging: every rank exposes its buffers, then reduces its own part of every rank's input
    /// (in rank order) straight into every rank's output, block by block while the block is in the cache; two
    /// steps in all (everyone exposed, everyone finished), after which no peer touches this rank's buffers.
    fn two_shot<T: Reducible>(&mut self, desc: Desc, input: Option<&[u8]>, buf: &mut [u8], op: Op) -> Result<()> {
        let esz = std::mem::size_of::<T>();
        let len = buf.len();
        let count = len / esz;
        let (world, rank) = (self.world, self.rank);
        // This rank's own input block, copied aside in place (its output aliases it), out of the kept scratch.
        let words = (DIRECT_BLOCK / 16).max(1);
        if self.scratch.len() < words {
            let more = words - self.scratch.len();
            self.scratch.try_reserve_exact(more).map_err(|_| out_of_memory::<u128>(words, "a two-shot block"))?;
            self.scratch.resize(words, 0);
        }
        let tmp = cast_mut::<T>(bytemuck::cast_slice_mut::<u128, u8>(&mut self.scratch[..words]))?;
        let me = direct::Exposed::new(&self.shared.exposed[rank], input, buf)?;
        self.steps.step(desc)?;
        let (s, e) = chunk(count, world, rank);
        {
            let view = direct::View::lock::<T>(&self.shared.exposed, len)?;
            direct::two_shot::<T>(&view, &me, rank, s * esz..e * esz, DIRECT_BLOCK, tmp, op)?;
        }
        self.steps.step(desc.chunk(1))?;
        drop(me);
        Ok(())
    }

    /// Ring reduce-scatter then ring all-gather: step `k` publishes into staging buffer `k % 2` and reads the
    /// predecessor's.
    fn ring<T: Reducible>(&mut self, desc: Desc, input: Option<&[u8]>, buf: &mut [u8], op: Op) -> Result<()> {
        // Taken out of `self` while the steps borrow it, and kept for the next call (lost only with a failed call,
        // after which the communicator refuses further collectives anyway).
        let mut scratch = std::mem::take(&mut *self.scratch);
        let r = self.ring_in::<T>(&mut scratch, desc, input, buf, op);
        *self.scratch = scratch;
        r
    }

    /// [`Call::ring`] with its accumulators in `scratch`.
    fn ring_in<T: Reducible>(
        &mut self,
        scratch: &mut Vec<u128>,
        desc: Desc,
        input: Option<&[u8]>,
        buf: &mut [u8],
        op: Op,
    ) -> Result<()> {
        if let Some(src) = input {
            buf.copy_from_slice(src);
        }
        let world = self.world;
        let rank = self.rank;
        let esz = std::mem::size_of::<T>();
        let asz = std::mem::size_of::<T::Acc>();
        let count = buf.len() / esz;
        let pred = (rank + world - 1) % world;
        let max_chunk = count.div_ceil(world);
        // Two accumulator arrays of `max_chunk` each, out of the kept scratch memory (16-byte words: aligned for
        // every accumulator type).
        let acc_bytes = max_chunk * asz;
        let words = (2 * acc_bytes).div_ceil(16);
        if scratch.len() < words {
            let more = words - scratch.len();
            scratch.try_reserve_exact(more).map_err(|_| out_of_memory::<u128>(words, "the ring's accumulators"))?;
            scratch.resize(words, 0);
        }
        let (acc, next) = bytemuck::cast_slice_mut::<u128, u8>(&mut scratch[..words]).split_at_mut(acc_bytes);
        let mut acc = cast_mut::<T::Acc>(acc)?;
        let mut next = cast_mut::<T::Acc>(&mut next[..acc_bytes])?;

        let (s0, e0) = chunk(count, world, rank);
        load_acc::<T>(&cast::<T>(buf)?[s0..e0], &mut acc[..e0 - s0]);
        let mut acc_len = e0 - s0;
        let mut k = 0usize;
        for s in 1..world {
            k += 1;
            self.exchange(desc.chunk(k), k % 2, bytemuck::cast_slice(&acc[..acc_len]))?;
            let c = (rank + world - s) % world;
            let (cs, ce) = chunk(count, world, c);
            {
                let g = self.staged(pred, k % 2);
                let theirs = cast::<T::Acc>(bytes_of(&g, (ce - cs) * asz)?)?;
                combine_acc::<T>(theirs, &cast::<T>(buf)?[cs..ce], &mut next[..ce - cs], op);
            }
            self.done()?;
            std::mem::swap(&mut acc, &mut next);
            acc_len = ce - cs;
        }
        let fin = (rank + 1) % world;
        let (fs, fe) = chunk(count, world, fin);
        store_acc::<T>(&acc[..acc_len], &mut cast_mut::<T>(buf)?[fs..fe], op, world);

        let mut held = fin;
        for t in 1..world {
            k += 1;
            let (hs, he) = chunk(count, world, held);
            self.exchange(desc.chunk(k), k % 2, &buf[hs * esz..he * esz])?;
            let c = (rank + world + 1 - t) % world;
            let (cs, ce) = chunk(count, world, c);
            {
                let g = self.staged(pred, k % 2);
                buf[cs * esz..ce * esz].copy_from_slice(bytes_of(&g, (ce - cs) * esz)?);
            }
            self.done()?;
            held = c;
        }
        Ok(())
    }
}

fn split_io<'a>(bufs: InOut<'a, [u8]>) -> (Option<&'a [u8]>, &'a mut [u8]) {
    match bufs {
        InOut::InPlace(b) => (None, b),
        InOut::Separate { send, recv } => (Some(send), recv),
    }
}

impl CommBackend for HostComm {
    /// The operator in the host kernels' own set, resolved once per call by `check_reduction`.
    type Reduction = crate::reduce::Op;
    type Plan = ();
    type Runtime = HostRuntime;

    fn runtime(&self) -> &HostRuntime {
        &self.runtime
    }

    fn name(&self) -> &'static str {
        "host"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn vendor(&self) -> Vendor {
        Vendor::Host
    }

    fn arch(&self) -> &str {
        "host"
    }

    fn capabilities(&self) -> &CapabilityReport {
        &self.shared.caps
    }

    fn allreduce_algorithms(&self) -> &[Algorithm] {
        &ALGORITHMS
    }

    fn check_reduction(&self, dtype: DataType, op: anyccl_core::ReduceOp) -> Result<crate::reduce::Op> {
        // The host kernels implement every pair core accepts that this build knows.
        resolve(dtype, op)
    }

    fn allreduce_eligible(&self, algorithm: Algorithm, _call: &AllReduceCall) -> std::result::Result<(), String> {
        if ALGORITHMS.contains(&algorithm) {
            Ok(())
        } else {
            Err("not implemented by the host backend".to_owned())
        }
    }

    fn all_reduce(&mut self, args: AllReduceArgs<'_, Self>) -> Result<()> {
        let (algorithm, dtype, bytes) = (args.algorithm(), args.dtype(), args.bytes());
        let op = args.reduction();
        let (input, buf) = split_io(args.into_bufs());
        let input = input.map(|i| &i[..bytes]);
        let buf = &mut buf[..bytes];
        if !ALGORITHMS.contains(&algorithm) {
            return Err(Error::AlgorithmNotEligible { algorithm, why: "not implemented by the host backend".into() });
        }
        let desc = Desc::new(Kind::AllReduce, bytes, 0).reduction(dtype, op).algorithm(algorithm);
        self.run("all-reduce", |c| {
            with_type!(dtype, T => match algorithm {
                Algorithm::TwoShot => c.two_shot::<T>(desc, input, buf, op),
                Algorithm::Ring => c.ring::<T>(desc, input, buf, op),
                _ => c.one_shot::<T>(desc, input, buf, op),
            })
        })
    }

    fn all_gather(&mut self, args: AllGatherArgs<'_, Self>) -> Result<()> {
        let dtype = args.dtype();
        let part = args.count() * dtype.size_bytes();
        let (input, buf) = split_io(args.into_bufs());
        let own = self.rank * part..(self.rank + 1) * part;
        let desc = Desc::new(Kind::AllGather, part, 0).dtype(dtype);
        self.run("all-gather", |c| {
            match input {
                Some(i) => {
                    c.exchange(desc, 0, &i[..part])?;
                    buf[own].copy_from_slice(&i[..part]);
                }
                None => c.exchange(desc, 0, &buf[own])?,
            }
            for q in (0..c.world).filter(|q| *q != c.rank) {
                let g = c.staged(q, 0);
                buf[q * part..(q + 1) * part].copy_from_slice(bytes_of(&g, part)?);
            }
            c.done()
        })
    }

    fn reduce_scatter(&mut self, args: ReduceScatterArgs<'_, Self>) -> Result<()> {
        let (dtype, total) = (args.dtype(), args.bytes());
        let op = args.reduction();
        let part = args.count() * dtype.size_bytes();
        let (input, buf) = split_io(args.into_bufs());
        let desc = Desc::new(Kind::ReduceScatter, total, 0).reduction(dtype, op);
        self.run("reduce-scatter", |c| {
            let src = match input {
                Some(i) => &i[..total],
                None => &buf[..total],
            };
            c.exchange(desc, 0, src)?;
            let mine = c.rank * part..(c.rank + 1) * part;
            let out = if input.is_some() { &mut buf[..part] } else { &mut buf[mine.clone()] };
            {
                let guards: Vec<_> = (0..c.world).map(|q| c.staged(q, 0)).collect();
                with_type!(dtype, T => {
                    let ins: Vec<&[T]> = guards
                        .iter()
                        .map(|g| cast::<T>(&bytes_of(g, total)?[mine.clone()]))
                        .collect::<Result<_>>()?;
                    reduce_into(&ins, cast_mut::<T>(out)?, op, c.world);
                });
            }
            c.done()
        })
    }

    fn broadcast(&mut self, args: BroadcastArgs<'_, Self>) -> Result<()> {
        let (bytes, root, dtype) = (args.bytes(), args.root(), args.dtype());
        let (input, buf) = split_io(args.into_bufs());
        let desc = Desc::new(Kind::Broadcast, bytes, 0).dtype(dtype).root(root);
        self.run("broadcast", |c| {
            if c.rank == root {
                let src = input.map_or(&buf[..bytes], |i| &i[..bytes]);
                c.exchange(desc, 0, src)?;
                if let Some(i) = input {
                    buf[..bytes].copy_from_slice(&i[..bytes]);
                }
            } else {
                c.exchange_none(desc)?;
                let g = c.staged(root, 0);
                buf[..bytes].copy_from_slice(bytes_of(&g, bytes)?);
            }
            c.done()
        })
    }

    fn reduce(&mut self, args: ReduceArgs<'_, Self>) -> Result<()> {
        let (bytes, dtype, root) = (args.bytes(), args.dtype(), args.root());
        // On every rank, the root's peers too, so an unknown type or operator fails everywhere before anything moves.
        let op = args.reduction();
        let (input, buf) = split_io(args.into_bufs());
        let desc = Desc::new(Kind::Reduce, bytes, 0).reduction(dtype, op).root(root);
        self.run("reduce", |c| {
            c.exchange(desc, 0, input.map_or(&buf[..bytes], |i| &i[..bytes]))?;
            if c.rank == root {
                let guards: Vec<_> = (0..c.world).map(|q| c.staged(q, 0)).collect();
                with_type!(dtype, T => {
                    let ins: Vec<&[T]> =
                        guards.iter().map(|g| cast::<T>(bytes_of(g, bytes)?)).collect::<Result<_>>()?;
                    reduce_into(&ins, cast_mut::<T>(&mut buf[..bytes])?, op, c.world);
                });
            }
            c.done()
        })
    }

    fn send(&mut self, args: SendArgs<'_, Self>) -> Result<()> {
        let idx = self.rank * self.shared.world + args.peer();
        let msg = try_copy(&args.buf()[..args.bytes()], "a point-to-point message")?;
        self.shared.mail[idx].lock().unwrap_or_else(|e| e.into_inner()).push_back(msg);
        self.shared.mail_sync.notify_all();
        Ok(())
    }

    fn recv(&mut self, args: RecvArgs<'_, Self>) -> Result<()> {
        let (bytes, peer) = (args.bytes(), args.peer());
        let idx = peer * self.shared.world + self.rank;
        let msg = self.shared.mail_sync.wait_for(self.rank, peer, self.timeout, || {
            self.shared.mail[idx].lock().unwrap_or_else(|e| e.into_inner()).pop_front()
        })?;
        if msg.len() != bytes {
            let got = msg.len();
            // Put it back: a mismatched receive loses nothing.
            self.shared.mail[idx].lock().unwrap_or_else(|e| e.into_inner()).push_front(msg);
            return Err(InvalidArgument::MessageMismatch { peer, got, expected: bytes }.into());
        }
        args.into_buf()[..bytes].copy_from_slice(&msg);
        Ok(())
    }

    fn p2p(&mut self, mut args: P2pArgs<'_, '_, Self>) -> Result<()> {
        // A send only queues a copy for its peer: with every send posted first, each receive that follows is
        // matched whatever the order of the operations on each rank.
        for item in args.items() {
            if let P2pItem::Send(s) = item {
                self.send(s)?;
            }
        }
        for item in args.items() {
            if let P2pItem::Recv(r) = item {
                self.recv(r)?;
            }
        }
        Ok(())
    }

    /// The ranks exchange their (color, key) through the staging buffers; the first member of each color (in the
    /// new order) makes the new group's shared state and hands it to the others through the parent's state.
    fn split(&mut self, color: Option<u32>, key: u32) -> Result<Option<Self>> {
        let timeout = self.timeout;
        let desc = Desc::new(Kind::Split, 9, 0);
        let taken = self.run("split", |c| {
            c.exchange(desc, 0, &split_entry(color, key))?;
            let entries = (0..c.world)
                .map(|q| {
                    let g = c.staged(q, 0);
                    parse_split_entry(q, bytes_of(&g, 9)?)
                })
                .collect::<Result<Vec<_>>>();
            let mine = match (&entries, color) {
                (Ok(entries), Some(col)) => Some(split_members(entries, col)),
                _ => None,
            };
            if let Some(members) = mine.as_ref().filter(|m| m.first() == Some(&c.rank)) {
                let made = Shared::new(members.len());
                let mut splits = c.shared.splits.lock().unwrap_or_else(|e| e.into_inner());
                splits.insert(c.rank, (made, members.len()));
            }
            c.done()?;
            // Every rank has read every entry, and every leader has left its group, past this barrier.
            c.steps.barrier()?;
            entries?;
            let Some(members) = mine else { return Ok(None) };
            // This rank passed `color`, so it is one of `members`.
            let me = c.rank;
            let rank = members
                .iter()
                .position(|q| *q == me)
                .ok_or_else(|| reduce::internal(format!("rank {me} is not in its own split")))?;
            let leader = members[0];
            let mut splits = c.shared.splits.lock().unwrap_or_else(|e| e.into_inner());
            let entry = splits.get_mut(&leader).ok_or_else(|| {
                reduce::internal(format!("rank {leader} left no sub-communicator for color {color:?}"))
            })?;
            let got = entry.0.clone();
            entry.1 -= 1;
            if entry.1 == 0 {
                splits.remove(&leader);
            }
            Ok(Some((rank, got)))
        })?;
        let Some((rank, shared)) = taken else { return Ok(None) };
        Ok(Some(HostComm::new(rank, shared?, timeout)?))
    }

    fn rmsnorm_forms(&self) -> &[anyccl_core::RmsNormForm] {
        &fused::FORMS
    }

    fn all_reduce_rmsnorm(&mut self, args: anyccl_core::fused::RmsNormArgs<'_, Self>) -> Result<()> {
        let (call, form) = (*args.call(), args.form());
        let dtype = fused::element(&call)?;
        let two = fused::two_shot(form, &call);
        let algorithm = if two { Algorithm::TwoShot } else { Algorithm::OneShot };
        let desc = Desc::new(Kind::AllReduceRmsNorm, call.bytes, 0).reduction(dtype, Op::Sum).algorithm(algorithm);
        if call.bytes == 0 {
            // Nothing moves, but the ranks still check that they all make this call.
            return self.run("all-reduce + RMSNorm", |c| {
                c.exchange_none(desc)?;
                c.done()
            });
        }
        let b = args.into_bufs();
        let mut reduced = fused::reduced_buffer(&call)?;
        let input = Some(&b.input[..call.bytes]);
        let sum = reduced.as_bytes_mut();
        self.run("all-reduce + RMSNorm", |c| match (dtype, two) {
            (DataType::F16, false) => c.one_shot::<half::f16>(desc, input, sum, Op::Sum),
            (DataType::F16, true) => c.two_shot::<half::f16>(desc, input, sum, Op::Sum),
            (_, false) => c.one_shot::<half::bf16>(desc, input, sum, Op::Sum),
            (_, true) => c.two_shot::<half::bf16>(desc, input, sum, Op::Sum),
        })?;
        fused::norm_rows(&call, reduced.as_bytes(), b.residual, b.weight, b.out)
    }

    fn barrier(&mut self, _stream: &()) -> Result<()> {
        self.run("barrier", |c| c.steps.barrier())
    }
}

/// Checks the chunking used by two-shot and ring covers `[0, count)` exactly.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_partition_the_range() {
        for count in [0usize, 1, 5, 7, 1037] {
            for n in 1..=8 {
                let mut next = 0;
                for i in 0..n {
                    let (s, e) = chunk(count, n, i);
                    assert_eq!(s, next);
                    next = e;
                }
                assert_eq!(next, count);
            }
        }
    }

    #[test]
    fn world_zero_is_rejected() {
        assert!(matches!(
            create_group(0, Duration::from_secs(1)),
            Err(Error::InvalidArgument(InvalidArgument::BadWorld(_)))
        ));
    }

    /// Sizes from outside never abort the process: an impossible buffer or group is a typed error.
    #[test]
    fn impossible_sizes_are_errors_not_aborts() {
        let e = HostBuffer::try_zeroed(usize::MAX).expect_err("no such buffer");
        assert!(matches!(&e, Error::OutOfMemory { bytes, .. } if *bytes >= u64::MAX / 2), "{e:?}");
        assert!(e.to_string().starts_with("out of memory: cannot allocate"), "{e}");
        let e = HostRuntime.alloc(usize::MAX - 7).expect_err("no such buffer");
        assert!(matches!(e, Error::OutOfMemory { .. }), "{e:?}");
        assert!(matches!(
            create_group(usize::MAX, Duration::from_secs(1)),
            Err(Error::InvalidArgument(InvalidArgument::BadWorld(_)))
        ));
        assert!(matches!(create_group(1 << 31, Duration::from_secs(1)), Err(Error::OutOfMemory { .. })));
        assert_eq!(HostBuffer::try_zeroed(13).map(|b| b.len()).ok(), Some(13));
    }
}
