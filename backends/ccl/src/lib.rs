//! anyccl-ccl: one runtime loader for the `nccl.h` ABI, shared by NCCL and RCCL.
//!
//! - [`find`]: finds the library really installed (explicit path from `ANYCCL_NCCL_PATH` / `ANYCCL_RCCL_PATH`, the
//!   dynamic loader's names, Python's `nvidia/nccl/lib`, `$CUDA_HOME/lib64`, `/opt/rocm/lib`) and, when nothing
//!   loads, says where it looked and why each place failed.
//! - [`loader`]: resolves every symbol once at load time — required ones as plain function pointers, optional
//!   ones as `Option` — decodes the version (both encodings) and tells NCCL from RCCL. Nothing is looked up by name
//!   afterwards, so nothing can fail that way during graph capture. [`CclLibrary::load_with`] lets tests supply
//!   symbols without `dlopen`.
//! - [`caps`]: turns the table, the version and the environment into a capability report with reasons, and
//!   assembles the GPU backends' reports ([`caps::gpu_backend_report`], [`caps::gpu_runtime`]).
//! - [`result`]: the one unsafe layer, as cudarc's `result` is over the driver: one function per library call on
//!   raw handles, status codes to errors carrying the vendor's text and `ncclGetLastError`.
//! - [`CclComm`]: one rank of a communicator, the one type a GPU backend holds, written once for the CUDA and ROCm
//!   backends: its life (destroy on drop, abort, background close), the collectives over validated arguments,
//!   barrier, query, wait and symmetric windows ([`SymmetricMemory`]).
//! - this module: unique ids as bytes, and the dtype/op mappings that refuse what the loaded version lacks.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod caps;
mod comm;
pub mod find;
pub mod loader;
pub mod result;
mod symmetric;
pub mod sys;

use std::sync::Arc;

use anyccl_core::{DataType, Error, InvalidArgument, ReduceOp, Result};

pub use caps::derive as derive_capabilities;
pub use comm::{io_ptrs, AbortOutcome, CclBackend, CclComm, CclStream, DeviceAddress, ABORT_GRACE, EXIT_WAIT_LIMIT};
pub use find::{NotFound, SearchPlan};
pub use loader::{CclLibrary, CclTable, CclVendor, CclVersion, LoadFailure};
use result::backend_name;
pub use symmetric::{SymmetricBuffer, SymmetricMemory};

/// The former name of [`CclComm`]: one rank of a communicator is one type now, and a [`CclComm`] knows its rank
/// and world (`CclRank::new(comm, rank, world)` is [`CclComm::init_rank`] itself).
#[deprecated(note = "use CclComm: the rank is folded into the communicator")]
pub type CclRank = CclComm;

/// The former home of the communicator's collectives, symmetric memory and stream traits; everything it held is
/// at the crate root now (`anyccl_ccl::CclComm`, `anyccl_ccl::SymmetricBuffer`, …).
#[deprecated(note = "everything of anyccl_ccl::rank is at the crate root: use anyccl_ccl::{CclComm, ...}")]
pub mod rank {
    #[allow(deprecated)]
    pub use crate::CclRank;
    pub use crate::{io_ptrs, CclBackend, CclStream, DeviceAddress, SymmetricBuffer, SymmetricMemory, ABORT_GRACE};
}

/// Finds and loads the library of `vendor` with the standard search plan.
pub fn load(vendor: CclVendor) -> std::result::Result<Arc<CclLibrary>, NotFound> {
    SearchPlan::from_env(vendor).load().map(Arc::new)
}

/// An `ncclUniqueId`: created by one rank, sent to the others as bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId([u8; sys::NCCL_UNIQUE_ID_BYTES]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({:02x?}…)", &self.0[..8])
    }
}

impl UniqueId {
    /// Asks the library for a new id.
    pub fn new(lib: &CclLibrary) -> Result<Self> {
        let raw = result::get_unique_id(lib)?;
        Ok(UniqueId(raw.internal.map(|c| c as u8)))
    }

    /// The id's bytes, for sending to the other ranks.
    pub fn as_bytes(&self) -> &[u8; sys::NCCL_UNIQUE_ID_BYTES] {
        &self.0
    }

    /// Rebuilds an id received from another rank; any other length is an error.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let arr: [u8; sys::NCCL_UNIQUE_ID_BYTES] = bytes.try_into().map_err(|_| {
            Error::InvalidArgument(InvalidArgument::MessageMismatch {
                peer: 0,
                got: bytes.len(),
                expected: sys::NCCL_UNIQUE_ID_BYTES,
            })
        })?;
        Ok(UniqueId(arr))
    }

    /// The id as the library takes it.
    pub fn raw(&self) -> sys::ncclUniqueId {
        sys::ncclUniqueId { internal: self.0.map(|b| b as std::ffi::c_char) }
    }
}

/// Every `ncclDataType_t` of `nccl.h` (2.32) with anyccl's type and the name NCCL gives it: the one list of the
/// codes (RCCL uses the same values, its fp8 types included). The drop-in `libnccl` reads its callers' codes
/// through it.
pub const NCCL_DATA_TYPES: [(DataType, sys::ncclDataType_t, &str); 12] = [
    (DataType::I8, 0, "int8"),
    (DataType::U8, 1, "uint8"),
    (DataType::I32, 2, "int32"),
    (DataType::U32, 3, "uint32"),
    (DataType::I64, 4, "int64"),
    (DataType::U64, 5, "uint64"),
    (DataType::F16, 6, "float16"),
    (DataType::F32, 7, "float32"),
    (DataType::F64, 8, "float64"),
    (DataType::Bf16, 9, "bfloat16"),
    (DataType::Fp8E4M3, 10, "float8e4m3"),
    (DataType::Fp8E5M2, 11, "float8e5m2"),
];

/// The `ncclDataType_t` code of `dtype` in `nccl.h`, whatever the loaded library's version
/// ([`NCCL_DATA_TYPES`]); `None` for a type `nccl.h` has no code for.
pub fn nccl_dtype_code(dtype: DataType) -> Option<sys::ncclDataType_t> {
    NCCL_DATA_TYPES.iter().find(|(d, _, _)| *d == dtype).map(|(_, c, _)| *c)
}

/// anyccl's type of an `ncclDataType_t` code ([`NCCL_DATA_TYPES`]); `None` for a code `nccl.h` 2.32 lacks.
pub fn dtype_of_nccl_code(code: sys::ncclDataType_t) -> Option<DataType> {
    NCCL_DATA_TYPES.iter().find(|(_, c, _)| *c == code).map(|(d, _, _)| *d)
}

/// NCCL's name of an `ncclDataType_t` code (`"bfloat16"`, [`NCCL_DATA_TYPES`]); `None` for a code `nccl.h` 2.32
/// lacks.
pub fn nccl_dtype_name(code: sys::ncclDataType_t) -> Option<&'static str> {
    NCCL_DATA_TYPES.iter().find(|(_, c, _)| *c == code).map(|(_, _, n)| *n)
}

/// The `ncclDataType_t` of `dtype`, or an error if the loaded version lacks it (bf16 before 2.10, fp8 before 2.24
/// on NCCL / 2.20 on RCCL).
pub fn nccl_dtype(lib: &CclLibrary, dtype: DataType) -> Result<sys::ncclDataType_t> {
    let v = lib.version();
    let refuse = |need: (u32, u32)| {
        Error::InvalidArgument(InvalidArgument::UnsupportedReduction {
            dtype,
            op: ReduceOp::Sum,
            why: format!("{} has no {dtype} type; {}.{} or newer is required", lib.describe(), need.0, need.1),
        })
    };
    match dtype {
        DataType::Bf16 if !v.at_least(2, 10) => return Err(refuse((2, 10))),
        DataType::Fp8E4M3 | DataType::Fp8E5M2 => {
            let need = caps::fp8_first_version(lib.vendor());
            if !v.at_least(need.0, need.1) {
                return Err(refuse(need));
            }
        }
        _ => {}
    }
    // NCCL's ncclFloat8e4m3/e5m2 and RCCL's ncclFp8E4M3/E5M2 share the values 10 and 11.
    nccl_dtype_code(dtype).ok_or_else(|| {
        // `DataType` is `#[non_exhaustive]`: a type added to anyccl-core after this crate has no code here yet.
        Error::InvalidArgument(InvalidArgument::UnsupportedDataType {
            dtype,
            backend: backend_name(lib).into(),
            why: format!(
                "anyccl-ccl {} does not know its ncclDataType_t, so {} cannot be asked (the type is newer than this \
                 crate; update anyccl-ccl)",
                env!("CARGO_PKG_VERSION"),
                lib.describe()
            ),
        })
    })
}

/// The `ncclRedOp_t` of `op`, or an error if the loaded version lacks it (avg before 2.10).
pub fn nccl_op(lib: &CclLibrary, op: ReduceOp, dtype: DataType) -> Result<sys::ncclRedOp_t> {
    Ok(match op {
        ReduceOp::Sum => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        // NCCL 2.28.3 answers ncclInvalidArgument for avg on fp8 (seen on an H200); refuse it up front.
        ReduceOp::Avg if dtype.is_fp8() => {
            return Err(Error::InvalidArgument(InvalidArgument::UnsupportedReduction {
                dtype,
                op,
                why: format!("{} has no avg on fp8 types (it returns ncclInvalidArgument)", lib.describe()),
            }))
        }
        ReduceOp::Avg if lib.version().at_least(2, 10) => 4,
        ReduceOp::Avg => {
            return Err(Error::InvalidArgument(InvalidArgument::UnsupportedReduction {
                dtype,
                op,
                why: format!("{} has no ncclAvg; 2.10 or newer is required", lib.describe()),
            }))
        }
        // `ReduceOp` is `#[non_exhaustive]`: an operator added to anyccl-core after this crate has no code here yet.
        other => {
            return Err(Error::InvalidArgument(InvalidArgument::UnsupportedReduction {
                dtype,
                op: other,
                why: format!(
                    "anyccl-ccl {} does not know its ncclRedOp_t, so {} cannot be asked (the operator is newer \
                     than this crate; update anyccl-ccl)",
                    env!("CARGO_PKG_VERSION"),
                    lib.describe()
                ),
            }))
        }
    })
}

/// A (type, operator) pair one loaded library accepts, in that library's own codes: mapped once per call by
/// [`CclReduction::new`] (the backends do it when the front-end checks the pair) and handed to the collective
/// calls, which check that it was mapped for their library.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CclReduction {
    dtype: sys::ncclDataType_t,
    op: sys::ncclRedOp_t,
    pair: (DataType, ReduceOp),
    /// The address of the library it was mapped for: compared, never dereferenced.
    lib: usize,
}

impl CclReduction {
    /// Maps `op` on `dtype` for `lib`, or refuses what the loaded version lacks ([`nccl_dtype`], [`nccl_op`]).
    pub fn new(lib: &Arc<CclLibrary>, dtype: DataType, op: ReduceOp) -> Result<Self> {
        let (d, o) = (nccl_dtype(lib, dtype)?, nccl_op(lib, op, dtype)?);
        Ok(CclReduction { dtype: d, op: o, pair: (dtype, op), lib: Arc::as_ptr(lib) as usize })
    }

    /// The element type.
    pub fn dtype(&self) -> DataType {
        self.pair.0
    }

    /// The operator.
    pub fn op(&self) -> ReduceOp {
        self.pair.1
    }

    /// The library's (`ncclDataType_t`, `ncclRedOp_t`) codes, for [`result`] calls, if the pair was mapped for
    /// `lib` (codes differ between versions and vendors); refused otherwise.
    pub fn codes(&self, lib: &Arc<CclLibrary>) -> Result<(sys::ncclDataType_t, sys::ncclRedOp_t)> {
        if self.lib != Arc::as_ptr(lib) as usize {
            return Err(Error::InvalidArgument(InvalidArgument::UnsupportedReduction {
                dtype: self.pair.0,
                op: self.pair.1,
                why: format!("the pair was mapped for another library than {}", lib.describe()),
            }));
        }
        Ok((self.dtype, self.op))
    }
}

#[cfg(test)]
mod dtype_code_tests {
    use super::*;

    #[test]
    fn every_nccl_code_names_one_type_and_back() {
        for (i, (dtype, code, name)) in NCCL_DATA_TYPES.iter().enumerate() {
            assert_eq!(*code as usize, i, "nccl.h numbers its types from 0 in this order");
            assert_eq!(nccl_dtype_code(*dtype), Some(*code));
            assert_eq!(dtype_of_nccl_code(*code), Some(*dtype));
            assert_eq!(nccl_dtype_name(*code), Some(*name));
        }
        assert_eq!(dtype_of_nccl_code(12), None);
        assert_eq!(dtype_of_nccl_code(-1), None);
        assert_eq!(nccl_dtype_name(9), Some("bfloat16"));
    }
}
