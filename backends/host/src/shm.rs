//! The shared-memory transport of the host backend across processes ([`crate::ProcessComm`]).
//!
//! **Segments.** Each rank creates one segment when the communicator forms: an anonymous memory file
//! (`memfd_create` with sealing allowed; it has no name in any directory, so nothing is left behind whatever
//! happens to the process), sized and reserved up front (so exhausted memory is an error at setup, not a fault
//! later), sealed with `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL` (its size can never change again, and no seal can
//! be added or removed), and mapped read-write by its owner. Its descriptor — reopened read-only through
//! `/proc/self/fd` where `/proc` is there — goes to each peer over the point-to-point mesh (`SCM_RIGHTS`, with the
//! capacity and a random 32-byte token). Each peer checks the descriptor before it maps it: the seals first (a
//! descriptor that is not a sealed memfd is refused, so a segment can never shrink under its readers and fault
//! them with `SIGBUS`), then (fstat) that it is a regular file owned by this uid of exactly the announced size; it
//! maps it **read-only** and checks its header: magic, version, capacity, rank, world, and the token, so a
//! foreign segment is refused. Each phase — create and send, then receive, check and map — ends with an agreement
//! over the bootstrap, so a rank that fails fails every rank at once with its reason.
//!
//! **Layout** (64-bit words, little-endian on the machine it runs on): a 4 KiB header — magic, version, capacity,
//! rank, world, token, state (open / closed / failed); the owner's sequence counter on its own cache line; two
//! descriptor slots saying which collective, size and chunk each step belongs to — then the data region.
//!
//! **Steps.** Every rank runs the same sequence of steps; a step is one increment of the rank's own counter. A
//! data step writes the rank's contribution into its own data region, then publishes (descriptor, then the
//! counter with `Release`); a rank reads its peers' data only once every peer's counter reached that step, and
//! says it is done reading with the next step. A rank writes its data region again only after every peer passed
//! the step after the one that data was published in, so nothing is overwritten while a peer reads it. Each step
//! compares every peer's descriptor with its own, so ranks that call different collectives (or sizes) get an
//! error instead of each other's bytes.
//!
//! **Waiting.** A wait spins for up to about 100 µs, yielding the processor now and then to a peer that runs on
//! the same one (less when recent waits were long: see `SPIN_FOR`), then sleeps on the awaited
//! peer's doorbell (a 32-bit futex word in its header) after saying so in its own header; a rank that publishes
//! bumps its doorbell and wakes it only when a peer says it sleeps on it, so the hot path makes no system call.
//!
//! **Ranks as threads** ([`ShmGroup::in_process`]) run the same steps over headers on the heap (no data region:
//! they move their data through their own staging buffers), so they check each other's calls the same way.
//!
//! **Untrusted memory.** Everything in a peer's segment can change under us, so it is only ever touched through
//! [`AtomicU64`] loads (relaxed, then an acquire fence) or, for the data region on x86-64, one `rep movsb` copy
//! (see `copy_shared`) — never a Rust reference to plain bytes there — and every header value read is checked
//! before it is used: a counter more than one step ahead, a wrong magic, an unknown state or
//! a descriptor of another collective is an [`Error::PeerFailure`] naming the rank. Garbage in a peer's data
//! region can only produce garbage numbers. The seals keep every segment's size, so no process can make a reader
//! fault; a same-uid process that reaches a segment (through `/proc`) can still write into it or punch holes in it
//! (which read as zeros), which a header check catches and a data region turns into wrong numbers: such a process
//! can signal or trace the ranks anyway.

use std::fs::File;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyccl_core::bootstrap::Bootstrap;
use anyccl_core::{Algorithm, DataType, Error, InvalidArgument, Result};

use crate::reduce::Op;
use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::{Mode, OFlags};

use crate::reduce::internal;

/// The default data capacity of a segment (bytes): collectives larger than this move in chunks.
pub const DEFAULT_SHM_CAPACITY: usize = 4 << 20;
/// The smallest data capacity accepted.
pub const MIN_SHM_CAPACITY: usize = 4 << 10;
/// The largest data capacity accepted.
pub const MAX_SHM_CAPACITY: usize = 1 << 30;

/// Bytes of the header before the data region (one page, so the data region is page-aligned).
const HEADER_BYTES: usize = 4096;
const HEADER_WORDS: usize = HEADER_BYTES / 8;
/// "anyccl" + "SH": the first word of every segment.
const MAGIC: u64 = u64::from_le_bytes(*b"anycclSH");
const VERSION: u64 = 1;
const TOKEN_LEN: usize = 32;
/// The first bytes of this rank's setup message in the bootstrap all-gather.
const SETUP_TAG: &[u8; 8] = b"anyshm01";

// Header words.
const W_MAGIC: usize = 0;
const W_VERSION: usize = 1;
const W_CAPACITY: usize = 2;
const W_RANK: usize = 3;
const W_WORLD: usize = 4;
const W_TOKEN: usize = 5;
const W_STATE: usize = W_TOKEN + TOKEN_LEN / 8;
/// After a failure: 1 + the rank the owner's error was about (0: none), for its peers' error messages.
const W_BLAME: usize = W_STATE + 1;
/// The owner's sequence counter, alone on its cache line (byte 128).
const W_SEQ: usize = 16;
/// The owner's doorbell, on the counter's cache line: only ever accessed as a 32-bit futex word (its first four
/// bytes), bumped after every publish so a peer sleeping on it wakes.
const W_WAKE: usize = 17;
/// 1 + the rank whose doorbell the owner sleeps on (0: awake), on its own cache line (byte 192): a publisher reads
/// its peers' words to learn whether a wake-up call is needed.
const W_SLEEP: usize = 24;
/// 1 + the processor the owner last published a step from (0: not yet), beside [`W_SLEEP`]: a hint only, compared
/// for equality by a peer that spins for the owner (it yields its processor only when the owner may be queued
/// behind it there).
const W_CPU: usize = 25;
/// Two descriptor slots (bytes 256 and 320): step `s` uses slot `s % 2`.
const W_DESC: usize = 32;
const DESC_WORDS: usize = 8;

const STATE_OPEN: u64 = 1;
const STATE_CLOSED: u64 = 2;
const STATE_FAILED: u64 = 3;

/// How often a long wait asks the kernel whether the awaited peer's process is still there.
const LIVENESS_EVERY: Duration = Duration::from_millis(2);

/// The data capacity actually used for `capacity` bytes asked for: checked against the limits and the world (every
/// rank needs at least 64 bytes of it in a reduce-scatter), rounded down to 64 bytes.
pub(crate) fn checked_capacity(capacity: usize, world: usize) -> Result<usize> {
    let min = MIN_SHM_CAPACITY.max(world.saturating_mul(64));
    if capacity < min || capacity > MAX_SHM_CAPACITY {
        return Err(InvalidArgument::OutOfRange {
            what: "HostOptions::shm_capacity",
            value: capacity as u64,
            min: min as u64,
            max: MAX_SHM_CAPACITY as u64,
        }
        .into());
    }
    Ok(capacity & !63)
}

/// Which collective a step belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    AllReduce = 1,
    AllGather = 2,
    ReduceScatter = 3,
    Broadcast = 4,
    Reduce = 5,
    Barrier = 6,
    /// A split into sub-communicators (ranks as threads).
    Split = 7,
    /// An all-reduce fused with RMSNorm (ranks as threads).
    AllReduceRmsNorm = 8,
}

impl Kind {
    fn name(code: u64) -> &'static str {
        match code {
            1 => "all-reduce",
            2 => "all-gather",
            3 => "reduce-scatter",
            4 => "broadcast",
            5 => "reduce",
            6 => "barrier",
            7 => "split",
            8 => "all-reduce + RMSNorm",
            _ => "an unknown step",
        }
    }
}

/// What a step is: the collective, its size and chunk, and whether the rank publishes data or is done reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Desc {
    kind: Kind,
    done: bool,
    bytes: u64,
    chunk: u64,
    root: u64,
    dtype: u64,
    op: u64,
    /// 1 + the all-reduce algorithm's index in [`Algorithm::ALL`] (0: not an all-reduce, or the only one there is).
    algorithm: u64,
}

impl Desc {
    /// A data step of `kind` over `bytes` (the call's size as every rank sees it), chunk `chunk`.
    pub(crate) fn new(kind: Kind, bytes: usize, chunk: usize) -> Self {
        Desc { kind, done: false, bytes: bytes as u64, chunk: chunk as u64, root: 0, dtype: 0, op: 0, algorithm: 0 }
    }

    /// The same with an element type (and no operator).
    pub(crate) fn dtype(mut self, dtype: DataType) -> Self {
        self.dtype = dtype_code(dtype);
        self
    }

    /// The same with the all-reduce algorithm every rank must run.
    pub(crate) fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = Algorithm::ALL.iter().position(|a| *a == algorithm).map_or(u64::MAX, |i| i as u64 + 1);
        self
    }

    /// The same for chunk `chunk`.
    pub(crate) fn chunk(mut self, chunk: usize) -> Self {
        self.chunk = chunk as u64;
        self
    }

    /// The same with a root rank.
    pub(crate) fn root(mut self, root: usize) -> Self {
        self.root = root as u64;
        self
    }

    /// The same with an element type and operator.
    pub(crate) fn reduction(mut self, dtype: DataType, op: Op) -> Self {
        self.dtype = dtype_code(dtype);
        // A fieldless enum's discriminant, the same in every rank's build of this crate.
        self.op = op as u64 + 1;
        self
    }

    fn as_done(mut self) -> Self {
        self.done = true;
        self
    }

    fn words(&self) -> [u64; 5] {
        let code = self.kind as u64 | u64::from(self.done) << 8 | self.algorithm << 16;
        [code, self.bytes, self.chunk, self.root, self.dtype << 8 | self.op]
    }

    /// A description of the words `w` (from a peer: any values) for an error message.
    fn describe(w: &[u64; 5]) -> String {
        let step = if w[0] >> 8 & 1 == 1 { "done reading" } else { "data" };
        let mut out = format!("{} of {} bytes", Kind::name(w[0] & 0xff), w[1]);
        let dtype = usize::try_from(w[4] >> 8).ok().and_then(|d| d.checked_sub(1)).and_then(|d| DataType::ALL.get(d));
        if let Some(d) = dtype {
            out.push_str(&format!(" of {d}"));
        }
        let op = usize::try_from(w[4] & 0xff).ok().and_then(|o| o.checked_sub(1)).and_then(|o| Op::ALL.get(o));
        if let Some(op) = op {
            out.push_str(&format!(", operator {op:?}"));
        }
        let algo = usize::try_from(w[0] >> 16).ok().and_then(|a| a.checked_sub(1)).and_then(|a| Algorithm::ALL.get(a));
        if let Some(a) = algo {
            out.push_str(&format!(", algorithm {a}"));
        }
        out.push_str(&format!(" (chunk {}, root {}, {step})", w[2], w[3]));
        out
    }
}

/// 1 + `dtype`'s index in [`DataType::ALL`]: the same in every rank's build of this crate.
fn dtype_code(dtype: DataType) -> u64 {
    DataType::ALL.iter().position(|d| *d == dtype).map_or(u64::MAX, |i| i as u64 + 1)
}

/// Where a segment's words live.
enum Mem {
    /// A mapping of a segment file (ranks as processes).
    Map(MmapRaw),
    /// Memory shared by the ranks of one process (ranks as threads): a header only, no data region.
    Heap(Arc<[AtomicU64]>),
}

/// One rank's segment, seen only as 64-bit atomic words.
struct Segment {
    mem: Mem,
    words: usize,
}

impl Segment {
    /// Every word of the segment.
    fn words(&self) -> &[AtomicU64] {
        match &self.mem {
            Mem::Heap(w) => w,
            // SAFETY: `map` is a live mapping of `words * 8` bytes (the file was checked to be exactly that long
            // before it was mapped) that outlives the returned borrow of `self`; mmap returns page-aligned addresses,
            // so the pointer is aligned for `AtomicU64`. `AtomicU64` has interior mutability, so a shared slice of it
            // may alias memory that the owner or another process changes concurrently; we only ever access it
            // through atomic operations, never through plain references. A peer's segment is mapped read-only, and
            // on it we only do `Relaxed` 8-byte loads, which std documents as sound on read-only memory on the
            // 64-bit targets where peers are mapped read-only (elsewhere they are mapped read-write, see
            // `map_peer`).
            Mem::Map(map) => unsafe { std::slice::from_raw_parts(map.as_ptr().cast::<AtomicU64>(), self.words) },
        }
    }

    /// Header word `i` (`i < HEADER_WORDS`, which every segment holds: a file's size is checked to be at least
    /// `HEADER_BYTES + MIN_SHM_CAPACITY` before it is mapped, and a thread's header is `HEADER_WORDS` long).
    fn word(&self, i: usize) -> &AtomicU64 {
        &self.words()[i]
    }

    /// The doorbell: the first four bytes of word [`W_WAKE`], as a futex word.
    fn doorbell(&self) -> &AtomicU32 {
        let w: *const AtomicU64 = self.word(W_WAKE);
        // SAFETY: the pointer is to a live `AtomicU64` borrowed from `self` for the returned lifetime; an
        // `AtomicU32` is smaller and no more aligned, so it lies within it and is aligned. Word `W_WAKE` is only ever
        // accessed through this view (never as a 64-bit atomic, and never through a plain reference), so there is
        // no mixed-size access; the view has interior mutability like the word itself. On a peer's read-only
        // mapping it is only loaded and handed to `futex(FUTEX_WAIT)`, which only reads it.
        unsafe { &*w.cast::<AtomicU32>() }
    }

    /// The data region (after the header; empty for a thread's header).
    fn data(&self) -> &[AtomicU64] {
        self.words().get(HEADER_WORDS..).unwrap_or(&[])
    }
}

/// Writes this rank's contribution into its own data region (see [`ShmGroup::exchange`]).
pub(crate) struct Writer<'a> {
    data: &'a [AtomicU64],
}

impl Writer<'_> {
    /// Copies `src` into the data region at byte `offset` (a multiple of 8).
    pub(crate) fn put(&self, offset: usize, src: &[u8]) -> Result<()> {
        let dst = words_at(self.data, offset, src.len())?;
        store_bytes(dst, src);
        Ok(())
    }
}

/// The words covering `len` bytes at byte `offset` of `data`, or an internal error when they do not fit.
fn words_at(data: &[AtomicU64], offset: usize, len: usize) -> Result<&[AtomicU64]> {
    let first = offset / 8;
    let bad = || internal(format!("{len} bytes at offset {offset} do not fit a {}-byte segment", data.len() * 8));
    if !offset.is_multiple_of(8) {
        return Err(bad());
    }
    let end = first.checked_add(len.div_ceil(8)).ok_or_else(bad)?;
    data.get(first..end).ok_or_else(bad)
}

/// `src` into the first `src.len()` bytes of `dst` (which holds at least that many; `words_at` sizes it).
#[cfg(target_arch = "x86_64")]
fn store_bytes(dst: &[AtomicU64], src: &[u8]) {
    let n = src.len().min(dst.len() * 8);
    let to = dst.first().map_or(std::ptr::null_mut(), |w| w.as_ptr().cast::<u8>());
    // SAFETY: see `copy_shared`: `to` points to `n <= 8 * dst.len()` bytes of `dst`'s words, which have interior
    // mutability (so writing through a pointer from a shared borrow is allowed); `src` is a separate, live slice
    // of `n` bytes (it is plain Rust memory, never a segment's words).
    unsafe { copy_shared(to, src.as_ptr(), n) };
}

/// The first `dst.len()` bytes of `src` (which holds at least that many; `words_at` sizes it) into `dst`.
#[cfg(target_arch = "x86_64")]
fn load_bytes(src: &[AtomicU64], dst: &mut [u8]) {
    let n = dst.len().min(src.len() * 8);
    let from = src.first().map_or(std::ptr::null(), |w| w.as_ptr().cast_const().cast::<u8>());
    // SAFETY: see `copy_shared`: `from` points to `n <= 8 * src.len()` bytes of `src`'s words; `dst` is an
    // exclusive borrow of `n` bytes of plain Rust memory, so the two do not overlap.
    unsafe { copy_shared(dst.as_mut_ptr(), from, n) };
}

/// Copies `n` bytes from `from` to `to` with one `rep movsb` (as fast as `memcpy` on processors with fast string
/// moves, where a loop of 8-byte atomic accesses moved a third of that). A segment's data region is only ever
/// accessed by this copy, never through a Rust reference nor by a plain Rust load or store, so the compiler assumes
/// nothing about its contents; the copy reads and writes memory as the processor defines it, so bytes that another
/// process writes meanwhile arrive as some mix of old and new bytes: data, as they were with word-wise atomic
/// copies (the headers, which the ranks synchronise on, are still only accessed as atomic words).
///
/// # Safety
///
/// `to` must be valid for writes and `from` for reads of `n` bytes (either may be null when `n` is 0), and the two
/// ranges must not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn copy_shared(to: *mut u8, from: *const u8, n: usize) {
    if n == 0 {
        return;
    }
    // SAFETY: the caller's contract: both ranges are valid for `n` bytes and disjoint. The direction flag is clear
    // on entry (the ABI guarantees it), so `rep movsb` copies forwards; it touches only rcx, rdi, rsi (declared) and
    // no flags or stack.
    unsafe {
        std::arch::asm!(
            "rep movsb",
            inout("rcx") n => _,
            inout("rdi") to => _,
            inout("rsi") from => _,
            options(nostack, preserves_flags)
        );
    }
}

/// `src` into `dst`, 8 bytes per relaxed store (the last word zero-padded).
#[cfg(not(target_arch = "x86_64"))]
fn store_bytes(dst: &[AtomicU64], src: &[u8]) {
    let mut words = dst.iter();
    let mut chunks = src.chunks_exact(8);
    // The byte chunks go first in the zip: it stops on them without taking one more word.
    for (c, w) in chunks.by_ref().zip(words.by_ref()) {
        let mut b = [0u8; 8];
        b.copy_from_slice(c);
        w.store(u64::from_ne_bytes(b), Ordering::Relaxed);
    }
    let rest = chunks.remainder();
    if let (Some(w), false) = (words.next(), rest.is_empty()) {
        let mut b = [0u8; 8];
        b[..rest.len()].copy_from_slice(rest);
        w.store(u64::from_ne_bytes(b), Ordering::Relaxed);
    }
}

/// `src` into `dst`, 8 bytes per relaxed load.
#[cfg(not(target_arch = "x86_64"))]
fn load_bytes(src: &[AtomicU64], dst: &mut [u8]) {
    let mut words = src.iter();
    let mut chunks = dst.chunks_exact_mut(8);
    for (c, w) in chunks.by_ref().zip(words.by_ref()) {
        c.copy_from_slice(&w.load(Ordering::Relaxed).to_ne_bytes());
    }
    let rest = chunks.into_remainder();
    if let Some(w) = words.next() {
        let n = rest.len();
        rest.copy_from_slice(&w.load(Ordering::Relaxed).to_ne_bytes()[..n]);
    }
}

/// The header fields a segment is created with and checked against.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HeaderFields {
    capacity: u64,
    rank: u64,
    world: u64,
    token: [u8; TOKEN_LEN],
}

fn token_words(token: &[u8; TOKEN_LEN]) -> [u64; TOKEN_LEN / 8] {
    let mut out = [0u64; TOKEN_LEN / 8];
    for (o, c) in out.iter_mut().zip(token.chunks_exact(8)) {
        let mut b = [0u8; 8];
        b.copy_from_slice(c);
        *o = u64::from_le_bytes(b);
    }
    out
}

/// Fills a fresh header (counters zero, state open).
fn write_header(h: &[AtomicU64], f: &HeaderFields) {
    let put = |i: usize, v: u64| {
        if let Some(w) = h.get(i) {
            w.store(v, Ordering::Relaxed);
        }
    };
    put(W_MAGIC, MAGIC);
    put(W_VERSION, VERSION);
    put(W_CAPACITY, f.capacity);
    put(W_RANK, f.rank);
    put(W_WORLD, f.world);
    for (i, t) in token_words(&f.token).into_iter().enumerate() {
        put(W_TOKEN + i, t);
    }
    put(W_SEQ, 0);
    put(W_BLAME, 0);
    for i in 0..2 * DESC_WORDS {
        put(W_DESC + i, 0);
    }
    put(W_STATE, STATE_OPEN);
}

/// Checks a peer's freshly mapped header against what it announced through the bootstrap: the reason if it does
/// not match.
fn check_header(h: &[AtomicU64], want: &HeaderFields) -> std::result::Result<(), String> {
    if h.len() < HEADER_WORDS {
        return Err(format!("its header holds {} words, expected {HEADER_WORDS}", h.len()));
    }
    let get = |i: usize| h[i].load(Ordering::Relaxed);
    let magic = get(W_MAGIC);
    if magic != MAGIC {
        return Err(format!("its magic is {magic:#018x}, not an anyccl segment's {MAGIC:#018x}"));
    }
    let version = get(W_VERSION);
    if version != VERSION {
        return Err(format!("its layout version is {version}, this build speaks {VERSION}"));
    }
    for (what, i, expected) in
        [("capacity", W_CAPACITY, want.capacity), ("rank", W_RANK, want.rank), ("world size", W_WORLD, want.world)]
    {
        let got = get(i);
        if got != expected {
            return Err(format!("its header says {what} {got}, but the bootstrap announced {expected}"));
        }
    }
    let token = token_words(&want.token);
    if (0..token.len()).any(|i| get(W_TOKEN + i) != token[i]) {
        return Err("its token differs from the one announced through the bootstrap (a swapped or foreign \
                    segment)"
            .to_owned());
    }
    let state = get(W_STATE);
    if state != STATE_OPEN {
        return Err(format!("its state is {state}, not open"));
    }
    let seq = get(W_SEQ);
    if seq != 0 {
        return Err(format!("its sequence counter is {seq} before the first collective"));
    }
    Ok(())
}

/// The seals every segment carries before a peer maps it: its size can never change again (so no reader can fault
/// on a page that went away), and no seal can be added or removed.
#[cfg(target_os = "linux")]
fn required_seals() -> rustix::fs::SealFlags {
    use rustix::fs::SealFlags;
    SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL
}

/// The checks on a peer's segment descriptor before it is mapped (seals first: once sealed, the size read after
/// them is final): the reason if it is refused.
#[cfg(target_os = "linux")]
fn check_descriptor(fd: std::os::fd::BorrowedFd<'_>, uid: u32, len: u64) -> std::result::Result<(), String> {
    let seals =
        rustix::fs::fcntl_get_seals(fd).map_err(|e| format!("it is not a sealable memory file (a memfd) ({e})"))?;
    if !seals.contains(required_seals()) {
        return Err(format!(
            "it is not sealed against shrinking, growing and further sealing (its seals: {seals:?}), so it could be \
             truncated under its readers"
        ));
    }
    let st = rustix::fs::fstat(fd).map_err(|e| format!("cannot stat it: {e}"))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err("it is not a regular memory file".to_owned());
    }
    if st.st_uid != uid {
        return Err(format!("it is owned by uid {}, not by this process's effective uid {uid}", st.st_uid));
    }
    if u64::try_from(st.st_size).ok() != Some(len) {
        return Err(format!("it holds {} bytes, but its rank announced {len}", st.st_size));
    }
    Ok(())
}

fn setup_error(what: String) -> Error {
    Error::PeerFailure(what)
}

/// This rank's new segment, mapped read-write, and the descriptor its peers get.
struct Created {
    seg: Segment,
    /// A read-only descriptor of the same memory where the target maps peers read-only (else a read-write one).
    share: std::os::fd::OwnedFd,
}

/// Creates this rank's segment: an anonymous memory file (`memfd_create`, so no name in any directory, nothing left
/// behind whatever happens to the process), sized, reserved, sealed against any change of size, and mapped
/// read-write.
#[cfg(target_os = "linux")]
fn create_segment(fields: &HeaderFields) -> Result<Created> {
    use rustix::fs::MemfdFlags;
    let len = HEADER_BYTES + usize::try_from(fields.capacity).map_err(|_| internal("capacity overflow".to_owned()))?;
    const NAME: &str = "anyccl-host-segment";
    let flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
    // Never executable where the kernel knows the flag (Linux 6.3; required when `vm.memfd_noexec` is 2); older
    // kernels refuse the unknown flag with EINVAL.
    let fd = match rustix::fs::memfd_create(NAME, flags | MemfdFlags::NOEXEC_SEAL) {
        Err(rustix::io::Errno::INVAL) => rustix::fs::memfd_create(NAME, flags),
        made => made,
    }
    .map_err(|e| setup_error(format!("cannot create a shared-memory segment (memfd_create): {e}")))?;
    rustix::fs::ftruncate(&fd, len as u64)
        .map_err(|e| setup_error(format!("cannot size the shared-memory segment to {len} bytes: {e}")))?;
    reserve(&fd, len)?;
    rustix::fs::fcntl_add_seals(&fd, required_seals())
        .map_err(|e| setup_error(format!("cannot seal the shared-memory segment: {e}")))?;
    let file = File::from(fd);
    let map = MmapOptions::new()
        .len(len)
        .map_raw(&file)
        .map_err(|e| setup_error(format!("cannot map the shared-memory segment: {e}")))?;
    let seg = Segment { mem: Mem::Map(map), words: len / 8 };
    write_header(seg.words(), fields);
    let share = if READ_ONLY_PEERS { read_only_view(&file).unwrap_or_else(|| file.into()) } else { file.into() };
    Ok(Created { seg, share })
}

#[cfg(not(target_os = "linux"))]
fn create_segment(_fields: &HeaderFields) -> Result<Created> {
    Err(Error::Unsupported {
        capability: "host-processes".into(),
        reason: anyccl_core::Reason::Unavailable {
            component: "sealed memory files (memfd_create)".into(),
            detail: "the host backend across processes needs Linux".into(),
        },
    })
}

/// A read-only descriptor of `file`'s memory (reopened through `/proc/self/fd`), so a peer cannot write into it
/// through the descriptor it receives; `None` where `/proc` is not there (the peers then get the read-write one and
/// still map it read-only).
#[cfg(target_os = "linux")]
fn read_only_view(file: &File) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::AsRawFd;
    let path = format!("/proc/self/fd/{}", file.as_raw_fd());
    let view = rustix::fs::open(path.as_str(), OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty());
    match view {
        Ok(v) => {
            // The same memory (a `/proc` that is not what it seems would give another file).
            let same = matches!((rustix::fs::fstat(&v), rustix::fs::fstat(file)),
                (Ok(a), Ok(b)) if a.st_dev == b.st_dev && a.st_ino == b.st_ino);
            same.then_some(v)
        }
        Err(e) => {
            tracing::debug!("no read-only view of the shared-memory segment: {e}");
            None
        }
    }
}

/// Reserves the segment's pages, so a full memory (or a memory cgroup's limit) is an error now rather than a
/// `SIGBUS` at the first write.
#[cfg(target_os = "linux")]
fn reserve(fd: &std::os::fd::OwnedFd, len: usize) -> Result<()> {
    match rustix::fs::fallocate(fd, rustix::fs::FallocateFlags::empty(), 0, len as u64) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::OPNOTSUPP) => Ok(()),
        Err(e) => Err(setup_error(format!(
            "cannot reserve {len} bytes for a shared-memory segment: {e} (HostOptions::shm_capacity chooses how much)"
        ))),
    }
}

/// Whether this target's `Relaxed` 8-byte atomic loads are documented as sound on read-only memory.
const READ_ONLY_PEERS: bool = cfg!(any(
    target_arch = "x86_64",
    target_arch = "aarch64",
    target_arch = "loongarch64",
    target_arch = "mips64",
    target_arch = "powerpc64",
    target_arch = "riscv64",
    target_arch = "sparc64",
    target_arch = "s390x"
));

/// Checks and maps rank `q`'s segment descriptor `fd`, which rank `q` announced with `fields`.
#[cfg(target_os = "linux")]
fn map_peer(q: usize, fd: std::os::fd::OwnedFd, fields: &HeaderFields, uid: u32) -> Result<Segment> {
    use std::os::fd::AsFd;
    let refuse = |why: String| setup_error(format!("rank {q}'s shared-memory segment is refused: {why}"));
    let len = (HEADER_BYTES as u64).saturating_add(fields.capacity);
    check_descriptor(fd.as_fd(), uid, len).map_err(refuse)?;
    let len = usize::try_from(len).map_err(|_| refuse(format!("{len} bytes do not fit this address space")))?;
    let file = File::from(fd);
    let mut opts = MmapOptions::new();
    opts.len(len);
    let map = if READ_ONLY_PEERS { opts.map_raw_read_only(&file) } else { opts.map_raw(&file) }
        .map_err(|e| refuse(format!("cannot map it: {e}")))?;
    let seg = Segment { mem: Mem::Map(map), words: len / 8 };
    check_header(seg.words(), fields).map_err(refuse)?;
    Ok(seg)
}

/// The message that travels with a segment's descriptor: tag, capacity, token.
const SETUP_LEN: usize = SETUP_TAG.len() + 8 + TOKEN_LEN;

/// This rank's setup message: tag, capacity, token.
fn setup_message(capacity: usize, token: &[u8; TOKEN_LEN]) -> [u8; SETUP_LEN] {
    let mut m = [0u8; SETUP_LEN];
    m[..SETUP_TAG.len()].copy_from_slice(SETUP_TAG);
    m[SETUP_TAG.len()..SETUP_TAG.len() + 8].copy_from_slice(&(capacity as u64).to_le_bytes());
    m[SETUP_TAG.len() + 8..].copy_from_slice(token);
    m
}

/// Rank `q`'s setup message, checked: its capacity and token.
fn parse_setup(q: usize, m: &[u8]) -> Result<(u64, [u8; TOKEN_LEN])> {
    if m.len() != SETUP_LEN || &m[..SETUP_TAG.len()] != SETUP_TAG {
        return Err(setup_error(format!("rank {q} sent a malformed shared-memory setup message ({} bytes)", m.len())));
    }
    let mut cap = [0u8; 8];
    cap.copy_from_slice(&m[SETUP_TAG.len()..SETUP_TAG.len() + 8]);
    let cap = u64::from_le_bytes(cap);
    if cap < MIN_SHM_CAPACITY as u64 || cap > MAX_SHM_CAPACITY as u64 || !cap.is_multiple_of(64) {
        return Err(setup_error(format!("rank {q} announced a shared-memory capacity of {cap} bytes")));
    }
    let mut token = [0u8; TOKEN_LEN];
    token.copy_from_slice(&m[SETUP_TAG.len() + 8..]);
    Ok((cap, token))
}

/// Sends this rank's setup message with the segment's descriptor attached (`SCM_RIGHTS`) on `s`.
#[cfg(target_os = "linux")]
fn send_segment(s: &UnixStream, fd: std::os::fd::BorrowedFd<'_>, msg: &[u8; SETUP_LEN]) -> std::io::Result<()> {
    use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    use std::io::Write;
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [fd];
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(std::io::Error::other("no room for a descriptor in the control message"));
    }
    let sent = loop {
        match sendmsg(s, &[std::io::IoSlice::new(msg)], &mut control, SendFlags::NOSIGNAL) {
            Ok(n) => break n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    };
    // The descriptor went with the first byte; the rest (never in practice, 48 bytes) as plain bytes.
    let mut w: &UnixStream = s;
    w.write_all(msg.get(sent..).unwrap_or(&[]))
}

/// Receives a peer's setup message and the one descriptor attached to it on `s` (within the stream's receive
/// timeout): the reason if what came is not that. Every descriptor that arrives is owned, so closed when refused.
#[cfg(target_os = "linux")]
fn recv_segment(s: &UnixStream) -> std::result::Result<(std::os::fd::OwnedFd, [u8; SETUP_LEN]), String> {
    use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags};
    use std::io::Read;
    let mut buf = [0u8; SETUP_LEN];
    // Room for two: a second one is seen (and refused) rather than silently cut off.
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = loop {
        match recvmsg(s, &mut [std::io::IoSliceMut::new(&mut buf)], &mut control, RecvFlags::CMSG_CLOEXEC) {
            Ok(m) => break m,
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => return Err("it sent no segment within the timeout".to_owned()),
            Err(e) => return Err(format!("cannot receive its segment: {e}")),
        }
    };
    let mut fds: Vec<std::os::fd::OwnedFd> = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = m {
            fds.extend(received);
        }
    }
    if msg.bytes == 0 {
        return Err("it hung up before sending its segment".to_owned());
    }
    if msg.flags.contains(ReturnFlags::CTRUNC) {
        return Err(
            "its message carried more descriptors than fit (or this process is at its descriptor limit)".to_owned()
        );
    }
    let count = fds.len();
    let fd = match (fds.pop(), count) {
        (Some(fd), 1) => fd,
        _ => return Err(format!("its setup message carried {count} descriptors, not one")),
    };
    let mut r: &UnixStream = s;
    r.read_exact(buf.get_mut(msg.bytes..).unwrap_or(&mut []))
        .map_err(|e| format!("its setup message stopped after {} bytes: {e}", msg.bytes))?;
    Ok((fd, buf))
}

#[cfg(not(target_os = "linux"))]
fn send_segment(_s: &UnixStream, _fd: std::os::fd::BorrowedFd<'_>, _msg: &[u8; SETUP_LEN]) -> std::io::Result<()> {
    Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
}

#[cfg(not(target_os = "linux"))]
fn recv_segment(_s: &UnixStream) -> std::result::Result<(std::os::fd::OwnedFd, [u8; SETUP_LEN]), String> {
    Err("descriptor passing needs Linux".to_owned())
}

#[cfg(not(target_os = "linux"))]
fn map_peer(_q: usize, _fd: std::os::fd::OwnedFd, _fields: &HeaderFields, _uid: u32) -> Result<Segment> {
    Err(internal("shared memory across processes needs Linux".to_owned()))
}

/// How a [`ShmGroup`] is made.
#[derive(Debug, Clone)]
pub(crate) struct ShmConfig {
    /// Requested data capacity per rank (checked with [`checked_capacity`]).
    pub(crate) capacity: usize,
    /// How long one wait for the peers may take.
    pub(crate) timeout: Duration,
}

/// The shared-memory segments of all ranks, and this rank's place in the step sequence.
pub(crate) struct ShmGroup {
    rank: usize,
    /// Index = rank; this rank's own segment is mapped read-write, the others read-only.
    segs: Vec<Segment>,
    /// The data capacity every rank can use: the smallest announced.
    capacity: usize,
    /// This rank's counter (the value last published).
    seq: u64,
    /// Every peer's counter is known to have reached this step, with a matching descriptor.
    synced: u64,
    /// This rank's descriptors of its last two steps (index `step % 2`).
    desc: [Desc; 2],
    /// Whether the peers' data of the current step may be read (between an exchange and the next step).
    readable: bool,
    timeout: Duration,
    /// Set by the first failure: every later step refuses.
    broken: Option<String>,
    /// The peer the last failed wait was about.
    blame: Option<usize>,
    /// Streams to the peers (duplicates of the point-to-point mesh), watched for a hang-up while waiting.
    liveness: Vec<Option<UnixStream>>,
    /// Whether the doorbells are private to this process (ranks as threads) or shared between processes.
    private: bool,
    /// How long the next wait spins before it sleeps (adapts between zero and [`SPIN_FOR`]).
    spin: Duration,
    /// Waits that did not find their peers there at once (every [`PROBE_EVERY`]th spins the full [`SPIN_FOR`]).
    waits: u32,
}

/// One rank's header when the ranks are threads of one process: shared by the ranks' [`ShmGroup`]s.
pub(crate) type ThreadHeader = Arc<[AtomicU64]>;

/// The headers of a group of `world` ranks as threads (index = rank), reserved fallibly.
pub(crate) fn thread_headers(world: usize) -> Result<Vec<ThreadHeader>> {
    let mut out = Vec::new();
    out.try_reserve_exact(world).map_err(|_| crate::out_of_memory::<ThreadHeader>(world, "the host step headers"))?;
    for rank in 0..world {
        let mut words = Vec::new();
        words
            .try_reserve_exact(HEADER_WORDS)
            .map_err(|_| crate::out_of_memory::<AtomicU64>(HEADER_WORDS, "a host step header"))?;
        words.extend((0..HEADER_WORDS).map(|_| AtomicU64::new(0)));
        let fields = HeaderFields { capacity: 0, rank: rank as u64, world: world as u64, token: [0; TOKEN_LEN] };
        write_header(&words, &fields);
        out.push(Arc::from(words));
    }
    Ok(out)
}

impl ShmGroup {
    /// Creates, exchanges, checks and maps every rank's segment (collective over `boot`): each segment's
    /// descriptor goes to each peer over `streams` (the point-to-point mesh, one stream per peer, with a receive
    /// timeout), whose hang-up later means the peer's process is gone. Each of the two phases (create and send;
    /// receive, check and map) ends with an agreement over `boot`, so a rank that fails makes every rank fail at
    /// once with its reason.
    pub(crate) fn new(boot: &mut dyn Bootstrap, cfg: &ShmConfig, streams: Vec<Option<UnixStream>>) -> Result<ShmGroup> {
        let (rank, world) = (boot.rank(), boot.world());
        let capacity = checked_capacity(cfg.capacity, world)?;
        if streams.len() != world || streams.iter().enumerate().any(|(q, s)| s.is_some() == (q == rank)) {
            return Err(internal(format!("rank {rank} of {world} got streams for the wrong peers")));
        }
        let mut token = [0u8; TOKEN_LEN];
        getrandom::fill(&mut token).map_err(|e| internal(format!("no randomness for the shared-memory token: {e}")))?;
        let fields = HeaderFields { capacity: capacity as u64, rank: rank as u64, world: world as u64, token };
        let msg = setup_message(capacity, &token);
        let sent = create_segment(&fields).and_then(|c| {
            use std::os::fd::AsFd;
            for (q, s) in streams.iter().enumerate() {
                if let Some(s) = s {
                    send_segment(s, c.share.as_fd(), &msg)
                        .map_err(|e| setup_error(format!("rank {rank} cannot send its segment to rank {q}: {e}")))?;
                }
            }
            Ok(c.seg)
        });
        let own = crate::process::agree(boot, "its shared-memory segment", sent)?;
        let received = Self::receive(rank, world, capacity, own, &streams);
        let (segs, capacity) = crate::process::agree(boot, "the peers' shared-memory segments", received)?;
        tracing::debug!(rank, world, capacity, "host shared-memory segments are mapped");
        let first = Desc::new(Kind::Barrier, 0, 0);
        Ok(ShmGroup {
            rank,
            segs,
            capacity,
            seq: 0,
            synced: 0,
            desc: [first; 2],
            readable: false,
            timeout: cfg.timeout,
            broken: None,
            blame: None,
            liveness: streams,
            private: false,
            spin: SPIN_FOR,
            waits: 0,
        })
    }

    /// Receives, checks and maps every peer's segment: the segments by rank (`own` at this rank's index) and the
    /// data capacity every rank can use (the smallest announced).
    fn receive(
        rank: usize,
        world: usize,
        capacity: usize,
        own: Segment,
        streams: &[Option<UnixStream>],
    ) -> Result<(Vec<Segment>, usize)> {
        let uid = rustix::process::geteuid().as_raw();
        let mut segs = Vec::new();
        segs.try_reserve_exact(world).map_err(|_| internal(format!("no memory for {world} segment mappings")))?;
        let mut own = Some(own);
        let mut smallest = capacity as u64;
        for (q, s) in streams.iter().enumerate() {
            let Some(s) = s else {
                segs.push(own.take().ok_or_else(|| internal("this rank's segment twice".to_owned()))?);
                continue;
            };
            let (fd, m) = recv_segment(s)
                .map_err(|why| setup_error(format!("rank {q}'s shared-memory segment is refused: {why}")))?;
            let (cap, token) = parse_setup(q, &m)?;
            smallest = smallest.min(cap);
            let want = HeaderFields { capacity: cap, rank: q as u64, world: world as u64, token };
            segs.push(map_peer(q, fd, &want, uid)?);
        }
        // `smallest` is at most this rank's own capacity, a usize.
        let capacity = usize::try_from(smallest).unwrap_or(capacity);
        if capacity / world < 64 {
            return Err(setup_error(format!(
                "the smallest shared-memory capacity announced, {capacity} bytes, leaves less than 64 bytes for each \
                 of {world} ranks (rank {rank})"
            )));
        }
        Ok((segs, capacity))
    }

    /// Rank `rank`'s steps over `headers` (one per rank, from [`thread_headers`]): ranks as threads of this
    /// process, which move their data themselves and use only the steps (no data region: capacity 0).
    pub(crate) fn in_process(rank: usize, headers: &[ThreadHeader], timeout: Duration) -> Result<ShmGroup> {
        if rank >= headers.len() {
            return Err(internal(format!("rank {rank} of a group of {} step headers", headers.len())));
        }
        let segs = headers.iter().map(|h| Segment { words: h.len(), mem: Mem::Heap(h.clone()) }).collect();
        let first = Desc::new(Kind::Barrier, 0, 0);
        Ok(ShmGroup {
            rank,
            segs,
            capacity: 0,
            seq: 0,
            synced: 0,
            desc: [first; 2],
            readable: false,
            timeout,
            broken: None,
            blame: None,
            liveness: headers.iter().map(|_| None).collect(),
            private: true,
            spin: SPIN_FOR,
            waits: 0,
        })
    }

    /// This rank.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// The data capacity of one step (bytes, a multiple of 64).
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Runs one collective: refused once the group is broken; an error inside it breaks the group (for this rank,
    /// and its peers see this rank's state turn failed), so no later call reads half-written state.
    pub(crate) fn run<R>(&mut self, f: impl FnOnce(&mut ShmGroup) -> Result<R>) -> Result<R> {
        if let Some(why) = &self.broken {
            return Err(Error::PeerFailure(format!(
                "this host communicator stopped after an earlier failure and refuses further collectives: {why}"
            )));
        }
        let r = f(self);
        if let Err(e) = &r {
            self.broken = Some(e.to_string());
            self.readable = false;
            let blame = self.blame.map_or(0, |q| q as u64 + 1);
            self.own().word(W_BLAME).store(blame, Ordering::Relaxed);
            self.own().word(W_STATE).store(STATE_FAILED, Ordering::Release);
            self.ring(true);
        }
        r
    }

    /// Bumps this rank's doorbell after a publish or a change of state, and wakes the peers sleeping on it (all of
    /// them when `always`; else only when a peer says it sleeps on this rank).
    fn ring(&self, always: bool) {
        let own = self.own();
        let bell = own.doorbell();
        bell.fetch_add(1, Ordering::Release);
        // Pairs with the fence in `sleep_on`: either the sleeper sees the new counter (or state) before it sleeps,
        // or this rank sees that it sleeps.
        fence(Ordering::SeqCst);
        let me = self.rank as u64 + 1;
        let asleep = always
            || self
                .segs
                .iter()
                .enumerate()
                .any(|(q, s)| q != self.rank && s.word(W_SLEEP).load(Ordering::Relaxed) == me);
        if asleep {
            futex_wake(bell, self.private);
        }
    }

    /// Sleeps until peer `q`'s doorbell rings or `max` passes, unless its counter already reached `target` (or it is
    /// no longer open). Spurious returns are fine: the caller looks again.
    fn sleep_on(&self, q: usize, target: u64, max: Duration) {
        let Some(seg) = self.segs.get(q) else { return };
        let bell = seg.doorbell();
        let seen = bell.load(Ordering::Acquire);
        let flag = self.own().word(W_SLEEP);
        flag.store(q as u64 + 1, Ordering::Relaxed);
        // Pairs with the fence in `ring`.
        fence(Ordering::SeqCst);
        if seg.word(W_SEQ).load(Ordering::Relaxed) < target && seg.word(W_STATE).load(Ordering::Relaxed) == STATE_OPEN {
            futex_wait(bell, seen, max, self.private);
        }
        flag.store(0, Ordering::Relaxed);
    }

    fn own(&self) -> &Segment {
        // `segs` holds one segment per rank and `rank < world` (checked when the communicator forms).
        &self.segs[self.rank]
    }

    /// One data step: waits until every peer is done with this rank's previous data, lets `write` fill this
    /// rank's data region, publishes, and waits until every peer has published the same step. The peers' data
    /// may then be [`ShmGroup::read`] until [`ShmGroup::done`].
    pub(crate) fn exchange(&mut self, desc: Desc, write: impl FnOnce(&Writer<'_>) -> Result<()>) -> Result<()> {
        if self.readable {
            // The peers may still read this rank's data of the current step until it says `done`.
            return Err(internal("a shared-memory data step before the previous one was done".to_owned()));
        }
        self.wait_all()?;
        write(&Writer { data: self.own().data() })?;
        self.arrive(desc)?;
        self.wait_all()?;
        self.readable = true;
        Ok(())
    }

    /// One step that moves no data through shared memory (ranks as threads reading each other's buffers): waits
    /// until every peer is done with the previous step, publishes `desc`, and waits until every peer published the
    /// same step (every descriptor checked against `desc`).
    pub(crate) fn step(&mut self, desc: Desc) -> Result<()> {
        if self.readable {
            return Err(internal("a step before the previous data step was done".to_owned()));
        }
        self.wait_all()?;
        self.arrive(desc)?;
        self.wait_all()
    }

    /// Copies `dst.len()` bytes at byte `offset` of rank `q`'s data region into `dst`.
    pub(crate) fn read(&self, q: usize, offset: usize, dst: &mut [u8]) -> Result<()> {
        if !self.readable {
            return Err(internal("a shared-memory read outside a data step".to_owned()));
        }
        let seg = self.segs.get(q).ok_or_else(|| internal(format!("no segment of rank {q}")))?;
        load_bytes(words_at(seg.data(), offset, dst.len())?, dst);
        Ok(())
    }

    /// Copies `src` into this rank's own data region at byte `offset` (a multiple of 8) while a step is readable.
    /// The peers may be reading this rank's data of the current step: the caller writes only to a part of its
    /// region that they do not read in this step, and publishes it with [`ShmGroup::next_step`].
    pub(crate) fn put_own(&self, offset: usize, src: &[u8]) -> Result<()> {
        if !self.readable {
            return Err(internal("a shared-memory write beside a step outside a data step".to_owned()));
        }
        Writer { data: self.own().data() }.put(offset, src)
    }

    /// The next step of one exchange, without a [`ShmGroup::done`] before it: this rank is through reading the
    /// current step's data, and publishes step `desc` (with what it wrote by [`ShmGroup::put_own`]); returns once
    /// every peer published the same step. As after [`ShmGroup::exchange`], the peers' data may then be read until
    /// [`ShmGroup::done`]. A peer that published the next step has stopped reading the current one, so the next
    /// exchange (which waits for every peer's `done` of this step) still overwrites nothing a peer reads.
    pub(crate) fn next_step(&mut self, desc: Desc) -> Result<()> {
        if !self.readable {
            return Err(internal("a shared-memory next step outside a data step".to_owned()));
        }
        self.arrive(desc)?;
        self.wait_all()?;
        self.readable = true;
        Ok(())
    }

    /// Says this rank is done reading the current step's data (the peers may overwrite theirs once every rank
    /// said so). Does not wait.
    pub(crate) fn done(&mut self) -> Result<()> {
        let desc = self.desc[(self.seq % 2) as usize].as_done();
        self.arrive(desc)
    }

    /// Returns once every rank has called it.
    pub(crate) fn barrier(&mut self) -> Result<()> {
        self.wait_all()?;
        self.arrive(Desc::new(Kind::Barrier, 0, 0))?;
        self.wait_all()
    }

    /// Publishes step `seq + 1` described by `desc`. Every peer must have reached `seq` (a wait came first), so
    /// the descriptor slot rewritten here was read by every peer already.
    fn arrive(&mut self, desc: Desc) -> Result<()> {
        if self.synced != self.seq {
            return Err(internal("a shared-memory step without waiting for the previous one".to_owned()));
        }
        self.readable = false;
        let next = self.seq + 1;
        let slot = (next % 2) as usize;
        let own = self.own();
        own.word(W_DESC + slot * DESC_WORDS).store(next, Ordering::Relaxed);
        for (i, w) in desc.words().into_iter().enumerate() {
            own.word(W_DESC + slot * DESC_WORDS + 1 + i).store(w, Ordering::Relaxed);
        }
        own.word(W_CPU).store(this_cpu() + 1, Ordering::Relaxed);
        own.word(W_SEQ).store(next, Ordering::Release);
        self.desc[slot] = desc;
        self.seq = next;
        self.ring(false);
        Ok(())
    }

    /// Waits until every peer's counter reached this rank's, checking everything read from the peers' headers.
    fn wait_all(&mut self) -> Result<()> {
        self.wait_all_inner().map_err(|(q, e)| {
            self.blame = Some(q);
            e
        })
    }

    /// [`ShmGroup::wait_all`], its error paired with the peer it is about.
    fn wait_all_inner(&mut self) -> std::result::Result<(), (usize, Error)> {
        let target = self.seq;
        if self.synced == target {
            return Ok(());
        }
        if self.first_behind(target)?.is_none() {
            return self.synced_to(target);
        }
        let start = Instant::now();
        let mut polled = start;
        let mut round = 0u32;
        let mut sleeping = false;
        let budget = if self.waits.is_multiple_of(PROBE_EVERY) { SPIN_FOR } else { self.spin };
        self.waits = self.waits.wrapping_add(1);
        let spins = budget >= SPIN_STEP;
        let cpu = this_cpu() + 1;
        loop {
            match self.first_behind(target)? {
                None => break,
                Some(q) => {
                    // Spin for the current budget, looking at the clock and yielding the processor every 32 rounds
                    // only; then sleep.
                    round = round.wrapping_add(1);
                    let spin = !sleeping && spins;
                    if spin && !round.is_multiple_of(32) {
                        std::hint::spin_loop();
                        continue;
                    }
                    let now = Instant::now();
                    let waited = now.duration_since(start);
                    if spin && waited < budget {
                        // A peer that last ran on this rank's processor may be queued behind it there: it runs
                        // now instead of after this rank's time slice. Otherwise no yield: on a loaded processor
                        // a yield hands the rest of the slice to whatever else is queued (with EEVDF, for up to a
                        // whole slice of its own), which is what a peer on another processor is waiting for.
                        let theirs = self.segs.get(q).map_or(0, |s| s.word(W_CPU).load(Ordering::Relaxed));
                        if theirs == cpu {
                            std::thread::yield_now();
                        } else {
                            std::hint::spin_loop();
                        }
                        continue;
                    }
                    sleeping = true;
                    if waited >= self.timeout {
                        let what = format!("rank {q} to reach step {target} ({})", self.current());
                        return Err((q, Error::Timeout { what, after: self.timeout }));
                    }
                    if now.duration_since(polled) >= LIVENESS_EVERY {
                        polled = now;
                        self.check_alive(q, target).map_err(|e| (q, e))?;
                    }
                    self.sleep_on(q, target, (self.timeout - waited).min(LIVENESS_EVERY));
                }
            }
        }
        // Adaptive spinning: a peer that came while this rank spun was running, and spinning catches it sooner
        // than a wake-up; one that did not was not (an oversubscribed or loaded machine), and spinning for it only
        // keeps it, or another rank, off the processor.
        self.spin = if sleeping { budget / 2 } else { (budget * 2).clamp(SPIN_STEP, SPIN_FOR) };
        self.synced_to(target)
    }

    /// Every peer's counter reached `target`: checks their descriptors of it.
    fn synced_to(&mut self, target: u64) -> std::result::Result<(), (usize, Error)> {
        // Pairs with each peer's `Release` store of its counter: its descriptor and data are visible from here on.
        fence(Ordering::Acquire);
        self.check_descs(target)?;
        self.synced = target;
        Ok(())
    }

    /// The first peer whose counter is still below `target`, after checking every peer's header words.
    fn first_behind(&self, target: u64) -> std::result::Result<Option<usize>, (usize, Error)> {
        let mut behind = None;
        for (q, seg) in self.segs.iter().enumerate() {
            if q == self.rank {
                continue;
            }
            let fail = |e: Error| Err((q, e));
            let magic = seg.word(W_MAGIC).load(Ordering::Relaxed);
            if magic != MAGIC {
                return fail(self.corrupt(q, format!("its magic changed to {magic:#018x}")));
            }
            // The state first: a peer publishes its last step before it closes (or fails), so once a closed state is
            // seen (and the fence below orders the loads), the counter read after it is final.
            let state = seg.word(W_STATE).load(Ordering::Relaxed);
            if state != STATE_OPEN {
                fence(Ordering::Acquire);
            }
            let c = seg.word(W_SEQ).load(Ordering::Relaxed);
            if c > target.saturating_add(1) {
                let why = format!("its sequence counter is {c}, more than one step ahead of this rank's {target}");
                return fail(self.corrupt(q, why));
            }
            if !matches!(state, STATE_OPEN | STATE_CLOSED | STATE_FAILED) {
                return fail(self.corrupt(q, format!("its state word is {state}")));
            }
            if c >= target {
                continue;
            }
            // Only formatted on the way to an error: this loop is the hot path of every wait.
            let when = || format!("at step {c}, before step {target} ({})", self.current());
            match state {
                STATE_OPEN => {}
                STATE_CLOSED => {
                    return fail(Error::PeerFailure(format!("rank {q} left: it closed its communicator {}", when())))
                }
                STATE_FAILED => {
                    // Display only: any value outside the world is ignored.
                    let b = seg.word(W_BLAME).load(Ordering::Relaxed);
                    let blamed = match usize::try_from(b) {
                        Ok(b) if (1..=self.segs.len()).contains(&b) => format!("; it blamed rank {}", b - 1),
                        _ => String::new(),
                    };
                    return fail(Error::PeerFailure(format!("rank {q} stopped after an error {}{blamed}", when())));
                }
                _ => return fail(self.corrupt(q, format!("its state word is {state}"))),
            }
            behind.get_or_insert(q);
        }
        Ok(behind)
    }

    fn current(&self) -> String {
        Desc::describe(&self.desc[(self.seq % 2) as usize].words())
    }

    fn corrupt(&self, q: usize, why: String) -> Error {
        Error::PeerFailure(format!("rank {q}'s shared-memory segment is corrupt: {why}"))
    }

    /// Every peer's descriptor of step `target` must equal this rank's.
    fn check_descs(&self, target: u64) -> std::result::Result<(), (usize, Error)> {
        let slot = (target % 2) as usize;
        let mine = self.desc[slot].words();
        for (q, seg) in self.segs.iter().enumerate() {
            if q == self.rank {
                continue;
            }
            let base = W_DESC + slot * DESC_WORDS;
            let tag = seg.word(base).load(Ordering::Relaxed);
            if tag != target {
                return Err((q, self.corrupt(q, format!("its descriptor of step {target} is tagged {tag}"))));
            }
            let mut theirs = [0u64; 5];
            for (i, t) in theirs.iter_mut().enumerate() {
                *t = seg.word(base + 1 + i).load(Ordering::Relaxed);
            }
            if theirs != mine {
                return Err((
                    q,
                    Error::PeerFailure(format!(
                        "rank {q} runs a different collective: at step {target} it is in the {} while rank {} is in \
                     the {} (every rank must call the same collectives with the same sizes, in the same order)",
                        Desc::describe(&theirs),
                        self.rank,
                        Desc::describe(&mine)
                    )),
                ));
            }
        }
        Ok(())
    }

    /// A peer whose point-to-point stream hung up has exited (or dropped its communicator).
    fn check_alive(&self, q: usize, target: u64) -> Result<()> {
        let Some(Some(s)) = self.liveness.get(q) else { return Ok(()) };
        #[cfg(any(target_os = "linux", target_os = "android"))]
        let events = rustix::event::PollFlags::RDHUP;
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        let events = rustix::event::PollFlags::empty();
        let mut fds = [rustix::event::PollFd::new(s, events)];
        let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
        if rustix::event::poll(&mut fds, Some(&zero)).is_err() {
            return Ok(());
        }
        let gone = rustix::event::PollFlags::HUP | rustix::event::PollFlags::ERR | rustix::event::PollFlags::NVAL;
        #[cfg(any(target_os = "linux", target_os = "android"))]
        let gone = gone | rustix::event::PollFlags::RDHUP;
        if fds[0].revents().intersects(gone) {
            // A peer that published this step and then exited is not a failure: look again after the hang-up.
            fence(Ordering::Acquire);
            if self.segs.get(q).is_some_and(|seg| seg.word(W_SEQ).load(Ordering::Relaxed) >= target) {
                return Ok(());
            }
            return Err(Error::PeerFailure(format!(
                "rank {q} is gone (its connection hung up; the process exited or was killed) while rank {} waited \
                 for step {target} ({})",
                self.rank,
                self.current()
            )));
        }
        Ok(())
    }
}

/// The longest a wait only spins: a peer that is running arrives within it. Every 32 polling rounds the spinner
/// yields its processor, but only when the awaited peer last published from that same processor (`W_CPU`), so may
/// be queued behind it. After that the wait sleeps on the awaited peer's doorbell. The budget adapts (see
/// `wait_all_inner`): it halves after each wait whose peer did not come while it spun, and doubles (from
/// [`SPIN_STEP`]) after each whose peer did; below [`SPIN_STEP`] a wait sleeps at once, and every
/// [`PROBE_EVERY`]th wait spins the full budget again to learn whether the machine got quieter. Measured on a
/// loaded 2-core machine (two ranks, Open MPI beside them in the same run, kernel 6.18): a 10 µs spin left most
/// waits asleep, and each futex wake-up tended to put both ranks on one processor (4 KiB: 11 µs against Open
/// MPI's 2.8 µs); a spin that never yields was worse when the ranks shared a processor (200 µs); one that always
/// yields lost the processor for milliseconds to the other programs queued on it (ranks as threads at 1 MiB:
/// medians of 2 to 20 ms in half the runs); yielding only to a peer on the same processor took 2.2 µs at 4 KiB
/// and 50 µs at 1 MiB with the ranks bound to cores.
const SPIN_FOR: Duration = Duration::from_micros(100);
/// The smallest spin budget: below it a wait sleeps at once.
const SPIN_STEP: Duration = Duration::from_micros(1);
/// How often (in waits that did not find their peers there at once) a wait spins the full [`SPIN_FOR`] again.
const PROBE_EVERY: u32 = 64;

/// The processor this thread runs on (a hint: it may move at any time).
#[cfg(any(target_os = "linux", target_os = "android"))]
fn this_cpu() -> u64 {
    rustix::thread::sched_getcpu() as u64
}

/// Without `getcpu`: every rank looks as if on one processor, so a spinning wait always yields.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn this_cpu() -> u64 {
    0
}

/// `FUTEX_WAIT` on `bell` while it holds `seen`, at most `max`; an early or failed return only means the caller
/// looks again.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn futex_wait(bell: &AtomicU32, seen: u32, max: Duration, private: bool) {
    use rustix::thread::futex;
    let flags = if private { futex::Flags::PRIVATE } else { futex::Flags::empty() };
    let t = futex::Timespec {
        tv_sec: futex::Secs::try_from(max.as_secs()).unwrap_or(futex::Secs::MAX),
        tv_nsec: max.subsec_nanos().into(),
    };
    if let Err(e) = futex::wait(bell, flags, seen, Some(&t)) {
        if !matches!(e, rustix::io::Errno::AGAIN | rustix::io::Errno::INTR | rustix::io::Errno::TIMEDOUT) {
            // Not expected on Linux; a short sleep keeps the wait bounded and cheap.
            tracing::trace!("futex wait failed: {e}");
            std::thread::sleep(max.min(Duration::from_micros(50)));
        }
    }
}

/// Without futexes: a short sleep.
#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn futex_wait(_bell: &AtomicU32, _seen: u32, max: Duration, _private: bool) {
    std::thread::sleep(max.min(Duration::from_micros(50)));
}

/// `FUTEX_WAKE` of every waiter on `bell`.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn futex_wake(bell: &AtomicU32, private: bool) {
    use rustix::thread::futex;
    let flags = if private { futex::Flags::PRIVATE } else { futex::Flags::empty() };
    if let Err(e) = futex::wake(bell, flags, u32::MAX >> 1) {
        tracing::trace!("futex wake failed: {e}");
    }
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn futex_wake(_bell: &AtomicU32, _private: bool) {}

impl Drop for ShmGroup {
    fn drop(&mut self) {
        if self.broken.is_none() {
            self.own().word(W_STATE).store(STATE_CLOSED, Ordering::Release);
            self.ring(true);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use anyccl_core::bootstrap::LocalGroup;

    use super::*;

    fn fields() -> HeaderFields {
        HeaderFields { capacity: 8192, rank: 1, world: 3, token: [7; TOKEN_LEN] }
    }

    fn header() -> Vec<AtomicU64> {
        let h: Vec<AtomicU64> = (0..HEADER_WORDS).map(|_| AtomicU64::new(0)).collect();
        write_header(&h, &fields());
        h
    }

    #[test]
    fn a_fresh_header_passes_its_own_check() {
        assert_eq!(check_header(&header(), &fields()), Ok(()));
    }

    /// Each header field that differs from what the bootstrap announced is refused, with a reason naming it.
    #[test]
    fn every_wrong_header_field_is_refused() {
        let cases: [(usize, u64, &str); 8] = [
            (W_MAGIC, 0x1234, "magic"),
            (W_VERSION, 2, "version"),
            (W_CAPACITY, 4096, "capacity"),
            (W_RANK, 2, "rank"),
            (W_WORLD, 4, "world size"),
            (W_TOKEN + 3, 99, "token"),
            (W_STATE, STATE_CLOSED, "state"),
            (W_SEQ, 5, "sequence counter"),
        ];
        for (word, value, says) in cases {
            let h = header();
            h[word].store(value, Ordering::Relaxed);
            let why = check_header(&h, &fields()).expect_err(says);
            assert!(why.contains(says), "word {word}: {why}");
        }
        let short: Vec<AtomicU64> = (0..HEADER_WORDS - 1).map(|_| AtomicU64::new(0)).collect();
        assert!(check_header(&short, &fields()).is_err());
    }

    #[test]
    fn a_foreign_token_is_refused() {
        let other = HeaderFields { token: [8; TOKEN_LEN], ..fields() };
        let why = check_header(&header(), &other).expect_err("another token");
        assert!(why.contains("swapped or foreign"), "{why}");
    }

    #[test]
    fn capacities_are_bounded() {
        for (cap, world) in [(0, 1), (MIN_SHM_CAPACITY - 1, 2), (MAX_SHM_CAPACITY + 1, 2), (8192, 1024)] {
            let e = checked_capacity(cap, world).expect_err("out of range");
            assert!(
                matches!(e, Error::InvalidArgument(InvalidArgument::OutOfRange { what, .. }) if what.contains("shm")),
                "{cap}: {e}"
            );
        }
        assert_eq!(checked_capacity(DEFAULT_SHM_CAPACITY, 8).ok(), Some(DEFAULT_SHM_CAPACITY));
        assert_eq!(checked_capacity(5000, 2).ok(), Some(4992));
    }

    #[test]
    fn setup_messages_round_trip_and_malformed_ones_are_refused() {
        let token = [3u8; TOKEN_LEN];
        let m = setup_message(8192, &token);
        assert_eq!(parse_setup(0, &m).expect("parses"), (8192, token));
        let mut bad_cap = m;
        bad_cap[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
        let mut bad_tag = m;
        bad_tag[0] = b'X';
        let long = [&m[..], b"x"].concat();
        for bad in [&m[..40], &m[..47], &bad_cap[..], &bad_tag[..], &long[..]] {
            assert!(matches!(parse_setup(2, bad), Err(Error::PeerFailure(w)) if w.contains("rank 2")));
        }
    }

    /// The byte copies through atomic words keep every length, including ones that end inside a word.
    #[test]
    fn bytes_survive_the_word_copies() {
        let words: Vec<AtomicU64> = (0..4).map(|_| AtomicU64::new(u64::MAX)).collect();
        for len in [0usize, 1, 7, 8, 9, 31, 32] {
            let src: Vec<u8> = (0..len as u8).map(|b| b.wrapping_mul(37)).collect();
            store_bytes(&words, &src);
            let mut back = vec![0u8; len];
            load_bytes(&words, &mut back);
            assert_eq!(back, src, "{len}");
        }
        assert!(words_at(&words, 4, 8).is_err(), "unaligned");
        assert!(words_at(&words, 8, 25).is_err(), "past the end");
        assert!(words_at(&words, usize::MAX - 7, 16).is_err(), "overflowing");
        assert_eq!(words_at(&words, 8, 24).map(<[_]>::len).ok(), Some(3));
    }

    fn uid() -> u32 {
        rustix::process::geteuid().as_raw()
    }

    fn small() -> HeaderFields {
        HeaderFields { capacity: MIN_SHM_CAPACITY as u64, rank: 0, world: 2, token: [5; TOKEN_LEN] }
    }

    /// A memfd of `len` bytes with `seals`.
    fn memfd(len: u64, seals: rustix::fs::SealFlags) -> std::os::fd::OwnedFd {
        use rustix::fs::MemfdFlags;
        let fd = rustix::fs::memfd_create("test", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).expect("memfd");
        rustix::fs::ftruncate(&fd, len).expect("size");
        rustix::fs::fcntl_add_seals(&fd, seals).expect("seals");
        fd
    }

    /// What a peer's descriptor must be before it is mapped: sealed, a memory file of this uid, of the size
    /// announced; a plain file, a pipe, an unsealed or partly sealed memfd and another size are refused.
    #[test]
    fn descriptors_that_are_not_sealed_segments_are_refused() {
        use rustix::fs::SealFlags;
        use std::os::fd::AsFd;
        let len = (HEADER_BYTES + MIN_SHM_CAPACITY) as u64;
        assert_eq!(check_descriptor(memfd(len, required_seals()).as_fd(), uid(), len), Ok(()));
        let cases: Vec<(std::os::fd::OwnedFd, u32, &str)> = vec![
            (memfd(len, SealFlags::empty()), uid(), "not sealed"),
            (memfd(len, SealFlags::SHRINK | SealFlags::SEAL), uid(), "not sealed"),
            (memfd(len + 4096, required_seals()), uid(), "holds 12288 bytes"),
            (memfd(len, required_seals()), uid().wrapping_add(1), "owned by uid"),
            (tempfile::tempfile().expect("file").into(), uid(), "not a sealable memory file"),
            (std::io::pipe().expect("pipe").0.into(), uid(), "not a sealable memory file"),
        ];
        for (fd, owner, says) in cases {
            let why = check_descriptor(fd.as_fd(), owner, len).expect_err(says);
            assert!(why.contains(says), "{says}: {why}");
        }
    }

    /// A segment cannot be truncated, grown or resealed, not even through a read-write descriptor a same-uid
    /// process reopens from `/proc` (the way an outsider would reach it); the peers' descriptor is read-only.
    #[test]
    fn a_segment_cannot_be_truncated_grown_or_unsealed() {
        use std::os::fd::AsRawFd;
        let c = create_segment(&small()).expect("segment");
        let len = (HEADER_BYTES + MIN_SHM_CAPACITY) as u64;
        let path = format!("/proc/self/fd/{}", c.share.as_raw_fd());
        let rw = rustix::fs::open(path.as_str(), OFlags::RDWR | OFlags::CLOEXEC, Mode::empty()).expect("reopen");
        assert_eq!(rustix::fs::ftruncate(&rw, 4096), Err(rustix::io::Errno::PERM), "shrink");
        assert_eq!(rustix::fs::ftruncate(&rw, len * 2), Err(rustix::io::Errno::PERM), "grow");
        let grow = rustix::fs::fallocate(&rw, rustix::fs::FallocateFlags::empty(), 0, len * 2);
        assert_eq!(grow, Err(rustix::io::Errno::PERM), "grow by fallocate");
        let seal = rustix::fs::fcntl_add_seals(&rw, rustix::fs::SealFlags::WRITE);
        assert_eq!(seal, Err(rustix::io::Errno::PERM), "no seal can be added");
        assert_eq!(rustix::fs::fstat(&rw).expect("stat").st_size as u64, len);
        let mode = rustix::fs::fcntl_getfl(&c.share).expect("flags") & OFlags::RWMODE;
        assert_eq!(mode, OFlags::RDONLY, "the peers get a read-only descriptor");
        assert_eq!(rustix::fs::ftruncate(&c.share, 0), Err(rustix::io::Errno::INVAL));
        assert_eq!(check_header(c.seg.words(), &small()), Ok(()));
        // Punching a hole keeps the size (the seals allow it, as they allow writing): the pages read as zeros
        // afterwards, never as a fault, and a zeroed header is refused like any other garbage.
        let punch = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
        rustix::fs::fallocate(&rw, punch, 0, 4096).expect("punch a hole");
        assert_eq!(rustix::fs::fstat(&rw).expect("stat").st_size as u64, len);
        let why = check_header(c.seg.words(), &small()).expect_err("a zeroed header");
        assert!(why.contains("magic"), "{why}");
    }

    /// A connected pair of streams for ranks 0 and 1 (each rank's streams by peer), with receive timeouts.
    fn streams(timeout: Duration) -> [Vec<Option<UnixStream>>; 2] {
        let (a, b) = UnixStream::pair().expect("pair");
        for s in [&a, &b] {
            s.set_read_timeout(Some(timeout)).expect("timeout");
        }
        [vec![None, Some(a)], vec![Some(b), None]]
    }

    fn config(timeout: Duration) -> ShmConfig {
        ShmConfig { capacity: MIN_SHM_CAPACITY, timeout }
    }

    /// Two ranks as threads over a `LocalGroup`.
    fn pair(timeout: Duration) -> (ShmGroup, ShmGroup) {
        let group = LocalGroup::new(2, Duration::from_secs(20));
        let cfg = config(timeout);
        let [s0, s1] = streams(Duration::from_secs(20));
        std::thread::scope(|s| {
            let mk = |r: usize, streams: Vec<Option<UnixStream>>| {
                let (group, cfg) = (group.clone(), cfg.clone());
                s.spawn(move || ShmGroup::new(&mut group.member(r), &cfg, streams).expect("segments"))
            };
            let (a, b) = (mk(0, s0), mk(1, s1));
            (a.join().expect("rank 0"), b.join().expect("rank 1"))
        })
    }

    /// Data steps carry every round's data, and no rank overwrites its data before its peer has read it (rank 1
    /// reads slowly every few rounds; a write that did not wait would show as a value of the next round).
    #[test]
    fn rounds_of_data_arrive_whole_and_are_not_overwritten_early() {
        let (a, b) = pair(Duration::from_secs(20));
        let len = MIN_SHM_CAPACITY;
        std::thread::scope(|s| {
            for (me, mut g) in [(0u8, a), (1u8, b)] {
                s.spawn(move || {
                    let mut got = vec![0u8; len];
                    for round in 0..300usize {
                        let mine = vec![me.wrapping_mul(100).wrapping_add(round as u8); len];
                        let desc = Desc::new(Kind::AllGather, len, round);
                        g.run(|g| g.exchange(desc, |w| w.put(0, &mine))).expect("exchange");
                        if me == 1 && round % 50 == 0 {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        g.read(1 - usize::from(me), 0, &mut got).expect("read");
                        let want = (1 - me).wrapping_mul(100).wrapping_add(round as u8);
                        assert!(got.iter().all(|b| *b == want), "rank {me} round {round}");
                        g.run(ShmGroup::done).expect("done");
                    }
                    g.run(ShmGroup::barrier).expect("barrier");
                });
            }
        });
    }

    /// Rank 0 writes garbage into its own header; rank 1 gets an error naming rank 0 (not undefined behaviour, not
    /// a hang), and refuses every later call.
    #[test]
    fn garbage_in_a_peer_header_is_an_error_naming_it() {
        let cases: [(usize, u64, &str); 4] = [
            (W_SEQ, 1 << 40, "more than one step ahead"),
            (W_MAGIC, 0xdead_beef, "magic changed"),
            (W_STATE, 77, "state word is 77"),
            (W_DESC + DESC_WORDS, 99, "tagged 99"),
        ];
        for (word, value, says) in cases {
            let (a, mut b) = pair(Duration::from_secs(20));
            if word == W_DESC + DESC_WORDS {
                // A published step whose descriptor slot holds another step's tag.
                a.own().word(W_SEQ).store(1, Ordering::Release);
            }
            a.own().word(word).store(value, Ordering::Release);
            let t = Instant::now();
            let e = b.run(ShmGroup::barrier).expect_err(says);
            assert!(t.elapsed() < Duration::from_secs(5), "{says}: took {:?}", t.elapsed());
            assert!(matches!(&e, Error::PeerFailure(w) if w.contains("rank 0") && w.contains(says)), "{e}");
            let again = b.run(ShmGroup::barrier).expect_err("broken");
            assert!(again.to_string().contains("refuses further collectives"), "{again}");
            assert_eq!(b.own().word(W_STATE).load(Ordering::Relaxed), STATE_FAILED);
            assert_eq!(b.own().word(W_BLAME).load(Ordering::Relaxed), 1, "rank 1 blames rank 0");
        }
    }

    #[test]
    fn a_peer_that_stalls_is_a_timeout_naming_it() {
        let (_a, mut b) = pair(Duration::from_millis(300));
        let t = Instant::now();
        let e = b.run(ShmGroup::barrier).expect_err("rank 0 never comes");
        let took = t.elapsed();
        assert!(matches!(&e, Error::Timeout { what, .. } if what.contains("rank 0")), "{e}");
        assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(3), "{took:?}");
    }

    #[test]
    fn a_peer_that_closed_or_failed_fails_its_peers_at_once() {
        let (a, mut b) = pair(Duration::from_secs(20));
        drop(a);
        let t = Instant::now();
        let e = b.run(ShmGroup::barrier).expect_err("rank 0 is gone");
        assert!(matches!(&e, Error::PeerFailure(w) if w.contains("rank 0 left: it closed its communicator")), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());

        let (mut a, mut b) = pair(Duration::from_secs(20));
        b.blame = Some(1);
        let _ = b.run(|_| -> Result<()> { Err(Error::PeerFailure("a test failure".into())) });
        let e = a.run(ShmGroup::barrier).expect_err("rank 1 failed");
        assert!(matches!(&e, Error::PeerFailure(w) if w.contains("rank 1 stopped after an error")), "{e}");
    }

    /// Ranks calling different collectives (here: sizes) both get an error describing both calls.
    #[test]
    fn different_collectives_are_refused_on_every_rank() {
        let (a, b) = pair(Duration::from_secs(20));
        let errs: Vec<Error> = std::thread::scope(|s| {
            let hs: Vec<_> = [(a, 100usize), (b, 200)]
                .into_iter()
                .map(|(mut g, bytes)| {
                    s.spawn(move || {
                        let desc = Desc::new(Kind::AllReduce, bytes, 0).reduction(DataType::F32, Op::Sum);
                        g.run(|g| g.exchange(desc, |_| Ok(()))).expect_err("sizes differ")
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        for e in errs {
            let w = e.to_string();
            assert!(w.contains("different collective") && w.contains("100 bytes") && w.contains("200 bytes"), "{w}");
        }
    }

    /// Rank 1 sets up for real while a forged rank 0 agrees to everything and `send`s what it likes on its stream:
    /// rank 1's error, after checking that the forged rank heard it in the agreement, and within a bound.
    fn refused(send: impl FnOnce(&UnixStream) + Send) -> String {
        let group: Arc<LocalGroup> = LocalGroup::new(2, Duration::from_secs(20));
        let cfg = config(Duration::from_secs(20));
        let [s0, s1] = streams(Duration::from_secs(1));
        let t = Instant::now();
        let (heard, r1) = std::thread::scope(|s| {
            let forged = s.spawn(|| {
                let mut me = group.member(0);
                let stream = s0.into_iter().flatten().next().expect("stream to rank 1");
                send(&stream);
                me.all_gather(&[0]).expect("first agreement");
                let heard = me.all_gather(&[0]).expect("second agreement");
                drop(stream);
                heard
            });
            let real = s.spawn(|| ShmGroup::new(&mut group.member(1), &cfg, s1).map(|_| ()));
            (forged.join().expect("rank 0"), real.join().expect("rank 1"))
        });
        assert!(t.elapsed() < Duration::from_secs(10), "took {:?}", t.elapsed());
        let e = r1.expect_err("the forged segment is refused");
        let w = e.to_string();
        assert!(matches!(e, Error::PeerFailure(_)), "{e:?}");
        assert!(w.contains("rank 0's shared-memory segment is refused"), "{w}");
        assert_eq!(heard[1].first(), Some(&1), "rank 1 told the others why");
        assert!(String::from_utf8_lossy(&heard[1]).contains("refused"), "{:?}", heard[1]);
        w
    }

    fn send_fds(s: &UnixStream, fds: &[std::os::fd::BorrowedFd<'_>], msg: &[u8]) {
        use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() {
            assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
        }
        sendmsg(s, &[std::io::IoSlice::new(msg)], &mut control, SendFlags::empty()).expect("sendmsg");
    }

    /// A real segment of rank 0 of 2 (header filled), not sealed.
    fn unsealed_segment(fields: &HeaderFields) -> std::os::fd::OwnedFd {
        let len = HEADER_BYTES + fields.capacity as usize;
        let fd = memfd(len as u64, rustix::fs::SealFlags::empty());
        let file = File::from(fd);
        let map = MmapOptions::new().len(len).map_raw(&file).expect("map");
        let seg = Segment { mem: Mem::Map(map), words: len / 8 };
        write_header(seg.words(), fields);
        file.into()
    }

    #[test]
    fn a_segment_that_is_not_sealed_is_refused() {
        use std::os::fd::AsFd;
        let f = small();
        let fd = unsealed_segment(&f);
        let w = refused(|s| send_fds(s, &[fd.as_fd()], &setup_message(MIN_SHM_CAPACITY, &f.token)));
        assert!(w.contains("not sealed"), "{w}");
    }

    #[test]
    fn a_segment_of_another_size_than_announced_is_refused() {
        use std::os::fd::AsFd;
        let f = small();
        let c = create_segment(&f).expect("segment");
        let w = refused(|s| send_fds(s, &[c.share.as_fd()], &setup_message(2 * MIN_SHM_CAPACITY, &f.token)));
        assert!(w.contains("holds 8192 bytes"), "{w}");
    }

    #[test]
    fn a_swapped_segment_with_another_token_is_refused() {
        use std::os::fd::AsFd;
        // A real sealed segment of "rank 0 of 2" from another job (another token).
        let c = create_segment(&HeaderFields { token: [9; TOKEN_LEN], ..small() }).expect("segment");
        let w = refused(|s| send_fds(s, &[c.share.as_fd()], &setup_message(MIN_SHM_CAPACITY, &small().token)));
        assert!(w.contains("swapped or foreign"), "{w}");
    }

    #[test]
    fn a_plain_file_or_a_pipe_instead_of_a_segment_is_refused() {
        use std::os::fd::AsFd;
        let file = tempfile::tempfile().expect("file");
        file.set_len((HEADER_BYTES + MIN_SHM_CAPACITY) as u64).expect("size");
        let w = refused(|s| send_fds(s, &[file.as_fd()], &setup_message(MIN_SHM_CAPACITY, &small().token)));
        assert!(w.contains("not a sealable memory file"), "{w}");
        let (r, _w) = std::io::pipe().expect("pipe");
        let w = refused(|s| send_fds(s, &[r.as_fd()], &setup_message(MIN_SHM_CAPACITY, &small().token)));
        assert!(w.contains("not a sealable memory file"), "{w}");
    }

    #[test]
    fn a_setup_message_with_no_or_two_descriptors_is_refused() {
        use std::os::fd::AsFd;
        let c = create_segment(&small()).expect("segment");
        let m = setup_message(MIN_SHM_CAPACITY, &small().token);
        let w = refused(|s| send_fds(s, &[], &m));
        assert!(w.contains("carried 0 descriptors"), "{w}");
        let w = refused(|s| send_fds(s, &[c.share.as_fd(), c.share.as_fd()], &m));
        assert!(w.contains("carried 2 descriptors"), "{w}");
    }

    /// A peer that agrees it sent its segment but sends nothing costs one stream timeout (1 s here), not more.
    #[test]
    fn a_silent_peer_is_refused_within_the_stream_timeout() {
        let w = refused(|_| {});
        assert!(w.contains("sent no segment within the timeout"), "{w}");
    }

    /// A peer that drips its setup message a byte at a time and then stops is refused within the stream timeout.
    #[test]
    fn a_dripping_peer_is_refused() {
        use std::io::Write;
        let w = refused(|s| {
            let mut s = s;
            let m = setup_message(MIN_SHM_CAPACITY, &small().token);
            for b in &m[..3] {
                s.write_all(&[*b]).expect("drip");
            }
        });
        assert!(w.contains("carried 0 descriptors") || w.contains("stopped after"), "{w}");
    }
}
