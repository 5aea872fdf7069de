//! `anyccl bench --backend cuda`: all-reduce on NVIDIA GPUs through the CUDA backend.
//!
//! Ranks: one process with one thread and one NCCL communicator per GPU (`ncclCommInitAll`), or, with `--per-rank`,
//! one process per GPU started by torchrun or srun (the rendezvous of `anyccl::cuda::bootstrap`). Two timing modes:
//! - graph (default): one CUDA graph holding 10 back-to-back all-reduces; warm-up replays, then timed replays,
//!   each between two events; latency = replay time / 10; the median is reported (how engines measure);
//! - eager: each call between two events; the median is reported.
//!
//! Every cell is measured out of place and in place, then checked: the output is downloaded and compared with
//! the host's reference ([`crate::check::Reference`]). Out of place under `--graph` the output is poisoned and the
//! timing graph replayed once (so the captured path is what is checked); otherwise one eager call after restoring
//! the input (in place) or poisoning the output (out of place).
//!
//! In eager mode the host time of each call is measured too, through anyccl and through a raw `ncclAllReduce` of
//! the same library on the same buffers, to show anyccl's per-call overhead.

use std::sync::Arc;
use std::time::Instant;

use anyccl::core::bootstrap::Bootstrap;
use anyccl::core::comm::AllReduceCall;
use anyccl::cuda::graph::{Event, Graph};
use anyccl::cuda::{CudaComm, CudaStream, DeviceBuffer, DeviceContext};
use serde::Serialize;

use crate::bench::{
    assemble, check_agreement, decode_cells, decode_rank_info, encode_cells, encode_rank_info, fingerprint, host_name,
    median, on_ranks, report, BenchConfig, BenchReport, Headline, Ineligible, Launch, Progress, RankCell, RankInfo,
    RankSweep,
};
use crate::check::Reference;
use anyccl::core::{Algorithm, Capabilities, Communicator, Error, InOut, MemoryRuntime, Result, Selection};

/// How GPU latency is timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// One graph of 10 back-to-back all-reduces per replay.
    Graph,
    /// Each eager call timed on its own.
    Eager,
}

/// Calls per graph replay.
pub const CALLS_PER_GRAPH: usize = 10;

type Call<'a> = dyn FnMut(&mut Communicator<CudaComm>, &CudaStream) -> Result<()> + 'a;

/// Device latency samples (µs per all-reduce) of `call` on `stream`, and in graph mode the timing graph (for the
/// check). `boot` reaches the other ranks' processes (`None`: ranks of this process).
fn time_device(
    ctx: &Arc<DeviceContext>,
    stream: &CudaStream,
    mode: Mode,
    cfg: &BenchConfig,
    c: &mut Communicator<CudaComm>,
    call: &mut Call<'_>,
    boot: Option<&mut dyn Bootstrap>,
) -> Result<(Vec<f64>, Option<Graph>)> {
    let events: Vec<Event> = (0..=cfg.iters).map(|_| Event::new(ctx)).collect::<Result<_>>()?;
    match mode {
        Mode::Eager => {
            for _ in 0..cfg.warmup {
                call(c, stream)?;
            }
            for ev in &events[..cfg.iters] {
                ev.record(stream)?;
                call(c, stream)?;
            }
            events[cfg.iters].record(stream)?;
            stream.synchronize()?;
            let samples = (0..cfg.iters)
                .map(|i| Ok(f64::from(events[i].elapsed_ms(&events[i + 1])?) * 1e3))
                .collect::<Result<_>>()?;
            Ok((samples, None))
        }
        Mode::Graph => {
            // Eager calls first: NCCL connects peers lazily on the first call of a kind, and connecting is not
            // allowed during capture ("failed to peer with device 1 … operation not permitted when stream is
            // capturing" at world 2 on an H200 pair without this).
            for _ in 0..cfg.warmup.max(1) {
                call(c, stream)?;
            }
            stream.synchronize()?;
            let graph = Graph::capture(ctx, stream, |s| {
                for _ in 0..CALLS_PER_GRAPH {
                    call(c, s)?;
                }
                Ok(())
            })?;
            // As an engine does after capturing: the custom kernels' captured inputs are registered (collective;
            // every rank captured the same calls), so replays read every rank's input directly.
            c.register_graph_buffers(boot)?;
            for _ in 0..cfg.warmup.max(1) {
                graph.launch(stream)?;
            }
            for ev in &events[..cfg.iters] {
                ev.record(stream)?;
                graph.launch(stream)?;
            }
            events[cfg.iters].record(stream)?;
            stream.synchronize()?;
            let samples = (0..cfg.iters)
                .map(|i| Ok(f64::from(events[i].elapsed_ms(&events[i + 1])?) * 1e3 / CALLS_PER_GRAPH as f64))
                .collect::<Result<_>>()?;
            Ok((samples, Some(graph)))
        }
    }
}

/// Median host time (µs) per call through anyccl (`call(true, …)`) and raw (`call(false, …)`), over `iters` eager
/// calls of each, synchronising after each call. The two are interleaved (anyccl, raw, raw, anyccl, …: the first of
/// each pair alternates), so both see the same clock, cache and scheduling conditions; blocks of each timed one
/// after the other drifted by more than the difference being measured between runs on the H200 machine.
fn time_host_pair(
    stream: &CudaStream,
    iters: usize,
    call: &mut dyn FnMut(bool, &CudaStream) -> Result<()>,
) -> Result<(f64, f64)> {
    let (mut through, mut raw) = (Vec::with_capacity(iters), Vec::with_capacity(iters));
    for i in 0..iters {
        let order = if i % 2 == 0 { [true, false] } else { [false, true] };
        for anyccl in order {
            let t = Instant::now();
            call(anyccl, stream)?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            if anyccl {
                through.push(us)
            } else {
                raw.push(us)
            }
            stream.synchronize()?;
        }
    }
    Ok((median(&mut through), median(&mut raw)))
}

/// The algorithms of `cfg` this communicator can run (in column order), and the others with the reason.
fn eligible(c: &Communicator<CudaComm>, cfg: &BenchConfig) -> (Vec<Algorithm>, Vec<Ineligible>) {
    let esz = cfg.dtype.size_bytes();
    let symmetric = c.capabilities().has(Capabilities::SYMMETRIC_WINDOWS);
    let requested = cfg.algorithms.clone().unwrap_or_else(|| anyccl::cuda::comm::ALGORITHMS.to_vec());
    let mut algorithms = Vec::new();
    let mut ineligible = Vec::new();
    for a in requested {
        match a {
            Algorithm::Ccl => algorithms.push(a),
            Algorithm::CclSymmetric if symmetric => algorithms.push(a),
            Algorithm::CclSymmetric => {
                let reason = c
                    .capabilities()
                    .require(Capabilities::SYMMETRIC_WINDOWS)
                    .err()
                    .map_or_else(|| "symmetric windows are off".into(), |e| e.to_string());
                ineligible.push(Ineligible { algorithm: a, reason });
            }
            other => {
                // Whether the backend could run a 4 KiB call of this kind at all (the table shows why not).
                let probe = AllReduceCall {
                    count: 4096 / esz,
                    dtype: cfg.dtype,
                    op: cfg.op,
                    bytes: 4096,
                    in_place: false,
                    capturing: false,
                    bufs: None,
                };
                match c.check_algorithm(other, &probe) {
                    Ok(()) => algorithms.push(other),
                    Err(Error::AlgorithmNotEligible { why, .. }) => {
                        ineligible.push(Ineligible { algorithm: other, reason: why })
                    }
                    Err(e) => ineligible.push(Ineligible { algorithm: other, reason: e.to_string() }),
                }
            }
        }
    }
    (algorithms, ineligible)
}

/// Where one cell runs and how it is checked.
struct CellRun<'a> {
    cfg: &'a BenchConfig,
    mode: Mode,
    reference: &'a Reference,
    /// The algorithm (`None`: auto).
    algo: Option<Algorithm>,
    in_place: bool,
    /// Message size in bytes.
    n: usize,
    /// This rank's input (its first `n` bytes).
    seed: &'a [u8],
}

/// Times one cell on one rank, then checks it; `chosen` receives auto's selection.
#[allow(clippy::too_many_arguments)]
fn measure_cell(
    run: &CellRun<'_>,
    c: &mut Communicator<CudaComm>,
    stream: &CudaStream,
    input: &DeviceBuffer,
    output: &mut DeviceBuffer,
    host: &mut [u8],
    chosen: &mut Option<Selection>,
    boot: Option<&mut dyn Bootstrap>,
) -> Result<RankCell> {
    let rt = c.runtime().clone();
    let ctx = rt.context().clone();
    let CellRun { cfg, mode, reference, algo, in_place, n, seed } = *run;
    let (dtype, op) = (cfg.dtype, cfg.op);
    let count = n / dtype.size_bytes();
    let seed = &seed[..n];
    let host = &mut host[..n];
    let sv = input.view(..n)?;
    // One call on `out`: the algorithm, or auto (its choice recorded).
    let mut one = |c: &mut Communicator<CudaComm>, out: &mut DeviceBuffer, s: &CudaStream| -> Result<()> {
        let io = if in_place { InOut::InPlace(out) } else { InOut::Separate { send: &*sv, recv: out } };
        match algo {
            Some(a) => c.all_reduce_with(a, io, count, dtype, op, s),
            None => c.all_reduce(io, count, dtype, op, s).map(|sel| *chosen = Some(sel)),
        }
    };
    if in_place {
        rt.upload(output, seed, stream)?;
    }
    let (mut samples, graph) = {
        let mut ov = output.view_mut(..n)?;
        time_device(&ctx, stream, mode, cfg, c, &mut |c, s| one(c, &mut ov, s), boot)?
    };
    // The check: poison the output (or restore the input), run once, download, compare.
    if in_place {
        rt.upload(output, seed, stream)?;
    } else {
        host.fill(0xFF);
        rt.upload(output, host, stream)?;
    }
    match (&graph, in_place) {
        (Some(g), false) => g.launch(stream)?,
        _ => one(c, &mut *output.view_mut(..n)?, stream)?,
    }
    stream.synchronize()?;
    rt.download(output, host, stream)?;
    drop(graph);
    Ok(RankCell::from_samples(&mut samples, reference.count_wrong(host)))
}

/// The bootstrap for one call, borrowed again (`Option::as_deref_mut` would keep the object's longer lifetime).
fn reborrow<'a>(boot: &'a mut Option<&mut dyn Bootstrap>) -> Option<&'a mut dyn Bootstrap> {
    match boot {
        Some(b) => Some(&mut **b),
        None => None,
    }
}

/// A vector of `n` zero bytes, reserved fallibly.
fn host_bytes(n: usize, what: &str) -> Result<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::OutOfMemory { what: what.into(), bytes: n as u64 })?;
    v.resize(n, 0);
    Ok(v)
}

/// One rank's sweep on the CUDA backend: every size, placement and algorithm, timed then checked.
#[allow(clippy::too_many_arguments)]
fn cuda_rank(
    c: &mut Communicator<CudaComm>,
    cfg: &BenchConfig,
    mode: Mode,
    algorithms: &[Algorithm],
    reference: &Reference,
    progress: Progress<'_>,
    mut boot: Option<&mut dyn Bootstrap>,
) -> Result<RankSweep> {
    let rank = c.rank();
    let stream = c.runtime().stream()?;
    let rt = c.runtime().clone();
    let (dtype, op) = (cfg.dtype, cfg.op);
    let max = cfg.sizes.iter().copied().max().unwrap_or(0);
    // Checked against GPU_MAX_MESSAGE_BYTES; a 32-bit host that cannot address it says so.
    let max = usize::try_from(max).map_err(|_| Error::OutOfMemory {
        what: "a message larger than this host's address space".into(),
        bytes: max,
    })?;
    let mut seed = host_bytes(max, "the bench's host copy of its input")?;
    reference.input(rank, &mut seed)?;
    let mut host = host_bytes(max, "the bench's host copy of its output")?;
    let mut send = rt.alloc(max)?;
    rt.upload(&mut send, &seed, &stream)?;
    let mut recv = rt.alloc(max)?;
    // Out of place like the ccl column: send and receive both in registered windows.
    let mut sym = if algorithms.contains(&Algorithm::CclSymmetric) {
        let mut sin = c.backend().symmetric_buffer(max, &stream)?;
        rt.upload(sin.buffer_mut(), &seed, &stream)?;
        Some((sin, c.backend().symmetric_buffer(max, &stream)?))
    } else {
        None
    };
    let mut sweep = RankSweep { cells: Vec::new(), autos: Vec::new(), host: Vec::new() };
    let total = (cfg.sizes.len() * crate::bench::cells_per_size(cfg, algorithms)) as u64;
    let mut done = 0u64;
    let places: &[bool] = if cfg.in_place { &[false, true] } else { &[false] };
    for &bytes in &cfg.sizes {
        let n = bytes as usize;
        let count = n / dtype.size_bytes();
        for &in_place in places {
            let mut chosen = None;
            for algo in algorithms.iter().copied().map(Some).chain([None]) {
                let run = CellRun { cfg, mode, reference, algo, in_place, n, seed: &seed };
                let cell = match algo {
                    Some(Algorithm::CclSymmetric) => {
                        let (sin, sout) =
                            sym.as_mut().ok_or_else(|| Error::PeerFailure("no symmetric buffer".into()))?;
                        // In place, only the output window is used (the input is uploaded into it).
                        measure_cell(
                            &run,
                            c,
                            &stream,
                            sin.buffer(),
                            sout.buffer_mut(),
                            &mut host,
                            &mut chosen,
                            reborrow(&mut boot),
                        )?
                    }
                    Some(a) => {
                        let call = AllReduceCall { count, dtype, op, bytes: n, in_place, capturing: false, bufs: None };
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
                    progress(done, total);
                }
            }
            sweep.autos.push(chosen.map_or((Algorithm::Ccl, String::new()), |s| (s.algorithm, s.why.to_string())));
        }
        let host_pair = if mode == Mode::Eager {
            // The raw call's (type, operator) codes are mapped once, outside the loop: it is NCCL alone.
            let reduction = anyccl::ccl::CclReduction::new(c.backend().ccl().library(), dtype, op)?;
            let sv = send.view(..n)?;
            let mut rv = recv.view_mut(..n)?;
            Some(time_host_pair(&stream, cfg.iters, &mut |anyccl, s| {
                if anyccl {
                    return c
                        .all_reduce(InOut::Separate { send: &*sv, recv: &mut *rv }, count, dtype, op, s)
                        .map(|_| ());
                }
                // SAFETY: views of this rank's live buffers of this device, `n` bytes each (validated above by
                // `view`); the stream is live.
                unsafe {
                    c.backend().ccl().all_reduce(
                        sv.device_ptr() as *const std::ffi::c_void,
                        rv.device_ptr() as *mut std::ffi::c_void,
                        count,
                        reduction,
                        s.raw() as _,
                    )
                }
            })?)
        } else {
            None
        };
        sweep.host.push(host_pair);
    }
    drop(sym.take());
    c.barrier(&stream)?;
    Ok(sweep)
}

/// The library's name, version and file (`NCCL 2.28.3 (/path/libnccl.so.2)`).
fn library_text(c: &Communicator<CudaComm>) -> String {
    let lib = c.backend().ccl().library();
    format!("{} ({})", lib.describe(), lib.path().display())
}

/// The device of ordinal `ordinal` (`GPU 0: NVIDIA H200 (sm_90, 140 GiB)`).
fn device_text(info: &anyccl::cuda::driver::DriverInfo, ordinal: i32) -> String {
    match info.devices.iter().find(|d| d.ordinal == ordinal) {
        Some(d) => format!("GPU {ordinal}: {} ({}, {} GiB)", d.name, d.arch(), d.total_memory >> 30),
        None => format!("GPU {ordinal}"),
    }
}

fn method(info: &anyccl::cuda::driver::DriverInfo, mode: Mode, launch: Launch) -> String {
    let ranks = match launch {
        Launch::Threads => "one process, a thread and an NCCL communicator per GPU; rank 0's median",
        Launch::Processes => "one process per GPU (--per-rank); the average of the ranks' medians",
    };
    match mode {
        Mode::Graph => format!(
            "driver {}: one CUDA graph of {CALLS_PER_GRAPH} back-to-back all-reduces per replay, timed with events; \
             latency = replay / {CALLS_PER_GRAPH}; median of the timed replays; {ranks}",
            info.version_string()
        ),
        Mode::Eager => format!(
            "driver {}: each eager call between two events; median; {ranks}. host us/call: median wall time of the \
             call itself (anyccl vs raw ncclAllReduce, rank 0)",
            info.version_string()
        ),
    }
}

fn check_text(reference: &Reference, mode: Mode) -> String {
    let graph = match mode {
        Mode::Graph => "out of place: the output poisoned (0xFF) and the timing graph replayed once",
        Mode::Eager => "out of place: the output poisoned (0xFF) and one eager call",
    };
    format!(
        "{}; {graph}; in place: the input restored and one eager call; every output downloaded",
        reference.describe()
    )
}

fn driver() -> Result<&'static anyccl::cuda::driver::DriverInfo> {
    anyccl::cuda::available().map_err(|reason| Error::Unsupported { capability: "cuda-runtime".into(), reason })
}

/// Runs the sweep on the CUDA backend, one thread per GPU of this process.
pub fn run(cfg: &BenchConfig, mode: Mode, progress: Progress<'_>) -> Result<BenchReport> {
    cfg.check(crate::bench::Limits::GPU)?;
    let info = driver()?;
    if cfg.world > info.devices.len() {
        return Err(crate::bench::flag_error(
            "--world",
            format!(
                "{} ranks; one process drives at most one rank per GPU, and this machine has {} (start one process \
                 per GPU with --per-rank for more)",
                cfg.world,
                info.devices.len()
            ),
        ));
    }
    let lib = anyccl::cuda::bootstrap::load_nccl()?;
    let reference = Reference::new(cfg.dtype, cfg.op, cfg.world)?;
    let ordinals: Vec<i32> = (0..cfg.world as i32).collect();
    let comms = anyccl::cuda::communicators_single_process(lib, &ordinals, cfg.selector.clone())?;
    let first = comms.first().ok_or_else(|| Error::PeerFailure("no communicator was made".into()))?;
    let (algorithms, ineligible) = eligible(first, cfg);
    let library = library_text(first);
    let sweeps = on_ranks(comms, |mut c| cuda_rank(&mut c, cfg, mode, &algorithms, &reference, progress, None))?;
    let all: Vec<Vec<RankCell>> = sweeps.iter().map(|s| s.cells.clone()).collect();
    // `on_ranks` returns every rank's result or an error, never an empty list: `sweeps[0]` is rank 0's.
    let rows = assemble(cfg, &algorithms, Algorithm::Ccl, &all, &sweeps[0], Headline::Rank0)?;
    let (host, pid) = (host_name(), std::process::id());
    let ranks = ordinals
        .iter()
        .enumerate()
        .map(|(rank, &o)| RankInfo { rank, host: host.clone(), pid, device: device_text(info, o) })
        .collect();
    Ok(report(
        cfg,
        "cuda",
        Launch::Threads,
        Some(library),
        ranks,
        Algorithm::Ccl,
        algorithms,
        ineligible,
        rows,
        check_text(&reference, mode),
        method(info, mode, Launch::Threads),
    ))
}

/// Runs the sweep with this process as one rank of a job started by torchrun or srun (`--per-rank`): `c` was
/// joined through `boot` (the rendezvous of [`anyccl::cuda::bootstrap::communicator_from_env`]). Every rank
/// measures; the ranks exchange their cells over `boot`, and every rank returns the whole report (rank 0 prints it).
pub fn run_processes(
    mut c: Communicator<CudaComm>,
    boot: &mut dyn Bootstrap,
    cfg: &BenchConfig,
    mode: Mode,
    progress: Progress<'_>,
) -> Result<BenchReport> {
    use anyccl::core::bootstrap::checked_all_gather;
    cfg.check(crate::bench::Limits::GPU)?;
    let info = driver()?;
    let (algorithms, ineligible) = eligible(&c, cfg);
    let mode_name = format!("cuda processes {mode:?}");
    check_agreement(&checked_all_gather(boot, &fingerprint(cfg, &algorithms, &mode_name))?)?;
    let reference = Reference::new(cfg.dtype, cfg.op, cfg.world)?;
    let sweep = cuda_rank(&mut c, cfg, mode, &algorithms, &reference, progress, Some(&mut *boot))?;
    let expected = sweep.cells.len();
    let cells = checked_all_gather(boot, &encode_cells(&sweep.cells))?;
    let all = cells.iter().enumerate().map(|(r, b)| decode_cells(r, b, expected)).collect::<Result<Vec<_>>>()?;
    let device = device_text(info, c.runtime().context().ordinal());
    let ranks = decode_rank_info(&checked_all_gather(boot, &encode_rank_info(&host_name(), &device))?)?;
    let rows = assemble(cfg, &algorithms, Algorithm::Ccl, &all, &sweep, Headline::Average)?;
    Ok(report(
        cfg,
        "cuda",
        Launch::Processes,
        Some(library_text(&c)),
        ranks,
        Algorithm::Ccl,
        algorithms,
        ineligible,
        rows,
        check_text(&reference, mode),
        method(info, mode, Launch::Processes),
    ))
}
