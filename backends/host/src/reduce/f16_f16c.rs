//! The f16 reduction written with AVX2 and F16C instructions: eight elements per vector widened to f32 and
//! narrowed back by the processor's conversion instructions, folded in rank order, with no accumulator in memory.
//!
//! It computes the element-wise definition exactly: on a processor with F16C, `half`'s `f16::to_f32` and
//! `f16::from_f32` ([`Reducible::load`](super::Reducible::load) and [`Reducible::store`](super::Reducible::store) of `f16`) are these same instructions
//! (`vcvtph2ps`, and `vcvtps2ph` rounding to nearest even), and the operators are those of the bf16 kernel
//! ([`super::bf16_avx2`]), the same IEEE operations on the same operands in the same order. The tests compare it
//! with the definition bit for bit over every f16 value and lengths that are not a multiple of the vector width
//! (with the bf16 kernel's one freedom: which of two NaNs meeting in one operation the result carries).

#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m128i, __m256, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_div_ps, _mm256_set1_ps, _mm_loadu_si128,
    _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
};

use half::f16;

use super::bf16_avx2::{combine, op_of, AVG, MAX, MIN, PROD, SUM};
use super::Op;

/// Elements per vector.
const LANES: usize = 8;
/// Elements per tile: four vectors, four f32 accumulators.
const TILE: usize = 4 * LANES;

/// [`super::reduce_into`] for f16 on a processor with AVX2 and F16C: `out[i] = store(finish(load(x_0[i]) ∘
/// load(x_1[i]) ∘ …))` over `inputs` in order, over the shortest of `out` and the inputs.
///
/// # Safety
///
/// The processor must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn reduce(inputs: &[&[f16]], out: &mut [f16], op: Op, world: usize) {
    match op {
        Op::Sum => run::<SUM>(inputs, out, world),
        Op::Prod => run::<PROD>(inputs, out, world),
        Op::Min => run::<MIN>(inputs, out, world),
        Op::Max => run::<MAX>(inputs, out, world),
        Op::Avg => run::<AVG>(inputs, out, world),
    }
}

/// [`reduce`] for the operator `OP`.
#[target_feature(enable = "avx2,f16c")]
fn run<const OP: u8>(inputs: &[&[f16]], out: &mut [f16], world: usize) {
    let n = inputs.iter().map(|x| x.len()).fold(out.len(), usize::min);
    let Some((first, rest)) = inputs.split_first() else { return };
    let whole = n - n % TILE;
    let (tiles, tail) = out[..n].split_at_mut(whole);
    let divisor = _mm256_set1_ps(world as f32);
    for (t, o) in tiles.chunks_exact_mut(TILE).enumerate() {
        let at = t * TILE;
        let Some(mut acc) = load(first, at) else { return };
        for x in rest {
            let Some(b) = load(x, at) else { return };
            for (a, b) in acc.iter_mut().zip(b) {
                *a = combine::<OP>(*a, b);
            }
        }
        if OP == AVG {
            for a in &mut acc {
                *a = _mm256_div_ps(*a, divisor);
            }
        }
        for (o, a) in o.chunks_exact_mut(LANES).zip(acc) {
            let Ok(o) = <&mut [f16; LANES]>::try_from(o) else { return };
            let v = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(a);
            // SAFETY: `o` is 8 f16 values, 16 writable bytes, borrowed exclusively; the unaligned store has no
            // alignment requirement.
            unsafe { _mm_storeu_si128(o.as_mut_ptr().cast::<__m128i>(), v) };
        }
    }
    // The last elements one at a time, by the definition itself.
    super::reduce_elements(first, rest, tail, whole, op_of::<OP>(), world);
}

/// The 32 elements of `x` from `at`, widened to f32 by `vcvtph2ps` as `f16::to_f32` does; `None` if `x` is
/// shorter than `at + 32`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn load(x: &[f16], at: usize) -> Option<[__m256; 4]> {
    let x: &[f16; TILE] = x.get(at..at + TILE)?.try_into().ok()?;
    let part = |k: usize| {
        // SAFETY: `k < 4`, so `k * 8 .. k * 8 + 8` lies within the 32 elements of `x`: 16 readable bytes; the
        // unaligned load has no alignment requirement.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(x.as_ptr().add(k * LANES).cast::<__m128i>()) })
    };
    Some([part(0), part(1), part(2), part(3)])
}
