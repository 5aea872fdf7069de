//! Element-wise reduction kernels for every data type, accumulating in f32 or wider.

use anyccl_core::{DataType, Error, InvalidArgument, ReduceOp, Result};
use bytemuck::{Pod, Zeroable};
use float8::{F8E4M3, F8E5M2};
use half::{bf16, f16, slice::HalfFloatSliceExt};

#[cfg(target_arch = "x86_64")]
mod bf16_avx2;
#[cfg(target_arch = "x86_64")]
mod f16_f16c;

/// The reduction operators the host backend implements.
///
/// [`ReduceOp`] is `#[non_exhaustive]`; `resolve` turns it into this exhaustive set once per call, before any data
/// moves, so an operator newer than this crate is a typed error up front and the element loops need no fallback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Mean (floating-point types).
    Avg,
}

impl Op {
    /// Every operator, in declaration order (index = discriminant).
    pub const ALL: [Op; 5] = [Op::Sum, Op::Prod, Op::Min, Op::Max, Op::Avg];
}

/// The 16-bit floats, which have reduction kernels of their own on x86-64.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
// Read only by the x86-64 kernels' dispatch.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) enum Half {
    /// `bf16`.
    Bf16,
    /// `f16`.
    F16,
}

/// An element type the host backend reduces, with the accumulator it reduces in.
pub(crate) trait Reducible: Pod {
    /// The accumulator: the type itself for integers and f32/f64, f32 for the 8- and 16-bit floats.
    type Acc: Pod;
    fn load(self) -> Self::Acc;
    fn store(acc: Self::Acc) -> Self;
    fn combine(a: Self::Acc, b: Self::Acc, op: Op) -> Self::Acc;
    /// Applies the final step of `avg` (division by the world size); identity for the other operators.
    fn finish(a: Self::Acc, op: Op, world: usize) -> Self::Acc;
    /// Whether the accumulator is the element type itself (integers, f32, f64): the kernels then combine the
    /// inputs where they lie, with no conversion pass.
    const ACC_IS_SELF: bool = false;
    /// `dst[i] = load(src[i])` over the shorter of the two. The 16-bit floats override it with a conversion
    /// that vectorises; the result is bitwise that of [`Reducible::load`].
    #[inline(always)]
    fn load_slice(src: &[Self], dst: &mut [Self::Acc]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.load();
        }
    }
    /// Which 16-bit float the type is, if it is one: they have kernels of their own (`reduce_half_simd`).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    const HALF: Option<Half> = None;
    /// Whether [`Reducible::load`] is cheap and branch-free, so that the kernels convert inside the fold loop
    /// (one pass) instead of converting a block first (bf16: a shift).
    const LOAD_IN_FOLD: bool = false;
    /// `dst[i] = store(src[i])` over the shorter of the two; bitwise that of [`Reducible::store`].
    #[inline(always)]
    fn store_slice(src: &[Self::Acc], dst: &mut [Self]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = Self::store(*s);
        }
    }
}

macro_rules! int_reducible {
    ($($t:ty),*) => {$(
        impl Reducible for $t {
            type Acc = $t;
            #[inline]
            fn load(self) -> $t { self }
            #[inline]
            fn store(a: $t) -> $t { a }
            #[inline]
            fn combine(a: $t, b: $t, op: Op) -> $t {
                match op {
                    // `avg` on integers is refused by validation; treat it as the sum it starts with.
                    Op::Sum | Op::Avg => a.wrapping_add(b),
                    Op::Prod => a.wrapping_mul(b),
                    Op::Min => a.min(b),
                    Op::Max => a.max(b),
                }
            }
            #[inline]
            fn finish(a: $t, _op: Op, _world: usize) -> $t { a }
            const ACC_IS_SELF: bool = true;
        }
    )*};
}
int_reducible!(i8, u8, i32, u32, i64, u64);

macro_rules! float_reducible {
    ($t:ty, $acc:ty, $load:expr, $store:expr) => {
        float_reducible!($t, $acc, $load, $store, {});
    };
    ($t:ty, $acc:ty, $load:expr, $store:expr, { $($extra:item)* }) => {
        impl Reducible for $t {
            type Acc = $acc;
            #[inline]
            fn load(self) -> $acc {
                $load(self)
            }
            #[inline]
            fn store(a: $acc) -> $t {
                $store(a)
            }
            #[inline]
            fn combine(a: $acc, b: $acc, op: Op) -> $acc {
                match op {
                    Op::Sum | Op::Avg => a + b,
                    Op::Prod => a * b,
                    Op::Min => {
                        if b < a {
                            b
                        } else {
                            a
                        }
                    }
                    Op::Max => {
                        if b > a {
                            b
                        } else {
                            a
                        }
                    }
                }
            }
            #[inline]
            fn finish(a: $acc, op: Op, world: usize) -> $acc {
                if op == Op::Avg {
                    a / world as $acc
                } else {
                    a
                }
            }
            $($extra)*
        }
    };
}
float_reducible!(f32, f32, |x| x, |a| a, {
    const ACC_IS_SELF: bool = true;
});
float_reducible!(f64, f64, |x| x, |a| a, {
    const ACC_IS_SELF: bool = true;
});
// f16: `half`'s slice conversions use the processor's conversion instructions (F16C) where it has them; they
// round to nearest even like the scalar conversion.
float_reducible!(f16, f32, f16::to_f32, f16::from_f32, {
    const HALF: Option<Half> = Some(Half::F16);
    #[inline]
    fn load_slice(src: &[f16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        src[..n].convert_to_f32_slice(&mut dst[..n]);
    }
    #[inline]
    fn store_slice(src: &[f32], dst: &mut [f16]) {
        let n = src.len().min(dst.len());
        dst[..n].convert_from_f32_slice(&src[..n]);
    }
});
// bf16: `half` converts slices of bf16 one element at a time through a branchy function; these branch-free forms
// of the same bit operations vectorise (the tests compare them with `half`'s bit for bit).
float_reducible!(bf16, f32, |x: bf16| bf16_bits_to_f32(x.to_bits()), |a| bf16::from_bits(f32_to_bf16_bits(a)), {
    const LOAD_IN_FOLD: bool = true;
    const HALF: Option<Half> = Some(Half::Bf16);
    #[inline(always)]
    fn load_slice(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = bf16_bits_to_f32(s.to_bits());
        }
    }
    #[inline(always)]
    fn store_slice(src: &[f32], dst: &mut [bf16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = bf16::from_bits(f32_to_bf16_bits(*s));
        }
    }
});

/// `bf16::to_f32` without branches: a NaN keeps its payload with the quiet bit set. The quiet bit is set in the
/// 16-bit value before it is widened, so that vectorised the test and the bit cover sixteen lanes at a time.
#[inline(always)]
fn bf16_bits_to_f32(i: u16) -> f32 {
    let nan = u16::from(i & 0x7FFF > 0x7F80);
    f32::from_bits(u32::from(i | (nan << 6)) << 16)
}

/// `bf16::from_f32` without branches: round to nearest even; a NaN keeps the high part of its payload with the
/// quiet bit set.
#[inline(always)]
fn f32_to_bf16_bits(v: f32) -> u16 {
    let x = v.to_bits();
    let nan = x & 0x7FFF_FFFF > 0x7F80_0000;
    // Round to nearest even: adding 0x7FFF and the kept part's lowest bit carries into the kept part exactly when
    // the dropped half is above one half, or exactly one half with the kept part odd. Not a NaN, `x` is at most
    // 0xFF80_0000 (negative infinity), so the sum cannot overflow.
    let rounded = x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16;
    let quiet = (x >> 16) | 0x40;
    (if nan { quiet } else { rounded }) as u16
}
float_reducible!(F8E4M3, f32, |x: F8E4M3| x.to_f32(), F8E4M3::from_f32);
float_reducible!(F8E5M2, f32, |x: F8E5M2| x.to_f32(), F8E5M2::from_f32);

/// Runs `$body` with `$t` bound to the Rust type of `$dtype`.
///
/// For a type this crate does not know ([`anyccl_core::DataType`] is `#[non_exhaustive]`) it returns
/// `Err(`[`unknown_dtype`]`)` from the enclosing function, which must return [`Result`]. Callers run [`resolve`]
/// before any side effect, so in practice that arm is met there first.
macro_rules! with_type {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            anyccl_core::DataType::I8 => {
                type $t = i8;
                $body
            }
            anyccl_core::DataType::U8 => {
                type $t = u8;
                $body
            }
            anyccl_core::DataType::I32 => {
                type $t = i32;
                $body
            }
            anyccl_core::DataType::U32 => {
                type $t = u32;
                $body
            }
            anyccl_core::DataType::I64 => {
                type $t = i64;
                $body
            }
            anyccl_core::DataType::U64 => {
                type $t = u64;
                $body
            }
            anyccl_core::DataType::F16 => {
                type $t = half::f16;
                $body
            }
            anyccl_core::DataType::Bf16 => {
                type $t = half::bf16;
                $body
            }
            anyccl_core::DataType::F32 => {
                type $t = f32;
                $body
            }
            anyccl_core::DataType::F64 => {
                type $t = f64;
                $body
            }
            anyccl_core::DataType::Fp8E4M3 => {
                type $t = float8::F8E4M3;
                $body
            }
            anyccl_core::DataType::Fp8E5M2 => {
                type $t = float8::F8E5M2;
                $body
            }
            other => return Err($crate::reduce::unknown_dtype(other)),
        }
    };
}
pub(crate) use with_type;

/// The host backend's [`Op`] for `op` on `dtype`, or a typed error naming the type or operator this build of
/// anyccl-host does not know (one added to anyccl-core after it). Called by every reducing collective before it
/// publishes or exchanges anything, so a refusal leaves the peers and the buffers as they were.
pub(crate) fn resolve(dtype: DataType, op: ReduceOp) -> Result<Op> {
    // The type: `with_type!` returns the error for an unknown one; the body has nothing else to do.
    fn known(dtype: DataType) -> Result<()> {
        with_type!(dtype, _T => Ok(()))
    }
    known(dtype)?;
    match op {
        ReduceOp::Sum => Ok(Op::Sum),
        ReduceOp::Prod => Ok(Op::Prod),
        ReduceOp::Min => Ok(Op::Min),
        ReduceOp::Max => Ok(Op::Max),
        ReduceOp::Avg => Ok(Op::Avg),
        other => Err(InvalidArgument::UnsupportedReduction {
            dtype,
            op: other,
            why: format!(
                "anyccl-host {} does not implement the operator {other} (newer than this backend; update anyccl-host)",
                env!("CARGO_PKG_VERSION")
            ),
        }
        .into()),
    }
}

/// The error for a data type this build of anyccl-host has no Rust type for (one added to anyccl-core after it).
pub(crate) fn unknown_dtype(dtype: DataType) -> Error {
    InvalidArgument::UnsupportedDataType {
        dtype,
        backend: "host".to_owned(),
        why: format!(
            "anyccl-host {} has no kernel for it (newer than this backend; update anyccl-host)",
            env!("CARGO_PKG_VERSION")
        ),
    }
    .into()
}

/// Views bytes as elements. Validation guarantees alignment and whole elements; a violation is reported as a
/// backend error rather than a panic.
pub(crate) fn cast<T: Pod>(bytes: &[u8]) -> Result<&[T]> {
    bytemuck::try_cast_slice(bytes).map_err(|e| internal(format!("cannot view bytes as elements: {e}")))
}

/// Mutable form of [`cast`].
pub(crate) fn cast_mut<T: Pod>(bytes: &mut [u8]) -> Result<&mut [T]> {
    bytemuck::try_cast_slice_mut(bytes).map_err(|e| internal(format!("cannot view bytes as elements: {e}")))
}

pub(crate) fn internal(message: String) -> Error {
    Error::backend("host", "collective", None, message)
}

/// Bytes of accumulators one block of a reduction covers: the block stays in the L1 cache while every input's
/// part of it is folded in.
const BLOCK_BYTES: usize = 16 << 10;
/// Accumulators per block for the 8- and 16-bit floats (f32 accumulators): `BLOCK_BYTES` of them.
const BLOCK: usize = BLOCK_BYTES / 4;

/// `acc[i] = combine(acc[i], x[i])`, with the operator fixed outside the loop so that it vectorises.
#[inline(always)]
fn fold<T: Reducible>(acc: &mut [T::Acc], x: &[T::Acc], op: Op) {
    #[inline(always)]
    fn each<A: Copy>(acc: &mut [A], x: &[A], f: impl Fn(A, A) -> A) {
        for (a, b) in acc.iter_mut().zip(x) {
            *a = f(*a, *b);
        }
    }
    match op {
        Op::Sum => each(acc, x, |a, b| T::combine(a, b, Op::Sum)),
        Op::Prod => each(acc, x, |a, b| T::combine(a, b, Op::Prod)),
        Op::Min => each(acc, x, |a, b| T::combine(a, b, Op::Min)),
        Op::Max => each(acc, x, |a, b| T::combine(a, b, Op::Max)),
        Op::Avg => each(acc, x, |a, b| T::combine(a, b, Op::Avg)),
    }
}

/// `acc[i] = combine(acc[i], load(x[i]))`, converting inside the loop (for types with a cheap
/// [`Reducible::load`]).
#[inline(always)]
fn fold_loading<T: Reducible>(acc: &mut [T::Acc], x: &[T], op: Op) {
    #[inline(always)]
    fn each<T: Reducible>(acc: &mut [T::Acc], x: &[T], f: impl Fn(T::Acc, T::Acc) -> T::Acc) {
        for (a, b) in acc.iter_mut().zip(x) {
            *a = f(*a, b.load());
        }
    }
    match op {
        Op::Sum => each(acc, x, |a, b| T::combine(a, b, Op::Sum)),
        Op::Prod => each(acc, x, |a, b| T::combine(a, b, Op::Prod)),
        Op::Min => each(acc, x, |a, b| T::combine(a, b, Op::Min)),
        Op::Max => each(acc, x, |a, b| T::combine(a, b, Op::Max)),
        Op::Avg => each(acc, x, |a, b| T::combine(a, b, Op::Avg)),
    }
}

/// `x[i] = combine(acc[i], x[i])` (the accumulator on the left, as in [`fold`]).
#[inline]
fn fold_into<T: Reducible>(acc: &[T::Acc], x: &mut [T::Acc], op: Op) {
    #[inline(always)]
    fn each<A: Copy>(acc: &[A], x: &mut [A], f: impl Fn(A, A) -> A) {
        for (a, b) in acc.iter().zip(x.iter_mut()) {
            *b = f(*a, *b);
        }
    }
    match op {
        Op::Sum => each(acc, x, |a, b| T::combine(a, b, Op::Sum)),
        Op::Prod => each(acc, x, |a, b| T::combine(a, b, Op::Prod)),
        Op::Min => each(acc, x, |a, b| T::combine(a, b, Op::Min)),
        Op::Max => each(acc, x, |a, b| T::combine(a, b, Op::Max)),
        Op::Avg => each(acc, x, |a, b| T::combine(a, b, Op::Avg)),
    }
}

/// `acc[i] = finish(acc[i])`: only `avg` has a final step.
#[inline(always)]
fn finish_all<T: Reducible>(acc: &mut [T::Acc], op: Op, world: usize) {
    if op == Op::Avg {
        for a in acc.iter_mut() {
            *a = T::finish(*a, Op::Avg, world);
        }
    }
}

/// `out[i] = finish(x_0[i] ∘ x_1[i] ∘ … )` over `inputs` in order, so every rank computing the same reduction
/// gets bitwise the same result. Inputs shorter than `out` are a caller's bug; the reduction then covers the
/// shortest.
pub(crate) fn reduce_into<T: Reducible>(inputs: &[&[T]], out: &mut [T], op: Op, world: usize) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        if T::HALF.is_some() && reduce_half_simd(inputs, out, op, world) {
            return;
        }
        #[allow(unsafe_code)]
        // SAFETY: the processor has AVX2 (checked just above), the only requirement of `reduce_into_avx2`.
        unsafe {
            reduce_into_avx2(inputs, out, op, world)
        };
        return;
    }
    reduce_into_any(inputs, out, op, world);
}

/// [`reduce_into`] for the 16-bit floats with their kernels, on a processor with AVX2 (and F16C for f16); false,
/// having done nothing, if `T` is not one of them or the processor lacks F16C for f16.
#[cfg(target_arch = "x86_64")]
fn reduce_half_simd<T: Reducible>(inputs: &[&[T]], out: &mut [T], op: Op, world: usize) -> bool {
    match T::HALF {
        Some(Half::Bf16) => with_views::<T, bf16>(inputs, out, |ins, out| {
            #[allow(unsafe_code)]
            // SAFETY: the caller checked that the processor has AVX2, the only requirement of the kernel.
            unsafe {
                bf16_avx2::reduce(ins, out, op, world)
            }
        }),
        Some(Half::F16) if std::arch::is_x86_feature_detected!("f16c") => {
            with_views::<T, f16>(inputs, out, |ins, out| {
                #[allow(unsafe_code)]
                // SAFETY: the caller checked that the processor has AVX2, and F16C is checked just above: the
                // kernel's requirements.
                unsafe {
                    f16_f16c::reduce(ins, out, op, world)
                }
            })
        }
        _ => false,
    }
}

/// Runs `f` on `inputs` and `out` viewed as `H`, the type `T` says it is ([`Reducible::HALF`]); false, having
/// done nothing, if a view fails (`T` is not `H`).
#[cfg(target_arch = "x86_64")]
fn with_views<T: Reducible, H: Pod>(inputs: &[&[T]], out: &mut [T], f: impl FnOnce(&[&[H]], &mut [H])) -> bool {
    /// Inputs viewed on the stack (a call has one per rank); more go through the heap.
    const ON_STACK: usize = 16;
    let Ok(out) = bytemuck::try_cast_slice_mut::<T, H>(out) else { return false };
    let mut stack: [&[H]; ON_STACK] = [&[]; ON_STACK];
    let mut heap: Vec<&[H]> = Vec::new();
    let ins: &mut [&[H]] = match stack.get_mut(..inputs.len()) {
        Some(s) => s,
        None => {
            heap.resize(inputs.len(), &[]);
            &mut heap
        }
    };
    for (d, x) in ins.iter_mut().zip(inputs) {
        match bytemuck::try_cast_slice::<T, H>(x) {
            Ok(x) => *d = x,
            Err(_) => return false,
        }
    }
    f(ins, out);
    true
}

/// [`reduce_into`] compiled for AVX2: the same operations in the same order (element-wise, no fused
/// multiply-add, no reassociation), so bitwise the same results, eight f32 lanes at a time instead of four.
///
/// # Safety
///
/// The processor must support AVX2.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2")]
unsafe fn reduce_into_avx2<T: Reducible>(inputs: &[&[T]], out: &mut [T], op: Op, world: usize) {
    reduce_into_any(inputs, out, op, world);
}

/// [`reduce_into`] for whatever processor the crate was compiled for (inlined into the AVX2 form as well).
#[inline(always)]
fn reduce_into_any<T: Reducible>(inputs: &[&[T]], out: &mut [T], op: Op, world: usize) {
    let n = inputs.iter().map(|x| x.len()).fold(out.len(), usize::min);
    let out = &mut out[..n];
    let Some((first, rest)) = inputs.split_first() else { return };
    if T::ACC_IS_SELF {
        // The accumulators are the elements themselves, kept in registers a tile at a time. (The views cannot fail
        // for such types; were one to, the converting form below would run instead, before anything is written.)
        let views_ok = inputs.iter().all(|x| bytemuck::try_cast_slice::<T, T::Acc>(x).is_ok());
        if let (true, Ok(out)) = (views_ok, bytemuck::try_cast_slice_mut::<T, T::Acc>(&mut *out)) {
            match op {
                Op::Sum => self_tiles::<T>(first, rest, out, |a, b| T::combine(a, b, Op::Sum), |a| a),
                Op::Prod => self_tiles::<T>(first, rest, out, |a, b| T::combine(a, b, Op::Prod), |a| a),
                Op::Min => self_tiles::<T>(first, rest, out, |a, b| T::combine(a, b, Op::Min), |a| a),
                Op::Max => self_tiles::<T>(first, rest, out, |a, b| T::combine(a, b, Op::Max), |a| a),
                Op::Avg => self_tiles::<T>(
                    first,
                    rest,
                    out,
                    |a, b| T::combine(a, b, Op::Avg),
                    |a| T::finish(a, Op::Avg, world),
                ),
            }
            return;
        }
    }
    // Converted accumulators: each input's block is converted into `tmp`, then folded into `acc`.
    let mut acc = [T::Acc::zeroed(); BLOCK];
    let mut tmp = [T::Acc::zeroed(); BLOCK];
    let mut start = 0;
    while start < n {
        let len = BLOCK.min(n - start);
        let (acc, tmp) = (&mut acc[..len], &mut tmp[..len]);
        T::load_slice(&first[start..start + len], acc);
        for inp in rest {
            if T::LOAD_IN_FOLD {
                fold_loading::<T>(acc, &inp[start..start + len], op);
            } else {
                T::load_slice(&inp[start..start + len], tmp);
                fold::<T>(acc, tmp, op);
            }
        }
        finish_all::<T>(acc, op, world);
        T::store_slice(acc, &mut out[start..start + len]);
        start += len;
    }
}

/// The element-wise definition for the elements from `from` on: `out[i] = store(finish(load(x_0[from + i]) ∘
/// load(x_1[from + i]) ∘ …))` over `first` then `rest` in order (the tails the vector kernels leave). Stops at the
/// end of the shortest input.
fn reduce_elements<T: Reducible>(first: &[T], rest: &[&[T]], out: &mut [T], from: usize, op: Op, world: usize) {
    for (i, o) in out.iter_mut().enumerate() {
        let at = from + i;
        let Some(x0) = first.get(at) else { return };
        let mut a = x0.load();
        for x in rest {
            let Some(x) = x.get(at) else { return };
            a = T::combine(a, x.load(), op);
        }
        *o = T::store(T::finish(a, op, world));
    }
}

/// Elements per tile of [`self_tiles`]: 64 f32 accumulators are eight AVX2 registers.
const TILE: usize = 64;

/// `out[i] = finish(x_0[i] ∘ x_1[i] ∘ …)` over `first` then `rest` in order, for elements that are their own
/// accumulators ([`Reducible::ACC_IS_SELF`]), a tile at a time: the tile's accumulators are copied from the first
/// input, every other input's part of it folded in, and the tile finished and written once, so the accumulators
/// stay in registers and the output is written once instead of once per input. The same operations in the same
/// order as the element-wise definition. `out` is at most as long as every input (the caller cut it to the
/// shortest) and every input views as accumulators (the caller checked), so the early returns never happen.
#[inline(always)]
fn self_tiles<T: Reducible>(
    first: &[T],
    rest: &[&[T]],
    out: &mut [T::Acc],
    f: impl Fn(T::Acc, T::Acc) -> T::Acc,
    finish: impl Fn(T::Acc) -> T::Acc,
) {
    let view = tile_view::<T>;
    let n = out.len();
    let whole = n - n % TILE;
    for (t, o) in out[..whole].chunks_exact_mut(TILE).enumerate() {
        let at = t * TILE;
        let Some(x0) = view(first, at..at + TILE) else { return };
        let mut acc = [T::Acc::zeroed(); TILE];
        acc.copy_from_slice(x0);
        for x in rest {
            let Some(x) = view(x, at..at + TILE) else { return };
            for (a, b) in acc.iter_mut().zip(x) {
                *a = f(*a, *b);
            }
        }
        for (o, a) in o.iter_mut().zip(acc) {
            *o = finish(a);
        }
    }
    for (i, o) in out[whole..].iter_mut().enumerate() {
        let at = whole + i;
        let Some(x0) = first.get(at) else { return };
        let mut a = x0.load();
        for x in rest {
            let Some(x) = x.get(at) else { return };
            a = f(a, x.load());
        }
        *o = finish(a);
    }
}

/// `x[r]` viewed as accumulators, if `r` lies within `x` and the view is possible.
#[inline(always)]
fn tile_view<T: Reducible>(x: &[T], r: std::ops::Range<usize>) -> Option<&[T::Acc]> {
    x.get(r).and_then(|x| bytemuck::try_cast_slice::<T, T::Acc>(x).ok())
}

/// Loads elements into accumulators.
pub(crate) fn load_acc<T: Reducible>(src: &[T], dst: &mut [T::Acc]) {
    T::load_slice(src, dst);
}

/// `out[i] = acc_in[i] ∘ load(x[i])`.
pub(crate) fn combine_acc<T: Reducible>(acc_in: &[T::Acc], x: &[T], out: &mut [T::Acc], op: Op) {
    let n = acc_in.len().min(x.len()).min(out.len());
    let out = &mut out[..n];
    T::load_slice(&x[..n], out);
    fold_into::<T>(&acc_in[..n], out, op);
}

/// `out[i] = store(finish(acc[i]))`.
pub(crate) fn store_acc<T: Reducible>(acc: &[T::Acc], out: &mut [T], op: Op, world: usize) {
    let mut tmp = [T::Acc::zeroed(); BLOCK];
    for (a, o) in acc.chunks(BLOCK).zip(out.chunks_mut(BLOCK)) {
        let n = a.len().min(o.len());
        let t = &mut tmp[..n];
        t.copy_from_slice(&a[..n]);
        finish_all::<T>(t, op, world);
        T::store_slice(t, &mut o[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_sums_wrap() {
        let a = [120i8, -5];
        let b = [10i8, -125];
        let mut out = [0i8; 2];
        reduce_into(&[&a[..], &b[..]], &mut out, Op::Sum, 2);
        assert_eq!(out, [-126, 126]);
    }

    #[test]
    fn half_precision_accumulates_in_f32() {
        // 2048 + 1 + 1 in f16 steps would round to 2048 twice; in f32 it is 2050, which f16 represents.
        let xs = [f16::from_f32(2048.0)];
        let one = [f16::from_f32(1.0)];
        let mut out = [f16::ZERO];
        reduce_into(&[&xs[..], &one[..], &one[..]], &mut out, Op::Sum, 3);
        assert_eq!(out[0].to_f32(), 2050.0);
    }

    #[test]
    fn every_known_pair_resolves_to_its_operator() {
        for dtype in DataType::ALL {
            for op in ReduceOp::ALL {
                // `Op`'s variants carry `ReduceOp`'s names: `Sum` for "sum", and so on.
                let got = resolve(dtype, op).map(|o| format!("{o:?}").to_ascii_lowercase());
                assert_eq!(got.ok().as_deref(), Some(op.name()), "{dtype} {op}");
            }
        }
    }

    #[test]
    fn unknown_type_error_is_typed_and_names_the_crate() {
        // No unknown variant can be built today; the error the wildcard arm returns is checked directly.
        let e = unknown_dtype(DataType::F32);
        match &e {
            Error::InvalidArgument(InvalidArgument::UnsupportedDataType { dtype, backend, why }) => {
                assert_eq!(*dtype, DataType::F32);
                assert_eq!(backend, "host");
                assert!(why.contains(&format!("anyccl-host {}", env!("CARGO_PKG_VERSION"))), "{why}");
            }
            other => panic!("expected UnsupportedDataType, got {other:?}"),
        }
        assert!(e.to_string().starts_with("invalid argument: f32 is not supported by the host backend"), "{e}");
    }

    #[test]
    fn bf16_conversions_match_half_bit_for_bit() {
        for i in 0..=u16::MAX {
            assert_eq!(bf16_bits_to_f32(i).to_bits(), bf16::from_bits(i).to_f32().to_bits(), "{i:#06x}");
        }
        // Every exponent with many mantissas, and the rounding edges (ties, carries into the exponent, NaNs).
        let mut xs: Vec<u32> = (0..=u32::MAX).step_by(65_521).collect();
        for hi in [0u32, 0x3F80, 0x7F7F, 0x7F80, 0x7FC0, 0x8000, 0xFF7F, 0xFF80, 0xFFFF, 0x0080, 0x00FF] {
            for lo in [0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0xC000] {
                xs.push((hi << 16) | lo);
            }
        }
        for x in xs {
            let v = f32::from_bits(x);
            assert_eq!(f32_to_bf16_bits(v), bf16::from_f32(v).to_bits(), "{x:#010x}");
        }
    }

    /// The block kernels give what the element-wise definition gives, bit for bit, for every operator, across
    /// block boundaries and with the 16-bit floats' conversions.
    #[test]
    fn block_kernels_match_the_element_definition() {
        fn check<T: Reducible + PartialEq + std::fmt::Debug>(make: impl Fn(usize, usize) -> T) {
            for world in [2, 3] {
                check_world(&make, world);
            }
        }
        fn check_world<T: Reducible + PartialEq + std::fmt::Debug>(make: &impl Fn(usize, usize) -> T, world: usize) {
            let n = BLOCK * 2 + 37;
            let inputs: Vec<Vec<T>> = (0..world).map(|r| (0..n).map(|i| make(r, i)).collect()).collect();
            let views: Vec<&[T]> = inputs.iter().map(|v| &v[..]).collect();
            for op in Op::ALL {
                let mut out = vec![make(0, 0); n];
                reduce_into(&views, &mut out, op, world);
                // The form for any processor gives the same bits as the one `reduce_into` picked here.
                let mut plain = vec![make(0, 0); n];
                reduce_into_any(&views, &mut plain, op, world);
                assert!(bytemuck::cast_slice::<T, u8>(&plain) == bytemuck::cast_slice::<T, u8>(&out), "{op:?}");
                for i in 0..n {
                    let mut a = inputs[0][i].load();
                    for inp in &inputs[1..] {
                        a = T::combine(a, inp[i].load(), op);
                    }
                    let want = T::store(T::finish(a, op, world));
                    assert_eq!(bytemuck::bytes_of(&out[i]), bytemuck::bytes_of(&want), "{op:?} at {i}");
                }
                let mut acc = vec![T::Acc::zeroed(); n];
                load_acc::<T>(&inputs[0], &mut acc);
                let mut next = vec![T::Acc::zeroed(); n];
                combine_acc::<T>(&acc, &inputs[1], &mut next, op);
                let mut stored = vec![make(0, 0); n];
                store_acc::<T>(&next, &mut stored, op, world);
                for i in 0..n {
                    let a = T::combine(inputs[0][i].load(), inputs[1][i].load(), op);
                    let want = T::store(T::finish(a, op, world));
                    assert_eq!(bytemuck::bytes_of(&stored[i]), bytemuck::bytes_of(&want), "{op:?} ring at {i}");
                }
            }
        }
        let val = |r: usize, i: usize| ((i * 7 + r * 13) % 23) as f32 * 0.37 - 3.1 + r as f32 * 1e-3;
        check(val);
        check(|r, i| f64::from(val(r, i)));
        // Signed zeros and one NaN against numbers, in every order: `min`/`max` must select as the definition does.
        // (One NaN pattern and no infinities, so that no operation chooses between two different NaNs.)
        check(|r, i| [0.0f32, -0.0, f32::NAN, 1.5, -2.25, 3.0][(i * 5 + r * 3 + i / 6) % 6]);
        check(|r, i| f16::from_f32(val(r, i)));
        check(|r, i| bf16::from_f32(val(r, i)));
        check(|r, i| F8E4M3::from_f32(val(r, i)));
        check(|r, i| (i as i32).wrapping_mul(2_654_435) ^ r as i32);
        check(|r, i| (i * 31 + r) as u8);
    }

    /// A 16-bit float's bit layout, for the kernel tests.
    trait HalfBits: Reducible + PartialEq + std::fmt::Debug {
        /// Infinity's bits (a magnitude above it is a NaN).
        const INF: u16;
        /// The quiet bit of a NaN.
        const QUIET: u16;
        /// Values worth meeting every other: zeros, subnormals, the largest finite, infinities, NaNs of both kinds
        /// and payloads, rounding ties.
        const SPECIAL: [u16; 26];
        fn of(bits: u16) -> Self;
        fn bits(self) -> u16;
    }
    impl HalfBits for bf16 {
        const INF: u16 = 0x7F80;
        const QUIET: u16 = 0x40;
        const SPECIAL: [u16; 26] = [
            0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7F81, 0xFF81, 0x7FBF,
            0x7FC0, 0xFFC0, 0x7FC1, 0x7FFF, 0xFFFF, 0x3F80, 0xBF80, 0x3B80, 0x3C00, 0x3F81, 0x4000, 0x0100, 0x7F00,
        ];
        fn of(bits: u16) -> Self {
            bf16::from_bits(bits)
        }
        fn bits(self) -> u16 {
            self.to_bits()
        }
    }
    impl HalfBits for f16 {
        const INF: u16 = 0x7C00;
        const QUIET: u16 = 0x200;
        const SPECIAL: [u16; 26] = [
            0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7C01, 0xFC01, 0x7DFF,
            0x7E00, 0xFE00, 0x7E01, 0x7FFF, 0xFFFF, 0x3C00, 0xBC00, 0x1000, 0x1400, 0x3C01, 0x4000, 0x0800, 0x7800,
        ];
        fn of(bits: u16) -> Self {
            f16::from_bits(bits)
        }
        fn bits(self) -> u16 {
            self.to_bits()
        }
    }

    /// Whether `got` and `want` are both NaNs that IEEE 754 and Rust let an operation choose between: where two
    /// NaNs meet in one operation (or a NaN meets one the operation made, such as infinity minus infinity), the
    /// result carries either's payload, and compilers reorder the operands of `+` and `*` freely, the element-wise
    /// definition included. Every NaN the inputs quieted, and the processor's own default NaNs, are candidates;
    /// with a single candidate there is no choice and the bits must match.
    fn same_nan_choice<T: HalfBits>(got: u16, want: u16, inputs: &[u16], op: Op) -> bool {
        let is_nan = |b: u16| b & 0x7FFF > T::INF;
        let mut candidates: Vec<u16> = inputs.iter().filter(|b| is_nan(**b)).map(|b| b | T::QUIET).collect();
        // The NaNs the operations made from numbers (infinity minus infinity, zero times infinity): the
        // processor's default NaN, negative on x86, positive on Arm.
        let mut made = 0;
        let mut a = T::of(inputs[0]).load();
        for x in &inputs[1..] {
            let b = T::of(*x).load();
            let c = T::combine(a, b, op);
            let nan = |v: T::Acc| T::store(v).bits() & 0x7FFF > T::INF;
            made += usize::from(!nan(a) && !nan(b) && nan(c));
            a = c;
        }
        if made > 0 {
            candidates.extend([0x8000 | T::INF | T::QUIET, T::INF | T::QUIET]);
        }
        let choices = inputs.iter().filter(|b| is_nan(**b)).count() + made;
        is_nan(got) && is_nan(want) && choices >= 2 && candidates.contains(&got)
    }

    /// The 16-bit floats' kernels (the AVX2 ones where the processor has them, and the portable one) give the
    /// element-wise definition's bits for every operator: every value against NaNs of both kinds and payloads,
    /// infinities, zeros of both signs, subnormals, the largest finite values and rounding ties, in every position
    /// of a vector, with lengths that are not a multiple of the vector width, and one to five inputs.
    fn check_half_kernels<T: HalfBits>() {
        // Every value, then pseudo-random patterns; the other inputs are the specials, shifted so that each meets
        // every lane, and pseudo-random patterns of their own.
        let mut lcg = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            lcg = lcg.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            (lcg >> 48) as u16
        };
        let special = T::SPECIAL;
        let n = (1 << 16) + (1 << 14) + 21;
        let all: Vec<T> = (0..n).map(|i| T::of(if i < 1 << 16 { i as u16 } else { next() })).collect();
        let mut inputs = vec![all];
        for r in 1..5 {
            inputs.push(
                (0..n)
                    .map(|i| {
                        let k = i / special.len() + r;
                        T::of(if (i / 7 + r) % 3 == 0 { next() } else { special[(i + k) % special.len()] })
                    })
                    .collect(),
            );
        }
        // The same rank order reversed, so that the specials stand on the left of each operator too.
        let mut reversed = inputs.clone();
        reversed.reverse();
        for set in [&inputs, &reversed] {
            for world in 1..=set.len() {
                for len in [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 100, n] {
                    let views: Vec<&[T]> = set[..world].iter().map(|v| &v[..len]).collect();
                    for op in Op::ALL {
                        let mut out = vec![T::of(0); len];
                        reduce_into(&views, &mut out, op, world);
                        let mut plain = vec![T::of(0); len];
                        reduce_into_any(&views, &mut plain, op, world);
                        for i in 0..len {
                            let mut a = views[0][i].load();
                            for x in &views[1..] {
                                a = T::combine(a, x[i].load(), op);
                            }
                            let want = T::store(T::finish(a, op, world)).bits();
                            let inputs: Vec<u16> = views.iter().map(|x| x[i].bits()).collect();
                            for (form, got) in [("portable", plain[i].bits()), ("picked", out[i].bits())] {
                                assert!(
                                    got == want || same_nan_choice::<T>(got, want, &inputs, op),
                                    "{op:?} ({form}) world {world} len {len} at {i}: {inputs:04x?} gave {got:04x}, \
                                     the definition {want:04x}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bf16_kernels_match_the_element_definition() {
        check_half_kernels::<bf16>();
    }

    #[test]
    fn f16_kernels_match_the_element_definition() {
        check_half_kernels::<f16>();
    }

    #[test]
    fn avg_divides_by_world() {
        let a = [1.0f32, 3.0];
        let b = [2.0f32, 5.0];
        let mut out = [0.0f32; 2];
        reduce_into(&[&a[..], &b[..]], &mut out, Op::Avg, 2);
        assert_eq!(out, [1.5, 4.0]);
    }
}
