//! The quantized two-shot all-reduce and deterministic mode on one GPU with N ranks emulated as N buffer sets
//! launched concurrently on N streams.
//!
//! - Quantized (fp8 e4m3 / int8 with one f32 scale per 32 elements): every rank's output equals the host model
//!   (`anyccl_kernels_common::quant::model`, re-exported as `anyccl_gpu::quant::model`, rounded once to the output type) value for value (±0 alike), the
//!   error against the exact sum is within the documented bound, ranks agree bitwise, and graph replays equal the
//!   eager run; 2..=8 ranks, f32/f16/bf16, 16 B to 64 MiB.
//! - Deterministic: one-shot, two-shot, two-shot in rounds, inputs read directly or through staging, eager and
//!   replayed, every size: all bitwise equal to the host's rank-order sum (f32, rounded once), so to each other, run
//!   after run, and independent of the message size.

use anyccl_core::{DataType, MemoryRuntime};
use anyccl_cuda::custom::Kind;
use anyccl_gpu::quant::model as quant;
use anyccl_lab::emulated::{EmulatedRanks, InputMode};
use anyccl_lab::emulated_quant::{Format, QuantRanks};

fn encode(dtype: DataType, v: f32) -> Vec<u8> {
    match dtype {
        DataType::F32 => v.to_le_bytes().to_vec(),
        DataType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
        DataType::Bf16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
        other => panic!("the custom kernels handle f32, f16 and bf16; this test asked for {other}"),
    }
}

fn decode(dtype: DataType, b: &[u8]) -> f32 {
    match dtype {
        DataType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        DataType::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
        DataType::Bf16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        other => panic!("the custom kernels handle f32, f16 and bf16; this test asked for {other}"),
    }
}

/// Half an ulp of the output type, relative.
fn unit(dtype: DataType) -> f64 {
    match dtype {
        DataType::F32 => 2f64.powi(-24),
        DataType::F16 => 2f64.powi(-11),
        _ => 2f64.powi(-8),
    }
}

/// xorshift64*: fresh, reproducible inputs without a dependency; uniform in [-1, 1).
fn rng(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    move || {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        (((s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0) as f32
    }
}

/// Rank r's input: values of magnitudes 1/16 to 16 varying every 97 elements (like activations), as the element
/// type holds them (f32 values, and their bytes).
fn input(dtype: DataType, n: usize, seed: u64) -> (Vec<f32>, Vec<u8>) {
    let mut next = rng(seed);
    let scales = [0.0625f32, 1.0, 16.0, 0.25];
    let vals: Vec<f32> =
        (0..n).map(|i| decode(dtype, &encode(dtype, next() * scales[(i / 97) % scales.len()]))).collect();
    let bytes = vals.iter().flat_map(|v| encode(dtype, *v)).collect();
    (vals, bytes)
}

/// A second handle on a buffer of the group, for the upload/download API.
fn view(b: &anyccl_cuda::DeviceBuffer) -> anyccl_cuda::DeviceBuffer {
    // SAFETY: the group owns the allocation and outlives every use of the view in this test.
    unsafe { anyccl_cuda::DeviceBuffer::from_raw(b.device_ptr(), b.len(), 0) }
}

fn outputs(g: &EmulatedRanks) -> Vec<Vec<u8>> {
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

fn poison(g: &EmulatedRanks) {
    let p = vec![0xFFu8; g.bytes];
    for o in &g.outputs {
        g.runtime.upload(&mut view(o), &p, &g.streams[0]).expect("poison");
    }
}

/// Uploads fresh inputs to every rank; returns them as f32.
fn upload_inputs(g: &EmulatedRanks, dtype: DataType, seed: u64) -> Vec<Vec<f32>> {
    let n = g.bytes / dtype.size_bytes();
    (0..g.inputs.len())
        .map(|r| {
            let (vals, bytes) = input(dtype, n, seed ^ ((r as u64 + 1) << 32));
            g.runtime.upload(&mut view(&g.inputs[r]), &bytes, &g.streams[0]).expect("upload");
            vals
        })
        .collect()
}

/// One quantized case: eager against the model and the bound, ranks equal, replay equal to eager.
fn check_quant(world: usize, dtype: DataType, format: Format, bytes: usize, seed: u64, graph: bool) -> quant::Measured {
    let q = QuantRanks::new(0, world, bytes, 8).expect("emulated ranks");
    let g = &q.ranks;
    let ins = upload_inputs(g, dtype, seed);
    poison(g);
    q.launch(format, dtype).expect("launch");
    g.synchronize().expect("sync");
    let eager = outputs(g);
    let esz = dtype.size_bytes();
    let n = bytes / esz;
    let refs: Vec<&[f32]> = ins.iter().map(Vec::as_slice).collect();
    let model = quant::model(format, &refs);
    let s = quant::block_magnitudes(&refs);
    let mut mismatches = Vec::new();
    let (mut got64, mut exact64) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n {
        let got = decode(dtype, &eager[0][i * esz..(i + 1) * esz]);
        let want = decode(dtype, &encode(dtype, model[i]));
        if got != want && mismatches.len() < 8 {
            mismatches.push(format!("element {i}: {got} (model {want})"));
        }
        let exact: f64 = ins.iter().map(|x| f64::from(x[i])).sum();
        let bound = quant::bound_f32(format, s[i]) + unit(dtype) * f64::from(model[i].abs()) + 1e-30;
        assert!(
            (f64::from(got) - exact).abs() <= bound,
            "{format:?} {dtype} world {world} bytes {bytes}: element {i} = {got}, exact {exact}, bound {bound}"
        );
        got64.push(f64::from(got));
        exact64.push(exact);
    }
    assert!(
        mismatches.is_empty(),
        "{format:?} {dtype} world {world} bytes {bytes}: differs from the model: {mismatches:?}"
    );
    for (r, o) in eager.iter().enumerate() {
        assert_eq!(o, &eager[0], "{format:?} {dtype} world {world}: rank {r} differs bitwise from rank 0");
    }
    if graph {
        let graphs = q.capture(format, dtype, 2).expect("capture");
        poison(g);
        for (gr, st) in graphs.iter().zip(&g.streams) {
            gr.launch(st).expect("replay");
        }
        g.synchronize().expect("sync");
        assert_eq!(outputs(g), eager, "{format:?} {dtype} world {world}: graph replay differs from eager");
    }
    quant::measure(&got64, &exact64)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn quantized_two_shot_matches_the_host_model_within_the_bound_for_2_to_8_ranks() {
    let mut seed = 1;
    for world in 2..=8 {
        for dtype in [DataType::F32, DataType::F16, DataType::Bf16] {
            for format in Format::ALL {
                // One vector (a partial block), a size whose blocks do not divide among the ranks, 1 MiB.
                for bytes in [16, 16 * 1037, 1 << 20] {
                    seed += 1;
                    check_quant(world, dtype, format, bytes, seed, bytes == 16 * 1037);
                }
            }
        }
        eprintln!(
            "world {world}: fp8 and int8, f32/f16/bf16, 16 B / 16.2 KiB / 1 MiB: equal to the model, within the bound"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn quantized_two_shot_at_64_mib_with_8_and_2_ranks_and_its_measured_error() {
    for (world, dtype) in [(8, DataType::Bf16), (2, DataType::Bf16), (8, DataType::F32)] {
        for format in Format::ALL {
            let m =
                check_quant(world, dtype, format, 64 << 20, 77 + world as u64, world == 8 && dtype == DataType::Bf16);
            eprintln!(
                "{} {dtype} world {world} 64 MiB: max |err|/max |exact| = {:.5}, sum |err|/sum |exact| = {:.5}",
                format.name(),
                m.max_rel,
                m.mean_rel
            );
            let (max_rel, mean_rel) = if format == Format::Fp8E4m3 { (0.1, 0.05) } else { (0.015, 0.015) };
            assert!(m.max_rel < max_rel && m.mean_rel < mean_rel, "{format:?}: {m:?} above the documented figures");
        }
    }
}

/// The rank-order sum the deterministic algorithms compute: rank 0's value as f32, plus ranks 1..W-1 in order in
/// f32, rounded once to the element type.
fn rank_order_sum(dtype: DataType, ins: &[Vec<f32>]) -> Vec<u8> {
    let n = ins[0].len();
    (0..n)
        .flat_map(|i| {
            let mut acc = ins[0][i];
            for x in &ins[1..] {
                acc += x[i];
            }
            encode(dtype, acc)
        })
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the GPU machine with --ignored"]
fn deterministic_forms_are_bitwise_identical_across_forms_sizes_and_runs() {
    for world in [2, 3, 5, 8] {
        for dtype in [DataType::F32, DataType::F16, DataType::Bf16] {
            let sizes = [16usize, 16 * 1037, 4 << 20];
            let mut prefix: Option<Vec<u8>> = None;
            for bytes in sizes {
                let mut g = EmulatedRanks::new(0, world, bytes, 8).expect("emulated ranks");
                // The same seed for every size: each smaller message's inputs are the larger ones' first elements,
                // so the outputs' common prefix must agree (independence of the message size).
                let ins = upload_inputs(&g, dtype, 4242 + world as u64);
                let want = rank_order_sum(dtype, &ins);
                let mut forms = 0;
                for (kind, round, mode) in [
                    (Kind::OneShot, 0, InputMode::Direct),
                    (Kind::OneShot, 0, InputMode::Staged),
                    (Kind::TwoShot, 0, InputMode::Direct),
                    (Kind::TwoShot, 0, InputMode::Staged),
                    (Kind::TwoShot, 48 << 10, InputMode::Staged),
                    (Kind::TwoShot, 16 * 3, InputMode::Direct),
                ] {
                    g.two_shot_round = round;
                    g.input_mode = mode;
                    for run in 0..2 {
                        poison(&g);
                        g.launch(kind, dtype).expect("launch");
                        g.synchronize().expect("sync");
                        for (r, o) in outputs(&g).iter().enumerate() {
                            assert!(
                                *o == want,
                                "{kind:?} round {round} {mode:?} {dtype} world {world} bytes {bytes} run {run} rank \
                                 {r}: not the rank-order sum bitwise"
                            );
                        }
                        forms += 1;
                    }
                }
                // And replayed from a graph.
                g.two_shot_round = 0;
                g.input_mode = InputMode::Direct;
                for kind in [Kind::OneShot, Kind::TwoShot] {
                    let graphs = g.capture(kind, dtype, 2).expect("capture");
                    poison(&g);
                    for (gr, st) in graphs.iter().zip(&g.streams) {
                        gr.launch(st).expect("replay");
                    }
                    g.synchronize().expect("sync");
                    assert!(
                        outputs(&g).iter().all(|o| *o == want),
                        "{kind:?} replay {dtype} world {world} bytes {bytes}"
                    );
                }
                if let Some(p) = &prefix {
                    assert_eq!(&want[..p.len()], &p[..], "{dtype} world {world}: a smaller message's sums differ");
                }
                prefix = Some(want);
                assert_eq!(forms, 12);
            }
        }
        eprintln!("world {world}: one-shot / two-shot / rounds, direct / staged, eager / replay: bitwise identical");
    }
}
