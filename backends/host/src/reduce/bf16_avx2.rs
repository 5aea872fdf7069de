//! The bf16 reduction written with AVX2 instructions: sixteen elements at a time, widened to f32 in registers,
//! folded in rank order and rounded back, with no accumulator in memory.
//!
//! It computes the element-wise definition exactly ([`Reducible::load`](super::Reducible::load), [`Reducible::combine`](super::Reducible::combine),
//! [`Reducible::finish`](super::Reducible::finish), [`Reducible::store`](super::Reducible::store) of `bf16`, in that order, input after input): the widening keeps
//! the bits and quiets a NaN as `load` does; the operators are the same IEEE operations on the same operands in
//! the same order (`min`/`max` as the select `b < a ? b : a`, which is what `minps b, a` computes, NaNs and signed
//! zeros included); the rounding is `store`'s, round to nearest even with a NaN quieted. The tests compare it with
//! the definition bit for bit over every bf16 value, NaN payloads, and lengths that are not a multiple of sixteen.
//! One freedom remains, the same in the definition: where two NaNs meet in one `+` or `*` (or a NaN meets one the
//! operation made), which payload the result carries is the compiler's choice of operand order (IEEE 754 and
//! Rust leave it open), so the tests accept either NaN there.
//!
//! Lane order: the widening unpacks each 128-bit half of a 16-element vector into a "low" vector (elements 0–3
//! and 8–11) and a "high" one (4–7 and 12–15); every input is widened the same way, the operators work lane by
//! lane, and the saturating pack that narrows the result interleaves the halves back into element order.

#![allow(unsafe_code)]

use std::arch::x86_64::{
    __m256, __m256i, _mm256_add_epi32, _mm256_add_ps, _mm256_and_si256, _mm256_blendv_epi8, _mm256_castps_si256,
    _mm256_castsi256_ps, _mm256_cmp_ps, _mm256_cmpgt_epi16, _mm256_div_ps, _mm256_loadu_si256, _mm256_max_ps,
    _mm256_min_ps, _mm256_movemask_ps, _mm256_mul_ps, _mm256_or_ps, _mm256_or_si256, _mm256_packs_epi32,
    _mm256_packus_epi32, _mm256_set1_epi16, _mm256_set1_epi32, _mm256_set1_ps, _mm256_setzero_si256, _mm256_srli_epi32,
    _mm256_storeu_si256, _mm256_unpackhi_epi16, _mm256_unpacklo_epi16, _CMP_UNORD_Q,
};

use half::bf16;

use super::Op;

/// Elements per vector of bf16.
const LANES: usize = 16;
/// Elements per tile: two vectors, four f32 accumulators.
const TILE: usize = 2 * LANES;

/// The operators as const parameters, so that each gets its own loop with the operation fixed inside.
pub(super) const SUM: u8 = 0;
pub(super) const PROD: u8 = 1;
pub(super) const MIN: u8 = 2;
pub(super) const MAX: u8 = 3;
pub(super) const AVG: u8 = 4;

/// The operator `OP` stands for.
pub(super) const fn op_of<const OP: u8>() -> Op {
    match OP {
        SUM => Op::Sum,
        PROD => Op::Prod,
        MIN => Op::Min,
        MAX => Op::Max,
        _ => Op::Avg,
    }
}

/// [`super::reduce_into`] for bf16 on a processor with AVX2: `out[i] = store(finish(load(x_0[i]) ∘ load(x_1[i])
/// ∘ …))` over `inputs` in order, over the shortest of `out` and the inputs.
///
/// # Safety
///
/// The processor must support AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn reduce(inputs: &[&[bf16]], out: &mut [bf16], op: Op, world: usize) {
    match op {
        Op::Sum => run::<SUM>(inputs, out, world),
        Op::Prod => run::<PROD>(inputs, out, world),
        Op::Min => run::<MIN>(inputs, out, world),
        Op::Max => run::<MAX>(inputs, out, world),
        Op::Avg => run::<AVG>(inputs, out, world),
    }
}

/// [`reduce`] for the operator `OP`.
///
/// Quieting the NaNs on load costs a third of the work, and only matters where an input holds a NaN. For `sum`,
/// `prod` and `avg` a NaN operand always gives a NaN (IEEE 754), so a tile whose results hold no NaN had none in
/// its inputs either, and its quieting would have changed nothing: such tiles are folded without it, and the
/// rare tile with a NaN result is folded again with it. `min` and `max` can drop a NaN operand, so they always
/// quiet.
#[target_feature(enable = "avx2")]
fn run<const OP: u8>(inputs: &[&[bf16]], out: &mut [bf16], world: usize) {
    let n = inputs.iter().map(|x| x.len()).fold(out.len(), usize::min);
    let Some((first, rest)) = inputs.split_first() else { return };
    let whole = n - n % TILE;
    let (tiles, tail) = out[..n].split_at_mut(whole);
    let divisor = _mm256_set1_ps(world as f32);
    let always_quiet = OP == MIN || OP == MAX;
    for (t, o) in tiles.chunks_exact_mut(TILE).enumerate() {
        let at = t * TILE;
        let Some(mut acc) = fold::<OP>(first, rest, at, always_quiet, divisor) else { return };
        let (lo, hi) = if any_nan(&acc) {
            if !always_quiet {
                let Some(again) = fold::<OP>(first, rest, at, true, divisor) else { return };
                acc = again;
            }
            (narrow(acc[0], acc[1]), narrow(acc[2], acc[3]))
        } else {
            (narrow_numbers(acc[0], acc[1]), narrow_numbers(acc[2], acc[3]))
        };
        let Ok(o) = <&mut [bf16; TILE]>::try_from(o) else { return };
        // SAFETY: `o` is 32 bf16 values, 64 writable bytes, borrowed exclusively; the unaligned stores have no
        // alignment requirement.
        unsafe {
            _mm256_storeu_si256(o.as_mut_ptr().cast::<__m256i>(), lo);
            _mm256_storeu_si256(o.as_mut_ptr().add(LANES).cast::<__m256i>(), hi);
        }
    }
    // The last elements one at a time, by the definition itself.
    super::reduce_elements(first, rest, tail, whole, op_of::<OP>(), world);
}

/// The tile at `at`: every input's 32 elements widened (NaNs quieted if `quiet`) and folded in order into four f32
/// vectors (the two vectors' "low" and "high" halves), `avg` divided by `divisor`. `None` if an input is shorter
/// than `at + 32`.
#[target_feature(enable = "avx2")]
#[inline]
fn fold<const OP: u8>(
    first: &[bf16],
    rest: &[&[bf16]],
    at: usize,
    quiet: bool,
    divisor: __m256,
) -> Option<[__m256; 4]> {
    let (a0, a1) = load(first, at, quiet)?;
    let (a2, a3) = load(first, at + LANES, quiet)?;
    let mut acc = [a0, a1, a2, a3];
    for x in rest {
        let (b0, b1) = load(x, at, quiet)?;
        let (b2, b3) = load(x, at + LANES, quiet)?;
        for (a, b) in acc.iter_mut().zip([b0, b1, b2, b3]) {
            *a = combine::<OP>(*a, b);
        }
    }
    if OP == AVG {
        for a in &mut acc {
            *a = _mm256_div_ps(*a, divisor);
        }
    }
    Some(acc)
}

/// `combine(a, b)` lane by lane, the accumulator `a` on the left.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn combine<const OP: u8>(a: __m256, b: __m256) -> __m256 {
    match OP {
        SUM | AVG => _mm256_add_ps(a, b),
        PROD => _mm256_mul_ps(a, b),
        // `minps x, y` is `x < y ? x : y`: with `x = b`, the definition's `b < a ? b : a`, NaNs and signed zeros
        // included (the maximum likewise).
        MIN => _mm256_min_ps(b, a),
        _ => _mm256_max_ps(b, a),
    }
}

/// Sixteen elements of `x` from `at`, widened to f32 as [`Reducible::load`](super::Reducible::load) does (a NaN quieted if `quiet`; the
/// bits kept as they are otherwise): the "low" and
/// "high" vectors of the module's lane order. `None` if `x` is shorter than `at + 16`.
#[target_feature(enable = "avx2")]
#[inline]
fn load(x: &[bf16], at: usize, quiet: bool) -> Option<(__m256, __m256)> {
    let x: &[bf16; LANES] = x.get(at..at + LANES)?.try_into().ok()?;
    // SAFETY: `x` is 16 bf16 values, 32 readable bytes; the unaligned load has no alignment requirement.
    let v = unsafe { _mm256_loadu_si256(x.as_ptr().cast::<__m256i>()) };
    // A NaN (magnitude above infinity's 0x7F80) gets the quiet bit 0x40, as `load` does; signed 16-bit compare is
    // right since the magnitudes are at most 0x7FFF.
    let v = if quiet {
        let nan = _mm256_cmpgt_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7FFF)), _mm256_set1_epi16(0x7F80));
        _mm256_or_si256(v, _mm256_and_si256(nan, _mm256_set1_epi16(0x40)))
    } else {
        v
    };
    // Each bf16 into the high half of a 32-bit lane: the f32 with the same bits on top.
    let zero = _mm256_setzero_si256();
    Some((_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v))))
}

/// Whether any lane of `acc` is a NaN.
#[target_feature(enable = "avx2")]
#[inline]
fn any_nan(acc: &[__m256; 4]) -> bool {
    let nan = |x: __m256| _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
    let all = _mm256_or_ps(_mm256_or_ps(nan(acc[0]), nan(acc[1])), _mm256_or_ps(nan(acc[2]), nan(acc[3])));
    _mm256_movemask_ps(all) != 0
}

/// Every lane of `x` rounded to nearest even to bf16 as [`Reducible::store`](super::Reducible::store) rounds a number (not a NaN), as
/// 32-bit lanes, and the upper halves of `x`'s lanes.
#[target_feature(enable = "avx2")]
#[inline]
fn round(x: __m256) -> (__m256i, __m256i) {
    let bits = _mm256_castps_si256(x);
    let upper = _mm256_srli_epi32::<16>(bits);
    let odd = _mm256_and_si256(upper, _mm256_set1_epi32(1));
    // As `f32_to_bf16_bits`: adding 0x7FFF and the kept part's lowest bit carries into the kept part exactly when
    // it must round up (the wrapping of a NaN's sum does not matter: a NaN's lane is replaced).
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd));
    (rounded, upper)
}

/// The "low" and "high" vectors rounded to bf16 as [`Reducible::store`](super::Reducible::store) does, in element order, for lanes that
/// hold no NaN.
#[target_feature(enable = "avx2")]
#[inline]
fn narrow_numbers(lo: __m256, hi: __m256) -> __m256i {
    // Every value packed is at most 0xFFFF (a 32-bit value shifted right by 16), so the unsigned saturation never
    // acts.
    _mm256_packus_epi32(round(lo).0, round(hi).0)
}

/// The "low" and "high" vectors rounded to bf16 as [`Reducible::store`](super::Reducible::store) does, in element order, NaNs included
/// (quieted, the upper half of their payload kept).
#[target_feature(enable = "avx2")]
#[inline]
fn narrow(lo: __m256, hi: __m256) -> __m256i {
    let (r_lo, u_lo) = round(lo);
    let (r_hi, u_hi) = round(hi);
    // As in `narrow_numbers`, no saturation; the masks are 0 or -1 and stay so through the signed pack.
    let rounded = _mm256_packus_epi32(r_lo, r_hi);
    let quiet = _mm256_or_si256(_mm256_packus_epi32(u_lo, u_hi), _mm256_set1_epi16(0x40));
    let nan = _mm256_packs_epi32(
        _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(lo, lo)),
        _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(hi, hi)),
    );
    _mm256_blendv_epi8(rounded, quiet, nan)
}
