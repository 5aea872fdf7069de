//! Raw types of the `nccl.h` ABI (shared by NCCL and RCCL). Types only; no logic.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void};

/// `ncclResult_t`.
pub type ncclResult_t = c_int;
/// `ncclComm_t`: an opaque communicator handle.
pub type ncclComm_t = *mut c_void;
/// `ncclWindow_t`: an opaque window handle.
pub type ncclWindow_t = *mut c_void;
/// `ncclDataType_t`.
pub type ncclDataType_t = c_int;
/// `ncclRedOp_t`.
pub type ncclRedOp_t = c_int;
/// `cudaStream_t` / `hipStream_t`.
pub type Stream = *mut c_void;

/// Bytes in `ncclUniqueId`.
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    /// Opaque bytes.
    pub internal: [c_char; NCCL_UNIQUE_ID_BYTES],
}

/// `ncclSuccess`.
pub const NCCL_SUCCESS: ncclResult_t = 0;
/// `ncclInProgress` (non-blocking communicators).
pub const NCCL_IN_PROGRESS: ncclResult_t = 7;
/// `NCCL_SPLIT_NOCOLOR`: the color of a rank that joins no communicator in `ncclCommSplit`.
pub const NCCL_SPLIT_NOCOLOR: c_int = -1;
/// `NCCL_WIN_COLL_SYMMETRIC`.
pub const NCCL_WIN_COLL_SYMMETRIC: c_int = 0x1;

/// `ncclGetVersion(int*)`.
pub type GetVersion = unsafe extern "C" fn(*mut c_int) -> ncclResult_t;
/// `ncclGetUniqueId(ncclUniqueId*)`.
pub type GetUniqueId = unsafe extern "C" fn(*mut ncclUniqueId) -> ncclResult_t;
/// `ncclCommInitRank(ncclComm_t*, int nranks, ncclUniqueId, int rank)`.
pub type CommInitRank = unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> ncclResult_t;
/// `ncclCommInitAll(ncclComm_t*, int ndev, const int* devlist)`.
pub type CommInitAll = unsafe extern "C" fn(*mut ncclComm_t, c_int, *const c_int) -> ncclResult_t;
/// `ncclCommDestroy`, `ncclCommAbort`, `ncclCommFinalize`.
pub type CommUnary = unsafe extern "C" fn(ncclComm_t) -> ncclResult_t;
/// `ncclGetErrorString(ncclResult_t)`.
pub type GetErrorString = unsafe extern "C" fn(ncclResult_t) -> *const c_char;
/// `ncclGetLastError(ncclComm_t)`.
pub type GetLastError = unsafe extern "C" fn(ncclComm_t) -> *const c_char;
/// `ncclCommCount`, `ncclCommCuDevice`, `ncclCommUserRank`.
pub type CommQuery = unsafe extern "C" fn(ncclComm_t, *mut c_int) -> ncclResult_t;
/// `ncclCommGetAsyncError(ncclComm_t, ncclResult_t*)`.
pub type CommGetAsyncError = unsafe extern "C" fn(ncclComm_t, *mut ncclResult_t) -> ncclResult_t;
/// `ncclAllReduce(send, recv, count, dtype, op, comm, stream)`.
pub type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclRedOp_t,
    ncclComm_t,
    Stream,
) -> ncclResult_t;
/// `ncclReduceScatter(send, recv, recvcount, dtype, op, comm, stream)`.
pub type ReduceScatter = AllReduce;
/// `ncclAllGather(send, recv, sendcount, dtype, comm, stream)`.
pub type AllGather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclComm_t, Stream) -> ncclResult_t;
/// `ncclBroadcast(send, recv, count, dtype, root, comm, stream)`.
pub type Broadcast =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, Stream) -> ncclResult_t;
/// `ncclReduce(send, recv, count, dtype, op, root, comm, stream)`.
pub type Reduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclRedOp_t,
    c_int,
    ncclComm_t,
    Stream,
) -> ncclResult_t;
/// `ncclSend(buf, count, dtype, peer, comm, stream)`.
pub type Send = unsafe extern "C" fn(*const c_void, usize, ncclDataType_t, c_int, ncclComm_t, Stream) -> ncclResult_t;
/// `ncclRecv(buf, count, dtype, peer, comm, stream)`.
pub type Recv = unsafe extern "C" fn(*mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, Stream) -> ncclResult_t;
/// `ncclGroupStart`, `ncclGroupEnd`.
pub type Group = unsafe extern "C" fn() -> ncclResult_t;
/// `ncclCommSplit(comm, color, key, newcomm, config)` (config is `ncclConfig_t*`, passed as NULL by anyccl).
pub type CommSplit = unsafe extern "C" fn(ncclComm_t, c_int, c_int, *mut ncclComm_t, *mut c_void) -> ncclResult_t;
/// `ncclCommRegister(comm, buff, size, handle)`.
pub type CommRegister = unsafe extern "C" fn(ncclComm_t, *mut c_void, usize, *mut *mut c_void) -> ncclResult_t;
/// `ncclCommDeregister(comm, handle)`.
pub type CommDeregister = unsafe extern "C" fn(ncclComm_t, *mut c_void) -> ncclResult_t;
/// `ncclMemAlloc(void** ptr, size_t size)`.
pub type MemAlloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> ncclResult_t;
/// `ncclMemFree(void* ptr)`.
pub type MemFree = unsafe extern "C" fn(*mut c_void) -> ncclResult_t;
/// `ncclCommWindowRegister(comm, buff, size, win, winFlags)`.
pub type CommWindowRegister =
    unsafe extern "C" fn(ncclComm_t, *mut c_void, usize, *mut ncclWindow_t, c_int) -> ncclResult_t;
/// `ncclCommWindowDeregister(comm, win)`.
pub type CommWindowDeregister = unsafe extern "C" fn(ncclComm_t, ncclWindow_t) -> ncclResult_t;
/// Entry points anyccl only probes for presence today (their signatures are not called).
pub type Opaque = unsafe extern "C" fn();
