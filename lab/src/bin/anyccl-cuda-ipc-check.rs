//! Checks inter-process device memory on this machine: run one process per rank with the torchrun variables
//! (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`); each fills a buffer with its own pattern, exchanges
//! handles (`--kind legacy` for cuIpc handles of cuMemAlloc memory, `--kind vmm` for cuMem allocations passed as
//! file descriptors over a private Unix socket), reads every peer's buffer and checks it. Prints one line per
//! rank; exits non-zero on any mismatch or error. Device: `--device N` (default 0).
//!
//! Other kinds, one process per GPU: `nccl` (NCCL all-reduce, the custom kernels over IPC, graph buffers, NCCL
//! symmetric windows), `conformance` (the core suite against the host reference, results compared bitwise
//! between the processes) and `kill-ALGORITHM` (the last rank dies; the others must fail within a limit).

use std::process::ExitCode;

use anyccl_core::{Algorithm, DataType, InOut, MemoryRuntime, ReduceOp, Result};
use anyccl_cuda::ipc::VmmBuffer;
use anyccl_cuda::multi_process::{exchange_legacy, exchange_vmm};
use anyccl_cuda::{CudaRuntime, DeviceBuffer};
use anyccl_rendezvous::{Rendezvous, RendezvousConfig};

const LEN: usize = 1 << 20;

fn pattern(rank: usize) -> Vec<u8> {
    (0..LEN).map(|i| ((i * 31 + rank * 101 + 7) % 251) as u8).collect()
}

/// One process per GPU through the rendezvous: all-reduce (sum) of rank-dependent integers, checked exactly.
fn run_nccl() -> Result<String> {
    let selector = std::sync::Arc::new(anyccl_core::Selector::from_env()?);
    let (mut comm, mut rdv) = anyccl_cuda::multi_process::communicator_from_env(selector)?;
    let (rank, world) = (comm.rank(), comm.world_size());
    let rt = comm.runtime().clone();
    let stream = rt.stream()?;
    let n = 1usize << 20;
    let mine: Vec<i32> = (0..n).map(|i| (i % 1000) as i32 * (rank as i32 + 1)).collect();
    let mut buf = rt.alloc(n * 4)?;
    rt.upload(&mut buf, bytemuck_bytes(&mine), &stream)?;
    let sel = comm.all_reduce(
        anyccl_core::InOut::InPlace(&mut buf),
        n,
        anyccl_core::DataType::I32,
        anyccl_core::ReduceOp::Sum,
        &stream,
    )?;
    let mut out = vec![0u8; n * 4];
    rt.download(&buf, &mut out, &stream)?;
    let factor: i32 = (1..=world as i32).sum();
    for (i, c) in out.chunks_exact(4).enumerate() {
        let v = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        if v != (i % 1000) as i32 * factor {
            return Err(anyccl_core::Error::PeerFailure(format!("rank {rank}: element {i} is {v}")));
        }
    }
    // The custom kernels over IPC, on bf16 values that are exact in bf16 (small integers).
    let mut custom = Vec::new();
    let algos = if world > 1 { vec![Algorithm::OneShot, Algorithm::TwoShot] } else { vec![] };
    for algo in algos {
        let m = 1usize << 19;
        let vals: Vec<u16> = (0..m).map(|i| bf16_bits((i % 17) as f32 + rank as f32)).collect();
        let mut b = rt.alloc(m * 2)?;
        rt.upload(&mut b, bytemuck::cast_slice(&vals), &stream)?;
        comm.all_reduce_with(algo, InOut::InPlace(&mut b), m, DataType::Bf16, ReduceOp::Sum, &stream)?;
        let mut o = vec![0u8; m * 2];
        rt.download(&b, &mut o, &stream)?;
        let rank_sum: f32 = (0..world).map(|r| r as f32).sum();
        for (i, c) in o.chunks_exact(2).enumerate() {
            let want = bf16_bits((i % 17) as f32 * world as f32 + rank_sum);
            let got = u16::from_le_bytes([c[0], c[1]]);
            if got != want {
                return Err(anyccl_core::Error::PeerFailure(format!(
                    "rank {rank}: {algo} element {i} is {got:#x}, expected {want:#x}"
                )));
            }
        }
        custom.push(algo.to_string());
    }
    let graphs = if world > 1 { graph_buffers(&mut comm, &mut rdv, &rt, &stream)? } else { String::new() };
    let windows = symmetric_windows(&mut comm, &rt, &stream)?;
    rdv.barrier()?;
    Ok(format!(
        "rank {rank}: nccl all-reduce over {world} processes ok ({}); custom [{}] over IPC ok{graphs}; {windows}",
        sel.algorithm,
        custom.join(", ")
    ))
}

/// NCCL symmetric windows between the processes: an in-place all-reduce on one registered window and an
/// out-of-place one between two, both forced to `ccl-symmetric`, then `auto` on the window (which must choose a
/// path that is correct there); f32 small integers, so the sums are exact.
fn symmetric_windows(
    comm: &mut anyccl_core::Communicator<anyccl_cuda::CudaComm>,
    rt: &CudaRuntime,
    stream: &anyccl_cuda::CudaStream,
) -> Result<String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    comm.capabilities().require(anyccl_core::Capabilities::SYMMETRIC_WINDOWS)?;
    let n = 1usize << 18;
    let fill = |round: i32| -> Vec<f32> { (0..n).map(|i| ((i as i32 + round) % 11 + rank as i32) as f32).collect() };
    let rank_sum: i32 = (0..world as i32).sum();
    let check = |what: &str, round: i32, buf: &anyccl_cuda::DeviceBuffer| -> Result<()> {
        let mut got = vec![0u8; n * 4];
        rt.download(buf, &mut got, stream)?;
        for (i, c) in got.chunks_exact(4).enumerate() {
            let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            let want = (((i as i32 + round) % 11) * world as i32 + rank_sum) as f32;
            if v != want {
                return Err(anyccl_core::Error::PeerFailure(format!(
                    "rank {rank}: symmetric window, {what}: element {i} is {v}, expected {want}"
                )));
            }
        }
        Ok(())
    };
    let mut a = comm.backend().symmetric_buffer(n * 4, stream)?;
    let mut b = comm.backend().symmetric_buffer(n * 4, stream)?;
    rt.upload(a.buffer_mut(), bytemuck::cast_slice(&fill(0)), stream)?;
    comm.all_reduce_with(
        Algorithm::CclSymmetric,
        InOut::InPlace(a.buffer_mut()),
        n,
        DataType::F32,
        ReduceOp::Sum,
        stream,
    )?;
    check("in place", 0, a.buffer())?;
    rt.upload(a.buffer_mut(), bytemuck::cast_slice(&fill(1)), stream)?;
    let bufs = InOut::Separate { send: a.buffer(), recv: b.buffer_mut() };
    comm.all_reduce_with(Algorithm::CclSymmetric, bufs, n, DataType::F32, ReduceOp::Sum, stream)?;
    check("out of place", 1, b.buffer())?;
    rt.upload(a.buffer_mut(), bytemuck::cast_slice(&fill(2)), stream)?;
    let sel = comm.all_reduce(InOut::InPlace(a.buffer_mut()), n, DataType::F32, ReduceOp::Sum, stream)?;
    check("auto", 2, a.buffer())?;
    stream.synchronize()?;
    Ok(format!("symmetric windows ok (in place, out of place; auto chose {})", sel.algorithm))
}

/// The core conformance suite with one process per rank: every collective × dtype × op × count × in/out of
/// place (and every all-reduce algorithm) against the host reference, then the all-reduce results' hashes are
/// exchanged through the rendezvous and must be bitwise identical on every rank.
fn run_conformance() -> Result<String> {
    let selector = std::sync::Arc::new(anyccl_core::Selector::from_env()?);
    let (mut comm, mut rdv) = anyccl_cuda::multi_process::communicator_from_env(selector)?;
    let (rank, world) = (comm.rank(), comm.world_size());
    let stream = comm.runtime().stream()?;
    let cfg = anyccl_core::conformance::Config {
        worlds: vec![world],
        counts: vec![0, 1, 5, 1037, 65537],
        ..anyccl_core::conformance::Config::default()
    };
    let report = anyccl_core::conformance::run_one_rank(&mut comm, &stream, &cfg);
    if !report.failures.is_empty() {
        let shown: Vec<_> = report.failures.iter().take(20).cloned().collect();
        return Err(anyccl_core::Error::PeerFailure(format!(
            "rank {rank}: {} conformance failures (first {}):\n{}",
            report.failures.len(),
            shown.len(),
            shown.join("\n")
        )));
    }
    if report.checks == 0 {
        return Err(anyccl_core::Error::PeerFailure(format!("rank {rank}: the conformance suite checked nothing")));
    }
    let all = rdv.all_gather(&anyccl_core::conformance::encode_hashes(&report.all_reduce_hashes))?;
    let hashes = all.iter().map(|b| anyccl_core::conformance::decode_hashes(b)).collect::<Result<Vec<_>>>()?;
    let mismatches = anyccl_core::conformance::compare_hashes(&hashes);
    if !mismatches.is_empty() {
        return Err(anyccl_core::Error::PeerFailure(format!(
            "rank {rank}: {} all-reduce results differ between ranks: {}",
            mismatches.len(),
            mismatches.iter().take(10).cloned().collect::<Vec<_>>().join("; ")
        )));
    }
    rdv.barrier()?;
    Ok(format!(
        "rank {rank}: conformance over {world} processes ok: {} checks, {} expected errors, {} all-reduce results bitwise identical on every rank",
        report.checks,
        report.expected_errors,
        report.all_reduce_hashes.len()
    ))
}

/// Graph buffers over IPC: one-shot (out of place) and two-shot (in place) captured on buffers never used
/// before; replayed once before registration (through staging), then registered through the rendezvous and
/// replayed with new inputs (read directly from every process). Checked exactly.
fn graph_buffers(
    comm: &mut anyccl_core::Communicator<anyccl_cuda::CudaComm>,
    rdv: &mut Rendezvous,
    rt: &CudaRuntime,
    stream: &anyccl_cuda::CudaStream,
) -> Result<String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let m = 1usize << 18;
    let rank_sum: f32 = (0..world).map(|r| r as f32).sum();
    let fill =
        |round: usize| -> Vec<u16> { (0..m).map(|i| bf16_bits(((i + round) % 13) as f32 + rank as f32)).collect() };
    let want = |round: usize| -> Vec<u16> {
        (0..m).map(|i| bf16_bits(((i + round) % 13) as f32 * world as f32 + rank_sum)).collect()
    };
    let mut a_in = rt.alloc(m * 2)?;
    let mut a_out = rt.alloc(m * 2)?;
    let mut b = rt.alloc(m * 2)?;
    let ctx = rt.context().clone();
    let graph = anyccl_cuda::graph::Graph::capture(&ctx, stream, |s| {
        let out = InOut::Separate { send: &a_in, recv: &mut a_out };
        comm.all_reduce_with(Algorithm::OneShot, out, m, DataType::Bf16, ReduceOp::Sum, s)?;
        comm.all_reduce_with(Algorithm::TwoShot, InOut::InPlace(&mut b), m, DataType::Bf16, ReduceOp::Sum, s)?;
        Ok(())
    })?;
    let fail = |m: String| anyccl_core::Error::PeerFailure(format!("rank {rank}: graph buffers: {m}"));
    let pending = comm.pending_graph_buffers();
    if pending != 2 {
        return Err(fail(format!("{pending} pending graph inputs, expected 2")));
    }
    let mut registered = 0;
    for round in 0..3 {
        if round == 1 {
            let reg = comm.register_graph_buffers(Some(rdv))?;
            if reg.registered != 2 || !reg.kept_staged.is_empty() {
                return Err(fail(format!("registration {reg:?}")));
            }
            registered = reg.registered;
        }
        rt.upload(&mut a_in, bytemuck::cast_slice(&fill(round)), stream)?;
        rt.upload(&mut b, bytemuck::cast_slice(&fill(round)), stream)?;
        graph.launch(stream)?;
        stream.synchronize()?;
        for (name, buf) in [("one-shot out of place", &a_out), ("two-shot in place", &b)] {
            let mut got = vec![0u8; m * 2];
            rt.download(buf, &mut got, stream)?;
            if got != bytemuck::cast_slice::<u16, u8>(&want(round)) {
                return Err(fail(format!("{name}, replay {round}: wrong result")));
            }
        }
    }
    Ok(format!("; graph buffers: {registered} registered over IPC, replays before and after ok"))
}

/// bf16 bits of a small integer (exact in bf16, so truncating the f32 bits is exact too).
fn bf16_bits(v: f32) -> u16 {
    (v.to_bits() >> 16) as u16
}

fn bytemuck_bytes(v: &[i32]) -> &[u8] {
    // i32 has no padding and u8 no alignment needs.
    bytemuck::cast_slice(v)
}

/// A rank that dies mid-run: every rank runs one all-reduce with `algo` (connections made, kernels loaded), then
/// the last rank exits without a word, and rank 0 runs a second one and waits at most 10 s. Succeeds when that
/// second call or its wait fails within the limit (with the error printed); fails if the wait returns `Ok`.
fn run_kill(algo: &str) -> Result<String> {
    let algo: Algorithm = algo.parse()?;
    let selector = std::sync::Arc::new(anyccl_core::Selector::from_env()?);
    let (mut comm, mut rdv) = anyccl_cuda::multi_process::communicator_from_env(selector)?;
    let (rank, world) = (comm.rank(), comm.world_size());
    let rt = comm.runtime().clone();
    let stream = rt.stream()?;
    let m = 1usize << 18;
    let mut b = rt.alloc(m * 2)?;
    rt.upload(&mut b, &vec![0u8; m * 2], &stream)?;
    comm.all_reduce_with(algo, InOut::InPlace(&mut b), m, DataType::Bf16, ReduceOp::Sum, &stream)?;
    comm.wait(&stream, std::time::Duration::from_secs(60))?;
    rdv.barrier()?;
    if rank + 1 == world {
        // Dies: no communicator teardown, no goodbye to the rendezvous.
        std::process::exit(17);
    }
    let start = std::time::Instant::now();
    let r = comm
        .all_reduce_with(algo, InOut::InPlace(&mut b), m, DataType::Bf16, ReduceOp::Sum, &stream)
        .and_then(|_| comm.wait(&stream, std::time::Duration::from_secs(10)));
    let secs = start.elapsed().as_secs_f64();
    match r {
        Ok(()) => Err(anyccl_core::Error::PeerFailure(format!(
            "rank {rank}: {algo} finished although rank {} is dead",
            world - 1
        ))),
        Err(e) => {
            // The failed wait told the custom kernels to stop and aborted NCCL, so freeing everything must not
            // wait for a kernel stuck on the dead peer.
            let start = std::time::Instant::now();
            drop(b);
            drop(stream);
            drop(comm);
            drop(rdv);
            Ok(format!(
                "rank {rank}: {algo} with a dead peer failed after {secs:.1} s: {e}; cleaned up in {:.1} s",
                start.elapsed().as_secs_f64()
            ))
        }
    }
}

fn run(kind: &str, device: i32) -> Result<String> {
    if kind == "nccl" {
        return run_nccl();
    }
    if kind == "conformance" {
        return run_conformance();
    }
    if let Some(algo) = kind.strip_prefix("kill-") {
        return run_kill(algo);
    }
    let mut rdv = Rendezvous::establish(RendezvousConfig::from_env()?)?;
    let rank = rdv.rank();
    let rt = CudaRuntime::new(device)?;
    let stream = rt.stream()?;
    let ctx = rt.context().clone();
    let check = |q: usize, view: &DeviceBuffer| -> Result<()> {
        let mut got = vec![0u8; LEN];
        rt.download(view, &mut got, &stream)?;
        if got != pattern(q) {
            return Err(anyccl_core::Error::PeerFailure(format!("rank {rank} read wrong data from rank {q}")));
        }
        Ok(())
    };
    let peers = match kind {
        "legacy" => {
            let mut own = rt.alloc(LEN)?;
            rt.upload(&mut own, &pattern(rank), &stream)?;
            let maps = exchange_legacy(&mut rdv, &ctx, &own)?;
            for (q, m) in maps.iter().enumerate() {
                if let Some(m) = m {
                    check(q, &m.view())?;
                }
            }
            rdv.barrier()?;
            maps.iter().flatten().count()
        }
        "vmm" => {
            let own = VmmBuffer::alloc(&ctx, LEN)?;
            let mut view = own.view();
            rt.upload(&mut view, &pattern(rank), &stream)?;
            let maps = exchange_vmm(&mut rdv, &ctx, &own)?;
            for (q, m) in maps.iter().enumerate() {
                if let Some(m) = m {
                    check(q, &m.view())?;
                }
            }
            rdv.barrier()?;
            maps.iter().flatten().count()
        }
        other => {
            return Err(anyccl_core::Error::Parse {
                what: "IPC kind",
                input: other.into(),
                expected: "legacy, vmm, nccl, conformance, kill-ALGORITHM".into(),
            })
        }
    };
    Ok(format!("rank {rank}: {kind} IPC ok, read {peers} peer buffers of {LEN} bytes"))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let kind = arg("--kind").unwrap_or_else(|| "legacy".into());
    let device = arg("--device").and_then(|d| d.parse().ok()).unwrap_or(0);
    match run(&kind, device) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
