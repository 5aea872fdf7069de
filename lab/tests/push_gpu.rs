//! The push-mode one-shot (`anyccl_lab::push`) on one GPU with N ranks emulated as N buffer sets on N streams:
//! bitwise equal to today's one-shot over many consecutive calls (both buffer sets, grids that change between
//! calls, with and without programmatic dependent launch), in graph replays, for inputs that hold the sentinel's
//! bits, and stopped by the abort word when a peer never writes. The push two-shot (`PushShape::TwoShot`, the same
//! receive buffers and protocol) runs interleaved with the one-shot in each of these and must give the same bits.

use anyccl_core::{DataType, MemoryRuntime};
use anyccl_cuda::custom::Kind;
use anyccl_lab::emulated::EmulatedRanks;
use anyccl_lab::push::{push_blocks, EmulatedPush, PushShape, PUSH_MAX_BYTES, PUSH_SENTINEL};

const DTYPES: [DataType; 3] = [DataType::F32, DataType::F16, DataType::Bf16];

/// xorshift64*: reproducible inputs without a dependency.
fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    move || {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        s.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

fn encode(dtype: DataType, v: f64) -> Vec<u8> {
    match dtype {
        DataType::F32 => (v as f32).to_le_bytes().to_vec(),
        DataType::F16 => half::f16::from_f64(v).to_le_bytes().to_vec(),
        _ => half::bf16::from_f64(v).to_le_bytes().to_vec(),
    }
}

fn decode(dtype: DataType, b: &[u8]) -> f64 {
    match dtype {
        DataType::F32 => f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        DataType::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f64(),
        _ => half::bf16::from_le_bytes([b[0], b[1]]).to_f64(),
    }
}

/// Random values in [-1, 1) of `dtype`, `bytes` of them.
fn random_input(dtype: DataType, bytes: usize, seed: u64) -> Vec<u8> {
    let mut next = rng(seed);
    let n = bytes / dtype.size_bytes();
    (0..n).flat_map(|_| encode(dtype, (next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0)).collect()
}

/// A second handle on a buffer of the group, for the upload/download API.
fn view(b: &anyccl_cuda::DeviceBuffer) -> anyccl_cuda::DeviceBuffer {
    // SAFETY: the group owns the allocation and outlives every use of the view in these tests.
    unsafe { anyccl_cuda::DeviceBuffer::from_raw(b.device_ptr(), b.len(), 0) }
}

fn upload_inputs(g: &EmulatedRanks, inputs: &[Vec<u8>]) {
    let s = &g.streams[0];
    g.synchronize().expect("sync");
    for (b, data) in g.inputs.iter().zip(inputs) {
        g.runtime.upload(&mut view(b), data, s).expect("upload");
    }
    s.synchronize().expect("sync");
}

fn poison_outputs(g: &EmulatedRanks) {
    let s = &g.streams[0];
    g.synchronize().expect("sync");
    for b in &g.outputs {
        g.runtime.upload(&mut view(b), &vec![0xA5u8; g.bytes], s).expect("poison");
    }
    s.synchronize().expect("sync");
}

fn outputs(g: &EmulatedRanks) -> Vec<Vec<u8>> {
    g.synchronize().expect("sync");
    let s = &g.streams[0];
    g.outputs
        .iter()
        .map(|o| {
            let mut v = vec![0u8; g.bytes];
            g.runtime.download(o, &mut v, s).expect("download");
            v
        })
        .collect()
}

/// Today's one-shot on the group's current inputs: every rank's output.
fn one_shot(g: &EmulatedRanks, dtype: DataType) -> Vec<Vec<u8>> {
    poison_outputs(g);
    g.launch(Kind::OneShot, dtype).expect("one-shot launch");
    outputs(g)
}

/// Checks `got` (every rank's output) against the f64 sum of `inputs` within the kernels' rounding, and bitwise
/// against `want` (today's one-shot) on every rank.
fn check(what: &str, dtype: DataType, inputs: &[Vec<u8>], got: &[Vec<u8>], want: &[Vec<u8>]) {
    let esz = dtype.size_bytes();
    let u_out = match dtype {
        DataType::F32 => 2f64.powi(-24),
        DataType::F16 => 2f64.powi(-11),
        _ => 2f64.powi(-8),
    };
    let world = inputs.len() as f64;
    for i in 0..got[0].len() / esz {
        let xs: Vec<f64> = inputs.iter().map(|b| decode(dtype, &b[i * esz..(i + 1) * esz])).collect();
        let sum: f64 = xs.iter().sum();
        let got0 = decode(dtype, &got[0][i * esz..(i + 1) * esz]);
        if xs.iter().any(|x| x.is_nan()) {
            assert!(got0.is_nan(), "{what}: element {i}: NaN input, got {got0}");
            continue;
        }
        let tol = world * 2f64.powi(-24) * xs.iter().map(|x| x.abs()).sum::<f64>() + u_out * sum.abs() + 1e-30;
        assert!((got0 - sum).abs() <= tol, "{what}: element {i} = {got0}, expected {sum} ± {tol}");
    }
    for (r, (g, w)) in got.iter().zip(want).enumerate() {
        if g != w {
            let at = g.iter().zip(w).position(|(a, b)| a != b).unwrap_or(0);
            panic!("{what}: rank {r} differs bitwise from today's one-shot at byte {at}");
        }
    }
}

/// Every rank's call counter equals `calls` and every slot of both sets holds the sentinel again.
fn check_state(g: &EmulatedRanks, p: &EmulatedPush, calls: u32, what: &str) {
    g.synchronize().expect("sync");
    for r in 0..g.streams.len() {
        let (epoch, sets) = p.state(g, r, &g.streams[0]).expect("state");
        assert_eq!(epoch, calls, "{what}: rank {r}'s call counter");
        if let Some(at) =
            sets.chunks_exact(4).position(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) != PUSH_SENTINEL)
        {
            panic!("{what}: rank {r}: receive word {at} was not reset to the sentinel");
        }
    }
}

/// `calls` consecutive eager calls, each on fresh inputs (so data left over from the previous call, or from the
/// other set, would show), with the grid changing between calls, the first half without programmatic dependent
/// launch and the second half with it (where the device has it); each checked against today's one-shot.
fn eager_calls(world: usize, dtype: DataType, bytes: usize, calls: usize, seed: u64) -> (EmulatedRanks, EmulatedPush) {
    let base = push_blocks(bytes, world);
    let mut g = EmulatedRanks::new(0, world, bytes, base).expect("emulated ranks");
    let mut p = EmulatedPush::new(&g).expect("push buffers");
    let pdl = p.pdl_supported();
    for call in 0..calls {
        let inputs: Vec<Vec<u8>> =
            (0..world).map(|r| random_input(dtype, bytes, seed * 1000 + call as u64 * 10 + r as u64)).collect();
        upload_inputs(&g, &inputs);
        g.blocks = base;
        let want = one_shot(&g, dtype);
        g.blocks = [base, 1, 3, base, 2, 7][call % 6];
        p.pdl = pdl && call >= calls / 2;
        // Odd calls run the push two-shot: both shapes share the receive buffers and the call counter.
        p.shape = if call % 2 == 1 { PushShape::TwoShot } else { PushShape::OneShot };
        poison_outputs(&g);
        p.launch(&g, dtype).expect("push launch");
        let got = outputs(&g);
        let what =
            format!("push {:?} {dtype} world {world} {bytes} B call {call} blocks {} pdl {}", p.shape, g.blocks, p.pdl);
        check(&what, dtype, &inputs, &got, &want);
    }
    g.blocks = base;
    check_state(&g, &p, calls as u32, &format!("push {dtype} world {world} {bytes} B"));
    (g, p)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn push_equals_today_s_one_shot_bitwise_for_2_to_8_ranks_over_consecutive_calls() {
    let mut seed = 1;
    for world in 2..=8 {
        for dtype in DTYPES {
            for bytes in [16, 4 << 10, 16 * 1037, 64 << 10, PUSH_MAX_BYTES] {
                seed += 1;
                eager_calls(world, dtype, bytes, 6, seed);
            }
        }
        eprintln!("world {world}: push one- and two-shot f32/f16/bf16, 16 B to 256 KiB, 6 calls: equal to one-shot");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn back_to_back_calls_without_host_sync_and_graph_replays_equal_eager() {
    let mut seed = 5000;
    for world in [2, 3, 5, 8] {
        for dtype in DTYPES {
            for bytes in [16 * 1037, PUSH_MAX_BYTES] {
                seed += 1;
                // Five eager calls leave the counter odd, so the graphs below start on the second set.
                let (g, mut p) = eager_calls(world, dtype, bytes, 5, seed);
                let inputs: Vec<Vec<u8>> =
                    (0..world).map(|r| random_input(dtype, bytes, seed * 77 + r as u64)).collect();
                upload_inputs(&g, &inputs);
                let want = one_shot(&g, dtype);
                // Seven calls queued back to back on every rank's stream, no host synchronisation in between.
                poison_outputs(&g);
                for k in 0..7 {
                    p.shape = if k % 3 == 1 { PushShape::TwoShot } else { PushShape::OneShot };
                    p.launch(&g, dtype).expect("push launch");
                }
                check(&format!("back-to-back {dtype} world {world} {bytes} B"), dtype, &inputs, &outputs(&g), &want);
                // Graphs of 3 calls, replayed 3 times (9 more calls, crossing the sets at every call), with and
                // without programmatic dependent launch edges.
                let mut calls = 12;
                for (pdl, shape) in [(false, PushShape::OneShot), (p.pdl_supported(), PushShape::TwoShot)] {
                    (p.pdl, p.shape) = (pdl, shape);
                    let graphs = p.capture(&g, dtype, 3).expect("capture");
                    for replay in 0..3 {
                        poison_outputs(&g);
                        for (gr, s) in graphs.iter().zip(&g.streams) {
                            gr.launch(s).expect("replay");
                        }
                        calls += 3;
                        let what = format!("graph {shape:?} {dtype} world {world} {bytes} B pdl {pdl} replay {replay}");
                        check(&what, dtype, &inputs, &outputs(&g), &want);
                    }
                }
                check_state(&g, &p, calls, &format!("graphs {dtype} world {world} {bytes} B"));
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn inputs_holding_the_sentinel_s_bits_are_reduced_like_today_s_one_shot() {
    for world in [2, 4, 8] {
        for dtype in DTYPES {
            let bytes = 16 * 1037;
            let g = EmulatedRanks::new(0, world, bytes, push_blocks(bytes, world)).expect("emulated ranks");
            let mut p = EmulatedPush::new(&g).expect("push buffers");
            // Random values with, on every rank, words of exactly the sentinel's bits (0xFFFFFFFF: NaNs) at
            // scattered places, words that merely start or end like it, and -0.0 (the sign bit alone).
            let inputs: Vec<Vec<u8>> = (0..world)
                .map(|r| {
                    let mut b = random_input(dtype, bytes, 9000 + r as u64);
                    for (k, w) in b.chunks_exact_mut(4).enumerate() {
                        let bits = match (k + r) % 97 {
                            0 => Some(PUSH_SENTINEL),
                            13 => Some(0xFFFF_7FFF),
                            29 => Some(0x7FFF_FFFF),
                            41 => Some(0x8000_8000),
                            _ => None,
                        };
                        if let Some(bits) = bits {
                            w.copy_from_slice(&bits.to_le_bytes());
                        }
                    }
                    b
                })
                .collect();
            upload_inputs(&g, &inputs);
            let want = one_shot(&g, dtype);
            for call in 0..4 {
                p.shape = if call % 2 == 1 { PushShape::TwoShot } else { PushShape::OneShot };
                poison_outputs(&g);
                p.launch(&g, dtype).expect("push launch");
                let what = format!("sentinel input {:?} {dtype} world {world} call {call}", p.shape);
                check(&what, dtype, &inputs, &outputs(&g), &want);
            }
            check_state(&g, &p, 4, &format!("sentinel input {dtype} world {world}"));
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn in_place_push_equals_out_of_place() {
    for world in [2, 8] {
        let dtype = DataType::Bf16;
        let bytes = 64 << 10;
        let mut g = EmulatedRanks::new(0, world, bytes, push_blocks(bytes, world)).expect("emulated ranks");
        let inputs: Vec<Vec<u8>> = (0..world).map(|r| random_input(dtype, bytes, 700 + r as u64)).collect();
        upload_inputs(&g, &inputs);
        let want = one_shot(&g, dtype);
        // Every rank's output is its input (a view of the same buffer): the kernel reads its own input only where
        // its own thread then writes the output.
        g.outputs = g.inputs.iter().map(view).collect();
        let mut p = EmulatedPush::new(&g).expect("push buffers");
        for shape in [PushShape::OneShot, PushShape::TwoShot] {
            upload_inputs(&g, &inputs);
            p.shape = shape;
            p.launch(&g, dtype).expect("push launch");
            check(&format!("in place {shape:?} world {world}"), dtype, &inputs, &outputs(&g), &want);
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn a_push_kernel_whose_peer_never_writes_stops_when_its_abort_word_is_set() {
    for (pdl, shape) in [(false, PushShape::OneShot), (true, PushShape::OneShot), (true, PushShape::TwoShot)] {
        let g = EmulatedRanks::new(0, 2, 64 << 10, 4).expect("emulated ranks");
        let mut p = EmulatedPush::new(&g).expect("push buffers");
        if pdl && !p.pdl_supported() {
            continue;
        }
        (p.pdl, p.shape) = (pdl, shape);
        // Only rank 0 runs: it pushes into rank 1's buffer, then waits for rank 1's data, which never comes.
        p.launch_rank(&g, DataType::Bf16, 0, &g.streams[0]).expect("launch rank 0");
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!g.streams[0].query().expect("query"), "{shape:?} pdl {pdl}: rank 0 finished without its peer's data");
        let t = std::time::Instant::now();
        anyccl_cuda::custom::stop_waiting(&g.flags[0], &g.streams[1], std::time::Duration::from_secs(1))
            .expect("set the abort word");
        while !g.streams[0].query().expect("query") {
            if t.elapsed() > std::time::Duration::from_secs(10) {
                // Dropping the buffers would wait for the kernel forever: end the process, failing.
                eprintln!("{shape:?} pdl {pdl}: the push kernel still waits 10 s after its abort word was set");
                std::process::exit(1);
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        eprintln!("{shape:?} pdl {pdl}: stopped {:?} after its abort word was set", t.elapsed());
    }
}

#[test]
fn sizes_beyond_the_receive_slots_and_odd_sizes_are_refused() {
    use anyccl_lab::push::ineligible;
    if let Some(why) = anyccl_kernels_cuda::NOT_BUILT {
        assert!(ineligible(DataType::Bf16, 4096, 4).is_some_and(|w| w.contains(why)));
        return;
    }
    assert_eq!(ineligible(DataType::Bf16, PUSH_MAX_BYTES, 8), None);
    assert_eq!(ineligible(DataType::F32, 16, 2), None);
    assert!(ineligible(DataType::Bf16, PUSH_MAX_BYTES + 16, 8).is_some_and(|w| w.contains("receive slots")));
    assert!(ineligible(DataType::Bf16, 4098, 4).is_some_and(|w| w.contains("16")));
    assert!(ineligible(DataType::I32, 4096, 4).is_some());
    assert!(ineligible(DataType::Bf16, 4096, 9).is_some());
    assert!(ineligible(DataType::Bf16, 4096, 1).is_some());
    assert_eq!(push_blocks(16, 2), 4);
    assert_eq!(push_blocks(64 << 10, 8), 8);
    assert_eq!(push_blocks(PUSH_MAX_BYTES, 8), 8);
    assert_eq!(push_blocks(PUSH_MAX_BYTES, 2), 32);
    for world in 2..=8 {
        assert!(world * push_blocks(PUSH_MAX_BYTES, world) as usize * 2 <= 128, "world {world}");
    }
}
