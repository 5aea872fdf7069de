//! The CUDA communicator (`CudaComm = GpuComm<Cuda>`) end to end with no GPU: on the fake CUDA driver (`libcuda.so.1`
//! from testkit/c/fake_cuda.c over the fake HIP runtime: host memory as device memory, streams on worker threads,
//! graphs, the capture rules, IPC handles within one process, and the one-shot / two-shot kernels run from their source
//! compiled for the host, every launch recorded) and a computing fake NCCL 2.28 linked against it.
//!
//! cudarc finds `libcuda.so` by name through the dynamic loader, which reads `LD_LIBRARY_PATH` when the process
//! starts, so every test runs this binary again as a child (`child`, with `FAKECUDA_CASE` naming the case) with
//! `LD_LIBRARY_PATH` at the fake driver and `ANYCCL_NCCL_PATH` at the fake NCCL; the child does the work and
//! asserts, and the parent asserts that it passed within its deadline and printed the case's closing line. If the
//! fakes cannot be built (no `cc`), the parent fails with the compiler's reason: nothing here is skipped.

use anyccl_testkit::fake_ccl;
use anyccl_testkit::fake_cuda::{self, call_kind};
use anyccl_testkit::fake_hip;
use anyccl_testkit::fused_case;

use std::ffi::c_void;
use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyccl_ccl::CclLibrary;
use anyccl_core::bootstrap::LocalGroup;
use anyccl_core::conformance::{self, Config, ConformanceTarget};
use anyccl_core::Bootstrap;
use anyccl_core::{
    Algorithm, Capabilities, CapabilityState, Communicator, DataType, Error, InOut, InvalidArgument, MemoryRuntime,
    ReduceOp, Result, Selector,
};
use anyccl_cuda::graph::Graph;
use anyccl_cuda::{Cuda, CudaComm, CudaStream};
use anyccl_testkit::gpu_suite::{
    self, call, catalogue_kernel, decode, input, per_rank, reduce_once, reduce_once_with, reference, value, Family,
    Harness,
};
use cudarc::driver::sys;
use fake_hip::{FakeHip, Launch, Shot};
use wait_timeout::ChildExt;

/// A child still running then is taken as hung (and killed).
const CHILD_DEADLINE: Duration = Duration::from_secs(90);

// ---- The parent half ----

/// Cases that check the custom kernels: without them compiled in (no nvcc at build time) they fail with the reason
/// instead of passing without checking anything.
const NEED_KERNELS: &[&str] = &[
    "init_all",
    "graphs",
    "abort",
    "ipc_threads",
    "two_hosts",
    "table_write",
    "alloc_in_capture",
    "engine_streams",
    "ipc_during_capture",
    "split",
    "push_init_all",
    "push_two_shot",
    "push_ipc",
    "push_sm80",
    "push_off",
    "push_fail",
    "launch_fail",
    "fused",
    "nvls",
    "nvls_fail",
];

/// Cases that test the one-shot / two-shot machinery at small sizes (which NVIDIA's default table gives to the
/// push one-shot): they run with the push one-shot off (`ANYCCL_PUSH_MAX_BYTES=0`), as they did before it existed.
const PUSH_OFF: &[&str] = &["init_all", "graphs", "abort", "ipc_threads", "table_write", "push_off"];

/// Cases run on a fake driver that reports multicast (`FAKECUDA_MULTICAST=1`).
const NVLS_CASES: &[&str] = &["nvls", "nvls_fail", "nvls_env_off", "nvls_disabled"];

/// Runs case `case` in a child process on the fakes and checks that it passed; returns its stdout.
fn run_case(case: &str) -> String {
    if let (Some(why), true) = (anyccl_kernels_cuda::NOT_BUILT, NEED_KERNELS.contains(&case)) {
        panic!(
            "case {case} runs the custom CUDA kernels, which this build lacks ({why}); build with \
             ANYCCL_CUDA_TOOLKIT=$(ci/install-cuda.sh) as CI does"
        );
    }
    let cuda = fake_cuda::build_cuda();
    let nccl = fake_cuda::build_nccl(&fake_ccl::NCCL_2_28);
    let dir = cuda.parent().expect("the fake driver's folder");
    let mut cmd = Command::new(std::env::current_exe().expect("this test binary"));
    cmd.args(["child", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("RUST_BACKTRACE", "1")
        .env("FAKECUDA_CASE", case)
        .env("FAKECUDA_LIB", &cuda)
        .env("FAKECUDA_DEVICES", "4")
        // An emulated kernel that waits this long for a peer records "timed out" instead of hanging the child.
        .env("FAKEHIP_KERNEL_TIMEOUT_MS", "20000")
        .env("LD_LIBRARY_PATH", dir)
        .env("ANYCCL_NCCL_PATH", &nccl)
        .env("ANYCCL_PUSH_MAX_BYTES", if PUSH_OFF.contains(&case) { "0" } else { "256KiB" })
        .env("FAKECUDA_CC_MAJOR", if case == "push_sm80" { "8" } else { "9" })
        // Not UTF-8: refused by every constructor with an error naming the variable.
        .env(
            "NCCL_WIN_ENABLE",
            if case == "env_not_utf8" {
                std::os::unix::ffi::OsStrExt::from_bytes(b"1\xff")
            } else {
                std::ffi::OsStr::new("1")
            },
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // The multicast emulation only where a case asks for it; the gates' environment per case.
    if NVLS_CASES.contains(&case) {
        cmd.env("FAKECUDA_MULTICAST", "1");
    }
    match case {
        "nvls_env_off" => {
            cmd.env("NCCL_NVLS_ENABLE", "0");
        }
        "nvls_disabled" => {
            cmd.env("ANYCCL_DISABLE", "multicast");
        }
        _ => {}
    }
    let mut child = cmd.spawn().expect("start the child");
    let mut out_pipe = child.stdout.take().expect("stdout");
    let mut err_pipe = child.stderr.take().expect("stderr");
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out_pipe.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err_pipe.read_to_string(&mut s);
        s
    });
    let status = child.wait_timeout(CHILD_DEADLINE).expect("wait for the child");
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let (stdout, stderr) = (out.join().expect("stdout reader"), err.join().expect("stderr reader"));
    let Some(status) = status else {
        panic!(
            "case {case}: still running after {CHILD_DEADLINE:?} (a hang)\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
        )
    };
    assert!(status.success(), "case {case}: the child failed ({status})\n--- stdout\n{stdout}\n--- stderr\n{stderr}");
    assert!(
        stdout.contains(&format!("FAKECUDA-CASE-PASSED {case}\n")) && stdout.contains("1 passed"),
        "case {case}: the child did not run the case\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    );
    stdout
}

/// A failed launch names the algorithm that ran: the push one-shot (selected for a small message), the push
/// two-shot and both quantized two-shots (named), each when the fake driver fails its kernel's launch on every rank
/// (CUDA_ERROR_LAUNCH_FAILED); nothing was enqueued, so the same calls then run and sum right.
#[test]
fn a_failed_launch_of_the_push_or_quantized_kernels_names_its_algorithm() {
    run_case("launch_fail");
}

/// The push one-shot on communicators of one process (worlds 2 and 4): the setup allocates one receive buffer of
/// `PUSH_RECV_BYTES` per rank, initialised to the sentinel with zeroed control words; small all-reduces (f32 and
/// bf16, in place and out of place, up to 256 KiB) select `one-shot-push` and launch `anyccl_push_one_shot_*` once
/// per rank with the grid `push_blocks`, 512 threads, every rank's receive buffer and its own flag array, through
/// `cuLaunchKernelEx` with programmatic dependent launch (the fake is sm_90); the sums equal the host reference;
/// the call counter counts the calls and every slot holds the sentinel again; a captured push replays right
/// twice; 256 KiB + 16 bytes fall back to one-shot with the reason; dropping the communicators frees every byte
/// they allocated.
#[test]
fn push_one_shot_is_set_up_selected_and_launched_with_pdl_on_communicators_of_one_process() {
    run_case("push_init_all");
}

/// The push two-shot, named (the defaults never pick it), on communicators of 2, 3 and 4 ranks: its kernel with its
/// own grid and PDL, exact rank-order sums for messages of unequal or empty chunks, in place and not, interleaved
/// with push one-shot calls on the same receive buffers; every slot empty again; refused above the limit and for
/// other reductions.
#[test]
fn push_two_shot_runs_when_named_interleaved_with_the_push_one_shot() {
    run_case("push_two_shot");
}

/// The push one-shot over IPC (one process per GPU, ranks as threads, world 3): the setup exports and opens each
/// rank's receive buffer with the staging, scratch and flag buffers (4 handles per rank, 4 mappings per peer);
/// a small all-reduce selects and launches the push kernel with every rank's mapped receive buffer; dropping the
/// communicators closes every mapping.
#[test]
fn push_one_shot_receive_buffers_are_exchanged_over_ipc_and_released() {
    run_case("push_ipc");
}

/// On a device below sm_90 (the fake at compute capability 8.0) the push one-shot still runs, with a plain
/// `cuLaunchKernel` (no `cuLaunchKernelEx`), and says why it has no programmatic dependent launch.
#[test]
fn push_one_shot_without_pdl_below_sm_90_says_why() {
    run_case("push_sm80");
}

/// `ANYCCL_PUSH_MAX_BYTES=0` allocates no receive buffer and leaves the push one-shot ineligible with the reason
/// (one-shot runs instead).
#[test]
fn push_one_shot_off_by_its_setting_says_why() {
    run_case("push_off");
}

/// A push setup that fails half-way (rank 1's receive buffer's initialisation fails) turns only the push one-shot
/// off, on every rank, with the reason, frees every receive buffer already made (rank 0's too), and keeps one-shot
/// running; dropping the communicators frees the rest.
#[test]
fn push_one_shot_setup_failing_half_way_leaks_nothing_and_says_why() {
    run_case("push_fail");
}

/// The fused all-reduce + RMSNorm through the front door: the chosen kernel launched with its shape on every
/// rank and its results equal to core's reference bit for bit (every form, the fused push one-shot included),
/// bad calls launching nothing (the `fused` case).
#[test]
fn the_fused_all_reduce_rmsnorm_launches_the_chosen_kernel_and_bad_calls_launch_nothing() {
    run_case("fused");
}

/// The fake driver reports its devices to `anyccl_cuda::available()` (4, compute capability 9.0, no multicast,
/// driver 12.8); the capability report has the runtime and the custom kernels on and multicast off with the
/// device attribute; NCCL is the fake 2.28 found through `ANYCCL_NCCL_PATH`.
#[test]
fn the_fake_driver_is_available_with_its_devices() {
    run_case("available");
}

/// `communicators_single_process` at worlds 2 and 4: f32 and bf16 sums, in place and out of place, run the
/// kernel the selection names (one-shot or two-shot), once per rank with the grid for the size and 512 threads,
/// with decoded parameters naming every rank, and the sums equal the host reference; i32 (no custom kernel) and a
/// size that is not whole 16-byte vectors go to NCCL, whose sums are right too. No capture violation.
/// A variable anyccl reads as text (`NCCL_WIN_ENABLE`) that is not UTF-8: `communicators_single_process` and
/// `communicator_with_id` refuse it with an error naming the variable, before any communicator is made.
#[test]
fn a_variable_that_is_not_utf8_is_an_error_naming_it() {
    run_case("env_not_utf8");
}

#[test]
fn init_all_runs_the_selected_cuda_kernel_and_sums_right() {
    run_case("init_all");
}

/// Graph capture of an out-of-place all-reduce launches the `_table` kernel (capturing, nothing runs), a replay
/// before `register_graph_buffers` reads the input through staging, registration registers it on every rank, and
/// later replays read the registered inputs; every replay sums right. One-shot at world 2, two-shot at world 4.
#[test]
fn captured_all_reduces_replay_before_and_after_register_graph_buffers() {
    run_case("graphs");
}

/// A wait that gives up writes rank 0's abort word once (`cuStreamWriteValue32_v2`), turns the kernels off with
/// the reason, and the aborted communicator refuses the next call; the peer's selection never diverges.
#[test]
fn a_failed_wait_writes_the_abort_word_and_turns_the_kernels_off() {
    run_case("abort");
}

/// One process per GPU as threads: `multi_process::broadcast_unique_id` + `communicator_with_id` set the kernels up
/// over legacy IPC handles (counted), eager and registered-graph sums are right, and every mapping is closed with
/// its communicator.
#[test]
fn one_process_per_gpu_as_threads_sets_up_cuda_ipc() {
    run_case("ipc_threads");
}

/// Ranks with different `ANYCCL_HOST_ID`s turn the kernels off with "ranks span 2 hosts" before any IPC call or
/// module load; NCCL serves the call and sums right.
#[test]
fn ranks_on_two_hosts_turn_the_kernels_off_before_any_ipc() {
    run_case("two_hosts");
}

/// A registration whose table write fails on one rank (the fake fails rank 1's table copy once, then twice) fails
/// on every rank alike: reverted to staging with right sums and the input still pending, or, when the revert fails
/// too, the graphs must not be replayed and the custom kernels are off on both ranks
/// (`gpu_suite::table_write_failure`).
#[test]
fn a_table_write_failing_on_one_rank_fails_registration_on_every_rank() {
    run_case("table_write");
}

/// Allocation during a capture is refused before the driver sees it (no `cuMemAlloc_v2`), and so is a wait (the
/// kernels stay on: a refused wait is no failed wait); the capture stays valid: the graph instantiates and replays
/// the captured all-reduce correctly.
#[test]
fn allocation_during_capture_is_refused_before_the_driver() {
    run_case("alloc_in_capture");
}

/// The engine's own streams: a borrowed blocking stream (`CudaStream::from_raw`) runs the kernels and stays the
/// engine's; while the engine captures a blocking stream anyccl never saw, in global mode, allocation is refused
/// before the driver (the legacy stream answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) and the capture stays valid;
/// while it captures a non-blocking one, allocation goes ahead in relaxed mode without invalidating it.
#[test]
fn engine_streams_borrowed_and_captured_behind_anyccls_back() {
    run_case("engine_streams");
}

/// The kernels' IPC setup (`enable_custom_ipc_with_env`) called while the engine captures in global mode is
/// refused before the driver on every rank (no handle, no module load, no violation, the capture stays valid);
/// after the capture the same setup succeeds and the CUDA one-shot runs.
#[test]
fn ipc_setup_during_a_capture_is_refused_before_the_driver_and_works_after_it() {
    run_case("ipc_during_capture");
}

/// Sub-communicators of a one-process-per-GPU job (threads): `split(rank % 2)` gives two of two ranks, each with
/// its own kernels over IPC through the sub-communicator, whose all-reduce runs the world-2 push one-shot over its two
/// ranks only; a grouped ring of sends and receives on the parent completes. On a single-process parent the sub's
/// kernels are off with the reason.
#[test]
fn split_sub_communicators_set_up_their_own_kernels_and_p2p_groups_complete() {
    run_case("split");
}

/// The typed all-reduce over cudarc's own context, streams and slices (feature `cudarc`) at world 2: bf16 data
/// written on one cudarc stream and reduced on another (cudarc's event tracking orders them), in place and into
/// a sub-range, runs the push one-shot kernel on cudarc's memory and sums right.
#[cfg(feature = "cudarc")]
#[test]
fn cudarc_slices_and_streams_all_reduce_at_world_two() {
    run_case("cudarc");
}

/// The conformance suite (every collective, dtype but fp8, op, worlds 1 to 4, counts not divisible by the world)
/// on the CUDA communicator over the fakes, custom kernels on; no capture violation.
#[test]
fn conformance_of_every_collective_on_the_fake_cuda_driver() {
    run_case("conformance");
}

/// NVLS through the communicator on a fake driver that reports multicast: the capability is on, `init_all` sets
/// one multicast object up in the order of the leak fix (create, export, release the local handle right after the
/// export, import and add every device, then every rank's staging-in, staging-out and flag buffers created, mapped,
/// bound and mapped through the multicast object from offset 0); at world 4 the default selector picks
/// nvls-block-pipeline for 1 MiB f32 and 2 MiB bf16, at world 2 a forced nvls-warp-pipeline runs 64 KiB f32 and
/// bf16, in place and not, and every rank's sums equal the host reference through the emulated multimem kernels;
/// nvls-zero-copy and a 40-byte call are refused with their reasons; dropping the communicators tears each rank's
/// part down in its fixed order (multicast mappings, ranges and bindings, the multicast handle, then the buffers)
/// and leaves no object, handle, allocation, binding, reservation or mapping behind.
#[test]
fn nvls_all_reduce_runs_through_the_communicator_on_a_multicast_fake_and_tears_down_in_order() {
    run_case("nvls");
}

/// A multicast setup that fails at any step (the object's creation, a peer's import or device, an allocation, a
/// binding, a multicast mapping, an access grant) turns NVLS off on every rank with the failing call named, tears
/// down everything it had made (no object, handle, allocation, binding, reservation or mapping left, no allocation
/// released while bound), and the communicators keep running two-shot.
#[test]
fn nvls_setup_failing_at_any_step_leaks_nothing_and_says_why() {
    run_case("nvls_fail");
}

/// On the default fake (no multicast) the NVLS plans are refused with the device attribute as the reason, the
/// selector falls back to two-shot, and no VMM or multicast call is made at all.
#[test]
fn nvls_is_refused_without_multicast_and_makes_no_multicast_call() {
    run_case("nvls_off");
}

/// `NCCL_NVLS_ENABLE=0` on a fake that reports multicast: refused with that reason, no multicast call.
#[test]
fn nvls_is_refused_with_nccl_nvls_enable_0_and_makes_no_multicast_call() {
    run_case("nvls_env_off");
}

/// `ANYCCL_DISABLE=multicast` on a fake that reports multicast: refused with that reason, no multicast call.
#[test]
fn nvls_is_refused_with_anyccl_disable_and_makes_no_multicast_call() {
    run_case("nvls_disabled");
}

// ---- The child half ----

/// The child half: runs the case `FAKECUDA_CASE` names (set by the tests above, which start it) and prints its
/// closing line. Run alone (as by `--ignored`) it does nothing.
#[test]
#[ignore = "the child half of the fake CUDA tests, which start it with the fakes on LD_LIBRARY_PATH"]
fn child() {
    let Some(case) = std::env::var("FAKECUDA_CASE").ok() else {
        eprintln!("child: not started by a fake CUDA test (FAKECUDA_CASE unset); nothing to do");
        return;
    };
    let s = setup();
    match case.as_str() {
        "available" => available(&s),
        "env_not_utf8" => env_not_utf8(&s),
        "init_all" => init_all(&s),
        "graphs" => graphs(&s),
        "abort" => abort(&s),
        "ipc_threads" => ipc_threads(&s),
        "two_hosts" => two_hosts(&s),
        "table_write" => gpu_suite::table_write_failure(&s),
        "alloc_in_capture" => alloc_in_capture(&s),
        "engine_streams" => engine_streams(&s),
        "ipc_during_capture" => ipc_during_capture(&s),
        "split" => split(&s),
        "fused" => fused(&s),
        #[cfg(feature = "cudarc")]
        "cudarc" => cudarc_world_two(&s),
        "conformance" => conformance_suite(&s),
        "push_init_all" => push_init_all(&s),
        "push_two_shot" => push_two_shot(&s),
        "push_ipc" => push_ipc(&s),
        "push_sm80" => push_sm80(&s),
        "push_off" => push_off(&s),
        "push_fail" => push_fail(&s),
        "nvls" => nvls(&s),
        "nvls_fail" => nvls_fail(&s),
        "nvls_off" => nvls_refused(&s, "MULTICAST_SUPPORTED = 0"),
        "nvls_env_off" => nvls_refused(&s, "NCCL_NVLS_ENABLE"),
        "nvls_disabled" => nvls_refused(&s, "ANYCCL_DISABLE"),
        "launch_fail" => launch_fail(&s),
        other => panic!("unknown case {other}"),
    }
    assert_eq!(s.fake.violations(), Vec::<String>::new(), "capture violations");
    println!("FAKECUDA-CASE-PASSED {case}");
}

struct Setup {
    lib: Arc<CclLibrary>,
    fake: FakeHip,
}

fn setup() -> Setup {
    let lib = anyccl_cuda::platform::load_nccl().expect("the fake NCCL through ANYCCL_NCCL_PATH");
    let path = PathBuf::from(std::env::var_os("FAKECUDA_LIB").expect("FAKECUDA_LIB"));
    // The driver the backend loads through LD_LIBRARY_PATH must be the fake one.
    anyccl_cuda::available().expect("the fake driver");
    let fake = FakeHip::open(&path);
    Setup { lib, fake }
}

impl Harness for Setup {
    type P = Cuda;
    type Graph = Graph;
    const WRITE_VALUE: &'static str = "cuStreamWriteValue32_v2";
    const ABORT_WORD_OFFSET: usize = anyccl_kernels_cuda::ABORT_WORD_OFFSET;
    const IPC_GET: &'static str = "cuIpcGetMemHandle";
    const IPC_OPEN: &'static str = "cuIpcOpenMemHandle_v2";
    const IPC_CLOSE: &'static str = "cuIpcCloseMemHandle";
    const MODULE_LOAD: &'static str = "cuModuleLoadData";
    const SMALL: Algorithm = Algorithm::OneShotPush;

    fn lib(&self) -> &Arc<CclLibrary> {
        &self.lib
    }

    fn device(&self, ordinal: i32) -> i32 {
        ordinal
    }

    fn caps(&self) -> anyccl_core::CapabilityReport {
        anyccl_cuda::capabilities(Some(&self.lib), &|_| None)
    }

    fn fake(&self) -> &FakeHip {
        &self.fake
    }

    fn comms(&self, world: usize) -> Vec<Communicator<CudaComm>> {
        comms(self, world)
    }

    fn join(
        &self,
        boot: &mut dyn Bootstrap,
        rank: usize,
        world: usize,
        env: Option<gpu_suite::Env<'_>>,
    ) -> Result<Communicator<CudaComm>> {
        let selector = Arc::new(Selector::defaults());
        let Some(env) = env else {
            let id = anyccl_cuda::multi_process::broadcast_unique_id(boot)?;
            return anyccl_cuda::multi_process::communicator_with_id(&id, rank, world, rank as i32, boot, selector);
        };
        let id = anyccl_gpu::multi_process::share_unique_id::<Cuda>(boot, Some(&self.lib))?;
        anyccl_gpu::multi_process::join::<Cuda>(self.lib.clone(), &id, rank, world, rank as i32, boot, selector, env)
    }

    fn capture(
        rt: &anyccl_cuda::CudaRuntime,
        stream: &CudaStream,
        mode: anyccl_core::CaptureMode,
        f: &mut dyn FnMut(&CudaStream) -> Result<()>,
    ) -> Result<Graph> {
        Graph::capture_with(rt.context(), stream, mode, f)
    }

    fn replay(graph: &Graph, stream: &CudaStream) -> Result<()> {
        graph.launch(stream)
    }

    fn raw(stream: &CudaStream) -> *mut c_void {
        stream.raw().cast()
    }
}

fn comms(s: &Setup, world: usize) -> Vec<Communicator<CudaComm>> {
    let ordinals: Vec<i32> = (0..world as i32).collect();
    anyccl_cuda::communicators_single_process(s.lib.clone(), &ordinals, Arc::new(Selector::defaults()))
        .expect("communicators")
}

/// The fused all-reduce + RMSNorm through the front door on the fakes (which run every kernel of the shared source,
/// the fused ones with their arithmetic). Bad calls (a short weight, a row that is not a multiple of 8) launch
/// nothing; fused one-shot launches `anyccl_fused_one_shot_bf16` with one block per row and `NORM_THREADS` threads
/// on every rank; fused two-shot `anyccl_fused_two_shot_bf16` with a block per row of the rank's share; unfused the
/// custom one-shot all-reduce into `out` then `anyccl_rmsnorm_bf16`; the fused push one-shot
/// `anyccl_fused_push_one_shot_bf16` on the push grid; each runs to completion and every rank's output and new
/// residual equal core's host reference bit for bit. The fused push one-shot is the default rule's first form at
/// this size, and a captured one takes no graph-input table slot; fp8 output is never unfused.
fn fused(s: &Setup) {
    use anyccl_core::{RmsNormForm, RmsNormSpec};
    use fused_case::{bytes_of, u16s, Case};
    let mut cs = comms(s, 2);
    assert!(cs[0].backend().custom_kernels_off().is_none(), "{:?}", cs[0].backend().custom_kernels_off());
    let (tokens, hidden) = (3usize, 1024usize);
    let bytes = tokens * hidden * 2;
    let spec = RmsNormSpec::new(DataType::Bf16, tokens, hidden, 1e-6);
    let case = Case::new(spec, 2, 11);
    let call_all = |cs: &mut [Communicator<CudaComm>], spec: RmsNormSpec, weight_bytes: usize| {
        per_rank(cs, |c| -> Result<(anyccl_core::RmsNormSelection, Vec<u8>, Vec<u16>)> {
            let rt = c.runtime().clone();
            let st = rt.stream()?;
            let mut input = rt.alloc(bytes)?;
            rt.upload(&mut input, &bytes_of(&case.inputs[c.rank()]), &st)?;
            let mut weight = rt.alloc(weight_bytes)?;
            rt.upload(&mut weight, &bytes_of(&case.weight)[..weight_bytes], &st)?;
            let (mut residual, mut out) = (rt.alloc(bytes)?, rt.alloc(bytes)?);
            rt.upload(&mut residual, &bytes_of(&case.residual), &st)?;
            let sel = c.all_reduce_rmsnorm(&input, &mut residual, &weight, &mut out, &spec, &st)?;
            st.synchronize()?;
            let (mut o, mut r) = (vec![0u8; bytes], vec![0u8; bytes]);
            rt.download(&out, &mut o, &st)?;
            rt.download(&residual, &mut r, &st)?;
            Ok((sel, o, u16s(&r)))
        })
    };
    let from = s.fake.launch_total();
    for e in call_all(&mut cs, spec, hidden * 2 - 2) {
        let e = e.expect_err("a short weight");
        assert!(matches!(e, Error::InvalidArgument(InvalidArgument::BufferTooSmall { which: "weight", .. })), "{e}");
    }
    let mut odd = spec;
    odd.hidden = 1020;
    for e in call_all(&mut cs, odd, hidden * 2) {
        let e = e.expect_err("hidden 1020");
        assert!(matches!(e, Error::InvalidArgument(InvalidArgument::InvalidValue { .. })), "{e}");
    }
    assert_eq!(s.fake.launch_total(), from, "a refused call launched something");
    let (want_out, want_res) = case.expected();
    let threads = anyccl_core::fused::NORM_THREADS as u32;
    let forms = [
        (RmsNormForm::FusedOneShot, vec![("anyccl_fused_one_shot_bf16", tokens as u32)]),
        (RmsNormForm::FusedTwoShot, vec![("anyccl_fused_two_shot_bf16", tokens.div_ceil(2) as u32)]),
        (RmsNormForm::Unfused, vec![("anyccl_one_shot_bf16", 0), ("anyccl_rmsnorm_bf16", tokens as u32)]),
        (
            RmsNormForm::FusedPush,
            vec![("anyccl_fused_push_one_shot_bf16", anyccl_gpu::push::fused_push_blocks(tokens, bytes, 2))],
        ),
    ];
    for (form, want) in forms {
        s.fake.reset();
        let got = call_all(&mut cs, spec.with_form(form), hidden * 2);
        let launches = s.fake.launches();
        let names: Vec<&str> = launches.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(launches.len(), 2 * want.len(), "{form}: {names:?}");
        for (name, grid) in &want {
            let of: Vec<&Launch> = launches.iter().filter(|l| l.name == *name).collect();
            assert_eq!(of.len(), 2, "{form}: {name} once per rank: {names:?}");
            for l in of {
                assert_eq!((l.status, l.runs, l.completed), (0, 1, 1), "{form}: {name}");
                if name.contains("norm") || name.contains("fused") {
                    assert_eq!((l.grid, l.block), ([*grid, 1, 1], [threads, 1, 1]), "{form}: {name}");
                    assert_eq!(l.norm.as_ref().map(|p| (p.tokens, p.hidden_vec)), Some((tokens as u64, 128)));
                } else {
                    assert_eq!(l.params.as_ref().map(|p| (p.shot, p.out != 0)), Some((Shot::One, true)), "{form}");
                }
            }
        }
        for (rank, r) in got.into_iter().enumerate() {
            let (sel, out, res) = r.unwrap_or_else(|e| panic!("{form} rank {rank}: {e}"));
            assert_eq!(sel.form, form);
            assert!(res == want_res && out == want_out, "{form} rank {rank}: differs from core's reference");
        }
    }
    // The default rule tries the fused push one-shot first at this size (6 KiB), where the push one-shot is set up.
    s.fake.reset();
    let _ = call_all(&mut cs, spec, hidden * 2);
    let names: Vec<String> = s.fake.launches().iter().map(|l| l.name.clone()).collect();
    assert_eq!(names, ["anyccl_fused_push_one_shot_bf16"; 2], "default form at 6 KiB");
    // A captured fused push call reads its own input directly: it takes no graph-input table slot (nothing left
    // pending for register_graph_buffers); a captured fused one-shot takes one (so the check can fail).
    for (form, want_pending) in [(RmsNormForm::FusedPush, 0usize), (RmsNormForm::FusedOneShot, 1)] {
        s.fake.reset();
        let pending = per_rank(&mut cs, |c| -> Result<usize> {
            let rt = c.runtime().clone();
            let st = rt.stream()?;
            let input = rt.alloc(bytes)?;
            let weight = rt.alloc(hidden * 2)?;
            let (mut residual, mut out) = (rt.alloc(bytes)?, rt.alloc(bytes)?);
            let f = spec.with_form(form);
            // Captured, never replayed: the slot (or its absence) is what this checks.
            Graph::capture(rt.context(), &st, |st| {
                c.all_reduce_rmsnorm(&input, &mut residual, &weight, &mut out, &f, st).map(|_| ())
            })?;
            Ok(c.pending_graph_buffers())
        });
        let pending: Vec<usize> = pending.into_iter().map(|p| p.expect("rank")).collect();
        assert_eq!(pending, [want_pending; 2], "{form}: graph inputs left pending");
        let names: Vec<String> = s.fake.launches().iter().map(|l| l.name.clone()).collect();
        assert!(names.iter().all(|n| n.contains("fused")) && names.len() == 2, "{form}: {names:?}");
    }
    // fp8 output: unfused is refused with the reason before anything is launched.
    s.fake.reset();
    for e in call_all(&mut cs, spec.fp8_output(0.5).with_form(RmsNormForm::Unfused), hidden * 2) {
        let e = e.expect_err("fp8 unfused");
        assert!(e.to_string().contains("fp8"), "{e}");
    }
    assert_eq!(s.fake.launch_total(), 0);
}

/// Runs `f` on one thread per rank.
fn env_not_utf8(s: &Setup) {
    let names_it = |e: &anyccl_core::Error| {
        matches!(e, anyccl_core::Error::Config { source_name, .. } if source_name == "NCCL_WIN_ENABLE")
            && e.to_string().contains("not valid UTF-8")
    };
    let e = anyccl_cuda::communicators_single_process(s.lib.clone(), &[0, 1], Arc::new(Selector::defaults()))
        .err()
        .expect("refused");
    assert!(names_it(&e), "{e:?}");
    let id = anyccl_ccl::UniqueId::from_bytes(&[0u8; 128]).expect("128 bytes");
    let group = LocalGroup::new(1, Duration::from_secs(30));
    let mut boot = group.member(0);
    let e = anyccl_cuda::multi_process::communicator_with_id(&id, 0, 1, 0, &mut boot, Arc::new(Selector::defaults()))
        .err()
        .expect("refused");
    assert!(names_it(&e), "{e:?}");
    // The same check the constructors make, named for a direct caller.
    let e = anyccl_core::env::check_process_env().expect_err("refused");
    assert!(names_it(&e), "{e:?}");
}

fn available(s: &Setup) {
    let info = anyccl_cuda::available().expect("available");
    assert_eq!(info.version, 12080);
    assert_eq!(info.devices.len(), 4, "{info:?}");
    for (i, d) in info.devices.iter().enumerate() {
        assert_eq!((d.ordinal, d.compute_capability, d.multicast_supported), (i as i32, (9, 0), false), "{d:?}");
        assert_eq!(d.name, format!("Fake NVIDIA H200 {i}"));
        assert_eq!(d.arch(), "sm_90");
    }
    assert_eq!(s.lib.version().code, 22809, "{}", s.lib.describe());
    let caps = anyccl_cuda::capabilities(Some(&s.lib), &|_| None);
    assert!(caps.has(Capabilities::CUDA_RUNTIME), "{caps:?}");
    // sm_90 devices and a driver exporting cuLaunchKernelEx: programmatic dependent launch is on.
    assert!(caps.has(Capabilities::DEPENDENT_LAUNCH), "{caps:?}");
    match anyccl_kernels_cuda::NOT_BUILT {
        None => assert!(caps.has(Capabilities::CUSTOM_KERNELS), "{caps:?}"),
        Some(why) => {
            let off = caps.require(Capabilities::CUSTOM_KERNELS).expect_err("not built").to_string();
            assert!(off.contains(why), "{off}");
        }
    }
    match caps.state(Capabilities::MULTICAST) {
        CapabilityState::Disabled(r) => assert!(r.to_string().contains("MULTICAST_SUPPORTED = 0"), "{r}"),
        other => panic!("multicast on the fake: {other:?}"),
    }
    // Nothing multicast was asked of the driver.
    for name in ["cuMulticastCreate", "cuMulticastGetGranularity", "cuMemCreate"] {
        assert_eq!(s.fake.calls(name), 0, "{name}");
    }
}

/// The multicast records of the fake driver.
fn multicast_records() -> fake_cuda::FakeMulticast {
    fake_cuda::FakeMulticast::open(&PathBuf::from(std::env::var_os("FAKECUDA_LIB").expect("FAKECUDA_LIB")))
}

fn nvls(s: &Setup) {
    let mc = multicast_records();
    let caps = anyccl_cuda::capabilities(Some(&s.lib), &|k| std::env::var(k).ok());
    assert!(caps.has(Capabilities::MULTICAST), "{caps:?}");
    /// World, forced algorithm, the algorithm expected, and the calls (element type, bytes, in place).
    type NvlsCase = (usize, Option<Algorithm>, Algorithm, &'static [(DataType, usize, bool)]);
    let cases: [NvlsCase; 2] = [
        (
            4,
            None,
            Algorithm::NvlsBlockPipeline,
            &[(DataType::F32, 1 << 20, false), (DataType::Bf16, 2 << 20, true), (DataType::F32, 1 << 20, true)],
        ),
        (
            2,
            Some(Algorithm::NvlsWarpPipeline),
            Algorithm::NvlsWarpPipeline,
            &[(DataType::F32, 64 << 10, true), (DataType::Bf16, 64 << 10, false)],
        ),
    ];
    for (world, forced, want, runs) in cases {
        mc.reset();
        let ordinals: Vec<i32> = (0..world as i32).collect();
        let selector = Arc::new(Selector::defaults().with_forced(forced));
        let mut cs =
            anyccl_cuda::communicators_single_process(s.lib.clone(), &ordinals, selector).expect("communicators");
        for c in &cs {
            assert_eq!(c.backend().nvls_off(), None, "world {world}");
        }
        // The setup, in order: one object, its local handle released right after the export, every device added
        // before any memory is bound, each binding mapped through the multicast handle.
        let setup: Vec<String> = mc.log().iter().map(|l| call_kind(l)).collect();
        let mut expected: Vec<&str> = vec![
            "cuMulticastCreate mc",
            "cuMemExportToShareableHandle mc",
            "cuMemRelease mc",
            "cuMemImportFromShareableHandle mc",
            "cuMulticastAddDevice mc",
        ];
        for _ in 1..world {
            expected.extend(["cuMemImportFromShareableHandle mc", "cuMulticastAddDevice mc"]);
        }
        for _ in 0..world * 3 {
            expected.extend(fake_cuda::BUFFER_SETUP_CALLS);
        }
        assert_eq!(setup, expected, "world {world}: the setup's calls");
        assert!(mc.log().iter().any(|l| l.starts_with("cuMemMap mc") && l.ends_with("offset=0")));
        for (round, &(dtype, bytes, in_place)) in runs.iter().enumerate() {
            let count = bytes / dtype.size_bytes();
            let mut c = call(count, dtype);
            c.in_place = in_place;
            assert_eq!(cs[0].select_all_reduce(&c).expect("selection").algorithm, want, "world {world} {dtype}");
            mc.reset();
            let out = per_rank(&mut cs, |c| reduce_once(c, dtype, count, round, in_place));
            for (rank, r) in out.into_iter().enumerate() {
                let (algorithm, got) = r.unwrap_or_else(|e| panic!("world {world} {dtype} {bytes}: {e}"));
                assert_eq!(algorithm, want, "world {world} rank {rank}");
                assert!(got == reference(world, round, count), "world {world} {dtype} {bytes} rank {rank}: wrong sums");
            }
            let name = anyccl_gpu::nvls::kernel_name(want, dtype).expect("kernel");
            let log = mc.log();
            for rank in 0..world {
                let ran = format!("run {name} rank={rank} completed");
                assert!(log.contains(&ran), "world {world}: {ran} missing from {log:?}");
            }
            println!("world {world} {dtype} {bytes} bytes: {want}");
        }
        if world == 4 {
            nvls_captured(&mut cs, &mc);
        }
        let why = cs[0].check_algorithm(Algorithm::NvlsZeroCopy, &call(1 << 18, DataType::F32)).expect_err("zc");
        assert!(why.to_string().contains("bound to the multicast object"), "{why}");
        let why = cs[0].check_algorithm(want, &call(10, DataType::F32)).expect_err("40 bytes");
        assert!(why.to_string().contains("multiple of 16"), "{why}");
        // Teardown: each rank's part in its fixed order, then the object itself; nothing left.
        mc.reset();
        drop(cs);
        let teardown: Vec<String> = mc.log().iter().map(|l| call_kind(l)).collect();
        let mut expected: Vec<&str> = Vec::new();
        for rank in 0..world {
            for _ in 0..3 {
                expected.extend(["cuMemUnmap mc", "cuMemAddressFree", "cuMulticastUnbind mc"]);
            }
            expected.push("cuMemRelease mc");
            if rank == world - 1 {
                expected.push("free mc");
            }
            for _ in 0..3 {
                expected.extend(["cuMemUnmap mem", "cuMemAddressFree", "cuMemRelease mem", "free mem"]);
            }
        }
        assert_eq!(teardown, expected, "world {world}: the teardown's calls");
        assert_eq!(mc.live(), fake_cuda::McLive::default(), "world {world}: something leaked");
    }
}

/// A captured nvls-block-pipeline all-reduce (1 MiB f32, out of place) at world 4: captured once, replayed twice
/// with new inputs, right both times; the kernel ran once per rank per replay.
fn nvls_captured(cs: &mut [Communicator<CudaComm>], mc: &fake_cuda::FakeMulticast) {
    let (dtype, bytes) = (DataType::F32, 1usize << 20);
    let count = bytes / 4;
    let world = cs.len();
    mc.reset();
    let out = per_rank(cs, |c| -> Result<(Option<Algorithm>, Vec<Vec<f32>>)> {
        let rt = c.runtime().clone();
        let st = rt.stream()?;
        let mut inp = rt.alloc(bytes)?;
        let mut out = rt.alloc(bytes)?;
        let mut chosen = None;
        let graph = Graph::capture(rt.context(), &st, |st| {
            let sel = c.all_reduce(InOut::Separate { send: &inp, recv: &mut out }, count, dtype, ReduceOp::Sum, st)?;
            chosen = Some(sel.algorithm);
            Ok(())
        })?;
        let mut sums = Vec::new();
        for round in [3usize, 4] {
            rt.upload(&mut inp, &input(dtype, c.rank(), round, count), &st)?;
            graph.launch(&st)?;
            st.synchronize()?;
            let mut host = vec![0u8; bytes];
            rt.download(&out, &mut host, &st)?;
            sums.push(decode(dtype, &host));
        }
        Ok((chosen, sums))
    });
    for (rank, r) in out.into_iter().enumerate() {
        let (chosen, sums) = r.unwrap_or_else(|e| panic!("captured rank {rank}: {e}"));
        assert_eq!(chosen, Some(Algorithm::NvlsBlockPipeline), "rank {rank}");
        assert!(sums[0] == reference(world, 3, count) && sums[1] == reference(world, 4, count), "rank {rank}: replays");
    }
    let runs = mc.log().iter().filter(|l| l.starts_with("run anyccl_nvls_block_pipeline_mc_f32")).count();
    assert_eq!(runs, 2 * world, "{:?}", mc.log());
}

fn nvls_fail(s: &Setup) {
    let mc = multicast_records();
    let steps = [
        ("cuMulticastCreate", 1),
        ("cuMemExportToShareableHandle", 1),
        ("cuMemImportFromShareableHandle", 3),
        ("cuMulticastAddDevice", 2),
        ("cuMemCreate", 7),
        ("cuMulticastBindMem", 5),
        ("cuMemMap", 6),
        ("cuMemSetAccess", 12),
    ];
    for (name, nth) in steps {
        mc.fail(name, nth);
        let mut cs = comms(s, 4);
        mc.fail("", 0);
        for c in &cs {
            let off = c.backend().nvls_off().expect("NVLS off");
            assert!(off.contains("multicast setup failed") && off.contains(name), "{name} #{nth}: {off}");
        }
        assert_eq!(mc.live(), fake_cuda::McLive::default(), "{name} #{nth}: left behind");
        let big = call((1 << 20) / 4, DataType::F32);
        assert_eq!(cs[0].select_all_reduce(&big).expect("selection").algorithm, Algorithm::TwoShot, "{name}");
        let out = per_rank(&mut cs, |c| -> Result<Vec<f32>> {
            let rt = c.runtime().clone();
            let st = rt.stream()?;
            let mut a = rt.alloc(1 << 20)?;
            rt.upload(&mut a, &input(DataType::F32, c.rank(), 1, big.count), &st)?;
            c.all_reduce(InOut::InPlace(&mut a), big.count, DataType::F32, ReduceOp::Sum, &st)?;
            st.synchronize()?;
            let mut host = vec![0u8; 1 << 20];
            rt.download(&a, &mut host, &st)?;
            Ok(decode(DataType::F32, &host))
        });
        for r in out {
            assert!(r.expect("two-shot") == reference(4, 1, big.count), "{name}: wrong sums");
        }
        println!("{name} #{nth}: NVLS off, nothing left");
    }
}

/// The NVLS plans refused with `reason` on every rank, nothing multicast asked of the driver.
fn nvls_refused(s: &Setup, reason: &str) {
    let mut cs = comms(s, 4);
    let big = call((1 << 20) / 4, DataType::F32);
    for c in &cs {
        let off = c.backend().nvls_off().expect("NVLS off");
        assert!(off.contains(reason), "{off}");
        for a in [Algorithm::NvlsBlockPipeline, Algorithm::NvlsWarpPipeline, Algorithm::NvlsZeroCopy] {
            let e = c.check_algorithm(a, &big).expect_err("refused");
            assert!(e.to_string().contains(reason), "{a}: {e}");
        }
    }
    // The default table's NVLS rule falls back to two-shot, which runs.
    assert_eq!(cs[0].select_all_reduce(&big).expect("selection").algorithm, Algorithm::TwoShot);
    let out = per_rank(&mut cs, |c| -> Result<Vec<f32>> {
        let rt = c.runtime().clone();
        let st = rt.stream()?;
        let mut a = rt.alloc(1 << 20)?;
        rt.upload(&mut a, &input(DataType::F32, c.rank(), 0, big.count), &st)?;
        c.all_reduce(InOut::InPlace(&mut a), big.count, DataType::F32, ReduceOp::Sum, &st)?;
        st.synchronize()?;
        let mut host = vec![0u8; 1 << 20];
        rt.download(&a, &mut host, &st)?;
        Ok(decode(DataType::F32, &host))
    });
    for r in out {
        assert!(r.expect("two-shot") == reference(4, 0, big.count), "wrong sums");
    }
    drop(cs);
    for name in ["cuMulticastCreate", "cuMulticastGetGranularity", "cuMulticastAddDevice", "cuMemCreate"] {
        assert_eq!(s.fake.calls(name), 0, "{name} was called");
    }
    assert_eq!(multicast_records().log(), Vec::<String>::new());
}

/// The generic `init_all` case on the fake CUDA driver (whatever NVIDIA's default table picks).
fn init_all(s: &Setup) {
    gpu_suite::init_all(s, |_, _| None);
}

/// The generic graph-capture case on the fake CUDA driver.
fn graphs(s: &Setup) {
    gpu_suite::graphs(s, |_, _| None);
}

/// The generic abort-word case on the fake CUDA driver.
fn abort(s: &Setup) {
    gpu_suite::abort(s);
}

/// The generic one-process-per-GPU case on the fake CUDA driver, through `multi_process::broadcast_unique_id` and
/// `communicator_with_id`.
fn ipc_threads(s: &Setup) {
    gpu_suite::ipc_threads(s);
}

/// The generic two-hosts case on the fake CUDA driver.
fn two_hosts(s: &Setup) {
    gpu_suite::two_hosts(s);
}

fn alloc_in_capture(s: &Setup) {
    let mut cs = comms(s, 2);
    let allocs = s.fake.calls("cuMemAlloc_v2");
    let out = per_rank(&mut cs, |c| -> Result<(Error, Vec<f32>)> {
        let rt = c.runtime().clone();
        let st = rt.stream()?;
        let mut b = rt.alloc(4096)?;
        rt.upload(&mut b, &input(DataType::F32, c.rank(), 0, 1024), &st)?;
        let (mut refused, mut wait) = (None, None);
        let graph = Graph::capture_with(rt.context(), &st, anyccl_core::CaptureMode::ThreadLocal, |st| {
            refused = rt.alloc(64).err();
            c.all_reduce(InOut::InPlace(&mut b), 1024, DataType::F32, ReduceOp::Sum, st)?;
            // A wait during the capture is refused too, and is no failed wait: nothing is aborted.
            wait = c.wait(st, Duration::from_secs(1)).err();
            Ok(())
        })?;
        let wait = wait.expect("wait during the capture refused");
        assert!(matches!(wait, Error::InvalidArgument(InvalidArgument::DuringCapture { .. })), "{wait}");
        assert!(c.backend().custom_kernels_off().is_none(), "{:?}", c.backend().custom_kernels_off());
        graph.launch(&st)?;
        st.synchronize()?;
        let mut host = vec![0u8; 4096];
        rt.download(&b, &mut host, &st)?;
        Ok((refused.expect("allocation during the capture refused"), decode(DataType::F32, &host)))
    });
    for (rank, r) in out.into_iter().enumerate() {
        let (refused, got) = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(matches!(refused, Error::InvalidArgument(InvalidArgument::DuringCapture { .. })), "{refused}");
        assert!(got == reference(2, 0, 1024), "rank {rank}: the captured all-reduce replayed");
    }
    // The driver saw each rank's buffer `b`, and not the allocation refused during the capture.
    assert_eq!(s.fake.calls("cuMemAlloc_v2") - allocs, 2, "the refused allocation never reached cuMemAlloc_v2");
    assert_eq!(s.fake.calls("cuStreamEndCapture"), 2);
}

/// A raw stream made as an engine makes it (`CU_STREAM_DEFAULT`: blocking, or `CU_STREAM_NON_BLOCKING`).
fn engine_stream(rt: &anyccl_cuda::CudaRuntime, blocking: bool) -> sys::CUstream {
    rt.context().bind().expect("bind");
    let mut raw: sys::CUstream = std::ptr::null_mut();
    // SAFETY: writes one stream handle.
    let rc = unsafe { sys::cuStreamCreate(&mut raw, if blocking { 0 } else { 1 }) };
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS);
    raw
}

/// Ends the engine's capture on `raw` and destroys the graph: the capture must have stayed valid.
fn end_engine_capture(raw: sys::CUstream) {
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: a stream this test began capturing; writes one graph handle.
    let rc = unsafe { sys::cuStreamEndCapture(raw, &mut graph) };
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "the engine's capture stayed valid");
    assert!(!graph.is_null());
    // SAFETY: the graph just ended, destroyed once; the stream is the test's own.
    unsafe {
        assert_eq!(sys::cuGraphDestroy(graph), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuStreamDestroy_v2(raw), sys::CUresult::CUDA_SUCCESS);
    }
}

fn engine_streams(s: &Setup) {
    let mut cs = comms(s, 2);
    let out = per_rank(&mut cs, |c| -> Result<Vec<f32>> {
        let rt = c.runtime().clone();
        let raw = engine_stream(&rt, true);
        let mut b = rt.alloc(4096)?;
        let got = {
            // SAFETY: `raw` is a live stream of this device and outlives the wrapper (destroyed below).
            let st = unsafe { CudaStream::from_raw(raw.cast(), rt.context()) };
            rt.upload(&mut b, &input(DataType::F32, c.rank(), 0, 1024), &st)?;
            let sel = c.all_reduce(InOut::InPlace(&mut b), 1024, DataType::F32, ReduceOp::Sum, &st)?;
            assert_eq!(sel.algorithm, Algorithm::OneShotPush);
            let mut host = vec![0u8; 4096];
            rt.download(&b, &mut host, &st)?;
            decode(DataType::F32, &host)
        };
        // SAFETY: the engine's stream, still alive after the wrapper dropped; destroyed once.
        assert_eq!(unsafe { sys::cuStreamDestroy_v2(raw) }, sys::CUresult::CUDA_SUCCESS, "the wrapper kept it");
        Ok(got)
    });
    for (rank, r) in out.into_iter().enumerate() {
        assert!(r.expect("rank") == reference(2, 0, 1024), "rank {rank}");
    }
    let rt = cs[0].runtime().clone();
    for blocking in [true, false] {
        let raw = engine_stream(&rt, blocking);
        let allocs = s.fake.calls("cuMemAlloc_v2");
        // SAFETY: a live stream of this device, not capturing.
        let rc = unsafe { sys::cuStreamBeginCapture_v2(raw, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL) };
        assert_eq!(rc, sys::CUresult::CUDA_SUCCESS);
        let r = rt.alloc(64);
        if blocking {
            let e = r.err().expect("refused while a blocking stream captures");
            assert!(matches!(e, Error::InvalidArgument(InvalidArgument::DuringCapture { .. })), "{e}");
            assert_eq!(s.fake.calls("cuMemAlloc_v2"), allocs, "refused before the driver");
        } else {
            let b = r.expect("allowed in relaxed mode beside a capture anyccl cannot see");
            assert_eq!(s.fake.calls("cuMemAlloc_v2"), allocs + 1);
            // Freeing is refused the same way while the capture runs: the buffer is kept until it ends.
            end_engine_capture(raw);
            drop(b);
            continue;
        }
        end_engine_capture(raw);
    }
}

/// The generic custom-kernel-setup-during-capture case on the fake CUDA driver (the push one-shot after it).
fn ipc_during_capture(s: &Setup) {
    gpu_suite::ipc_during_capture(s);
}

/// The generic split case on the fake CUDA driver (the subs run the push one-shot).
fn split(s: &Setup) {
    gpu_suite::split(s);
}

#[cfg(feature = "cudarc")]
fn cudarc_world_two(s: &Setup) {
    use anyccl_cuda::CudarcAllReduce;
    use half::bf16;
    let n = 1024;
    let data = |rank: usize| (0..n).map(|i| bf16::from_f32(value(rank, 3, i))).collect::<Vec<bf16>>();
    let mut cs = comms(s, 2);
    let from = s.fake.launch_total();
    let out = per_rank(&mut cs, |c| -> std::result::Result<(Algorithm, Vec<bf16>, Vec<bf16>), String> {
        let rank = c.rank();
        let ctx = cudarc::driver::CudaContext::new(rank).map_err(|e| e.to_string())?;
        let upload = ctx.new_stream().map_err(|e| e.to_string())?;
        let work = ctx.new_stream().map_err(|e| e.to_string())?;
        let mut x = upload.clone_htod(&data(rank)).map_err(|e| e.to_string())?;
        let sel = c.all_reduce_in_place(&mut x, ReduceOp::Sum, &work).map_err(|e| e.to_string())?;
        let summed = upload.clone_dtoh(&x).map_err(|e| e.to_string())?;
        // Into elements 16..528 of a zeroed output (whole vectors): nothing outside is written.
        let send = upload.clone_htod(&data(rank)).map_err(|e| e.to_string())?;
        let mut into = upload.alloc_zeros::<bf16>(n).map_err(|e| e.to_string())?;
        c.all_reduce_into(&send.slice(0..512), &mut into.slice_mut(16..528), ReduceOp::Sum, &work)
            .map_err(|e| e.to_string())?;
        let ranged = upload.clone_dtoh(&into).map_err(|e| e.to_string())?;
        Ok((sel.algorithm, summed, ranged))
    });
    let want: Vec<bf16> = reference(2, 3, n).into_iter().map(bf16::from_f32).collect();
    for (rank, r) in out.into_iter().enumerate() {
        let (algorithm, summed, ranged) = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(algorithm, Algorithm::OneShotPush, "rank {rank}");
        assert_eq!(summed, want, "rank {rank}: in place");
        assert_eq!(&ranged[16..528], &want[..512], "rank {rank}: into the sub-range");
        assert!(ranged[..16].iter().chain(&ranged[528..]).all(|v| *v == bf16::ZERO), "rank {rank}: outside");
    }
    let launched: Vec<Launch> = s.fake.launches().into_iter().filter(|l| l.seq > from).collect();
    assert_eq!(launched.iter().filter(|l| l.name == "anyccl_push_one_shot_bf16" && l.completed == 1).count(), 4);
}

struct FakeCuda<'a> {
    s: &'a Setup,
}

impl ConformanceTarget for FakeCuda<'_> {
    type Backend = CudaComm;

    fn name(&self) -> String {
        format!("cuda on the fake driver and {}", self.s.lib.describe())
    }

    fn create(&self, world: usize) -> Result<Vec<Communicator<CudaComm>>> {
        Ok(comms(self.s, world))
    }

    fn stream(&self, comm: &Communicator<CudaComm>) -> Result<CudaStream> {
        comm.runtime().stream()
    }
}

fn conformance_suite(s: &Setup) {
    let target = FakeCuda { s };
    // fp8 is left out: the fake NCCL does not compute it (it refuses it with ncclInvalidArgument).
    let dtypes: Vec<DataType> =
        DataType::ALL.iter().copied().filter(|d| !matches!(d, DataType::Fp8E4M3 | DataType::Fp8E5M2)).collect();
    // 1024 elements: whole 16-byte vectors for every kernel type, so the custom kernels are in the suite too.
    let cfg = Config { worlds: vec![1, 2, 3, 4], dtypes, counts: vec![0, 1, 5, 1037, 1024], ..Config::default() };
    let from = s.fake.launch_total();
    let summary = conformance::run(&target, &cfg);
    println!(
        "conformance: {} checks, {} expected errors, {} custom kernel launches",
        summary.checks,
        summary.expected_errors,
        s.fake.launch_total() - from
    );
    summary.assert_ok();
    if anyccl_kernels_cuda::NOT_BUILT.is_none() {
        assert!(s.fake.launch_total() > from, "the custom kernels ran in the suite");
    }
}

// ---- The push one-shot ----

fn dtype_name(dtype: DataType) -> &'static str {
    if dtype == DataType::F32 {
        "f32"
    } else {
        "bf16"
    }
}

/// The launches since `from` must be one push launch per rank of `world` for `bytes` of `dtype`, with the grid of
/// `push_blocks`, 512 threads, the same `world` receive buffers on every rank, and (per `pdl`) programmatic
/// dependent launch; each completed once (eager) unless `capturing`.
fn check_push_launches(
    fake: &FakeHip,
    from: u64,
    world: usize,
    dtype: DataType,
    bytes: usize,
    pdl: bool,
) -> Vec<Launch> {
    let new: Vec<Launch> = fake.launches().into_iter().filter(|l| l.seq > from).collect();
    assert_eq!(new.len(), world, "one launch per rank: {new:?}");
    let blocks = anyccl_gpu::push::push_blocks(bytes, world);
    let mut ranks = Vec::new();
    for l in &new {
        assert_eq!(l.name, catalogue_kernel(Family::PushOneShot, dtype), "{l:?}");
        assert_eq!((l.grid, l.block, l.status, l.pdl), ([blocks, 1, 1], [512, 1, 1], 0, pdl), "{l:?}");
        let p = l.push.as_ref().expect("push parameters");
        assert_eq!((p.world as usize, p.n_vec as usize, p.dtype), (world, bytes / 16, dtype_name(dtype)), "{l:?}");
        assert!(p.recv[..world].iter().all(|r| *r != 0) && p.recv[world..].iter().all(|r| *r == 0), "{l:?}");
        assert!(p.my_flags != 0 && p.input != 0 && p.out != 0, "{l:?}");
        ranks.push(p.rank);
        {
            // Every rank's receive buffer, none twice (in-process ranks see the same addresses; over IPC each rank
            // its own mappings).
            let mut r = p.recv[..world].to_vec();
            r.sort();
            r.dedup();
            assert_eq!(r.len(), world, "distinct receive buffers: {l:?}");
        }
    }
    ranks.sort();
    assert_eq!(ranks, (0..world as i32).collect::<Vec<_>>());
    new
}

/// The call counter of the receive buffer at `recv` and whether every slot holds the sentinel (the fake's device
/// memory is host memory).
fn receive_state(recv: u64) -> (u32, bool) {
    use anyccl_kernels_cuda::push::{PUSH_CTRL_OFFSET, PUSH_SENTINEL};
    // SAFETY: a live receive buffer of PUSH_RECV_BYTES in the fake's host-backed device memory; nothing runs on it
    // now (every stream was synchronised).
    let words = unsafe { std::slice::from_raw_parts(recv as *const u32, PUSH_CTRL_OFFSET / 4 + 1) };
    (words[PUSH_CTRL_OFFSET / 4], words[..PUSH_CTRL_OFFSET / 4].iter().all(|w| *w == PUSH_SENTINEL))
}

fn push_init_all(s: &Setup) {
    let used = s.fake.used_bytes();
    for world in [2usize, 4] {
        let mut cs = comms(s, world);
        for c in &cs {
            let (limit, pdl) = c.backend().push_status().unwrap_or_else(|e| panic!("push off: {e}"));
            assert_eq!(limit, anyccl_kernels_cuda::push::PUSH_MAX_BYTES);
            assert_eq!(pdl, Ok(()), "the fake is sm_90 and exports cuLaunchKernelEx");
        }
        let ex = s.fake.calls("cuLaunchKernelEx");
        let cases = [
            (DataType::F32, 4096usize, false),
            (DataType::Bf16, 64 << 10, true),
            (DataType::F32, 256 << 10, false),
            (DataType::Bf16, 16, true),
        ];
        let mut recv = Vec::new();
        for (round, (dtype, bytes, in_place)) in cases.into_iter().enumerate() {
            let count = bytes / dtype.size_bytes();
            let from = s.fake.launch_total();
            let out = per_rank(&mut cs, |c| reduce_once(c, dtype, count, round, in_place));
            let launches = check_push_launches(&s.fake, from, world, dtype, bytes, true);
            assert!(launches.iter().all(|l| !l.capturing && l.completed == 1), "{launches:?}");
            recv = launches[0].push.as_ref().map(|p| p.recv[..world].to_vec()).unwrap_or_default();
            for (rank, r) in out.into_iter().enumerate() {
                let (algorithm, got) = r.unwrap_or_else(|e| panic!("world {world} {dtype} {bytes}: {e}"));
                assert_eq!(algorithm, Algorithm::OneShotPush, "world {world} {dtype} {bytes} rank {rank}");
                assert!(got == reference(world, round, count), "world {world} {dtype} {bytes} rank {rank}: wrong sums");
            }
        }
        assert_eq!(s.fake.calls("cuLaunchKernelEx") - ex, (cases.len() * world) as i32, "every push launch");
        // Every rank's call counter counts the calls; every slot is empty again.
        for r in &recv {
            assert_eq!(receive_state(*r), (cases.len() as u32, true), "receive buffer {r:#x}");
        }
        // A captured push replays right (the set alternates on the device).
        let (count, dtype) = (2048usize, DataType::F32);
        let from = s.fake.launch_total();
        let replays = per_rank(&mut cs, |c| -> Result<Vec<Vec<f32>>> {
            let rt = c.runtime().clone();
            let st = rt.stream()?;
            let mut a = rt.alloc(count * 4)?;
            let mut b = rt.alloc(count * 4)?;
            let graph = Graph::capture(rt.context(), &st, |st| {
                let io = InOut::Separate { send: &a, recv: &mut b };
                c.all_reduce(io, count, dtype, ReduceOp::Sum, st).map(|_| ())
            })?;
            let mut sums = Vec::new();
            for round in 10..12 {
                rt.upload(&mut a, &input(dtype, c.rank(), round, count), &st)?;
                graph.launch(&st)?;
                st.synchronize()?;
                let mut host = vec![0u8; count * 4];
                rt.download(&b, &mut host, &st)?;
                sums.push(decode(dtype, &host));
            }
            Ok(sums)
        });
        let launched = check_push_launches(&s.fake, from, world, dtype, count * 4, true);
        assert!(launched.iter().all(|l| l.capturing && l.runs == 2 && l.completed == 2), "{launched:?}");
        for (rank, r) in replays.into_iter().enumerate() {
            let sums = r.unwrap_or_else(|e| panic!("world {world} rank {rank}: {e}"));
            for (k, got) in sums.iter().enumerate() {
                assert!(*got == reference(world, 10 + k, count), "world {world} rank {rank} replay {k}");
            }
        }
        // Above the limit: one-shot, and push says why.
        let big = call((256 << 10) / 4 + 4, DataType::F32);
        let why = cs[0].check_algorithm(Algorithm::OneShotPush, &big).expect_err("too big").to_string();
        assert!(why.contains("ANYCCL_PUSH_MAX_BYTES"), "{why}");
        assert_eq!(cs[0].select_all_reduce(&big).expect("selection").algorithm, Algorithm::OneShot);
        // Not a sum, or a type without a kernel: not eligible, with the reason.
        let mut max = call(1024, DataType::F32);
        max.op = ReduceOp::Max;
        let why = cs[0].check_algorithm(Algorithm::OneShotPush, &max).expect_err("max").to_string();
        assert!(why.contains("sum"), "{why}");
        let why = cs[0].check_algorithm(Algorithm::OneShotPush, &call(1024, DataType::I32)).expect_err("i32");
        assert!(why.to_string().contains("f32, f16 and bf16"), "{why}");
        drop(cs);
        assert_eq!(s.fake.used_bytes(), used, "world {world}: every byte freed with the communicators");
    }
}

/// The push two-shot (named: the default rules never pick it) on communicators of 2, 3 and 4 ranks: its kernel on
/// every rank with its own grid and PDL, the rank-order sums for messages whose chunks are unequal or empty (1
/// vector, 1037 vectors, 2048 vectors on 3 ranks, the 256 KiB limit), in place and not, interleaved with push
/// one-shot calls on the same receive buffers; every slot empty again afterwards; refused above the limit and for
/// other reductions, with the reason.
fn push_two_shot(s: &Setup) {
    let used = s.fake.used_bytes();
    for world in [2usize, 3, 4] {
        let mut cs = comms(s, world);
        let cases = [
            (DataType::F32, 4usize, false),
            (DataType::Bf16, 1037 * 8, true),
            (DataType::Bf16, 2048 * 8, false),
            (DataType::F32, (256 << 10) / 4, true),
        ];
        let mut recv = Vec::new();
        let mut calls = 0u32;
        for (round, (dtype, count, in_place)) in cases.into_iter().enumerate() {
            let bytes = count * dtype.size_bytes();
            for algorithm in [Algorithm::TwoShotPush, Algorithm::OneShotPush] {
                let from = s.fake.launch_total();
                let out = per_rank(&mut cs, |c| reduce_once_with(c, Some(algorithm), dtype, count, round, in_place));
                calls += 1;
                let new: Vec<Launch> = s.fake.launches().into_iter().filter(|l| l.seq > from).collect();
                assert_eq!(new.len(), world, "one launch per rank: {new:?}");
                let (family, blocks) = match algorithm {
                    Algorithm::TwoShotPush => {
                        (Family::PushTwoShot, anyccl_gpu::push::push_two_shot_blocks(bytes, world))
                    }
                    _ => (Family::PushOneShot, anyccl_gpu::push::push_blocks(bytes, world)),
                };
                let kernel = catalogue_kernel(family, dtype);
                for l in &new {
                    assert_eq!(l.name, kernel, "{l:?}");
                    assert_eq!((l.grid, l.status, l.pdl, l.completed), ([blocks, 1, 1], 0, true, 1), "{l:?}");
                    let p = l.push.as_ref().expect("push parameters");
                    assert_eq!((p.world as usize, p.n_vec as usize), (world, bytes / 16), "{l:?}");
                }
                recv = new[0].push.as_ref().map(|p| p.recv[..world].to_vec()).unwrap_or_default();
                for (rank, r) in out.into_iter().enumerate() {
                    let (ran, got) = r.unwrap_or_else(|e| panic!("{algorithm} world {world} {dtype} {bytes}: {e}"));
                    assert_eq!(ran, algorithm);
                    let want = reference(world, round, count);
                    assert!(got == want, "{algorithm} world {world} {dtype} {bytes} B rank {rank}: wrong sums");
                }
            }
        }
        for r in &recv {
            assert_eq!(receive_state(*r), (calls, true), "world {world}: receive buffer {r:#x}");
        }
        let big = call((256 << 10) / 4 + 4, DataType::F32);
        let why = cs[0].check_algorithm(Algorithm::TwoShotPush, &big).expect_err("too big").to_string();
        assert!(why.contains("ANYCCL_PUSH_MAX_BYTES"), "{why}");
        let mut max = call(1024, DataType::F32);
        max.op = ReduceOp::Max;
        let why = cs[0].check_algorithm(Algorithm::TwoShotPush, &max).expect_err("max").to_string();
        assert!(why.contains("sum"), "{why}");
        // The defaults never pick it.
        for count in [4usize, 1037 * 8, (256 << 10) / 4] {
            let sel = cs[0].select_all_reduce(&call(count, DataType::F32)).expect("selection");
            assert_ne!(sel.algorithm, Algorithm::TwoShotPush, "world {world} {count}");
        }
        drop(cs);
        assert_eq!(s.fake.used_bytes(), used, "world {world}: every byte freed with the communicators");
    }
}

fn push_ipc(s: &Setup) {
    let world = 3;
    let used = s.fake.used_bytes();
    let (gets, opens) = (s.fake.calls("cuIpcGetMemHandle"), s.fake.calls("cuIpcOpenMemHandle_v2"));
    let group = LocalGroup::new(world, Duration::from_secs(30));
    let count = 1024;
    let from = s.fake.launch_total();
    let outcomes = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let mut boot = group.member(rank);
                sc.spawn(move || -> Result<(Algorithm, Vec<f32>, Communicator<CudaComm>)> {
                    let id = anyccl_cuda::multi_process::broadcast_unique_id(&mut boot)?;
                    let selector = Arc::new(Selector::defaults());
                    let mut c = anyccl_cuda::multi_process::communicator_with_id(
                        &id,
                        rank,
                        world,
                        rank as i32,
                        &mut boot,
                        selector,
                    )?;
                    let (algorithm, sums) = reduce_once(&mut c, DataType::F32, count, 3, false)?;
                    Ok((algorithm, sums, c))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect::<Vec<_>>()
    });
    let mut comms = Vec::new();
    for (rank, o) in outcomes.into_iter().enumerate() {
        let (algorithm, sums, c) = o.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(c.backend().push_status().map(|p| p.0), Ok(256 << 10), "rank {rank}");
        assert_eq!(algorithm, Algorithm::OneShotPush, "rank {rank}");
        assert!(sums == reference(world, 3, count), "rank {rank}: wrong sums");
        comms.push(c);
    }
    let launched = check_push_launches(&s.fake, from, world, DataType::F32, count * 4, true);
    assert!(launched.iter().all(|l| l.completed == 1), "{launched:?}");
    // Each rank's own receive buffer is the one its peers mapped: the same allocation under another address.
    let n = world as i32;
    assert_eq!(s.fake.calls("cuIpcGetMemHandle") - gets, 4 * n, "staging, scratch, flags and push per rank");
    assert_eq!(s.fake.calls("cuIpcOpenMemHandle_v2") - opens, 4 * n * (n - 1));
    assert_eq!(s.fake.ipc_open_count(), 4 * n * (n - 1), "every mapping open while the communicators live");
    drop(comms);
    assert_eq!(s.fake.ipc_open_count(), 0, "every mapping closed with its communicator");
    assert_eq!(s.fake.used_bytes(), used, "every byte freed with the communicators");
}

fn push_sm80(s: &Setup) {
    let info = anyccl_cuda::available().expect("available");
    assert_eq!(info.devices[0].compute_capability, (8, 0));
    // The capability report says why there is no programmatic dependent launch.
    let caps = anyccl_cuda::capabilities(Some(&s.lib), &|_| None);
    let off = caps.require(Capabilities::DEPENDENT_LAUNCH).expect_err("off below sm_90").to_string();
    assert!(off.contains("compute capability 8.0"), "{off}");
    let mut cs = comms(s, 2);
    let (_, pdl) = cs[0].backend().push_status().expect("push on");
    let why = pdl.expect_err("no PDL below sm_90");
    assert!(why.contains("compute capability 8.0") && why.contains("sm_90"), "{why}");
    let ex = s.fake.calls("cuLaunchKernelEx");
    let from = s.fake.launch_total();
    let out = per_rank(&mut cs, |c| reduce_once(c, DataType::Bf16, 4096, 1, true));
    check_push_launches(&s.fake, from, 2, DataType::Bf16, 4096 * 2, false);
    assert_eq!(s.fake.calls("cuLaunchKernelEx"), ex, "plain cuLaunchKernel below sm_90");
    for (rank, r) in out.into_iter().enumerate() {
        let (algorithm, got) = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(algorithm, Algorithm::OneShotPush);
        assert!(got == reference(2, 1, 4096), "rank {rank}: wrong sums");
    }
}

fn push_off(s: &Setup) {
    let used = s.fake.used_bytes();
    // ANYCCL_PUSH_MAX_BYTES=0 (set by the parent): no receive buffer, push ineligible with the reason.
    let mut cs = comms(s, 2);
    let off = cs[0].backend().push_status().expect_err("off").to_owned();
    assert!(off.contains("ANYCCL_PUSH_MAX_BYTES is 0"), "{off}");
    let why = cs[0].check_algorithm(Algorithm::OneShotPush, &call(1024, DataType::F32)).expect_err("off");
    assert!(why.to_string().contains("ANYCCL_PUSH_MAX_BYTES is 0"), "{why}");
    let out = per_rank(&mut cs, |c| reduce_once(c, DataType::F32, 1024, 2, false));
    for r in out {
        let (algorithm, got) = r.expect("one-shot");
        assert_eq!(algorithm, Algorithm::OneShot);
        assert!(got == reference(2, 2, 1024));
    }
    drop(cs);
    assert_eq!(s.fake.used_bytes(), used);
}

fn launch_fail(s: &Setup) {
    let mut cs = comms(s, 2);
    let cases: [(Option<Algorithm>, Algorithm, &str, DataType); 4] = [
        (None, Algorithm::OneShotPush, "anyccl_push_one_shot_", DataType::F32),
        (Some(Algorithm::TwoShotPush), Algorithm::TwoShotPush, "anyccl_push_two_shot_", DataType::F32),
        (Some(Algorithm::TwoShotFp8), Algorithm::TwoShotFp8, "anyccl_quant_two_shot_fp8_", DataType::Bf16),
        (Some(Algorithm::TwoShotInt8), Algorithm::TwoShotInt8, "anyccl_quant_two_shot_int8_", DataType::Bf16),
    ];
    for (named, algorithm, prefix, dtype) in cases {
        let count = 1024;
        s.fake.fail_launches(prefix, 2);
        let before = s.fake.launch_total();
        let out = per_rank(&mut cs, |c| reduce_once_with(c, named, dtype, count, 1, true));
        s.fake.fail_launches("", 0);
        assert_eq!(s.fake.launch_total(), before, "{algorithm}: the failed launches ran nothing");
        for (rank, r) in out.into_iter().enumerate() {
            let e = r.expect_err("the launch failed");
            match &e {
                Error::Backend { call, code, .. } => {
                    assert_eq!(*code, Some(719), "rank {rank}: {e}");
                    assert!(call.starts_with(&format!("{algorithm} all-reduce: ")), "rank {rank}: {e}");
                }
                other => panic!("rank {rank}: {algorithm}: not the launch's failure: {other}"),
            }
            assert!(e.to_string().contains(&algorithm.to_string()), "rank {rank}: {e}");
            for other in [Algorithm::OneShot, Algorithm::TwoShot] {
                assert!(!e.to_string().contains(&format!("{other} all-reduce")), "rank {rank}: {e}");
            }
        }
        // Nothing was enqueued on any rank: the same call runs and sums right.
        let out = per_rank(&mut cs, |c| reduce_once_with(c, named, dtype, count, 1, true));
        for r in out {
            let (ran, got) = r.expect("the call after the failure");
            assert_eq!(ran, algorithm);
            let want = reference(2, 1, count);
            // The quantized two-shots are lossy: near the exact sums (at most 16 in magnitude here).
            let tolerance = if algorithm.is_lossy() { 2.5 } else { 0.0 };
            assert!(got.iter().zip(&want).all(|(g, w)| (g - w).abs() <= tolerance), "{algorithm}: {got:?}");
            let mean_error = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).sum::<f32>() / count as f32;
            assert!(mean_error <= tolerance / 4.0, "{algorithm}: mean error {mean_error}");
        }
    }
}

fn push_fail(s: &Setup) {
    let used = s.fake.used_bytes();
    let cs = comms(s, 2);
    assert!(cs[0].backend().push_status().is_ok());
    let with_push = s.fake.used_bytes() - used;
    drop(cs);
    assert_eq!(s.fake.used_bytes(), used);
    // A setup that fails half-way: rank 1's receive buffer cannot be initialised (its 4 MiB upload fails).
    s.fake.fail_copies(1, anyccl_kernels_cuda::push::PUSH_RECV_BYTES, 1);
    let mut cs = comms(s, 2);
    s.fake.fail_copies(1, 0, 0);
    for c in &cs {
        assert!(c.backend().custom_kernels_off().is_none(), "the custom kernels stay on");
        let off = c.backend().push_status().expect_err("push off").to_owned();
        assert!(off.contains("receive buffer"), "{off}");
    }
    // Rank 0's buffer, made before rank 1's failed, was freed with rank 1's: the communicators hold two receive
    // buffers less than with the push one-shot on.
    let without_push = s.fake.used_bytes() - used;
    // (The fake allocates whole 4 KiB pages.)
    let page_rounded = anyccl_kernels_cuda::push::PUSH_RECV_BYTES.next_multiple_of(4096);
    assert_eq!(with_push - without_push, 2 * page_rounded, "no receive buffer left behind");
    let out = per_rank(&mut cs, |c| reduce_once(c, DataType::F32, 1024, 4, true));
    for r in out {
        let (algorithm, got) = r.expect("one-shot");
        assert_eq!(algorithm, Algorithm::OneShot);
        assert!(got == reference(2, 4, 1024));
    }
    drop(cs);
    assert_eq!(s.fake.used_bytes(), used, "every byte freed with the communicators");
}
