//! The quantized two-shot all-reduce (`include/anyccl/quant.h`) on the host: its buffer layout, a model that
//! mirrors the kernels' arithmetic operation for operation (so CI checks the error bound without a GPU, and the GPU
//! tests compare the kernels with it), and the error bound.
//!
//! # The algorithm
//!
//! The message is cut into blocks of [`BLOCK`] (32) elements from element 0 (the last block may be shorter). Each
//! block is sent as 32 one-byte codes and one f32 scale: `amax` = the block's largest magnitude, `scale = amax /
//! QMAX`, `code = quantize(x · (QMAX / amax))` with QMAX = 448 for fp8 e4m3 (round to nearest even, saturated to
//! ±448) and 127 for int8 (round half to even, clamped to ±127), value = `code · scale`. Each rank quantizes its
//! input; rank r sums its chunk of blocks over every rank in rank order (`acc = fma(value, scale, acc)` from 0,
//! f32) and quantizes the sum again; every rank dequantizes every chunk into its output (rounded once to the
//! input type). The result is the same on every rank and every run, and independent of the world's chunking (a
//! block is summed the same way whoever owns it), but it is not the exact-order sum of the one-shot and two-shot
//! kernels: quantized all-reduces are never deterministic-mode algorithms.
//!
//! # Error bound
//!
//! For an element of block b, with `S` = the sum over ranks of each rank's largest magnitude in block b (of its
//! input), the dequantized f32 result differs from the exact sum of the inputs by at most
//! [`bound_f32`]`(format, S)` = `(2δ + δ² + 2⁻¹⁸) · S`, where δ is the format's worst relative step: 2⁻⁴ for e4m3
//! (3 mantissa bits, round to nearest: a block's values lose at most 1/16 of the block's largest magnitude) and
//! 1/254 for int8 (half a step of amax/127). One δ·S comes from quantizing the inputs, one δ·(1+δ)·S from quantizing
//! the sum (whose block magnitude is at most (1+δ)·S), and 2⁻¹⁸·S covers the f32 rounding of scales, products and
//! sums. The output type's rounding adds half an ulp of the result (`u · |result|`).
//!
//! Typical errors are far below the bound: see [`measure`], the tests `measured_errors_*` and the crate README.

/// Elements per quantization block (`ANYCCL_QUANT_BLOCK`).
pub const BLOCK: usize = 32;

/// The data format the ranks exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Format {
    /// fp8 e4m3 (OCP "fn": bias 7, largest finite 448, one NaN code `0x7f` per sign, signed zero).
    Fp8E4m3,
    /// int8, symmetric (−127..=127).
    Int8,
}

impl Format {
    /// Both formats.
    pub const ALL: [Format; 2] = [Format::Fp8E4m3, Format::Int8];

    /// The largest code magnitude a block's largest value maps to (448, 127).
    pub const fn qmax(self) -> f32 {
        match self {
            Format::Fp8E4m3 => 448.0,
            Format::Int8 => 127.0,
        }
    }

    /// The worst error of one quantization, as a fraction of the block's largest magnitude (2⁻⁴, 1/254).
    pub const fn delta(self) -> f64 {
        match self {
            Format::Fp8E4m3 => 0.0625,
            Format::Int8 => 1.0 / 254.0,
        }
    }

    /// The kernels' name part (`fp8`, `int8`).
    pub const fn name(self) -> &'static str {
        match self {
            Format::Fp8E4m3 => "fp8",
            Format::Int8 => "int8",
        }
    }

    fn encode(self, x: f32) -> u8 {
        match self {
            Format::Fp8E4m3 => e4m3_encode(x),
            // As the kernel: clamped as a float first (`fmaxf` turns NaN into -127), then converted exactly.
            Format::Int8 => {
                let r = x.round_ties_even();
                (if r.is_nan() { -127.0 } else { r.clamp(-127.0, 127.0) }) as i8 as u8
            }
        }
    }

    fn decode(self, c: u8) -> f32 {
        match self {
            Format::Fp8E4m3 => e4m3_decode(c),
            Format::Int8 => f32::from(c as i8),
        }
    }
}

/// Blocks of a message of `elements` elements.
pub const fn blocks(elements: usize) -> usize {
    elements.div_ceil(BLOCK)
}

/// Bytes of one rank's staging (and of its scratch) for a message of `elements` elements: `blocks × 32` code
/// bytes, then `blocks` f32 scales. `None` on overflow.
pub fn staging_bytes(elements: usize) -> Option<usize> {
    blocks(elements).checked_mul(BLOCK + 4)
}

/// f32 to fp8 e4m3 code: round to nearest even, saturated to ±448, NaN to `0x7f` with its sign (the kernels'
/// conversion: `cvt.rn.satfinite.e4m3x2.f32` on NVIDIA, the same by hand in `vendor_hip.h`). Hand-written: it must
/// be the kernels' rounding bit for bit, which the tests check against a search of every code.
pub fn e4m3_encode(f: f32) -> u8 {
    let u = f.to_bits();
    let sign = ((u >> 24) & 0x80) as u8;
    let a = u & 0x7fff_ffff;
    if a > 0x7f80_0000 {
        return sign | 0x7f;
    }
    if a >= 0x43e0_0000 {
        return sign | 0x7e;
    }
    if a >= 0x3c80_0000 {
        let mut r = a - 0x3c00_0000;
        r += 0x7ffff + ((r >> 20) & 1);
        return sign | (r >> 20) as u8;
    }
    // Subnormal: a multiple of 2^-9, at most 8 (the smallest normal) after rounding.
    sign | (f32::from_bits(a) * 512.0).round_ties_even() as u8
}

/// fp8 e4m3 code to f32 (exact).
pub fn e4m3_decode(c: u8) -> f32 {
    let sign = u32::from(c & 0x80) << 24;
    let (e, m) = (u32::from((c >> 3) & 0xf), u32::from(c & 7));
    if e == 15 && m == 7 {
        return f32::from_bits(sign | 0x7fc0_0000);
    }
    let v = if e == 0 { m as f32 * 0.001_953_125 } else { f32::from_bits(((e + 120) << 23) | (m << 20)) };
    f32::from_bits(v.to_bits() | sign)
}

/// One block quantized: codes and scale, as the kernel stores them (`quant_store`).
fn quantize(format: Format, x: &[f32; BLOCK]) -> ([u8; BLOCK], f32) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let q = format.qmax();
    // As the kernel: capped at the largest float (a tiny block would otherwise get an infinite factor, and 0 · inf
    // is NaN).
    let inv = if amax > 0.0 { (q / amax).min(f32::MAX) } else { 0.0 };
    let scale = amax / q;
    let mut codes = [0u8; BLOCK];
    for (c, v) in codes.iter_mut().zip(x) {
        *c = format.encode(v * inv);
    }
    (codes, scale)
}

/// The kernels' result for every element, as f32 before the rounding to the output type: `inputs[r]` is rank r's
/// input as f32 (f16 and bf16 inputs converted exactly). Every input has the same length.
pub fn model(format: Format, inputs: &[&[f32]]) -> Vec<f32> {
    let n = inputs.first().map_or(0, |i| i.len());
    let mut out = Vec::with_capacity(n);
    for b in 0..blocks(n) {
        let (s, e) = (b * BLOCK, ((b + 1) * BLOCK).min(n));
        let mut acc = [0.0f32; BLOCK];
        for input in inputs {
            let mut x = [0.0f32; BLOCK];
            x[..e - s].copy_from_slice(&input[s..e]);
            let (codes, scale) = quantize(format, &x);
            for (a, c) in acc.iter_mut().zip(codes) {
                *a = format.decode(c).mul_add(scale, *a);
            }
        }
        let (codes, scale) = quantize(format, &acc);
        out.extend(codes[..e - s].iter().map(|c| format.decode(*c) * scale));
    }
    out
}

/// `S` of the error bound for every element: the sum over ranks of each rank's largest magnitude in the element's
/// block.
pub fn block_magnitudes(inputs: &[&[f32]]) -> Vec<f64> {
    let n = inputs.first().map_or(0, |i| i.len());
    let mut out = Vec::with_capacity(n);
    for b in 0..blocks(n) {
        let (s, e) = (b * BLOCK, ((b + 1) * BLOCK).min(n));
        let sum: f64 = inputs.iter().map(|i| i[s..e].iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs())))).sum();
        out.extend(std::iter::repeat_n(sum, e - s));
    }
    out
}

/// The most the dequantized f32 result of an element may differ from the exact sum of the inputs, given `s` from
/// [`block_magnitudes`] (see the module's "Error bound").
pub fn bound_f32(format: Format, s: f64) -> f64 {
    let d = format.delta();
    (2.0 * d + d * d + 2f64.powi(-18)) * s
}

/// Measured error of a result against the exact sums: the largest absolute error over the largest exact magnitude
/// (`max_rel`), and the summed absolute error over the summed exact magnitude (`mean_rel`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measured {
    /// max |result − exact| / max |exact|.
    pub max_rel: f64,
    /// Σ |result − exact| / Σ |exact|.
    pub mean_rel: f64,
}

/// The error of `result` against `exact`, element by element (see [`Measured`]).
pub fn measure(result: &[f64], exact: &[f64]) -> Measured {
    let (mut max_err, mut max_abs, mut sum_err, mut sum_abs) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for (r, x) in result.iter().zip(exact) {
        let err = (r - x).abs();
        max_err = max_err.max(err);
        max_abs = max_abs.max(x.abs());
        sum_err += err;
        sum_abs += x.abs();
    }
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { a };
    Measured { max_rel: ratio(max_err, max_abs), mean_rel: ratio(sum_err, sum_abs) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64*: reproducible inputs without a dependency; uniform in [-1, 1).
    fn rng(seed: u64) -> impl FnMut() -> f64 {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        move || {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            ((s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        }
    }

    /// The code a correct round-to-nearest-even, saturating e4m3 conversion gives, by searching every finite code.
    fn nearest_code(x: f32) -> u8 {
        if x.is_nan() {
            return if x.is_sign_negative() { 0xff } else { 0x7f };
        }
        let x = f64::from(x);
        let mut best: Option<(f64, u8)> = None;
        for c in (0u8..=255).filter(|c| c & 0x7f != 0x7f) {
            let v = f64::from(e4m3_decode(c));
            if v.is_sign_negative() != x.is_sign_negative() {
                continue;
            }
            let d = (v - x).abs();
            best = match best {
                // Ties go to the even code (mantissa's lowest bit 0).
                Some((bd, bc)) if d > bd || (d == bd && bc & 1 == 0) => Some((bd, bc)),
                _ => Some((d, c)),
            };
        }
        best.map_or(0, |(_, c)| c)
    }

    #[test]
    fn e4m3_decodes_every_code_and_encodes_it_back() {
        assert_eq!(e4m3_decode(0x7e), 448.0);
        assert_eq!(e4m3_decode(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_decode(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_decode(0x38), 1.0);
        assert!(e4m3_decode(0x7f).is_nan() && e4m3_decode(0xff).is_nan());
        assert!(e4m3_decode(0x80) == 0.0 && e4m3_decode(0x80).is_sign_negative());
        for c in (0u8..=255).filter(|c| c & 0x7f != 0x7f) {
            assert_eq!(e4m3_encode(e4m3_decode(c)), c, "code {c:#04x}");
        }
    }

    #[test]
    fn e4m3_rounds_to_nearest_even_and_saturates() {
        // Every midpoint between neighbouring codes, just below and above it, plus random values over the range.
        let mut xs: Vec<f32> = Vec::new();
        for c in 0u8..0x7e {
            let (a, b) = (e4m3_decode(c), e4m3_decode(c + 1));
            let mid = (a + b) / 2.0;
            xs.extend([mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1), a]);
        }
        let mut next = rng(7);
        xs.extend((0..20_000).map(|_| (next() * 500.0) as f32));
        xs.extend((0..5_000).map(|_| (next() * 0.03) as f32));
        xs.extend([448.0, 463.9, 464.0, 1e30, f32::INFINITY, 1e-30, 0.0]);
        for x in xs.iter().flat_map(|x| [*x, -*x]) {
            let want = if x.abs() >= 448.0 { (if x < 0.0 { 0x80 } else { 0 }) | 0x7e } else { nearest_code(x) };
            assert_eq!(e4m3_encode(x), want, "{x:e}");
        }
        assert_eq!(e4m3_encode(f32::NAN) & 0x7f, 0x7f);
    }

    #[test]
    fn layout_sizes() {
        assert_eq!(blocks(0), 0);
        assert_eq!(blocks(8), 1);
        assert_eq!(blocks(32), 1);
        assert_eq!(blocks(33), 2);
        assert_eq!(staging_bytes(64), Some(72));
        assert_eq!(staging_bytes(usize::MAX), None);
        // A 16-bit message of `bytes` needs at most bytes · 36/64 plus one block; f32 bytes · 36/128 plus one.
        for bytes in [16usize, 1 << 10, 64 << 20] {
            assert!(staging_bytes(bytes / 2).expect("small") <= bytes * 36 / 64 + 36);
        }
    }

    fn inputs(world: usize, n: usize, seed: u64, spread: f64) -> Vec<Vec<f32>> {
        (0..world)
            .map(|r| {
                let mut next = rng(seed ^ (r as u64 + 1));
                // Magnitudes over several orders within a message, like activations.
                (0..n).map(|i| (next() * spread.powf(((i / 97) % 4) as f64 - 1.5)) as f32).collect()
            })
            .collect()
    }

    #[test]
    fn the_model_stays_within_the_bound_for_2_to_8_ranks() {
        for format in Format::ALL {
            for world in 2..=8 {
                for n in [1usize, 8, 31, 32, 33, 1000, 4096 + 8] {
                    let ins = inputs(world, n, (world * 1000 + n) as u64, 10.0);
                    let refs: Vec<&[f32]> = ins.iter().map(Vec::as_slice).collect();
                    let got = model(format, &refs);
                    let s = block_magnitudes(&refs);
                    assert_eq!(got.len(), n);
                    for i in 0..n {
                        let exact: f64 = ins.iter().map(|x| f64::from(x[i])).sum();
                        let err = (f64::from(got[i]) - exact).abs();
                        let bound = bound_f32(format, s[i]);
                        assert!(err <= bound, "{format:?} world {world} n {n} element {i}: error {err} > {bound}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_bound_is_tight_enough_to_catch_a_wrong_scale() {
        // A model that forgot the rescale of the sum (or mixed up ranks) would be far outside: the bound is a few
        // percent of S for fp8 and under 1% for int8, not a blanket.
        assert!(bound_f32(Format::Fp8E4m3, 1.0) < 0.13);
        assert!(bound_f32(Format::Int8, 1.0) < 0.008);
        let a = [1.0f32; 32];
        let b = [0.5f32; 32];
        let got = model(Format::Int8, &[&a, &b]);
        assert!(got.iter().all(|v| (*v - 1.5).abs() < 1e-6), "{got:?}");
    }

    #[test]
    fn tiny_blocks_give_no_nan() {
        // Largest magnitude 1e-39 (an f32 subnormal): 448 / 1e-39 overflows; the capped factor keeps zeros zero.
        let mut x = [0.0f32; 32];
        x[3] = 1e-39;
        x[7] = -5e-40;
        for format in Format::ALL {
            let got = model(format, &[&x, &x]);
            assert!(got.iter().all(|v| !v.is_nan()), "{format:?}: {got:?}");
            assert!(got.iter().zip(&x).all(|(g, v)| (f64::from(*g) - 2.0 * f64::from(*v)).abs() <= 4e-39), "{got:?}");
        }
    }

    #[test]
    fn zero_blocks_and_exact_values_survive() {
        // An all-zero block has scale 0 (no division by zero); a block of powers of two within 2^3 of its max is
        // exact in e4m3.
        let z = [0.0f32; 40];
        assert!(model(Format::Fp8E4m3, &[&z, &z]).iter().all(|v| *v == 0.0));
        let p: Vec<f32> = (0..32).map(|i| [1.0, 2.0, 4.0, -8.0][i % 4]).collect();
        let got = model(Format::Fp8E4m3, &[&p, &p]);
        for (g, x) in got.iter().zip(&p) {
            assert_eq!(*g, 2.0 * x);
        }
    }

    #[test]
    fn measured_errors_with_mixed_magnitudes() {
        // The GPU test's and the bench's inputs: magnitudes 1/16, 1, 16, 1/4 changing every 97 elements, so some
        // blocks mix magnitudes 256× apart (their small values lose most of their bits); 8 ranks, 1 Mi elements.
        let scales = [0.0625, 1.0, 16.0, 0.25];
        let ins: Vec<Vec<f32>> = (0..8)
            .map(|r| {
                let mut next = rng(99 + r);
                (0..1 << 20).map(|i| (next() * scales[(i / 97) % 4]) as f32).collect()
            })
            .collect();
        let refs: Vec<&[f32]> = ins.iter().map(Vec::as_slice).collect();
        let exact: Vec<f64> = (0..1 << 20).map(|i| ins.iter().map(|x| f64::from(x[i])).sum()).collect();
        for (format, max_rel, mean_rel) in [(Format::Fp8E4m3, 0.1, 0.05), (Format::Int8, 0.015, 0.015)] {
            let got: Vec<f64> = model(format, &refs).into_iter().map(f64::from).collect();
            let m = measure(&got, &exact);
            eprintln!("{format:?} (mixed magnitudes): max_rel {:.5} mean_rel {:.5}", m.max_rel, m.mean_rel);
            assert!(m.max_rel < max_rel && m.mean_rel < mean_rel, "{format:?}: {m:?}");
        }
    }

    #[test]
    fn measured_errors_are_what_the_readme_says() {
        // 8 ranks, uniform inputs in [-1, 1): the figures quoted in the README (rounded up), for 1 Mi elements.
        let ins = inputs(8, 1 << 20, 42, 1.0);
        let refs: Vec<&[f32]> = ins.iter().map(Vec::as_slice).collect();
        let exact: Vec<f64> = (0..1 << 20).map(|i| ins.iter().map(|x| f64::from(x[i])).sum()).collect();
        for (format, max_rel, mean_rel) in [(Format::Fp8E4m3, 0.06, 0.04), (Format::Int8, 0.008, 0.008)] {
            let got: Vec<f64> = model(format, &refs).into_iter().map(f64::from).collect();
            let m = measure(&got, &exact);
            eprintln!("{format:?}: max_rel {:.5} mean_rel {:.5}", m.max_rel, m.mean_rel);
            assert!(m.max_rel < max_rel && m.mean_rel < mean_rel, "{format:?}: {m:?}");
            assert!(m.mean_rel > 0.0, "quantization loses something");
        }
    }
}
