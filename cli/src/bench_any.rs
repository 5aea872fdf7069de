//! The bench written once for every backend, over the type-erased communicator ([`anyccl::dynamic`]): host
//! (threads, or processes with `--per-rank`), CUDA (a thread per GPU, or one process per GPU with `--per-rank`)
//! and ROCm (a thread per GPU, or one process per GPU with `--per-rank`).
//!
//! Timing, per backend:
//! - host ([`Timing::Barriers`]): each call between two barriers, timed on every rank;
//! - GPU graph ([`Timing::Graph`], the default): one graph of [`CALLS_PER_GRAPH`] back-to-back all-reduces per
//!   replay, each replay between two device events (CUDA, ROCm) or, where a backend has none, timed on the host up
//!   to a stream synchronisation, divided by the calls;
//! - GPU eager ([`Timing::Eager`]): each call between two events, or on the host up to a synchronisation. On CUDA
//!   the host time per call is measured too, anyccl against a raw `ncclAllReduce`, on the typed
//!   `Communicator<CudaComm>` (`bench_cuda`): the erased face's virtual call does not enter that measurement.
//!
//! Every cell is then checked as nccl-tests checks it ([`crate::check::Reference`]): out of place the output is
//! poisoned (0xFF) and the timing graph replayed once (graph mode) or one call made; in place the input is restored
//! and one call made; every output is downloaded and compared.

use std::time::Instant;

use anyccl::core::bootstrap::Bootstrap;
use anyccl::core::comm::AllReduceCall;
use anyccl::core::{Algorithm, Capabilities, Error, InOut, Result, Selection};
use anyccl::dynamic::{AnyBuffer, AnyEvent, AnyGraph, AnyStream, BackendKind, DynComm};
use anyccl::DataType;

use crate::bench::{
    assemble, cells_per_size, check_agreement, decode_cells, decode_rank_info, encode_cells, encode_rank_info,
    fingerprint, host_name, on_ranks, report, BenchConfig, BenchReport, Headline, Ineligible, Launch, Limits, Progress,
    RankCell, RankInfo, RankSweep,
};
use crate::check::Reference;

/// Calls per graph replay.
pub const CALLS_PER_GRAPH: usize = 10;

/// How a cell's calls are timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timing {
    /// Host: barrier, call, barrier; wall time on every rank.
    Barriers,
    /// GPU: one graph of [`CALLS_PER_GRAPH`] calls per replay, replay + synchronise timed on the host.
    Graph,
    /// GPU: each call + synchronise timed on the host.
    Eager,
}

/// Which cell a checked output belongs to (for a test's tamper hook).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CellId {
    /// The rank whose output it is.
    pub rank: usize,
    /// Message size.
    pub bytes: u64,
    /// The algorithm (`None`: auto).
    pub algorithm: Option<Algorithm>,
    /// In place.
    pub in_place: bool,
}

/// Tests only: changes a rank's downloaded output before the comparison, to show that wrong results are counted
/// and fail the command. The command itself always passes `None`.
pub(crate) type Tamper<'a> = Option<&'a (dyn Fn(CellId, &mut [u8]) + Sync)>;

/// The algorithms of `cfg` this communicator can run (in column order), and the others with the reason.
pub(crate) fn eligible(c: &dyn DynComm, cfg: &BenchConfig) -> (Vec<Algorithm>, Vec<Ineligible>) {
    let esz = cfg.dtype.size_bytes();
    // Lossy (quantized) algorithms only when asked for by name: their results are not the exact sum the check
    // compares against, and `tune` must never pick one from a default sweep.
    let mut requested: Vec<Algorithm> = cfg
        .algorithms
        .clone()
        .unwrap_or_else(|| c.allreduce_algorithms().into_iter().filter(|a| !a.is_lossy()).collect());
    for q in &cfg.quantized {
        if !requested.contains(q) {
            requested.push(*q);
        }
    }
    let mut algorithms = Vec::new();
    let mut ineligible = Vec::new();
    for a in requested {
        if a == Algorithm::CclSymmetric && c.allreduce_algorithms().contains(&a) {
            // Eligible only on buffers in windows: the bench makes them when windows are on.
            match c.capabilities().require(Capabilities::SYMMETRIC_WINDOWS) {
                Ok(()) => algorithms.push(a),
                Err(e) => ineligible.push(Ineligible { algorithm: a, reason: e.to_string() }),
            }
            continue;
        }
        // Whether the backend could run a call of this kind at all (the table shows why not).
        let count = 4096 / esz;
        let probe = AllReduceCall {
            count,
            dtype: cfg.dtype,
            op: cfg.op,
            bytes: count * esz,
            in_place: false,
            capturing: false,
            bufs: None,
        };
        match c.check_algorithm(a, &probe) {
            Ok(()) => algorithms.push(a),
            Err(Error::AlgorithmNotEligible { why, .. }) => ineligible.push(Ineligible { algorithm: a, reason: why }),
            Err(e) => ineligible.push(Ineligible { algorithm: a, reason: e.to_string() }),
        }
    }
    (algorithms, ineligible)
}

/// A vector of `n` zero bytes, reserved fallibly.
fn host_bytes(n: usize, what: &str) -> Result<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::OutOfMemory { what: what.into(), bytes: n as u64 })?;
    v.resize(n, 0);
    Ok(v)
}

/// One cell: what runs, where, and how it is checked.
struct CellRun<'a> {
    cfg: &'a BenchConfig,
    timing: Timing,
    reference: &'a Reference,
    /// The algorithm (`None`: auto).
    algo: Option<Algorithm>,
    in_place: bool,
    /// Message size in bytes.
    n: usize,
    /// This rank's input (its first `n` bytes are the message).
    seed: &'a [u8],
    tamper: Tamper<'a>,
    /// Whether GPU timing uses device events ([`DynComm::event`]).
    events: bool,
}

/// One call of the cell on `out` (and `input` out of place); auto's choice goes to `chosen`.
fn one_call(
    run: &CellRun<'_>,
    c: &mut dyn DynComm,
    input: &AnyBuffer,
    out: &mut AnyBuffer,
    stream: &AnyStream,
    chosen: &mut Option<Selection>,
) -> Result<()> {
    let count = run.n / run.cfg.dtype.size_bytes();
    let (dtype, op) = (run.cfg.dtype, run.cfg.op);
    let io = if run.in_place { InOut::InPlace(out) } else { InOut::Separate { send: input, recv: out } };
    match run.algo {
        Some(a) => c.all_reduce_with(a, io, count, dtype, op, stream),
        None => c.all_reduce(io, count, dtype, op, stream).map(|s| *chosen = Some(s)),
    }
}

/// Times one cell on one rank, then checks it.
#[allow(clippy::too_many_arguments)]
fn measure_cell(
    run: &CellRun<'_>,
    c: &mut dyn DynComm,
    stream: &AnyStream,
    input: &AnyBuffer,
    out: &mut AnyBuffer,
    host: &mut [u8],
    chosen: &mut Option<Selection>,
    boot: Option<&mut dyn Bootstrap>,
) -> Result<RankCell> {
    let (cfg, n) = (run.cfg, run.n);
    let seed = &run.seed[..n];
    let host = &mut host[..n];
    let mut samples = Vec::new();
    samples.try_reserve_exact(cfg.iters).map_err(|_| Error::OutOfMemory {
        what: "the timing samples".into(),
        bytes: (cfg.iters as u64).saturating_mul(8),
    })?;
    if run.in_place {
        c.upload(out, seed, stream)?;
    }
    let mut graph: Option<AnyGraph> = None;
    // Device events around each timed call or replay, where the backend has them.
    let events: Option<Vec<AnyEvent>> = match (run.timing, run.events) {
        (Timing::Graph | Timing::Eager, true) => Some((0..=cfg.iters).map(|_| c.event()).collect::<Result<_>>()?),
        _ => None,
    };
    let elapsed_us = |ev: &[AnyEvent], per: usize| -> Result<Vec<f64>> {
        (0..cfg.iters).map(|i| Ok(f64::from(ev[i].elapsed_ms(&ev[i + 1])?) * 1e3 / per as f64)).collect()
    };
    match run.timing {
        Timing::Barriers => {
            for i in 0..cfg.warmup + cfg.iters {
                if run.in_place {
                    c.upload(out, seed, stream)?;
                }
                c.barrier(stream)?;
                let t0 = Instant::now();
                one_call(run, c, input, out, stream, chosen)?;
                c.barrier(stream)?;
                if i >= cfg.warmup {
                    samples.push(t0.elapsed().as_secs_f64() * 1e6);
                }
            }
        }
        Timing::Eager => match &events {
            Some(ev) => {
                for _ in 0..cfg.warmup {
                    one_call(run, c, input, out, stream, chosen)?;
                }
                for e in &ev[..cfg.iters] {
                    e.record(stream)?;
                    one_call(run, c, input, out, stream, chosen)?;
                }
                ev[cfg.iters].record(stream)?;
                c.synchronize(stream)?;
                samples = elapsed_us(ev, 1)?;
            }
            None => {
                for i in 0..cfg.warmup + cfg.iters {
                    let t0 = Instant::now();
                    one_call(run, c, input, out, stream, chosen)?;
                    c.synchronize(stream)?;
                    if i >= cfg.warmup {
                        samples.push(t0.elapsed().as_secs_f64() * 1e6);
                    }
                }
            }
        },
        Timing::Graph => {
            // Eager calls first: the vendor library connects peers lazily on the first call of a kind, and
            // connecting is not allowed during capture ("failed to peer with device 1 … operation not permitted
            // when stream is capturing" at world 2 on an H200 pair without this).
            for _ in 0..cfg.warmup.max(1) {
                one_call(run, c, input, out, stream, chosen)?;
            }
            c.synchronize(stream)?;
            let g = c.capture(stream, &mut |c, s| {
                for _ in 0..CALLS_PER_GRAPH {
                    one_call(run, c, input, out, s, chosen)?;
                }
                Ok(())
            })?;
            // As an engine does after capturing: the custom kernels' captured inputs are registered (collective;
            // every rank captured the same calls), so replays read every rank's input directly.
            c.register_graph_buffers(boot)?;
            for _ in 0..cfg.warmup.max(1) {
                g.launch(stream)?;
            }
            match &events {
                Some(ev) => {
                    for e in &ev[..cfg.iters] {
                        e.record(stream)?;
                        g.launch(stream)?;
                    }
                    ev[cfg.iters].record(stream)?;
                    c.synchronize(stream)?;
                    samples = elapsed_us(ev, CALLS_PER_GRAPH)?;
                }
                None => {
                    c.synchronize(stream)?;
                    for _ in 0..cfg.iters {
                        let t0 = Instant::now();
                        g.launch(stream)?;
                        c.synchronize(stream)?;
                        samples.push(t0.elapsed().as_secs_f64() * 1e6 / CALLS_PER_GRAPH as f64);
                    }
                }
            }
            graph = Some(g);
        }
    }
    // The check: restore the input (in place) or poison the output, run once, download, compare.
    if run.in_place {
        c.upload(out, seed, stream)?;
    } else {
        host.fill(0xFF);
        c.upload(out, host, stream)?;
    }
    match (&graph, run.in_place) {
        (Some(g), false) => g.launch(stream)?,
        _ => one_call(run, c, input, out, stream, chosen)?,
    }
    c.synchronize(stream)?;
    c.download(out, host, stream)?;
    if let Some(t) = run.tamper {
        t(CellId { rank: c.rank(), bytes: n as u64, algorithm: run.algo, in_place: run.in_place }, host);
    }
    let wrong = match run.algo.and_then(crate::check::quantization_delta) {
        Some(delta) => run.reference.count_wrong_quantized(host, delta),
        None => run.reference.count_wrong(host),
    };
    Ok(RankCell::from_samples(&mut samples, wrong))
}

/// What every rank of a sweep shares.
pub(crate) struct Sweep<'a> {
    /// What to measure.
    pub cfg: &'a BenchConfig,
    /// How.
    pub timing: Timing,
    /// The algorithms measured, in column order.
    pub algorithms: &'a [Algorithm],
    /// The expected results.
    pub reference: &'a Reference,
    /// Progress (reported by rank 0).
    pub progress: Progress<'a>,
    /// A test's hook.
    pub tamper: Tamper<'a>,
}

/// The bootstrap for one call, borrowed again (`Option::as_deref_mut` would keep the object's longer lifetime).
fn reborrow<'a>(boot: &'a mut Option<&mut dyn Bootstrap>) -> Option<&'a mut dyn Bootstrap> {
    match boot {
        Some(b) => Some(&mut **b),
        None => None,
    }
}

/// One rank's sweep: every size, placement and algorithm, timed then checked. `boot` reaches the other ranks'
/// processes (`None`: ranks of this process).
pub(crate) fn rank_sweep(
    c: &mut dyn DynComm,
    sw: &Sweep<'_>,
    mut boot: Option<&mut dyn Bootstrap>,
) -> Result<RankSweep> {
    let cfg = sw.cfg;
    let rank = c.rank();
    let stream = c.stream()?;
    let max = cfg.sizes.iter().copied().max().unwrap_or(0);
    // Checked against the backend's limit; a 32-bit host that cannot address it says so.
    let max = usize::try_from(max).map_err(|_| Error::OutOfMemory {
        what: "a message larger than this host's address space".into(),
        bytes: max,
    })?;
    let mut seed = host_bytes(max, "the bench's host copy of its input")?;
    sw.reference.input(rank, &mut seed)?;
    let mut host = host_bytes(max, "the bench's host copy of its output")?;
    let mut send = c.alloc(max)?;
    c.upload(&mut send, &seed, &stream)?;
    let mut recv = c.alloc(max)?;
    // Out of place like the ccl column: send and receive both in registered windows.
    let mut sym = if sw.algorithms.contains(&Algorithm::CclSymmetric) {
        let mut sin = c.symmetric_buffer(max, &stream)?;
        c.upload(&mut sin, &seed, &stream)?;
        Some((sin, c.symmetric_buffer(max, &stream)?))
    } else {
        None
    };
    let mut sweep = RankSweep { cells: Vec::new(), autos: Vec::new(), host: Vec::new() };
    let total = (cfg.sizes.len() * cells_per_size(cfg, sw.algorithms)) as u64;
    let mut done = 0u64;
    let places: &[bool] = if cfg.in_place { &[false, true] } else { &[false] };
    let fallback = sw.algorithms.first().copied().unwrap_or(Algorithm::Ccl);
    let events = sw.timing != Timing::Barriers && c.event().is_ok();
    for &bytes in &cfg.sizes {
        let n = bytes as usize;
        let count = n / cfg.dtype.size_bytes();
        for &in_place in places {
            let mut chosen = None;
            for algo in sw.algorithms.iter().copied().map(Some).chain([None]) {
                let run = CellRun {
                    cfg,
                    timing: sw.timing,
                    reference: sw.reference,
                    algo,
                    in_place,
                    n,
                    seed: &seed,
                    tamper: sw.tamper,
                    events,
                };
                let cell = match algo {
                    Some(Algorithm::CclSymmetric) => {
                        let (sin, sout) =
                            sym.as_mut().ok_or_else(|| Error::PeerFailure("no symmetric buffer".into()))?;
                        // In place, only the output window is used (the input is uploaded into it).
                        measure_cell(&run, c, &stream, sin, sout, &mut host, &mut chosen, reborrow(&mut boot))?
                    }
                    Some(a) => {
                        let call = AllReduceCall {
                            count,
                            dtype: cfg.dtype,
                            op: cfg.op,
                            bytes: n,
                            in_place,
                            capturing: false,
                            bufs: None,
                        };
                        if c.check_algorithm(a, &call).is_err() {
                            // Not for this size (e.g. above the custom kernels' staging buffers): an empty cell.
                            RankCell::EMPTY
                        } else {
                            measure_cell(
                                &run,
                                c,
                                &stream,
                                &send,
                                &mut recv,
                                &mut host,
                                &mut chosen,
                                reborrow(&mut boot),
                            )?
                        }
                    }
                    None => {
                        measure_cell(&run, c, &stream, &send, &mut recv, &mut host, &mut chosen, reborrow(&mut boot))?
                    }
                };
                sweep.cells.push(cell);
                done += 1;
                if rank == 0 {
                    (sw.progress)(done, total);
                }
            }
            sweep.autos.push(chosen.map_or((fallback, String::new()), |s| (s.algorithm, s.why.to_string())));
        }
        sweep.host.push(if sw.timing == Timing::Eager {
            host_pair(c, &send, &mut recv, &stream, n, cfg)?
        } else {
            None
        });
    }
    drop(sym.take());
    c.barrier(&stream)?;
    Ok(sweep)
}

/// Eager mode on CUDA: anyccl's host time per call against a raw `ncclAllReduce`, on the typed communicator.
#[cfg(feature = "cuda")]
fn host_pair(
    c: &mut dyn DynComm,
    send: &AnyBuffer,
    recv: &mut AnyBuffer,
    stream: &AnyStream,
    n: usize,
    cfg: &BenchConfig,
) -> Result<Option<(f64, f64)>> {
    crate::bench_cuda::host_pair(c, send, recv, stream, n, cfg)
}

/// Other backends have no raw vendor call to compare with here.
#[cfg(not(feature = "cuda"))]
fn host_pair(
    _: &mut dyn DynComm,
    _: &AnyBuffer,
    _: &mut AnyBuffer,
    _: &AnyStream,
    _: usize,
    _: &BenchConfig,
) -> Result<Option<(f64, f64)>> {
    Ok(None)
}

/// The backend's limits on a sweep.
pub(crate) fn limits(kind: BackendKind) -> Limits {
    match kind {
        BackendKind::Host => Limits::HOST,
        BackendKind::Cuda | BackendKind::Rocm => Limits::GPU,
    }
}

/// The baseline column of a backend: its vendor library's own all-reduce, or the host's ring (one-shot across
/// processes, the only host algorithm there).
fn baseline(kind: BackendKind, launch: Launch) -> Algorithm {
    match (kind, launch) {
        (BackendKind::Host, Launch::Threads) => Algorithm::Ring,
        (BackendKind::Host, Launch::Processes) => Algorithm::OneShot,
        _ => Algorithm::Ccl,
    }
}

fn check_text(reference: &Reference, timing: Timing) -> String {
    match timing {
        Timing::Barriers => format!(
            "{}; out of place: the output is poisoned (all bytes 0xFF) before one checked call after the timed \
             ones; in place: the input is restored before it",
            reference.describe()
        ),
        Timing::Graph | Timing::Eager => {
            let out = if timing == Timing::Graph {
                "out of place: the output poisoned (0xFF) and the timing graph replayed once"
            } else {
                "out of place: the output poisoned (0xFF) and one eager call"
            };
            format!(
                "{}; {out}; in place: the input restored and one eager call; every output downloaded",
                reference.describe()
            )
        }
    }
}

fn method(kind: BackendKind, timing: Timing, launch: Launch, events: bool) -> String {
    let ranks = match (kind, launch) {
        (BackendKind::Host, Launch::Threads) => "host threads",
        (BackendKind::Host, Launch::Processes) => "one process per rank (host backend over shared memory)",
        (_, Launch::Threads) => "one process, a thread and a collective communicator per GPU",
        (_, Launch::Processes) => "one process per GPU (--per-rank)",
    };
    let headline = match launch {
        Launch::Threads => "rank 0's median",
        Launch::Processes => "the average of the ranks' medians",
    };
    let timed = if events { "timed with device events" } else { "timed on the host up to a stream synchronisation" };
    let driver = driver_text(kind);
    match timing {
        Timing::Barriers => format!(
            "{ranks}; per call: barrier, all-reduce, barrier, timed on every rank; {headline} of the timed calls \
             (the spread is of every rank's median)"
        ),
        Timing::Graph => format!(
            "{driver}{ranks}; one {kind} graph of {CALLS_PER_GRAPH} back-to-back all-reduces per replay, each replay \
             {timed}; latency = replay / {CALLS_PER_GRAPH}; {headline}"
        ),
        Timing::Eager => {
            let host = if kind == BackendKind::Cuda {
                ". host us/call: median wall time of the call itself (anyccl vs raw ncclAllReduce, rank 0, on the \
                 typed communicator)"
            } else {
                ""
            };
            format!("{driver}{ranks}; each eager call {timed}; {headline}{host}")
        }
    }
}

/// The CUDA driver's version, where the backend is CUDA (`driver 12.8: `).
fn driver_text(kind: BackendKind) -> String {
    #[cfg(feature = "cuda")]
    if kind == BackendKind::Cuda {
        if let Ok(info) = anyccl::cuda::available() {
            return format!("driver {}: ", info.version_string());
        }
    }
    let _ = kind;
    String::new()
}

/// Refuses more ranks than one process has GPUs (the chooser would too, without naming the flag).
fn check_world(kind: BackendKind, world: usize) -> Result<()> {
    if kind == BackendKind::Host {
        return Ok(());
    }
    match anyccl::dynamic::device_count(kind) {
        Ok(n) if world > n => Err(crate::bench::flag_error(
            "--world",
            format!(
                "{world} ranks; one process drives at most one rank per GPU, and this machine has {n} (start one \
                 process per GPU with --per-rank for more)"
            ),
        )),
        _ => Ok(()),
    }
}

/// What [`run`] measured, and the architecture the tuned table's rules name.
pub(crate) struct Measured {
    /// The report.
    pub report: BenchReport,
    /// Rank 0's architecture (`gfx942`, `host`).
    pub arch: String,
}

/// Runs the sweep on `kind`, one thread per rank of this process.
pub(crate) fn run(
    kind: BackendKind,
    cfg: &BenchConfig,
    timing: Timing,
    progress: Progress<'_>,
    tamper: Tamper<'_>,
) -> Result<Measured> {
    cfg.check(limits(kind))?;
    check_world(kind, cfg.world)?;
    let reference = Reference::new(cfg.dtype, cfg.op, cfg.world)?;
    let chosen = anyccl::dynamic::communicators(kind.into(), cfg.world, cfg.selector.clone())?;
    let first = chosen.comms.first().ok_or_else(|| Error::PeerFailure("no communicator was made".into()))?;
    let (algorithms, ineligible) = eligible(&**first, cfg);
    let library = first.library();
    let arch = first.arch().to_owned();
    let events = timing != Timing::Barriers && first.event().is_ok();
    let pid = std::process::id();
    let host = host_name();
    let ranks =
        chosen.comms.iter().map(|c| RankInfo { rank: c.rank(), host: host.clone(), pid, device: c.device() }).collect();
    let sw = Sweep { cfg, timing, algorithms: &algorithms, reference: &reference, progress, tamper };
    let bind = cfg.bind && kind == BackendKind::Host;
    let world = cfg.world;
    let sweeps = on_ranks(chosen.comms, |mut c| {
        if bind {
            if let Err(why) = crate::bind::bind_rank(c.rank(), world) {
                eprintln!("anyccl bench --bind: rank {}: {why}", c.rank());
            }
        }
        rank_sweep(&mut *c, &sw, None)
    })?;
    let all: Vec<Vec<RankCell>> = sweeps.iter().map(|s| s.cells.clone()).collect();
    let base = baseline(kind, Launch::Threads);
    // `on_ranks` returns every rank's result or an error, never an empty list: `sweeps[0]` is rank 0's.
    let rows = assemble(cfg, &algorithms, base, &all, &sweeps[0], Headline::Rank0)?;
    let report = report(
        cfg,
        kind.name(),
        Launch::Threads,
        library,
        ranks,
        base,
        algorithms,
        ineligible,
        rows,
        check_text(&reference, timing),
        method(kind, timing, Launch::Threads, events),
    );
    Ok(Measured { report, arch })
}

/// Exchanges `mine` with every rank over the communicator itself (variable lengths, each at most `limit` bytes):
/// lengths first, then the payloads padded to the longest.
pub(crate) fn gather(c: &mut dyn DynComm, mine: &[u8], limit: usize) -> Result<Vec<Vec<u8>>> {
    let world = c.world_size();
    let stream = c.stream()?;
    let mut len = c.alloc(8)?;
    c.upload(&mut len, &(mine.len() as u64).to_le_bytes(), &stream)?;
    let lens_bytes = world.checked_mul(8).ok_or_else(|| Error::PeerFailure("too many ranks".into()))?;
    let mut lens = c.alloc(lens_bytes)?;
    c.all_gather(InOut::Separate { send: &len, recv: &mut lens }, 8, DataType::U8, &stream)?;
    let mut raw = host_bytes(lens_bytes, "the ranks' lengths")?;
    c.download(&lens, &mut raw, &stream)?;
    let lens: Vec<usize> = raw
        .chunks_exact(8)
        .map(|b| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            usize::try_from(u64::from_le_bytes(a)).unwrap_or(usize::MAX)
        })
        .collect();
    if let Some((r, l)) = lens.iter().enumerate().find(|(_, &l)| l > limit) {
        return Err(Error::PeerFailure(format!("rank {r} announced {l} bytes of results; at most {limit} expected")));
    }
    let longest = lens.iter().copied().max().unwrap_or(0).max(1);
    let mut padded = host_bytes(longest, "this rank's results")?;
    padded[..mine.len()].copy_from_slice(mine);
    let mut send = c.alloc(longest)?;
    c.upload(&mut send, &padded, &stream)?;
    let total = longest.checked_mul(world).ok_or_else(|| Error::PeerFailure("results too large".into()))?;
    let mut all = c.alloc(total)?;
    c.all_gather(InOut::Separate { send: &send, recv: &mut all }, longest, DataType::U8, &stream)?;
    let mut out = host_bytes(total, "every rank's results")?;
    c.download(&all, &mut out, &stream)?;
    Ok(out.chunks(longest).zip(&lens).map(|(b, &l)| b[..l].to_vec()).collect())
}

/// Runs the sweep with this process as one rank of a job started by torchrun or srun (`--per-rank`): every rank
/// measures; the ranks exchange their cells over the communicator, and every rank returns the whole report (rank
/// 0 prints it).
pub(crate) fn run_processes(
    mut c: anyccl::AnyCommunicator,
    mut boot: Option<Box<dyn Bootstrap>>,
    cfg: &BenchConfig,
    timing: Timing,
    progress: Progress<'_>,
) -> Result<BenchReport> {
    let kind = c.backend();
    cfg.check(limits(kind))?;
    let (algorithms, ineligible) = eligible(&*c, cfg);
    let limit = 1 << 20;
    let mode = format!("{kind} processes {timing:?}");
    check_agreement(&gather(&mut *c, &fingerprint(cfg, &algorithms, &mode), limit)?)?;
    let reference = Reference::new(cfg.dtype, cfg.op, cfg.world)?;
    let sw = Sweep { cfg, timing, algorithms: &algorithms, reference: &reference, progress, tamper: None };
    let events = timing != Timing::Barriers && c.event().is_ok();
    let boot: Option<&mut dyn Bootstrap> = match &mut boot {
        Some(b) => Some(&mut **b),
        None => None,
    };
    if cfg.bind && kind == BackendKind::Host {
        if let Err(why) = crate::bind::bind_rank(c.rank(), cfg.world) {
            eprintln!("anyccl bench --bind: rank {}: {why}", c.rank());
        }
    }
    let sweep = rank_sweep(&mut *c, &sw, boot)?;
    let expected = sweep.cells.len();
    let cells = gather(&mut *c, &encode_cells(&sweep.cells), expected.saturating_mul(crate::bench::RANK_CELL_BYTES))?;
    let all = cells.iter().enumerate().map(|(r, b)| decode_cells(r, b, expected)).collect::<Result<Vec<_>>>()?;
    let device = c.device();
    let ranks = decode_rank_info(&gather(&mut *c, &encode_rank_info(&host_name(), &device), 4096)?)?;
    let base = baseline(kind, Launch::Processes);
    let rows = assemble(cfg, &algorithms, base, &all, &sweep, Headline::Average)?;
    Ok(report(
        cfg,
        kind.name(),
        Launch::Processes,
        c.library(),
        ranks,
        base,
        algorithms,
        ineligible,
        rows,
        check_text(&reference, timing),
        method(kind, timing, Launch::Processes, events),
    ))
}
