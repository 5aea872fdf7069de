//! The one unsafe layer over the `nccl.h` ABI, as cudarc's `result` is over the driver: one function per library
//! call, on raw handles (`ncclComm_t`, device pointers, streams) and the library's own codes, turning its status
//! into a `Result` with the vendor's error string and, where the library has it, `ncclGetLastError` text.
//!
//! Nothing here keeps state, checks sizes or maps anyccl's types: that is [`crate::CclComm`]'s work, the one type a
//! GPU backend holds. A function that takes a communicator handle is `unsafe`: the handle must be live and come
//! from the same loaded library, and the buffers and stream must be what the call says. A missing optional symbol
//! (`ncclCommSplit` before NCCL 2.18, `ncclCommWindowRegister` on RCCL 7.0, …) is [`Error::Unsupported`] naming the
//! symbol, the file and the release, before anything is called.

use std::ffi::{c_char, c_int, c_void, CStr};

use anyccl_core::{Error, Result};

use crate::{sys, CclLibrary, CclVendor};

/// `"nccl"` or `"rccl"`: the backend name errors carry.
pub(crate) fn backend_name(lib: &CclLibrary) -> &'static str {
    match lib.vendor() {
        CclVendor::Nccl => "nccl",
        CclVendor::Rccl => "rccl",
    }
}

/// Turns a status code into a `Result`, with the vendor's error string and, where the library has it and a
/// communicator is known, `ncclGetLastError` text. `comm` is null or a communicator of `lib` that is still live.
pub(crate) fn check(lib: &CclLibrary, call: &str, status: sys::ncclResult_t, comm: sys::ncclComm_t) -> Result<()> {
    if status == sys::NCCL_SUCCESS {
        return Ok(());
    }
    let t = lib.table();
    // SAFETY: ncclGetErrorString takes any status value and returns a pointer to a static string (or null).
    let text = unsafe { cstr((t.required.get_error_string)(status)) };
    let last = t.optional.get_last_error.and_then(|f| {
        // SAFETY: ncclGetLastError accepts a null or valid communicator and returns a library-owned string.
        unsafe { cstr(f(comm)) }
    });
    let mut message = text.unwrap_or_else(|| format!("status {status}"));
    if let Some(l) = last.filter(|l| !l.is_empty()) {
        message.push_str("; last error: ");
        message.push_str(&l);
    }
    Err(Error::backend(backend_name(lib), call, Some(i64::from(status)), message))
}

/// Copies a C string owned by the library, sanitised (control characters escaped, length bounded): it reaches
/// error messages and terminals.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string valid for the duration of the call.
unsafe fn cstr(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated per this function's contract.
    let bytes = unsafe { CStr::from_ptr(p) }.to_bytes();
    Some(anyccl_core::text::sanitize_bytes(bytes, anyccl_core::text::DEFAULT_MAX_LEN))
}

/// The refusal of a call whose optional symbol the loaded library lacks, naming the capability it turns off.
pub(crate) fn missing_symbol(lib: &CclLibrary, symbol: &str) -> Error {
    let capability = match symbol {
        "ncclMemAlloc" | "ncclMemFree" => "ccl-mem-alloc",
        "ncclCommWindowRegister" | "ncclCommWindowDeregister" => "symmetric-windows",
        "ncclCommSplit" => "comm-split",
        _ => "ccl",
    };
    Error::Unsupported {
        capability: capability.into(),
        reason: anyccl_core::Reason::MissingSymbol {
            symbol: symbol.into(),
            library: lib.path().display().to_string(),
            version: Some(lib.describe()),
        },
    }
}

/// `ncclGetUniqueId`.
pub fn get_unique_id(lib: &CclLibrary) -> Result<sys::ncclUniqueId> {
    let mut raw = sys::ncclUniqueId { internal: [0; sys::NCCL_UNIQUE_ID_BYTES] };
    // SAFETY: ncclGetUniqueId writes one ncclUniqueId through the valid pointer.
    let status = unsafe { (lib.table().required.get_unique_id)(&mut raw) };
    check(lib, "ncclGetUniqueId", status, std::ptr::null_mut())?;
    Ok(raw)
}

/// `ncclCommInitRank`: the new communicator (never null on `Ok`). Blocks until every rank of `id` has joined.
pub fn comm_init_rank(lib: &CclLibrary, nranks: c_int, id: sys::ncclUniqueId, rank: c_int) -> Result<sys::ncclComm_t> {
    let mut comm: sys::ncclComm_t = std::ptr::null_mut();
    // SAFETY: ncclCommInitRank writes a communicator handle through the valid pointer; id is passed by value.
    let status = unsafe { (lib.table().required.comm_init_rank)(&mut comm, nranks, id, rank) };
    check(lib, "ncclCommInitRank", status, comm)?;
    if comm.is_null() {
        return Err(Error::backend(
            backend_name(lib),
            "ncclCommInitRank",
            None,
            "returned success but no communicator",
        ));
    }
    Ok(comm)
}

/// `ncclCommInitAll`: one communicator per device of `devices` (index = rank); at least one device.
pub fn comm_init_all(lib: &CclLibrary, devices: &[c_int]) -> Result<Vec<sys::ncclComm_t>> {
    let f = lib.table().optional.comm_init_all.ok_or_else(|| missing_symbol(lib, "ncclCommInitAll"))?;
    let n = c_int::try_from(devices.len())
        .map_err(|_| anyccl_core::InvalidArgument::BadWorld("too many devices".into()))?;
    if n == 0 {
        return Err(anyccl_core::InvalidArgument::BadWorld("no devices".into()).into());
    }
    let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); devices.len()];
    // SAFETY: the library writes `n` handles into the array of `n` and reads `n` device ordinals.
    let st = unsafe { f(comms.as_mut_ptr(), n, devices.as_ptr()) };
    check(lib, "ncclCommInitAll", st, std::ptr::null_mut())?;
    Ok(comms)
}

/// `ncclCommDestroy`.
///
/// # Safety
/// `comm` is a live communicator of `lib`, destroyed (or aborted) by nobody else, and never used after this call.
pub unsafe fn comm_destroy(lib: &CclLibrary, comm: sys::ncclComm_t) -> Result<()> {
    // SAFETY: the caller's contract.
    let status = unsafe { (lib.table().required.comm_destroy)(comm) };
    check(lib, "ncclCommDestroy", status, std::ptr::null_mut())
}

/// `ncclCommAbort`: tears the communicator down without waiting for peers. It can block for as long as work is
/// still queued on the device.
///
/// # Safety
/// As [`comm_destroy`].
pub unsafe fn comm_abort(lib: &CclLibrary, comm: sys::ncclComm_t) -> Result<()> {
    // SAFETY: the caller's contract.
    let st = unsafe { (lib.table().required.comm_abort)(comm) };
    check(lib, "ncclCommAbort", st, std::ptr::null_mut())
}

/// An `int` query of a communicator (`ncclCommCount`, `ncclCommUserRank`), refusing a negative answer.
///
/// # Safety
/// `comm` is a live communicator of `lib`.
unsafe fn comm_query(lib: &CclLibrary, name: &str, f: sys::CommQuery, comm: sys::ncclComm_t) -> Result<usize> {
    let mut v: c_int = 0;
    // SAFETY: the caller's contract; the query writes one int.
    let status = unsafe { f(comm, &mut v) };
    check(lib, name, status, comm)?;
    usize::try_from(v)
        .map_err(|_| Error::backend(backend_name(lib), name, None, format!("returned a negative value {v}")))
}

/// `ncclCommCount`.
///
/// # Safety
/// `comm` is a live communicator of `lib`.
pub unsafe fn comm_count(lib: &CclLibrary, comm: sys::ncclComm_t) -> Result<usize> {
    // SAFETY: the caller's contract.
    unsafe { comm_query(lib, "ncclCommCount", lib.table().required.comm_count, comm) }
}

/// `ncclCommUserRank`.
///
/// # Safety
/// `comm` is a live communicator of `lib`.
pub unsafe fn comm_user_rank(lib: &CclLibrary, comm: sys::ncclComm_t) -> Result<usize> {
    // SAFETY: the caller's contract.
    unsafe { comm_query(lib, "ncclCommUserRank", lib.table().required.comm_user_rank, comm) }
}

/// `ncclCommGetAsyncError`: `Ok` while the communicator is healthy (or an operation is still in progress); the
/// asynchronous error otherwise.
///
/// # Safety
/// `comm` is a live communicator of `lib`.
pub unsafe fn comm_get_async_error(lib: &CclLibrary, comm: sys::ncclComm_t) -> Result<()> {
    let mut e: sys::ncclResult_t = 0;
    // SAFETY: the caller's contract; writes one status.
    let status = unsafe { (lib.table().required.comm_get_async_error)(comm, &mut e) };
    check(lib, "ncclCommGetAsyncError", status, comm)?;
    if e == sys::NCCL_IN_PROGRESS {
        return Ok(());
    }
    check(lib, "asynchronous operation", e, comm)
}

/// `ncclCommSplit` with the default (blocking) configuration: the new communicator, or null for a rank that
/// passed `NCCL_SPLIT_NOCOLOR`. Collective over `comm`.
///
/// # Safety
/// `comm` is a live communicator of `lib`.
pub unsafe fn comm_split(lib: &CclLibrary, comm: sys::ncclComm_t, color: c_int, key: c_int) -> Result<sys::ncclComm_t> {
    let f = lib.table().optional.comm_split.ok_or_else(|| missing_symbol(lib, "ncclCommSplit"))?;
    let mut new: sys::ncclComm_t = std::ptr::null_mut();
    // SAFETY: the caller's contract; the library writes one handle through the valid pointer, and a null
    // configuration asks for the default (blocking) one.
    let st = unsafe { f(comm, color, key, &mut new, std::ptr::null_mut()) };
    check(lib, "ncclCommSplit", st, comm)?;
    Ok(new)
}

/// `ncclAllReduce`.
///
/// # Safety
/// `comm` is a live communicator of `lib`; `send` and `recv` point to `count` elements of `datatype` in device
/// memory the communicator's device can access (they may be equal: in place); `stream` is a live stream of that
/// device.
#[allow(clippy::too_many_arguments)]
pub unsafe fn all_reduce(
    lib: &CclLibrary,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: sys::ncclDataType_t,
    op: sys::ncclRedOp_t,
    comm: sys::ncclComm_t,
    stream: sys::Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let st = unsafe { (lib.table().required.all_reduce)(send, recv, count, datatype, op, comm, stream) };
    check(lib, "ncclAllReduce", st, comm)
}

/// `ncclAllGather` of `count` elements per rank.
///
/// # Safety
/// `comm` is a live communicator of `lib`; `send` holds `count` elements and `recv` `world × count`, on the
/// communicator's device; `stream` is a live stream of that device.
pub unsafe fn all_gather(
    lib: &CclLibrary,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: sys::ncclDataType_t,
    comm: sys::ncclComm_t,
    stream: sys::Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let st = unsafe { (lib.table().required.all_gather)(send, recv, count, datatype, comm, stream) };
    check(lib, "ncclAllGather", st, comm)
}

/// `ncclReduceScatter` to `count` elements per rank.
///
/// # Safety
/// `comm` is a live communicator of `lib`; `send` holds `world × count` elements and `recv` `count`, on the
/// communicator's device; `stream` is a live stream of that device.
#[allow(clippy::too_many_arguments)]
pub unsafe fn reduce_scatter(
    lib: &CclLibrary,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: sys::ncclDataType_t,
    op: sys::ncclRedOp_t,
    comm: sys::ncclComm_t,
    stream: sys::Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let st = unsafe { (lib.table().required.reduce_scatter)(send, recv, count, datatype, op, comm, stream) };
    check(lib, "ncclReduceScatter", st, comm)
}

/// `ncclBroadcast` from `root`.
///
/// # Safety
/// `comm` is a live communicator of `lib`; both buffers hold `count` elements on the communicator's device (`send`
/// is read on the root only); `stream` is a live stream of that device.
#[allow(clippy::too_many_arguments)]
pub unsafe fn broadcast(
    lib: &CclLibrary,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: sys::ncclDataType_t,
    root: c_int,
    comm: sys::ncclComm_t,
    stream: sys::Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let st = unsafe { (lib.table().required.broadcast)(send, recv, count, datatype, root, comm, stream) };
    check(lib, "ncclBroadcast", st, comm)
}

/// `ncclReduce` to `root`.
///
/// # Safety
/// `comm` is a live communicator of `lib`; both buffers hold `count` elements on the communicator's device (`recv`
/// is written on the root only); `stream` is a live stream of that device.
#[allow(clippy::too_many_arguments)]
pub unsafe fn reduce(
    lib: &CclLibrary,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: sys::ncclDataType_t,
    op: sys::ncclRedOp_t,
    root: c_int,
    comm: sys::ncclComm_t,
    stream: sys::Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let st = unsafe { (lib.table().required.reduce)(send, recv, count, datatype, op, root, comm, stream) };
    check(lib, "ncclReduce", st, comm)
}

/// `ncclSend` to `peer`.
///
/// # Safety
/// `comm` is a live communicator of `lib`; `buf` holds `count` elements on the communicator's device; `stream` is
/// a live stream of that device.
pub unsafe fn send(
    lib: &CclLibrary,
    buf: *const c_void,
    count: usize,
    datatype: sys::ncclDataType_t,
    peer: c_int,
    comm: sys::ncclComm_t,
    stream: sys::Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let st = unsafe { (lib.table().required.send)(buf, count, datatype, peer, comm, stream) };
    check(lib, "ncclSend", st, comm)
}

/// `ncclRecv` from `peer`.
///
/// # Safety
/// `comm` is a live communicator of `lib`; `buf` holds `count` elements on the communicator's device; `stream` is
/// a live stream of that device.
pub unsafe fn recv(
    lib: &CclLibrary,
    buf: *mut c_void,
    count: usize,
    datatype: sys::ncclDataType_t,
    peer: c_int,
    comm: sys::ncclComm_t,
    stream: sys::Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let st = unsafe { (lib.table().required.recv)(buf, count, datatype, peer, comm, stream) };
    check(lib, "ncclRecv", st, comm)
}

/// `ncclGroupStart`.
pub fn group_start(lib: &CclLibrary) -> Result<()> {
    // SAFETY: ncclGroupStart takes no arguments.
    let st = unsafe { (lib.table().required.group_start)() };
    check(lib, "ncclGroupStart", st, std::ptr::null_mut())
}

/// `ncclGroupEnd`.
pub fn group_end(lib: &CclLibrary) -> Result<()> {
    // SAFETY: ncclGroupEnd takes no arguments.
    let st = unsafe { (lib.table().required.group_end)() };
    check(lib, "ncclGroupEnd", st, std::ptr::null_mut())
}

/// `ncclMemAlloc`: device memory suitable for windows and registration, on the current device. Not while a stream
/// is capturing. The address is the library's answer, unchecked.
pub fn mem_alloc(lib: &CclLibrary, size: usize) -> Result<*mut c_void> {
    let f = lib.table().optional.mem_alloc.ok_or_else(|| missing_symbol(lib, "ncclMemAlloc"))?;
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: ncclMemAlloc writes the allocation's address through the valid pointer.
    let st = unsafe { f(&mut p, size) };
    check(lib, "ncclMemAlloc", st, std::ptr::null_mut())?;
    Ok(p)
}

/// `ncclMemFree`.
///
/// # Safety
/// `ptr` came from [`mem_alloc`] of the same library and is freed once.
pub unsafe fn mem_free(lib: &CclLibrary, ptr: *mut c_void) -> Result<()> {
    let f = lib.table().optional.mem_free.ok_or_else(|| missing_symbol(lib, "ncclMemFree"))?;
    // SAFETY: per this function's contract.
    let st = unsafe { f(ptr) };
    check(lib, "ncclMemFree", st, std::ptr::null_mut())
}

/// `ncclCommWindowRegister` of `[ptr, ptr + size)` with `flags` (`NCCL_WIN_COLL_SYMMETRIC`). Collective: every
/// rank registers its buffer of the same size. Never while a stream is capturing.
///
/// # Safety
/// `comm` is a live communicator of `lib`; `ptr` is `size` bytes from `ncclMemAlloc` (or another cuMem
/// allocation) of the communicator's device, 4096-byte aligned, and outlives the window.
pub unsafe fn comm_window_register(
    lib: &CclLibrary,
    comm: sys::ncclComm_t,
    ptr: *mut c_void,
    size: usize,
    flags: c_int,
) -> Result<sys::ncclWindow_t> {
    let f = lib.table().optional.comm_window_register.ok_or_else(|| missing_symbol(lib, "ncclCommWindowRegister"))?;
    let mut win: sys::ncclWindow_t = std::ptr::null_mut();
    // SAFETY: the caller's contract; the library writes the window handle through the valid pointer.
    let st = unsafe { f(comm, ptr, size, &mut win, flags) };
    check(lib, "ncclCommWindowRegister", st, comm)?;
    Ok(win)
}

/// `ncclCommWindowDeregister`.
///
/// # Safety
/// `comm` is a live communicator of `lib`; `win` was registered on it by [`comm_window_register`] and is
/// deregistered once.
pub unsafe fn comm_window_deregister(lib: &CclLibrary, comm: sys::ncclComm_t, win: sys::ncclWindow_t) -> Result<()> {
    let f =
        lib.table().optional.comm_window_deregister.ok_or_else(|| missing_symbol(lib, "ncclCommWindowDeregister"))?;
    // SAFETY: the caller's contract.
    let st = unsafe { f(comm, win) };
    check(lib, "ncclCommWindowDeregister", st, comm)
}
