//! The host backend with one process per rank, started the way `torchrun` starts ranks: a stand-in launcher holds
//! `MASTER_PORT` (as torchrun's agent store does) and starts the ranks as child processes of this test binary
//! (test `rank`) with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`. Each rank joins through
//! `anyccl_host::from_env` and runs core's conformance suite as one rank; the launcher compares the ranks'
//! all-reduce hashes and an all-reduce against its own reference. Also: a rank killed with SIGKILL makes the
//! survivors fail with a clear error within the timeout, and the same API over a bring-your-own bootstrap.

use anyccl_testkit::launcher;

use std::process::{Child, Output};
use std::time::{Duration, Instant};

use launcher::{hold_master_port, result_line, text};

use std::path::Path;
use std::sync::Arc;

use anyccl_core::bootstrap::{Bootstrap, LocalGroup};
use anyccl_core::conformance::{compare_hashes, run_one_rank, Config, RankReport};
use anyccl_core::{Algorithm, CommBackend, Communicator, DataType, Error, InOut, ReduceOp, Selector};
use anyccl_host::{communicator_over, communicators, from_env, HostBuffer, HostOptions, HostRuntime};
use half::bf16;

/// A rank that has not finished by then is taken as hung.
const DEADLINE: Duration = Duration::from_secs(40);

/// The per-rank timeout of the killed-rank test (rendezvous and receives).
const KILL_TIMEOUT_SECS: u64 = 5;

fn suite() -> Config {
    Config { worlds: vec![], counts: vec![0, 1, 5, 77], dtypes: DataType::ALL.to_vec(), seed: 0x15 }
}

fn start(world: usize, port: u16, mode: &str, extra: &[(&str, String)]) -> Vec<Child> {
    let mut env = vec![("ANYCCL_HOST_CHILD", mode.to_owned())];
    env.extend(extra.iter().cloned());
    launcher::start_ranks(world, port, &env)
}

fn finish(rank: usize, child: Child, start: Instant) -> Output {
    launcher::finish(rank, child, start, DEADLINE)
}

/// Each rank's all-reduce result is `sum over q of (q + 1) * (i + 1)` for element `i`; the hash line of every rank
/// must be the same (bitwise identical all-reduce results across processes).
fn run_world(world: usize) {
    let held = hold_master_port();
    let port = held.local_addr().expect("addr").port();
    let t0 = Instant::now();
    let kids = start(world, port, "suite", &[]);
    let lines: Vec<String> = kids.into_iter().enumerate().map(|(r, c)| result_line(r, &finish(r, c, t0))).collect();
    let sum: f32 = (1..=world).map(|q| q as f32).sum();
    let want: Vec<String> = (0..4).map(|i| format!("{}", sum * (i + 1) as f32)).collect();
    let mut hashes = Vec::new();
    for (rank, l) in lines.iter().enumerate() {
        let mut parts = l.split(' ');
        assert_eq!(parts.next(), Some(format!("rank={rank}").as_str()), "{l}");
        assert_eq!(parts.next(), Some(format!("world={world}").as_str()), "{l}");
        assert_eq!(parts.next(), Some(format!("allreduce={}", want.join(",")).as_str()), "{l}");
        let checks: usize = parts.next().and_then(|c| c.strip_prefix("checks=")).expect("checks").parse().expect("n");
        assert!(checks > 100, "rank {rank} checked only {checks} calls: {l}");
        hashes.push(parts.next().expect("hashes").to_owned());
    }
    assert!(hashes.iter().all(|h| h == &hashes[0]), "all-reduce results differ between the processes: {hashes:?}");
}

#[test]
fn world_1_under_a_torchrun_stand_in() {
    run_world(1);
}

#[test]
fn world_2_under_a_torchrun_stand_in() {
    run_world(2);
}

#[test]
fn world_3_under_a_torchrun_stand_in() {
    run_world(3);
}

/// Ranks that a launcher places on two hosts (simulated per rank with `ANYCCL_HOST_ID`) are refused by every rank,
/// with the reason, before any shared memory or socket is set up.
#[test]
fn ranks_on_two_hosts_are_refused_with_the_reason_before_any_shared_memory() {
    let held = hold_master_port();
    let port = held.local_addr().expect("addr").port();
    // The ranks' temporary directory: anything they created on disk would be left in it.
    let dir = tempfile::tempdir().expect("tempdir");
    let shm_before = dev_shm_anyccl();
    let env = [("ANYCCL_HOST_CHILD", "hosts".to_owned()), ("TMPDIR", dir.path().display().to_string())];
    let t0 = Instant::now();
    let kids =
        launcher::start_ranks_each(3, port, &env, &|rank| vec![("ANYCCL_HOST_ID", format!("node-{}", rank / 2))]);
    for (rank, kid) in kids.into_iter().enumerate() {
        let l = result_line(rank, &finish(rank, kid, t0));
        assert!(l.contains("ranks span 2 hosts (rank 0 on node-0, rank 2 on node-1)"), "rank {rank}: {l}");
        assert!(l.contains("needs them on one host"), "rank {rank}: {l}");
        // Counted by the rank after the refusal: no segment is open or mapped.
        assert!(l.ends_with(" segment-fds=0 dev-shm=0 memfd-maps=0"), "rank {rank} set up a segment: {l}");
    }
    assert!(leftovers(dir.path()).is_empty(), "set up despite the refusal: {:?}", leftovers(dir.path()));
    assert!(new_in_dev_shm(&shm_before).is_empty(), "left in /dev/shm: {:?}", new_in_dev_shm(&shm_before));
}

/// The shared-memory capacity of the large-message tests: far below their messages, so they move in many chunks.
const SMALL_SHM: usize = 64 << 10;

/// Elements per rank of the large-message tests: 1 MiB + 12 bytes of f32, above the bootstrap's old 1 MiB limit
/// and sixteen times the segment capacity, and not a multiple of the chunk size.
const BIG: usize = (1 << 18) + 3;

/// Element `i` of rank `r`'s input: values whose f32 sums round differently in different orders.
fn value(r: usize, i: usize) -> f32 {
    ((r * 7919 + i * 104_729) % 20_011) as f32 * 0.0137 - 97.3
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// Every collective once with messages of `BIG` elements, each result checked against a reference computed
/// here (the ranks' reduction order, the threaded backend's kernels); returns the hashes of the results.
fn big_suite<B: CommBackend<Runtime = HostRuntime>>(comm: &mut Communicator<B>) -> anyccl_core::Result<String> {
    let (me, world) = (comm.rank(), comm.world_size());
    let ranks = 0..world;
    let mut line = format!("rank={me}");

    // all-reduce f32 sum, in place.
    let mut buf = HostBuffer::from_elems(&(0..BIG).map(|i| value(me, i)).collect::<Vec<_>>());
    comm.all_reduce(InOut::InPlace(buf.as_bytes_mut()), BIG, DataType::F32, ReduceOp::Sum, &())?;
    let want: Vec<f32> =
        (0..BIG).map(|i| ranks.clone().map(|r| value(r, i)).reduce(|a, b| a + b).unwrap_or(0.0)).collect();
    assert!(buf.to_vec::<f32>().iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "f32 sum, rank {me}");
    line += &format!(" ar_f32={:016x}", fnv(buf.as_bytes()));

    // all-reduce bf16 avg (accumulates in f32), separate buffers.
    let send = HostBuffer::from_elems(&(0..BIG).map(|i| bf16::from_f32(value(me, i))).collect::<Vec<_>>());
    let mut recv = HostBuffer::zeroed(send.len());
    let bufs = InOut::Separate { send: send.as_bytes(), recv: recv.as_bytes_mut() };
    comm.all_reduce(bufs, BIG, DataType::Bf16, ReduceOp::Avg, &())?;
    let want: Vec<bf16> = (0..BIG)
        .map(|i| {
            let sum = ranks.clone().map(|r| bf16::from_f32(value(r, i)).to_f32()).reduce(|a, b| a + b).unwrap_or(0.0);
            bf16::from_f32(sum / world as f32)
        })
        .collect();
    assert!(recv.to_vec::<bf16>() == want, "bf16 avg, rank {me}");
    line += &format!(" ar_bf16={:016x}", fnv(recv.as_bytes()));

    // all-gather f32, separate buffers.
    let send = HostBuffer::from_elems(&(0..BIG).map(|i| value(me, i)).collect::<Vec<_>>());
    let mut recv = HostBuffer::zeroed(send.len() * world);
    comm.all_gather(InOut::Separate { send: send.as_bytes(), recv: recv.as_bytes_mut() }, BIG, DataType::F32, &())?;
    let want: Vec<f32> = ranks.clone().flat_map(|r| (0..BIG).map(move |i| value(r, i))).collect();
    assert!(recv.to_vec::<f32>().iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "gather, rank {me}");
    line += &format!(" ag={:016x}", fnv(recv.as_bytes()));

    // broadcast of an odd number of bytes from the last rank, in place.
    let root = world - 1;
    let pattern = |i: usize| (i * 31 + 7) as u8;
    let n = 4 * BIG + 3;
    let mut buf = HostBuffer::from_elems(&(0..n).map(|i| if me == root { pattern(i) } else { 0 }).collect::<Vec<u8>>());
    comm.broadcast(InOut::InPlace(buf.as_bytes_mut()), n, DataType::U8, root, &())?;
    assert!(buf.to_vec::<u8>().iter().enumerate().all(|(i, b)| *b == pattern(i)), "broadcast, rank {me}");
    line += &format!(" bc={:016x}", fnv(buf.as_bytes()));

    // reduce-scatter f32 sum, in place: rank `me` keeps part `me` of the sum.
    let mut buf = HostBuffer::from_elems(&(0..BIG * world).map(|j| value(me, j)).collect::<Vec<_>>());
    comm.reduce_scatter(InOut::InPlace(buf.as_bytes_mut()), BIG, DataType::F32, ReduceOp::Sum, &())?;
    let got = buf.to_vec::<f32>();
    let mine = &got[me * BIG..(me + 1) * BIG];
    let ok = (0..BIG).all(|i| {
        let want = ranks.clone().map(|r| value(r, me * BIG + i)).reduce(|a, b| a + b).unwrap_or(0.0);
        mine[i].to_bits() == want.to_bits()
    });
    assert!(ok, "reduce-scatter, rank {me}");
    line += &format!(" rs={:016x}", fnv(bytemuck::cast_slice(mine)));

    // reduce f32 max to rank 1 (or 0), separate buffers.
    let root = 1 % world;
    let send = HostBuffer::from_elems(&(0..BIG).map(|i| value(me, i)).collect::<Vec<_>>());
    let mut recv = HostBuffer::zeroed(send.len());
    let bufs = InOut::Separate { send: send.as_bytes(), recv: recv.as_bytes_mut() };
    comm.reduce(bufs, BIG, DataType::F32, ReduceOp::Max, root, &())?;
    if me == root {
        let want: Vec<f32> = (0..BIG).map(|i| ranks.clone().map(|r| value(r, i)).fold(f32::MIN, f32::max)).collect();
        assert!(recv.to_vec::<f32>() == want, "reduce, rank {me}");
        line += &format!(" red={:016x}", fnv(recv.as_bytes()));
    }
    Ok(line)
}

/// The files left in `dir` (the tests' segment directory).
fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir).expect("the ranks' TMPDIR").map(|e| e.expect("entry").path().display().to_string()).collect()
}

/// The entries of `/dev/shm` whose name mentions anyccl (none is expected: the segments are memfds, which have no
/// name in any directory); a test compares the list before and after its ranks ran.
fn dev_shm_anyccl() -> Vec<String> {
    match std::fs::read_dir("/dev/shm") {
        Ok(d) => d
            .map(|e| e.expect("a /dev/shm entry").file_name().to_string_lossy().into_owned())
            .filter(|n| n.to_ascii_lowercase().contains("anyccl"))
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// The `/dev/shm` entries that appeared since `before` was listed.
fn new_in_dev_shm(before: &[String]) -> Vec<String> {
    dev_shm_anyccl().into_iter().filter(|n| !before.contains(n)).collect()
}

/// In a rank: how many of this process's mappings are files under `/dev/shm`, and how many are anyccl's segment
/// memfds (as `backends/host/tests/hostile.rs` counts them).
fn segment_mappings() -> (usize, usize) {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
    let named = maps.lines().filter(|l| l.contains("/dev/shm/")).count();
    let memfds = maps.lines().filter(|l| l.contains("/memfd:anyccl-host-segment")).count();
    (named, memfds)
}

/// In a rank: how many of this process's open descriptors are anyccl segment memfds.
fn segment_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|t| t.to_string_lossy().contains("memfd:anyccl-host-segment"))
        .count()
}

/// Every collective with large messages across `world` processes whose segments hold 64 KiB (so each call moves in
/// many chunks): every rank checks its results against its own reference; the ranks' results are bitwise
/// identical, and identical to the threaded host backend's on the same inputs; no segment file is left.
/// `algorithm`: the all-reduce algorithm the processes are forced to (`ANYCCL_ALLREDUCE_ALGO`), "auto" for the
/// selector's choice (two-shot at these sizes).
fn run_big(world: usize, algorithm: &str) {
    let held = hold_master_port();
    let port = held.local_addr().expect("addr").port();
    // The ranks' temporary directory: anything they created on disk would be left in it.
    let dir = tempfile::tempdir().expect("tempdir");
    let shm_before = dev_shm_anyccl();
    let extra = [("TMPDIR", dir.path().display().to_string()), ("ANYCCL_ALLREDUCE_ALGO", algorithm.to_owned())];
    let t0 = Instant::now();
    let kids = start(world, port, "big", &extra);
    let lines: Vec<String> = kids.into_iter().enumerate().map(|(r, c)| result_line(r, &finish(r, c, t0))).collect();
    eprintln!("{world} processes: {:?}", t0.elapsed());
    assert!(leftovers(dir.path()).is_empty(), "left behind: {:?}", leftovers(dir.path()));
    assert!(new_in_dev_shm(&shm_before).is_empty(), "left in /dev/shm: {:?}", new_in_dev_shm(&shm_before));
    let field = |l: &str, k: &str| l.split(' ').find(|f| f.starts_with(k)).map(str::to_owned);
    for k in ["ar_f32=", "ar_bf16=", "ag=", "bc="] {
        let all: Vec<_> = lines.iter().map(|l| field(l, k)).collect();
        assert!(all[0].is_some() && all.iter().all(|h| h == &all[0]), "{k} differs between the ranks: {lines:?}");
    }
    // The same calls on the threaded backend (one-shot, the reduction order the processes use).
    let selector = Arc::new(Selector::defaults().with_forced(Some(Algorithm::OneShot)));
    let comms = communicators(world, HostOptions { selector, ..HostOptions::default() }).expect("threaded group");
    let threaded: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = comms.into_iter().map(|mut c| s.spawn(move || big_suite(&mut c).expect("threaded"))).collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    assert_eq!(lines, threaded, "processes and threads disagree");
}

#[test]
fn large_chunked_collectives_across_2_processes() {
    run_big(2, "auto");
}

#[test]
fn large_chunked_collectives_across_3_processes() {
    run_big(3, "auto");
}

/// Two-shot and one-shot across processes give the same bits as the threaded one-shot (the ranks' parts of a
/// chunk are runs of 64-byte blocks: an odd count leaves the last rank a short part).
#[test]
fn large_chunked_two_shot_across_3_processes() {
    run_big(3, "two-shot");
}

#[test]
fn large_chunked_one_shot_across_3_processes() {
    run_big(3, "one-shot");
}

/// Rank 1 of 3 is killed with SIGKILL while its peers wait in an all-reduce: both survivors exit with a typed
/// error (peer failure or timeout) well within the rendezvous timeout plus a margin, not hang.
#[test]
fn a_killed_rank_makes_the_survivors_fail_within_the_timeout() {
    kill_one_of_3("victim");
}

/// The same with large chunked all-reduces in flight (64 KiB segments, 1 MiB messages): the survivors are
/// somewhere inside a many-step collective when rank 1 dies.
#[test]
fn a_rank_killed_inside_a_chunked_collective_makes_the_survivors_fail_within_the_timeout() {
    kill_one_of_3("big-victim");
}

fn kill_one_of_3(mode: &str) {
    let held = hold_master_port();
    let port = held.local_addr().expect("addr").port();
    let dir = tempfile::tempdir().expect("tempdir");
    // The ranks' temporary directory: anything they created on disk (the victim cannot clean up) would be left in it.
    let tmp = tempfile::tempdir().expect("tempdir");
    let shm_before = dev_shm_anyccl();
    let ready = dir.path().join("victim-ready");
    let extra = [
        ("ANYCCL_RENDEZVOUS_TIMEOUT_SECS", KILL_TIMEOUT_SECS.to_string()),
        ("ANYCCL_HOST_READY_FILE", ready.display().to_string()),
        ("TMPDIR", tmp.path().display().to_string()),
    ];
    let t0 = Instant::now();
    let mut kids = start(3, port, mode, &extra);
    while !ready.exists() {
        assert!(t0.elapsed() < DEADLINE, "the victim never became ready");
        for (r, k) in kids.iter_mut().enumerate() {
            if let Some(st) = k.try_wait().expect("wait") {
                panic!("rank {r} exited ({st}) before the victim was ready");
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut victim = kids.remove(1);
    victim.kill().expect("SIGKILL rank 1");
    let killed_at = Instant::now();
    let _ = victim.wait();
    for (i, k) in kids.into_iter().enumerate() {
        let rank = if i == 0 { 0 } else { 2 };
        let out = finish(rank, k, t0);
        let waited = killed_at.elapsed();
        let all = text(&out);
        assert_eq!(out.status.code(), Some(3), "rank {rank} should report the failure and exit 3:\n{all}");
        assert!(all.contains("FAILED "), "{all}");
        assert!(
            all.contains("peer failure") || all.contains("timed out") || all.contains("PeerFailure"),
            "rank {rank}'s error does not say a peer failed or timed out:\n{all}"
        );
        assert!(waited < Duration::from_secs(KILL_TIMEOUT_SECS * 2 + 5), "rank {rank} took {waited:?}");
        let line = all.lines().find(|l| l.starts_with("FAILED ")).unwrap_or_default();
        // The error names the dead rank (its connection hung up) or, at worst, the rank it waited for.
        assert!(line.contains("rank 1"), "rank {rank}'s error does not name rank 1: {line}");
        eprintln!("rank {rank} failed {waited:?} after the kill: {line}");
    }
    assert!(leftovers(tmp.path()).is_empty(), "left behind: {:?}", leftovers(tmp.path()));
    assert!(new_in_dev_shm(&shm_before).is_empty(), "left in /dev/shm: {:?}", new_in_dev_shm(&shm_before));
}

fn all_reduce_sample(comm: &mut anyccl_core::Communicator<anyccl_host::ProcessComm>) -> anyccl_core::Result<String> {
    let me = (comm.rank() + 1) as f32;
    let mut buf = HostBuffer::from_elems(&[me, 2.0 * me, 3.0 * me, 4.0 * me]);
    comm.all_reduce(InOut::InPlace(buf.as_bytes_mut()), 4, DataType::F32, ReduceOp::Sum, &())?;
    Ok(buf.to_vec::<f32>().iter().map(|v| v.to_string()).collect::<Vec<_>>().join(","))
}

fn report_line(rank: usize, world: usize, sample: &str, report: &RankReport) -> String {
    assert!(report.failures.is_empty(), "rank {rank}: {:#?}", report.failures);
    let fold = report.all_reduce_hashes.iter().fold(0u64, |a, (id, h)| a.rotate_left(7) ^ id ^ h);
    format!("rank={rank} world={world} allreduce={sample} checks={} {fold:016x}", report.checks)
}

/// The sizes (bytes of f32) and timed iterations of the all-reduce measurement.
const BENCH: [(usize, usize); 2] = [(64 << 10, 200), (4 << 20, 40)];

/// A measurement, not a check: all-reduce of f32 across 2 processes at 64 KiB and 4 MiB, each timed call preceded
/// by a barrier; prints each rank's median and minimum. Run with
/// `cargo test -p anyccl-host --release --test processes -- --ignored --nocapture bench_all_reduce`.
#[test]
#[ignore = "a measurement, run by hand"]
fn bench_all_reduce_across_2_processes() {
    let held = hold_master_port();
    let port = held.local_addr().expect("addr").port();
    let t0 = Instant::now();
    let kids = start(2, port, "bench", &[]);
    for (r, c) in kids.into_iter().enumerate() {
        let line = result_line(r, &finish(r, c, t0));
        println!("rank {r}: {line}");
    }
}

/// One rank of the measurement: the rendezvous gets a message limit above 4 MiB so that the bootstrap transport
/// (before shared memory) can run the large size too.
fn bench_rank() -> anyccl_core::Result<String> {
    let cfg = anyccl_rendezvous::RendezvousConfig::from_env()?.with_max_message(64 << 20);
    let rdv = anyccl_rendezvous::Rendezvous::establish(cfg)?;
    let mut comm = communicator_over(Box::new(rdv), HostOptions::default())?;
    let mut out = Vec::new();
    for (bytes, iters) in BENCH {
        let count = bytes / 4;
        let mut buf = HostBuffer::from_elems(&vec![1.0f32; count]);
        let mut times = Vec::with_capacity(iters);
        for i in 0..iters + 5 {
            comm.barrier(&())?;
            let t = Instant::now();
            comm.all_reduce(InOut::InPlace(buf.as_bytes_mut()), count, DataType::F32, ReduceOp::Max, &())?;
            if i >= 5 {
                times.push(t.elapsed());
            }
        }
        times.sort();
        let at = |q: usize| times[(times.len() - 1) * q / 100];
        out.push(format!("{}KiB median={:?} min={:?} p10={:?} p90={:?}", bytes >> 10, at(50), at(0), at(10), at(90)));
    }
    Ok(out.join(" "))
}

/// The rank half, started by the tests above with torchrun's variables.
#[test]
#[ignore = "one rank of the launcher tests, which start it with torchrun's variables"]
fn rank() {
    let mode = std::env::var("ANYCCL_HOST_CHILD").expect("run by the launcher tests");
    if mode == "bench" {
        println!("RESULT {}", bench_rank().expect("the measurement runs"));
        return;
    }
    let mut opts = HostOptions { timeout: Duration::from_secs(KILL_TIMEOUT_SECS), ..HostOptions::default() };
    if mode.starts_with("big") {
        opts.shm_capacity = SMALL_SHM;
        // The all-reduce algorithm the launcher forced, if any (`ANYCCL_ALLREDUCE_ALGO`).
        opts.selector = Arc::new(Selector::from_env().expect("the launcher's selector variables"));
    }
    if mode == "hosts" {
        // The launcher gave the ranks different host identities: the communicator must refuse, with the reason,
        // before any segment exists.
        let e = from_env(opts).err().expect("ranks on two hosts are refused");
        let (named, memfds) = segment_mappings();
        println!("RESULT {e} segment-fds={} dev-shm={named} memfd-maps={memfds}", segment_descriptors());
        return;
    }
    let mut comm = from_env(opts).expect("the host communicator forms");
    let (rank, world) = (comm.rank(), comm.world_size());
    match mode.as_str() {
        "big" => {
            all_reduce_sample(&mut comm).expect("all-reduce");
            // Every rank has passed its setup (each published a step of that all-reduce after it): nothing on disk
            // in the rank's TMPDIR, no segment mapped from /dev/shm, and every rank's segment mapped as a memfd.
            let tmp = std::env::temp_dir();
            assert!(leftovers(&tmp).is_empty(), "left behind after setup: {:?}", leftovers(&tmp));
            let (named, memfds) = segment_mappings();
            assert_eq!((named, memfds), (0, world), "mappings from /dev/shm and segment memfds after setup");
            println!("RESULT {}", big_suite(&mut comm).expect("the large collectives"));
        }
        "big-victim" => {
            let mut buf = HostBuffer::from_elems(&vec![1.0f32; BIG]);
            let mut big = |comm: &mut Communicator<anyccl_host::ProcessComm>| {
                comm.all_reduce(InOut::InPlace(buf.as_bytes_mut()), BIG, DataType::F32, ReduceOp::Max, &())
            };
            big(&mut comm).expect("a first large all-reduce with every rank alive");
            if rank == 1 {
                std::fs::write(std::env::var("ANYCCL_HOST_READY_FILE").expect("ready file"), b"").expect("ready");
                // Keep going until killed; the launcher fails the test if that never happens.
                let t = Instant::now();
                while t.elapsed() < DEADLINE {
                    big(&mut comm).expect("all-reduces while the survivors run");
                }
                std::process::exit(4);
            }
            loop {
                if let Err(e) = big(&mut comm) {
                    println!("FAILED {e} ({e:?})");
                    // The communicator is broken now: a later call refuses instead of reading stale state.
                    let again = big(&mut comm).expect_err("a broken communicator refuses");
                    assert!(again.to_string().contains("refuses further collectives"), "{again}");
                    std::process::exit(3);
                }
            }
        }
        "suite" => {
            let sample = all_reduce_sample(&mut comm).expect("all-reduce");
            let report = run_one_rank(&mut comm, &(), &suite());
            println!("RESULT {}", report_line(rank, world, &sample, &report));
        }
        "victim" => {
            all_reduce_sample(&mut comm).expect("a first all-reduce with every rank alive");
            if rank == 1 {
                std::fs::write(std::env::var("ANYCCL_HOST_READY_FILE").expect("ready file"), b"").expect("ready");
                // Wait here to be killed; the launcher fails the test if that never happens.
                std::thread::sleep(DEADLINE);
                std::process::exit(4);
            }
            loop {
                if let Err(e) = all_reduce_sample(&mut comm) {
                    println!("FAILED {e} ({e:?})");
                    std::process::exit(3);
                }
            }
        }
        other => panic!("unknown mode {other}"),
    }
}

/// Bring your own bootstrap: ranks as threads over core's `LocalGroup`, through the same `communicator_over`,
/// run the conformance suite; every rank passes and all-reduce results are bitwise identical.
#[test]
fn ranks_as_threads_over_a_bring_your_own_bootstrap() {
    let world = 3;
    let group = LocalGroup::new(world, Duration::from_secs(20));
    let reports: Vec<(String, RankReport)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let me: Box<dyn Bootstrap + Send> = Box::new(group.member(r));
                s.spawn(move || {
                    let mut comm = communicator_over(me, HostOptions::default()).expect("communicator");
                    let sample = all_reduce_sample(&mut comm).expect("all-reduce");
                    (sample, run_one_rank(&mut comm, &(), &suite()))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    let hashes: Vec<Vec<(u64, u64)>> = reports.iter().map(|(_, r)| r.all_reduce_hashes.clone()).collect();
    for (rank, (sample, report)) in reports.iter().enumerate() {
        assert_eq!(sample, "6,12,18,24", "rank {rank}");
        assert!(report.failures.is_empty(), "rank {rank}: {:#?}", report.failures);
        assert!(report.checks > 100, "rank {rank} checked only {}", report.checks);
    }
    assert!(compare_hashes(&hashes).is_empty(), "{:?}", compare_hashes(&hashes));
}

/// A bootstrap whose rank is out of its world is refused with a typed error.
#[test]
fn a_bootstrap_claiming_a_rank_outside_its_world_is_refused() {
    struct Liar;
    impl Bootstrap for Liar {
        fn rank(&self) -> usize {
            2
        }
        fn world(&self) -> usize {
            2
        }
        fn all_gather(&mut self, mine: &[u8]) -> anyccl_core::Result<Vec<Vec<u8>>> {
            Ok(vec![mine.to_vec(); 2])
        }
    }
    let e = communicator_over(Box::new(Liar), HostOptions::default()).err().expect("rank 2 of 2");
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
}

/// A shared-memory capacity of 0 or an absurd one is an `InvalidArgument` naming the option.
#[test]
fn a_zero_or_absurd_segment_capacity_is_refused() {
    for cap in [0, 1, anyccl_host::MAX_SHM_CAPACITY + 1, usize::MAX] {
        let group = LocalGroup::new(1, Duration::from_secs(5));
        let opts = HostOptions { shm_capacity: cap, ..HostOptions::default() };
        let e = communicator_over(Box::new(group.member(0)), opts).err().expect("refused");
        assert!(
            matches!(&e, Error::InvalidArgument(anyccl_core::InvalidArgument::OutOfRange { what, value, .. })
                if what.contains("shm_capacity") && *value == cap as u64),
            "{cap}: {e}"
        );
    }
    // The smallest capacity accepted works (every call then moves in 4 KiB chunks).
    let group = LocalGroup::new(1, Duration::from_secs(5));
    let opts = HostOptions { shm_capacity: anyccl_host::MIN_SHM_CAPACITY, ..HostOptions::default() };
    let mut comm = communicator_over(Box::new(group.member(0)), opts).expect("4 KiB segments");
    assert_eq!(all_reduce_sample(&mut comm).expect("all-reduce"), "1,2,3,4");
}

/// Point-to-point over the mesh: a receive whose size does not match the message is an `InvalidArgument` that loses
/// nothing (the next receive of the right size gets the message), and messages keep their order.
#[test]
fn a_mismatched_receive_loses_nothing() {
    let group = LocalGroup::new(2, Duration::from_secs(20));
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let me: Box<dyn Bootstrap + Send> = Box::new(group.member(r));
                s.spawn(move || {
                    let mut comm = communicator_over(me, HostOptions::default()).expect("communicator");
                    if r == 0 {
                        comm.send(HostBuffer::from_elems(&[1u32, 2]).as_bytes(), 2, DataType::U32, 1, &())
                            .expect("send");
                        comm.send(HostBuffer::from_elems(&[3u32]).as_bytes(), 1, DataType::U32, 1, &()).expect("send");
                    } else {
                        let mut one = HostBuffer::from_elems(&[0u32]);
                        let e = comm.recv(one.as_bytes_mut(), 1, DataType::U32, 0, &()).expect_err("2 elements came");
                        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
                        let mut two = HostBuffer::from_elems(&[0u32, 0]);
                        comm.recv(two.as_bytes_mut(), 2, DataType::U32, 0, &()).expect("the same message, whole");
                        assert_eq!(two.to_vec::<u32>(), [1, 2]);
                        comm.recv(one.as_bytes_mut(), 1, DataType::U32, 0, &()).expect("the next message");
                        assert_eq!(one.to_vec::<u32>(), [3]);
                    }
                    comm.barrier(&()).expect("barrier");
                })
            })
            .collect();
        for h in hs {
            h.join().expect("rank thread");
        }
    });
}
