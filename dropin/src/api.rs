//! The C types and result codes of `nccl.h` as the drop-in sees them; the functions themselves are listed once,
//! in [`crate::table`], which generates [`Api`] (the underlying library's entry points), [`NCCL_H_FUNCTIONS`] and
//! every export.
//!
//! C enums (`ncclResult_t`, `ncclDataType_t`, `ncclRedOp_t`, `ncclScalarResidence_t`, `ncclCommMemStat_t`) are
//! `int` here: a caller may pass any value and it is forwarded untouched (a Rust enum could not hold an unknown
//! value soundly). Structures the drop-in never looks into (`ncclConfig_t`, `ncclSimInfo_t`, windows, communicators,
//! streams, parameter handles) are opaque pointers, and so is `ncclCollConfig_t`, which only `ncclAllReduceConfig`
//! reads, within its declared size ([`crate::coll_config`]).

use std::ffi::{c_int, c_void};

pub use crate::table::{Api, DEVICE_HOST_FUNCTIONS, NCCL_H_FUNCTIONS};

pub use anyccl_ccl::sys::{ncclComm_t as Comm, ncclResult_t as NcclResult, ncclUniqueId as UniqueId, Stream};

/// `ncclWindow_t`.
pub type Window = *mut c_void;
/// `ncclConfig_t*` (never read by the drop-in; its layout changes between releases).
pub type Config = *mut c_void;
/// `ncclSimInfo_t*`.
pub type SimInfo = *mut c_void;
/// `const ncclCollConfig_t*` (the per-call configuration of NCCL 2.31 and later; null: as the plain call; read by
/// [`crate::coll_config`]).
pub type CollConfig = *const c_void;
/// `ncclParamHandle_t`.
pub type ParamHandle = *mut c_void;

/// `ncclTeam_t` of `nccl_device/core.h`: passed and returned by value, so its layout is spelled out.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Team {
    /// `nRanks`.
    pub n_ranks: c_int,
    /// `rank`.
    pub rank: c_int,
    /// `stride`.
    pub stride: c_int,
}

impl Team {
    /// What a team function returns when the drop-in cannot forward it: no ranks (`ncclGetLastError` says why).
    pub const NONE: Team = Team { n_ranks: 0, rank: 0, stride: 0 };
}

/// `ncclMultimemHandle_t` of `nccl_device/core.h`: passed by value, so its layout is spelled out.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MultimemHandle {
    /// `mcBasePtr`.
    pub mc_base_ptr: *mut c_void,
}

/// `ncclSuccess`.
pub const NCCL_SUCCESS: NcclResult = 0;
/// `ncclUnhandledCudaError`: what `ncclAllReduce` returns when the device runtime failed anyccl's own kernel.
pub const NCCL_UNHANDLED_CUDA_ERROR: NcclResult = 1;
/// `ncclSystemError`: what every call returns when there is no underlying library to forward to.
pub const NCCL_SYSTEM_ERROR: NcclResult = 2;
/// `ncclInternalError`: what a call returns when the drop-in itself failed (a panic caught at the boundary).
pub const NCCL_INTERNAL_ERROR: NcclResult = 3;
/// `ncclInvalidArgument`: what `ncclAllReduce` returns when anyccl refused the call's arguments.
pub const NCCL_INVALID_ARGUMENT: NcclResult = 4;
/// `ncclInvalidUsage`: what a call returns when the underlying library does not export that function.
pub const NCCL_INVALID_USAGE: NcclResult = 5;
/// `ncclInProgress`: a non-blocking operation has not finished.
pub const NCCL_IN_PROGRESS: NcclResult = 7;

/// The `nccl.h` version whose API this library exports.
pub const NCCL_H_VERSION: &str = "2.32.3";

/// The name of an `ncclDataType_t` value for the log (`"bfloat16"`), or the number for one `nccl.h` 2.32 lacks.
#[derive(Debug, Clone, Copy)]
pub struct DataTypeName(pub c_int);

impl std::fmt::Display for DataTypeName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match anyccl_ccl::nccl_dtype_name(self.0) {
            Some(n) => f.write_str(n),
            None => write!(f, "datatype {}", self.0),
        }
    }
}

/// The name of an `ncclRedOp_t` value for the log (`"sum"`); ops made by `ncclRedOpCreatePreMulSum` are numbers.
#[derive(Debug, Clone, Copy)]
pub struct RedOpName(pub c_int);

impl std::fmt::Display for RedOpName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            0 => f.write_str("sum"),
            1 => f.write_str("prod"),
            2 => f.write_str("max"),
            3 => f.write_str("min"),
            4 => f.write_str("avg"),
            other => write!(f, "op {other}"),
        }
    }
}

/// The drop-in's own text for a result code, used only when no underlying library can answer
/// `ncclGetErrorString` (written here, in the sense of `nccl.h`'s comments; a loaded library's text is forwarded).
pub fn own_error_string(code: NcclResult) -> &'static std::ffi::CStr {
    match code {
        0 => c"no error",
        1 => c"unhandled CUDA error",
        2 => c"system error (the anyccl drop-in found no NCCL or RCCL to forward to; see ncclGetLastError)",
        3 => c"internal error",
        4 => c"invalid argument",
        5 => c"invalid usage",
        6 => c"remote error",
        7 => c"operation in progress",
        _ => c"unknown result code",
    }
}
