//! The ROCm backend against the fake HIP runtime and computing fake RCCL libraries for ROCm 6.2, 7.0 and 7.1
//! (anyccl-testkit): capability reports, communicator creation, all-reduce eager and inside a HIP graph capture,
//! zero capture violations, no symbol lookup after load, and conformance of every collective. No GPU needed.
//!
//! The fake runtime keeps one process-wide record of calls and violations, so the tests take a lock and run one
//! at a time.

use anyccl_testkit::fake_ccl;
use anyccl_testkit::fake_hip;

use std::ffi::{c_void, CStr};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use anyccl_ccl::CclLibrary;
use anyccl_core::conformance::{self, Config, ConformanceTarget};
use anyccl_core::{
    Algorithm, Capabilities, CapabilityState, Communicator, DataType, Error, InOut, InvalidArgument, MemoryRuntime,
    ReduceOp, Result, Selector,
};
use anyccl_rocm::{HipDevice, HipGraph, HipLibrary, HipStream, RocmComm};
use fake_ccl::{Profile, RCCL_6_2, RCCL_7_0, RCCL_7_1};
use fake_hip::FakeHip;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Both libraries loaded through counting lookups, and the fake runtime's test interface.
struct Setup {
    hip: Arc<HipLibrary>,
    rccl: Arc<CclLibrary>,
    fake: FakeHip,
    lookups: Arc<AtomicUsize>,
    rccl_path: std::path::PathBuf,
}

fn counting(path: &Path, lookups: &Arc<AtomicUsize>) -> impl FnMut(&CStr) -> *const c_void {
    // SAFETY: the fake libraries built for this test; their initialisers do nothing. Leaked so the code stays
    // mapped for the process, as the loaders do.
    let lib: &'static libloading::Library =
        Box::leak(Box::new(unsafe { libloading::Library::new(path) }.expect("open fake library")));
    let lookups = lookups.clone();
    move |name: &CStr| {
        lookups.fetch_add(1, Ordering::SeqCst);
        // SAFETY: a symbol lookup only reads the dynamic symbol table.
        unsafe { lib.get::<*const c_void>(name.to_bytes_with_nul()) }.map(|s| *s).unwrap_or(std::ptr::null())
    }
}

fn setup(p: &Profile) -> Setup {
    let hip_path = fake_hip::build_hip();
    let rccl_path = fake_hip::build_rccl(p);
    let lookups = Arc::new(AtomicUsize::new(0));
    let hip = HipLibrary::load_with(&hip_path, &mut counting(&hip_path, &lookups)).expect("fake HIP loads");
    let rccl = CclLibrary::load_with(&rccl_path, &mut counting(&rccl_path, &lookups)).expect("fake RCCL loads");
    let fake = FakeHip::open(&hip_path);
    fake.reset();
    Setup { hip: Arc::new(hip), rccl: Arc::new(rccl), fake, lookups, rccl_path }
}

fn env_with_cumem(on: bool) -> impl Fn(&str) -> Option<String> {
    move |k: &str| (on && k == "NCCL_CUMEM_ENABLE").then(|| "1".to_owned())
}

fn comms(s: &Setup, world: usize, cumem: bool) -> Vec<Communicator<RocmComm>> {
    let caps = Arc::new(anyccl_rocm::capabilities(Ok(&s.hip), Some(&s.rccl), &env_with_cumem(cumem)));
    let devices: Vec<Arc<HipDevice>> =
        (0..world as i32).map(|o| HipDevice::new(s.hip.clone(), o).expect("fake device")).collect();
    let selector = Arc::new(Selector::defaults());
    RocmComm::init_all(s.rccl.clone(), &devices, caps)
        .expect("communicators")
        .into_iter()
        .map(|c| Communicator::new(c, selector.clone()))
        .collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32_from(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[test]
fn each_rccl_release_reports_symmetric_windows_with_the_reason() {
    let _g = serial();
    for (p, label) in [(&RCCL_6_2, "RCCL 2.20.5"), (&RCCL_7_0, "RCCL 2.26.6"), (&RCCL_7_1, "RCCL 2.27.7")] {
        let s = setup(p);
        assert_eq!(s.rccl.describe(), label);
        for cumem in [false, true] {
            let caps = anyccl_rocm::capabilities(Ok(&s.hip), Some(&s.rccl), &env_with_cumem(cumem));
            assert!(
                caps.has(Capabilities::HIP_RUNTIME)
                    && caps.has(Capabilities::CCL)
                    && caps.has(Capabilities::GRAPH_CAPTURE)
            );
            let win = caps.state(Capabilities::SYMMETRIC_WINDOWS);
            match (p.version, cumem) {
                (22707, true) => assert_eq!(*win, CapabilityState::Enabled, "7.1 with cuMem on"),
                (22707, false) => {
                    let why = caps.require(Capabilities::SYMMETRIC_WINDOWS).expect_err("off").to_string();
                    assert!(why.contains("NCCL_CUMEM_ENABLE"), "{why}");
                }
                _ => {
                    // 6.2 and 7.0: the symbol is missing; the reason names it, the file and the release.
                    let why = caps.require(Capabilities::SYMMETRIC_WINDOWS).expect_err("off").to_string();
                    assert!(why.contains("ncclCommWindowRegister"), "{why}");
                    assert!(why.contains(&s.rccl.path().display().to_string()), "{why}");
                    assert!(why.contains(label), "{why}");
                }
            }
            // Built in, the custom kernels are on (each communicator checks its devices' targets); not built, the
            // reason names the HIP kernels.
            match anyccl_kernels_hip::NOT_BUILT {
                None => assert_eq!(*caps.state(Capabilities::CUSTOM_KERNELS), CapabilityState::Enabled),
                Some(_) => {
                    let kernels = caps.require(Capabilities::CUSTOM_KERNELS).expect_err("not built").to_string();
                    assert!(kernels.contains("HIP"), "{kernels}");
                }
            }
            assert!(caps.require(Capabilities::MULTICAST).is_err());
        }
        assert!(s.rccl_path.ends_with(p.file));
    }
}

/// Runs `f` on one thread per rank (the fake RCCL blocks a rank until its peers reach the same collective).
fn per_rank<T: Send>(
    comms: &mut [Communicator<RocmComm>],
    f: impl Fn(&mut Communicator<RocmComm>) -> T + Sync,
) -> Vec<T> {
    std::thread::scope(|sc| {
        let hs: Vec<_> = comms.iter_mut().map(|c| sc.spawn(|| f(c))).collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

/// One rank's eager result, its results after the first and second graph replay, and the algorithm chosen.
type RankOutcome = (Vec<f32>, Vec<f32>, Vec<f32>, Algorithm);

#[test]
fn all_reduce_eager_and_in_a_graph_capture_on_every_release() {
    let _g = serial();
    const N: usize = 1037;
    for p in [&RCCL_6_2, &RCCL_7_0, &RCCL_7_1] {
        for world in [1usize, 2, 3] {
            let s = setup(p);
            let mut cs = comms(&s, world, true);
            let loaded = s.lookups.load(Ordering::SeqCst);
            let input = |rank: usize, round: usize| -> Vec<f32> {
                (0..N).map(|i| ((i * 7 + rank * 13 + round * 5) % 17) as f32 - 8.0).collect()
            };
            let expect =
                |round: usize| -> Vec<f32> { (0..N).map(|i| (0..world).map(|r| input(r, round)[i]).sum()).collect() };
            let results = per_rank(&mut cs, |c| -> Result<RankOutcome> {
                let rank = c.rank();
                let rt = c.runtime().clone();
                let stream = rt.stream()?;
                let mut buf = rt.alloc(N * 4)?;
                // Eager.
                rt.upload(&mut buf, &f32_bytes(&input(rank, 0)), &stream)?;
                c.all_reduce(InOut::InPlace(&mut buf), N, DataType::F32, ReduceOp::Sum, &stream)?;
                let mut out = vec![0u8; N * 4];
                rt.download(&buf, &mut out, &stream)?;
                let eager = f32_from(&out);
                // Captured: nothing runs until the graph is launched.
                rt.upload(&mut buf, &f32_bytes(&input(rank, 1)), &stream)?;
                let mut chosen = Algorithm::Ccl;
                let graph = HipGraph::capture(&stream, |st| {
                    chosen = c.all_reduce(InOut::InPlace(&mut buf), N, DataType::F32, ReduceOp::Sum, st)?.algorithm;
                    Ok(())
                })?;
                rt.download(&buf, &mut out, &stream)?;
                assert_eq!(f32_from(&out), input(rank, 1), "capture must not run the all-reduce");
                graph.launch(&stream)?;
                stream.synchronize()?;
                rt.download(&buf, &mut out, &stream)?;
                let replay1 = f32_from(&out);
                // A second replay reduces the first one's results.
                graph.launch(&stream)?;
                stream.synchronize()?;
                rt.download(&buf, &mut out, &stream)?;
                Ok((eager, replay1, f32_from(&out), chosen))
            });
            for (rank, r) in results.into_iter().enumerate() {
                let (eager, replay1, replay2, chosen) = r.unwrap_or_else(|e| panic!("{} world {world}: {e}", p.file));
                assert_eq!(eager, expect(0), "{} world {world} rank {rank}: eager", p.file);
                assert_eq!(replay1, expect(1), "{} world {world} rank {rank}: first replay", p.file);
                let twice: Vec<f32> = expect(1).iter().map(|v| v * world as f32).collect();
                assert_eq!(replay2, twice, "{} world {world} rank {rank}: second replay", p.file);
                assert_eq!(chosen, Algorithm::Ccl, "plain buffers take RCCL's own path");
            }
            assert_eq!(s.fake.violations(), Vec::<String>::new(), "{} world {world}: capture violations", p.file);
            assert_eq!(s.lookups.load(Ordering::SeqCst), loaded, "{}: a symbol was looked up after load", p.file);
            assert!(s.fake.calls("hipStreamBeginCapture") >= world as i32);
        }
    }
}

#[test]
fn symmetric_buffers_on_7_1_register_before_capture_and_are_refused_during_it() {
    let _g = serial();
    let s = setup(&RCCL_7_1);
    let mut cs = comms(&s, 2, true);
    const N: usize = 4096;
    let results = per_rank(&mut cs, |c| -> Result<Vec<f32>> {
        let rt = c.runtime().clone();
        let stream = rt.stream()?;
        let mut sym = c.backend().symmetric_buffer(N * 4, &stream)?;
        rt.upload(sym.buffer_mut(), &f32_bytes(&vec![c.rank() as f32 + 1.0; N]), &stream)?;
        let mut refused = Vec::new();
        let mut chosen = Algorithm::Ccl;
        let graph = HipGraph::capture(&stream, |st| {
            // Everything that allocates or registers is refused before it reaches HIP or RCCL.
            refused.push(c.backend().symmetric_buffer(N * 4, st).err().map(|e| e.to_string()));
            refused.push(rt.alloc(64).err().map(|e| e.to_string()));
            refused.push(rt.upload(sym.buffer_mut(), &[0u8; 4], st).err().map(|e| e.to_string()));
            // Forced: an ineligible forced algorithm would be an error, so this proves the window is seen.
            c.all_reduce_with(
                Algorithm::CclSymmetric,
                InOut::InPlace(sym.buffer_mut()),
                N,
                DataType::F32,
                ReduceOp::Sum,
                st,
            )?;
            chosen = Algorithm::CclSymmetric;
            Ok(())
        })?;
        for r in &refused {
            let why = r.as_deref().expect("refused during capture");
            assert!(why.contains("capture"), "{why}");
        }
        assert_eq!(chosen, Algorithm::CclSymmetric);
        graph.launch(&stream)?;
        stream.synchronize()?;
        let mut out = vec![0u8; N * 4];
        rt.download(sym.buffer(), &mut out, &stream)?;
        Ok(f32_from(&out))
    });
    for r in results {
        assert_eq!(r.expect("rank"), vec![3.0f32; N]);
    }
    assert_eq!(s.fake.violations(), Vec::<String>::new());
    assert!(s.fake.calls("hipMalloc") >= 2, "ncclMemAlloc fell back to hipMalloc outside the capture");
}

/// Found in review: `symmetric_buffer(usize::MAX)` returned `Ok` with a view of 2^64 - 1 bytes at address 0 (the
/// 4 KiB round-up wrapped to 0 and `ncclMemAlloc(0)` succeeded). Sizes are now bounded before the library sees
/// them, and what the allocator returns must be non-null and span the size as the runtime reports it.
#[test]
fn a_symmetric_buffer_claims_only_memory_the_runtime_really_returned() {
    let _g = serial();
    let s = setup(&RCCL_7_1);
    let cs = comms(&s, 1, true);
    let c = &cs[0];
    let stream = c.runtime().stream().expect("stream");
    for bytes in [usize::MAX, usize::MAX - 4095, isize::MAX as usize + 1] {
        let before = s.fake.calls("hipMalloc");
        let err = c.backend().symmetric_buffer(bytes, &stream).err().expect("a size that cannot be allocated");
        assert!(
            matches!(&err, Error::InvalidArgument(InvalidArgument::SizeTooLarge { requested, .. }) if *requested == bytes as u64),
            "{err:?}"
        );
        assert_eq!(s.fake.calls("hipMalloc"), before, "{bytes} bytes reached the allocator");
    }

    s.fake.next_malloc_null();
    let err = c.backend().symmetric_buffer(4096, &stream).err().expect("a null allocation is refused");
    assert!(err.to_string().contains("ncclMemAlloc") && err.to_string().contains("null address"), "{err}");

    s.fake.set_range_shrink(4096);
    let frees = s.fake.calls("hipFree");
    let err = c.backend().symmetric_buffer(8192, &stream).err().expect("an allocation shorter than asked is refused");
    assert!(err.to_string().contains("the runtime reports the allocation there as 4096 bytes"), "{err}");
    assert_eq!(s.fake.calls("hipFree"), frees + 1, "the refused allocation is freed once");
    s.fake.set_range_shrink(0);

    // Nothing was lost: a real buffer of the same size works afterwards.
    let sym = c.backend().symmetric_buffer(8192, &stream).expect("a real symmetric buffer");
    assert_eq!(anyccl_core::runtime::BufferLike::desc(sym.buffer()).len, 8192);
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

#[test]
fn on_7_0_a_symmetric_buffer_is_refused_with_the_reason_and_auto_still_captures() {
    let _g = serial();
    let s = setup(&RCCL_7_0);
    let mut cs = comms(&s, 2, true);
    let results = per_rank(&mut cs, |c| -> Result<String> {
        let rt = c.runtime().clone();
        let stream = rt.stream()?;
        let err = c.backend().symmetric_buffer(4096, &stream).err().map(|e| e.to_string()).unwrap_or_default();
        let mut buf = rt.alloc(64)?;
        let _g = HipGraph::capture(&stream, |st| {
            c.all_reduce(InOut::InPlace(&mut buf), 16, DataType::F32, ReduceOp::Sum, st).map(|_| ())
        })?;
        Ok(err)
    });
    for r in results {
        let why = r.expect("rank");
        assert!(why.contains("ncclCommWindowRegister") && why.contains("RCCL 2.26.6"), "{why}");
    }
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

#[test]
fn the_fake_runtime_enforces_the_capture_rules() {
    let _g = serial();
    let s = setup(&RCCL_7_1);
    let dev = HipDevice::new(s.hip.clone(), 0).expect("device");
    let stream = HipStream::new(&dev).expect("stream");
    // A raw hipMalloc on the capturing thread is illegal: 900, recorded, and the capture is invalidated.
    let r = HipGraph::capture(&stream, |_| {
        assert_eq!(s.fake.raw_malloc(64), 900);
        Ok(())
    });
    let err = r.err().expect("invalidated capture").to_string();
    assert!(err.contains("hipErrorStreamCaptureInvalidated"), "{err}");
    let v = s.fake.violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert!(v[0].starts_with("hipMalloc"), "{v:?}");
    // Synchronising a capturing stream is refused by anyccl before HIP sees it.
    s.fake.reset();
    let r = HipGraph::capture(&stream, |st| st.synchronize());
    assert!(r.err().expect("refused").to_string().contains("capture"));
    assert_eq!(s.fake.violations(), Vec::<String>::new());
    // And the stream is usable afterwards.
    let g = HipGraph::capture(&stream, |_| Ok(())).expect("an empty capture");
    g.launch(&stream).expect("launch");
}

struct FakeRocm {
    s: Setup,
}

impl ConformanceTarget for FakeRocm {
    type Backend = RocmComm;

    fn name(&self) -> String {
        format!("rocm on the fake {}", self.s.rccl.describe())
    }

    fn create(&self, world: usize) -> Result<Vec<Communicator<RocmComm>>> {
        Ok(comms(&self.s, world, true))
    }

    fn stream(&self, comm: &Communicator<RocmComm>) -> Result<HipStream> {
        comm.runtime().stream()
    }
}

#[test]
fn conformance_of_every_collective_on_the_fake_rccl_7_1() {
    let _g = serial();
    let target = FakeRocm { s: setup(&RCCL_7_1) };
    // fp8 is left out: the fake RCCL does not compute it (it refuses it with ncclInvalidArgument).
    let dtypes: Vec<DataType> =
        DataType::ALL.iter().copied().filter(|d| !matches!(d, DataType::Fp8E4M3 | DataType::Fp8E5M2)).collect();
    let cfg = Config { worlds: vec![1, 2, 3, 4], dtypes, ..Config::default() };
    let summary = conformance::run(&target, &cfg);
    eprintln!("fake RCCL 7.1 conformance: {} checks, {} expected errors", summary.checks, summary.expected_errors);
    summary.assert_ok();
    assert_eq!(target.s.fake.violations(), Vec::<String>::new());
}

/// The real HIP runtime from Debian's `libamdhip64-5` (CI installs it with hipcc; set `ANYCCL_TEST_REAL_HIP` to
/// its path): every symbol anyccl needs resolves, and with no AMD GPU the backend reports why it is off instead
/// of crashing.
#[test]
#[ignore = "needs a real libamdhip64: run with ANYCCL_TEST_REAL_HIP=/path/to/libamdhip64.so.5 and --ignored"]
fn the_real_hip_runtime_loads_and_says_why_there_is_no_device() {
    let path = std::env::var_os("ANYCCL_TEST_REAL_HIP").expect("ANYCCL_TEST_REAL_HIP names the real libamdhip64");
    let lib = HipLibrary::open(Path::new(&path)).unwrap_or_else(|e| panic!("the real HIP runtime loads: {e}"));
    assert!(lib.describe().starts_with("HIP "), "{}", lib.describe());
    let caps = anyccl_rocm::capabilities(Ok(&lib), None, &|_| None);
    let count = anyccl_rocm::runtime::device_count(&lib);
    if !Path::new("/dev/kfd").exists() {
        // No AMD kernel driver (CI): HIP itself must say there is no device.
        assert!(count.is_err(), "devices without /dev/kfd: {count:?}");
    }
    // The report agrees with what HIP says, with HIP's reason where it is off.
    match count {
        Ok(n) if n > 0 => assert!(caps.has(Capabilities::HIP_RUNTIME), "{n} devices but the runtime is off"),
        Ok(_) => {
            let why = caps.require(Capabilities::HIP_RUNTIME).expect_err("no devices").to_string();
            assert!(why.contains("no HIP devices"), "{why}");
        }
        Err(e) => {
            let why = caps.require(Capabilities::HIP_RUNTIME).expect_err("no device").to_string();
            assert!(why.contains("hipGetDeviceCount") && why.contains(&e.to_string()), "{why}");
            assert!(caps.require(Capabilities::GRAPH_CAPTURE).is_err());
            eprintln!("{}: {why}", lib.describe());
        }
    }
}

#[test]
fn a_wait_on_work_that_never_finishes_times_out_and_aborts_instead_of_hanging() {
    let _g = serial();
    let s = setup(&RCCL_7_1);
    // SAFETY: the fake RCCL built for this test; it exports these test hooks with these C signatures.
    let rccl = unsafe { libloading::Library::new(&s.rccl_path) }.expect("fake RCCL");
    // SAFETY: as above.
    let (set_async_error, aborted_count) = unsafe {
        (
            *rccl.get::<unsafe extern "C" fn(i32)>(b"fakerccl_set_async_error\0").expect("hook"),
            *rccl.get::<unsafe extern "C" fn() -> i32>(b"fakerccl_aborted\0").expect("hook"),
        )
    };
    // SAFETY: the hook only reads an int.
    let aborted = || unsafe { aborted_count() };
    let mut cs = comms(&s, 2, false);
    let n = 256;
    // Finished work: every rank's wait returns at once.
    let ok = per_rank(&mut cs, |c| -> Result<()> {
        let rt = c.runtime().clone();
        let st = rt.stream()?;
        let mut b = rt.alloc(n * 4)?;
        rt.upload(&mut b, &f32_bytes(&vec![1.0; n]), &st)?;
        c.all_reduce(InOut::InPlace(&mut b), n, DataType::F32, ReduceOp::Sum, &st)?;
        c.wait(&st, std::time::Duration::from_secs(5))
    });
    assert!(ok.iter().all(|r| r.is_ok()), "{ok:?}");

    // Rank 0's queued work never finishes (a peer died): a timeout within the limit, RCCL aborted.
    let before = aborted();
    let rt0 = cs[0].runtime().clone();
    let st0 = rt0.stream().expect("stream");
    s.fake.set_busy(st0.raw(), true);
    let start = std::time::Instant::now();
    let e = cs[0].wait(&st0, std::time::Duration::from_millis(200)).expect_err("times out");
    s.fake.set_busy(st0.raw(), false);
    assert!(start.elapsed() < std::time::Duration::from_secs(10), "{:?}", start.elapsed());
    assert!(matches!(e, anyccl_core::Error::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("the communicator was aborted"), "{e}");
    assert_eq!(aborted(), before + 1, "ncclCommAbort ran once");
    // Later calls on rank 0 fail instead of touching the freed communicator.
    let mut b = rt0.alloc(n * 4).expect("alloc");
    let later = cs[0].all_reduce(InOut::InPlace(&mut b), n, DataType::F32, ReduceOp::Sum, &st0).expect_err("aborted");
    assert!(later.to_string().contains("aborted"), "{later}");

    // Rank 1: the library reports an asynchronous error while its work is pending.
    let rt1 = cs[1].runtime().clone();
    let st1 = rt1.stream().expect("stream");
    s.fake.set_busy(st1.raw(), true);
    // SAFETY: the hook only sets an int.
    unsafe { set_async_error(1) };
    let e = cs[1].wait(&st1, std::time::Duration::from_secs(30)).expect_err("library error");
    // SAFETY: as above.
    unsafe { set_async_error(0) };
    s.fake.set_busy(st1.raw(), false);
    assert!(matches!(e, anyccl_core::Error::PeerFailure(_)), "{e}");
    assert!(e.to_string().contains("unhandled cuda error (fake RCCL)"), "{e}");
    assert_eq!(aborted(), before + 2);

    // A capturing stream is refused before anything is queried: no capture violation.
    let mut refused = None;
    let g = HipGraph::capture(&st1, |st| {
        refused = Some(cs[1].wait(st, std::time::Duration::from_secs(1)));
        Ok(())
    });
    assert!(g.is_ok(), "the capture itself stays valid");
    let refused = refused.expect("ran").expect_err("refused during capture");
    assert_eq!(refused, Error::InvalidArgument(InvalidArgument::DuringCapture { what: "Communicator::wait" }));
    assert!(s.fake.violations().is_empty(), "{:?}", s.fake.violations());
    drop(cs);
}

#[test]
fn query_polls_without_aborting_and_reports_a_library_error() {
    let _g = serial();
    let s = setup(&RCCL_7_1);
    // SAFETY: the fake RCCL built for this test; it exports these test hooks with these C signatures.
    let rccl = unsafe { libloading::Library::new(&s.rccl_path) }.expect("fake RCCL");
    // SAFETY: as above.
    let (set_async_error, aborted_count) = unsafe {
        (
            *rccl.get::<unsafe extern "C" fn(i32)>(b"fakerccl_set_async_error\0").expect("hook"),
            *rccl.get::<unsafe extern "C" fn() -> i32>(b"fakerccl_aborted\0").expect("hook"),
        )
    };
    let mut cs = comms(&s, 1, false);
    let c = &mut cs[0];
    let rt = c.runtime().clone();
    let st = rt.stream().expect("stream");
    // SAFETY: the hook only reads an int.
    let before = unsafe { aborted_count() };
    assert!(c.query(&st).expect("idle"), "an idle stream is done");
    s.fake.set_busy(st.raw(), true);
    assert!(!c.query(&st).expect("busy"), "a busy stream is not done");
    assert!(!c.query(&st).expect("busy again"), "asking again changes nothing");
    // A library error while the work runs is an error, but the communicator is not aborted.
    // SAFETY: the hook only sets an int.
    unsafe { set_async_error(1) };
    let e = c.query(&st).expect_err("library error");
    // SAFETY: as above.
    unsafe { set_async_error(0) };
    assert!(matches!(e, Error::PeerFailure(_)), "{e}");
    assert!(e.to_string().contains("unhandled cuda error (fake RCCL)"), "{e}");
    // SAFETY: the hook only reads an int.
    assert_eq!(unsafe { aborted_count() }, before, "query does not abort");
    s.fake.set_busy(st.raw(), false);
    assert!(c.query(&st).expect("drained"), "done once the work finished");
    // The communicator is still usable after a `false`: an all-reduce runs and its result is right.
    let n = 64;
    let mut b = rt.alloc(n * 4).expect("alloc");
    rt.upload(&mut b, &f32_bytes(&vec![2.5; n]), &st).expect("upload");
    c.all_reduce(InOut::InPlace(&mut b), n, DataType::F32, ReduceOp::Sum, &st).expect("all-reduce");
    assert!(c.query(&st).expect("done"));
    let mut out = vec![0u8; n * 4];
    rt.download(&b, &mut out, &st).expect("download");
    assert_eq!(f32_from(&out), vec![2.5; n]);
    // A capturing stream is refused before HIP is queried: no capture violation.
    let mut refused = None;
    let g = HipGraph::capture(&st, |st| {
        refused = Some(c.query(st));
        Ok(())
    });
    assert!(g.is_ok(), "the capture stays valid");
    let refused = refused.expect("ran").expect_err("refused during capture").to_string();
    assert!(refused.contains("hipStreamQuery"), "{refused}");
    assert!(s.fake.violations().is_empty(), "{:?}", s.fake.violations());
}

#[test]
fn capture_modes_follow_hips_rules() {
    use anyccl_core::CaptureMode;
    let _g = serial();
    let s = setup(&RCCL_7_1);
    let dev = HipDevice::new(s.hip.clone(), 0).expect("device");
    let stream = HipStream::new(&dev).expect("stream");
    let rt = anyccl_rocm::HipRuntime::new(dev.clone());
    // Global mode: anyccl refuses allocation on any thread while the capture lasts, before HIP sees it.
    let mut other = None;
    let g = HipGraph::capture_with(&stream, CaptureMode::Global, |_| {
        other = Some(std::thread::scope(|sc| sc.spawn(|| rt.alloc(64).map(drop)).join().expect("thread")));
        Ok(())
    });
    assert!(g.is_ok(), "the global capture stays valid");
    let refused = other.expect("ran").expect_err("refused on another thread").to_string();
    assert!(refused.contains("hipMalloc"), "{refused}");
    assert!(s.fake.violations().is_empty(), "{:?}", s.fake.violations());
    // ... and a raw hipMalloc on another thread invalidates a global capture (the fake enforces HIP's rule).
    let r = HipGraph::capture_with(&stream, CaptureMode::Global, |_| {
        let code = std::thread::scope(|sc| sc.spawn(|| s.fake.raw_malloc(64)).join().expect("thread"));
        assert_eq!(code, 900);
        Ok(())
    });
    assert!(r.err().expect("invalidated").to_string().contains("hipErrorStreamCaptureInvalidated"));
    s.fake.reset();
    // Thread-local mode: another thread may allocate.
    let mut other = None;
    let g = HipGraph::capture_with(&stream, CaptureMode::ThreadLocal, |_| {
        other = Some(std::thread::scope(|sc| sc.spawn(|| rt.alloc(64).map(drop)).join().expect("thread")));
        Ok(())
    });
    assert!(g.is_ok());
    assert!(other.expect("ran").is_ok(), "thread-local capture lets other threads allocate");
    // Relaxed mode: even the capturing thread may allocate.
    let g = HipGraph::capture_with(&stream, CaptureMode::Relaxed, |_| rt.alloc(64).map(drop));
    assert!(g.is_ok(), "{:?}", g.err());
    assert!(s.fake.violations().is_empty(), "{:?}", s.fake.violations());
    // After the captures nothing is refused any more.
    rt.alloc(64).expect("allocation after the captures");
}

#[test]
fn memory_info_reports_free_and_total_memory() {
    let _g = serial();
    let s = setup(&RCCL_7_1);
    let dev = HipDevice::new(s.hip.clone(), 0).expect("device");
    let rt = anyccl_rocm::HipRuntime::new(dev);
    let (free0, total) = rt.memory_info().expect("memory info");
    assert_eq!(total, 64 << 30, "the fake device's size");
    let b = rt.alloc(1 << 20).expect("alloc");
    let (free1, total1) = rt.memory_info().expect("memory info");
    assert_eq!(total1, total);
    assert_eq!(free0 - free1, 1 << 20, "an allocation takes its size off the free memory");
    drop(b);
    assert_eq!(rt.memory_info().expect("memory info").0, free0);
}

#[test]
fn an_all_reduce_into_a_view_touches_only_its_range() {
    let _g = serial();
    let s = setup(&RCCL_7_1);
    let mut cs = comms(&s, 1, false);
    let c = &mut cs[0];
    let rt = c.runtime().clone();
    let st = rt.stream().expect("stream");
    anyccl_testkit::gpu_suite::all_reduce_into_a_view(c, &st);
    let n = 1024usize;
    let mut buf = rt.alloc(n * 4).expect("alloc");
    // A view swapped out of its `HipViewMut` keeps the allocation alive: the memory is freed with the last holder.
    let (free_before, _) = rt.memory_info().expect("memory info");
    let mut escaped = rt.alloc(16).expect("alloc");
    {
        let mut view = buf.view_mut(..64).expect("view");
        std::mem::swap(&mut *view, &mut escaped);
    }
    drop(buf);
    assert_eq!(escaped.len(), 64);
    // The 16-byte buffer went out with the view and was freed; `buf`'s 4 KiB are still held by `escaped`.
    assert_eq!(rt.memory_info().expect("memory info").0, free_before, "the big allocation is still held");
    rt.upload(&mut escaped, &f32_bytes(&[1.0; 16]), &st).expect("the escaped view is still valid memory");
    drop(escaped);
    assert_eq!(rt.memory_info().expect("memory info").0, free_before + n * 4, "freed with the last holder");
}

#[test]
fn a_wait_or_query_during_capture_is_refused_and_changes_nothing() {
    let _g = serial();
    let s = setup(&RCCL_7_1);
    // SAFETY: the fake RCCL built for this test; it exports this test hook with this C signature.
    let rccl = unsafe { libloading::Library::new(&s.rccl_path) }.expect("fake RCCL");
    // SAFETY: as above.
    let aborted_count = unsafe { *rccl.get::<unsafe extern "C" fn() -> i32>(b"fakerccl_aborted\0").expect("hook") };
    // SAFETY: the hook only reads an int.
    let aborted = || unsafe { aborted_count() };
    let mut cs = comms(&s, 2, false);
    let before = aborted();
    let n = 64;
    let outcomes = per_rank(&mut cs, |c| -> Result<(Error, Error, Vec<f32>)> {
        let rt = c.runtime().clone();
        let st = rt.stream()?;
        let mut b = rt.alloc(n * 4)?;
        rt.upload(&mut b, &f32_bytes(&vec![1.5; n]), &st)?;
        let (mut waited, mut queried) = (None, None);
        HipGraph::capture(&st, |st| {
            waited = Some(c.wait(st, std::time::Duration::from_secs(5)));
            queried = Some(c.query(st));
            Ok(())
        })?;
        let waited = waited.and_then(|r| r.err()).expect("the wait was refused");
        let queried = queried.and_then(|r| r.err()).expect("the query was refused");
        // The communicator was not aborted and runs the next collective with its peers.
        c.all_reduce(InOut::InPlace(&mut b), n, DataType::F32, ReduceOp::Sum, &st)?;
        c.wait(&st, std::time::Duration::from_secs(5))?;
        let mut out = vec![0u8; n * 4];
        rt.download(&b, &mut out, &st)?;
        Ok((waited, queried, f32_from(&out)))
    });
    for r in outcomes {
        let (waited, queried, out) = r.expect("rank");
        assert_eq!(waited, Error::InvalidArgument(InvalidArgument::DuringCapture { what: "Communicator::wait" }));
        assert_eq!(
            queried,
            Error::InvalidArgument(InvalidArgument::DuringCapture { what: "HipStream::query (hipStreamQuery)" })
        );
        assert_eq!(out, vec![3.0; n], "both ranks still reduce together");
    }
    assert_eq!(aborted(), before, "nothing was aborted");
    assert!(s.fake.violations().is_empty(), "{:?}", s.fake.violations());
}

/// Begins a capture in `mode` on the raw stream `raw` straight through HIP, as an engine does (anyccl is not told).
fn raw_begin(s: &Setup, raw: *mut c_void, mode: i32) {
    // SAFETY: a live stream of the fake runtime; HIP checks the mode.
    assert_eq!(unsafe { (s.hip.table().stream_begin_capture)(raw, mode) }, 0, "hipStreamBeginCapture");
}

/// Ends the capture on `raw` straight through HIP: HIP's status (901 when the capture was invalidated).
fn raw_end(s: &Setup, raw: *mut c_void) -> i32 {
    let mut graph: *mut c_void = std::ptr::null_mut();
    // SAFETY: a live stream of the fake runtime; writes the graph handle.
    let st = unsafe { (s.hip.table().stream_end_capture)(raw, &mut graph) };
    if !graph.is_null() {
        // SAFETY: the graph just returned, destroyed once.
        unsafe { (s.hip.table().graph_destroy)(graph) };
    }
    st
}

#[test]
fn allocation_during_an_engines_capture_is_refused_before_hip_and_the_capture_stays_valid() {
    let _g = serial();
    let s = setup(&RCCL_7_1);
    let mut cs = comms(&s, 1, true);
    let c = &mut cs[0];
    let rt = c.runtime().clone();
    // The engine captures, in global mode, on a stream anyccl knows (one the runtime made, or the engine's own
    // handed to anyccl), without telling anyccl: as PyTorch and vLLM capture.
    let stream = rt.stream().expect("stream");
    let early = rt.alloc(256).expect("allocated before the capture");
    let frees = s.fake.calls("hipFree");
    raw_begin(&s, stream.raw(), 0);
    let refused = rt.alloc(64).map(drop).expect_err("refused during the capture");
    assert_eq!(
        refused,
        Error::InvalidArgument(InvalidArgument::DuringCapture { what: "MemoryRuntime::alloc (hipMalloc)" })
    );
    let other = std::thread::scope(|sc| sc.spawn(|| rt.alloc(64).map(drop)).join().expect("thread"));
    assert!(matches!(other, Err(Error::InvalidArgument(InvalidArgument::DuringCapture { .. }))), "{other:?}");
    let sym = c.backend().symmetric_buffer(4096, &stream).map(drop).expect_err("refused");
    assert!(matches!(sym, Error::InvalidArgument(InvalidArgument::DuringCapture { .. })), "{sym:?}");
    let reg = c.register_graph_buffers(None).expect_err("refused");
    assert!(matches!(reg, Error::InvalidArgument(InvalidArgument::DuringCapture { .. })), "{reg:?}");
    // A buffer dropped during the capture is leaked rather than freed (freeing would invalidate the capture).
    drop(early);
    assert_eq!(s.fake.calls("hipFree"), frees, "nothing was freed during the capture");
    assert_eq!(raw_end(&s, stream.raw()), 0, "the engine's capture is still valid");
    assert!(s.fake.violations().is_empty(), "{:?}", s.fake.violations());
    rt.alloc(64).expect("allocation after the capture");
}

#[test]
fn allocation_during_a_capture_anyccl_cannot_see_does_not_invalidate_it() {
    let _g = serial();
    let s = setup(&RCCL_7_1);
    let dev = HipDevice::new(s.hip.clone(), 0).expect("device");
    let rt = anyccl_rocm::HipRuntime::new(dev.clone());
    // A stream of the engine's that anyccl was never given, captured in global mode.
    let mut raw: *mut c_void = std::ptr::null_mut();
    // SAFETY: writes one stream handle.
    assert_eq!(unsafe { (s.hip.table().stream_create_with_flags)(&mut raw, 1) }, 0);
    raw_begin(&s, raw, 0);
    let exchanges = s.fake.calls("hipThreadExchangeStreamCaptureMode");
    let b = rt.alloc(64).expect("allocated in relaxed capture mode");
    assert_eq!(s.fake.calls("hipThreadExchangeStreamCaptureMode"), exchanges + 2, "relaxed, then restored");
    assert_eq!(raw_end(&s, raw), 0, "the capture anyccl could not see is still valid");
    assert!(s.fake.violations().is_empty(), "{:?}", s.fake.violations());
    // The thread's mode was restored: a raw hipMalloc during a new global capture is refused again.
    raw_begin(&s, raw, 0);
    assert_eq!(s.fake.raw_malloc(64), 900);
    assert_eq!(raw_end(&s, raw), 901, "that one invalidated it");
    // SAFETY: the stream made above, destroyed once.
    unsafe { (s.hip.table().stream_destroy)(raw) };
    drop(b);
}

#[test]
fn closing_in_the_background_destroys_the_rccl_communicator_off_the_callers_thread() {
    let _g = serial();
    let s = setup(&RCCL_7_1);
    let cs = comms(&s, 2, false);
    let frees = s.fake.calls("hipFree");
    let teardowns: Vec<anyccl_core::Teardown> = cs.into_iter().map(|c| c.close_in_background()).collect();
    for t in &teardowns {
        assert_eq!(t.wait(), Ok(()), "RCCL's destroy succeeded");
    }
    // Per rank: the barrier scratch, and the custom kernels' staging, scratch, flags and graph-input tables.
    assert_eq!(s.fake.calls("hipFree"), frees + 2 * 5, "each rank's buffers were freed after the destroy");
}
