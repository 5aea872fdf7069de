//! The core conformance suite on the host backend, world sizes 1–8, plus the host-specific failure modes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyccl_core::conformance::{self, Config, ConformanceTarget};
use anyccl_core::{Algorithm, Communicator, DataType, Error, InOut, InvalidArgument, ReduceOp, Result, Selector};
use anyccl_host::{communicators, HostBuffer, HostComm, HostOptions};

struct Host;

impl ConformanceTarget for Host {
    type Backend = HostComm;

    fn name(&self) -> String {
        "host".into()
    }

    fn create(&self, world: usize) -> Result<Vec<Communicator<HostComm>>> {
        communicators(world, HostOptions { timeout: Duration::from_secs(60), ..HostOptions::default() })
    }

    fn stream(&self, _comm: &Communicator<HostComm>) -> Result<()> {
        Ok(())
    }
}

#[test]
fn conformance_worlds_1_to_8() {
    let summary = conformance::run(&Host, &Config::default());
    summary.assert_ok();
    // Every world size ran every collective for every dtype: this many checks cannot happen by accident.
    assert!(summary.checks > 8 * 12 * 4 * 2 * 10, "only {} checks ran", summary.checks);
    // avg on the six integer types, per count, per in/out-of-place, per rank of every world: all refused.
    let ranks: usize = (1..=8).sum();
    assert_eq!(summary.expected_errors, 6 * 4 * 2 * ranks);
}

#[test]
fn one_rank_at_a_time_as_processes_would_run_it() {
    // What each process of a multi-process run does: run its own rank, then exchange the all-reduce hashes.
    let cfg = Config { worlds: vec![], counts: vec![0, 5, 1037], ..Config::default() };
    let reports = on_ranks(3, |c| conformance::run_one_rank(c, &(), &cfg));
    for (rank, r) in reports.iter().enumerate() {
        assert!(r.failures.is_empty(), "rank {rank}: {:?}", r.failures);
        assert!(r.checks > 100, "rank {rank}: only {} checks", r.checks);
        assert!(!r.all_reduce_hashes.is_empty(), "rank {rank}: no all-reduce hashes");
    }
    let exchanged: Vec<Vec<(u64, u64)>> = reports
        .iter()
        .map(|r| conformance::decode_hashes(&conformance::encode_hashes(&r.all_reduce_hashes)).expect("decode"))
        .collect();
    assert!(conformance::compare_hashes(&exchanged).is_empty());
    // The same number of checks as the threaded suite makes for this world.
    let threaded = conformance::run(&Host, &Config { worlds: vec![3], ..cfg.clone() });
    threaded.assert_ok();
    assert_eq!(reports.iter().map(|r| r.checks).sum::<usize>(), threaded.checks);
}

/// Runs `f` on every rank of a fresh group of `world` and returns the results by rank.
fn on_ranks<T: Send>(world: usize, f: impl Fn(&mut Communicator<HostComm>) -> T + Sync) -> Vec<T> {
    let comms = communicators(world, HostOptions { timeout: Duration::from_secs(10), ..HostOptions::default() })
        .expect("group");
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                let f = &f;
                s.spawn(move || f(&mut c))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

#[test]
fn each_bad_input_class_is_a_typed_error_and_the_communicator_survives() {
    let results = on_ranks(2, |c| {
        let mut errs = Vec::new();
        let mut a = HostBuffer::zeroed(64);
        let b = HostBuffer::zeroed(64);
        // Too short.
        errs.push(
            c.all_reduce(
                InOut::Separate { send: b.as_bytes(), recv: &mut a.as_bytes_mut()[..8] },
                16,
                DataType::F32,
                ReduceOp::Sum,
                &(),
            )
            .err(),
        );
        // Misaligned (an f32 view starting at byte 1).
        errs.push(
            c.all_reduce(InOut::InPlace(&mut a.as_bytes_mut()[1..41]), 10, DataType::F32, ReduceOp::Sum, &()).err(),
        );
        // Unsupported pair.
        errs.push(c.all_reduce(InOut::InPlace(a.as_bytes_mut()), 16, DataType::I32, ReduceOp::Avg, &()).err());
        // Root out of range.
        errs.push(c.broadcast(InOut::InPlace(a.as_bytes_mut()), 16, DataType::F32, 2, &()).err());
        // Peer is self / out of range.
        let me = c.rank();
        errs.push(c.send(b.as_bytes(), 4, DataType::F32, me, &()).err());
        errs.push(c.recv(a.as_bytes_mut(), 4, DataType::F32, 7, &()).err());
        // All-gather output too small for world × count.
        errs.push(
            c.all_gather(
                InOut::Separate { send: b.as_bytes(), recv: &mut a.as_bytes_mut()[..32] },
                8,
                DataType::F32,
                &(),
            )
            .err(),
        );
        // Count overflow.
        errs.push(c.all_reduce(InOut::InPlace(a.as_bytes_mut()), usize::MAX, DataType::F64, ReduceOp::Sum, &()).err());
        // Forced algorithm the backend does not have.
        errs.push(
            c.all_reduce_with(
                Algorithm::NvlsZeroCopy,
                InOut::InPlace(a.as_bytes_mut()),
                16,
                DataType::F32,
                ReduceOp::Sum,
                &(),
            )
            .err(),
        );
        // Afterwards the communicator still works: nothing was half-sent.
        let mut x = HostBuffer::from_elems(&[1.0f32; 16]);
        c.all_reduce(InOut::InPlace(x.as_bytes_mut()), 16, DataType::F32, ReduceOp::Sum, &()).expect("valid call");
        (errs, x.to_vec::<f32>())
    });
    for (errs, sum) in results {
        assert_eq!(sum, vec![2.0f32; 16]);
        let e: Vec<Error> = errs.into_iter().map(|e| e.expect("each bad call must fail")).collect();
        assert!(
            matches!(e[0], Error::InvalidArgument(InvalidArgument::BufferTooSmall { which: "recv", .. })),
            "{:?}",
            e[0]
        );
        assert!(matches!(e[1], Error::InvalidArgument(InvalidArgument::Misaligned { align: 4, .. })), "{:?}", e[1]);
        assert!(matches!(e[2], Error::InvalidArgument(InvalidArgument::UnsupportedReduction { .. })), "{:?}", e[2]);
        assert!(
            matches!(e[3], Error::InvalidArgument(InvalidArgument::RankOutOfRange { what: "root", rank: 2, world: 2 })),
            "{:?}",
            e[3]
        );
        assert!(matches!(e[4], Error::InvalidArgument(InvalidArgument::SelfPeer { .. })), "{:?}", e[4]);
        assert!(
            matches!(e[5], Error::InvalidArgument(InvalidArgument::RankOutOfRange { what: "peer", rank: 7, .. })),
            "{:?}",
            e[5]
        );
        assert!(matches!(e[6], Error::InvalidArgument(InvalidArgument::BufferTooSmall { need: 64, .. })), "{:?}", e[6]);
        assert!(matches!(e[7], Error::InvalidArgument(InvalidArgument::CountOverflow { .. })), "{:?}", e[7]);
        assert!(matches!(e[8], Error::AlgorithmNotEligible { algorithm: Algorithm::NvlsZeroCopy, .. }), "{:?}", e[8]);
    }
}

#[test]
fn a_rank_that_leaves_fails_its_peers_instead_of_hanging() {
    let start = Instant::now();
    let results = on_ranks(3, |c| {
        if c.rank() == 2 {
            return None; // returns without joining: its communicator is dropped by the caller
        }
        let mut x = HostBuffer::from_elems(&[1.0f32; 4]);
        c.all_reduce(InOut::InPlace(x.as_bytes_mut()), 4, DataType::F32, ReduceOp::Sum, &()).err()
    });
    assert!(start.elapsed() < Duration::from_secs(5), "peers waited for the timeout instead of failing at once");
    for e in results.into_iter().flatten() {
        assert!(matches!(e, Error::PeerFailure(ref m) if m.contains("rank 2 left")), "{e:?}");
    }
}

#[test]
fn a_missing_peer_times_out() {
    let comms =
        communicators(2, HostOptions { timeout: Duration::from_millis(200), ..HostOptions::default() }).expect("group");
    let mut it = comms.into_iter();
    let mut c0 = it.next().expect("rank 0");
    let _c1 = it.next().expect("rank 1 stays alive but never calls");
    let err = c0.barrier(&()).expect_err("no peer");
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
}

#[test]
fn mismatched_message_is_rejected_and_kept() {
    let results = on_ranks(2, |c| {
        if c.rank() == 0 {
            let b = HostBuffer::from_elems(&[7u32; 4]);
            c.send(b.as_bytes(), 4, DataType::U32, 1, &()).expect("send");
            None
        } else {
            let mut small = HostBuffer::zeroed(8);
            let e = c.recv(small.as_bytes_mut(), 2, DataType::U32, 0, &()).expect_err("size mismatch");
            let mut ok = HostBuffer::zeroed(16);
            c.recv(ok.as_bytes_mut(), 4, DataType::U32, 0, &()).expect("the message is still there");
            Some((e, ok.to_vec::<u32>()))
        }
    });
    let (e, data) = results.into_iter().flatten().next().expect("rank 1 result");
    assert!(
        matches!(e, Error::InvalidArgument(InvalidArgument::MessageMismatch { got: 16, expected: 8, .. })),
        "{e:?}"
    );
    assert_eq!(data, vec![7; 4]);
}

#[test]
fn forced_algorithm_is_used_and_reported() {
    let sel = Arc::new(Selector::defaults().with_forced(Some(Algorithm::Ring)));
    let comms = communicators(3, HostOptions { selector: sel, ..HostOptions::default() }).expect("group");
    let picks: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                s.spawn(move || {
                    let mut x = HostBuffer::from_elems(&[c.rank() as f64; 10]);
                    let sel = c
                        .all_reduce(InOut::InPlace(x.as_bytes_mut()), 10, DataType::F64, ReduceOp::Max, &())
                        .expect("ring");
                    (sel.algorithm, sel.why.to_string(), x.to_vec::<f64>())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    for (algo, why, data) in picks {
        assert_eq!(algo, Algorithm::Ring);
        assert!(why.contains("ANYCCL_ALLREDUCE_ALGO"), "{why}");
        assert_eq!(data, vec![2.0; 10]);
    }
}
