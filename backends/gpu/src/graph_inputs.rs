//! Inputs of custom all-reduces captured in graphs ("graph buffers"), for every vendor.
//!
//! Outside capture the custom kernels copy each rank's input into its peer-visible staging buffer (inside the
//! kernel, before the first barrier). Inside a capture, an input seen for the first time gets a slot: an input
//! table in device memory that the captured kernel reads at every replay. The table starts as "staging" (every
//! rank's staging buffer, and the kernel copies its own input in first), so a graph replayed before registration
//! is still correct. After capture, [`GraphInputs::register`] (collective) exchanges the inputs' allocations
//! between the ranks: legacy IPC handles between processes, plain pointers between the communicators of one
//! process, opens the peers' ones, agrees on which inputs every rank could map, and rewrites those tables with
//! every rank's input. Later replays then read the inputs directly, with no staging copy.
//!
//! Inputs are known by their device pointer and the platform's buffer id ([`GpuPlatform::buffer_id`]), so a freed
//! and reallocated buffer at the same address is a new input where the platform can tell. Like every collective's
//! buffers, graph inputs must correspond across ranks (the same captures in the same order on every rank) and stay
//! allocated while their graphs may be replayed.

use std::collections::HashMap;

use anyccl_core::bootstrap::{Bootstrap, LocalRank};
pub use anyccl_core::comm::GraphRegistration;
use anyccl_core::{Error, MemoryRuntime, Result};

use super::kernels::{input_table, INPUT_TABLE_BYTES};
use super::{BufferOf, GpuPlatform, StreamOf, LEGACY_HANDLE_BYTES};
use crate::device::GpuRuntime;

/// Most distinct graph inputs one communicator keeps tables for; captures beyond it copy through staging.
pub const MAX_GRAPH_INPUTS: usize = 2048;
/// Bytes between two input tables in device memory.
const TABLE_STRIDE: usize = 128;
/// Inputs exchanged per all-gather round (keeps every message far below the rendezvous' size limit).
const BATCH: usize = 256;
/// One input's entry in the exchange: a flag (exportable or not), an IPC handle, the allocation's size, and the
/// input's offset in it (between processes) or its address (within one process).
const ENTRY: usize = 1 + LEGACY_HANDLE_BYTES + 8 + 8;

/// How the ranks of a communicator reach each other's memory.
#[non_exhaustive]
pub enum Transport {
    /// One process per GPU: legacy IPC handles through the caller's bootstrap.
    Ipc,
    /// One process for all ranks (peer access enabled): plain pointers through an in-process group.
    InProcess(LocalRank),
}

struct Slot {
    ptr: u64,
    /// Whether a registration has dealt with it (registered, or left on staging for good).
    handled: bool,
}

/// One rank's graph-input tables and registrations.
pub struct GraphInputs<P: GpuPlatform> {
    device: DeviceSide<P>,
    slots: Vec<Slot>,
    by_key: HashMap<(u64, u64), usize>,
    rank: usize,
    world: usize,
    /// The form every table starts in (every rank's staging buffer), which a failed registration writes back.
    staging: [u8; INPUT_TABLE_BYTES],
    /// Why the tables may no longer be read (a registration could not put them back to staging on some rank).
    unusable: Option<String>,
}

/// What registration does to memory, behind a seam so that the collective protocol ([`register_inputs`]) is
/// tested without a GPU.
trait Registrar {
    /// This rank's entry for input `ptr` (without the leading "exportable" flag).
    fn export(&self, ptr: u64) -> Result<[u8; ENTRY - 1]>;
    /// Rank `q`'s input as addressable here, from its entry.
    fn open(&mut self, q: usize, entry: &[u8]) -> Result<u64>;
    /// Writes input table `slot`.
    fn write_table(&mut self, slot: usize, table: &[u8; INPUT_TABLE_BYTES]) -> Result<()>;
}

/// The device side of [`GraphInputs`]: the tables, the transport, and the peers' allocations opened so far.
struct DeviceSide<P: GpuPlatform> {
    runtime: P::Runtime,
    tables: BufferOf<P>,
    /// A stream of its own for writing tables.
    stream: StreamOf<P>,
    opened: HashMap<(usize, [u8; LEGACY_HANDLE_BYTES]), P::Mapping>,
    transport: Transport,
}

fn backend<P: GpuPlatform>(call: &str, message: String) -> Error {
    Error::backend(P::NAME, call, None, message)
}

impl<P: GpuPlatform> Registrar for DeviceSide<P> {
    /// Between processes the input's allocation as an IPC handle and its offset; within one process its address.
    fn export(&self, ptr: u64) -> Result<[u8; ENTRY - 1]> {
        P::legacy_ipc_capable(&self.runtime, ptr)?;
        let (base, size) = self.runtime.address_range(ptr)?;
        let mut e = [0u8; ENTRY - 1];
        match self.transport {
            Transport::Ipc => {
                e[..LEGACY_HANDLE_BYTES].copy_from_slice(&P::ipc_export(&self.runtime, base)?);
                e[LEGACY_HANDLE_BYTES + 8..].copy_from_slice(&(ptr - base).to_le_bytes());
            }
            Transport::InProcess(_) => e[LEGACY_HANDLE_BYTES + 8..].copy_from_slice(&ptr.to_le_bytes()),
        }
        e[LEGACY_HANDLE_BYTES..LEGACY_HANDLE_BYTES + 8].copy_from_slice(&(size as u64).to_le_bytes());
        Ok(e)
    }

    fn open(&mut self, q: usize, e: &[u8]) -> Result<u64> {
        // `e` is one entry of an exchange whose length register_inputs checked: ENTRY - 1 bytes.
        let word = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&e[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let (size, last) = (word(LEGACY_HANDLE_BYTES), word(LEGACY_HANDLE_BYTES + 8));
        match self.transport {
            Transport::InProcess(_) => Ok(last),
            Transport::Ipc => {
                if last >= size {
                    return Err(backend::<P>("graph buffers", format!("rank {q} sent offset {last} in {size} bytes")));
                }
                let len = usize::try_from(size)
                    .map_err(|_| backend::<P>("graph buffers", format!("rank {q} sent a size of {size} bytes")))?;
                let mut handle = [0u8; LEGACY_HANDLE_BYTES];
                handle.copy_from_slice(&e[..LEGACY_HANDLE_BYTES]);
                let m = match self.opened.entry((q, handle)) {
                    std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                    std::collections::hash_map::Entry::Vacant(v) => v.insert(P::ipc_open(&self.runtime, &handle, len)?),
                };
                Ok(P::mapping_ptr(m) + last)
            }
        }
    }

    fn write_table(&mut self, slot: usize, t: &[u8; INPUT_TABLE_BYTES]) -> Result<()> {
        let at = slot * TABLE_STRIDE;
        let mut view = self.tables.view_mut(at..at + INPUT_TABLE_BYTES)?;
        // Waits for the copy (the runtime's upload synchronises its stream).
        self.runtime.upload(&mut view, t, &self.stream)
    }
}

impl<P: GpuPlatform> GraphInputs<P> {
    /// Tables for `MAX_GRAPH_INPUTS` inputs, every one "staging" (`staging[r]`: rank r's staging buffer as
    /// addressable here). Not during capture.
    pub fn new(runtime: &P::Runtime, staging: Vec<u64>, rank: usize, transport: Transport) -> Result<Self> {
        let world = staging.len();
        let mut tables = runtime.alloc(MAX_GRAPH_INPUTS * TABLE_STRIDE)?;
        let one = input_table(&staging, false);
        let mut host = vec![0u8; MAX_GRAPH_INPUTS * TABLE_STRIDE];
        for t in host.chunks_exact_mut(TABLE_STRIDE) {
            t[..INPUT_TABLE_BYTES].copy_from_slice(&one);
        }
        let stream = P::stream(runtime)?;
        runtime.upload(&mut tables, &host, &stream)?;
        Ok(GraphInputs {
            device: DeviceSide { runtime: runtime.clone(), tables, stream, opened: HashMap::new(), transport },
            slots: Vec::new(),
            by_key: HashMap::new(),
            rank,
            world,
            staging: one,
            unusable: None,
        })
    }

    /// The device address of the table for input `ptr` (a capture is running), making a slot for an input seen
    /// for the first time; `None` when every slot is taken or the pointer is not device memory the driver knows
    /// (the call then copies through staging, outside any table).
    pub fn table_for(&mut self, ptr: u64) -> Option<u64> {
        let id = P::buffer_id(&self.device.runtime, ptr).ok()?;
        let slot = match self.by_key.get(&(ptr, id)) {
            Some(s) => *s,
            None => {
                if self.slots.len() >= MAX_GRAPH_INPUTS {
                    tracing::warn!(
                        max = MAX_GRAPH_INPUTS,
                        "all graph-input tables are taken; this captured all-reduce copies through staging"
                    );
                    return None;
                }
                self.slots.push(Slot { ptr, handled: false });
                self.by_key.insert((ptr, id), self.slots.len() - 1);
                self.slots.len() - 1
            }
        };
        Some(self.device.tables.device_ptr() + (slot * TABLE_STRIDE) as u64)
    }

    /// Why these tables may no longer be read by any kernel: a registration failed and could not put some rank's
    /// tables back to staging, so the ranks' tables may disagree. The communicator then turns its custom kernels
    /// off (on every rank alike: every rank's registration reports it from the same exchange).
    pub fn unusable(&self) -> Option<&str> {
        self.unusable.as_deref()
    }

    /// Inputs seen in captures and not registered yet.
    pub fn pending(&self) -> usize {
        self.slots.iter().filter(|s| !s.handled).count()
    }

    /// Registers every input seen in captures since the last call: collective (every rank calls it after the
    /// same captures, before replaying them). `ex` is the bootstrap for [`Transport::Ipc`]; in-process
    /// communicators use their own group and ignore it. No graph of this communicator may be running.
    ///
    /// Fails on every rank alike when a table write failed on any rank: every rank has then put the tables back
    /// to staging, and the inputs stay pending. Where that too failed somewhere, [`Self::unusable`] says so.
    pub fn register(&mut self, ex: Option<&mut dyn Bootstrap>) -> Result<GraphRegistration> {
        let mut local;
        let ex: &mut dyn Bootstrap = match (&self.device.transport, ex) {
            (Transport::InProcess(l), _) => {
                local = l.clone();
                &mut local
            }
            (Transport::Ipc, Some(ex)) => ex,
            (Transport::Ipc, None) => {
                return Err(backend::<P>(
                    "register_graph_buffers",
                    "a one-process-per-GPU communicator registers graph buffers through its bootstrap (the \
                     rendezvous it was made with, or the engine's own); pass it"
                        .into(),
                ))
            }
        };
        let todo: Vec<(usize, u64)> =
            self.slots.iter().enumerate().filter(|(_, s)| !s.handled).map(|(i, s)| (i, s.ptr)).collect();
        let out = match register_inputs(&mut self.device, &todo, &self.staging, (self.rank, self.world, P::NAME), ex) {
            Ok(out) => out,
            Err(Failed { error, tables_unsafe }) => {
                // The same on every rank (decided from one exchange), except where the exchange itself failed.
                if tables_unsafe {
                    self.unusable = Some(error.to_string());
                }
                return Err(error);
            }
        };
        // A slot that could not be registered stays "staging" and is not retried (its graphs stay correct).
        for (i, _) in todo {
            self.slots[i].handled = true;
        }
        Ok(out)
    }
}

/// Why a registration failed on every rank, and whether the tables may no longer be used.
#[derive(Debug)]
struct Failed {
    error: Error,
    /// Some rank's tables could not be put back to the staging form after a failed write: the ranks' tables may
    /// disagree, so no kernel may read them again (the communicator turns its custom kernels off on every rank).
    tables_unsafe: bool,
}

impl From<Error> for Failed {
    fn from(error: Error) -> Self {
        Failed { error, tables_unsafe: false }
    }
}

/// Longest failure message a rank sends in a registration's agreement rounds (the rest is cut off).
const MAX_REASON: usize = 512;

/// This rank's outcome of a phase, as sent in an agreement round: `[1]`, or `[0]` and why not (at most
/// [`MAX_REASON`] bytes of it).
fn outcome(r: &std::result::Result<(), String>) -> Vec<u8> {
    match r {
        Ok(()) => vec![1],
        Err(why) => {
            let mut end = why.len().min(MAX_REASON);
            while !why.is_char_boundary(end) {
                end -= 1;
            }
            let mut m = vec![0];
            m.extend_from_slice(&why.as_bytes()[..end]);
            m
        }
    }
}

/// The first rank whose outcome in `all` is a failure, and its reason (a malformed answer is a failure too).
fn first_failure(all: &[Vec<u8>]) -> Option<(usize, String)> {
    all.iter().enumerate().find_map(|(q, a)| match a.split_first() {
        Some((1, [])) => None,
        Some((0, why)) => Some((q, String::from_utf8_lossy(why).into_owned())),
        _ => Some((q, "a malformed answer".to_owned())),
    })
}

/// The registration protocol, the same on every rank: agree on how many inputs there are; in batches, exchange
/// every rank's entry for each input, open the peers' ones, and agree which inputs every rank could open; rewrite
/// those inputs' tables with every rank's input, then agree that every rank did. Where a write failed on any rank,
/// every rank writes `staging` (the form every table had) back into each table it rewrote (or tried to), and the
/// registration fails on every rank alike, naming the rank; the inputs stay pending. Where that revert fails on
/// any rank, the ranks' tables may disagree: [`Failed::tables_unsafe`] on every rank. `todo` is (table slot,
/// input pointer) in capture order; `name` is the backend's name in errors.
fn register_inputs(
    dev: &mut dyn Registrar,
    todo: &[(usize, u64)],
    staging: &[u8; INPUT_TABLE_BYTES],
    (rank, world, name): (usize, usize, &str),
    ex: &mut dyn Bootstrap,
) -> std::result::Result<GraphRegistration, Failed> {
    // Every rank must run the same number of rounds: agree on the count first.
    let counts = ex.all_gather(&(todo.len() as u64).to_le_bytes())?;
    if counts.len() != world {
        return Err(
            Error::PeerFailure(format!("{} ranks answered a graph-input exchange of {world}", counts.len())).into()
        );
    }
    for (q, c) in counts.iter().enumerate() {
        if c.as_slice() != (todo.len() as u64).to_le_bytes() {
            return Err(Error::PeerFailure(format!(
                "rank {q} has a different number of graph inputs to register than rank {rank} ({}): every rank \
                 must capture the same all-reduces",
                todo.len()
            ))
            .into());
        }
    }
    let mut out = GraphRegistration::default();
    // The tables every rank agreed to rewrite: (slot, input, new table). At most `todo.len()` entries, which is
    // at most MAX_GRAPH_INPUTS (one per slot).
    let mut plan: Vec<(usize, u64, [u8; INPUT_TABLE_BYTES])> = Vec::with_capacity(todo.len());
    for batch in todo.chunks(BATCH) {
        let mut mine = Vec::with_capacity(batch.len() * ENTRY);
        for &(_, ptr) in batch {
            match dev.export(ptr) {
                Ok(e) => {
                    mine.push(1);
                    mine.extend_from_slice(&e);
                }
                Err(why) => {
                    tracing::info!(input = ptr, %why, "graph input stays on staging");
                    mine.push(0);
                    mine.extend_from_slice(&[0u8; ENTRY - 1]);
                }
            }
        }
        let all = ex.all_gather(&mine)?;
        if let Some(q) = all.iter().position(|a| a.len() != mine.len()) {
            return Err(Error::PeerFailure(format!("rank {q} sent a malformed graph-input exchange")).into());
        }
        let mut peers = vec![vec![0u64; world]; batch.len()];
        let mut why: Vec<Option<String>> = vec![None; batch.len()];
        for (k, &(_, ptr)) in batch.iter().enumerate() {
            for (q, a) in all.iter().enumerate() {
                let e = &a[k * ENTRY..(k + 1) * ENTRY];
                if e[0] == 0 {
                    why[k].get_or_insert_with(|| format!("rank {q} could not export it"));
                } else if q == rank {
                    peers[k][q] = ptr;
                } else if why[k].is_none() {
                    match dev.open(q, &e[1..]) {
                        Ok(p) => peers[k][q] = p,
                        Err(err) => why[k] = Some(format!("opening rank {q}'s buffer failed: {err}")),
                    }
                }
            }
        }
        let ok: Vec<u8> = why.iter().map(|w| u8::from(w.is_none())).collect();
        let agreed = ex.all_gather(&ok)?;
        if let Some(q) = agreed.iter().position(|a| a.len() != ok.len()) {
            return Err(Error::PeerFailure(format!("rank {q} sent a malformed graph-input agreement")).into());
        }
        for (k, &(slot, ptr)) in batch.iter().enumerate() {
            if let Some(q) = agreed.iter().position(|a| a[k] == 0) {
                let reason = why[k].clone().unwrap_or_else(|| format!("rank {q} could not map every peer's"));
                out.kept_staged.push(format!("input {ptr:#x}: {reason}"));
                continue;
            }
            plan.push((slot, ptr, input_table(&peers[k], true)));
        }
    }
    // Every exchange is done before the first write, so a failing write leaves no peer waiting in a later batch.
    // The slots this rank rewrote, or tried to (a failed write may have changed the table).
    let mut touched = Vec::with_capacity(plan.len());
    let mut wrote: std::result::Result<(), String> = Ok(());
    for (slot, ptr, table) in &plan {
        touched.push(*slot);
        if let Err(e) = dev.write_table(*slot, table) {
            wrote = Err(format!("could not write the input table of graph input {ptr:#x}: {e}"));
            break;
        }
    }
    // A rank whose tables changed while a peer's did not would read registered inputs that the peer no longer
    // copies into staging, or the other way round: wrong data on replay. The ranks agree before anyone keeps them.
    let revert = |dev: &mut dyn Registrar| -> std::result::Result<(), String> {
        let mut first = Ok(());
        for slot in &touched {
            if let Err(e) = dev.write_table(*slot, staging) {
                tracing::error!(slot, error = %e, "could not put a graph-input table back to staging");
                if first.is_ok() {
                    first = Err(format!("could not put input table {slot} back to staging: {e}"));
                }
            }
        }
        first
    };
    let all = match anyccl_core::bootstrap::checked_all_gather(ex, &outcome(&wrote)) {
        Ok(all) => all,
        Err(e) => {
            // Nobody's outcome is known: this rank's tables are put back to staging, and they are not used again
            // here (the peers, if any still run, fail the same exchange).
            let _ = revert(dev);
            return Err(Failed { error: e, tables_unsafe: true });
        }
    };
    let Some((failed, reason)) = first_failure(&all) else {
        out.registered = plan.len();
        return Ok(out);
    };
    let reverted = revert(dev);
    let all = match anyccl_core::bootstrap::checked_all_gather(ex, &outcome(&reverted)) {
        Ok(all) => all,
        Err(e) => return Err(Failed { error: e, tables_unsafe: true }),
    };
    let first = format!("rank {failed} {reason}");
    match first_failure(&all) {
        None => Err(Error::backend(
            name,
            "register_graph_buffers",
            None,
            format!(
                "{first}; every rank put the tables this registration rewrote back to staging (graphs captured so \
                 far stay correct, copying through staging), and the inputs stay pending for the next registration"
            ),
        )
        .into()),
        Some((q, why)) => Err(Failed {
            error: Error::backend(
                name,
                "register_graph_buffers",
                None,
                format!(
                    "{first}, and then rank {q} {why}: the ranks' input tables may disagree, so graphs captured on \
                     this communicator since its last registration must not be replayed (capture them again); the \
                     custom kernels are off on every rank"
                ),
            ),
            tables_unsafe: true,
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use anyccl_core::bootstrap::LocalGroup;

    use super::*;

    /// A registrar over host bookkeeping: rank `rank`'s input `ptr` is exportable unless listed in
    /// `no_export`, peer `q`'s input `p` opens unless (q, p) is in `no_open`, and opening returns `p + 1000 × q`.
    struct FakeRegistrar {
        no_export: Vec<u64>,
        no_open: Vec<(usize, u64)>,
        written: Vec<(usize, Vec<u64>, bool)>,
        /// Slots whose registered-form write fails.
        fail_write: Vec<usize>,
        /// Slots whose staging-form write (a revert) fails.
        fail_revert: Vec<usize>,
        /// Each slot's table as last written successfully (absent: never written, so still staging).
        tables: HashMap<usize, [u8; INPUT_TABLE_BYTES]>,
    }

    impl FakeRegistrar {
        fn new() -> Self {
            FakeRegistrar {
                no_export: vec![],
                no_open: vec![],
                written: vec![],
                fail_write: vec![],
                fail_revert: vec![],
                tables: HashMap::new(),
            }
        }

        /// Whether slot `slot` holds the registered form (else the staging form it started with).
        fn registered(&self, slot: usize) -> bool {
            self.tables.get(&slot).is_some_and(|t| t[anyccl_kernels_common::MAX_RANKS * 8] == 1)
        }
    }

    impl Registrar for FakeRegistrar {
        fn export(&self, ptr: u64) -> Result<[u8; ENTRY - 1]> {
            if self.no_export.contains(&ptr) {
                return Err(Error::backend("fake", "graph buffers", None, format!("{ptr:#x} is not exportable")));
            }
            let mut e = [0u8; ENTRY - 1];
            e[LEGACY_HANDLE_BYTES + 8..].copy_from_slice(&ptr.to_le_bytes());
            Ok(e)
        }
        fn open(&mut self, q: usize, entry: &[u8]) -> Result<u64> {
            let mut b = [0u8; 8];
            b.copy_from_slice(&entry[LEGACY_HANDLE_BYTES + 8..]);
            let p = u64::from_le_bytes(b);
            if self.no_open.contains(&(q, p)) {
                return Err(Error::backend("fake", "graph buffers", None, format!("cannot open rank {q}'s {p:#x}")));
            }
            Ok(p + 1000 * q as u64)
        }
        fn write_table(&mut self, slot: usize, table: &[u8; INPUT_TABLE_BYTES]) -> Result<()> {
            let words: Vec<u64> =
                table.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
            let ranks = anyccl_kernels_common::MAX_RANKS;
            let registered = words[ranks] == 1;
            let fails = if registered { &self.fail_write } else { &self.fail_revert };
            if fails.contains(&slot) {
                return Err(Error::backend("fake", "upload", None, format!("writing table {slot} failed")));
            }
            if registered {
                self.written.push((slot, words[..ranks].to_vec(), registered));
            } else {
                assert_eq!(table, &staging_form(), "a revert writes the staging form");
            }
            self.tables.insert(slot, *table);
            Ok(())
        }
    }

    /// Runs `register_inputs` on `world` threads; `todo(rank)` and `fake(rank)` give each rank its inputs and
    /// registrar. Returns each rank's result and its registrar.
    fn run(
        world: usize,
        todo: &(dyn Fn(usize) -> Vec<(usize, u64)> + Sync),
        fake: &(dyn Fn(usize) -> FakeRegistrar + Sync),
    ) -> Vec<(std::result::Result<GraphRegistration, Failed>, FakeRegistrar)> {
        run_within(world, Duration::from_secs(30), todo, fake)
    }

    /// [`run`] with each exchange waiting at most `timeout` for the other ranks.
    fn run_within(
        world: usize,
        timeout: Duration,
        todo: &(dyn Fn(usize) -> Vec<(usize, u64)> + Sync),
        fake: &(dyn Fn(usize) -> FakeRegistrar + Sync),
    ) -> Vec<(std::result::Result<GraphRegistration, Failed>, FakeRegistrar)> {
        let group = LocalGroup::new(world, timeout);
        std::thread::scope(|sc| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    let mut me = group.member(r);
                    sc.spawn(move || {
                        let mut f = fake(r);
                        let out = register_inputs(&mut f, &todo(r), &staging_form(), (r, world, "fake"), &mut me);
                        (out, f)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
        })
    }

    /// The staging form of every table in these tests (what `GraphInputs::new` writes first).
    fn staging_form() -> [u8; INPUT_TABLE_BYTES] {
        input_table(&[0x5_0000, 0x6_0000, 0x7_0000], false)
    }

    fn input(rank: usize, k: usize) -> u64 {
        0x1000_0000 * (rank as u64 + 1) + 0x100 * k as u64
    }

    #[test]
    fn registration_writes_every_ranks_inputs_into_each_table_across_batches() {
        let world = 3;
        let n = BATCH * 2 + 7; // three exchange rounds
        let todo = |r: usize| (0..n).map(|k| (k, input(r, k))).collect::<Vec<_>>();
        let fake = |_| FakeRegistrar::new();
        for (r, (out, f)) in run(world, &todo, &fake).into_iter().enumerate() {
            let out = out.expect("registration");
            assert_eq!((out.registered, out.kept_staged), (n, Vec::<String>::new()));
            assert_eq!(f.written.len(), n);
            for (k, (slot, ptrs, registered)) in f.written.iter().enumerate() {
                assert_eq!(*slot, k);
                assert!(registered);
                for (q, got) in ptrs.iter().take(world).enumerate() {
                    let want = if q == r { input(r, k) } else { input(q, k) + 1000 * q as u64 };
                    assert_eq!(*got, want, "rank {r} input {k}: rank {q}'s pointer");
                }
                assert!(ptrs[world..].iter().all(|p| *p == 0));
            }
        }
    }

    #[test]
    fn an_input_one_rank_cannot_export_or_open_stays_on_staging_everywhere() {
        let world = 4;
        let todo = |r: usize| (0..5).map(|k| (10 + k, input(r, k))).collect::<Vec<_>>();
        // Rank 2 cannot export its input 1; rank 0 cannot open rank 3's input 3.
        let fake = |r: usize| FakeRegistrar {
            no_export: if r == 2 { vec![input(2, 1)] } else { vec![] },
            no_open: if r == 0 { vec![(3, input(3, 3))] } else { vec![] },
            ..FakeRegistrar::new()
        };
        for (r, (out, f)) in run(world, &todo, &fake).into_iter().enumerate() {
            let out = out.expect("registration");
            assert_eq!(out.registered, 3, "rank {r}");
            assert_eq!(out.kept_staged.len(), 2, "rank {r}: {:?}", out.kept_staged);
            assert!(out.kept_staged[0].contains("rank 2 could not export it"), "{:?}", out.kept_staged);
            let slots: Vec<usize> = f.written.iter().map(|w| w.0).collect();
            assert_eq!(slots, vec![10, 12, 14], "rank {r}: tables 11 and 13 stay staging");
        }
    }

    #[test]
    fn ranks_with_different_numbers_of_inputs_fail_without_writing_tables() {
        let todo = |r: usize| (0..2 + r).map(|k| (k, input(r, k))).collect::<Vec<_>>();
        let fake = |_| FakeRegistrar::new();
        for (out, f) in run(2, &todo, &fake) {
            let err = out.expect_err("counts differ").error;
            assert!(err.to_string().contains("must capture the same all-reduces"), "{err}");
            assert!(f.written.is_empty());
        }
    }

    /// A write that fails on one rank only: before the agreement round, rank 1 kept staging while ranks 0 and 2
    /// had registered tables (and, with a second batch, waited for rank 1 until the exchange timed out).
    #[test]
    fn a_table_write_failing_on_one_rank_puts_every_ranks_tables_back_to_staging() {
        let world = 3;
        for n in [3, BATCH + 3] {
            // Rank 1's write of table 1 fails; ranks 0 and 2 write every table.
            let todo = |r: usize| (0..n).map(|k| (k, input(r, k))).collect::<Vec<_>>();
            let fake =
                |r: usize| FakeRegistrar { fail_write: if r == 1 { vec![1] } else { vec![] }, ..FakeRegistrar::new() };
            let timeout = Duration::from_secs(5);
            let start = std::time::Instant::now();
            let outs = run_within(world, timeout, &todo, &fake);
            assert!(start.elapsed() < timeout, "{n} inputs: a rank waited for a peer until the timeout");
            for (r, (out, f)) in outs.into_iter().enumerate() {
                let Failed { error: err, tables_unsafe } = out.expect_err("registration fails on every rank");
                assert!(!tables_unsafe, "{n} inputs, rank {r}: every revert succeeded");
                assert!(err.to_string().contains("rank 1 could not write"), "{n} inputs, rank {r}: {err}");
                assert!(err.to_string().contains("writing table 1 failed"), "{n} inputs, rank {r}: {err}");
                assert!(err.to_string().contains("back to staging"), "{n} inputs, rank {r}: {err}");
                // Ranks 0 and 2 had registered every table before they heard of rank 1's failure.
                let wrote = if r == 1 { 1 } else { n };
                assert_eq!(f.written.len(), wrote, "{n} inputs, rank {r}: registered writes");
                let registered: Vec<usize> = (0..n).filter(|s| f.registered(*s)).collect();
                assert_eq!(registered, Vec::<usize>::new(), "{n} inputs, rank {r}: tables left registered");
            }
        }
    }

    #[test]
    fn a_revert_that_fails_makes_every_rank_report_the_tables_unusable() {
        let (world, n) = (3, 3);
        let todo = |r: usize| (0..n).map(|k| (k, input(r, k))).collect::<Vec<_>>();
        // Rank 1's write of table 1 fails; rank 2 then cannot put table 0 back to staging.
        let fake = |r: usize| FakeRegistrar {
            fail_write: if r == 1 { vec![1] } else { vec![] },
            fail_revert: if r == 2 { vec![0] } else { vec![] },
            ..FakeRegistrar::new()
        };
        for (r, (out, f)) in run(world, &todo, &fake).into_iter().enumerate() {
            let Failed { error, tables_unsafe } = out.expect_err("registration fails on every rank");
            assert!(tables_unsafe, "rank {r}: the tables may disagree");
            let msg = error.to_string();
            assert!(msg.contains("rank 1 could not write"), "rank {r}: {msg}");
            assert!(msg.contains("rank 2 could not put input table 0 back to staging"), "rank {r}: {msg}");
            assert!(msg.contains("must not be replayed"), "rank {r}: {msg}");
            let registered: Vec<usize> = (0..n).filter(|s| f.registered(*s)).collect();
            let left = if r == 2 { vec![0] } else { vec![] };
            assert_eq!(registered, left, "rank {r}: every other table is back to staging");
        }
    }

    #[test]
    fn the_tables_stay_registered_when_every_write_succeeds() {
        let todo = |r: usize| (0..3).map(|k| (k, input(r, k))).collect::<Vec<_>>();
        // A revert would fail everywhere: none is attempted.
        let fake = |_| FakeRegistrar { fail_revert: vec![0, 1, 2], ..FakeRegistrar::new() };
        for (r, (out, f)) in run(2, &todo, &fake).into_iter().enumerate() {
            assert_eq!(out.expect("registration").registered, 3, "rank {r}");
            assert!((0..3).all(|s| f.registered(s)), "rank {r}");
        }
    }
}
