//! The custom kernels on one GPU with N ranks emulated as N buffer sets launched concurrently on N streams.

use anyccl_core::{DataType, MemoryRuntime};
use anyccl_cuda::custom::Kind;
use anyccl_cuda::emulated::EmulatedRanks;

fn encode(dtype: DataType, v: f64) -> Vec<u8> {
    match dtype {
        DataType::F32 => (v as f32).to_le_bytes().to_vec(),
        DataType::F16 => half::f16::from_f64(v).to_le_bytes().to_vec(),
        DataType::Bf16 => half::bf16::from_f64(v).to_le_bytes().to_vec(),
        _ => unreachable!("kernels handle f32, f16, bf16"),
    }
}

fn decode(dtype: DataType, b: &[u8]) -> f64 {
    match dtype {
        DataType::F32 => f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        DataType::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f64(),
        DataType::Bf16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f64(),
        _ => unreachable!("kernels handle f32, f16, bf16"),
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
    let blocks = 8;
    let g = EmulatedRanks::new(0, world, bytes, blocks).expect("emulated ranks");
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
            for kind in [Kind::OneShot, Kind::TwoShot, Kind::NvlsZeroCopyEmulated, Kind::NvlsBlockPipelineEmulated] {
                for bytes in [16, 16 * 1037, 4 << 20] {
                    seed += 1;
                    check(world, dtype, kind, bytes, seed, bytes == 16 * 1037);
                }
            }
        }
        eprintln!("world {world}: one-shot, two-shot, NVLS zero-copy and block-pipeline (emulated), f32/f16/bf16, 16 B / 16.2 KiB / 4 MiB: ok");
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
