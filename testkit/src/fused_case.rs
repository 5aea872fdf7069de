//! Shared by the fake-runtime tests of the fused all-reduce + residual add + RMSNorm (ROCm's and CUDA's): one call's
//! inputs, residual and weight, and what core's host reference says its output and new residual are.

use anyccl_core::fused::{from_f32, norm_row, to_f32, RmsNormCall, RmsNormSpec};
use anyccl_core::DataType;

/// xorshift64*: reproducible values in [-1, 1).
pub fn rng(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    move || {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        ((s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u32 << 24) as f32) * 2.0 - 1.0
    }
}

/// `n` elements of `dtype` (bits) from `seed`, their magnitudes spread over a few orders (every 37 elements).
pub fn elements(dtype: DataType, seed: u64, n: usize) -> Vec<u16> {
    let mut next = rng(seed);
    (0..n).map(|i| from_f32(dtype, next() * [0.25f32, 1.0, 4.0, 0.0625][(i / 37) % 4])).collect()
}

/// Element bits as the buffers hold them (native endian).
pub fn bytes_of(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// Element bits of buffer bytes.
pub fn u16s(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2).map(|c| u16::from_ne_bytes([c[0], c[1]])).collect()
}

/// One fused case: every rank's input, the residual (the same on every rank) and the weight.
pub struct Case {
    /// The validated call.
    pub call: RmsNormCall,
    /// Every rank's input (element bits).
    pub inputs: Vec<Vec<u16>>,
    /// The residual.
    pub residual: Vec<u16>,
    /// The weight.
    pub weight: Vec<u16>,
}

impl Case {
    pub fn new(spec: RmsNormSpec, world: usize, seed: u64) -> Case {
        let call = spec.call().expect("a valid spec");
        let n = spec.tokens * spec.hidden;
        let inputs = (0..world).map(|r| elements(spec.dtype, seed + r as u64, n)).collect();
        let residual = elements(spec.dtype, seed + 100, n);
        let weight = elements(spec.dtype, seed + 200, spec.hidden);
        Case { call, inputs, residual, weight }
    }

    /// Core's host reference: the rank-order f32 sum rounded once, then core's row arithmetic (the output bytes,
    /// the new residual).
    pub fn expected(&self) -> (Vec<u8>, Vec<u16>) {
        let (dtype, hidden) = (self.call.dtype, self.call.hidden);
        let row_out = hidden * self.call.output.element_bytes(dtype);
        let mut out = vec![0u8; self.call.out_bytes];
        let mut residual = self.residual.clone();
        let mut scratch = vec![0f32; hidden];
        for t in 0..self.call.tokens {
            let row = t * hidden..(t + 1) * hidden;
            let reduced: Vec<u16> = row
                .clone()
                .map(|i| {
                    let mut acc = to_f32(dtype, self.inputs[0][i]);
                    for x in &self.inputs[1..] {
                        acc += to_f32(dtype, x[i]);
                    }
                    from_f32(dtype, acc)
                })
                .collect();
            let out_row = &mut out[t * row_out..(t + 1) * row_out];
            norm_row(&self.call, &reduced, &mut residual[row], &self.weight, out_row, &mut scratch);
        }
        (out, residual)
    }
}
