//! The ROCm communicator's custom kernels on the fake HIP runtime, which records every kernel launch (name, grid,
//! decoded parameters) and runs the kernels (their source compiled for the host) on its host-backed memory: selection,
//! the kernels launched, their results, graph capture with graph buffers, the abort word, one process per GPU as
//! threads over HIP IPC, and the one-host check before any IPC. No GPU needed.
//!
//! The fake runtime keeps one process-wide record, so the tests take a lock and run one at a time.

use anyccl_testkit::fake_ccl;
use anyccl_testkit::fake_hip;

use std::ffi::{c_void, CStr};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use anyccl_ccl::CclLibrary;
use anyccl_core::{Algorithm, Communicator, DataType, InOut, MemoryRuntime, ReduceOp, Result, Selector};
use anyccl_gpu::multi_process as gpu_multi_process;
use anyccl_rocm::{Hip, HipDevice, HipGraph, HipLibrary, HipStream, RocmComm};
use anyccl_testkit::gpu_suite::{self, catalogue_kernel, decode, input, per_rank, reference, Family, Harness};
use fake_hip::{FakeHip, Launch};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

struct Setup {
    hip: Arc<HipLibrary>,
    rccl: Arc<CclLibrary>,
    fake: FakeHip,
}

fn lookup(path: &Path) -> impl FnMut(&CStr) -> *const c_void {
    // SAFETY: the fake libraries built for this test; their initialisers do nothing. Leaked so the code stays
    // mapped for the process, as the loaders do.
    let lib: &'static libloading::Library =
        Box::leak(Box::new(unsafe { libloading::Library::new(path) }.expect("open fake library")));
    move |name: &CStr| {
        // SAFETY: a symbol lookup only reads the dynamic symbol table.
        unsafe { lib.get::<*const c_void>(name.to_bytes_with_nul()) }.map(|s| *s).unwrap_or(std::ptr::null())
    }
}

fn setup() -> Setup {
    let hip_path = fake_hip::build_hip();
    let rccl_path = fake_hip::build_rccl(&fake_ccl::RCCL_7_1);
    let hip = HipLibrary::load_with(&hip_path, &mut lookup(&hip_path)).expect("fake HIP loads");
    let rccl = CclLibrary::load_with(&rccl_path, &mut lookup(&rccl_path)).expect("fake RCCL loads");
    let fake = FakeHip::open(&hip_path);
    fake.reset();
    Setup { hip: Arc::new(hip), rccl: Arc::new(rccl), fake }
}

fn no_env(_: &str) -> Option<String> {
    None
}

fn devices(s: &Setup, world: usize) -> Vec<Arc<HipDevice>> {
    (0..world as i32).map(|o| HipDevice::new(s.hip.clone(), o).expect("fake device")).collect()
}

impl Harness for Setup {
    type P = Hip;
    type Graph = HipGraph;
    const WRITE_VALUE: &'static str = "hipStreamWriteValue32";
    const ABORT_WORD_OFFSET: usize = anyccl_kernels_hip::ABORT_WORD_OFFSET;
    const IPC_GET: &'static str = "hipIpcGetMemHandle";
    const IPC_OPEN: &'static str = "hipIpcOpenMemHandle";
    const IPC_CLOSE: &'static str = "hipIpcCloseMemHandle";
    const MODULE_LOAD: &'static str = "hipModuleLoadData";
    const SMALL: Algorithm = Algorithm::OneShot;

    fn lib(&self) -> &Arc<CclLibrary> {
        &self.rccl
    }

    fn device(&self, ordinal: i32) -> Arc<HipDevice> {
        HipDevice::new(self.hip.clone(), ordinal).expect("fake device")
    }

    fn caps(&self) -> anyccl_core::CapabilityReport {
        anyccl_rocm::capabilities(Ok(&self.hip), Some(&self.rccl), &no_env)
    }

    fn fake(&self) -> &FakeHip {
        &self.fake
    }

    fn comms(&self, world: usize) -> Vec<Communicator<RocmComm>> {
        comms(self, world)
    }

    fn join(
        &self,
        boot: &mut dyn anyccl_core::Bootstrap,
        _rank: usize,
        world: usize,
        env: Option<gpu_suite::Env<'_>>,
    ) -> Result<Communicator<RocmComm>> {
        let one_host = |k: &str| (k == "ANYCCL_HOST_ID").then(|| "node-a".to_owned());
        join_rank(self, boot, world, env.unwrap_or(&one_host))
    }

    fn capture(
        _: &anyccl_rocm::HipRuntime,
        stream: &HipStream,
        mode: anyccl_core::CaptureMode,
        f: &mut dyn FnMut(&HipStream) -> Result<()>,
    ) -> Result<HipGraph> {
        HipGraph::capture_with(stream, mode, f)
    }

    fn replay(graph: &HipGraph, stream: &HipStream) -> Result<()> {
        graph.launch(stream)
    }

    fn raw(stream: &HipStream) -> *mut c_void {
        stream.raw()
    }
}

/// One process, `world` ranks (`ncclCommInitAll`), custom kernels set up over peer access.
fn comms(s: &Setup, world: usize) -> Vec<Communicator<RocmComm>> {
    let caps = Arc::new(anyccl_rocm::capabilities(Ok(&s.hip), Some(&s.rccl), &no_env));
    let selector = Arc::new(Selector::defaults());
    RocmComm::init_all(s.rccl.clone(), &devices(s, world), caps)
        .expect("communicators")
        .into_iter()
        .map(|c| Communicator::new(c, selector.clone()))
        .collect()
}

/// ROCm `init_all` at worlds 2 and 4: the push one-shot is not offered and says why; then the generic case
/// (`gpu_suite::init_all`) with the algorithms AMD's default table picks; nothing breaks HIP's capture rules.
#[test]
fn init_all_launches_the_selected_hip_kernel_with_its_grid_and_sums_right() {
    let _g = serial();
    let s = setup();
    for world in [2usize, 4] {
        let cs = comms(&s, world);
        // The push one-shot is not offered on ROCm (no receive buffer is allocated), and says why.
        let push = cs[0].backend().push_status().expect_err("no push one-shot on ROCm");
        assert!(push.contains("ROCm backend does not offer it"), "{push}");
    }
    assert!(!anyccl_rocm::platform::ALGORITHMS.contains(&Algorithm::OneShotPush));
    assert!(!anyccl_rocm::platform::ALGORITHMS.contains(&Algorithm::TwoShotPush));
    // The algorithm AMD's default table picks: one-shot at 4 KiB, and at 1 MiB one-shot at world 2, else two-shot.
    let table = |world: usize, bytes: usize| {
        Some(if bytes <= 4096 || world == 2 { Algorithm::OneShot } else { Algorithm::TwoShot })
    };
    gpu_suite::init_all(&s, table);
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// Graph capture on ROCm, the generic case (`gpu_suite::graphs`): one-shot at world 2, two-shot at world 4 (AMD's
/// default table), and nothing breaks HIP's capture rules.
#[test]
fn captured_all_reduces_read_registered_inputs_after_register_graph_buffers() {
    let _g = serial();
    let s = setup();
    gpu_suite::graphs(&s, |world, _| Some(if world == 2 { Algorithm::OneShot } else { Algorithm::TwoShot }));
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// A registration whose table write fails on one rank fails on every rank alike: the generic case
/// (`gpu_suite::table_write_failure`); nothing breaks HIP's capture rules.
#[test]
fn a_table_write_failing_on_one_rank_fails_registration_on_every_rank() {
    let _g = serial();
    let s = setup();
    gpu_suite::table_write_failure(&s);
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// The generic abort-word case (`gpu_suite::abort`) on ROCm (the word written by `hipStreamWriteValue32` on the
/// communicator's control stream), and nothing breaks HIP's capture rules.
#[test]
fn a_failed_wait_writes_the_abort_word() {
    let _g = serial();
    let s = setup();
    gpu_suite::abort(&s);
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// What one rank of a one-process-per-GPU job does, with the environment `env`: the unique id from rank 0
/// through `boot`, then `join` (RCCL, then the custom kernels over HIP IPC through the same bootstrap).
fn join_rank(
    s: &Setup,
    boot: &mut dyn anyccl_core::Bootstrap,
    world: usize,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Communicator<RocmComm>> {
    let rank = boot.rank();
    let id = gpu_multi_process::share_unique_id::<Hip>(boot, Some(&s.rccl))?;
    let dev = HipDevice::new(s.hip.clone(), rank as i32)?;
    let selector = Arc::new(Selector::defaults());
    gpu_multi_process::join::<Hip>(s.rccl.clone(), &id, rank, world, dev, boot, selector, env)
}

/// One process per GPU, simulated as threads over an in-process bootstrap: the generic case (`gpu_suite::ipc_threads`)
/// through the generic bootstrap over HIP IPC; nothing breaks HIP's capture rules.
#[test]
fn one_process_per_gpu_as_threads_sets_up_hip_ipc_and_registers_graph_buffers() {
    let _g = serial();
    let s = setup();
    gpu_suite::ipc_threads(&s);
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// Ranks that report different hosts turn the custom kernels off with the reason before any IPC, and RCCL serves
/// the call: the generic case (`gpu_suite::two_hosts`).
#[test]
fn ranks_on_two_hosts_turn_the_kernels_off_before_any_ipc() {
    let _g = serial();
    let s = setup();
    gpu_suite::two_hosts(&s);
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// An engine's own stream, borrowed (`HipStream::from_raw`): collectives run on it, a capture on it is known to
/// the capture rules (allocation refused before HIP sees it), and dropping the wrapper leaves the stream alive.
#[test]
fn a_borrowed_engine_stream_runs_collectives_and_stays_the_engines() {
    let _g = serial();
    let s = setup();
    let mut cs = comms(&s, 2);
    let raws = per_rank(&mut cs, |c| -> Result<Vec<f32>> {
        let dev = c.runtime().device().clone();
        let lib = dev.library().clone();
        dev.bind()?;
        let mut raw: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one stream handle (the engine's).
        assert_eq!(unsafe { (lib.table().stream_create_with_flags)(&mut raw, 1) }, 0);
        let rt = c.runtime().clone();
        let mut b = rt.alloc(4096)?;
        let out = {
            // SAFETY: `raw` is a live stream of this device and outlives the wrapper (destroyed below).
            let st = unsafe { HipStream::from_raw(raw, &dev) };
            rt.upload(&mut b, &input(DataType::F32, c.rank(), 0, 1024), &st)?;
            let sel = c.all_reduce(InOut::InPlace(&mut b), 1024, DataType::F32, ReduceOp::Sum, &st)?;
            assert_eq!(sel.algorithm, Algorithm::OneShot);
            let _graph = HipGraph::capture(&st, |_| {
                let refused = rt.alloc(64).expect_err("allocation refused during the capture");
                assert!(refused.to_string().contains("capture"), "{refused}");
                Ok(())
            })?;
            let mut host = vec![0u8; 4096];
            rt.download(&b, &mut host, &st)?;
            decode(DataType::F32, &host)
        };
        // SAFETY: the engine's stream, still alive after the wrapper dropped; destroyed once.
        assert_eq!(unsafe { (lib.table().stream_destroy)(raw) }, 0, "the wrapper did not destroy it");
        Ok(out)
    });
    for (rank, r) in raws.into_iter().enumerate() {
        assert!(r.expect("rank") == reference(2, 0, 1024), "rank {rank}");
    }
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// The custom kernels' IPC setup under HIP's capture rules: called while the engine captures in global mode, it
/// is refused before HIP sees anything (no allocation, module load or IPC call, no violation, the capture stays
/// valid), every rank alike; after the capture the same setup succeeds and the HIP kernel runs.
#[test]
fn ipc_setup_during_a_capture_is_refused_before_hip_and_works_after_it() {
    let _g = serial();
    let s = setup();
    gpu_suite::ipc_during_capture(&s);
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// Sub-communicators of a one-process-per-GPU job (threads here): `split(rank % 2)` makes two of two ranks, each
/// with its own custom-kernel state set up over HIP IPC through the sub-communicator itself, so an all-reduce on
/// it runs the HIP one-shot over its two ranks and sums only theirs; a grouped ring of sends and receives on the
/// parent (each rank receives before it sends in its list) completes. On a single-process parent the sub's
/// kernels are off with the reason.
#[test]
fn split_sub_communicators_set_up_their_own_kernels_and_p2p_groups_complete() {
    let _g = serial();
    let s = setup();
    gpu_suite::split(&s);
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

mod fused_quant;
