//! `anyccl bench --backend cuda`: all-reduce on NVIDIA GPUs through the CUDA backend.
//!
//! One process, one thread and one NCCL communicator per GPU (`ncclCommInitAll`). Two timing modes:
//! - graph (default): one CUDA graph holding 10 back-to-back all-reduces; warm-up replays, then timed replays,
//!   each between two events; latency = replay time / 10; the median is reported (how engines measure);
//! - eager: each call between two events; the median is reported.
//!
//! In eager mode the host time of each call is measured too, through anyccl and through a raw `ncclAllReduce` of
//! the same library on the same buffers, to show anyccl's per-call overhead.

use std::sync::Arc;
use std::time::Instant;

use anyccl::cuda::graph::{Event, Graph};
use anyccl::cuda::{CudaComm, CudaStream, DeviceBuffer, DeviceContext};
use serde::Serialize;

use crate::bench::{make_row, median, on_ranks, BenchConfig, BenchReport, Ineligible, Progress};
use anyccl::core::{Algorithm, Capabilities, Communicator, Error, InOut, MemoryRuntime, Result};

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

/// Device latency samples (µs per all-reduce) of `call` on `stream`.
fn time_device(
    ctx: &Arc<DeviceContext>,
    stream: &CudaStream,
    mode: Mode,
    cfg: &BenchConfig,
    c: &mut Communicator<CudaComm>,
    call: &mut dyn FnMut(&mut Communicator<CudaComm>, &CudaStream) -> Result<()>,
) -> Result<Vec<f64>> {
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
            (0..cfg.iters).map(|i| Ok(f64::from(events[i].elapsed_ms(&events[i + 1])?) * 1e3)).collect()
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
            c.register_graph_buffers(None)?;
            for _ in 0..cfg.warmup.max(1) {
                graph.launch(stream)?;
            }
            for ev in &events[..cfg.iters] {
                ev.record(stream)?;
                graph.launch(stream)?;
            }
            events[cfg.iters].record(stream)?;
            stream.synchronize()?;
            (0..cfg.iters)
                .map(|i| Ok(f64::from(events[i].elapsed_ms(&events[i + 1])?) * 1e3 / CALLS_PER_GRAPH as f64))
                .collect()
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

type RankRow = (Vec<Vec<f64>>, (Vec<f64>, Algorithm, String), Option<(f64, f64)>);

/// Runs the sweep on the CUDA backend.
pub fn run(cfg: &BenchConfig, mode: Mode, progress: Progress<'_>) -> Result<BenchReport> {
    cfg.check(crate::bench::Limits::GPU)?;
    let info =
        anyccl::cuda::available().map_err(|reason| Error::Unsupported { capability: "cuda-runtime".into(), reason })?;
    if cfg.world > info.devices.len() {
        return Err(Error::Parse {
            what: "world size",
            input: cfg.world.to_string(),
            expected: format!(
                "at most {} (one process drives one rank per GPU; this machine has that many)",
                info.devices.len()
            ),
        });
    }
    let lib = anyccl::ccl::load(anyccl::ccl::CclVendor::Nccl).map_err(|e| Error::Unsupported {
        capability: "ccl".into(),
        reason: anyccl::core::Reason::Unavailable { component: "NCCL".into(), detail: e.to_string() },
    })?;
    let esz = cfg.dtype.size_bytes() as u64;
    for &b in &cfg.sizes {
        if b == 0 || b % esz != 0 {
            return Err(Error::Parse {
                what: "message size",
                input: b.to_string(),
                expected: format!("a positive multiple of the {} element size ({esz} B)", cfg.dtype),
            });
        }
    }
    let ordinals: Vec<i32> = (0..cfg.world as i32).collect();
    let comms = anyccl::cuda::communicators_single_process(lib, &ordinals, cfg.selector.clone())?;
    let symmetric = comms.first().is_some_and(|c| c.capabilities().has(Capabilities::SYMMETRIC_WINDOWS));
    let requested = cfg.algorithms.clone().unwrap_or_else(|| anyccl::cuda::comm::ALGORITHMS.to_vec());
    let mut algorithms = Vec::new();
    let mut ineligible = Vec::new();
    for a in requested {
        match a {
            Algorithm::Ccl => algorithms.push(a),
            Algorithm::CclSymmetric if symmetric => algorithms.push(a),
            Algorithm::CclSymmetric => {
                let reason = comms
                    .first()
                    .and_then(|c| c.capabilities().require(Capabilities::SYMMETRIC_WINDOWS).err())
                    .map_or_else(|| "symmetric windows are off".into(), |e| e.to_string());
                ineligible.push(Ineligible { algorithm: a, reason });
            }
            other => {
                // Whether the backend could run a 4 KiB call of this kind at all (the table shows why not).
                let probe = anyccl::core::comm::AllReduceCall {
                    count: 4096 / esz as usize,
                    dtype: cfg.dtype,
                    op: cfg.op,
                    bytes: 4096,
                    in_place: false,
                    capturing: false,
                    bufs: None,
                };
                match comms.first().map(|c| c.check_algorithm(other, &probe)) {
                    Some(Ok(())) => algorithms.push(other),
                    Some(Err(Error::AlgorithmNotEligible { why, .. })) => {
                        ineligible.push(Ineligible { algorithm: other, reason: why })
                    }
                    Some(Err(e)) => ineligible.push(Ineligible { algorithm: other, reason: e.to_string() }),
                    None => {}
                }
            }
        }
    }
    let max_bytes = cfg.sizes.iter().copied().max().unwrap_or(0);
    // Checked against GPU_MAX_MESSAGE_BYTES above; a 32-bit host that cannot address it says so.
    let max_bytes = usize::try_from(max_bytes).map_err(|_| Error::OutOfMemory {
        what: "a message larger than this host's address space".into(),
        bytes: max_bytes,
    })?;
    let total = (cfg.sizes.len() * (algorithms.len() + 1)) as u64;

    let run_rank = |mut c: Communicator<CudaComm>| -> Result<Vec<RankRow>> {
        let rank = c.rank();
        let stream = c.runtime().stream()?;
        let rt = c.runtime().clone();
        let ctx = rt.context().clone();
        let dtype = cfg.dtype;
        let op = cfg.op;
        let mut seed: Vec<u8> = Vec::new();
        seed.try_reserve_exact(max_bytes).map_err(|_| Error::OutOfMemory {
            what: "the bench's host copy of its input".into(),
            bytes: max_bytes as u64,
        })?;
        seed.extend((0..max_bytes).map(|i| ((i * 7 + rank * 13) % 61) as u8 & 0x3f));
        let mut send = rt.alloc(max_bytes)?;
        rt.upload(&mut send, &seed, &stream)?;
        let recv = rt.alloc(max_bytes)?;
        // Out of place like the ccl column: send and receive both in registered windows.
        let mut sym = if algorithms.contains(&Algorithm::CclSymmetric) {
            let mut sin = c.backend().symmetric_buffer(max_bytes, &stream)?;
            rt.upload(sin.buffer_mut(), &seed, &stream)?;
            Some((sin, c.backend().symmetric_buffer(max_bytes, &stream)?))
        } else {
            None
        };
        let mut rows = Vec::new();
        let mut done = 0u64;
        for &bytes in &cfg.sizes {
            let count = (bytes / esz) as usize;
            // Views of the first `bytes` of each buffer, so validation sees the call's own size.
            // SAFETY: each view lies within an allocation that outlives this loop iteration.
            let (sv, mut rv) = unsafe {
                (
                    DeviceBuffer::from_raw(send.device_ptr(), bytes as usize, rt.context().ordinal().unsigned_abs()),
                    DeviceBuffer::from_raw(recv.device_ptr(), bytes as usize, rt.context().ordinal().unsigned_abs()),
                )
            };
            let mut per_algo = Vec::new();
            for &a in &algorithms {
                let samples = if a == Algorithm::CclSymmetric {
                    let (sin, sout) = sym.as_mut().ok_or_else(|| Error::PeerFailure("no symmetric buffer".into()))?;
                    let ord = rt.context().ordinal().unsigned_abs();
                    // SAFETY: within the symmetric allocations, which outlive the call.
                    let (ws, mut wr) = unsafe {
                        (
                            DeviceBuffer::from_raw(sin.buffer().device_ptr(), bytes as usize, ord),
                            DeviceBuffer::from_raw(sout.buffer().device_ptr(), bytes as usize, ord),
                        )
                    };
                    time_device(&ctx, &stream, mode, cfg, &mut c, &mut |c, s| {
                        c.all_reduce_with(a, InOut::Separate { send: &ws, recv: &mut wr }, count, dtype, op, s)
                    })?
                } else {
                    let call = anyccl::core::comm::AllReduceCall {
                        count,
                        dtype,
                        op,
                        bytes: bytes as usize,
                        in_place: false,
                        capturing: false,
                        bufs: None,
                    };
                    if c.check_algorithm(a, &call).is_err() {
                        // Not for this size (e.g. above the custom kernels' staging buffers): an empty cell.
                        Vec::new()
                    } else {
                        time_device(&ctx, &stream, mode, cfg, &mut c, &mut |c, s| {
                            c.all_reduce_with(a, InOut::Separate { send: &sv, recv: &mut rv }, count, dtype, op, s)
                        })?
                    }
                };
                per_algo.push(samples);
                done += 1;
                if rank == 0 {
                    progress(done, total);
                }
            }
            let mut why = String::new();
            let mut chosen = Algorithm::Ccl;
            let auto = time_device(&ctx, &stream, mode, cfg, &mut c, &mut |c, s| {
                let sel = c.all_reduce(InOut::Separate { send: &sv, recv: &mut rv }, count, dtype, op, s)?;
                chosen = sel.algorithm;
                why = sel.why.to_string();
                Ok(())
            })?;
            done += 1;
            if rank == 0 {
                progress(done, total);
            }
            let host = if mode == Mode::Eager {
                // The raw call's (type, operator) codes are mapped once, outside the loop: it is NCCL alone.
                let reduction = anyccl::ccl::CclReduction::new(c.backend().ccl().library(), dtype, op)?;
                Some(time_host_pair(&stream, cfg.iters, &mut |anyccl, s| {
                    if anyccl {
                        return c
                            .all_reduce(InOut::Separate { send: &sv, recv: &mut rv }, count, dtype, op, s)
                            .map(|_| ());
                    }
                    // SAFETY: validated-size views of live buffers of this device; the stream is live.
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
            rows.push((per_algo, (auto, chosen, why), host));
        }
        drop(sym.take());
        c.barrier(&stream)?;
        Ok(rows)
    };

    let rank0: Vec<RankRow> = on_ranks(comms, run_rank)?;
    let baseline = Algorithm::Ccl;
    let rows = cfg
        .sizes
        .iter()
        .zip(rank0)
        .map(|(&bytes, (per_algo, (auto, chosen, why), host))| {
            make_row(cfg, bytes, &algorithms, per_algo, (auto, chosen, why), baseline, host)
        })
        .collect();
    let dev = info.devices.first().map(|d| format!("{} ({})", d.name, d.arch())).unwrap_or_default();
    Ok(BenchReport {
        backend: "cuda".into(),
        world: cfg.world,
        dtype: cfg.dtype,
        op: cfg.op,
        iters: cfg.iters,
        warmup: cfg.warmup,
        baseline,
        algorithms,
        ineligible,
        rows,
        method: match mode {
            Mode::Graph => format!(
                "{dev}, driver {}: one CUDA graph of {CALLS_PER_GRAPH} back-to-back all-reduces per replay, timed \
                 with events; latency = replay / {CALLS_PER_GRAPH}; median of the timed replays",
                info.version_string()
            ),
            Mode::Eager => format!(
                "{dev}, driver {}: each eager call between two events; median. host us/call: median wall time of \
                 the call itself (anyccl vs raw ncclAllReduce)",
                info.version_string()
            ),
        },
    })
}
