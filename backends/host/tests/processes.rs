//! The host backend with one process per rank, started the way `torchrun` starts ranks: a stand-in launcher holds
//! `MASTER_PORT` (as torchrun's agent store does) and starts the ranks as child processes of this test binary
//! (test `rank`) with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`. Each rank joins through
//! `anyccl_host::from_env` and runs core's conformance suite as one rank; the launcher compares the ranks'
//! all-reduce hashes and an all-reduce against its own reference. Also: a rank killed with SIGKILL makes the
//! survivors fail with a clear error within the timeout, and the same API over a bring-your-own bootstrap.

#[path = "../../../tests/support/launcher.rs"]
mod launcher;

use std::process::{Child, Output};
use std::time::{Duration, Instant};

use launcher::{hold_master_port, result_line, text};

use anyccl_core::bootstrap::{Bootstrap, LocalGroup};
use anyccl_core::conformance::{compare_hashes, run_one_rank, Config, RankReport};
use anyccl_core::{DataType, Error, InOut, ReduceOp};
use anyccl_host::{communicator_over, from_env, HostBuffer, HostOptions};

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

/// Rank 1 of 3 is killed with SIGKILL while its peers wait in an all-reduce: both survivors exit with a typed
/// error (peer failure or timeout) well within the rendezvous timeout plus a margin, not hang.
#[test]
fn a_killed_rank_makes_the_survivors_fail_within_the_timeout() {
    let held = hold_master_port();
    let port = held.local_addr().expect("addr").port();
    let dir = tempfile::tempdir().expect("tempdir");
    let ready = dir.path().join("victim-ready");
    let extra = [
        ("ANYCCL_RENDEZVOUS_TIMEOUT_SECS", KILL_TIMEOUT_SECS.to_string()),
        ("ANYCCL_HOST_READY_FILE", ready.display().to_string()),
    ];
    let t0 = Instant::now();
    let mut kids = start(3, port, "victim", &extra);
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
        eprintln!("rank {rank} failed {waited:?} after the kill: {line}");
    }
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
        out.push(format!("{}KiB median={:?} min={:?}", bytes >> 10, times[times.len() / 2], times[0]));
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
    let opts = HostOptions { timeout: Duration::from_secs(KILL_TIMEOUT_SECS), ..HostOptions::default() };
    let mut comm = from_env(opts).expect("the host communicator forms");
    let (rank, world) = (comm.rank(), comm.world_size());
    match mode.as_str() {
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
