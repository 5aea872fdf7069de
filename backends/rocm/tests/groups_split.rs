//! Grouped point-to-point calls, sub-communicators (`ncclCommSplit`) and the bootstrap over the communicator
//! itself (`CclBootstrap`), through anyccl-ccl's communicator (`CclComm`) on the computing fake RCCL and the fake
//! HIP runtime (anyccl-testkit). No GPU needed.
//!
//! The GPU backends' own `CommBackend::p2p`/`split` are wired by their communicators; here a minimal backend over
//! `CclComm` and the HIP runtime (`Ranked`, below) takes the calls through core's validating `Communicator`, as
//! they will.
//!
//! The fake runtime keeps one process-wide record of calls and violations, so the tests take a lock and run one
//! at a time.

use anyccl_testkit::fake_ccl;
use anyccl_testkit::fake_hip;

use std::sync::{Arc, Mutex, MutexGuard};

use anyccl_ccl::{CclComm, CclLibrary, CclReduction, UniqueId};
use anyccl_core::bootstrap::Bootstrap;
use anyccl_core::comm::{
    AllGatherArgs, AllReduceArgs, AllReduceCall, BroadcastArgs, CommBackend, P2pArgs, RecvArgs, ReduceArgs,
    ReduceScatterArgs, SendArgs,
};
use anyccl_core::{
    Algorithm, CapabilityReport, Communicator, DataType, Error, InOut, InvalidArgument, MemoryRuntime, P2pOp, ReduceOp,
    Result, Selector, Vendor,
};
use anyccl_gpu::CclBootstrap;
use anyccl_rocm::{HipBuffer, HipDevice, HipGraph, HipLibrary, HipRuntime, HipStream};
use fake_ccl::{NCCL_2_17, RCCL_6_2};
use fake_hip::FakeHip;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// One rank: the shared CCL communicator over the fake RCCL, on one fake HIP device.
struct Ranked {
    ccl: CclComm,
    runtime: HipRuntime,
    caps: Arc<CapabilityReport>,
    scratch: HipBuffer,
}

impl CommBackend for Ranked {
    type Reduction = CclReduction;
    type Plan = ();
    type Runtime = HipRuntime;

    fn runtime(&self) -> &HipRuntime {
        &self.runtime
    }
    fn name(&self) -> &'static str {
        "ranked"
    }
    fn rank(&self) -> usize {
        self.ccl.rank()
    }
    fn world_size(&self) -> usize {
        self.ccl.world()
    }
    fn vendor(&self) -> Vendor {
        Vendor::Amd
    }
    fn arch(&self) -> &str {
        "gfx942"
    }
    fn capabilities(&self) -> &CapabilityReport {
        &self.caps
    }
    fn allreduce_algorithms(&self) -> &[Algorithm] {
        &[Algorithm::Ccl]
    }
    fn allreduce_eligible(&self, algorithm: Algorithm, call: &AllReduceCall) -> std::result::Result<(), String> {
        self.ccl.eligible(algorithm, call, &self.caps, "nothing").unwrap_or(Err("not here".into()))
    }
    fn check_reduction(&self, dtype: DataType, op: ReduceOp) -> Result<CclReduction> {
        self.ccl.check_reduction(dtype, op)
    }
    fn all_reduce(&mut self, args: AllReduceArgs<'_, Self>) -> Result<()> {
        // SAFETY: `args` was made by this backend's `Communicator` after validating it against this rank.
        unsafe { self.ccl.all_reduce(args) }
    }
    fn all_gather(&mut self, args: AllGatherArgs<'_, Self>) -> Result<()> {
        // SAFETY: as above.
        unsafe { self.ccl.all_gather(args) }
    }
    fn reduce_scatter(&mut self, args: ReduceScatterArgs<'_, Self>) -> Result<()> {
        // SAFETY: as above.
        unsafe { self.ccl.reduce_scatter(args) }
    }
    fn broadcast(&mut self, args: BroadcastArgs<'_, Self>) -> Result<()> {
        // SAFETY: as above.
        unsafe { self.ccl.broadcast(args) }
    }
    fn reduce(&mut self, args: ReduceArgs<'_, Self>) -> Result<()> {
        // SAFETY: as above.
        unsafe { self.ccl.reduce(args) }
    }
    fn send(&mut self, args: SendArgs<'_, Self>) -> Result<()> {
        // SAFETY: as above.
        unsafe { self.ccl.send(args) }
    }
    fn recv(&mut self, args: RecvArgs<'_, Self>) -> Result<()> {
        // SAFETY: as above.
        unsafe { self.ccl.recv(args) }
    }
    fn p2p(&mut self, args: P2pArgs<'_, '_, Self>) -> Result<()> {
        // SAFETY: as above.
        unsafe { self.ccl.p2p(args) }
    }
    fn split(&mut self, color: Option<u32>, key: u32) -> Result<Option<Self>> {
        let Some(ccl) = self.ccl.split(&self.caps, color, key)? else { return Ok(None) };
        let scratch = self.runtime.alloc(4)?;
        Ok(Some(Ranked { ccl, runtime: self.runtime.clone(), caps: self.caps.clone(), scratch }))
    }
    fn barrier(&mut self, stream: &HipStream) -> Result<()> {
        // SAFETY: a 4-byte buffer of this device; a stream of this device.
        unsafe { self.ccl.barrier(&self.scratch, stream) }
    }
}

struct Setup {
    hip: Arc<HipLibrary>,
    rccl: Arc<CclLibrary>,
    fake: FakeHip,
    rccl_path: std::path::PathBuf,
}

fn setup() -> Setup {
    let hip_path = fake_hip::build_hip();
    let rccl_path = fake_hip::build_rccl(&RCCL_6_2);
    let hip = Arc::new(HipLibrary::open(&hip_path).expect("fake HIP loads"));
    let rccl = Arc::new(CclLibrary::open(&rccl_path).expect("fake RCCL loads"));
    let fake = FakeHip::open(&hip_path);
    fake.reset();
    Setup { hip, rccl, fake, rccl_path }
}

/// `world` ranks over `ncclCommInitAll`, one fake device each, behind core's `Communicator`.
fn ranks(s: &Setup, world: usize) -> Vec<Communicator<Ranked>> {
    let caps = Arc::new(anyccl_rocm::capabilities(Ok(&s.hip), Some(&s.rccl), &|_| None));
    let devices: Vec<i32> = (0..world as i32).collect();
    let comms = CclComm::init_all(&s.rccl, &devices).expect("ncclCommInitAll");
    let selector = Arc::new(Selector::defaults());
    comms
        .into_iter()
        .enumerate()
        .map(|(r, c)| {
            let runtime = HipRuntime::new(HipDevice::new(s.hip.clone(), r as i32).expect("fake device"));
            let scratch = runtime.alloc(4).expect("scratch");
            let b = Ranked { ccl: c, runtime, caps: caps.clone(), scratch };
            Communicator::new(b, selector.clone())
        })
        .collect()
}

/// Runs `f` on one thread per rank (the fake RCCL blocks a rank until its peers reach the same call); the
/// communicators outlive every thread.
fn per_rank<T: Send>(comms: &mut [Communicator<Ranked>], f: impl Fn(&mut Communicator<Ranked>) -> T + Sync) -> Vec<T> {
    std::thread::scope(|sc| {
        let f = &f;
        let hs: Vec<_> = comms.iter_mut().map(|c| sc.spawn(move || f(c))).collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32_from(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// A device buffer holding `v`, uploaded on `stream`.
fn device(c: &Communicator<Ranked>, v: &[f32], stream: &HipStream) -> HipBuffer {
    let mut b = c.runtime().alloc(v.len() * 4).expect("alloc");
    c.runtime().upload(&mut b, &f32_bytes(v), stream).expect("upload");
    b
}

fn host(c: &Communicator<Ranked>, b: &HipBuffer, stream: &HipStream) -> Vec<f32> {
    let mut out = vec![0u8; b.len()];
    c.runtime().download(b, &mut out, stream).expect("download");
    f32_from(&out)
}

/// This thread's open group depth in the fake RCCL (0: none open).
fn group_depth(rccl: &std::path::Path) -> i32 {
    // SAFETY: the fake RCCL built above (already loaded: the same copy); it exports this C function.
    unsafe {
        let lib = libloading::Library::new(rccl).expect("reopen the fake RCCL");
        let f = lib.get::<unsafe extern "C" fn() -> i32>(b"fakerccl_group_depth\0").expect("fakerccl_group_depth");
        f()
    }
}

const N: usize = 1000;

fn msg(r: usize, k: usize) -> Vec<f32> {
    (0..N).map(|i| (r * 100_000 + k * 1000 + i) as f32).collect()
}

/// A ring step in a group, listed send-first, receive-first, and mixed by rank parity, then two messages each
/// way in one group: every rank gets its predecessor's messages, in order; no group is left open; the fake
/// recorded no violation (a receive listed first and run alone would have waited for its peer's send forever).
#[test]
fn a_grouped_ring_completes_in_either_order_on_the_fake_rccl() {
    let _g = serial();
    let s = setup();
    for world in [3, 4] {
        let mut comms = ranks(&s, world);
        let out = per_rank(&mut comms, |c| {
            let (me, world) = (c.rank(), c.world_size());
            let (next, prev) = ((me + 1) % world, (me + world - 1) % world);
            let stream = c.runtime().stream().expect("stream");
            for (k, recv_first) in [(0, false), (1, true), (2, me.is_multiple_of(2))] {
                let send = device(c, &msg(me, k), &stream);
                let mut got = device(c, &[0.0; N], &stream);
                let (sop, rop) =
                    (P2pOp::send(&send, N, DataType::F32, next), P2pOp::recv(&mut got, N, DataType::F32, prev));
                let mut ops = if recv_first { [rop, sop] } else { [sop, rop] };
                c.p2p(&mut ops, &stream).expect("grouped ring step");
                assert!(host(c, &got, &stream) == msg(prev, k), "rank {me}, round {k}: wrong message");
            }
            let (a, b) = (device(c, &msg(me, 3), &stream), device(c, &msg(me, 4), &stream));
            let (mut ga, mut gb) = (device(c, &[0.0; N], &stream), device(c, &[0.0; N], &stream));
            let mut ops = [
                P2pOp::recv(&mut ga, N, DataType::F32, prev),
                P2pOp::recv(&mut gb, N, DataType::F32, prev),
                P2pOp::send(&a, N, DataType::F32, next),
                P2pOp::send(&b, N, DataType::F32, next),
            ];
            c.p2p(&mut ops, &stream).expect("two messages each way");
            let got = (host(c, &ga, &stream), host(c, &gb, &stream));
            assert!(got == (msg(prev, 3), msg(prev, 4)), "rank {me}: the two messages, in order");
            group_depth(&s.rccl_path)
        });
        assert_eq!(out, vec![0; world], "world {world}: a group left open");
    }
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// An operation the library refuses inside the group (the fake computes no fp8) fails the call with an error
/// naming that operation; `ncclGroupEnd` still ran (no group left open), the group was discarded on every rank
/// (nobody waits for it), and the next group works. An `ncclGroupEnd` with no group open is refused and recorded.
#[test]
fn an_operation_refused_inside_a_group_names_it_and_closes_the_group() {
    let _g = serial();
    let s = setup();
    let mut comms = ranks(&s, 2);
    let out = per_rank(&mut comms, |c| {
        let (me, peer) = (c.rank(), 1 - c.rank());
        let stream = c.runtime().stream().expect("stream");
        let send = device(c, &[1.0; 4], &stream);
        let mut fp8 = c.runtime().alloc(4).expect("alloc");
        let mut ops = [P2pOp::send(&send, 4, DataType::F32, peer), P2pOp::recv(&mut fp8, 4, DataType::Fp8E4M3, peer)];
        let e = c.p2p(&mut ops, &stream).expect_err("the fake refuses fp8");
        let depth = group_depth(&s.rccl_path);
        let mut got = device(c, &[0.0; 4], &stream);
        c.send_recv(&send, peer, &mut got, peer, 4, DataType::F32, &stream).expect("the next group works");
        assert_eq!(host(c, &got, &stream), vec![1.0; 4], "rank {me}");
        (e, depth)
    });
    for (e, depth) in out {
        assert_eq!(depth, 0, "ncclGroupEnd ran after the failure");
        let text = e.to_string();
        assert!(matches!(e, Error::Backend { code: Some(4), .. }), "{e:?}");
        assert!(text.contains("ncclRecv (operation 1 of 2 in a group: receive of 4 × fp8"), "{text}");
    }
    assert_eq!(s.fake.violations(), Vec::<String>::new());
    let e = anyccl_ccl::result::group_end(&s.rccl).expect_err("no group is open");
    assert!(e.to_string().contains("ncclGroupEnd"), "{e}");
    let v = s.fake.violations();
    assert!(v.len() == 1 && v[0].contains("ncclGroupEnd without ncclGroupStart"), "{v:?}");
}

/// Color of parent rank `r` of `world`: even and odd ranks; the last rank of an odd world joins none.
fn color(r: usize, world: usize) -> Option<u32> {
    (world.is_multiple_of(2) || r + 1 < world).then_some((r % 2) as u32)
}

/// `ncclCommSplit` through `Communicator::split`: two colors whose keys reverse the parent order; each
/// sub-communicator ranks its members by key, all-reduces its own members' values, and runs a grouped ring; the
/// rank with no color gets `None`; the parent still all-reduces after. A bootstrap over each sub-communicator
/// (`CclBootstrap`) gathers its own members' bytes.
#[test]
fn split_makes_independent_sub_communicators_on_the_fake_rccl() {
    let _g = serial();
    let s = setup();
    for world in [4, 5] {
        let mut comms = ranks(&s, world);
        let out = per_rank(&mut comms, |c| {
            let (me, world) = (c.rank(), c.world_size());
            let stream = c.runtime().stream().expect("stream");
            let sub = c.split(color(me, world), (world - me) as u32).expect("split");
            let line = match (color(me, world), sub) {
                (None, None) => "none".to_owned(),
                (Some(col), Some(mut sub)) => {
                    let members: Vec<usize> = (0..world).filter(|r| color(*r, world) == Some(col)).rev().collect();
                    assert_eq!((members[sub.rank()], sub.world_size()), (me, members.len()), "rank {me}");
                    let mut b = device(c, &[(me + 1) as f32], &stream);
                    sub.all_reduce(InOut::InPlace(&mut b), 1, DataType::F32, ReduceOp::Sum, &stream).expect("sub sum");
                    let sum = host(c, &b, &stream)[0];
                    assert_eq!(sum, members.iter().map(|r| (r + 1) as f32).sum::<f32>(), "rank {me}");
                    let (n, sr) = (sub.world_size(), sub.rank());
                    let send = device(c, &msg(me, 9), &stream);
                    let mut got = device(c, &[0.0; N], &stream);
                    sub.send_recv(&send, (sr + 1) % n, &mut got, (sr + n - 1) % n, N, DataType::F32, &stream)
                        .expect("ring in the sub-communicator");
                    let want = msg(members[(sr + n - 1) % n], 9);
                    assert!(host(c, &got, &stream) == want, "rank {me}: wrong message in the sub-communicator");
                    let mut boot = CclBootstrap::new(&sub.backend().ccl, sub.runtime(), &stream);
                    let all = boot.all_gather(&[me as u8; 3]).expect("bootstrap over the sub-communicator");
                    assert_eq!(all, members.iter().map(|r| vec![*r as u8; 3]).collect::<Vec<_>>(), "rank {me}");
                    format!("{sr}/{n}:{sum}")
                }
                (c, s) => panic!("rank {me}: color {c:?}, sub-communicator {}", s.is_some()),
            };
            let mut b = device(c, &[1.0], &stream);
            c.all_reduce(InOut::InPlace(&mut b), 1, DataType::F32, ReduceOp::Sum, &stream).expect("parent");
            assert_eq!(host(c, &b, &stream), vec![world as f32], "rank {me}: the parent after the split");
            line
        });
        let want: Vec<String> = match world {
            4 => vec!["1/2:4", "1/2:6", "0/2:4", "0/2:6"],
            _ => vec!["1/2:4", "1/2:6", "0/2:4", "0/2:6", "none"],
        }
        .into_iter()
        .map(String::from)
        .collect();
        assert_eq!(out, want, "world {world}");
    }
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}

/// A release without `ncclCommSplit` (NCCL 2.17): the split is refused with the capability's reason, naming the
/// symbol, the file and the release, before the library is asked.
#[test]
fn split_without_nccl_comm_split_says_why() {
    let path = fake_ccl::build_profile(&NCCL_2_17);
    let lib = Arc::new(CclLibrary::open(&path).expect("fake NCCL 2.17"));
    let id = UniqueId::new(&lib).expect("id");
    let rank = CclComm::init_rank(lib.clone(), 1, &id, 0).expect("init");
    let caps = anyccl_ccl::derive_capabilities(&lib, &|_| None);
    // SAFETY: a live communicator of `lib`; the call is refused before the library is reached (no symbol).
    let raw = unsafe { anyccl_ccl::result::comm_split(&lib, rank.handle().expect("live"), 0, 0) };
    for e in [rank.split(&caps, Some(0), 0).err().expect("refused"), raw.expect_err("refused")] {
        let text = e.to_string();
        assert!(matches!(&e, Error::Unsupported { capability, .. } if capability == "comm-split"), "{e:?}");
        assert!(text.contains("ncclCommSplit") && text.contains("NCCL 2.17.1"), "{text}");
        assert!(text.contains(&path.display().to_string()), "{text}");
    }
}

/// The bootstrap over the communicator, 3 ranks as threads: payloads of different lengths (one empty) arrive
/// intact, broadcast and barrier work over it; one over the limit is refused on every rank (the sender with
/// `SizeTooLarge`, the others naming it) without hanging, and the bootstrap works again after; during a capture
/// it is refused before anything is exchanged.
#[test]
fn the_bootstrap_over_the_communicator_gathers_bounded_payloads() {
    let _g = serial();
    let s = setup();
    let mut comms = ranks(&s, 3);
    let payload = |r: usize| (0..[5usize, 0, 3000][r]).map(|i| (i * 7 + r) as u8).collect::<Vec<u8>>();
    let out = per_rank(&mut comms, |c| {
        let me = c.rank();
        let stream = c.runtime().stream().expect("stream");
        let mut boot = CclBootstrap::new(&c.backend().ccl, c.runtime(), &stream).with_limit(4096);
        assert_eq!((boot.rank(), boot.world(), boot.limit()), (me, 3, 4096));
        let all = boot.all_gather(&payload(me)).expect("all-gather");
        assert_eq!(all, (0..3).map(payload).collect::<Vec<_>>(), "rank {me}");
        assert_eq!(boot.broadcast(2, Some(b"from two")).expect("broadcast"), b"from two");
        boot.barrier().expect("barrier");
        let big = vec![1u8; if me == 1 { 5000 } else { 10 }];
        let refused = boot.all_gather(&big).expect_err("rank 1's payload is over the limit");
        let again = boot.all_gather(&[me as u8]).expect("the bootstrap still works");
        assert_eq!(again, vec![vec![0], vec![1], vec![2]]);
        refused
    });
    let too_large =
        InvalidArgument::SizeTooLarge { what: "a bootstrap all-gather payload", requested: 5000, limit: 4096 };
    assert_eq!(out[1], Error::InvalidArgument(too_large));
    for e in [&out[0], &out[2]] {
        assert!(matches!(e, Error::PeerFailure(m) if m.contains("rank 1 contributed 5000 bytes")), "{e}");
    }
    // During a capture: refused with the capture still valid, nothing exchanged (world 1: no peer to wait for).
    let mut one = ranks(&s, 1);
    let c = &mut one[0];
    let stream = c.runtime().stream().expect("stream");
    let calls = s.fake.calls("hipMalloc");
    let graph = HipGraph::capture(&stream, |st| {
        let mut boot = CclBootstrap::new(&c.backend().ccl, c.runtime(), st);
        let e = boot.all_gather(b"x").expect_err("refused during capture");
        assert!(matches!(e, Error::InvalidArgument(InvalidArgument::DuringCapture { .. })), "{e}");
        Ok(())
    });
    assert!(graph.is_ok(), "the capture stayed valid: {:?}", graph.err());
    assert_eq!(s.fake.calls("hipMalloc"), calls, "nothing allocated during the capture");
    assert_eq!(s.fake.violations(), Vec::<String>::new());
}
