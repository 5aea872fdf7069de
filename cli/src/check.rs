//! The correctness check of `anyccl bench` (the `#wrong` column), as nccl-tests checks its results: every rank's
//! input is a deterministic pattern, the host computes what every rank must get, and each rank counts the elements
//! of its output that differ.
//!
//! The inputs are chosen so that the result is exact whatever order an implementation adds in (ring, tree, one-shot,
//! NCCL's chunks): small integers, at most [`MAX_ACTIVE`] ranks contributing a non-identity value to each element,
//! so every partial sum of any subset of the ranks is an integer the type represents exactly (16 for fp8 e4m3, 256
//! for bf16, …); products are of powers of two within the type's normal range. Sum, product, min and max of every
//! type, and every integer result, must therefore match bit for bit (a float `-0` and `+0` count as equal). Only
//! `avg` on floats rounds in ways that depend on the implementation (NCCL pre-multiplies by 1/n): its result must lie
//! within `(n + 2)·u·Σ|xᵢ|/n + u·|r| + n·s` of the exact mean (`u` the type's unit roundoff, `s` its smallest
//! subnormal), a bound on n products and n − 1 additions each rounded once.
//!
//! The pattern repeats every `lcm(world, 1021)` elements (1021 is prime, so the period does not line up with the
//! power-of-two chunks the algorithms split messages into): the expected values of one period are computed once per
//! sweep and the check of a message is one pass over it. Written here rather than taken from a crate: no crate
//! models the reduction orders of collective libraries.

use anyccl::core::dtype::Value as Val;
use anyccl::core::{Algorithm, DataType, Error, ReduceOp, Result};

/// The pattern's period in elements apart from the world size (a prime).
const PERIOD: usize = 1021;

/// The most ranks that contribute a non-identity value to one element.
pub const MAX_ACTIVE: usize = 64;

/// The most ranks the reference is computed for (its tables grow with the world size).
pub const MAX_WORLD: usize = 1024;

/// The most ranks that contribute to one element of a product (their powers of two stay in fp8's normal range).
const MAX_ACTIVE_PROD: usize = 6;

/// The expected result of an all-reduce over the bench's inputs, for one (type, operator, world).
#[derive(Debug, Clone)]
pub struct Reference {
    dtype: DataType,
    op: ReduceOp,
    world: usize,
    /// Elements per period of the pattern.
    period: usize,
    /// Ranks contributing to each element.
    active: usize,
    /// Largest magnitude of a contribution (sum, min, max, avg).
    magnitude: i64,
    /// One period of the expected result, encoded.
    expected: Vec<u8>,
    /// `avg` on floats: the exact mean and the tolerance of each element of one period.
    approx: Option<Vec<(f64, f64)>>,
}

fn unsupported(dtype: DataType) -> Error {
    Error::Config {
        source_name: "--dtype".into(),
        line: None,
        message: format!("the bench cannot check {dtype} results (no reference for this type)"),
    }
}

/// The largest integer `n` such that every integer of magnitude at most `n` is exact in `dtype` (floats).
fn exact_integers(dtype: DataType) -> Option<u64> {
    Some(match dtype {
        DataType::F16 => 1 << 11,
        DataType::Bf16 => 1 << 8,
        DataType::F32 => 1 << 24,
        DataType::F64 => 1 << 53,
        DataType::Fp8E4M3 => 1 << 4,
        DataType::Fp8E5M2 => 1 << 3,
        _ => return None,
    })
}

/// The worst step of one quantization, relative to a block's largest magnitude, of a quantized algorithm (fp8
/// e4m3: 1/16; int8: 1/254, as `anyccl_kernels_common::quant::Format::delta`); `None` for the others.
pub fn quantization_delta(a: Algorithm) -> Option<f64> {
    match a {
        Algorithm::TwoShotFp8 => Some(1.0 / 16.0),
        Algorithm::TwoShotInt8 => Some(1.0 / 254.0),
        _ => None,
    }
}

/// Unit roundoff and smallest subnormal of a float type.
fn roundoff(dtype: DataType) -> (f64, f64) {
    let p = |bits: i32| 2f64.powi(-bits);
    match dtype {
        DataType::F16 => (p(11), p(24)),
        DataType::Bf16 => (p(8), p(133)),
        DataType::F32 => (p(24), p(149)),
        DataType::F64 => (p(53), p(1074)),
        DataType::Fp8E4M3 => (p(4), p(9)),
        DataType::Fp8E5M2 => (p(3), p(16)),
        _ => (0.0, 0.0),
    }
}

fn is_unsigned(dtype: DataType) -> bool {
    matches!(dtype, DataType::U8 | DataType::U32 | DataType::U64)
}

/// A well-mixed 64-bit hash of `x` (splitmix64's finaliser).
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

fn decode(dtype: DataType, c: &[u8]) -> Val {
    Val::decode(dtype, c)
}

/// Appends `v` encoded as `dtype` (integers wrap to the type's width, as the reductions define).
fn encode(dtype: DataType, v: Val, out: &mut Vec<u8>) {
    v.encode(dtype, out);
}

fn oom(what: &str, bytes: usize) -> Error {
    Error::OutOfMemory { what: what.into(), bytes: bytes as u64 }
}

/// A vector of `n` elements reserved fallibly.
fn reserve<T>(n: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| oom(what, n.saturating_mul(std::mem::size_of::<T>())))?;
    Ok(v)
}

impl Reference {
    /// The reference for `world` ranks all-reducing `dtype` with `op`. Refuses a world of 0 or above [`MAX_WORLD`]
    /// and a type it has no model of.
    pub fn new(dtype: DataType, op: ReduceOp, world: usize) -> Result<Self> {
        if world == 0 || world > MAX_WORLD {
            return Err(Error::Config {
                source_name: "--world".into(),
                line: None,
                message: format!("the bench checks results for 1 to {MAX_WORLD} ranks, not {world}"),
            });
        }
        let esz = dtype.size_bytes();
        if !(1..=8).contains(&esz) {
            return Err(unsupported(dtype));
        }
        let float = dtype.is_float();
        let exact = if float { exact_integers(dtype).ok_or_else(|| unsupported(dtype))? } else { u64::MAX };
        let exact = usize::try_from(exact).unwrap_or(usize::MAX);
        let active = match op {
            ReduceOp::Prod => world.min(MAX_ACTIVE_PROD),
            _ => world.min(MAX_ACTIVE).min(exact),
        };
        let magnitude = match (float, op) {
            (true, ReduceOp::Avg) => 1,
            (true, _) => (exact / active.max(1)).clamp(1, 8) as i64,
            (false, _) => 50,
        };
        let period = world / gcd(world, PERIOD) * PERIOD;
        let mut r = Reference { dtype, op, world, period, active, magnitude, expected: Vec::new(), approx: None };
        r.expected = reserve(period * esz, "the bench's expected results")?;
        let approximate = float && op == ReduceOp::Avg;
        let mut approx = if approximate { Some(reserve(period, "the bench's tolerances")?) } else { None };
        let (u, sub) = roundoff(dtype);
        for t in 0..period {
            let vals = r.contributions(t);
            let v = if float {
                let xs = vals.map(|v| if let Val::Float(f) = v { f } else { f64::NAN });
                match op {
                    ReduceOp::Sum => Val::Float(xs.sum()),
                    ReduceOp::Prod => Val::Float(xs.product()),
                    ReduceOp::Min => Val::Float(xs.fold(f64::INFINITY, f64::min)),
                    ReduceOp::Max => Val::Float(xs.fold(f64::NEG_INFINITY, f64::max)),
                    _ => {
                        let (s, abs) = xs.fold((0.0, 0.0), |(s, a), x| (s + x, a + x.abs()));
                        let w = world as f64;
                        let mean = s / w;
                        let tol = (w + 2.0) * u * abs / w + u * mean.abs() + w * sub;
                        if let Some(a) = approx.as_mut() {
                            a.push((mean, tol));
                        }
                        Val::Float(mean)
                    }
                }
            } else {
                let xs = vals.map(|v| if let Val::Int(i) = v { i } else { 0 });
                Val::Int(match op {
                    ReduceOp::Prod => xs.fold(1i128, i128::wrapping_mul),
                    ReduceOp::Min => xs.min().unwrap_or(0),
                    ReduceOp::Max => xs.max().unwrap_or(0),
                    // Sum, and avg (which integer types refuse; the sum stands in).
                    _ => xs.fold(0i128, i128::wrapping_add),
                })
            };
            encode(dtype, v, &mut r.expected);
        }
        r.approx = approx;
        Ok(r)
    }

    /// Whether every element must match exactly (everything but `avg` on floats).
    pub fn is_exact(&self) -> bool {
        self.approx.is_none()
    }

    /// Whether `rank` contributes a non-identity value to element `t`.
    fn is_active(&self, rank: usize, t: usize) -> bool {
        (t + rank) % self.world < self.active
    }

    /// Rank `rank`'s input at element `t` of the period.
    fn value(&self, rank: usize, t: usize) -> Val {
        let active = self.is_active(rank, t);
        let h = mix((((t % PERIOD) as u64) << 16) | rank as u64);
        let float = self.dtype.is_float();
        if self.op == ReduceOp::Prod {
            if !active {
                return if float { Val::Float(1.0) } else { Val::Int(1) };
            }
            return if float {
                Val::Float([2.0, 0.5, -1.0, -2.0, -0.5, 1.0][(h % 6) as usize])
            } else if is_unsigned(self.dtype) {
                Val::Int([1, 2, 3][(h % 3) as usize])
            } else {
                Val::Int([-2, -1, 1, 2, 3][(h % 5) as usize])
            };
        }
        if !active {
            return if float { Val::Float(0.0) } else { Val::Int(0) };
        }
        let m = self.magnitude;
        let x = (h % (2 * m as u64 + 1)) as i64;
        let x = if is_unsigned(self.dtype) { x } else { x - m };
        if float {
            Val::Float(x as f64)
        } else {
            Val::Int(i128::from(x))
        }
    }

    /// The contributions to element `t`: the active ranks', and one inactive rank's (the identity of sum and
    /// product; zero, which matters to min and max) when some rank is inactive.
    fn contributions(&self, t: usize) -> impl Iterator<Item = Val> + '_ {
        let w = self.world;
        let actives = (0..self.active).map(move |j| (j + w - t % w) % w);
        let inactive = (self.active < w).then(|| (self.active + w - t % w) % w);
        actives.chain(inactive).map(move |r| self.value(r, t))
    }

    /// Fills `out` with rank `rank`'s input (as many whole elements as fit; `out.len()` should be a multiple of
    /// the element size).
    pub fn input(&self, rank: usize, out: &mut [u8]) -> Result<()> {
        let esz = self.dtype.size_bytes();
        let mut period = reserve(self.period * esz, "the bench's input pattern")?;
        for t in 0..self.period {
            encode(self.dtype, self.value(rank % self.world, t), &mut period);
        }
        for chunk in out.chunks_mut(period.len()) {
            let n = chunk.len();
            chunk.copy_from_slice(&period[..n]);
        }
        Ok(())
    }

    /// How many elements of `got` (one rank's result, from element 0) differ from the expected result.
    pub fn count_wrong(&self, got: &[u8]) -> u64 {
        let esz = self.dtype.size_bytes();
        let pbytes = self.expected.len();
        let mut wrong = 0u64;
        for chunk in got.chunks(pbytes) {
            match &self.approx {
                None => {
                    let want = &self.expected[..chunk.len()];
                    if chunk == want && chunk.len() % esz == 0 {
                        continue;
                    }
                    for (g, w) in chunk.chunks(esz).zip(want.chunks(esz)) {
                        if g.len() != esz || (g != w && !self.same_float(g, w)) {
                            wrong += 1;
                        }
                    }
                }
                Some(approx) => {
                    for (g, (want, tol)) in chunk.chunks(esz).zip(approx) {
                        let ok = g.len() == esz
                            && match decode(self.dtype, g) {
                                Val::Float(g) => !g.is_nan() && (g - want).abs() <= *tol,
                                Val::Int(_) => false,
                            };
                        if !ok {
                            wrong += 1;
                        }
                    }
                }
            }
        }
        wrong
    }

    /// How many elements of `got` lie further from the exact result than a quantized all-reduce's error bound
    /// allows: `(2δ + δ² + 2⁻¹⁸) · S + u · (|exact| + that)`, with S = world × the largest contribution (each rank's
    /// largest magnitude in a 32-element block is at most it) and δ the format's step ([`quantization_delta`]).
    /// Integer types have no quantized kernels: every element counts as wrong.
    pub fn count_wrong_quantized(&self, got: &[u8], delta: f64) -> u64 {
        let esz = self.dtype.size_bytes();
        let (u, _) = roundoff(self.dtype);
        let s = self.world as f64 * self.magnitude as f64;
        let bound = (2.0 * delta + delta * delta + 2f64.powi(-18)) * s;
        let mut wrong = 0u64;
        for chunk in got.chunks(self.expected.len().max(1)) {
            for (g, w) in chunk.chunks(esz).zip(self.expected.chunks(esz)) {
                let ok = g.len() == esz
                    && match (decode(self.dtype, g), decode(self.dtype, w)) {
                        (Val::Float(g), Val::Float(w)) => !g.is_nan() && (g - w).abs() <= bound + u * (w.abs() + bound),
                        _ => false,
                    };
                if !ok {
                    wrong += 1;
                }
            }
        }
        wrong
    }

    /// Whether two encodings are the same float value (`-0` and `+0`).
    fn same_float(&self, a: &[u8], b: &[u8]) -> bool {
        match (decode(self.dtype, a), decode(self.dtype, b)) {
            (Val::Float(x), Val::Float(y)) => x == y,
            _ => false,
        }
    }

    /// How the results are checked, for the report.
    pub fn describe(&self) -> String {
        let how = if self.is_exact() {
            "must match exactly".to_owned()
        } else {
            "must lie within (n+2)·u·Σ|x|/n + u·|r| + n·s of the exact mean".to_owned()
        };
        format!(
            "each rank's output against a host-computed reference ({} {}, world {}; inputs: small integers, {} of \
             the {} ranks non-trivial per element, pattern period {} elements); {how}",
            self.dtype, self.op, self.world, self.active, self.world, self.period
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The exact result of element `i`, computed naively over every rank's decoded input.
    fn naive(r: &Reference, inputs: &[Vec<u8>], i: usize) -> Val {
        let esz = r.dtype.size_bytes();
        let vals: Vec<Val> = inputs.iter().map(|x| decode(r.dtype, &x[i * esz..(i + 1) * esz])).collect();
        if r.dtype.is_float() {
            let xs = vals.iter().map(|v| if let Val::Float(f) = v { *f } else { f64::NAN });
            Val::Float(match r.op {
                ReduceOp::Sum => xs.sum(),
                ReduceOp::Prod => xs.product(),
                ReduceOp::Min => xs.fold(f64::INFINITY, f64::min),
                ReduceOp::Max => xs.fold(f64::NEG_INFINITY, f64::max),
                _ => xs.sum::<f64>() / r.world as f64,
            })
        } else {
            let xs = vals.iter().map(|v| if let Val::Int(i) = v { *i } else { 0 });
            Val::Int(match r.op {
                ReduceOp::Prod => xs.fold(1, i128::wrapping_mul),
                ReduceOp::Min => xs.min().unwrap_or(0),
                ReduceOp::Max => xs.max().unwrap_or(0),
                _ => xs.fold(0, i128::wrapping_add),
            })
        }
    }

    fn inputs(r: &Reference, count: usize) -> Vec<Vec<u8>> {
        (0..r.world)
            .map(|rank| {
                let mut v = vec![0u8; count * r.dtype.size_bytes()];
                r.input(rank, &mut v).expect("input");
                v
            })
            .collect()
    }

    fn naive_result(r: &Reference, count: usize) -> Vec<u8> {
        let ins = inputs(r, count);
        let mut out = Vec::new();
        for i in 0..count {
            encode(r.dtype, naive(r, &ins, i), &mut out);
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(40))]

        /// The reference's tables (computed from the active ranks only, one period) agree with a naive reduction
        /// over every rank's whole input, for every type, operator and world, across period boundaries; and one
        /// changed element is one wrong element.
        #[test]
        fn tables_match_a_naive_reduction(
            d in 0usize..DataType::ALL.len(),
            o in 0usize..ReduceOp::ALL.len(),
            world in 1usize..=24,
            extra in 0usize..50,
            at in any::<prop::sample::Index>(),
        ) {
            let (dtype, op) = (DataType::ALL[d], ReduceOp::ALL[o]);
            prop_assume!(op != ReduceOp::Avg || dtype.is_float());
            let r = Reference::new(dtype, op, world).expect("reference");
            let count = r.period + extra;
            let mut got = naive_result(&r, count);
            prop_assert_eq!(r.count_wrong(&got), 0, "{} {} world {}", dtype, op, world);
            let esz = dtype.size_bytes();
            let i = at.index(count);
            // A different value at element i: NaN for floats, +1 for integers.
            let g = &mut got[i * esz..(i + 1) * esz];
            if dtype.is_float() {
                g.fill(0xFF);
            } else {
                g[0] = g[0].wrapping_add(1);
            }
            prop_assert_eq!(r.count_wrong(&got), 1);
        }
    }

    /// The inputs keep every partial sum exact: no contribution is larger than the type's exact integers allow,
    /// and sum, min, max and prod are checked bit for bit.
    #[test]
    fn exact_where_the_order_cannot_matter() {
        for dtype in DataType::ALL.into_iter().filter(|d| d.is_float()) {
            for world in [1, 2, 8, 64, 100] {
                let r = Reference::new(dtype, ReduceOp::Sum, world).expect("reference");
                let bound = exact_integers(dtype).expect("float") as i64;
                assert!(r.active as i64 * r.magnitude <= bound, "{dtype} world {world}");
                assert!(r.is_exact());
                assert!(!Reference::new(dtype, ReduceOp::Avg, world).expect("avg").is_exact());
            }
        }
        let big = Reference::new(DataType::Fp8E5M2, ReduceOp::Sum, MAX_WORLD).expect("the largest world");
        assert_eq!((big.active, big.magnitude), (8, 1));
        assert!(Reference::new(DataType::Bf16, ReduceOp::Sum, 0).is_err());
        assert!(Reference::new(DataType::Bf16, ReduceOp::Sum, MAX_WORLD + 1).is_err());
    }

    /// Poison (all bytes 0xFF, what the bench writes before a check) is wrong everywhere, and a result missing one
    /// rank's contribution is caught at every element that rank contributes to.
    #[test]
    fn poison_and_a_missing_rank_are_counted() {
        for dtype in [DataType::Bf16, DataType::F32, DataType::Fp8E4M3, DataType::I32, DataType::U8] {
            let r = Reference::new(dtype, ReduceOp::Sum, 4).expect("reference");
            let count = 3 * r.period + 7;
            let esz = dtype.size_bytes();
            // Poison reads as NaN for floats, never a result; as -1 or the largest value for integers, which a
            // few results are.
            let not_poison = naive_result(&r, count).chunks(esz).filter(|e| e.iter().any(|&b| b != 0xFF)).count();
            assert!(not_poison == count || !dtype.is_float(), "{dtype}");
            assert!(not_poison > count * 9 / 10, "{dtype}");
            assert_eq!(r.count_wrong(&vec![0xFF; count * esz]) as usize, not_poison, "{dtype}");
            // Ranks 0..3 only.
            let ins = inputs(&r, count);
            let three = Reference { world: 3, ..r.clone() };
            let mut partial = Vec::new();
            for i in 0..count {
                encode(dtype, naive(&three, &ins[..3], i), &mut partial);
            }
            let missing = (0..count).filter(|&i| r.value(3, i % r.period) != decode(dtype, &[0; 8])).count();
            assert!(missing > count / 4, "{dtype}: rank 3 contributes to {missing} of {count}");
            assert_eq!(r.count_wrong(&partial) as usize, missing, "{dtype}");
        }
    }

    /// Avg on floats: the exact mean passes, a value off by more than the tolerance fails, and a real
    /// implementation's rounding (the host backend's) passes.
    #[test]
    fn avg_has_a_bounded_tolerance() {
        let r = Reference::new(DataType::Bf16, ReduceOp::Avg, 8).expect("reference");
        let count = r.period;
        let exact = naive_result(&r, count);
        assert_eq!(r.count_wrong(&exact), 0);
        let approx = r.approx.as_ref().expect("approximate");
        let mut off = exact.clone();
        let (want, tol) = approx[5];
        off[10..12].copy_from_slice(&anyccl::half::bf16::from_f64(want + 4.0 * tol + 0.25).to_bits().to_le_bytes());
        assert_eq!(r.count_wrong(&off), 1);
        // Missing one rank's contribution of ±1 moves the mean by 1/8, beyond bf16's tolerance at world 8.
        assert!(
            approx.iter().all(|(_, tol)| *tol < 0.125),
            "max tolerance {:?}",
            approx.iter().map(|a| a.1).fold(0.0, f64::max)
        );
    }

    /// Signed zeros are the same value; a partial last element is wrong.
    #[test]
    fn zeros_and_partial_elements() {
        let r = Reference::new(DataType::F32, ReduceOp::Sum, 2).expect("reference");
        let mut got = naive_result(&r, r.period);
        let i = (0..r.period).find(|&i| got[i * 4..i * 4 + 4] == [0; 4]).expect("some element sums to zero");
        got[i * 4 + 3] = 0x80;
        assert_eq!(r.count_wrong(&got), 0, "-0 is +0");
        assert_eq!(r.count_wrong(&got[..6]), 1, "a partial element is counted wrong");
    }

    #[test]
    fn quantized_results_are_checked_within_the_bound() {
        let r = Reference::new(DataType::Bf16, ReduceOp::Sum, 8).expect("reference");
        let n = r.period * 2;
        let exact = naive_result(&r, n);
        let delta = quantization_delta(Algorithm::TwoShotFp8).expect("fp8");
        assert_eq!(r.count_wrong_quantized(&exact, delta), 0, "the exact sum is within any bound");
        // An error just inside the bound passes, far outside fails; NaN (the poison) always fails.
        let bound = (2.0 * delta + delta * delta) * 8.0 * r.magnitude as f64;
        let shift = |by: f64| -> Vec<u8> {
            exact
                .chunks(2)
                .flat_map(|c| {
                    // bf16 by hand (round to nearest even): this crate has no half dependency.
                    let v = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16) + by as f32;
                    let u = v.to_bits();
                    (((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16).to_le_bytes()
                })
                .collect()
        };
        assert_eq!(r.count_wrong_quantized(&shift(bound * 0.5), delta), 0);
        assert_eq!(r.count_wrong_quantized(&shift(bound * 3.0), delta), n as u64);
        assert_eq!(r.count_wrong_quantized(&vec![0xFF; n * 2], delta), n as u64);
        // int8's bound is far tighter than fp8's.
        let int8 = quantization_delta(Algorithm::TwoShotInt8).expect("int8");
        assert!(r.count_wrong_quantized(&shift(bound * 0.5), int8) > 0);
        assert_eq!(quantization_delta(Algorithm::TwoShot), None);
    }
}
