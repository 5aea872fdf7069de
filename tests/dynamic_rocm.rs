//! The type-erased communicator on the ROCm backend, chosen at run time over the fake HIP runtime and the
//! computing fake RCCL of ROCm 7.1 (windows on): eager and captured all-reduce (the HIP one-shot kernel), a
//! symmetric window, the other collectives, HIP timing events, and buffers or streams of another backend refused
//! with a typed error.
//! No GPU needed.
//!
//! One test in its own binary: the chooser loads the HIP runtime once per process, from `ANYCCL_HIP_PATH`.

use anyccl_testkit::fake_ccl;
use anyccl_testkit::fake_hip;

use std::sync::Arc;

use anyccl::core::InvalidArgument;
use anyccl::dynamic::{communicators, from_env, BackendChoice, BackendKind};
use anyccl::{Algorithm, DataType, Error, InOut, ReduceOp, Result, Selector};

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// What one rank saw: eager sum, replayed sum, symmetric sum, gathered ranks, chosen algorithm.
type Seen = (Vec<u8>, Vec<u8>, Vec<u8>, Vec<u8>, Algorithm);

#[test]
fn rocm_ranks_chosen_at_run_time_reduce_capture_and_refuse_foreign_memory() {
    let hip = fake_hip::build_hip();
    let rccl = fake_hip::build_rccl(&fake_ccl::RCCL_7_1);
    // Set before anything reads them, in this binary's only test.
    std::env::set_var("ANYCCL_HIP_PATH", &hip);
    std::env::set_var("ANYCCL_RCCL_PATH", &rccl);
    std::env::set_var("NCCL_CUMEM_ENABLE", "1");
    std::env::remove_var("ANYCCL_DISABLE");
    let fake = fake_hip::FakeHip::open(&hip);
    fake.reset();
    let chosen = communicators(BackendChoice::Rocm, 2, Arc::new(Selector::defaults())).expect("rocm ranks");
    assert_eq!((chosen.backend, chosen.comms.len()), (BackendKind::Rocm, 2));
    let lib = chosen.comms[0].library().expect("RCCL");
    assert!(lib.starts_with("RCCL 2.27.7 (") && lib.contains("rocm-7.1"), "{lib}");
    assert_eq!(chosen.comms[1].device(), "GPU 1 (gfx90a)");
    const N: usize = 256;
    let seen: Vec<Result<Seen>> = std::thread::scope(|s| {
        let hs: Vec<_> = chosen
            .comms
            .into_iter()
            .map(|mut c| {
                s.spawn(move || -> Result<Seen> {
                    let rank = c.rank();
                    let st = c.stream()?;
                    let input = f32s(&[rank as f32 + 1.0; N]);
                    let mut buf = c.alloc(N * 4)?;
                    c.upload(&mut buf, &input, &st)?;
                    let sel = c.all_reduce(InOut::InPlace(&mut buf), N, DataType::F32, ReduceOp::Sum, &st)?;
                    let mut eager = vec![0u8; N * 4];
                    c.download(&buf, &mut eager, &st)?;
                    // Captured: nothing runs until the replay.
                    c.upload(&mut buf, &input, &st)?;
                    let g = c.capture(&st, &mut |c, s| {
                        c.all_reduce(InOut::InPlace(&mut buf), N, DataType::F32, ReduceOp::Sum, s).map(|_| ())
                    })?;
                    g.launch(&st)?;
                    c.synchronize(&st)?;
                    let mut replayed = vec![0u8; N * 4];
                    c.download(&buf, &mut replayed, &st)?;
                    // A symmetric window, reduced with the explicit algorithm.
                    let mut win = c.symmetric_buffer(N * 4, &st)?;
                    assert!(win.is_symmetric());
                    c.upload(&mut win, &input, &st)?;
                    c.all_reduce_with(
                        Algorithm::CclSymmetric,
                        InOut::InPlace(&mut win),
                        N,
                        DataType::F32,
                        ReduceOp::Sum,
                        &st,
                    )?;
                    let mut sym = vec![0u8; N * 4];
                    c.download(&win, &mut sym, &st)?;
                    drop(win);
                    // Another collective through the same face.
                    let mut mine = c.alloc(4)?;
                    c.upload(&mut mine, &(rank as f32).to_le_bytes(), &st)?;
                    let mut all = c.alloc(8)?;
                    c.all_gather(InOut::Separate { send: &mine, recv: &mut all }, 1, DataType::F32, &st)?;
                    let mut gathered = vec![0u8; 8];
                    c.download(&all, &mut gathered, &st)?;
                    c.barrier(&st)?;
                    Ok((eager, replayed, sym, gathered, sel.algorithm))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    for r in seen {
        let (eager, replayed, sym, gathered, algo) = r.expect("rank ran");
        assert_eq!(eager, f32s(&[3.0; N]), "1 + 2");
        assert_eq!(replayed, f32s(&[3.0; N]), "the captured call, replayed once");
        assert_eq!(sym, f32s(&[3.0; N]), "in the window");
        assert_eq!(gathered, f32s(&[0.0, 1.0]));
        // 1 KiB of f32 at world 2: the HIP one-shot kernel where it is built (the fake emulates it), else RCCL.
        let want = if anyccl::rocm::kernels::NOT_BUILT.is_none() { Algorithm::OneShot } else { Algorithm::Ccl };
        assert_eq!(algo, want);
    }
    assert_eq!(fake.violations(), Vec::<String>::new(), "capture violations");

    // Memory and streams of another backend: refused before the call, with both backends named.
    let mut one = communicators(BackendChoice::Rocm, 1, Arc::new(Selector::defaults())).expect("one rank");
    let mut host = communicators(BackendChoice::Host, 1, Arc::new(Selector::defaults())).expect("host rank");
    let (r, h) = (&mut one.comms[0], &mut host.comms[0]);
    let (rs, hs) = (r.stream().expect("hip stream"), h.stream().expect("host stream"));
    let mut foreign = h.alloc(16).expect("host memory");
    let e = r.all_reduce(InOut::InPlace(&mut foreign), 4, DataType::F32, ReduceOp::Sum, &rs).expect_err("foreign");
    assert_eq!(
        e,
        Error::InvalidArgument(InvalidArgument::WrongBackend { which: "buffer", found: "host", expected: "rocm" })
    );
    let mut mine = r.alloc(16).expect("device memory");
    let e = r.all_reduce(InOut::InPlace(&mut mine), 4, DataType::F32, ReduceOp::Sum, &hs).expect_err("host stream");
    assert!(e.to_string().contains("stream belongs to the host backend, but this communicator is rocm"), "{e}");
    let e = h.upload(&mut mine, &[0; 16], &hs).expect_err("device memory on the host communicator");
    assert!(matches!(e, Error::InvalidArgument(InvalidArgument::WrongBackend { found: "rocm", .. })), "{e:?}");
    // HIP timing events through the erased face: created, recorded, read and destroyed in balance; a record on a
    // capturing stream refused before HIP sees it (the capture stays valid); a stream of another backend refused.
    let calls = |n: &str| fake.calls(n);
    let before: Vec<i32> = ["hipEventCreate", "hipEventRecord", "hipEventElapsedTime", "hipEventDestroy"]
        .iter()
        .map(|n| calls(n))
        .collect();
    {
        let (start, end) = (r.event().expect("a HIP event"), r.event().expect("a HIP event"));
        start.record(&rs).expect("record");
        r.all_reduce(InOut::InPlace(&mut mine), 4, DataType::F32, ReduceOp::Sum, &rs).expect("all-reduce");
        end.record(&rs).expect("record");
        r.synchronize(&rs).expect("synchronize");
        // The fake's hipEventElapsedTime reports 1 µs.
        assert_eq!(start.elapsed_ms(&end).expect("elapsed"), 0.001);
        let g = r
            .capture(&rs, &mut |_, s| {
                let e = start.record(s).expect_err("refused during capture");
                assert!(matches!(e, Error::InvalidArgument(InvalidArgument::DuringCapture { .. })), "{e:?}");
                Ok(())
            })
            .expect("the capture stays valid");
        g.launch(&rs).expect("replay");
        r.synchronize(&rs).expect("synchronize");
        let e = start.record(&hs).expect_err("a host stream");
        assert_eq!(
            e,
            Error::InvalidArgument(InvalidArgument::WrongBackend { which: "stream", found: "host", expected: "rocm" })
        );
    }
    let after: Vec<i32> = ["hipEventCreate", "hipEventRecord", "hipEventElapsedTime", "hipEventDestroy"]
        .iter()
        .map(|n| calls(n))
        .collect();
    let delta: Vec<i32> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert_eq!(delta, [2, 2, 1, 2], "created, recorded (refused records never reach HIP), read, destroyed");
    assert_eq!(fake.violations(), Vec::<String>::new(), "capture violations around the events");
    // One process per GPU on ROCm joins through the rendezvous: without a launcher's variables it says which one
    // is missing, before any GPU work.
    for v in ["WORLD_SIZE", "SLURM_NTASKS", "RANK", "SLURM_PROCID"] {
        std::env::remove_var(v);
    }
    let e = from_env(BackendChoice::Rocm, Arc::new(Selector::defaults())).err().expect("refused");
    assert!(e.to_string().contains("WORLD_SIZE"), "{e}");
    let t = one.comms.pop().expect("rank").close_in_background();
    assert_eq!(t.wait(), Ok(()));
}
