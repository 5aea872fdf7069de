//! Element-wise reduction kernels for every data type, accumulating in f32 or wider.

use anyccl_core::{DataType, Error, InvalidArgument, ReduceOp, Result};
use bytemuck::{Pod, Zeroable};
use float8::{F8E4M3, F8E5M2};
use half::{bf16, f16};

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

/// An element type the host backend reduces, with the accumulator it reduces in.
pub(crate) trait Reducible: Pod {
    /// The accumulator: the type itself for integers and f32/f64, f32 for the 8- and 16-bit floats.
    type Acc: Pod;
    fn load(self) -> Self::Acc;
    fn store(acc: Self::Acc) -> Self;
    fn combine(a: Self::Acc, b: Self::Acc, op: Op) -> Self::Acc;
    /// Applies the final step of `avg` (division by the world size); identity for the other operators.
    fn finish(a: Self::Acc, op: Op, world: usize) -> Self::Acc;
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
        }
    )*};
}
int_reducible!(i8, u8, i32, u32, i64, u64);

macro_rules! float_reducible {
    ($t:ty, $acc:ty, $load:expr, $store:expr) => {
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
        }
    };
}
float_reducible!(f32, f32, |x| x, |a| a);
float_reducible!(f64, f64, |x| x, |a| a);
float_reducible!(f16, f32, f16::to_f32, f16::from_f32);
float_reducible!(bf16, f32, bf16::to_f32, bf16::from_f32);
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

const BLOCK: usize = 2048;

/// `out[i] = finish(x_0[i] ∘ x_1[i] ∘ … )` over `inputs` in order, so every rank computing the same reduction
/// gets bitwise the same result.
pub(crate) fn reduce_into<T: Reducible>(inputs: &[&[T]], out: &mut [T], op: Op, world: usize) {
    let n = out.len();
    let mut acc = vec![T::Acc::zeroed(); BLOCK.min(n)];
    let mut start = 0;
    while start < n {
        let len = BLOCK.min(n - start);
        let acc = &mut acc[..len];
        if let Some((first, rest)) = inputs.split_first() {
            for (a, x) in acc.iter_mut().zip(&first[start..start + len]) {
                *a = x.load();
            }
            for inp in rest {
                for (a, x) in acc.iter_mut().zip(&inp[start..start + len]) {
                    *a = T::combine(*a, x.load(), op);
                }
            }
        }
        for (o, a) in out[start..start + len].iter_mut().zip(acc.iter()) {
            *o = T::store(T::finish(*a, op, world));
        }
        start += len;
    }
}

/// Loads elements into accumulators.
pub(crate) fn load_acc<T: Reducible>(src: &[T], dst: &mut [T::Acc]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.load();
    }
}

/// `acc[i] = acc_in[i] ∘ load(x[i])`.
pub(crate) fn combine_acc<T: Reducible>(acc_in: &[T::Acc], x: &[T], out: &mut [T::Acc], op: Op) {
    for ((o, a), x) in out.iter_mut().zip(acc_in).zip(x) {
        *o = T::combine(*a, x.load(), op);
    }
}

/// `out[i] = store(finish(acc[i]))`.
pub(crate) fn store_acc<T: Reducible>(acc: &[T::Acc], out: &mut [T], op: Op, world: usize) {
    for (o, a) in out.iter_mut().zip(acc) {
        *o = T::store(T::finish(*a, op, world));
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
    fn avg_divides_by_world() {
        let a = [1.0f32, 3.0];
        let b = [2.0f32, 5.0];
        let mut out = [0.0f32; 2];
        reduce_into(&[&a[..], &b[..]], &mut out, Op::Avg, 2);
        assert_eq!(out, [1.5, 4.0]);
    }
}
