//! CUDA backend tests. The ones marked `#[ignore = "needs an NVIDIA GPU…"]` run on the GPU machine with
//! `--ignored` (CI has no GPU and lists them as ignored); the others run everywhere.

use std::path::Path;
use std::sync::Arc;

use anyccl_core::conformance::{self, Config, ConformanceTarget};
use anyccl_core::{
    Algorithm, Capabilities, CapabilityState, Communicator, DataType, InOut, ReduceOp, Result, Selector,
};
use anyccl_cuda::{CudaComm, CudaStream};
use cudarc::driver::{result, sys};

fn has_gpu() -> bool {
    Path::new("/dev/nvidia0").exists()
}

#[test]
fn backend_reports_availability_with_a_reason() {
    let caps = anyccl_cuda::capabilities(None, &|_| None);
    match caps.state(Capabilities::CUDA_RUNTIME) {
        CapabilityState::Enabled => assert!(has_gpu(), "CUDA runtime enabled without a GPU device node"),
        CapabilityState::Disabled(reason) => {
            assert!(!has_gpu() || anyccl_cuda::available().is_err());
            let text = reason.to_string();
            assert!(text.contains("libcuda.so.1") || text.contains("NVIDIA GPU"), "{text}");
            // Everything that needs the runtime says so.
            for c in [Capabilities::IPC, Capabilities::MULTICAST, Capabilities::GRAPH_CAPTURE] {
                let s = format!("{:?}", caps.state(c));
                assert!(s.contains("cuda-runtime"), "{c:?}: {s}");
            }
        }
    }
    // Without a library, every NCCL capability is off with a reason.
    assert!(!caps.has(Capabilities::CCL));
    assert!(caps.require(Capabilities::SYMMETRIC_WINDOWS).is_err());
}

#[test]
fn creating_a_communicator_without_a_gpu_is_an_error_not_a_crash() {
    if has_gpu() {
        return; // covered by the GPU tests below
    }
    let err = anyccl_cuda::CudaRuntime::new(0).err().expect("no GPU here");
    assert!(err.to_string().contains("cuda-runtime is not available"), "{err}");
}

fn nccl() -> Arc<anyccl_ccl::CclLibrary> {
    anyccl_ccl::load(anyccl_ccl::CclVendor::Nccl).unwrap_or_else(|e| panic!("NCCL must be installed: {e}"))
}

struct Cuda;

impl ConformanceTarget for Cuda {
    type Backend = CudaComm;

    fn name(&self) -> String {
        "cuda".into()
    }

    fn create(&self, world: usize) -> Result<Vec<Communicator<CudaComm>>> {
        // One rank per GPU (NCCL refuses two ranks of one communicator on one GPU).
        let ordinals: Vec<i32> = (0..world as i32).collect();
        anyccl_cuda::communicators_single_process(nccl(), &ordinals, Arc::new(Selector::defaults()))
    }

    fn stream(&self, comm: &Communicator<CudaComm>) -> Result<CudaStream> {
        comm.runtime().stream()
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn gpu_conformance_every_local_world_against_the_host_reference() {
    let gpus = anyccl_cuda::available().map(|i| i.devices.len()).expect("a GPU");
    let cfg = Config { worlds: (1..=gpus.min(8)).collect(), counts: vec![0, 1, 5, 1037, 65537], ..Config::default() };
    eprintln!("cuda conformance over worlds {:?}", cfg.worlds);
    let summary = conformance::run(&Cuda, &cfg);
    eprintln!("cuda conformance: {} checks, {} expected errors", summary.checks, summary.expected_errors);
    summary.assert_ok();
}

fn free_memory() -> usize {
    result::mem_get_info().map(|(free, _)| free).unwrap_or(0)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn graph_capture_and_replay_equal_eager() {
    let mut comms = Cuda.create(1).expect("communicator");
    let comm = &mut comms[0];
    let stream = comm.runtime().stream().expect("stream");
    let n = 1 << 16;
    let input: Vec<f32> = (0..n).map(|i| ((i * 37) % 101) as f32 * 0.25 - 7.0).collect();
    let bytes: &[u8] = bytemuck::cast_slice(&input);
    let rt = comm.runtime().clone();
    let mut eager = anyccl_core::MemoryRuntime::alloc(&rt, bytes.len()).expect("alloc");
    let mut graphed = anyccl_core::MemoryRuntime::alloc(&rt, bytes.len()).expect("alloc");
    let send = {
        let mut b = anyccl_core::MemoryRuntime::alloc(&rt, bytes.len()).expect("alloc");
        anyccl_core::MemoryRuntime::upload(&rt, &mut b, bytes, &stream).expect("upload");
        b
    };
    comm.all_reduce(InOut::Separate { send: &send, recv: &mut eager }, n, DataType::F32, ReduceOp::Sum, &stream)
        .expect("eager");

    // Capture: the front-end sees the capture, nothing illegal runs, and an upload is refused without breaking it.
    // SAFETY: live stream; global capture mode.
    unsafe { result::stream::begin_capture(stream.raw(), sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL) }
        .expect("begin capture");
    assert!(stream.is_capturing().expect("query"));
    let sel = comm
        .all_reduce(InOut::Separate { send: &send, recv: &mut graphed }, n, DataType::F32, ReduceOp::Sum, &stream)
        .expect("captured all-reduce");
    assert_eq!(sel.algorithm, Algorithm::Ccl);
    let refused = anyccl_core::MemoryRuntime::upload(&rt, &mut graphed, bytes, &stream);
    assert!(refused.is_err(), "an upload during capture must be refused");
    // SAFETY: ends the capture begun above.
    let graph = unsafe { result::stream::end_capture(stream.raw()) }.expect("end capture (capture still valid)");
    // SAFETY: a graph just captured.
    let exec = unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) }.expect("instantiate");
    for _ in 0..3 {
        // SAFETY: instantiated graph, live stream.
        unsafe { result::graph::launch(exec, stream.raw()) }.expect("replay");
    }
    stream.synchronize().expect("sync");
    let mut a = vec![0u8; bytes.len()];
    let mut b = vec![0u8; bytes.len()];
    anyccl_core::MemoryRuntime::download(&rt, &eager, &mut a, &stream).expect("download");
    anyccl_core::MemoryRuntime::download(&rt, &graphed, &mut b, &stream).expect("download");
    assert_eq!(a, b, "graph replay differs from eager");
    assert_eq!(a, bytes, "world 1 sum is the input");
    // SAFETY: destroy what was created above, once.
    unsafe {
        result::graph::exec_destroy(exec).expect("exec destroy");
        result::graph::destroy(graph).expect("graph destroy");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn symmetric_buffers_1000_times_return_memory() {
    let mut comms = Cuda.create(1).expect("communicator");
    let comm = &mut comms[0];
    let stream = comm.runtime().stream().expect("stream");
    if let Err(e) = comm.capabilities().require(Capabilities::SYMMETRIC_WINDOWS) {
        panic!("this NCCL must have symmetric windows: {e}");
    }
    let n = 1 << 18;
    // Warm up once so lazily created NCCL resources are not counted as a leak.
    drop(comm.backend().symmetric_buffer(n * 4, &stream).expect("symmetric buffer"));
    stream.synchronize().expect("sync");
    let before = free_memory();
    for i in 0..1000 {
        let mut sb = comm.backend().symmetric_buffer(n * 4, &stream).unwrap_or_else(|e| panic!("iteration {i}: {e}"));
        if i % 100 == 0 {
            comm.all_reduce_with(
                Algorithm::CclSymmetric,
                InOut::InPlace(sb.buffer_mut()),
                n,
                DataType::F32,
                ReduceOp::Sum,
                &stream,
            )
            .expect("zero-copy all-reduce on the window");
            stream.synchronize().expect("sync");
        }
    }
    stream.synchronize().expect("sync");
    let after = free_memory();
    eprintln!("symmetric buffers x1000: free memory before {before} after {after}");
    assert!(before.abs_diff(after) <= 1 << 20, "device memory moved by {} bytes", before.abs_diff(after));
    // Ordinary buffers are not eligible for the symmetric path, with the reason.
    let mut plain = anyccl_core::MemoryRuntime::alloc(comm.runtime(), n * 4).expect("alloc");
    let err = comm
        .all_reduce_with(Algorithm::CclSymmetric, InOut::InPlace(&mut plain), n, DataType::F32, ReduceOp::Sum, &stream)
        .expect_err("not a window");
    assert!(err.to_string().contains("not in a registered symmetric window"), "{err}");
}

/// Found in review, on the H200: `symmetric_buffer(usize::MAX)` returned `Ok` with a view of 2^64 - 1 bytes at
/// address 0, and a 2 TiB all-reduce on it "succeeded". Sizes are bounded before NCCL sees them; a size the
/// device cannot hold is NCCL's error; a real buffer spans what it claims (`cuMemGetAddressRange`).
#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn symmetric_and_device_buffers_claim_only_memory_that_exists() {
    use anyccl_core::{Error, InvalidArgument};
    let mut comms = Cuda.create(1).expect("communicator");
    let comm = &mut comms[0];
    let stream = comm.runtime().stream().expect("stream");
    comm.capabilities().require(Capabilities::SYMMETRIC_WINDOWS).expect("this NCCL must have symmetric windows");
    for bytes in [usize::MAX, usize::MAX - 4095, isize::MAX as usize + 1] {
        let err = comm.backend().symmetric_buffer(bytes, &stream).err().expect("cannot exist");
        assert!(
            matches!(&err, Error::InvalidArgument(InvalidArgument::SizeTooLarge { requested, .. }) if *requested == bytes as u64),
            "{bytes}: {err:?}"
        );
        let err = anyccl_core::MemoryRuntime::alloc(comm.runtime(), bytes).err().expect("cannot exist");
        assert!(matches!(&err, Error::InvalidArgument(InvalidArgument::SizeTooLarge { .. })), "{bytes}: {err:?}");
    }
    // 1 PiB passes the bound but no device has it: the library's own error, and no buffer.
    let err = comm.backend().symmetric_buffer(1 << 50, &stream).err().expect("1 PiB on one GPU");
    eprintln!("symmetric_buffer(1 PiB): {err}");
    assert!(matches!(&err, Error::Backend { .. }), "{err:?}");
    let err = anyccl_core::MemoryRuntime::alloc(comm.runtime(), 1 << 50).err().expect("1 PiB on one GPU");
    eprintln!("alloc(1 PiB): {err}");
    assert!(matches!(&err, Error::Backend { .. }), "{err:?}");
    // A real one: the driver's allocation spans the view.
    let n = 1 << 20;
    let mut sb = comm.backend().symmetric_buffer(n * 4 + 1, &stream).expect("symmetric buffer");
    let addr = anyccl_core::runtime::BufferLike::desc(sb.buffer()).addr as u64;
    let (base, size) = comm.runtime().context().address_range(addr).expect("range");
    assert!(base <= addr && addr + (n * 4 + 1) as u64 <= base + size as u64, "{addr:#x} in {size} at {base:#x}");
    comm.all_reduce_with(
        Algorithm::CclSymmetric,
        InOut::InPlace(sb.buffer_mut()),
        n,
        DataType::F32,
        ReduceOp::Sum,
        &stream,
    )
    .expect("the window still works");
    stream.synchronize().expect("sync");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn communicators_1000_times_return_memory() {
    let lib = nccl();
    drop(Cuda.create(1).expect("warm-up"));
    // 1000 by default. One ncclCommInitAll took 0.6 s on the H200 here, so the 10-minute command limit there
    // allows about 500 per run (ANYCCL_TEST_COMM_ITERS=500).
    let iters: usize = std::env::var("ANYCCL_TEST_COMM_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let before = free_memory();
    for i in 0..iters {
        if i % 100 == 0 {
            eprintln!("communicators: iteration {i}, free {}", free_memory());
        }
        let c = anyccl_cuda::communicators_single_process(lib.clone(), &[0], Arc::new(Selector::defaults()))
            .unwrap_or_else(|e| panic!("iteration {i}: {e}"));
        drop(c);
    }
    let after = free_memory();
    eprintln!("communicators x{iters}: free memory before {before} after {after}");
    assert!(before.abs_diff(after) <= 1 << 20, "device memory moved by {} bytes", before.abs_diff(after));
}

#[test]
fn bootstrap_with_a_missing_peer_times_out_naming_it() {
    let addr: std::net::SocketAddr = "127.0.0.1:0".parse().expect("addr");
    let cfg = anyccl_rendezvous::RendezvousConfig::new(0, 2, addr).with_timeout(std::time::Duration::from_millis(300));
    let t = std::time::Instant::now();
    let err = anyccl_cuda::multi_process::communicator(cfg, Some(0), Arc::new(Selector::defaults()))
        .err()
        .expect("rank 1 never arrives");
    assert!(t.elapsed() < std::time::Duration::from_secs(5), "took {:?}", t.elapsed());
    let text = err.to_string();
    assert!(matches!(err, anyccl_core::Error::Timeout { .. }), "{err:?}");
    assert!(text.contains("rank") && text.contains('1'), "{text}");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn bootstrap_world_1_through_the_rendezvous() {
    let addr: std::net::SocketAddr = "127.0.0.1:0".parse().expect("addr");
    let cfg = anyccl_rendezvous::RendezvousConfig::new(0, 1, addr);
    let (mut comm, mut rdv) =
        anyccl_cuda::multi_process::communicator(cfg, Some(0), Arc::new(Selector::defaults())).expect("bootstrap");
    rdv.barrier().expect("rendezvous still usable");
    let stream = comm.runtime().stream().expect("stream");
    let mut b = anyccl_core::MemoryRuntime::alloc(comm.runtime(), 64).expect("alloc");
    let data: Vec<u8> = (0..64).collect();
    anyccl_core::MemoryRuntime::upload(comm.runtime(), &mut b, &data, &stream).expect("upload");
    comm.all_reduce(InOut::InPlace(&mut b), 64, DataType::U8, ReduceOp::Max, &stream).expect("all-reduce");
    let mut out = vec![0u8; 64];
    anyccl_core::MemoryRuntime::download(comm.runtime(), &b, &mut out, &stream).expect("download");
    assert_eq!(out, data);
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

/// The `anyccl-cuda-ipc-check` tool (workspace member `anyccl-lab`): `ANYCCL_IPC_CHECK`, else the one built in this
/// test's target directory (`cargo build -p anyccl-lab --bin anyccl-cuda-ipc-check`, same profile).
fn ipc_check_exe() -> std::path::PathBuf {
    if let Some(exe) = std::env::var_os("ANYCCL_IPC_CHECK") {
        return exe.into();
    }
    // This test runs as target/<profile>/deps/gpu-<hash>; binaries lie in target/<profile>.
    let test = std::env::current_exe().expect("the test's own path");
    let exe = test.parent().and_then(|deps| deps.parent()).expect("a target directory").join("anyccl-cuda-ipc-check");
    assert!(
        exe.exists(),
        "{} is missing: build it with `cargo build -p anyccl-lab --bin anyccl-cuda-ipc-check` (same profile) or set \
         ANYCCL_IPC_CHECK",
        exe.display()
    );
    exe
}

/// Runs `anyccl-cuda-ipc-check` as `world` ranks with the torchrun variables; returns (rank, success, stdout,
/// stderr) per rank once all have exited.
fn run_ranks(world: usize, args: &dyn Fn(usize) -> Vec<String>) -> Vec<(usize, bool, String, String)> {
    let exe = ipc_check_exe();
    let port = free_port().to_string();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            std::process::Command::new(&exe)
                .args(args(rank))
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                // the rendezvous's own port (else MASTER_PORT + 1, which free_port did not check)
                .env("MASTER_PORT", "1")
                .env("ANYCCL_MASTER_PORT", &port)
                .env("ANYCCL_RENDEZVOUS_TIMEOUT_SECS", "60")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("spawn anyccl-cuda-ipc-check")
        })
        .collect();
    // No rank may run for more than ten minutes: a hang fails the test instead of stalling the run.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
    let mut children = children;
    while children.iter_mut().any(|c| c.try_wait().ok().flatten().is_none()) {
        if std::time::Instant::now() > deadline {
            for c in &mut children {
                let _ = c.kill();
            }
            panic!("world {world}: a rank was still running after 600 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    children
        .into_iter()
        .enumerate()
        .map(|(rank, c)| {
            let out = c.wait_with_output().expect("wait");
            let so = String::from_utf8_lossy(&out.stdout).into_owned();
            let se = String::from_utf8_lossy(&out.stderr).into_owned();
            eprintln!("world {world} rank {rank}: {so}{se}");
            (rank, out.status.success(), so, se)
        })
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn ipc_between_two_and_four_processes_with_both_handle_kinds() {
    let gpus = anyccl_cuda::available().map(|i| i.devices.len()).expect("a GPU");
    for kind in ["legacy", "vmm"] {
        for world in [2usize, 4] {
            let args = |rank: usize| vec!["--kind".into(), kind.into(), "--device".into(), (rank % gpus).to_string()];
            for (rank, ok, so, se) in run_ranks(world, &args) {
                assert!(ok, "{kind} world {world} rank {rank} failed: {se}");
                assert!(so.contains(&format!("rank {rank}: {kind} IPC ok, read {} peer buffers", world - 1)), "{so}");
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn nccl_one_process_per_gpu_through_the_rendezvous() {
    let gpus = anyccl_cuda::available().map(|i| i.devices.len()).expect("a GPU");
    for (rank, ok, so, se) in run_ranks(gpus, &|_| vec!["--kind".into(), "nccl".into()]) {
        assert!(ok, "rank {rank}: {se}");
        assert!(so.contains(&format!("rank {rank}: nccl all-reduce over {gpus} processes ok")), "{so}");
        if gpus > 1 {
            assert!(so.contains("custom [one-shot, two-shot] over IPC ok"), "{so}");
            assert!(so.contains("graph buffers: 2 registered over IPC, replays before and after ok"), "{so}");
        }
        assert!(so.contains("symmetric windows ok (in place, out of place; auto chose "), "{so}");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn conformance_one_process_per_gpu_bitwise_identical_across_processes() {
    let gpus = anyccl_cuda::available().map(|i| i.devices.len()).expect("a GPU");
    for (rank, ok, so, se) in run_ranks(gpus, &|_| vec!["--kind".into(), "conformance".into()]) {
        assert!(ok, "rank {rank}: {se}");
        assert!(so.contains(&format!("rank {rank}: conformance over {gpus} processes ok")), "{so}");
        eprintln!("{}", so.trim());
    }
}

/// bf16 bits of a small integer (exact in bf16, so truncating the f32 bits is exact too).
fn bf16_bits(v: f32) -> u16 {
    (v.to_bits() >> 16) as u16
}

#[test]
#[ignore = "needs 2 or more NVIDIA GPUs: run on a multi-GPU machine with --ignored"]
fn graph_buffers_single_process_replays_before_and_after_registration() {
    let gpus = anyccl_cuda::available().map(|i| i.devices.len()).expect("a GPU");
    assert!(gpus >= 2, "this test needs two GPUs or more, found {gpus}");
    let world = gpus.min(8);
    let comms = Cuda.create(world).expect("communicators");
    let m = 1usize << 18;
    let rank_sum: f32 = (0..world).map(|r| r as f32).sum();
    let results: Vec<std::result::Result<String, String>> = std::thread::scope(|sc| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, mut comm)| {
                sc.spawn(move || -> std::result::Result<String, String> {
                    let e = |x: anyccl_core::Error| x.to_string();
                    let rt = comm.runtime().clone();
                    let stream = rt.stream().map_err(e)?;
                    let fill = |round: usize| -> Vec<u8> {
                        let v: Vec<u16> = (0..m).map(|i| bf16_bits(((i + round) % 13) as f32 + rank as f32)).collect();
                        bytemuck::cast_slice(&v).to_vec()
                    };
                    let want = |round: usize| -> Vec<u8> {
                        let v: Vec<u16> =
                            (0..m).map(|i| bf16_bits(((i + round) % 13) as f32 * world as f32 + rank_sum)).collect();
                        bytemuck::cast_slice(&v).to_vec()
                    };
                    use anyccl_core::MemoryRuntime;
                    let mut a_in = rt.alloc(m * 2).map_err(e)?;
                    let mut a_out = rt.alloc(m * 2).map_err(e)?;
                    let mut b = rt.alloc(m * 2).map_err(e)?;
                    let ctx = rt.context().clone();
                    let graph = anyccl_cuda::graph::Graph::capture(&ctx, &stream, |s| {
                        let out = InOut::Separate { send: &a_in, recv: &mut a_out };
                        comm.all_reduce_with(Algorithm::OneShot, out, m, DataType::Bf16, ReduceOp::Sum, s)?;
                        comm.all_reduce_with(
                            Algorithm::TwoShot,
                            InOut::InPlace(&mut b),
                            m,
                            DataType::Bf16,
                            ReduceOp::Sum,
                            s,
                        )?;
                        Ok(())
                    })
                    .map_err(e)?;
                    let pending = comm.pending_graph_buffers();
                    if pending != 2 {
                        return Err(format!("rank {rank}: {pending} pending graph inputs, expected 2"));
                    }
                    let mut registered = 0;
                    for round in 0..3 {
                        if round == 1 {
                            let reg = comm.register_graph_buffers(None).map_err(e)?;
                            if reg.registered != 2 || !reg.kept_staged.is_empty() {
                                return Err(format!("rank {rank}: registration {reg:?}"));
                            }
                            registered = reg.registered;
                        }
                        rt.upload(&mut a_in, &fill(round), &stream).map_err(e)?;
                        rt.upload(&mut b, &fill(round), &stream).map_err(e)?;
                        graph.launch(&stream).map_err(e)?;
                        stream.synchronize().map_err(e)?;
                        for (name, buf) in [("one-shot out of place", &a_out), ("two-shot in place", &b)] {
                            let mut got = vec![0u8; m * 2];
                            rt.download(buf, &mut got, &stream).map_err(e)?;
                            if got != want(round) {
                                return Err(format!("rank {rank}: {name}, replay {round}: wrong result"));
                            }
                        }
                    }
                    Ok(format!("rank {rank}: {registered} graph inputs registered; 3 replays ok"))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("rank thread panicked".into()))).collect()
    });
    for r in results {
        let line = r.unwrap_or_else(|e| panic!("{e}"));
        eprintln!("{line}");
    }
}

#[test]
#[ignore = "needs 2 or more NVIDIA GPUs: run on a multi-GPU machine with --ignored"]
fn a_rank_that_dies_makes_the_others_fail_within_the_timeout() {
    let gpus = anyccl_cuda::available().map(|i| i.devices.len()).expect("a GPU");
    assert!(gpus >= 2, "this test needs two GPUs or more, found {gpus}");
    for algo in ["ccl", "one-shot"] {
        let start = std::time::Instant::now();
        let results = run_ranks(2, &|_| vec!["--kind".into(), format!("kill-{algo}")]);
        let (_, ok, so, se) = &results[0];
        assert!(ok, "{algo}: rank 0 did not report the dead peer: {so}{se}");
        assert!(so.contains("with a dead peer failed after") && so.contains("cleaned up in"), "{so}");
        assert!(start.elapsed() < std::time::Duration::from_secs(120), "{algo}: took {:?}", start.elapsed());
        assert!(!results[1].1, "rank 1 was meant to die");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn wait_on_a_stream_that_never_finishes_times_out_aborts_nccl_and_later_calls_fail() {
    // What a dead peer looks like from one GPU: the stream stops at a gate (cuStreamWaitValue32 on a word of
    // pinned host memory that stays 0), so its work does not finish. The real CUDA query, the real NCCL abort and
    // the later refusals run. A helper thread opens the gate after GATE, with a plain store (no CUDA call), so the
    // test ends whatever the abort does; the wait must return long before that.
    const GATE: std::time::Duration = std::time::Duration::from_secs(8);
    let mut comms = Cuda.create(1).expect("world-1 communicator");
    let mut comm = comms.pop().expect("one rank");
    let stream = comm.runtime().stream().expect("stream");
    let n = 1024usize;
    let mut b = anyccl_core::MemoryRuntime::alloc(comm.runtime(), n * 4).expect("alloc");
    let ones: Vec<u8> = (0..n).flat_map(|_| 1.0f32.to_le_bytes()).collect();
    anyccl_core::MemoryRuntime::upload(comm.runtime(), &mut b, &ones, &stream).expect("upload");

    // Work that finishes: the wait returns Ok, and the communicator stays usable.
    comm.all_reduce(InOut::InPlace(&mut b), n, DataType::F32, ReduceOp::Sum, &stream).expect("all-reduce");
    comm.wait(&stream, std::time::Duration::from_secs(30)).expect("finished work waits fine");

    comm.runtime().context().bind().expect("bind");
    // SAFETY: a 4-byte pinned, device-mapped host allocation, freed at the end after the stream has drained.
    let host = unsafe { result::malloc_host(4, sys::CU_MEMHOSTALLOC_DEVICEMAP) }.expect("cuMemHostAlloc");
    // SAFETY: `host` is 4 writable bytes, aligned (pinned allocations are page-aligned).
    unsafe { (host as *mut u32).write_volatile(0) };
    let mut dev: sys::CUdeviceptr = 0;
    // SAFETY: `host` is a device-mapped pinned allocation of the bound context; `dev` receives its device address.
    let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuMemHostGetDevicePointer");
    // SAFETY: live stream of this context; `dev` is the device address of the live gate word.
    let r = unsafe {
        sys::cuStreamWaitValue32_v2(stream.raw(), dev, 1, sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32)
    };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuStreamWaitValue32");
    assert!(!stream.query().expect("query"), "the gated stream reports work still queued");
    let gate_word = host as usize; // the address crosses to the helper thread as an integer
    let t0 = std::time::Instant::now();
    let opener = std::thread::spawn(move || {
        std::thread::sleep(GATE);
        // SAFETY: the gate word stays allocated until this thread has been joined.
        unsafe { (gate_word as *mut u32).write_volatile(1) };
        t0.elapsed()
    });

    let limit = std::time::Duration::from_millis(300);
    let err = comm.wait(&stream, limit).expect_err("the gated stream does not finish within the limit");
    let took = t0.elapsed();
    assert!(matches!(err, anyccl_core::Error::Timeout { .. }), "{err:?}");
    let bound = limit + anyccl_ccl::ABORT_GRACE + std::time::Duration::from_secs(1);
    assert!(took >= limit && took < bound, "returned after {took:?} (the gate opens at {GATE:?})");
    let text = err.to_string();
    assert!(text.contains("abort"), "{text}");

    let later = comm
        .all_reduce(InOut::InPlace(&mut b), n, DataType::F32, ReduceOp::Sum, &stream)
        .expect_err("an aborted communicator refuses later calls");
    assert!(matches!(later, anyccl_core::Error::PeerFailure(_)), "{later:?}");

    let opened = opener.join().expect("gate thread");
    stream.synchronize().expect("the gated stream drains once the gate opens");
    let drained = t0.elapsed();
    let mut out = vec![0u8; n * 4];
    anyccl_core::MemoryRuntime::download(comm.runtime(), &b, &mut out, &stream).expect("download");
    assert_eq!(out, ones, "the all-reduce before the gate ran (world 1: sum of one rank)");
    // SAFETY: the stream that waited on the word has drained and the opener has been joined.
    unsafe { result::free_host(host) }.expect("cuMemFreeHost");
    drop(comm); // destroys nothing twice: the communicator was aborted
    eprintln!("wait returned after {took:?}; gate opened at {opened:?}; stream drained at {drained:?}; error: {text}");
}

/// A communicator of world 1 on device 0, its runtime and a stream.
fn world_one() -> (Communicator<CudaComm>, anyccl_cuda::CudaRuntime, CudaStream) {
    let mut cs =
        anyccl_cuda::communicators_single_process(nccl(), &[0], Arc::new(Selector::defaults())).expect("communicator");
    let c = cs.pop().expect("one communicator");
    let rt = c.runtime().clone();
    let st = rt.stream().expect("stream");
    (c, rt, st)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn all_reduce_of_a_view_touches_only_its_range() {
    let (mut c, rt, st) = world_one();
    anyccl_testkit::gpu_suite::all_reduce_into_a_view(&mut c, &st);
    let (free, total) = rt.memory_info().expect("memory info");
    assert!(free > 0 && free <= total, "{free} of {total}");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn a_global_mode_capture_of_an_all_reduce_replays_correctly() {
    use anyccl_core::{CaptureMode, MemoryRuntime};
    let (mut c, rt, st) = world_one();
    let n = 256usize;
    let mut buf = rt.alloc(n * 4).expect("alloc");
    rt.upload(&mut buf, &[3.0f32.to_le_bytes(); 256].concat(), &st).expect("upload");
    let mut out_buf = rt.alloc(n * 4).expect("alloc");
    let g = anyccl_cuda::graph::Graph::capture_with(rt.context(), &st, CaptureMode::Global, |st| {
        assert!(c.query(st).is_err(), "query is refused during capture");
        c.all_reduce(InOut::Separate { send: &buf, recv: &mut out_buf }, n, DataType::F32, ReduceOp::Sum, st)
            .map(|_| ())
    })
    .expect("global-mode capture");
    g.launch(&st).expect("launch");
    c.wait(&st, std::time::Duration::from_secs(30)).expect("wait");
    let mut out = vec![0u8; n * 4];
    rt.download(&out_buf, &mut out, &st).expect("download");
    assert_eq!(out, [3.0f32.to_le_bytes(); 256].concat());
}

/// A raw stream of device 0 made straight through the driver, as an engine makes its own: anyccl never sees it.
fn raw_stream(rt: &anyccl_cuda::CudaRuntime, flags: sys::CUstream_flags) -> sys::CUstream {
    rt.context().bind().expect("bind");
    let mut s: sys::CUstream = std::ptr::null_mut();
    // SAFETY: writes one stream handle of the bound context.
    let r = unsafe { sys::cuStreamCreate(&mut s, flags as u32) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuStreamCreate");
    s
}

/// Begins a global-mode capture on `raw` straight through the driver, as PyTorch and vLLM capture.
fn raw_begin(raw: sys::CUstream) {
    // SAFETY: a live stream, not capturing.
    unsafe { result::stream::begin_capture(raw, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL) }
        .expect("begin capture");
}

/// Ends the capture on `raw`: the driver's status (`CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` when it was broken).
fn raw_end(raw: sys::CUstream) -> sys::CUresult {
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: a live stream; writes the graph handle.
    let r = unsafe { sys::cuStreamEndCapture(raw, &mut graph) };
    if !graph.is_null() {
        // SAFETY: the graph just returned, destroyed once.
        let _ = unsafe { result::graph::destroy(graph) };
    }
    r
}

fn is_during_capture(r: &Result<()>) -> bool {
    matches!(r, Err(anyccl_core::Error::InvalidArgument(anyccl_core::InvalidArgument::DuringCapture { .. })))
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn allocation_during_capture_is_refused_before_the_driver_and_the_capture_stays_valid() {
    use anyccl_core::{CaptureMode, MemoryRuntime};
    let (mut c, rt, st) = world_one();
    // The original problem, reproduced: a plain cuMemAlloc during an engine's global-mode capture is refused by
    // the driver (900) and the capture is lost (901 at its end).
    raw_begin(st.raw());
    // SAFETY: a plain allocation; it fails (the thread is in global capture mode).
    let plain = unsafe { result::malloc_sync(64) };
    assert!(plain.is_err(), "the driver refuses cuMemAlloc during a global capture: {plain:?}");
    assert_eq!(raw_end(st.raw()), sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "and the capture is lost");

    // anyccl's allocation during the same kind of capture, on a stream it knows: refused before the driver, on
    // this thread and on another, with the capture intact. So are registration and symmetric buffers.
    let early = rt.alloc(256).expect("allocated before the capture");
    raw_begin(st.raw());
    assert!(is_during_capture(&rt.alloc(64).map(drop)), "refused on the capturing thread");
    let other = std::thread::scope(|sc| sc.spawn(|| rt.alloc(64).map(drop)).join().expect("thread"));
    assert!(is_during_capture(&other), "refused on another thread: {other:?}");
    assert!(is_during_capture(&c.register_graph_buffers(None).map(drop)));
    assert!(is_during_capture(&c.backend().symmetric_buffer(4096, &st).map(drop)));
    drop(early); // leaked, not freed: freeing would break the capture
    assert_eq!(raw_end(st.raw()), sys::CUresult::CUDA_SUCCESS, "the capture is still valid");

    // A capture on a non-blocking stream anyccl never saw: it cannot be found, so the allocation runs in relaxed
    // mode and neither fails nor breaks the capture.
    let unseen = raw_stream(&rt, sys::CUstream_flags::CU_STREAM_NON_BLOCKING);
    raw_begin(unseen);
    let b = rt.alloc(64).expect("allocated in relaxed capture mode");
    assert_eq!(raw_end(unseen), sys::CUresult::CUDA_SUCCESS, "the unseen capture is still valid");
    drop(b);
    // A capture on a blocking stream anyccl never saw: the legacy stream reveals it, and the allocation is refused.
    let blocking = raw_stream(&rt, sys::CUstream_flags::CU_STREAM_DEFAULT);
    raw_begin(blocking);
    assert!(is_during_capture(&rt.alloc(64).map(drop)), "a blocking stream's capture is found");
    assert_eq!(raw_end(blocking), sys::CUresult::CUDA_SUCCESS, "and stays valid");
    // SAFETY: the two streams made above, destroyed once.
    unsafe {
        result::stream::destroy(unseen).expect("destroy");
        result::stream::destroy(blocking).expect("destroy");
    }

    // A thread-local capture through anyccl's graph helper: refused on the capturing thread only, as the driver
    // would refuse it; another thread allocates.
    let mut here = None;
    let mut elsewhere = None;
    let g = anyccl_cuda::graph::Graph::capture_with(rt.context(), &st, CaptureMode::ThreadLocal, |_| {
        here = Some(rt.alloc(64).map(drop));
        elsewhere = Some(std::thread::scope(|sc| sc.spawn(|| rt.alloc(64).map(drop)).join().expect("thread")));
        Ok(())
    });
    assert!(g.is_ok(), "the capture is valid: {:?}", g.err());
    assert!(is_during_capture(&here.expect("ran")));
    assert!(elsewhere.expect("ran").is_ok(), "another thread may allocate during a thread-local capture");
    rt.alloc(64).expect("allocation after the captures");
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn a_wait_during_capture_is_refused_and_changes_nothing() {
    use anyccl_core::{CaptureMode, CommBackend, MemoryRuntime};
    let (mut c, rt, st) = world_one();
    let n = 256usize;
    let mut buf = rt.alloc(n * 4).expect("alloc");
    rt.upload(&mut buf, &[2.0f32.to_le_bytes(); 256].concat(), &st).expect("upload");
    let epoch = c.backend().eligibility_epoch();
    let (mut waited, mut queried) = (None, None);
    let g = anyccl_cuda::graph::Graph::capture_with(rt.context(), &st, CaptureMode::Global, |st| {
        waited = Some(c.wait(st, std::time::Duration::from_secs(5)));
        queried = Some(c.query(st).map(drop));
        Ok(())
    });
    assert!(g.is_ok(), "the capture stays valid: {:?}", g.err());
    assert!(is_during_capture(&waited.expect("ran")));
    assert!(is_during_capture(&queried.expect("ran")));
    assert!(!c.backend().ccl().is_aborted(), "the communicator was not aborted");
    assert_eq!(c.backend().eligibility_epoch(), epoch, "nothing the selection reads changed");
    c.all_reduce(InOut::InPlace(&mut buf), n, DataType::F32, ReduceOp::Sum, &st).expect("still usable");
    c.wait(&st, std::time::Duration::from_secs(30)).expect("wait");
    let mut out = vec![0u8; n * 4];
    rt.download(&buf, &mut out, &st).expect("download");
    assert_eq!(out, [2.0f32.to_le_bytes(); 256].concat());
}

#[test]
#[ignore = "needs 2 or more NVIDIA GPUs: run on a multi-GPU machine with --ignored"]
fn a_refused_wait_during_capture_leaves_the_custom_kernels_on_for_every_rank() {
    use anyccl_core::comm::AllReduceCall;
    use anyccl_core::{CaptureMode, CommBackend, MemoryRuntime};
    let gpus = anyccl_cuda::available().map(|i| i.devices.len()).expect("a GPU");
    assert!(gpus >= 2, "this test needs two GPUs or more, found {gpus}");
    let world = 2usize;
    let mut comms = Cuda.create(world).expect("communicators");
    let n = 4096usize;
    let call = AllReduceCall {
        count: n,
        dtype: DataType::F32,
        op: ReduceOp::Sum,
        bytes: n * 4,
        in_place: true,
        capturing: false,
        bufs: None,
    };
    let results: Vec<std::result::Result<String, String>> = std::thread::scope(|sc| {
        let hs: Vec<_> = comms
            .iter_mut()
            .enumerate()
            .map(|(rank, c)| {
                sc.spawn(move || -> std::result::Result<String, String> {
                    let e = |x: anyccl_core::Error| format!("rank {rank}: {x}");
                    c.check_algorithm(Algorithm::OneShot, &call).map_err(e)?;
                    let epoch = c.backend().eligibility_epoch();
                    let rt = c.runtime().clone();
                    let st = rt.stream().map_err(e)?;
                    let mut b = rt.alloc(n * 4).map_err(e)?;
                    rt.upload(&mut b, &[(rank as f32 + 1.0).to_le_bytes(); 4096].concat(), &st).map_err(e)?;
                    let mut waited = None;
                    anyccl_cuda::graph::Graph::capture_with(rt.context(), &st, CaptureMode::ThreadLocal, |s| {
                        waited = Some(c.wait(s, std::time::Duration::from_secs(5)));
                        Ok(())
                    })
                    .map_err(e)?;
                    if !is_during_capture(&waited.expect("ran")) {
                        return Err(format!("rank {rank}: the wait during capture was not refused"));
                    }
                    if c.backend().eligibility_epoch() != epoch {
                        return Err(format!("rank {rank}: the refused wait changed the custom kernels' state"));
                    }
                    // Both ranks still choose and run the custom kernels together.
                    c.all_reduce_with(Algorithm::OneShot, InOut::InPlace(&mut b), n, DataType::F32, ReduceOp::Sum, &st)
                        .map_err(e)?;
                    c.wait(&st, std::time::Duration::from_secs(30)).map_err(e)?;
                    let mut out = vec![0u8; n * 4];
                    rt.download(&b, &mut out, &st).map_err(e)?;
                    if out != [3.0f32.to_le_bytes(); 4096].concat() {
                        return Err(format!("rank {rank}: wrong one-shot result after the refused wait"));
                    }
                    Ok(format!("rank {rank}: wait refused during capture; one-shot still runs"))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("rank thread panicked".into()))).collect()
    });
    for r in results {
        eprintln!("{}", r.unwrap_or_else(|e| panic!("{e}")));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored --nocapture (prints the times)"]
fn teardown_times_of_drop_and_background_close() {
    use std::time::{Duration, Instant};
    let lib = nccl();
    let selector = Arc::new(Selector::defaults());
    let make = || {
        anyccl_cuda::communicators_single_process(lib.clone(), &[0], selector.clone())
            .expect("communicator")
            .pop()
            .expect("one rank")
    };
    drop(make()); // warm-up: the first communicator pays NCCL's one-time setup
    let iters: usize = std::env::var("ANYCCL_TEST_TEARDOWN_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(5);
    let (mut create, mut dropped, mut returned, mut completed, mut recreate) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let before = free_memory();
    for _ in 0..iters {
        let t = Instant::now();
        let c = make();
        create.push(t.elapsed());
        let t = Instant::now();
        drop(c);
        dropped.push(t.elapsed());
        let c = make();
        let t = Instant::now();
        let td = c.close_in_background();
        returned.push(t.elapsed());
        // What an engine that rebuilds a communicator does next: make the new one while the old one goes.
        let t2 = Instant::now();
        let next = make();
        recreate.push(t2.elapsed());
        td.wait().expect("NCCL's destroy succeeded");
        completed.push(t.elapsed());
        assert!(td.is_done());
        drop(next);
    }
    assert!(anyccl_core::teardown::wait_for_pending(Duration::from_secs(30)), "a teardown is still running");
    let after = free_memory();
    let median = |v: &mut Vec<Duration>| -> Duration {
        v.sort();
        v[v.len() / 2]
    };
    let (c, d, r, k, n) = (
        median(&mut create),
        median(&mut dropped),
        median(&mut returned),
        median(&mut completed),
        median(&mut recreate),
    );
    eprintln!(
        "TEARDOWN world 1, {iters} iterations, medians: create {c:?}; drop {d:?}; close_in_background returns after \
         {r:?}, its destroy completes after {k:?}; a new communicator made meanwhile took {n:?}; free memory before \
         {before} after {after}"
    );
    assert!(r < Duration::from_millis(50), "the background close took {r:?} to return");
    assert!(r <= k, "returned before it completed");
}

/// Pseudo-random bits of a rank's input (f32 words, or pairs of f16/bf16 values): finite values of mixed signs and
/// magnitudes, so that a different summation order would change the rounded result.
fn push_input(rank: usize, round: usize, bytes: usize, dtype: DataType) -> Vec<u8> {
    let mut x = ((rank as u64 + 1) * 0x9E37_79B9_7F4A_7C15) ^ ((round as u64) << 32);
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % 20_000) as f32 / 997.0 - 10.0
    };
    match dtype {
        DataType::F32 => (0..bytes / 4).flat_map(|_| next().to_le_bytes()).collect(),
        DataType::Bf16 => (0..bytes / 2).flat_map(|_| bf16_bits(next()).to_le_bytes()).collect(),
        _ => (0..bytes / 2).flat_map(|_| half::f16::from_f32(next()).to_bits().to_le_bytes()).collect(),
    }
}

/// The push one-shot on a real communicator of two GPUs or more (one process, peer access): set up by
/// `init_all` with programmatic dependent launch on sm_90+, selected by the defaults for small messages, and
/// bitwise equal to the one-shot for f32, f16 and bf16 from 16 bytes to 256 KiB, eager (out of place and in place)
/// and captured (three replays). World 1 has no push one-shot (the custom kernels need two ranks or more), so there
/// is no world-1 form of this test.
#[test]
#[ignore = "needs 2 or more NVIDIA GPUs: run on a multi-GPU machine with --ignored"]
fn push_one_shot_equals_one_shot_bitwise_on_a_communicator_of_two_gpus() {
    let gpus = anyccl_cuda::available().map(|i| i.devices.len()).expect("a GPU");
    assert!(gpus >= 2, "this test needs two GPUs or more, found {gpus}");
    let world = gpus.min(8);
    let comms = Cuda.create(world).expect("communicators");
    let sm90 = anyccl_cuda::available().map(|i| i.devices[0].compute_capability.0 >= 9).unwrap_or(false);
    let results: Vec<std::result::Result<String, String>> = std::thread::scope(|sc| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, mut comm)| {
                sc.spawn(move || -> std::result::Result<String, String> {
                    use anyccl_core::MemoryRuntime;
                    let e = |x: anyccl_core::Error| x.to_string();
                    let (limit, pdl) = comm
                        .backend()
                        .push_status()
                        .map(|(limit, pdl)| (limit, pdl.map_err(str::to_owned)))
                        .map_err(|w| format!("push off: {w}"))?;
                    if sm90 && pdl.is_err() {
                        return Err(format!("rank {rank}: no PDL on sm_90+: {pdl:?}"));
                    }
                    let rt = comm.runtime().clone();
                    let stream = rt.stream().map_err(e)?;
                    let mut runs = 0;
                    for dtype in [DataType::F32, DataType::F16, DataType::Bf16] {
                        for bytes in [16usize, 4 << 10, 64 << 10, limit] {
                            let count = bytes / dtype.size_bytes();
                            let probe = anyccl_core::comm::AllReduceCall {
                                count,
                                dtype,
                                op: ReduceOp::Sum,
                                bytes,
                                in_place: false,
                                capturing: false,
                                bufs: None,
                            };
                            let chosen = comm.select_all_reduce(&probe).map_err(e)?.algorithm;
                            if bytes <= 64 << 10 && chosen != Algorithm::OneShotPush {
                                return Err(format!("rank {rank}: {dtype} {bytes}: the defaults chose {chosen}"));
                            }
                            let input = rt.alloc(bytes).map_err(e)?;
                            let mut a = input;
                            let mut push_out = rt.alloc(bytes).map_err(e)?;
                            let mut one_out = rt.alloc(bytes).map_err(e)?;
                            let mut inplace = rt.alloc(bytes).map_err(e)?;
                            for round in 0..2 {
                                let data = push_input(rank, round, bytes, dtype);
                                rt.upload(&mut a, &data, &stream).map_err(e)?;
                                rt.upload(&mut inplace, &data, &stream).map_err(e)?;
                                for (alg, out) in
                                    [(Algorithm::OneShotPush, &mut push_out), (Algorithm::OneShot, &mut one_out)]
                                {
                                    let io = InOut::Separate { send: &a, recv: out };
                                    comm.all_reduce_with(alg, io, count, dtype, ReduceOp::Sum, &stream).map_err(e)?;
                                }
                                let io = InOut::InPlace(&mut inplace);
                                comm.all_reduce_with(Algorithm::OneShotPush, io, count, dtype, ReduceOp::Sum, &stream)
                                    .map_err(e)?;
                                stream.synchronize().map_err(e)?;
                                let (mut p, mut o, mut i) = (vec![0u8; bytes], vec![0u8; bytes], vec![0u8; bytes]);
                                rt.download(&push_out, &mut p, &stream).map_err(e)?;
                                rt.download(&one_out, &mut o, &stream).map_err(e)?;
                                rt.download(&inplace, &mut i, &stream).map_err(e)?;
                                if p != o || i != o {
                                    return Err(format!(
                                        "rank {rank}: {dtype} {bytes} round {round}: push != one-shot"
                                    ));
                                }
                                runs += 1;
                            }
                            // Captured: three replays, each equal to an eager one-shot of the same input.
                            let ctx = rt.context().clone();
                            let graph = anyccl_cuda::graph::Graph::capture(&ctx, &stream, |s| {
                                let io = InOut::Separate { send: &a, recv: &mut push_out };
                                comm.all_reduce_with(Algorithm::OneShotPush, io, count, dtype, ReduceOp::Sum, s)
                                    .map(|_| ())
                            })
                            .map_err(e)?;
                            for round in 2..5 {
                                rt.upload(&mut a, &push_input(rank, round, bytes, dtype), &stream).map_err(e)?;
                                graph.launch(&stream).map_err(e)?;
                                let io = InOut::Separate { send: &a, recv: &mut one_out };
                                comm.all_reduce_with(Algorithm::OneShot, io, count, dtype, ReduceOp::Sum, &stream)
                                    .map_err(e)?;
                                stream.synchronize().map_err(e)?;
                                let (mut p, mut o) = (vec![0u8; bytes], vec![0u8; bytes]);
                                rt.download(&push_out, &mut p, &stream).map_err(e)?;
                                rt.download(&one_out, &mut o, &stream).map_err(e)?;
                                if p != o {
                                    return Err(format!(
                                        "rank {rank}: {dtype} {bytes} replay {round}: push != one-shot"
                                    ));
                                }
                                runs += 1;
                            }
                        }
                    }
                    Ok(format!("rank {rank}: {runs} push calls bitwise equal to one-shot (limit {limit}, pdl {pdl:?})"))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("rank thread panicked".into()))).collect()
    });
    for r in results {
        let line = r.unwrap_or_else(|e| panic!("{e}"));
        eprintln!("{line}");
    }
}
