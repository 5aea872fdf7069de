//! NVLS multicast with one process per GPU, as torchrun runs engines, on the fake CUDA driver (no GPU).
//!
//! The parent (each `#[test]` below) starts one process per rank (this test binary again, its `#[ignore]`d test
//! `rank`) with a cleared environment: the fake driver first on `LD_LIBRARY_PATH` (cudarc opens `libcuda.so` by
//! name), the fake NCCL, the rendezvous variables torchrun sets (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`), and the case's own. Each rank joins the TCP rendezvous, wraps a library communicator of its own
//! (the fake NCCL is one process's: the NVLS plans never call it) as its rank of the world, and sets NVLS up over
//! the rendezvous: rank 0 creates the multicast object and sends its file descriptor to the others over a Unix
//! socket; the fake driver keeps the object's state in a memfd behind that descriptor, and reaches every rank's
//! bound memory across processes, so the all-reduces below sum real data of other processes. Each rank prints a
//! `RESULT` line that the parent checks.
//!
//! The gate: with `NCCL_NVLS_ENABLE=0` (on every rank, or on one rank only), `ANYCCL_DISABLE=multicast`, a driver
//! without multicast, or two ranks on one GPU, NVLS is off on every rank with the reason, and the fake driver
//! counted no multicast call in any process.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyccl_ccl::{CclComm, UniqueId};
use anyccl_core::{Algorithm, Communicator, DataType, Selector};
use anyccl_cuda::Cuda;
use anyccl_gpu::{GpuComm, GpuPlatform};
use anyccl_rendezvous::{Rendezvous, RendezvousConfig};
use anyccl_testkit::fake_ccl;
use anyccl_testkit::fake_cuda::{self, call_kind};
use anyccl_testkit::fake_hip::FakeHip;
use anyccl_testkit::gpu_suite::{call, reduce_once, reference};
use anyccl_testkit::launcher;

/// A rank still running then is taken as hung (and killed).
const DEADLINE: Duration = Duration::from_secs(90);

/// The multicast calls none of which may happen where the gate refuses.
const MULTICAST_CALLS: [&str; 8] = [
    "cuMulticastCreate",
    "cuMulticastGetGranularity",
    "cuMulticastAddDevice",
    "cuMulticastBindMem",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemCreate",
    "cuMemMap",
];

// ---- The parent half ----

/// Starts `world` ranks of case `case` (rank r on device `device(r)`, with `env` and `per_rank(r)` on top), waits
/// for them, and returns each rank's `RESULT` line.
fn run(
    case: &str,
    world: usize,
    env: &[(&str, &str)],
    per_rank: &dyn Fn(usize) -> Vec<(&'static str, String)>,
) -> Vec<String> {
    if let Some(why) = anyccl_kernels_cuda::NOT_BUILT {
        panic!(
            "the NVLS kernels are not in this build ({why}); build with ANYCCL_CUDA_TOOLKIT=$(ci/install-cuda.sh) \
             as CI does"
        );
    }
    let cuda = fake_cuda::build_cuda();
    let nccl = fake_cuda::build_nccl(&fake_ccl::NCCL_2_28);
    let dir = cuda.parent().expect("the fake driver's folder");
    let held = launcher::hold_master_port();
    let port = held.local_addr().expect("the launcher's port").port();
    let exe = std::env::current_exe().expect("this test binary");
    let start = Instant::now();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            let mut cmd = Command::new(&exe);
            // Cleared: nothing of this process's environment (NCCL_NVLS_ENABLE among it) reaches the ranks
            // unless the case sets it.
            cmd.args(["rank", "--exact", "--ignored", "--nocapture", "--test-threads=1", "-q"])
                .env_clear()
                .env("PATH", std::env::var_os("PATH").unwrap_or_default())
                .env("RUST_BACKTRACE", "1")
                .env("NVLS_CASE", case)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("XDG_RUNTIME_DIR", launcher::runtime_dir())
                .env("FAKECUDA_LIB", &cuda)
                .env("FAKECUDA_DEVICES", "4")
                .env("FAKEHIP_KERNEL_TIMEOUT_MS", "20000")
                .env("LD_LIBRARY_PATH", dir)
                .env("ANYCCL_NCCL_PATH", &nccl)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env {
                cmd.env(k, v);
            }
            for (k, v) in per_rank(rank) {
                cmd.env(k, v);
            }
            cmd.spawn().expect("start a rank")
        })
        .collect();
    let outs: Vec<_> = children.into_iter().enumerate().map(|(r, c)| launcher::finish(r, c, start, DEADLINE)).collect();
    drop(held);
    outs.iter().enumerate().map(|(r, o)| launcher::result_line(r, o)).collect()
}

fn none(_: usize) -> Vec<(&'static str, String)> {
    Vec::new()
}

/// Three processes, one GPU each: NVLS is set up across them (rank 0 creates and exports, the others import over
/// the Unix socket, the owner's handle released right after the export), forced nvls-block-pipeline all-reduces of
/// 1 MiB f32 (out of place) and 256 KiB bf16 (in place) sum every rank's data right, nvls-warp-pipeline is
/// eligible too, nvls-zero-copy is refused with its reason, and each process tears its part down in order and
/// leaves nothing behind.
#[test]
fn nvls_all_reduce_across_processes_sums_right_and_tears_down_in_order() {
    let lines = run("on", 3, &[("FAKECUDA_MULTICAST", "1")], &none);
    for (rank, line) in lines.iter().enumerate() {
        assert_eq!(line, &format!("nvls on rank {rank}: sums right, teardown clean"), "rank {rank}");
    }
}

/// `NCCL_NVLS_ENABLE=0`: off on every rank, no multicast call in any process.
#[test]
fn nvls_across_processes_is_refused_with_nccl_nvls_enable_0() {
    let env = [("FAKECUDA_MULTICAST", "1"), ("NCCL_NVLS_ENABLE", "0")];
    for line in run("off:NCCL_NVLS_ENABLE", 2, &env, &none) {
        assert_eq!(line, "nvls off, no multicast call");
    }
}

/// `NCCL_NVLS_ENABLE=0` on rank 1 only: rank 0 learns it from the agreement, so NVLS is off on both ranks with
/// rank 1's reason, and no multicast object is created anywhere.
#[test]
fn nvls_across_processes_is_refused_everywhere_when_one_rank_turns_it_off() {
    let per_rank = |r: usize| if r == 1 { vec![("NCCL_NVLS_ENABLE", "0".to_owned())] } else { Vec::new() };
    for line in run("off:rank 1: ", 2, &[("FAKECUDA_MULTICAST", "1")], &per_rank) {
        assert_eq!(line, "nvls off, no multicast call");
    }
}

/// `ANYCCL_DISABLE=multicast`: off on every rank, no multicast call in any process.
#[test]
fn nvls_across_processes_is_refused_with_anyccl_disable() {
    let env = [("FAKECUDA_MULTICAST", "1"), ("ANYCCL_DISABLE", "multicast")];
    for line in run("off:ANYCCL_DISABLE", 2, &env, &none) {
        assert_eq!(line, "nvls off, no multicast call");
    }
}

/// A driver without multicast (no `FAKECUDA_MULTICAST`): off on every rank, no multicast call in any process.
#[test]
fn nvls_across_processes_is_refused_without_multicast() {
    for line in run("off:MULTICAST_SUPPORTED = 0", 2, &[], &none) {
        assert_eq!(line, "nvls off, no multicast call");
    }
}

/// Two ranks on one GPU (both processes on device 0): off on both, told apart by PCI address before any
/// multicast call.
#[test]
fn nvls_across_processes_is_refused_for_two_ranks_on_one_gpu() {
    let env = [("FAKECUDA_MULTICAST", "1"), ("NVLS_DEVICE", "0")];
    for line in run("off:share GPU", 2, &env, &none) {
        assert_eq!(line, "nvls off, no multicast call");
    }
}

// ---- The child half ----

/// One rank: runs the case `NVLS_CASE` names (set by the tests above, which start it) and prints its `RESULT`
/// line. Run alone (as by `--ignored`) it does nothing.
#[test]
#[ignore = "a rank of the NVLS multi-process tests, which start it with the fakes on LD_LIBRARY_PATH"]
fn rank() {
    let Ok(case) = std::env::var("NVLS_CASE") else {
        eprintln!("rank: not started by an NVLS test (NVLS_CASE unset); nothing to do");
        return;
    };
    // The driver cudarc loaded must be the fake one before anything multicast may be asked of it.
    let info = anyccl_cuda::available().expect("the fake driver");
    assert!(info.devices.iter().all(|d| d.name.starts_with("Fake ")), "not the fake driver: {:?}", info.devices);
    let fake = FakeHip::open(&PathBuf::from(std::env::var_os("FAKECUDA_LIB").expect("FAKECUDA_LIB")));
    let rank: usize = std::env::var("RANK").expect("RANK").parse().expect("RANK");
    let world: usize = std::env::var("WORLD_SIZE").expect("WORLD_SIZE").parse().expect("WORLD_SIZE");
    let device: i32 = std::env::var("NVLS_DEVICE").map_or(rank as i32, |d| d.parse().expect("NVLS_DEVICE"));
    let env = |k: &str| std::env::var(k).ok();

    let lib = anyccl_cuda::platform::load_nccl().expect("the fake NCCL through ANYCCL_NCCL_PATH");
    let mut caps = anyccl_cuda::capabilities(Some(&lib), &env);
    caps.apply_env().expect("ANYCCL_DISABLE");
    // This rank of a library communicator of `world` whose peers never join: the fake NCCL's ranks live in one
    // process and its init does not wait for them. The NVLS plans never call the library, so nothing waits on
    // the missing peers.
    let rt = <Cuda as GpuPlatform>::runtime(&device).expect("runtime");
    rt.context().bind().expect("bind");
    let id = UniqueId::new(&lib).expect("unique id");
    let ccl = CclComm::init_rank(lib.clone(), world, &id, rank).expect("this rank of a library communicator");
    let mut comm = GpuComm::<Cuda>::from_ccl(ccl, &device, Arc::new(caps)).expect("wrap");
    let mut rdv = Rendezvous::establish(RendezvousConfig::from_env().expect("rendezvous config")).expect("rendezvous");
    let mc = fake_cuda::FakeMulticast::open(&PathBuf::from(std::env::var_os("FAKECUDA_LIB").expect("lib")));
    let set_up = comm.enable_nvls_with_env(&mut rdv, &env);

    if let Some(reason) = case.strip_prefix("off:") {
        let e = set_up.expect_err("NVLS refused");
        assert!(e.to_string().contains(reason), "rank {rank}: {e}");
        let off = comm.nvls_off().expect("NVLS off");
        assert!(off.contains(reason), "rank {rank}: {off}");
        let comm = Communicator::new(comm, Arc::new(Selector::defaults()));
        for a in [Algorithm::NvlsBlockPipeline, Algorithm::NvlsWarpPipeline, Algorithm::NvlsZeroCopy] {
            let e = comm.check_algorithm(a, &call((1 << 20) / 4, DataType::F32)).expect_err("refused");
            assert!(e.to_string().contains(reason), "rank {rank} {a}: {e}");
        }
        drop(comm);
        for name in MULTICAST_CALLS {
            assert_eq!(fake.calls(name), 0, "rank {rank}: {name} was called");
        }
        assert_eq!(mc.log(), Vec::<String>::new(), "rank {rank}");
        rdv.barrier().expect("the ranks finish together");
        println!("RESULT nvls off, no multicast call");
        return;
    }
    assert_eq!(case, "on", "unknown case");
    set_up.unwrap_or_else(|e| panic!("rank {rank}: NVLS setup: {e}"));
    assert_eq!(comm.nvls_off(), None);
    check_setup_calls(rank, &mc.log());
    let mut comm =
        Communicator::new(comm, Arc::new(Selector::defaults().with_forced(Some(Algorithm::NvlsBlockPipeline))));
    comm.check_algorithm(Algorithm::NvlsWarpPipeline, &call((64 << 10) / 4, DataType::F32)).expect("warp pipeline");
    let e = comm.check_algorithm(Algorithm::NvlsZeroCopy, &call((1 << 20) / 4, DataType::F32)).expect_err("zc");
    assert!(e.to_string().contains("bound to the multicast object"), "{e}");
    for (round, (dtype, bytes, in_place)) in
        [(DataType::F32, 1usize << 20, false), (DataType::Bf16, 256 << 10, true)].into_iter().enumerate()
    {
        mc.reset();
        let count = bytes / dtype.size_bytes();
        let (algorithm, got) =
            reduce_once(&mut comm, dtype, count, round, in_place).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(algorithm, Algorithm::NvlsBlockPipeline, "rank {rank} {dtype} {bytes}");
        assert!(got == reference(world, round, count), "rank {rank} {dtype} {bytes}: wrong sums");
        let name = anyccl_gpu::nvls::kernel_name(Algorithm::NvlsBlockPipeline, dtype).expect("kernel");
        let ran = format!("run {name} rank={rank} completed");
        assert!(mc.log().contains(&ran), "rank {rank}: {ran} missing from {:?}", mc.log());
    }
    // Every rank is done with the object's memory before any rank tears its part down.
    rdv.barrier().expect("barrier");
    mc.reset();
    drop(comm);
    // Teardown, in this process: the multicast mappings, the bindings, the imported handle (the object then freed
    // here), then the buffers.
    let deadline = Instant::now() + Duration::from_secs(20);
    while mc.live() != fake_cuda::McLive::default() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(mc.live(), fake_cuda::McLive::default(), "rank {rank}: something leaked: {:?}", mc.log());
    let teardown: Vec<String> = mc.log().iter().map(|l| call_kind(l)).collect();
    let mut expected: Vec<&str> = Vec::new();
    for _ in 0..3 {
        expected.extend(["cuMemUnmap mc", "cuMemAddressFree", "cuMulticastUnbind mc"]);
    }
    expected.extend(["cuMemRelease mc", "free mc"]);
    for _ in 0..3 {
        expected.extend(["cuMemUnmap mem", "cuMemAddressFree", "cuMemRelease mem", "free mem"]);
    }
    assert_eq!(teardown, expected, "rank {rank}: the teardown's calls");
    assert_eq!(fake.violations(), Vec::<String>::new(), "rank {rank}: violations");
    rdv.barrier().expect("the ranks finish together");
    println!("RESULT nvls on rank {rank}: sums right, teardown clean");
}

/// This process's multicast calls of the setup: rank 0 creates the object, exports it, releases its local handle
/// right after the export and imports its own export before adding its device; the others only import (the
/// descriptor from rank 0) and add theirs; then every rank binds and maps its three buffers, each multicast
/// mapping from offset 0.
fn check_setup_calls(rank: usize, log: &[String]) {
    let got: Vec<String> = log.iter().map(|l| call_kind(l)).collect();
    let mut expected: Vec<&str> = if rank == 0 {
        vec![
            "cuMulticastCreate mc",
            "cuMemExportToShareableHandle mc",
            "cuMemRelease mc",
            "cuMemImportFromShareableHandle mc",
            "cuMulticastAddDevice mc",
        ]
    } else {
        vec!["cuMemImportFromShareableHandle mc", "cuMulticastAddDevice mc"]
    };
    for _ in 0..3 {
        expected.extend(fake_cuda::BUFFER_SETUP_CALLS);
    }
    assert_eq!(got, expected, "rank {rank}: the setup's calls");
    assert!(log.iter().filter(|l| l.starts_with("cuMemMap mc")).all(|l| l.ends_with("offset=0")), "{log:?}");
}
