//! The old out-of-bounds route, closed.
//!
//! Before: `CommBackend`'s collectives were safe functions taking loose buffers and counts "already validated",
//! and `Communicator::backend_mut()` handed them to any caller, so a 4-byte buffer described as 2^20 elements
//! reached the backend (on CUDA: `ncclAllReduce`, which reads and writes 4 MiB past the buffer). Now the backend's
//! collectives take a validated description that only the communicator makes (the compile-time half is the
//! `compile_fail` doctests in `anyccl_core::args` and this crate's `HostComm`); this suite checks the run-time
//! half: the communicator refuses every such call with `InvalidArgument`, touches nothing, sends nothing, and the
//! group stays usable.

use std::time::Duration;

use anyccl_core::{DataType, Error, InOut, InvalidArgument, ReduceOp};
use anyccl_host::{communicators, HostBuffer, HostOptions};

const BIG: usize = 1 << 20;

fn too_small(r: anyccl_core::Result<impl std::fmt::Debug>, what: &str) {
    match r {
        Err(Error::InvalidArgument(InvalidArgument::BufferTooSmall { have, need, .. })) => {
            assert!(have < need, "{what}: {have} < {need}");
        }
        other => panic!("{what}: expected InvalidArgument::BufferTooSmall, got {other:?}"),
    }
}

/// Every collective with a 4-byte buffer and a count of 2^20 is refused on every rank with `BufferTooSmall`, the
/// buffers keep their bytes, and a correct all-reduce afterwards still gives the right sum on every rank (nothing
/// was published or left half-done by the refused calls).
#[test]
fn short_buffers_with_large_counts_are_invalid_arguments_and_lose_nothing() {
    let world = 2;
    let opts = HostOptions { timeout: Duration::from_secs(20), ..HostOptions::default() };
    let comms = communicators(world, opts).expect("host group");
    let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                s.spawn(move || {
                    let rank = comm.rank();
                    let mut short = HostBuffer::from_elems(&[7.0f32 + rank as f32]);
                    let before = short.clone();
                    let other = HostBuffer::from_elems(&[1.0f32]);
                    let (f32_, sum) = (DataType::F32, ReduceOp::Sum);
                    too_small(comm.all_reduce(InOut::InPlace(short.as_bytes_mut()), BIG, f32_, sum, &()), "all-reduce");
                    let sep = InOut::Separate { send: other.as_bytes(), recv: short.as_bytes_mut() };
                    too_small(comm.all_reduce(sep, BIG, f32_, sum, &()), "out-of-place all-reduce");
                    for algo in anyccl_host::ALGORITHMS {
                        let r = comm.all_reduce_with(algo, InOut::InPlace(short.as_bytes_mut()), BIG, f32_, sum, &());
                        too_small(r, "all-reduce with an explicit algorithm");
                    }
                    too_small(comm.all_gather(InOut::InPlace(short.as_bytes_mut()), BIG, f32_, &()), "all-gather");
                    let rs = comm.reduce_scatter(InOut::InPlace(short.as_bytes_mut()), BIG, f32_, sum, &());
                    too_small(rs, "reduce-scatter");
                    too_small(comm.broadcast(InOut::InPlace(short.as_bytes_mut()), BIG, f32_, 0, &()), "broadcast");
                    too_small(comm.reduce(InOut::InPlace(short.as_bytes_mut()), BIG, f32_, sum, 0, &()), "reduce");
                    let peer = 1 - rank;
                    too_small(comm.send(short.as_bytes(), BIG, f32_, peer, &()), "send");
                    too_small(comm.recv(short.as_bytes_mut(), BIG, f32_, peer, &()), "recv");
                    assert_eq!(short, before, "rank {rank}: a refused call wrote into the buffer");
                    // The group is intact: a correct call after all the refused ones.
                    comm.all_reduce(InOut::InPlace(short.as_bytes_mut()), 1, f32_, sum, &()).expect("valid call");
                    short.to_vec::<f32>()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    assert_eq!(sums, vec![vec![15.0f32]; world]);
}

/// What `backend_mut()` was used for is a named method now: graph-buffer registration through any bootstrap
/// (the host backend has nothing to register), refused with `InvalidArgument` when the bootstrap is not this
/// communicator's group, before the backend sees it.
#[test]
fn graph_buffer_registration_is_a_communicator_method_that_checks_its_bootstrap() {
    use anyccl_core::bootstrap::LocalGroup;
    use anyccl_core::GraphRegistration;

    let mut comm = communicators(1, HostOptions::default()).expect("host group").remove(0);
    assert_eq!(comm.pending_graph_buffers(), 0);
    assert_eq!(comm.register_graph_buffers(None).expect("nothing to register"), GraphRegistration::default());
    let solo = LocalGroup::new(1, Duration::from_secs(5));
    let reg = comm.register_graph_buffers(Some(&mut solo.member(0))).expect("a matching bootstrap");
    assert_eq!(reg, GraphRegistration::default());
    let other = LocalGroup::new(2, Duration::from_secs(5));
    let e = comm.register_graph_buffers(Some(&mut other.member(1))).expect_err("rank 1 of 2 is not this group");
    assert!(matches!(e, Error::InvalidArgument(InvalidArgument::BadWorld(_))), "{e}");
    assert!(e.to_string().contains("the bootstrap is rank 1 of 2, but the communicator is rank 0 of 1"), "{e}");
}
