//! Deterministic mode on the host backend: the host's one-shot and two-shot sum every element in rank order
//! (`reduce_into`), so with the mode on every all-reduce is bitwise identical across the two algorithms, across
//! message sizes and across runs; the ring, whose chunks start their sums at different ranks, is never selected
//! and refused when named.

use std::time::Duration;

use anyccl_core::{Algorithm, DataType, Error, InOut, ReduceOp};
use anyccl_host::{communicators, HostBuffer, HostOptions};

/// xorshift64*: reproducible values of mixed magnitudes, so the order of the additions shows in the result.
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|i| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let u = (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
            (u * [1e-3, 1.0, 1e4][i % 3]) as f32
        })
        .collect()
}

#[test]
fn one_shot_and_two_shot_agree_bitwise_at_every_size_and_the_ring_is_refused() {
    let world = 4;
    let sizes = [1usize, 7, 1000, 9000];
    let opts = HostOptions { timeout: Duration::from_secs(20), ..HostOptions::default() };
    let comms = communicators(world, opts).expect("host group");
    let results: Vec<Vec<Vec<u32>>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                s.spawn(move || {
                    let rank = comm.rank();
                    comm.set_deterministic(true);
                    let mut out = Vec::new();
                    for n in sizes {
                        let input = values(rank as u64 + 1, n);
                        // Selected (the host rules name the ring nowhere first, but the mode must never fall to it),
                        // then each deterministic algorithm named, twice.
                        let mut buf = HostBuffer::from_elems(&input);
                        let sel = comm
                            .all_reduce(InOut::InPlace(buf.as_bytes_mut()), n, DataType::F32, ReduceOp::Sum, &())
                            .expect("selected");
                        assert!(sel.algorithm.nondeterministic().is_none(), "{sel:?}");
                        out.push(buf.to_vec::<f32>().iter().map(|v| v.to_bits()).collect());
                        for algo in [Algorithm::OneShot, Algorithm::TwoShot, Algorithm::OneShot, Algorithm::TwoShot] {
                            let mut buf = HostBuffer::from_elems(&input);
                            comm.all_reduce_with(
                                algo,
                                InOut::InPlace(buf.as_bytes_mut()),
                                n,
                                DataType::F32,
                                ReduceOp::Sum,
                                &(),
                            )
                            .expect("deterministic algorithm");
                            out.push(buf.to_vec::<f32>().iter().map(|v| v.to_bits()).collect());
                        }
                        let mut buf = HostBuffer::from_elems(&input);
                        let r = comm.all_reduce_with(
                            Algorithm::Ring,
                            InOut::InPlace(buf.as_bytes_mut()),
                            n,
                            DataType::F32,
                            ReduceOp::Sum,
                            &(),
                        );
                        assert!(
                            matches!(r, Err(Error::AlgorithmNotEligible { algorithm: Algorithm::Ring, .. })),
                            "{r:?}"
                        );
                        assert_eq!(buf.to_vec::<f32>(), input, "a refused call touched the buffer");
                    }
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    // The rank-order f32 sum, computed here: every rank, every algorithm, every run.
    let mut k = 0;
    for n in sizes {
        let ins: Vec<Vec<f32>> = (0..world).map(|r| values(r as u64 + 1, n)).collect();
        let want: Vec<u32> = (0..n)
            .map(|i| {
                let mut acc = ins[0][i];
                for x in &ins[1..] {
                    acc += x[i];
                }
                acc.to_bits()
            })
            .collect();
        for run in 0..5 {
            for (rank, r) in results.iter().enumerate() {
                assert_eq!(r[k + run], want, "size {n} call {run} rank {rank}: not the rank-order sum bitwise");
            }
        }
        k += 5;
    }
    // The mode matters: the ring's order differs from rank order for some element of these inputs.
    let n = 9000;
    let opts = HostOptions { timeout: Duration::from_secs(20), ..HostOptions::default() };
    let comms = communicators(world, opts).expect("host group");
    let ring: Vec<Vec<u32>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                s.spawn(move || {
                    let mut buf = HostBuffer::from_elems(&values(comm.rank() as u64 + 1, n));
                    comm.all_reduce_with(
                        Algorithm::Ring,
                        InOut::InPlace(buf.as_bytes_mut()),
                        n,
                        DataType::F32,
                        ReduceOp::Sum,
                        &(),
                    )
                    .expect("ring without the mode");
                    buf.to_vec::<f32>().iter().map(|v| v.to_bits()).collect()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    assert_ne!(ring[0], results[0][k - 5], "the ring happened to sum in rank order: the test shows nothing");
}
