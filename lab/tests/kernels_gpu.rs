//! The custom kernels on one GPU with N ranks emulated as N buffer sets launched concurrently on N streams.

use anyccl_core::{DataType, MemoryRuntime};
use anyccl_cuda::custom::Kind;
use anyccl_lab::emulated::{EmulatedRanks, InputMode};

fn encode(dtype: DataType, v: f64) -> Vec<u8> {
    match dtype {
        DataType::F32 => (v as f32).to_le_bytes().to_vec(),
        DataType::F16 => half::f16::from_f64(v).to_le_bytes().to_vec(),
        DataType::Bf16 => half::bf16::from_f64(v).to_le_bytes().to_vec(),
        other => panic!("the custom kernels handle f32, f16 and bf16; this test asked for {other}"),
    }
}

fn decode(dtype: DataType, b: &[u8]) -> f64 {
    match dtype {
        DataType::F32 => f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        DataType::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f64(),
        DataType::Bf16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f64(),
        other => panic!("the custom kernels handle f32, f16 and bf16; this test asked for {other}"),
    }
}

/// xorshift64*: fresh, reproducible inputs without a dependency.
fn rng(seed: u64) -> impl FnMut() -> f64 {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    move || {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        ((s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }
}

fn check(world: usize, dtype: DataType, kind: Kind, bytes: usize, seed: u64, graph: bool) {
    check_with(world, dtype, kind, bytes, seed, graph, &|_| {})
}

/// Random inputs, poisoned outputs, an eager run checked against the f64 reference and bitwise across ranks, and
/// (with `graph`) a captured replay equal to eager; `setup` configures the group first.
fn check_with(
    world: usize,
    dtype: DataType,
    kind: Kind,
    bytes: usize,
    seed: u64,
    graph: bool,
    setup: &dyn Fn(&mut EmulatedRanks),
) {
    let blocks = 8;
    let mut g = EmulatedRanks::new(0, world, bytes, blocks).expect("emulated ranks");
    setup(&mut g);
    let g = g;
    let s = &g.streams[0];
    let esz = dtype.size_bytes();
    let n = bytes / esz;
    let mut inputs = Vec::new();
    for r in 0..world {
        let mut next = rng(seed ^ (r as u64 + 1));
        let b: Vec<u8> = (0..n).flat_map(|_| encode(dtype, next())).collect();
        let mut buf = unsafe_view(&g.inputs[r]);
        g.runtime.upload(&mut buf, &b, s).expect("upload");
        inputs.push(b);
    }
    let poison = vec![0xFFu8; bytes];
    let reset = |g: &EmulatedRanks| {
        for o in &g.outputs {
            g.runtime.upload(&mut unsafe_view(o), &poison, s).expect("poison");
        }
    };
    reset(&g);
    g.launch(kind, dtype).expect("launch");
    g.synchronize().expect("sync");
    let eager: Vec<Vec<u8>> = g
        .outputs
        .iter()
        .map(|o| {
            let mut v = vec![0u8; bytes];
            g.runtime.download(o, &mut v, s).expect("download");
            v
        })
        .collect();
    // Against an f64 reference: rounding of the inputs is already in them; the kernel accumulates in f32 and
    // rounds once to the output type.
    let (u_out, u_acc) = match dtype {
        DataType::F32 => (2f64.powi(-24), 2f64.powi(-24)),
        DataType::F16 => (2f64.powi(-11), 2f64.powi(-24)),
        _ => (2f64.powi(-8), 2f64.powi(-24)),
    };
    for i in 0..n {
        let xs: Vec<f64> = inputs.iter().map(|b| decode(dtype, &b[i * esz..(i + 1) * esz])).collect();
        let want: f64 = xs.iter().sum();
        let abs: f64 = xs.iter().map(|x| x.abs()).sum();
        let tol = world as f64 * u_acc * abs + u_out * want.abs() + 1e-30;
        let got = decode(dtype, &eager[0][i * esz..(i + 1) * esz]);
        assert!(
            !got.is_nan() && (got - want).abs() <= tol,
            "{kind:?} {dtype} world {world} bytes {bytes}: element {i} = {got}, expected {want} ± {tol}"
        );
    }
    for (r, o) in eager.iter().enumerate() {
        assert_eq!(o, &eager[0], "{kind:?} {dtype} world {world}: rank {r} differs bitwise from rank 0");
    }
    if graph {
        let graphs = g.capture(kind, dtype, 3).expect("capture");
        reset(&g);
        for (gr, st) in graphs.iter().zip(&g.streams) {
            gr.launch(st).expect("replay");
        }
        g.synchronize().expect("sync");
        for (r, o) in g.outputs.iter().enumerate() {
            let mut v = vec![0u8; bytes];
            g.runtime.download(o, &mut v, s).expect("download");
            assert_eq!(v, eager[r], "{kind:?} {dtype} world {world}: graph replay differs from eager on rank {r}");
        }
    }
}

/// A second handle on a buffer of the group, for the upload/download API.
fn unsafe_view(b: &anyccl_cuda::DeviceBuffer) -> anyccl_cuda::DeviceBuffer {
    // SAFETY: the group owns the allocation and outlives every use of the view in this test.
    unsafe { anyccl_cuda::DeviceBuffer::from_raw(b.device_ptr(), b.len(), 0) }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn custom_and_emulated_nvls_kernels_for_2_to_8_ranks_match_the_reference_and_replay() {
    let mut seed = 1;
    for world in 2..=8 {
        for dtype in [DataType::F32, DataType::F16, DataType::Bf16] {
            for kind in Kind::ALL {
                for bytes in [16, 16 * 1037, 4 << 20] {
                    seed += 1;
                    check(world, dtype, kind, bytes, seed, bytes == 16 * 1037);
                }
            }
        }
        eprintln!("world {world}: one-shot, two-shot, NVLS zero-copy, warp- and block-pipeline (emulated), f32/f16/bf16, 16 B / 16.2 KiB / 4 MiB: ok");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn two_shot_in_rounds_matches_the_reference_and_replays() {
    // Rounds that divide the message, that do not (a short last round), one vector, and rounds whose chunks are
    // shorter than the world (some ranks own nothing in a round).
    let mut seed = 1000;
    for world in [2, 3, 5, 8] {
        for (bytes, round) in
            [(4 << 20, 1 << 20), (4 << 20, 48 << 10), (16 * 1037, 16 * 100), (16 * 1037, 16), (16 * 1037, 16 * 3)]
        {
            for dtype in [DataType::F32, DataType::Bf16] {
                seed += 1;
                check_with(world, dtype, Kind::TwoShot, bytes, seed, bytes < (1 << 20), &|g| g.two_shot_round = round);
            }
        }
    }
}

#[test]
fn sizes_that_are_not_16_byte_multiples_are_refused() {
    if let Some(why) = anyccl_kernels_cuda::NOT_BUILT {
        let w = anyccl_cuda::custom::ineligible(DataType::Bf16, 4096, 4).expect("no kernels");
        assert!(w.contains(why), "{w}");
        return;
    }
    assert!(anyccl_cuda::custom::ineligible(DataType::Bf16, 4098, 4).is_some_and(|w| w.contains("16")));
    assert!(anyccl_cuda::custom::ineligible(DataType::I32, 4096, 4).is_some());
    assert!(anyccl_cuda::custom::ineligible(DataType::Bf16, 4096, 9).is_some());
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn one_and_two_shot_read_inputs_through_staging_and_tables() {
    // Staged: the kernel copies its input into staging first (the communicator's eager path). Table: the inputs
    // come through a table in device memory, as staging (unregistered) or as the inputs themselves (registered).
    let mut seed = 2000;
    for world in [2, 3, 8] {
        for kind in [Kind::OneShot, Kind::TwoShot] {
            for dtype in [DataType::F32, DataType::Bf16] {
                for bytes in [16, 16 * 1037, 4 << 20] {
                    for (mode, registered) in
                        [(InputMode::Staged, false), (InputMode::Table, false), (InputMode::Table, true)]
                    {
                        seed += 1;
                        check_with(world, dtype, kind, bytes, seed, bytes == 16 * 1037, &|g| {
                            g.input_mode = mode;
                            g.set_tables(registered).expect("tables");
                        });
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn a_captured_kernel_switches_from_staging_to_registered_inputs_at_replay() {
    for world in [2, 5, 8] {
        for kind in [Kind::OneShot, Kind::TwoShot] {
            let bytes = 16 * 4099;
            let mut g = EmulatedRanks::new(0, world, bytes, 8).expect("emulated ranks");
            g.input_mode = InputMode::Table;
            let own_stream = g.runtime.stream().expect("stream");
            let s = &own_stream;
            let input = |r: usize| -> Vec<u8> {
                (0..bytes / 4).flat_map(|i| (((i * 7 + r * 3) % 29) as f32).to_le_bytes()).collect()
            };
            for r in 0..world {
                g.runtime.upload(&mut unsafe_view(&g.inputs[r]), &input(r), s).expect("upload");
            }
            let graphs = g.capture(kind, DataType::F32, 1).expect("capture");
            let replay = |g: &EmulatedRanks| -> Vec<Vec<u8>> {
                for (gr, st) in graphs.iter().zip(&g.streams) {
                    gr.launch(st).expect("replay");
                }
                g.synchronize().expect("sync");
                g.outputs
                    .iter()
                    .map(|o| {
                        let mut v = vec![0u8; bytes];
                        g.runtime.download(o, &mut v, s).expect("download");
                        v
                    })
                    .collect()
            };
            let staging = |g: &EmulatedRanks, r: usize| -> Vec<u8> {
                let mut v = vec![0u8; bytes];
                g.runtime.download(&g.stage_out[r], &mut v, s).expect("download");
                v
            };
            // Sums of small integers are exact in f32: the expected output is known exactly.
            let want: Vec<u8> = (0..bytes / 4)
                .flat_map(|i| ((0..world).map(|r| ((i * 7 + r * 3) % 29) as f32).sum::<f32>()).to_le_bytes())
                .collect();
            let before = replay(&g);
            for (r, out) in before.iter().enumerate() {
                assert_eq!(out, &want, "{kind:?} world {world} rank {r}: unregistered replay");
                assert_eq!(staging(&g, r), input(r), "{kind:?}: an unregistered table copies the input to staging");
            }
            g.set_tables(true).expect("register");
            for r in 0..world {
                g.runtime.upload(&mut unsafe_view(&g.stage_out[r]), &vec![0xFFu8; bytes], s).expect("poison");
            }
            let after = replay(&g);
            for (r, out) in after.iter().enumerate() {
                assert_eq!(out, &want, "{kind:?} world {world} rank {r}: registered replay");
                assert!(
                    staging(&g, r).iter().all(|b| *b == 0xFF),
                    "{kind:?}: a registered table reads the inputs directly; staging must stay untouched"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn a_kernel_waiting_for_a_dead_peer_stops_when_its_abort_word_is_set() {
    for kind in Kind::ALL {
        let g = EmulatedRanks::new(0, 2, 1 << 20, 8).expect("emulated ranks");
        // Only rank 0 runs: its first barrier waits for rank 1, which never comes.
        g.launch_rank(kind, DataType::Bf16, 0, &g.streams[0]).expect("launch rank 0");
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!g.streams[0].query().expect("query"), "{kind:?}: rank 0 finished without its peer");
        let t = std::time::Instant::now();
        anyccl_cuda::custom::stop_waiting(&g.flags[0], &g.streams[1], std::time::Duration::from_secs(1))
            .expect("set the abort word");
        while !g.streams[0].query().expect("query") {
            if t.elapsed() > std::time::Duration::from_secs(10) {
                // Dropping the buffers would wait for the kernel forever: end the process, failing.
                eprintln!("{kind:?}: the kernel still waits 10 s after its abort word was set");
                std::process::exit(1);
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        eprintln!("{kind:?}: stopped {:?} after its abort word was set", t.elapsed());
    }
}
