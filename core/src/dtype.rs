//! Element types, reduction operators, and which pairs of them are valid.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, InvalidArgument};

/// The element type of a collective's buffers.
///
/// The set matches the `ncclDataType_t` enumeration of NCCL ≥ 2.24 (RCCL names the fp8 types differently; the
/// backends map them).
///
/// `#[non_exhaustive]`: vendors add types (NCCL 2.24 added the fp8 pair), and so may anyccl. A `match` outside this
/// crate needs a wildcard arm; a backend answers a type it does not know with a typed error, never a panic.
///
/// ```compile_fail
/// use anyccl_core::DataType;
///
/// // Every variant of today, and still an error: a `match` outside anyccl-core must have a `_` arm.
/// fn size(d: DataType) -> usize {
///     match d {
///         DataType::I8 | DataType::U8 | DataType::Fp8E4M3 | DataType::Fp8E5M2 => 1,
///         DataType::F16 | DataType::Bf16 => 2,
///         DataType::I32 | DataType::U32 | DataType::F32 => 4,
///         DataType::I64 | DataType::U64 | DataType::F64 => 8,
///     }
/// }
/// ```
///
/// The same function with a `_` arm compiles (so the failure above is the missing arm, nothing else):
///
/// ```
/// use anyccl_core::DataType;
///
/// fn size(d: DataType) -> Option<usize> {
///     match d {
///         DataType::I8 | DataType::U8 | DataType::Fp8E4M3 | DataType::Fp8E5M2 => Some(1),
///         DataType::F16 | DataType::Bf16 => Some(2),
///         DataType::I32 | DataType::U32 | DataType::F32 => Some(4),
///         DataType::I64 | DataType::U64 | DataType::F64 => Some(8),
///         _ => None,
///     }
/// }
/// assert_eq!(size(DataType::Bf16), Some(2));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum DataType {
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    Bf16,
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary64.
    F64,
    /// OCP fp8 E4M3 (finite-only, max 448).
    #[serde(rename = "fp8e4m3")]
    Fp8E4M3,
    /// OCP fp8 E5M2 (max 57344).
    #[serde(rename = "fp8e5m2")]
    Fp8E5M2,
}

impl DataType {
    /// Every data type, in declaration order: the integers, f16, bf16, f32, f64, then the fp8 pair. (Not quite
    /// `ncclDataType_t` order, which numbers bf16 after f64.)
    pub const ALL: [DataType; 12] = [
        DataType::I8,
        DataType::U8,
        DataType::I32,
        DataType::U32,
        DataType::I64,
        DataType::U64,
        DataType::F16,
        DataType::Bf16,
        DataType::F32,
        DataType::F64,
        DataType::Fp8E4M3,
        DataType::Fp8E5M2,
    ];

    /// Size of one element in bytes (also its required alignment).
    pub const fn size_bytes(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 | DataType::Fp8E4M3 | DataType::Fp8E5M2 => 1,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }

    /// The canonical short name (`"bf16"`, `"fp8e4m3"`, …), as used on the command line and in table files.
    pub const fn name(self) -> &'static str {
        match self {
            DataType::I8 => "i8",
            DataType::U8 => "u8",
            DataType::I32 => "i32",
            DataType::U32 => "u32",
            DataType::I64 => "i64",
            DataType::U64 => "u64",
            DataType::F16 => "f16",
            DataType::Bf16 => "bf16",
            DataType::F32 => "f32",
            DataType::F64 => "f64",
            DataType::Fp8E4M3 => "fp8e4m3",
            DataType::Fp8E5M2 => "fp8e5m2",
        }
    }

    /// True for the floating-point types (including fp8 and bf16).
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F16 | DataType::Bf16 | DataType::F32 | DataType::F64 | DataType::Fp8E4M3 | DataType::Fp8E5M2
        )
    }

    /// True for the fp8 types.
    pub const fn is_fp8(self) -> bool {
        matches!(self, DataType::Fp8E4M3 | DataType::Fp8E5M2)
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DataType {
    type Err = Error;

    /// Accepts the canonical names and the usual aliases (`float32`, `half`, `bfloat16`, `e4m3`, …).
    fn from_str(s: &str) -> Result<Self, Error> {
        let t = match s.trim().to_ascii_lowercase().as_str() {
            "i8" | "int8" => DataType::I8,
            "u8" | "uint8" => DataType::U8,
            "i32" | "int32" | "int" => DataType::I32,
            "u32" | "uint32" => DataType::U32,
            "i64" | "int64" => DataType::I64,
            "u64" | "uint64" => DataType::U64,
            "f16" | "fp16" | "float16" | "half" => DataType::F16,
            "bf16" | "bfloat16" => DataType::Bf16,
            "f32" | "fp32" | "float32" | "float" => DataType::F32,
            "f64" | "fp64" | "float64" | "double" => DataType::F64,
            "fp8e4m3" | "f8e4m3" | "e4m3" | "float8_e4m3fn" => DataType::Fp8E4M3,
            "fp8e5m2" | "f8e5m2" | "e5m2" | "float8_e5m2" => DataType::Fp8E5M2,
            _ => {
                return Err(Error::Parse {
                    what: "data type",
                    input: s.to_owned(),
                    expected: DataType::ALL.iter().map(|d| d.name()).collect::<Vec<_>>().join(", "),
                })
            }
        };
        Ok(t)
    }
}

/// The reduction operator of all-reduce, reduce and reduce-scatter (`ncclRedOp_t` order).
///
/// `#[non_exhaustive]`: vendors add operators (NCCL 2.10 added `avg`), and so may anyccl. A `match` outside this
/// crate needs a wildcard arm; a backend answers an operator it does not know with a typed error, never a panic.
///
/// ```compile_fail
/// use anyccl_core::ReduceOp;
///
/// // Every variant of today, and still an error: a `match` outside anyccl-core must have a `_` arm.
/// fn is_sum(op: ReduceOp) -> bool {
///     match op {
///         ReduceOp::Sum => true,
///         ReduceOp::Prod | ReduceOp::Min | ReduceOp::Max | ReduceOp::Avg => false,
///     }
/// }
/// ```
///
/// The same function with a `_` arm compiles (so the failure above is the missing arm, nothing else):
///
/// ```
/// use anyccl_core::ReduceOp;
///
/// fn is_sum(op: ReduceOp) -> bool {
///     match op {
///         ReduceOp::Sum => true,
///         ReduceOp::Prod | ReduceOp::Min | ReduceOp::Max | ReduceOp::Avg => false,
///         _ => false,
///     }
/// }
/// assert!(is_sum(ReduceOp::Sum));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum ReduceOp {
    /// Sum (integers wrap on overflow, as in NCCL).
    Sum,
    /// Product (integers wrap on overflow).
    Prod,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Mean over the ranks (the sum divided by the world size). Floating-point types only.
    Avg,
}

impl ReduceOp {
    /// Every operator.
    pub const ALL: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];

    /// The canonical lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "sum" => Ok(ReduceOp::Sum),
            "prod" | "product" => Ok(ReduceOp::Prod),
            "min" => Ok(ReduceOp::Min),
            "max" => Ok(ReduceOp::Max),
            "avg" | "mean" => Ok(ReduceOp::Avg),
            _ => Err(Error::Parse {
                what: "reduce op",
                input: s.to_owned(),
                expected: "sum, prod, min, max, avg".to_owned(),
            }),
        }
    }
}

/// Whether `op` is defined on `dtype` in anyccl, independent of any backend.
///
/// Every operator is defined on every type except `avg` on integers: vendors disagree on how an integer mean rounds
/// (NCCL divides after a wrapping sum), so anyccl refuses it rather than give results that differ between backends.
/// Backends may refuse more pairs (for example fp8 on NCCL < 2.24); they say so through their capability report.
pub fn check_reduction(dtype: DataType, op: ReduceOp) -> Result<(), InvalidArgument> {
    if op == ReduceOp::Avg && !dtype.is_float() {
        return Err(InvalidArgument::UnsupportedReduction {
            dtype,
            op,
            why: "avg is defined on floating-point types only (integer means round differently between vendors)"
                .to_owned(),
        });
    }
    Ok(())
}

/// One element's value, wide enough for every [`DataType`]: floats as `f64`, integers as `i128`. What host
/// references and result checks compute with ([`Value::decode`], [`Value::encode`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    /// A floating-point element.
    Float(f64),
    /// An integer element.
    Int(i128),
}

impl Value {
    /// Decodes one little-endian element of `dtype` from the start of `bytes` (missing trailing bytes read as 0).
    pub fn decode(dtype: DataType, bytes: &[u8]) -> Value {
        let mut b = [0u8; 8];
        let n = bytes.len().min(dtype.size_bytes()).min(8);
        b[..n].copy_from_slice(&bytes[..n]);
        let u = u64::from_le_bytes(b);
        match dtype {
            DataType::I8 => Value::Int(i128::from(u as u8 as i8)),
            DataType::U8 => Value::Int(i128::from(u as u8)),
            DataType::I32 => Value::Int(i128::from(u as u32 as i32)),
            DataType::U32 => Value::Int(i128::from(u as u32)),
            DataType::I64 => Value::Int(i128::from(u as i64)),
            DataType::U64 => Value::Int(i128::from(u)),
            DataType::F16 => Value::Float(half::f16::from_bits(u as u16).to_f64()),
            DataType::Bf16 => Value::Float(half::bf16::from_bits(u as u16).to_f64()),
            DataType::F32 => Value::Float(f64::from(f32::from_bits(u as u32))),
            DataType::F64 => Value::Float(f64::from_bits(u)),
            DataType::Fp8E4M3 => Value::Float(float8::F8E4M3::from_bits(u as u8).to_f64()),
            DataType::Fp8E5M2 => Value::Float(float8::F8E5M2::from_bits(u as u8).to_f64()),
        }
    }

    /// Appends the value encoded as `dtype`, little-endian: integers wrap to the type's width (the wrapping the
    /// integer reductions define), floats round to the nearest value of the type.
    pub fn encode(self, dtype: DataType, out: &mut Vec<u8>) {
        let (f, i) = match self {
            Value::Float(f) => (f, f as i128),
            Value::Int(i) => (i as f64, i),
        };
        match dtype {
            DataType::I8 | DataType::U8 => out.push(i as u8),
            DataType::I32 | DataType::U32 => out.extend_from_slice(&(i as u32).to_le_bytes()),
            DataType::I64 | DataType::U64 => out.extend_from_slice(&(i as u64).to_le_bytes()),
            DataType::F16 => out.extend_from_slice(&half::f16::from_f64(f).to_bits().to_le_bytes()),
            DataType::Bf16 => out.extend_from_slice(&half::bf16::from_f64(f).to_bits().to_le_bytes()),
            DataType::F32 => out.extend_from_slice(&(f as f32).to_bits().to_le_bytes()),
            DataType::F64 => out.extend_from_slice(&f.to_bits().to_le_bytes()),
            DataType::Fp8E4M3 => out.push(float8::F8E4M3::from_f64(f).to_bits()),
            DataType::Fp8E5M2 => out.push(float8::F8E5M2::from_f64(f).to_bits()),
        }
    }
}

/// A Rust type that is one of anyccl's [`DataType`]s, for the typed APIs.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The anyccl data type this Rust type is.
    const DTYPE: DataType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(impl Element for $t { const DTYPE: DataType = DataType::$d; })*
    };
}

element!(
    i8 => I8, u8 => U8, i32 => I32, u32 => U32, i64 => I64, u64 => U64,
    half::f16 => F16, half::bf16 => Bf16, f32 => F32, f64 => F64,
    float8::F8E4M3 => Fp8E4M3, float8::F8E5M2 => Fp8E5M2,
);

#[cfg(test)]
mod tests {

    #[test]
    fn values_round_trip_through_every_type_and_integers_wrap() {
        for d in DataType::ALL {
            let n = d.size_bytes();
            let bytes: Vec<u8> = (0..n as u8).map(|b| b.wrapping_mul(37) & 0x3f).collect();
            let mut out = Vec::new();
            Value::decode(d, &bytes).encode(d, &mut out);
            assert_eq!(out, bytes, "{d}");
        }
        let mut out = Vec::new();
        Value::Int(257).encode(DataType::U8, &mut out);
        Value::Int(-1).encode(DataType::I32, &mut out);
        assert_eq!(out, [1, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(Value::decode(DataType::I8, &[0xff]), Value::Int(-1));
        assert_eq!(Value::decode(DataType::Bf16, &[0x80, 0x3f]), Value::Float(1.0));
        // Missing trailing bytes read as zero.
        assert_eq!(Value::decode(DataType::U32, &[7]), Value::Int(7));
    }

    use super::*;

    #[test]
    fn sizes_match_rust_types() {
        fn size_of<T: Element>() -> (DataType, usize) {
            (T::DTYPE, std::mem::size_of::<T>())
        }
        for (d, s) in [
            size_of::<i8>(),
            size_of::<u8>(),
            size_of::<i32>(),
            size_of::<u32>(),
            size_of::<i64>(),
            size_of::<u64>(),
            size_of::<half::f16>(),
            size_of::<half::bf16>(),
            size_of::<f32>(),
            size_of::<f64>(),
            size_of::<float8::F8E4M3>(),
            size_of::<float8::F8E5M2>(),
        ] {
            assert_eq!(d.size_bytes(), s, "{d}");
        }
    }

    #[test]
    fn names_round_trip() {
        for d in DataType::ALL {
            assert_eq!(d.name().parse::<DataType>().ok(), Some(d));
        }
        for op in ReduceOp::ALL {
            assert_eq!(op.name().parse::<ReduceOp>().ok(), Some(op));
        }
        assert!(matches!("float128".parse::<DataType>(), Err(Error::Parse { .. })));
        assert!(matches!("xor".parse::<ReduceOp>(), Err(Error::Parse { .. })));
    }

    #[test]
    fn avg_only_on_floats() {
        for d in DataType::ALL {
            for op in ReduceOp::ALL {
                let ok = check_reduction(d, op).is_ok();
                assert_eq!(ok, op != ReduceOp::Avg || d.is_float(), "{d} {op}");
            }
        }
    }
}
