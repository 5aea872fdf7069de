//! Ranks as threads check each other: every rank publishes a descriptor of each call (collective, size, element
//! type, operator, root, algorithm) with its step counter, and reads no peer's data before it has checked every
//! peer's descriptor against its own. A mismatch is an error on every rank, at once, never a panic and never
//! another rank's (or an earlier call's) bytes; a missing rank is a timeout naming it; a rank that leaves fails the
//! collectives of the others but not their point-to-point messages.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyccl_core::{Algorithm, Communicator, DataType, Error, InOut, ReduceOp, Result, Selector};
use anyccl_host::{communicators, create_group, HostBuffer, HostComm, HostOptions};

/// Long enough that a test finishing well within it shows the ranks did not wait for it.
const LONG: Duration = Duration::from_secs(60);
/// How long a mismatch may take to show on every rank of a loaded 2-core machine (it takes milliseconds).
const PROMPT: Duration = Duration::from_secs(10);

/// Runs `f` on every rank of a fresh threaded group of `world` ranks (timeout `timeout`): the results by rank,
/// and how long the slowest rank took.
fn on_ranks<R: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(&mut Communicator<HostComm>) -> R + Sync,
) -> (Vec<R>, Duration) {
    let comms = communicators(world, HostOptions { timeout, ..HostOptions::default() }).expect("host group");
    run_all(comms, f)
}

fn run_all<R: Send>(
    comms: Vec<Communicator<HostComm>>,
    f: impl Fn(&mut Communicator<HostComm>) -> R + Sync,
) -> (Vec<R>, Duration) {
    let start = Instant::now();
    let out = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                let f = &f;
                s.spawn(move || f(&mut c))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
    });
    (out, start.elapsed())
}

fn all_reduce(c: &mut Communicator<HostComm>, count: usize, dtype: DataType, op: ReduceOp) -> Result<HostBuffer> {
    let mut b = HostBuffer::zeroed(count * dtype.size_bytes());
    c.all_reduce(InOut::InPlace(b.as_bytes_mut()), count, dtype, op, &())?;
    Ok(b)
}

/// Every rank's result is a [`Error::PeerFailure`] saying the ranks run different collectives and containing every
/// text of `says`; then every rank refuses its next collective (it stopped after the failure).
fn assert_mismatch_everywhere<T: std::fmt::Debug>(results: &[Result<T>], took: Duration, says: &[&str]) {
    assert!(took < PROMPT, "the ranks took {took:?} to see the mismatch");
    for (rank, r) in results.iter().enumerate() {
        match r {
            Err(Error::PeerFailure(m)) => {
                assert!(m.contains("runs a different collective"), "rank {rank}: {m}");
                for s in says {
                    assert!(m.contains(s), "rank {rank}: {m} does not say {s:?}");
                }
            }
            other => panic!("rank {rank}: expected a peer failure describing the mismatch, got {other:?}"),
        }
    }
}

/// After a mismatch every rank refuses further collectives with a [`Error::PeerFailure`] at once.
fn assert_refuses_later_calls(c: &mut Communicator<HostComm>) {
    let t = Instant::now();
    let e = all_reduce(c, 4, DataType::F32, ReduceOp::Sum).expect_err("the communicator stopped");
    assert!(matches!(&e, Error::PeerFailure(m) if m.contains("refuses further collectives")), "{e:?}");
    assert!(t.elapsed() < PROMPT, "{:?}", t.elapsed());
}

#[test]
fn a_count_that_differs_across_ranks_is_an_error_on_every_rank() {
    let (results, took) = on_ranks(3, LONG, |c| {
        let count = if c.rank() == 1 { 1000 } else { 10 };
        let r = all_reduce(c, count, DataType::F32, ReduceOp::Sum).map(|b| b.to_vec::<f32>());
        assert_refuses_later_calls(c);
        r
    });
    assert_mismatch_everywhere(&results, took, &["40 bytes", "4000 bytes"]);
}

/// The case that used to return `Ok` with stale data: a larger call first leaves every staging buffer large
/// enough for the mismatched one.
#[test]
fn a_smaller_mismatched_count_after_a_larger_call_is_not_served_stale_data() {
    let (results, took) = on_ranks(3, LONG, |c| {
        let big = all_reduce(c, 1024, DataType::F32, ReduceOp::Sum).expect("the matching larger call");
        assert_eq!(big.to_vec::<f32>(), vec![0.0; 1024]);
        let count = if c.rank() == 2 { 16 } else { 8 };
        let mut b = HostBuffer::from_elems(&vec![c.rank() as f32 + 1.0; count]);
        c.all_reduce(InOut::InPlace(b.as_bytes_mut()), count, DataType::F32, ReduceOp::Sum, &())
            .map(|_| b.to_vec::<f32>())
    });
    assert_mismatch_everywhere(&results, took, &["32 bytes", "64 bytes"]);
}

#[test]
fn an_element_type_that_differs_across_ranks_is_an_error_on_every_rank() {
    // The same count and the same number of bytes: only the element type differs.
    let (results, took) = on_ranks(2, LONG, |c| {
        let dtype = if c.rank() == 0 { DataType::F32 } else { DataType::I32 };
        all_reduce(c, 64, dtype, ReduceOp::Sum).map(|b| b.to_vec::<u32>())
    });
    assert_mismatch_everywhere(&results, took, &["of f32", "of i32"]);
}

#[test]
fn an_operator_that_differs_across_ranks_is_an_error_on_every_rank() {
    let (results, took) = on_ranks(3, LONG, |c| {
        let op = if c.rank() == 2 { ReduceOp::Max } else { ReduceOp::Sum };
        let r = all_reduce(c, 64, DataType::F32, op).map(|b| b.to_vec::<f32>());
        assert_refuses_later_calls(c);
        r
    });
    assert_mismatch_everywhere(&results, took, &["operator Sum", "operator Max"]);
}

#[test]
fn a_root_that_differs_across_ranks_is_an_error_on_every_rank() {
    let (results, took) = on_ranks(3, LONG, |c| {
        let root = usize::from(c.rank() == 0);
        let mut b = HostBuffer::from_elems(&[c.rank() as u32; 8]);
        c.broadcast(InOut::InPlace(b.as_bytes_mut()), 8, DataType::U32, root, &()).map(|()| b.to_vec::<u32>())
    });
    assert_mismatch_everywhere(&results, took, &["root 0", "root 1"]);

    let (results, took) = on_ranks(2, LONG, |c| {
        let root = c.rank();
        let mut b = HostBuffer::from_elems(&[1.0f64; 8]);
        c.reduce(InOut::InPlace(b.as_bytes_mut()), 8, DataType::F64, ReduceOp::Sum, root, &())
            .map(|()| b.to_vec::<f64>())
    });
    assert_mismatch_everywhere(&results, took, &["reduce", "root 0", "root 1"]);
}

#[test]
fn different_collectives_across_ranks_are_an_error_on_every_rank() {
    // All-reduce against broadcast of the same bytes, and all-reduce against barrier.
    let (results, took) = on_ranks(2, LONG, |c| {
        let mut b = HostBuffer::from_elems(&[1.0f32; 16]);
        if c.rank() == 0 {
            c.all_reduce(InOut::InPlace(b.as_bytes_mut()), 16, DataType::F32, ReduceOp::Sum, &()).map(|_| ())
        } else {
            c.broadcast(InOut::InPlace(b.as_bytes_mut()), 16, DataType::F32, 0, &())
        }
    });
    assert_mismatch_everywhere(&results, took, &["all-reduce", "broadcast"]);

    let (results, took) = on_ranks(3, LONG, |c| {
        if c.rank() == 1 {
            c.barrier(&())
        } else {
            all_reduce(c, 4, DataType::F32, ReduceOp::Sum).map(|_| ())
        }
    });
    assert_mismatch_everywhere(&results, took, &["all-reduce", "barrier"]);

    let (results, took) = on_ranks(2, LONG, |c| {
        let mut send = HostBuffer::from_elems(&[1.0f32; 8]);
        let mut recv = HostBuffer::zeroed(64);
        if c.rank() == 0 {
            c.all_gather(InOut::Separate { send: send.as_bytes(), recv: recv.as_bytes_mut() }, 8, DataType::F32, &())
        } else {
            let io = InOut::Separate { send: send.as_bytes_mut(), recv: recv.as_bytes_mut() };
            c.reduce_scatter(io, 4, DataType::F32, ReduceOp::Sum, &())
        }
    });
    assert_mismatch_everywhere(&results, took, &["all-gather", "reduce-scatter"]);
}

/// Ranks whose selectors pick different all-reduce algorithms for the same call are refused too.
#[test]
fn different_all_reduce_algorithms_across_ranks_are_an_error_on_every_rank() {
    let raw = create_group(2, LONG).expect("host group");
    let comms: Vec<_> = raw
        .into_iter()
        .zip([Algorithm::Ring, Algorithm::OneShot])
        .map(|(b, a)| Communicator::new(b, Arc::new(Selector::defaults().with_forced(Some(a)))))
        .collect();
    let (results, took) = run_all(comms, |c| all_reduce(c, 100, DataType::F32, ReduceOp::Sum).map(|_| ()));
    assert_mismatch_everywhere(&results, took, &["algorithm ring", "algorithm one-shot"]);
}

/// A rank that never comes: every waiting rank times out naming it, not a rank that did arrive.
#[test]
fn a_timeout_names_the_missing_rank() {
    let timeout = Duration::from_millis(300);
    let (results, _) = on_ranks(4, timeout, |c| {
        if c.rank() == 2 {
            // Alive, but it never calls: its peers wait for it.
            std::thread::sleep(Duration::from_secs(2));
            return None;
        }
        let t = Instant::now();
        let r = all_reduce(c, 32, DataType::F32, ReduceOp::Sum).map(|_| ());
        Some((r, t.elapsed()))
    });
    for (rank, r) in results.into_iter().enumerate() {
        let Some((r, took)) = r else { continue };
        match r {
            Err(Error::Timeout { what, after }) => {
                assert_eq!(after, timeout, "rank {rank}");
                assert!(what.starts_with("rank 2 "), "rank {rank} blames the wrong rank: {what}");
                assert!(took >= timeout && took < PROMPT, "rank {rank} took {took:?}");
            }
            other => panic!("rank {rank}: expected a timeout naming rank 2, got {other:?}"),
        }
    }
}

/// Rank 2 drops its communicator: the others' collectives fail naming it, receives waiting for it fail, and the
/// other pairs keep exchanging messages.
#[test]
fn a_rank_that_leaves_does_not_break_the_other_pairs_messages() {
    let comms = communicators(3, HostOptions { timeout: LONG, ..HostOptions::default() }).expect("host group");
    let mut comms = comms.into_iter();
    let (c0, c1, c2) = (comms.next().expect("0"), comms.next().expect("1"), comms.next().expect("2"));
    // A message rank 2 sent before it left is still delivered.
    let mut c2 = c2;
    c2.send(HostBuffer::from_elems(&[9u32; 2]).as_bytes(), 2, DataType::U32, 0, &()).expect("send before leaving");
    drop(c2);
    let t = Instant::now();
    let (results, _) = run_all(vec![c0, c1], |c| {
        let (me, peer) = (c.rank(), 1 - c.rank());
        // Round trips between the two ranks that stayed.
        for round in 0..50u32 {
            let out = HostBuffer::from_elems(&[me as u32 * 1000 + round; 4]);
            let mut got = HostBuffer::zeroed(16);
            c.send(out.as_bytes(), 4, DataType::U32, peer, &()).expect("send between the ranks that stayed");
            c.recv(got.as_bytes_mut(), 4, DataType::U32, peer, &()).expect("receive between the ranks that stayed");
            assert_eq!(got.to_vec::<u32>(), vec![peer as u32 * 1000 + round; 4]);
        }
        let mut got = HostBuffer::zeroed(8);
        let early = if me == 0 {
            c.recv(got.as_bytes_mut(), 2, DataType::U32, 2, &()).map(|()| got.to_vec::<u32>())
        } else {
            Ok(vec![9, 9])
        };
        let late = c.recv(got.as_bytes_mut(), 2, DataType::U32, 2, &());
        let collective = all_reduce(c, 4, DataType::F32, ReduceOp::Sum).map(|_| ());
        (early, late, collective)
    });
    assert!(t.elapsed() < PROMPT, "{:?}", t.elapsed());
    for (rank, (early, late, collective)) in results.into_iter().enumerate() {
        assert_eq!(early.expect("the message sent before leaving"), vec![9, 9], "rank {rank}");
        assert!(matches!(&late, Err(Error::PeerFailure(m)) if m.contains("rank 2 left")), "rank {rank}: {late:?}");
        assert!(
            matches!(&collective, Err(Error::PeerFailure(m)) if m.contains("rank 2 left")),
            "rank {rank}: {collective:?}"
        );
    }
}

/// Matching calls of every kind and size still agree, many times over (the checks pass when they should).
#[test]
fn matching_calls_pass_their_checks_round_after_round() {
    let (results, _) = on_ranks(3, LONG, |c| {
        let r = c.rank() as f32;
        for n in [1usize, 7, 300, 5000] {
            for _ in 0..20 {
                let mut b = HostBuffer::from_elems(&vec![r + 1.0; n]);
                c.all_reduce(InOut::InPlace(b.as_bytes_mut()), n, DataType::F32, ReduceOp::Sum, &())?;
                assert_eq!(b.to_vec::<f32>(), vec![6.0; n]);
                let mut b = HostBuffer::from_elems(&vec![r; n]);
                c.broadcast(InOut::InPlace(b.as_bytes_mut()), n, DataType::F32, 2, &())?;
                assert_eq!(b.to_vec::<f32>(), vec![2.0; n]);
                c.barrier(&())?;
            }
        }
        Ok::<_, Error>(())
    });
    for (rank, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}
