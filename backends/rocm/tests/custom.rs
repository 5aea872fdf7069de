//! The ROCm communicator's custom kernels on the fake HIP runtime, which records every kernel launch (name, grid,
//! decoded parameters) and emulates the one-shot / two-shot all-reduce on its host-backed memory: selection, the
//! kernels launched, their results, graph capture with graph buffers, the abort word, one process per GPU as
//! threads over HIP IPC, and the one-host check before any IPC. No GPU needed.
//!
//! The fake runtime keeps one process-wide record, so the tests take a lock and run one at a time.

#[path = "../../../tests/support/fake_ccl.rs"]
mod fake_ccl;
#[path = "../../../tests/support/fake_hip.rs"]
mod fake_hip;

use std::ffi::{c_void, CStr};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyccl_ccl::CclLibrary;
use anyccl_core::bootstrap::LocalGroup;
use anyccl_core::{Algorithm, Communicator, DataType, Error, InOut, MemoryRuntime, ReduceOp, Result, Selector};
use anyccl_gpu::multi_process as gpu_bootstrap;
use anyccl_rocm::{Hip, HipBuffer, HipDevice, HipGraph, HipLibrary, HipStream, RocmComm};
use fake_hip::{FakeHip, Launch, Shot};

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

/// Runs `f` on one thread per rank.
fn per_rank<T: Send>(
    comms: &mut [Communicator<RocmComm>],
    f: impl Fn(&mut Communicator<RocmComm>) -> T + Sync,
) -> Vec<T> {
    std::thread::scope(|sc| {
        let hs: Vec<_> = comms.iter_mut().map(|c| sc.spawn(|| f(c))).collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

/// Small integers, exact in f32 and bf16 and in their sums over 8 ranks.
fn value(rank: usize, round: usize, i: usize) -> f32 {
    ((i * 7 + rank * 13 + round * 5) % 17) as f32 - 8.0
}

fn encode(dtype: DataType, v: &[f32]) -> Vec<u8> {
    match dtype {
        DataType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        // Exact for these integers: bf16 is the upper half of the f32.
        DataType::Bf16 => v.iter().flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes()).collect(),
        other => panic!("no encoding for {other}"),
    }
}

fn decode(dtype: DataType, b: &[u8]) -> Vec<f32> {
    match dtype {
        DataType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        DataType::Bf16 => {
            b.chunks_exact(2).map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16)).collect()
        }
        other => panic!("no decoding for {other}"),
    }
}

fn input(dtype: DataType, rank: usize, round: usize, count: usize) -> Vec<u8> {
    encode(dtype, &(0..count).map(|i| value(rank, round, i)).collect::<Vec<_>>())
}

fn reference(world: usize, round: usize, count: usize) -> Vec<f32> {
    (0..count).map(|i| (0..world).map(|r| value(r, round, i)).sum()).collect()
}

fn kernel(shot: Shot, table: bool, dtype: DataType) -> String {
    let s = if shot == Shot::One { "one_shot" } else { "two_shot" };
    let t = if table { "table_" } else { "" };
    format!("anyccl_{s}_{t}{}", if dtype == DataType::F32 { "f32" } else { "bf16" })
}

/// Checks that the launches recorded since `from` (a launch count) are `world` launches of `name`, one per rank,
/// with the communicator's grid for `bytes` and 512 threads, and returns them.
fn check_launches(fake: &FakeHip, from: u64, world: usize, name: &str, bytes: usize) -> Vec<Launch> {
    let new: Vec<Launch> = fake.launches().into_iter().filter(|l| l.seq > from).collect();
    assert_eq!(new.len(), world, "one launch per rank: {new:?}");
    let blocks = (bytes / (32 << 10)).clamp(4, 64) as u32;
    let mut ranks: Vec<i32> = Vec::new();
    for l in &new {
        assert_eq!(l.name, name);
        assert_eq!((l.grid, l.block, l.status), ([blocks, 1, 1], [512, 1, 1], 0), "{l:?}");
        let p = l.params.as_ref().expect("decoded all-reduce parameters");
        assert_eq!((p.world as usize, p.n_vec as usize), (world, bytes / 16), "{l:?}");
        ranks.push(p.rank);
    }
    ranks.sort();
    assert_eq!(ranks, (0..world as i32).collect::<Vec<_>>());
    new
}

/// ROCm `init_all` at worlds 2 and 4: for eligible f32 and bf16 sums the selector picks one-shot or two-shot as its
/// table says, the communicator launches exactly that HIP kernel once per rank with the grid for the size, the
/// emulated kernels' results equal the host reference (in place and out of place), and nothing breaks HIP's
/// capture rules.
#[test]
fn init_all_launches_the_selected_hip_kernel_with_its_grid_and_sums_right() {
    let _g = serial();
    let s = setup();
    for world in [2usize, 4] {
        let mut cs = comms(&s, world);
        assert!(cs[0].backend().custom_kernels_off().is_none(), "{:?}", cs[0].backend().custom_kernels_off());
        // The push one-shot is not offered on ROCm (no receive buffer is allocated), and says why.
        let push = cs[0].backend().push_status().expect_err("no push one-shot on ROCm");
        assert!(push.contains("ROCm backend does not offer it"), "{push}");
        assert!(!anyccl_rocm::platform::ALGORITHMS.contains(&Algorithm::OneShotPush));
        assert!(!anyccl_rocm::platform::ALGORITHMS.contains(&Algorithm::TwoShotPush));
        // (dtype, bytes, in place, the algorithm the default table picks on AMD).
        let cases = [
            (DataType::F32, 4096usize, false, Algorithm::OneShot),
            (DataType::Bf16, 4096, true, Algorithm::OneShot),
            (DataType::F32, 1 << 20, true, if world == 2 { Algorithm::OneShot } else { Algorithm::TwoShot }),
            (DataType::Bf16, 1 << 20, false, if world == 2 { Algorithm::OneShot } else { Algorithm::TwoShot }),
        ];
        for (round, (dtype, bytes, in_place, want)) in cases.into_iter().enumerate() {
            let count = bytes / dtype.size_bytes();
            let from = s.fake.launch_total();
            let out = per_rank(&mut cs, |c| -> Result<(Algorithm, Vec<f32>)> {
                let rt = c.runtime().clone();
                let st = rt.stream()?;
                let mut a = rt.alloc(bytes)?;
                rt.upload(&mut a, &input(dtype, c.rank(), round, count), &st)?;
                let mut b = rt.alloc(bytes)?;
                let sel = if in_place {
                    c.all_reduce(InOut::InPlace(&mut a), count, dtype, ReduceOp::Sum, &st)?
                } else {
                    c.all_reduce(InOut::Separate { send: &a, recv: &mut b }, count, dtype, ReduceOp::Sum, &st)?
                };
                st.synchronize()?;
                let mut host = vec![0u8; bytes];
                rt.download(if in_place { &a } else { &b }, &mut host, &st)?;
                Ok((sel.algorithm, decode(dtype, &host)))
            });
            let shot = if want == Algorithm::OneShot { Shot::One } else { Shot::Two };
            let launches = check_launches(&s.fake, from, world, &kernel(shot, false, dtype), bytes);
            assert!(launches.iter().all(|l| !l.capturing && l.completed == 1), "{launches:?}");
            for (rank, r) in out.into_iter().enumerate() {
                let (algorithm, got) = r.unwrap_or_else(|e| panic!("world {world} {dtype} {bytes}: {e}"));
                assert_eq!(algorithm, want, "world {world} {dtype} {bytes} rank {rank}");
                assert!(got == reference(world, round, count), "world {world} {dtype} {bytes} rank {rank}: wrong sums");
            }
        }
        // A type the kernels lack, and a size that is not whole vectors, go to RCCL.
        let call = |count: usize, dtype: DataType| anyccl_core::comm::AllReduceCall {
            count,
            dtype,
            op: ReduceOp::Sum,
            bytes: count * dtype.size_bytes(),
            in_place: true,
            capturing: false,
            bufs: None,
        };
        let why =
            cs[0].check_algorithm(Algorithm::OneShot, &call(10, DataType::F32)).expect_err("40 bytes").to_string();
        assert!(why.contains("multiple of 16"), "{why}");
        let why = cs[0].check_algorithm(Algorithm::TwoShot, &call(64, DataType::I32)).expect_err("i32").to_string();
        assert!(why.contains("f32, f16 and bf16"), "{why}");
        assert_eq!(cs[0].select_all_reduce(&call(64, DataType::I32)).expect("selection").algorithm, Algorithm::Ccl);
    }
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// A rank's captured graph, its stream, input and output.
type Captured = (HipGraph, HipStream, HipBuffer, HipBuffer);

/// On a thread per rank: uploads round `round`'s input, replays the graph once and reads the output.
fn replay_all(
    cs: &[Communicator<RocmComm>],
    kept: &mut [Captured],
    dtype: DataType,
    round: usize,
) -> Vec<Result<Vec<f32>>> {
    let runtimes: Vec<_> = cs.iter().map(|c| c.runtime().clone()).collect();
    std::thread::scope(|sc| {
        let hs: Vec<_> = kept
            .iter_mut()
            .zip(runtimes)
            .enumerate()
            .map(|(rank, ((graph, st, inp, out), rt))| {
                sc.spawn(move || -> Result<Vec<f32>> {
                    let count = inp.len() / dtype.size_bytes();
                    rt.upload(inp, &input(dtype, rank, round, count), st)?;
                    graph.launch(st)?;
                    st.synchronize()?;
                    let mut host = vec![0u8; out.len()];
                    rt.download(out, &mut host, st)?;
                    Ok(decode(dtype, &host))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

/// Graph capture on ROCm: a captured out-of-place all-reduce launches the `_table` kernel (capturing, nothing runs
/// yet), a replay before registration reads its input through staging (`registered` 0), `register_graph_buffers`
/// registers the one input on every rank, and later replays read the registered inputs directly (`registered`
/// 1); every replay's sums are right and nothing breaks HIP's capture rules. One-shot at world 2, two-shot at
/// world 4.
#[test]
fn captured_all_reduces_read_registered_inputs_after_register_graph_buffers() {
    let _g = serial();
    let s = setup();
    for (world, bytes, shot) in [(2usize, 4096usize, Shot::One), (4, 1 << 20, Shot::Two)] {
        let mut cs = comms(&s, world);
        let dtype = DataType::F32;
        let count = bytes / 4;
        let from = s.fake.launch_total();
        // Captured by every rank on its own thread; replayed once before registration.
        let graphs = per_rank(&mut cs, |c| -> Result<_> {
            let rt = c.runtime().clone();
            let st = rt.stream()?;
            let mut inp = rt.alloc(bytes)?;
            let mut out = rt.alloc(bytes)?;
            let graph = HipGraph::capture(&st, |st| {
                c.all_reduce(InOut::Separate { send: &inp, recv: &mut out }, count, dtype, ReduceOp::Sum, st)
                    .map(|_| ())
            })?;
            let pending = c.pending_graph_buffers();
            rt.upload(&mut inp, &input(dtype, c.rank(), 0, count), &st)?;
            graph.launch(&st)?;
            st.synchronize()?;
            let mut host = vec![0u8; bytes];
            rt.download(&out, &mut host, &st)?;
            Ok((graph, st, inp, out, pending, decode(dtype, &host)))
        });
        let captured = check_launches(&s.fake, from, world, &kernel(shot, true, dtype), bytes);
        assert!(captured.iter().all(|l| l.capturing && l.runs == 1 && l.completed == 1), "{captured:?}");
        assert!(captured.iter().all(|l| l.params.as_ref().and_then(|p| p.last_registered) == Some(false)));
        let mut kept = Vec::new();
        for (rank, g) in graphs.into_iter().enumerate() {
            let (graph, st, inp, out, pending, got) = g.unwrap_or_else(|e| panic!("world {world} rank {rank}: {e}"));
            assert_eq!(pending, 1, "one input seen in the capture");
            assert!(got == reference(world, 0, count), "world {world} rank {rank}: first replay");
            kept.push((graph, st, inp, out));
        }
        // Registration: collective, every rank on its own thread (ranks of one process exchange pointers).
        let regs = per_rank(&mut cs, |c| c.register_graph_buffers(None));
        for r in regs {
            let r = r.expect("registration");
            assert_eq!((r.registered, r.kept_staged.len()), (1, 0), "{r:?}");
        }
        assert_eq!(cs[0].pending_graph_buffers(), 0);
        // Replays now read every rank's input directly.
        for (rank, r) in replay_all(&cs, &mut kept, dtype, 1).into_iter().enumerate() {
            assert!(r.expect("replay") == reference(world, 1, count), "world {world} rank {rank}: registered replay");
        }
        let replayed: Vec<Launch> = s.fake.launches().into_iter().filter(|l| l.seq > from).collect();
        for l in &replayed {
            assert_eq!((l.runs, l.completed, l.failed), (2, 2, 0), "{l:?}");
            assert_eq!(l.params.as_ref().and_then(|p| p.last_registered), Some(true), "{l:?}");
        }
        drop(kept);
    }
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// A registration whose table write fails on one rank fails on every rank alike, with no rank left reading
/// registered inputs while its peer reads staging: the fake fails rank 1's table copy. With one failing copy the
/// revert succeeds: every rank errs naming rank 1, a replay reads staging on both ranks (`registered` 0) with right
/// sums, the input stays pending, and the next registration succeeds. With two (the revert fails too) every rank
/// errs saying the graphs must not be replayed, and the custom kernels are off on both ranks. Before the agreement
/// round, rank 0 returned `Ok` with the input registered while rank 1 failed and kept staging.
#[test]
fn a_table_write_failing_on_one_rank_fails_registration_on_every_rank() {
    let _g = serial();
    let s = setup();
    let (world, bytes, dtype) = (2usize, 4096usize, DataType::F32);
    let count = bytes / 4;
    let table_bytes = anyccl_gpu::kernels::INPUT_TABLE_BYTES;
    for failing in [1, 2] {
        let mut cs = comms(&s, world);
        let from = s.fake.launch_total();
        let mut kept: Vec<_> = per_rank(&mut cs, |c| -> Result<_> {
            let rt = c.runtime().clone();
            let st = rt.stream()?;
            let inp = rt.alloc(bytes)?;
            let mut out = rt.alloc(bytes)?;
            let graph = HipGraph::capture(&st, |st| {
                c.all_reduce(InOut::Separate { send: &inp, recv: &mut out }, count, dtype, ReduceOp::Sum, st)
                    .map(|_| ())
            })?;
            Ok((graph, st, inp, out))
        })
        .into_iter()
        .map(|r| r.expect("capture"))
        .collect();
        s.fake.fail_copies(1, table_bytes, failing);
        let regs = per_rank(&mut cs, |c| c.register_graph_buffers(None));
        s.fake.fail_copies(-1, 0, 0);
        for (rank, r) in regs.into_iter().enumerate() {
            let e = r.expect_err("registration fails on every rank").to_string();
            assert!(e.contains("rank 1 could not write the input table"), "{failing} failing, rank {rank}: {e}");
            let says = if failing == 1 { "back to staging" } else { "must not be replayed" };
            assert!(e.contains(says), "{failing} failing, rank {rank}: {e}");
        }
        if failing == 2 {
            for c in &cs {
                let why = c.backend().custom_kernels_off().expect("off on every rank");
                assert!(why.contains("left the input tables unusable"), "{why}");
            }
            continue;
        }
        // Both ranks' tables are staging: the replay copies through staging on both, and the sums are right.
        for (rank, r) in replay_all(&cs, &mut kept, dtype, 0).into_iter().enumerate() {
            assert!(r.expect("replay") == reference(world, 0, count), "rank {rank}: replay after the failure");
        }
        let replayed: Vec<Launch> = s.fake.launches().into_iter().filter(|l| l.seq > from).collect();
        assert_eq!(replayed.len(), world, "{replayed:?}");
        for l in &replayed {
            assert_eq!(l.params.as_ref().and_then(|p| p.last_registered), Some(false), "{l:?}");
        }
        for c in &cs {
            assert_eq!(c.pending_graph_buffers(), 1, "the input stays pending");
            assert_eq!(c.backend().custom_kernels_off(), None);
        }
        let regs = per_rank(&mut cs, |c| c.register_graph_buffers(None));
        for r in regs {
            assert_eq!(r.expect("the next registration").registered, 1);
        }
        drop(kept);
    }
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// A wait that gives up on a peer tells this rank's custom kernels to stop: after a one-shot both ranks ran,
/// rank 0's stream never drains (as behind a kernel stuck on a dead peer), its wait times out, the abort word of
/// its flag array is written once (`hipStreamWriteValue32` on the communicator's control stream, not the stuck
/// stream), and the custom kernels go off with the aborted communicator (the next call fails; no rank chooses
/// differently from a live peer).
#[test]
fn a_failed_wait_writes_the_abort_word() {
    let _g = serial();
    let s = setup();
    let mut cs = comms(&s, 2);
    let from = s.fake.launch_total();
    let ok = per_rank(&mut cs, |c| -> Result<()> {
        let rt = c.runtime().clone();
        let st = rt.stream()?;
        let mut b = rt.alloc(4096)?;
        c.all_reduce(InOut::InPlace(&mut b), 1024, DataType::F32, ReduceOp::Sum, &st)?;
        c.wait(&st, Duration::from_secs(5))
    });
    assert!(ok.iter().all(|r| r.is_ok()), "{ok:?}");
    let launched = check_launches(&s.fake, from, 2, "anyccl_one_shot_f32", 4096);
    let p0 = launched.iter().filter_map(|l| l.params.clone()).find(|p| p.rank == 0).expect("rank 0's launch");
    let word = (p0.flags[0] + anyccl_kernels_hip::ABORT_WORD_OFFSET as u64) as *const u32;
    // SAFETY: the fake's device memory is host memory; rank 0's flag array lives while its communicator does.
    let read = || unsafe { std::ptr::read_volatile(word) };
    assert_eq!(read(), 0, "the abort word starts clear");

    let c = &mut cs[0];
    let rt = c.runtime().clone();
    let st = rt.stream().expect("stream");
    s.fake.set_busy(st.raw(), true);
    let writes = s.fake.calls("hipStreamWriteValue32");
    let started = std::time::Instant::now();
    let err = c.wait(&st, Duration::from_millis(200)).expect_err("the stream never drains");
    assert!(matches!(err, Error::Timeout { .. } | Error::PeerFailure(_)), "{err}");
    assert!(started.elapsed() < Duration::from_secs(8), "bounded: {:?}", started.elapsed());
    assert_eq!(s.fake.calls("hipStreamWriteValue32"), writes + 1, "the abort word was written once");
    assert_eq!(read(), 1, "rank 0's abort word is set");
    let off = c.backend().custom_kernels_off().expect("off").to_owned();
    assert!(off.contains("an earlier wait failed"), "{off}");
    let mut b = rt.alloc(4096).expect("buffer");
    assert!(c.all_reduce(InOut::InPlace(&mut b), 1024, DataType::F32, ReduceOp::Sum, &st).is_err(), "aborted");
    s.fake.set_busy(st.raw(), false);
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
    let id = gpu_bootstrap::share_unique_id::<Hip>(boot, Some(&s.rccl))?;
    let dev = HipDevice::new(s.hip.clone(), rank as i32)?;
    let selector = Arc::new(Selector::defaults());
    gpu_bootstrap::join::<Hip>(s.rccl.clone(), &id, rank, world, dev, boot, selector, env)
}

/// A rank's eager sums, its registered replay's sums, how many graph inputs it registered, and the communicator.
type RankResult = (Vec<f32>, Vec<f32>, usize, Communicator<RocmComm>);

/// One process per GPU, simulated as threads over an in-process bootstrap: every rank joins through the generic
/// bootstrap, exports its three buffers' HIP IPC handles and opens its peers' (the fake's handles name
/// allocations, so threads work), all-reduces with the HIP kernels reading the peers' mapped buffers, and
/// registers a captured input over IPC through the same bootstrap; the mappings close with the communicators.
#[test]
fn one_process_per_gpu_as_threads_sets_up_hip_ipc_and_registers_graph_buffers() {
    let _g = serial();
    let s = setup();
    let world = 3;
    let (gets, opens) = (s.fake.calls("hipIpcGetMemHandle"), s.fake.calls("hipIpcOpenMemHandle"));
    let group = LocalGroup::new(world, Duration::from_secs(30));
    let env = |k: &str| (k == "ANYCCL_HOST_ID").then(|| "node-a".to_owned());
    let bytes = 8192;
    let count = bytes / 4;
    let from = s.fake.launch_total();
    let outcomes = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let mut boot = group.member(rank);
                let (s, env) = (&s, &env);
                sc.spawn(move || -> Result<RankResult> {
                    let mut c = join_rank(s, &mut boot, world, env)?;
                    let rt = c.runtime().clone();
                    let st = rt.stream()?;
                    let mut inp = rt.alloc(bytes)?;
                    let mut out = rt.alloc(bytes)?;
                    rt.upload(&mut inp, &input(DataType::F32, rank, 0, count), &st)?;
                    c.all_reduce(
                        InOut::Separate { send: &inp, recv: &mut out },
                        count,
                        DataType::F32,
                        ReduceOp::Sum,
                        &st,
                    )?;
                    st.synchronize()?;
                    let mut host = vec![0u8; bytes];
                    rt.download(&out, &mut host, &st)?;
                    let eager = decode(DataType::F32, &host);
                    let graph = HipGraph::capture(&st, |st| {
                        c.all_reduce(
                            InOut::Separate { send: &inp, recv: &mut out },
                            count,
                            DataType::F32,
                            ReduceOp::Sum,
                            st,
                        )
                        .map(|_| ())
                    })?;
                    let reg = c.register_graph_buffers(Some(&mut boot))?;
                    rt.upload(&mut inp, &input(DataType::F32, rank, 1, count), &st)?;
                    graph.launch(&st)?;
                    st.synchronize()?;
                    rt.download(&out, &mut host, &st)?;
                    Ok((eager, decode(DataType::F32, &host), reg.registered, c))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect::<Vec<_>>()
    });
    let mut comms = Vec::new();
    for (rank, o) in outcomes.into_iter().enumerate() {
        let (eager, replay, registered, c) = o.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(c.backend().custom_kernels_off().is_none(), "{:?}", c.backend().custom_kernels_off());
        assert!(eager == reference(world, 0, count), "rank {rank}: eager");
        assert!(replay == reference(world, 1, count), "rank {rank}: registered replay");
        assert_eq!(registered, 1, "rank {rank}");
        comms.push(c);
    }
    let launched: Vec<Launch> = s.fake.launches().into_iter().filter(|l| l.seq > from).collect();
    assert_eq!(launched.iter().filter(|l| l.name == "anyccl_one_shot_f32").count(), world, "{launched:?}");
    let table: Vec<&Launch> = launched.iter().filter(|l| l.name == "anyccl_one_shot_table_f32").collect();
    assert_eq!(table.len(), world);
    assert!(table.iter().all(|l| l.params.as_ref().and_then(|p| p.last_registered) == Some(true)), "{table:?}");
    // Setup: staging, scratch and flags of every rank, each opened by every peer; then one graph input each.
    let n = world as i32;
    assert_eq!(s.fake.calls("hipIpcGetMemHandle") - gets, 3 * n + n);
    assert_eq!(s.fake.calls("hipIpcOpenMemHandle") - opens, (3 + 1) * n * (n - 1));
    assert_eq!(s.fake.ipc_open_count(), (3 + 1) * n * (n - 1), "every mapping open while the communicators live");
    drop(comms);
    assert_eq!(s.fake.ipc_open_count(), 0, "every mapping closed with its communicator");
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// Ranks that report different hosts (`ANYCCL_HOST_ID` per rank, through each rank's own environment) turn the
/// custom kernels off with the reason before any IPC handle is exported or opened, and RCCL serves the call.
#[test]
fn ranks_on_two_hosts_turn_the_kernels_off_before_any_ipc() {
    let _g = serial();
    let s = setup();
    let world = 2;
    let (gets, opens) = (s.fake.calls("hipIpcGetMemHandle"), s.fake.calls("hipIpcOpenMemHandle"));
    let loads = s.fake.calls("hipModuleLoadData");
    let group = LocalGroup::new(world, Duration::from_secs(30));
    let outcomes = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let mut boot = group.member(rank);
                let s = &s;
                sc.spawn(move || -> Result<(String, Algorithm, Vec<f32>)> {
                    let host = if rank == 0 { "node-a" } else { "node-b" };
                    let env = move |k: &str| (k == "ANYCCL_HOST_ID").then(|| host.to_owned());
                    let mut c = join_rank(s, &mut boot, world, &env)?;
                    let off = c.backend().custom_kernels_off().unwrap_or_default().to_owned();
                    let rt = c.runtime().clone();
                    let st = rt.stream()?;
                    let mut b = rt.alloc(4096)?;
                    rt.upload(&mut b, &input(DataType::F32, rank, 0, 1024), &st)?;
                    let sel = c.all_reduce(InOut::InPlace(&mut b), 1024, DataType::F32, ReduceOp::Sum, &st)?;
                    st.synchronize()?;
                    let mut host_bytes = vec![0u8; 4096];
                    rt.download(&b, &mut host_bytes, &st)?;
                    Ok((off, sel.algorithm, decode(DataType::F32, &host_bytes)))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect::<Vec<_>>()
    });
    for (rank, o) in outcomes.into_iter().enumerate() {
        let (off, algorithm, got) = o.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(off.contains("ranks span 2 hosts (rank 0 on node-a, rank 1 on node-b)"), "rank {rank}: {off}");
        assert_eq!(algorithm, Algorithm::Ccl, "rank {rank}");
        assert!(got == reference(world, 0, 1024), "rank {rank}");
    }
    assert_eq!(s.fake.calls("hipIpcGetMemHandle"), gets, "no handle exported");
    assert_eq!(s.fake.calls("hipIpcOpenMemHandle"), opens, "no handle opened");
    assert_eq!(s.fake.calls("hipModuleLoadData"), loads, "not even the kernels loaded");
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
    let world = 2;
    let group = LocalGroup::new(world, Duration::from_secs(30));
    let env = |k: &str| (k == "ANYCCL_HOST_ID").then(|| "node-a".to_owned());
    let rccl = s.rccl.clone();
    let caps = Arc::new(anyccl_rocm::capabilities(Ok(&s.hip), Some(&s.rccl), &no_env));
    let id = anyccl_ccl::UniqueId::new(&rccl).expect("unique id");
    let (gets, loads) = (s.fake.calls("hipIpcGetMemHandle"), s.fake.calls("hipModuleLoadData"));
    let outcomes = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let mut boot = group.member(rank);
                let (s, env, rccl, caps, id) = (&s, &env, rccl.clone(), caps.clone(), &id);
                sc.spawn(move || -> Result<(Error, Algorithm, Vec<f32>)> {
                    let dev = HipDevice::new(s.hip.clone(), rank as i32)?;
                    let mut comm = RocmComm::init_rank(rccl, dev, world, rank, id, caps)?;
                    let st = anyccl_core::CommBackend::runtime(&comm).stream()?;
                    // A global capture refuses allocation on every thread: every rank is set up before any
                    // captures, and every capture has ended before any rank allocates again.
                    anyccl_core::Bootstrap::barrier(&mut boot)?;
                    let mut during = None;
                    HipGraph::capture_with(&st, anyccl_core::CaptureMode::Global, |_| {
                        during = Some(comm.enable_custom_ipc_with_env(&mut boot, env));
                        Ok(())
                    })?;
                    let refused = during.and_then(|r| r.err()).expect("refused during the capture");
                    anyccl_core::Bootstrap::barrier(&mut boot)?;
                    comm.enable_custom_ipc_with_env(&mut boot, env)?;
                    let mut c = Communicator::new(comm, Arc::new(Selector::defaults()));
                    let rt = c.runtime().clone();
                    let mut b = rt.alloc(4096)?;
                    rt.upload(&mut b, &input(DataType::F32, rank, 0, 1024), &st)?;
                    let sel = c.all_reduce(InOut::InPlace(&mut b), 1024, DataType::F32, ReduceOp::Sum, &st)?;
                    st.synchronize()?;
                    let mut host = vec![0u8; 4096];
                    rt.download(&b, &mut host, &st)?;
                    Ok((refused, sel.algorithm, decode(DataType::F32, &host)))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect::<Vec<_>>()
    });
    for (rank, o) in outcomes.into_iter().enumerate() {
        let (refused, algorithm, got) = o.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(
            matches!(refused, Error::InvalidArgument(anyccl_core::InvalidArgument::DuringCapture { .. })),
            "rank {rank}: {refused}"
        );
        assert_eq!(algorithm, Algorithm::OneShot, "rank {rank}: set up after the capture");
        assert!(got == reference(world, 0, 1024), "rank {rank}");
    }
    // Only the setup after the capture reached HIP: three handles per rank, one module load per rank.
    assert_eq!(s.fake.calls("hipIpcGetMemHandle") - gets, 3 * world as i32);
    assert_eq!(s.fake.calls("hipModuleLoadData") - loads, world as i32);
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// What one rank of the split test saw: its sub-communicator's rank and world, the sub all-reduce's algorithm and
/// sums, and what the grouped ring exchange on the parent received.
type SplitSeen = (usize, usize, Algorithm, Vec<f32>, Vec<f32>);

/// Sub-communicators of a one-process-per-GPU job (threads here): `split(rank % 2)` makes two of two ranks, each
/// with its own custom-kernel state set up over HIP IPC through the sub-communicator itself, so an all-reduce on
/// it runs the HIP one-shot over its two ranks and sums only theirs; a grouped ring of sends and receives on the
/// parent (each rank receives before it sends in its list) completes. On a single-process parent the sub's
/// kernels are off with the reason.
#[test]
fn split_sub_communicators_set_up_their_own_kernels_and_p2p_groups_complete() {
    let _g = serial();
    let s = setup();
    let world = 4;
    let group = LocalGroup::new(world, Duration::from_secs(30));
    let env = |k: &str| (k == "ANYCCL_HOST_ID").then(|| "node-a".to_owned());
    let from = s.fake.launch_total();
    let outcomes = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let mut boot = group.member(rank);
                let (s, env) = (&s, &env);
                sc.spawn(move || -> Result<SplitSeen> {
                    let mut c = join_rank(s, &mut boot, world, env)?;
                    let rt = c.runtime().clone();
                    let st = rt.stream()?;
                    let mut sub = c.split(Some(rank as u32 % 2), rank as u32)?.expect("a color was given");
                    let mut b = rt.alloc(4096)?;
                    rt.upload(&mut b, &input(DataType::F32, rank, 0, 1024), &st)?;
                    let sel = sub.all_reduce(InOut::InPlace(&mut b), 1024, DataType::F32, ReduceOp::Sum, &st)?;
                    st.synchronize()?;
                    let mut host = vec![0u8; 4096];
                    rt.download(&b, &mut host, &st)?;
                    // A ring on the parent: receive from the previous rank, send to the next, in one group.
                    let mut mine = rt.alloc(16)?;
                    rt.upload(&mut mine, &encode(DataType::F32, &[rank as f32; 4]), &st)?;
                    let mut got = rt.alloc(16)?;
                    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
                    let mut ops = [
                        anyccl_core::P2pOp::Recv { buf: &mut got, count: 4, dtype: DataType::F32, peer: prev },
                        anyccl_core::P2pOp::Send { buf: &mine, count: 4, dtype: DataType::F32, peer: next },
                    ];
                    c.p2p(&mut ops, &st)?;
                    st.synchronize()?;
                    let mut ring = vec![0u8; 16];
                    rt.download(&got, &mut ring, &st)?;
                    Ok((
                        sub.rank(),
                        sub.world_size(),
                        sel.algorithm,
                        decode(DataType::F32, &host),
                        decode(DataType::F32, &ring),
                    ))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect::<Vec<_>>()
    });
    for (rank, o) in outcomes.into_iter().enumerate() {
        let (sub_rank, sub_world, algorithm, sums, ring) = o.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!((sub_rank, sub_world), (rank / 2, 2), "rank {rank}");
        assert_eq!(algorithm, Algorithm::OneShot, "rank {rank}: the sub-communicator's own kernels");
        let peers = [rank % 2, rank % 2 + 2];
        let want: Vec<f32> = (0..1024).map(|i| peers.iter().map(|r| value(*r, 0, i)).sum()).collect();
        assert!(sums == want, "rank {rank}: the sum over its sub-communicator only");
        assert_eq!(ring, vec![((rank + world - 1) % world) as f32; 4], "rank {rank}: the previous rank's values");
    }
    let subs: Vec<Launch> = s
        .fake
        .launches()
        .into_iter()
        .filter(|l| l.seq > from && l.params.as_ref().is_some_and(|p| p.world == 2))
        .collect();
    assert_eq!(subs.len(), world, "one world-2 one-shot per rank: {subs:?}");
    assert_eq!(s.fake.violations(), Vec::<String>::new());

    // One process: the sub-communicators' kernels are off, with the reason, and RCCL serves them.
    let mut cs = comms(&s, 2);
    let subs = per_rank(&mut cs, |c| {
        c.split(Some(0), 0).map(|sub| sub.map(|s| s.backend().custom_kernels_off().map(str::to_owned)))
    });
    for sub in subs {
        let why = sub.expect("split").expect("colored").expect("off");
        assert!(why.contains("peer access within one process"), "{why}");
    }
}

#[path = "custom/fused_quant.rs"]
mod fused_quant;
