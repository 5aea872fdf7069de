//! The GPU-communicator suite, written once for every [`GpuPlatform`]: each case takes a [`Harness`] (the fake
//! runtime's records, `world` communicators of one process, and the few things only the platform's own types can
//! do: graph capture, a stream's raw handle) and checks what the generic engine does, whatever the vendor. `backends/cuda/tests/fake.rs` runs it on the fake CUDA driver and
//! `backends/rocm/tests/custom/main.rs` on the fake HIP runtime; each adds only what is its platform's own.

use anyccl_core::comm::AllReduceCall;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyccl_ccl::{CclLibrary, UniqueId};

use anyccl_core::bootstrap::LocalGroup;
use anyccl_core::{
    Algorithm, Bootstrap, CapabilityReport, CaptureMode, CommBackend, Communicator, DataType, Error, InOut,
    InvalidArgument, MemoryRuntime, P2pOp, ReduceOp, Result, Selector,
};
use anyccl_gpu::comm::{custom_blocks, DEFAULT_CUSTOM_MAX_BLOCKS};
use anyccl_gpu::{GpuComm, GpuPlatform, StreamOf};

use crate::fake_hip::{FakeHip, Launch, Shot};

pub use anyccl_kernels_common::catalogue::{self, Family};

/// An environment to read settings from (`ANYCCL_HOST_ID`, ...), in place of the process's.
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;
/// A platform's stream.
pub type Stream<H> = StreamOf<<H as Harness>::P>;
/// A platform's device buffer.
pub type Buffer<H> = <<<H as Harness>::P as GpuPlatform>::Runtime as MemoryRuntime>::OwnedBuffer;
/// A rank's captured graph, its stream, input and output.
pub type Captured<H> = (<H as Harness>::Graph, Stream<H>, Buffer<H>, Buffer<H>);

/// What the suite needs of a platform's test: the fake runtime's records, `world` communicators of one process
/// (`ncclCommInitAll`) with the custom kernels set up, and the platform's graph capture.
pub trait Harness: Sync {
    /// The platform under test.
    type P: GpuPlatform;
    /// An instantiated captured graph.
    type Graph: Send;
    /// The driver call that writes a 32-bit word from a stream (the abort word).
    const WRITE_VALUE: &'static str;
    /// The abort word's byte offset in a rank's flag array (the kernels' `ABORT_WORD_OFFSET`).
    const ABORT_WORD_OFFSET: usize;
    /// The driver calls that export, open and close a legacy IPC handle, and load a module.
    const IPC_GET: &'static str;
    /// See [`Self::IPC_GET`].
    const IPC_OPEN: &'static str;
    /// See [`Self::IPC_GET`].
    const IPC_CLOSE: &'static str;
    /// See [`Self::IPC_GET`].
    const MODULE_LOAD: &'static str;
    /// What a 4 KiB f32 sum of a one-process-per-GPU job runs: the push one-shot where the platform offers it.
    const SMALL: Algorithm;

    /// The loaded collective library (the fake NCCL or RCCL).
    fn lib(&self) -> &Arc<CclLibrary>;
    /// The device of `ordinal`.
    fn device(&self, ordinal: i32) -> <Self::P as GpuPlatform>::DeviceSpec;
    /// The capability report a communicator of this process gets (no environment).
    fn caps(&self) -> CapabilityReport;

    /// The fake runtime's test interface (the same loaded copy the backend uses).
    fn fake(&self) -> &FakeHip;
    /// `world` communicators of one process.
    fn comms(&self, world: usize) -> Vec<Communicator<GpuComm<Self::P>>>;
    /// Rank `rank` of a one-process-per-GPU job of `world` ranks on device `rank`, through `boot`: the unique id from
    /// rank 0, then the library's communicator and the custom kernels over IPC. `env` set: the generic join with
    /// that environment; unset: the platform's own public path.
    fn join(
        &self,
        boot: &mut dyn Bootstrap,
        rank: usize,
        world: usize,
        env: Option<Env<'_>>,
    ) -> Result<Communicator<GpuComm<Self::P>>>;
    /// Captures what `f` enqueues on `stream` into a graph.
    fn capture(
        rt: &<Self::P as GpuPlatform>::Runtime,
        stream: &Stream<Self>,
        mode: CaptureMode,
        f: &mut dyn FnMut(&Stream<Self>) -> Result<()>,
    ) -> Result<Self::Graph>;
    /// Launches `graph` on `stream`.
    fn replay(graph: &Self::Graph, stream: &Stream<Self>) -> Result<()>;
    /// The stream's raw handle, as the fake records it.
    fn raw(stream: &Stream<Self>) -> *mut c_void;
}

/// Runs `f` on one thread per rank.
pub fn per_rank<P: GpuPlatform, T: Send>(
    comms: &mut [Communicator<GpuComm<P>>],
    f: impl Fn(&mut Communicator<GpuComm<P>>) -> T + Sync,
) -> Vec<T> {
    std::thread::scope(|sc| {
        let hs: Vec<_> = comms.iter_mut().map(|c| sc.spawn(|| f(c))).collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

/// Small integers, exact in f32, bf16 and i32 and in their sums over 8 ranks.
pub fn value(rank: usize, round: usize, i: usize) -> f32 {
    ((i * 7 + rank * 13 + round * 5) % 17) as f32 - 8.0
}

/// `v` as the bytes of `dtype` (f32, i32 or bf16; exact for [`value`]'s integers).
pub fn encode(dtype: DataType, v: &[f32]) -> Vec<u8> {
    match dtype {
        DataType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DataType::I32 => v.iter().flat_map(|x| (*x as i32).to_le_bytes()).collect(),
        // Exact for these integers: bf16 is the upper half of the f32.
        DataType::Bf16 => v.iter().flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes()).collect(),
        other => panic!("no encoding for {other}"),
    }
}

/// The bytes of `dtype` as f32 values.
pub fn decode(dtype: DataType, b: &[u8]) -> Vec<f32> {
    match dtype {
        DataType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        DataType::I32 => b.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32).collect(),
        DataType::Bf16 => {
            b.chunks_exact(2).map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16)).collect()
        }
        other => panic!("no decoding for {other}"),
    }
}

/// Rank `rank`'s input of round `round`.
pub fn input(dtype: DataType, rank: usize, round: usize, count: usize) -> Vec<u8> {
    encode(dtype, &(0..count).map(|i| value(rank, round, i)).collect::<Vec<_>>())
}

/// The sums of round `round`'s inputs over `world` ranks.
pub fn reference(world: usize, round: usize, count: usize) -> Vec<f32> {
    (0..count).map(|i| (0..world).map(|r| value(r, round, i)).sum()).collect()
}

/// Rank `c`'s all-reduce of `count` `dtype` values (round `round`'s inputs, [`input`]), in place or not, on a new
/// stream of its runtime; returns the algorithm that ran and the sums read back.
pub fn reduce_once<P: GpuPlatform>(
    c: &mut Communicator<GpuComm<P>>,
    dtype: DataType,
    count: usize,
    round: usize,
    in_place: bool,
) -> Result<(Algorithm, Vec<f32>)> {
    reduce_once_with(c, None, dtype, count, round, in_place)
}

/// [`reduce_once`] with `algorithm` named (`all_reduce_with`), or selected where `None`.
pub fn reduce_once_with<P: GpuPlatform>(
    c: &mut Communicator<GpuComm<P>>,
    algorithm: Option<Algorithm>,
    dtype: DataType,
    count: usize,
    round: usize,
    in_place: bool,
) -> Result<(Algorithm, Vec<f32>)> {
    let bytes = count * dtype.size_bytes();
    let rt = c.runtime().clone();
    let st = P::stream(&rt)?;
    let mut a = rt.alloc(bytes)?;
    rt.upload(&mut a, &input(dtype, c.rank(), round, count), &st)?;
    let mut b = rt.alloc(bytes)?;
    let io = if in_place { InOut::InPlace(&mut a) } else { InOut::Separate { send: &a, recv: &mut b } };
    let ran = match algorithm {
        Some(named) => c.all_reduce_with(named, io, count, dtype, ReduceOp::Sum, &st).map(|()| named)?,
        None => c.all_reduce(io, count, dtype, ReduceOp::Sum, &st)?.algorithm,
    };
    rt.synchronize(&st)?;
    let mut host = vec![0u8; bytes];
    rt.download(if in_place { &a } else { &b }, &mut host, &st)?;
    Ok((ran, decode(dtype, &host)))
}

/// The kernel catalogue's name of `family`'s kernel for `dtype` (`anyccl_push_one_shot_bf16`); panics where the
/// catalogue has none.
pub fn catalogue_kernel(family: Family, dtype: DataType) -> String {
    catalogue::Dtype::from_suffix(dtype.name())
        .and_then(|d| catalogue::kernel_name(family, d))
        .unwrap_or_else(|| panic!("the kernel catalogue has no {family:?} kernel for {dtype}"))
}

/// The catalogue's name of the `shot` kernel, with an input table or not: `anyccl_{one,two}_shot[_table]_<type>`.
pub fn kernel(shot: Shot, table: bool, dtype: DataType) -> String {
    let family = match shot {
        Shot::One => Family::OneShot { table },
        Shot::Two => Family::TwoShot { table },
    };
    catalogue_kernel(family, dtype)
}

/// The kernel family of a custom algorithm.
pub fn shot_of(a: Algorithm) -> Shot {
    match a {
        Algorithm::OneShot => Shot::One,
        Algorithm::TwoShot => Shot::Two,
        other => panic!("{other} is not a custom kernel"),
    }
}

/// An in-place eager sum of `count` elements, as the selector sees it.
pub fn call(count: usize, dtype: DataType) -> AllReduceCall {
    AllReduceCall {
        count,
        dtype,
        op: ReduceOp::Sum,
        bytes: count * dtype.size_bytes(),
        in_place: true,
        capturing: false,
        bufs: None,
    }
}

/// The launches recorded since `from` must be `world` launches of `name`, one per rank, with the communicator's
/// grid for `bytes`, 512 threads, and decoded parameters for `world` ranks of `bytes / 16` vectors and every
/// rank's flags; returns them.
pub fn check_launches(fake: &FakeHip, from: u64, world: usize, name: &str, bytes: usize) -> Vec<Launch> {
    let new: Vec<Launch> = fake.launches().into_iter().filter(|l| l.seq > from).collect();
    assert_eq!(new.len(), world, "one launch per rank: {new:?}");
    let blocks = custom_blocks(bytes, DEFAULT_CUSTOM_MAX_BLOCKS);
    let mut ranks: Vec<i32> = Vec::new();
    for l in &new {
        assert_eq!(l.name, name);
        assert_eq!((l.grid, l.block, l.status), ([blocks, 1, 1], [512, 1, 1], 0), "{l:?}");
        let p = l.params.as_ref().expect("decoded all-reduce parameters");
        assert_eq!((p.world as usize, p.n_vec as usize), (world, bytes / 16), "{l:?}");
        assert!(p.flags[..world].iter().all(|f| *f != 0), "every rank's flags: {l:?}");
        ranks.push(p.rank);
    }
    ranks.sort();
    assert_eq!(ranks, (0..world as i32).collect::<Vec<_>>());
    new
}

/// `init_all` at worlds 2 and 4: for eligible f32 and bf16 sums (4 KiB and 1 MiB, in place and out of place) the
/// selector picks one-shot or two-shot (what `table(world, bytes)` says where it says), the communicator launches
/// exactly that kernel once per rank with the grid for the size and every rank's flags, and the kernels' results (their
/// source run by the fakes) equal the host reference; 1 KiB takes one-shot; 40 bytes (not whole vectors) and i32 (no
/// kernel) are refused by the custom kernels with the reason, go to the collective library with no kernel launched, and
/// sum right.
pub fn init_all<H: Harness>(h: &H, table: impl Fn(usize, usize) -> Option<Algorithm>) {
    for world in [2usize, 4] {
        let mut cs = h.comms(world);
        assert!(cs[0].backend().custom_kernels_off().is_none(), "{:?}", cs[0].backend().custom_kernels_off());
        let cases = [
            (DataType::F32, 4096usize, false),
            (DataType::Bf16, 4096, true),
            (DataType::F32, 1 << 20, true),
            (DataType::Bf16, 1 << 20, false),
        ];
        for (round, (dtype, bytes, in_place)) in cases.into_iter().enumerate() {
            let count = bytes / dtype.size_bytes();
            let want = cs[0].select_all_reduce(&call(count, dtype)).expect("selection").algorithm;
            assert!(matches!(want, Algorithm::OneShot | Algorithm::TwoShot), "world {world} {dtype} {bytes}: {want}");
            if let Some(expected) = table(world, bytes) {
                assert_eq!(want, expected, "the default table at world {world}, {bytes} bytes");
            }
            let from = h.fake().launch_total();
            let out = per_rank(&mut cs, |c| reduce_once(c, dtype, count, round, in_place));
            let launches = check_launches(h.fake(), from, world, &kernel(shot_of(want), false, dtype), bytes);
            assert!(launches.iter().all(|l| !l.capturing && l.completed == 1), "{launches:?}");
            for (rank, r) in out.into_iter().enumerate() {
                let (algorithm, got) = r.unwrap_or_else(|e| panic!("world {world} {dtype} {bytes}: {e}"));
                assert_eq!(algorithm, want, "world {world} {dtype} {bytes} rank {rank}");
                assert!(got == reference(world, round, count), "world {world} {dtype} {bytes} rank {rank}: wrong sums");
            }
        }
        // The small sizes take one-shot on both vendors' default tables.
        assert_eq!(cs[0].select_all_reduce(&call(1024, DataType::F32)).expect("sel").algorithm, Algorithm::OneShot);
        // i32 (no custom kernel) and 40 bytes (not whole vectors) go to the library, which sums them right.
        let why = cs[0].check_algorithm(Algorithm::OneShot, &call(10, DataType::F32)).expect_err("40 bytes");
        assert!(why.to_string().contains("multiple of 16"), "{why}");
        let why = cs[0].check_algorithm(Algorithm::TwoShot, &call(64, DataType::I32)).expect_err("i32").to_string();
        assert!(why.contains("f32, f16 and bf16"), "{why}");
        for (dtype, count) in [(DataType::I32, 4096usize), (DataType::F32, 10)] {
            let from = h.fake().launch_total();
            let out = per_rank(&mut cs, |c| -> Result<(Algorithm, Vec<f32>)> {
                let rt = c.runtime().clone();
                let st = H::P::stream(&rt)?;
                let bytes = count * dtype.size_bytes();
                let mut a = rt.alloc(bytes)?;
                rt.upload(&mut a, &input(dtype, c.rank(), 7, count), &st)?;
                let sel = c.all_reduce(InOut::InPlace(&mut a), count, dtype, ReduceOp::Sum, &st)?;
                rt.synchronize(&st)?;
                let mut host = vec![0u8; bytes];
                rt.download(&a, &mut host, &st)?;
                Ok((sel.algorithm, decode(dtype, &host)))
            });
            assert_eq!(h.fake().launch_total(), from, "no kernel for {dtype} x {count}");
            for (rank, r) in out.into_iter().enumerate() {
                let (algorithm, got) = r.unwrap_or_else(|e| panic!("world {world} {dtype}: {e}"));
                assert_eq!(algorithm, Algorithm::Ccl, "world {world} {dtype} x {count} rank {rank}");
                assert!(got == reference(world, 7, count), "world {world} {dtype} rank {rank}: wrong sums");
            }
        }
    }
}

/// On a thread per rank: uploads round `round`'s input, replays the graph once and reads the output.
pub fn replay_all<H: Harness>(
    cs: &[Communicator<GpuComm<H::P>>],
    kept: &mut [Captured<H>],
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
                    H::replay(graph, st)?;
                    rt.synchronize(st)?;
                    let mut host = vec![0u8; out.len()];
                    rt.download(out, &mut host, st)?;
                    Ok(decode(dtype, &host))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

/// Graph capture: a captured out-of-place all-reduce (the algorithm the selector picks for a capturing call:
/// one-shot at world 2 and 4 KiB, `table(world, bytes)` where it says) launches the `_table` kernel (capturing,
/// nothing runs yet), a replay before registration reads its input through staging (`registered` 0),
/// `register_graph_buffers` registers the one input on every rank, and later replays read the registered inputs
/// directly (`registered` 1); every replay's sums are right.
pub fn graphs<H: Harness>(h: &H, table: impl Fn(usize, usize) -> Option<Algorithm>) {
    for (world, bytes) in [(2usize, 4096usize), (4, 1 << 20)] {
        let mut cs = h.comms(world);
        let dtype = DataType::F32;
        let count = bytes / 4;
        let mut capturing = call(count, dtype);
        (capturing.in_place, capturing.capturing) = (false, true);
        let want = cs[0].select_all_reduce(&capturing).expect("selection").algorithm;
        if let Some(expected) = table(world, bytes) {
            assert_eq!(want, expected, "the default table at world {world}, {bytes} bytes, capturing");
        }
        let from = h.fake().launch_total();
        // Captured by every rank on its own thread; replayed once before registration.
        let graphs = per_rank(&mut cs, |c| -> Result<_> {
            let rt = c.runtime().clone();
            let st = H::P::stream(&rt)?;
            let mut inp = rt.alloc(bytes)?;
            let mut out = rt.alloc(bytes)?;
            let mut chosen = None;
            let graph = H::capture(&rt, &st, CaptureMode::ThreadLocal, &mut |st| {
                let sel =
                    c.all_reduce(InOut::Separate { send: &inp, recv: &mut out }, count, dtype, ReduceOp::Sum, st)?;
                chosen = Some(sel.algorithm);
                Ok(())
            })?;
            let pending = c.pending_graph_buffers();
            rt.upload(&mut inp, &input(dtype, c.rank(), 0, count), &st)?;
            H::replay(&graph, &st)?;
            rt.synchronize(&st)?;
            let mut host = vec![0u8; bytes];
            rt.download(&out, &mut host, &st)?;
            Ok(((graph, st, inp, out), chosen, pending, decode(dtype, &host)))
        });
        let captured = check_launches(h.fake(), from, world, &kernel(shot_of(want), true, dtype), bytes);
        assert!(captured.iter().all(|l| l.capturing && l.runs == 1 && l.completed == 1), "{captured:?}");
        assert!(captured.iter().all(|l| l.params.as_ref().and_then(|p| p.last_registered) == Some(false)));
        let mut kept: Vec<Captured<H>> = Vec::new();
        for (rank, g) in graphs.into_iter().enumerate() {
            let (k, chosen, pending, got) = g.unwrap_or_else(|e| panic!("world {world} rank {rank}: {e}"));
            assert_eq!(chosen, Some(want), "rank {rank}");
            assert_eq!(pending, 1, "one input seen in the capture");
            assert!(got == reference(world, 0, count), "world {world} rank {rank}: first replay");
            kept.push(k);
        }
        // Registration: collective, every rank on its own thread (ranks of one process exchange pointers).
        let regs = per_rank(&mut cs, |c| c.register_graph_buffers(None));
        for r in regs {
            let r = r.expect("registration");
            assert_eq!((r.registered, r.kept_staged.len()), (1, 0), "{r:?}");
        }
        assert_eq!(cs[0].pending_graph_buffers(), 0);
        // Replays now read every rank's input directly.
        for (rank, r) in replay_all::<H>(&cs, &mut kept, dtype, 1).into_iter().enumerate() {
            assert!(r.expect("replay") == reference(world, 1, count), "world {world} rank {rank}: registered replay");
        }
        let replayed: Vec<Launch> = h.fake().launches().into_iter().filter(|l| l.seq > from).collect();
        for l in &replayed {
            assert_eq!((l.runs, l.completed, l.failed), (2, 2, 0), "{l:?}");
            assert_eq!(l.params.as_ref().and_then(|p| p.last_registered), Some(true), "{l:?}");
        }
        drop(kept);
    }
}

/// A wait that gives up on a peer tells this rank's custom kernels to stop: after a one-shot both ranks ran, rank
/// 0's stream never drains (as behind a kernel stuck on a dead peer), its wait times out within its bound, the
/// abort word of its flag array is written once (from the communicator's control stream, not the stuck one), and
/// the custom kernels go off with the reason (the next call fails). Rank 1 still chooses the kernel, whose launch
/// waits for rank 0 at its barrier for good: rank 1's own wait gives up, writes its abort word, which stops the
/// kernel (aborted, not timed out), and rank 1's kernels go off too. So the call fails on every rank and none
/// hangs.
pub fn abort<H: Harness>(h: &H) {
    let fake = h.fake();
    let mut cs = h.comms(2);
    let from = fake.launch_total();
    let ok = per_rank(&mut cs, |c| -> Result<()> {
        let rt = c.runtime().clone();
        let st = H::P::stream(&rt)?;
        let mut b = rt.alloc(4096)?;
        c.all_reduce(InOut::InPlace(&mut b), 1024, DataType::F32, ReduceOp::Sum, &st)?;
        c.wait(&st, Duration::from_secs(5))
    });
    assert!(ok.iter().all(|r| r.is_ok()), "{ok:?}");
    let launched = check_launches(fake, from, 2, "anyccl_one_shot_f32", 4096);
    let flags_of = |rank: i32| {
        let p = launched.iter().filter_map(|l| l.params.clone()).find(|p| p.rank == rank).expect("launch");
        (p.flags[rank as usize] + H::ABORT_WORD_OFFSET as u64) as *const u32
    };
    let (word0, word1) = (flags_of(0), flags_of(1));
    // SAFETY: the fake's device memory is host memory; the flag arrays live while the communicators do.
    let read = |w: *const u32| unsafe { std::ptr::read_volatile(w) };
    assert_eq!((read(word0), read(word1)), (0, 0), "the abort words start clear");

    let c = &mut cs[0];
    let rt = c.runtime().clone();
    let st = H::P::stream(&rt).expect("stream");
    fake.set_busy(H::raw(&st), true);
    let writes = fake.calls(H::WRITE_VALUE);
    let started = Instant::now();
    let err = c.wait(&st, Duration::from_millis(200)).expect_err("the stream never drains");
    assert!(matches!(err, Error::Timeout { .. } | Error::PeerFailure(_)), "{err}");
    assert!(started.elapsed() < Duration::from_secs(8), "bounded: {:?}", started.elapsed());
    assert_eq!(fake.calls(H::WRITE_VALUE), writes + 1, "the abort word was written once");
    assert_eq!(read(word0), 1, "rank 0's abort word is set");
    let off = c.backend().custom_kernels_off().expect("off").to_owned();
    assert!(off.contains("an earlier wait failed"), "{off}");
    let mut b = rt.alloc(4096).expect("buffer");
    assert!(c.all_reduce(InOut::InPlace(&mut b), 1024, DataType::F32, ReduceOp::Sum, &st).is_err(), "aborted");
    fake.set_busy(H::raw(&st), false);

    let c = &mut cs[1];
    let rt = c.runtime().clone();
    let st = H::P::stream(&rt).expect("stream");
    let mut b = rt.alloc(4096).expect("buffer");
    let from = fake.launch_total();
    let sel = c.all_reduce(InOut::InPlace(&mut b), 1024, DataType::F32, ReduceOp::Sum, &st).expect("rank 1 launches");
    assert_eq!(sel.algorithm, Algorithm::OneShot, "rank 1 has seen no failure");
    let started = Instant::now();
    let err = c.wait(&st, Duration::from_millis(300)).expect_err("rank 0 never comes");
    assert!(matches!(err, Error::Timeout { .. } | Error::PeerFailure(_)), "{err}");
    assert!(started.elapsed() < Duration::from_secs(8), "bounded: {:?}", started.elapsed());
    assert_eq!(fake.calls(H::WRITE_VALUE), writes + 2, "rank 1's abort word was written once");
    assert_eq!(read(word1), 1, "rank 1's abort word is set");
    let stuck: Vec<Launch> = fake.launches().into_iter().filter(|l| l.seq > from).collect();
    assert_eq!(stuck.len(), 1, "{stuck:?}");
    assert_eq!((stuck[0].runs, stuck[0].aborted, stuck[0].timed_out, stuck[0].completed), (1, 1, 0, 0), "{stuck:?}");
    let off = c.backend().custom_kernels_off().expect("off on rank 1 too").to_owned();
    assert!(off.contains("an earlier wait failed"), "{off}");
}

/// A rank's eager sums, its registered replay's sums, how many graph inputs it registered, and the communicator.
type RankResult<P> = (Vec<f32>, Vec<f32>, usize, Communicator<GpuComm<P>>);

/// One process per GPU, simulated as threads over an in-process bootstrap (world 3): every rank joins through the
/// platform's public path, exports its three buffers' IPC handles and opens its peers' (the fake's handles name
/// allocations, so threads work), all-reduces with the kernels reading the peers' mapped buffers, and registers a
/// captured input over IPC through the same bootstrap (replays read it: `registered` 1); every mapping is open while
/// the communicators live and closed with them.
pub fn ipc_threads<H: Harness>(h: &H) {
    let fake = h.fake();
    let world = 3;
    let (gets, opens, closes) = (fake.calls(H::IPC_GET), fake.calls(H::IPC_OPEN), fake.calls(H::IPC_CLOSE));
    let group = LocalGroup::new(world, Duration::from_secs(30));
    let bytes = 8192;
    let count = bytes / 4;
    let from = fake.launch_total();
    let outcomes = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let mut boot = group.member(rank);
                sc.spawn(move || -> Result<RankResult<H::P>> {
                    let mut c = h.join(&mut boot, rank, world, None)?;
                    let rt = c.runtime().clone();
                    let st = H::P::stream(&rt)?;
                    let mut inp = rt.alloc(bytes)?;
                    let mut out = rt.alloc(bytes)?;
                    rt.upload(&mut inp, &input(DataType::F32, rank, 0, count), &st)?;
                    let io = InOut::Separate { send: &inp, recv: &mut out };
                    c.all_reduce(io, count, DataType::F32, ReduceOp::Sum, &st)?;
                    rt.synchronize(&st)?;
                    let mut host = vec![0u8; bytes];
                    rt.download(&out, &mut host, &st)?;
                    let eager = decode(DataType::F32, &host);
                    let graph = H::capture(&rt, &st, CaptureMode::ThreadLocal, &mut |st| {
                        let io = InOut::Separate { send: &inp, recv: &mut out };
                        c.all_reduce(io, count, DataType::F32, ReduceOp::Sum, st).map(|_| ())
                    })?;
                    let reg = c.register_graph_buffers(Some(&mut boot))?;
                    rt.upload(&mut inp, &input(DataType::F32, rank, 1, count), &st)?;
                    H::replay(&graph, &st)?;
                    rt.synchronize(&st)?;
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
    let launched: Vec<Launch> = fake.launches().into_iter().filter(|l| l.seq > from).collect();
    assert_eq!(launched.iter().filter(|l| l.name == "anyccl_one_shot_f32").count(), world, "{launched:?}");
    let table: Vec<&Launch> = launched.iter().filter(|l| l.name == "anyccl_one_shot_table_f32").collect();
    assert_eq!(table.len(), world);
    assert!(table.iter().all(|l| l.params.as_ref().and_then(|p| p.last_registered) == Some(true)), "{table:?}");
    // Setup: staging, scratch and flags of every rank, each opened by every peer; then one graph input each.
    let n = world as i32;
    assert_eq!(fake.calls(H::IPC_GET) - gets, 3 * n + n);
    assert_eq!(fake.calls(H::IPC_OPEN) - opens, (3 + 1) * n * (n - 1));
    assert_eq!(fake.ipc_open_count(), (3 + 1) * n * (n - 1), "every mapping open while the communicators live");
    drop(comms);
    assert_eq!(fake.ipc_open_count(), 0, "every mapping closed with its communicator");
    assert_eq!(fake.calls(H::IPC_CLOSE) - closes, (3 + 1) * n * (n - 1));
}

/// Ranks that report different hosts (`ANYCCL_HOST_ID` per rank, through each rank's own environment) turn the
/// custom kernels off with the reason before any IPC handle is exported or opened and before the kernels are even
/// loaded, and the collective library serves the call with the right sums.
pub fn two_hosts<H: Harness>(h: &H) {
    let fake = h.fake();
    let world = 2;
    let names = [H::IPC_GET, H::IPC_OPEN, H::MODULE_LOAD, "hipIpcGetMemHandle"];
    let before: Vec<i32> = names.iter().map(|n| fake.calls(n)).collect();
    let group = LocalGroup::new(world, Duration::from_secs(30));
    let outcomes = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let mut boot = group.member(rank);
                sc.spawn(move || -> Result<(String, Algorithm, Vec<f32>)> {
                    let host = if rank == 0 { "node-a" } else { "node-b" };
                    let env = move |k: &str| (k == "ANYCCL_HOST_ID").then(|| host.to_owned());
                    let mut c = h.join(&mut boot, rank, world, Some(&env))?;
                    let off = c.backend().custom_kernels_off().unwrap_or_default().to_owned();
                    let rt = c.runtime().clone();
                    let st = H::P::stream(&rt)?;
                    let mut b = rt.alloc(4096)?;
                    rt.upload(&mut b, &input(DataType::F32, rank, 0, 1024), &st)?;
                    let sel = c.all_reduce(InOut::InPlace(&mut b), 1024, DataType::F32, ReduceOp::Sum, &st)?;
                    rt.synchronize(&st)?;
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
    for (name, before) in names.iter().zip(before) {
        assert_eq!(fake.calls(name), before, "{name}: no IPC handle and not even the kernels before the check");
    }
}

/// Custom-kernel setup inside a global capture (the one-process-per-GPU path: `init_rank`, then
/// `enable_custom_ipc_with_env`) is refused before the driver sees anything (no allocation, module load or IPC
/// call, the capture stays valid), every rank alike; after the capture the same setup succeeds and the kernel
/// ([`Harness::SMALL`]) runs with the right sums. Only the setup after the capture reaches the driver: three IPC
/// handles per rank (staging, scratch, flags; four with the push one-shot's receive buffer), one module load.
pub fn ipc_during_capture<H: Harness>(h: &H) {
    let fake = h.fake();
    let world = 2;
    let group = LocalGroup::new(world, Duration::from_secs(30));
    let env = |k: &str| (k == "ANYCCL_HOST_ID").then(|| "node-a".to_owned());
    let caps = Arc::new(h.caps());
    let id = UniqueId::new(h.lib()).expect("unique id");
    let (gets, loads) = (fake.calls(H::IPC_GET), fake.calls(H::MODULE_LOAD));
    let outcomes = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let mut boot = group.member(rank);
                let (env, caps, id) = (&env, caps.clone(), &id);
                sc.spawn(move || -> Result<(Error, Algorithm, Vec<f32>)> {
                    let device = h.device(rank as i32);
                    let mut comm = GpuComm::<H::P>::init_rank(h.lib().clone(), device, world, rank, id, caps)?;
                    let rt = comm.runtime().clone();
                    let st = H::P::stream(&rt)?;
                    // A global capture refuses allocation on every thread: every rank is set up before any
                    // captures, and every capture has ended before any rank allocates again.
                    boot.barrier()?;
                    let mut during = None;
                    let _graph = H::capture(&rt, &st, CaptureMode::Global, &mut |_| {
                        during = Some(comm.enable_custom_ipc_with_env(&mut boot, env));
                        Ok(())
                    })?;
                    let refused = during.and_then(|r| r.err()).expect("refused during the capture");
                    boot.barrier()?;
                    comm.enable_custom_ipc_with_env(&mut boot, env)?;
                    let mut c = Communicator::new(comm, Arc::new(Selector::defaults()));
                    let mut b = rt.alloc(4096)?;
                    rt.upload(&mut b, &input(DataType::F32, rank, 0, 1024), &st)?;
                    let sel = c.all_reduce(InOut::InPlace(&mut b), 1024, DataType::F32, ReduceOp::Sum, &st)?;
                    rt.synchronize(&st)?;
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
            matches!(refused, Error::InvalidArgument(InvalidArgument::DuringCapture { .. })),
            "rank {rank}: {refused}"
        );
        assert_eq!(algorithm, H::SMALL, "rank {rank}: set up after the capture");
        assert!(got == reference(world, 0, 1024), "rank {rank}");
    }
    let handles = if H::SMALL == Algorithm::OneShotPush { 4 } else { 3 };
    assert_eq!(fake.calls(H::IPC_GET) - gets, handles * world as i32);
    assert_eq!(fake.calls(H::MODULE_LOAD) - loads, world as i32);
}

/// What one rank of the split case saw: its sub-communicator's rank and world, the sub all-reduce's algorithm and
/// sums, and what the grouped ring exchange on the parent received.
type SplitSeen = (usize, usize, Algorithm, Vec<f32>, Vec<f32>);

/// Sub-communicators of a one-process-per-GPU job (threads here, world 4): `split(rank % 2)` makes two of two
/// ranks, each with its own custom-kernel state set up over IPC through the sub-communicator itself, so an
/// all-reduce on it runs the kernel ([`Harness::SMALL`]) over its two ranks (one world-2 launch per rank) and sums
/// only theirs; a grouped ring of sends and receives on the parent (each rank receives before it sends in its list)
/// completes. On a single-process parent the sub's kernels are off with the reason.
pub fn split<H: Harness>(h: &H) {
    let fake = h.fake();
    let world = 4;
    let group = LocalGroup::new(world, Duration::from_secs(30));
    let from = fake.launch_total();
    let outcomes = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let mut boot = group.member(rank);
                sc.spawn(move || -> Result<SplitSeen> {
                    let mut c = h.join(&mut boot, rank, world, None)?;
                    let rt = c.runtime().clone();
                    let st = H::P::stream(&rt)?;
                    let mut sub = c.split(Some(rank as u32 % 2), rank as u32)?.expect("a color was given");
                    let mut b = rt.alloc(4096)?;
                    rt.upload(&mut b, &input(DataType::F32, rank, 0, 1024), &st)?;
                    let sel = sub.all_reduce(InOut::InPlace(&mut b), 1024, DataType::F32, ReduceOp::Sum, &st)?;
                    rt.synchronize(&st)?;
                    let mut host = vec![0u8; 4096];
                    rt.download(&b, &mut host, &st)?;
                    // A ring on the parent: receive from the previous rank, send to the next, in one group.
                    let mut mine = rt.alloc(16)?;
                    rt.upload(&mut mine, &encode(DataType::F32, &[rank as f32; 4]), &st)?;
                    let mut got = rt.alloc(16)?;
                    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
                    let mut ops = [
                        P2pOp::Recv { buf: &mut got, count: 4, dtype: DataType::F32, peer: prev },
                        P2pOp::Send { buf: &mine, count: 4, dtype: DataType::F32, peer: next },
                    ];
                    c.p2p(&mut ops, &st)?;
                    rt.synchronize(&st)?;
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
        assert_eq!(algorithm, H::SMALL, "rank {rank}: the sub-communicator's own kernels");
        let peers = [rank % 2, rank % 2 + 2];
        let want: Vec<f32> = (0..1024).map(|i| peers.iter().map(|r| value(*r, 0, i)).sum()).collect();
        assert!(sums == want, "rank {rank}: the sum over its sub-communicator only");
        assert_eq!(ring, vec![((rank + world - 1) % world) as f32; 4], "rank {rank}: the previous rank's values");
    }
    let world_of = |l: &Launch| l.push.as_ref().map(|p| p.world).or(l.params.as_ref().map(|p| p.world));
    let subs: Vec<Launch> = fake.launches().into_iter().filter(|l| l.seq > from && world_of(l) == Some(2)).collect();
    assert_eq!(subs.len(), world, "one world-2 kernel per rank: {subs:?}");

    // One process: the sub-communicators' kernels are off, with the reason, and the library serves them.
    let mut cs = h.comms(2);
    let subs = per_rank(&mut cs, |c| {
        c.split(Some(0), 0).map(|sub| sub.map(|s| s.backend().custom_kernels_off().map(str::to_owned)))
    });
    for sub in subs {
        let why = sub.expect("split").expect("colored").expect("off");
        assert!(why.contains("peer access within one process"), "{why}");
    }
}

/// An all-reduce into a view of a larger buffer (world 1: the call copies `send` into the view) touches only the
/// view's range; more elements than the view holds are refused before anything is queued, and a view past the end
/// of the buffer is refused; a wait and a query then see the stream drained. Runs on the fakes and on a GPU.
pub fn all_reduce_into_a_view<P: GpuPlatform>(c: &mut Communicator<GpuComm<P>>, st: &StreamOf<P>) {
    let rt = c.runtime().clone();
    let (n, off, m) = (1024usize, 256usize, 128usize);
    let mut buf = rt.alloc(n * 4).expect("alloc");
    let host: Vec<f32> = (0..n).map(|i| i as f32).collect();
    rt.upload(&mut buf, &encode(DataType::F32, &host), st).expect("upload");
    let mut src = rt.alloc(m * 4).expect("alloc");
    rt.upload(&mut src, &encode(DataType::F32, &vec![7.0; m]), st).expect("upload");
    let base = buf.device_ptr();
    {
        let mut view = buf.view_mut(off * 4..(off + m) * 4).expect("view");
        assert_eq!((view.len(), view.device_ptr()), (m * 4, base + off as u64 * 4));
        c.all_reduce(InOut::Separate { send: &src, recv: &mut view }, m, DataType::F32, ReduceOp::Sum, st)
            .expect("all-reduce into the view");
        let e = c.all_reduce(InOut::InPlace(&mut view), m + 1, DataType::F32, ReduceOp::Sum, st).expect_err("short");
        assert!(matches!(e, Error::InvalidArgument(InvalidArgument::BufferTooSmall { .. })), "{e}");
    }
    let e = buf.view(..n * 4 + 1).err();
    assert!(matches!(e, Some(Error::InvalidArgument(InvalidArgument::RangeOutOfBounds { .. }))), "{e:?}");
    c.wait(st, Duration::from_secs(30)).expect("wait");
    assert!(c.query(st).expect("query"), "the stream drained");
    let mut out = vec![0u8; n * 4];
    rt.download(&buf, &mut out, st).expect("download");
    for (i, v) in decode(DataType::F32, &out).into_iter().enumerate() {
        let want = if (off..off + m).contains(&i) { 7.0 } else { i as f32 };
        assert_eq!(v, want, "element {i}");
    }
}

/// A registration whose table write fails on one rank fails on every rank alike, with no rank left reading
/// registered inputs while its peer reads staging: the fake fails rank 1's table copy (device 1's copies of the
/// table's size). With one failing copy the revert succeeds: every rank errs naming rank 1, a replay reads staging on both ranks (`registered` 0) with right
/// sums, the input stays pending, and the next registration succeeds. With two (the revert fails too) every rank
/// errs saying the graphs must not be replayed, and the custom kernels are off on both ranks. Before the agreement
/// round, rank 0 returned `Ok` with the input registered while rank 1 failed and kept staging.
pub fn table_write_failure<H: Harness>(h: &H) {
    let fake = h.fake();
    let (world, bytes, dtype) = (2usize, 4096usize, DataType::F32);
    let count = bytes / 4;
    let table_bytes = anyccl_gpu::kernels::INPUT_TABLE_BYTES;
    for failing in [1, 2] {
        let mut cs = h.comms(world);
        let from = fake.launch_total();
        let mut kept: Vec<_> = per_rank(&mut cs, |c| -> Result<_> {
            let rt = c.runtime().clone();
            let st = H::P::stream(&rt)?;
            let inp = rt.alloc(bytes)?;
            let mut out = rt.alloc(bytes)?;
            let graph = H::capture(&rt, &st, CaptureMode::ThreadLocal, &mut |st| {
                c.all_reduce(InOut::Separate { send: &inp, recv: &mut out }, count, dtype, ReduceOp::Sum, st)
                    .map(|_| ())
            })?;
            Ok((graph, st, inp, out))
        })
        .into_iter()
        .map(|r| r.expect("capture"))
        .collect();
        fake.fail_copies(1, table_bytes, failing);
        let regs = per_rank(&mut cs, |c| c.register_graph_buffers(None));
        fake.fail_copies(-1, 0, 0);
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
        for (rank, r) in replay_all::<H>(&cs, &mut kept, dtype, 0).into_iter().enumerate() {
            assert!(r.expect("replay") == reference(world, 0, count), "rank {rank}: replay after the failure");
        }
        let replayed: Vec<Launch> = fake.launches().into_iter().filter(|l| l.seq > from).collect();
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
}
