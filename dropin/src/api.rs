//! The `nccl.h` API of NCCL 2.28.9 as a table of the underlying library's entry points.
//!
//! The function list was derived from the `nccl.h` of the PyPI wheel `nvidia-nccl-cu12==2.28.9` (every
//! `nccl*` function it declares; each also has a `pnccl*` profiling alias there). The test `real_nccl` parses that
//! header again and compares it with [`NCCL_H_FUNCTIONS`], and the test `exports` compares the built library's
//! dynamic symbols with it, so a function missing here fails a test.
//!
//! C enums (`ncclResult_t`, `ncclDataType_t`, `ncclRedOp_t`, `ncclScalarResidence_t`) are `int` here: a caller may
//! pass any value and it is forwarded untouched (a Rust enum could not hold an unknown value soundly). Structures the
//! drop-in never looks into (`ncclConfig_t`, `ncclSimInfo_t`, windows, communicators, streams) are opaque pointers.

use std::ffi::{c_char, c_int, c_void};

pub use anyccl_ccl::sys::{ncclComm_t as Comm, ncclResult_t as NcclResult, ncclUniqueId as UniqueId, Stream};

/// `ncclWindow_t`.
pub type Window = *mut c_void;
/// `ncclConfig_t*` (never read by the drop-in; its layout changes between releases).
pub type Config = *mut c_void;
/// `ncclSimInfo_t*`.
pub type SimInfo = *mut c_void;

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
pub const NCCL_H_VERSION: &str = "2.28.9";

macro_rules! api_table {
    ($( $name:ident ( $($ty:ty),* ) -> $ret:ty ; )*) => {
        /// Every function of `nccl.h`, as the underlying library exports it (`None`: it does not).
        #[allow(non_snake_case)]
        #[derive(Debug, Clone, Copy, Default)]
        pub struct Api {
            $(
                #[doc = concat!("`", stringify!($name), "`.")]
                pub $name: Option<unsafe extern "C" fn($($ty),*) -> $ret>,
            )*
        }

        /// The names of every function `nccl.h` 2.28.9 declares (without the `pnccl*` aliases), in header order.
        pub const NCCL_H_FUNCTIONS: &[&str] = &[$(stringify!($name)),*];

        impl Api {
            /// Resolves every entry point through `lookup` (null: not exported), once.
            pub(crate) fn resolve(lookup: &mut dyn FnMut(&std::ffi::CStr) -> *const c_void) -> Api {
                Api {
                    $(
                        $name: {
                            let p = lookup(
                                // A literal with one NUL at its end: always a valid C string.
                                match std::ffi::CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()) {
                                    Ok(c) => c,
                                    Err(_) => c"",
                                },
                            );
                            if p.is_null() {
                                None
                            } else {
                                // SAFETY: `p` is the non-null address the underlying library exports under this
                                // nccl.h name (the loader checked it is a function in that library's own code); the
                                // target type is the signature nccl.h 2.28.9 declares for it, the same in every
                                // NCCL and RCCL release that exports it.
                                Some(unsafe {
                                    std::mem::transmute::<*const c_void, unsafe extern "C" fn($($ty),*) -> $ret>(p)
                                })
                            }
                        },
                    )*
                }
            }
        }
    };
}

api_table! {
    ncclMemAlloc(*mut *mut c_void, usize) -> NcclResult;
    ncclMemFree(*mut c_void) -> NcclResult;
    ncclGetVersion(*mut c_int) -> NcclResult;
    ncclGetUniqueId(*mut UniqueId) -> NcclResult;
    ncclCommInitRankConfig(*mut Comm, c_int, UniqueId, c_int, Config) -> NcclResult;
    ncclCommInitRank(*mut Comm, c_int, UniqueId, c_int) -> NcclResult;
    ncclCommInitAll(*mut Comm, c_int, *const c_int) -> NcclResult;
    ncclCommFinalize(Comm) -> NcclResult;
    ncclCommDestroy(Comm) -> NcclResult;
    ncclCommAbort(Comm) -> NcclResult;
    ncclCommRevoke(Comm, c_int) -> NcclResult;
    ncclCommSplit(Comm, c_int, c_int, *mut Comm, Config) -> NcclResult;
    ncclCommShrink(Comm, *mut c_int, c_int, *mut Comm, Config, c_int) -> NcclResult;
    ncclCommInitRankScalable(*mut Comm, c_int, c_int, c_int, *mut UniqueId, Config) -> NcclResult;
    ncclGetErrorString(NcclResult) -> *const c_char;
    ncclGetLastError(Comm) -> *const c_char;
    ncclResetDebugInit() -> ();
    ncclCommGetAsyncError(Comm, *mut NcclResult) -> NcclResult;
    ncclCommCount(Comm, *mut c_int) -> NcclResult;
    ncclCommCuDevice(Comm, *mut c_int) -> NcclResult;
    ncclCommUserRank(Comm, *mut c_int) -> NcclResult;
    ncclCommRegister(Comm, *mut c_void, usize, *mut *mut c_void) -> NcclResult;
    ncclCommDeregister(Comm, *mut c_void) -> NcclResult;
    ncclCommWindowRegister(Comm, *mut c_void, usize, *mut Window, c_int) -> NcclResult;
    ncclCommWindowDeregister(Comm, Window) -> NcclResult;
    ncclRedOpCreatePreMulSum(*mut c_int, *mut c_void, c_int, c_int, Comm) -> NcclResult;
    ncclRedOpDestroy(c_int, Comm) -> NcclResult;
    ncclReduce(*const c_void, *mut c_void, usize, c_int, c_int, c_int, Comm, Stream) -> NcclResult;
    ncclBcast(*mut c_void, usize, c_int, c_int, Comm, Stream) -> NcclResult;
    ncclBroadcast(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> NcclResult;
    ncclAllReduce(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> NcclResult;
    ncclReduceScatter(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> NcclResult;
    ncclAllGather(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> NcclResult;
    ncclAlltoAll(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> NcclResult;
    ncclGather(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> NcclResult;
    ncclScatter(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> NcclResult;
    ncclSend(*const c_void, usize, c_int, c_int, Comm, Stream) -> NcclResult;
    ncclRecv(*mut c_void, usize, c_int, c_int, Comm, Stream) -> NcclResult;
    ncclGroupStart() -> NcclResult;
    ncclGroupEnd() -> NcclResult;
    ncclGroupSimulateEnd(SimInfo) -> NcclResult;
}

/// The name of an `ncclDataType_t` value for the log (`"bfloat16"`), or the number for one `nccl.h` 2.28 lacks.
#[derive(Debug, Clone, Copy)]
pub struct DataTypeName(pub c_int);

impl std::fmt::Display for DataTypeName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names =
            ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64", "bfloat16"];
        match usize::try_from(self.0).ok().and_then(|i| names.get(i)) {
            Some(n) => f.write_str(n),
            None => match self.0 {
                10 => f.write_str("float8e4m3"),
                11 => f.write_str("float8e5m2"),
                other => write!(f, "datatype {other}"),
            },
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
