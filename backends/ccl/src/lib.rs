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
//! - [`rank`]: one rank's collectives, barrier, query, wait and symmetric windows, written once for the CUDA and
//!   ROCm backends ([`CclRank`]).
//! - this module: a thin safe layer — status codes to errors carrying the vendor's text, unique ids as bytes,
//!   dtype/op mappings that refuse what the loaded version lacks, and a small RAII communicator handle.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod caps;
pub mod find;
pub mod loader;
pub mod rank;
pub mod sys;

use std::ffi::{c_int, c_void, CStr};
use std::sync::Arc;

use anyccl_core::{DataType, Error, InvalidArgument, ReduceOp, Result, Teardown};

pub use caps::derive as derive_capabilities;
pub use find::{NotFound, SearchPlan};
pub use loader::{CclLibrary, CclTable, CclVendor, CclVersion, LoadFailure};
pub use rank::{CclBackend, CclRank, CclStream, DeviceAddress, ABORT_GRACE};

/// Finds and loads the library of `vendor` with the standard search plan.
pub fn load(vendor: CclVendor) -> std::result::Result<Arc<CclLibrary>, NotFound> {
    SearchPlan::from_env(vendor).load().map(Arc::new)
}

fn backend_name(lib: &CclLibrary) -> &'static str {
    match lib.vendor() {
        CclVendor::Nccl => "nccl",
        CclVendor::Rccl => "rccl",
    }
}

/// Turns a status code into a `Result`, with the vendor's error string and, where the library has it and a
/// communicator is known, `ncclGetLastError` text.
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
unsafe fn cstr(p: *const std::ffi::c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated per this function's contract.
    let bytes = unsafe { CStr::from_ptr(p) }.to_bytes();
    Some(anyccl_core::text::sanitize_bytes(bytes, anyccl_core::text::DEFAULT_MAX_LEN))
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
        let mut raw = sys::ncclUniqueId { internal: [0; sys::NCCL_UNIQUE_ID_BYTES] };
        // SAFETY: ncclGetUniqueId writes one ncclUniqueId through the valid pointer.
        let status = unsafe { (lib.table().required.get_unique_id)(&mut raw) };
        check(lib, "ncclGetUniqueId", status, std::ptr::null_mut())?;
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

    fn raw(&self) -> sys::ncclUniqueId {
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

    /// The library's codes, if the pair was mapped for `lib` (codes differ between versions and vendors).
    fn codes_for(&self, lib: &Arc<CclLibrary>) -> Result<(sys::ncclDataType_t, sys::ncclRedOp_t)> {
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

/// A communicator handle that keeps its library loaded (`Arc`) and destroys the communicator on drop (unless it
/// was borrowed: [`CclComm::from_raw_borrowed`]).
pub struct CclComm {
    lib: Arc<CclLibrary>,
    comm: sys::ncclComm_t,
    /// Made by [`CclComm::from_raw_borrowed`]: someone else owns the communicator's life, so neither drop nor
    /// destroy nor abort ever reaches the library.
    borrowed: bool,
}

// SAFETY: an ncclComm_t may be used from any thread as long as calls on one communicator are not concurrent;
// `CclComm` exposes it only through `&mut self` or read-only queries that NCCL documents as thread-safe.
unsafe impl Send for CclComm {}

/// What became of [`CclComm::abort_within`].
///
/// Not `#[non_exhaustive]`: the abort returned within the wait or it did not; there is no third outcome.
#[derive(Debug)]
pub enum AbortOutcome {
    /// The library's abort returned, with its status.
    Done(Result<()>),
    /// The abort had not returned after `after` and goes on in the background.
    StillRunning {
        /// How long the caller waited for it.
        after: std::time::Duration,
    },
}

impl CclComm {
    /// `ncclCommInitRank`: joins the communicator `id` as `rank` of `world`.
    pub fn init_rank(lib: Arc<CclLibrary>, world: usize, id: &UniqueId, rank: usize) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(InvalidArgument::RankOutOfRange { what: "own", rank, world }.into());
        }
        let n = c_int::try_from(world).map_err(|_| InvalidArgument::BadWorld(format!("world {world} too large")))?;
        let r = c_int::try_from(rank).map_err(|_| InvalidArgument::BadWorld(format!("rank {rank} too large")))?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: ncclCommInitRank writes a communicator handle through the valid pointer; id is passed by value.
        let status = unsafe { (lib.table().required.comm_init_rank)(&mut comm, n, id.raw(), r) };
        check(&lib, "ncclCommInitRank", status, comm)?;
        if comm.is_null() {
            return Err(Error::backend(
                backend_name(&lib),
                "ncclCommInitRank",
                None,
                "returned success but no communicator",
            ));
        }
        Ok(CclComm { lib, comm, borrowed: false })
    }

    fn query(&self, name: &str, f: sys::CommQuery) -> Result<usize> {
        let mut v: c_int = 0;
        let comm = self.live()?;
        // SAFETY: `comm` is a live communicator; the query writes one int.
        let status = unsafe { f(comm, &mut v) };
        check(&self.lib, name, status, self.comm)?;
        usize::try_from(v)
            .map_err(|_| Error::backend(backend_name(&self.lib), name, None, format!("returned a negative value {v}")))
    }

    /// Wraps a communicator that someone else created and will destroy (the caller of the drop-in `libnccl`):
    /// every call of this type works on it, but dropping the value, [`CclComm::destroy`] and
    /// [`CclComm::close_in_background`] only forget the handle, and [`CclComm::abort_in_place`] /
    /// [`CclComm::abort_within`] forget it and return an error (its owner aborts it). Every later call through
    /// this value then fails as on an aborted communicator.
    ///
    /// # Safety
    /// `comm` is a live communicator of `lib` (created through the same loaded library), and stays live for as long
    /// as the returned value (and anything made from it) is used: its owner destroys or aborts it only after
    /// dropping this value. Calls through this value and the owner's own calls on the communicator are not
    /// concurrent (NCCL's rule for one communicator).
    pub unsafe fn from_raw_borrowed(lib: Arc<CclLibrary>, comm: sys::ncclComm_t) -> Self {
        CclComm { lib, comm, borrowed: true }
    }

    /// Whether the value was made by [`CclComm::from_raw_borrowed`] (it never destroys the communicator).
    pub fn is_borrowed(&self) -> bool {
        self.borrowed
    }

    /// Forgets a borrowed handle instead of aborting it: `Err` saying so.
    fn refuse_borrowed_abort(&mut self) -> Result<()> {
        self.comm = std::ptr::null_mut();
        Err(Error::backend(
            backend_name(&self.lib),
            "ncclCommAbort",
            None,
            "the communicator is borrowed (its owner aborts or destroys it); this handle was forgotten instead",
        ))
    }

    /// `ncclCommCount`.
    pub fn count(&self) -> Result<usize> {
        self.query("ncclCommCount", self.lib.table().required.comm_count)
    }

    /// `ncclCommUserRank`.
    pub fn user_rank(&self) -> Result<usize> {
        self.query("ncclCommUserRank", self.lib.table().required.comm_user_rank)
    }

    /// `ncclCommGetAsyncError`: `Ok` while the communicator is healthy.
    pub fn async_error(&self) -> Result<()> {
        let mut e: sys::ncclResult_t = 0;
        let comm = self.live()?;
        // SAFETY: live communicator; writes one status.
        let status = unsafe { (self.lib.table().required.comm_get_async_error)(comm, &mut e) };
        check(&self.lib, "ncclCommGetAsyncError", status, self.comm)?;
        if e == sys::NCCL_IN_PROGRESS {
            return Ok(());
        }
        check(&self.lib, "asynchronous operation", e, self.comm)
    }

    /// The library this communicator uses.
    pub fn library(&self) -> &Arc<CclLibrary> {
        &self.lib
    }

    /// The raw `ncclComm_t`, for calls this layer does not wrap (null once aborted).
    pub fn raw(&self) -> sys::ncclComm_t {
        self.comm
    }

    /// The communicator handle, or an error once [`Self::abort_in_place`] has torn it down.
    fn live(&self) -> Result<sys::ncclComm_t> {
        if self.comm.is_null() {
            return Err(Error::PeerFailure(format!(
                "this {} communicator was aborted after a peer failed or a wait timed out; create a new one",
                backend_name(&self.lib)
            )));
        }
        Ok(self.comm)
    }

    /// Whether [`Self::abort_in_place`] has torn this communicator down.
    pub fn is_aborted(&self) -> bool {
        self.comm.is_null()
    }

    /// `ncclCommAbort`, keeping the value: the library stops its kernels and frees the communicator without
    /// waiting for peers; every later call returns [`Error::PeerFailure`]. Aborting twice does nothing.
    pub fn abort_in_place(&mut self) -> Result<()> {
        if self.comm.is_null() {
            return Ok(());
        }
        if self.borrowed {
            return self.refuse_borrowed_abort();
        }
        let comm = std::mem::replace(&mut self.comm, std::ptr::null_mut());
        // SAFETY: `comm` was live and is aborted exactly once (the field is null from now on).
        let st = unsafe { (self.lib.table().required.comm_abort)(comm) };
        check(&self.lib, "ncclCommAbort", st, std::ptr::null_mut())
    }

    /// `ncclCommAbort` on a thread of its own, keeping the value, waiting at most `grace` for it. Every later call
    /// returns [`Error::PeerFailure`] at once, whatever the abort does. The library's abort can block for as long
    /// as work is still queued on the device (it frees device memory, which waits for the device), and a kernel
    /// that waits for a dead peer never finishes: then this returns [`AbortOutcome::StillRunning`] after `grace`
    /// and the abort goes on in the background until it finishes or the process exits. Aborting twice does
    /// nothing.
    pub fn abort_within(&mut self, grace: std::time::Duration) -> AbortOutcome {
        if self.comm.is_null() {
            return AbortOutcome::Done(Ok(()));
        }
        if self.borrowed {
            return AbortOutcome::Done(self.refuse_borrowed_abort());
        }
        /// The handle moving to the aborting thread.
        struct Handle(sys::ncclComm_t);
        // SAFETY: the handle moves to the aborting thread and nothing else uses it: `self.comm` is null from now
        // on, so neither later calls nor Drop touch it.
        unsafe impl Send for Handle {}
        let handle = Handle(std::mem::replace(&mut self.comm, std::ptr::null_mut()));
        let lib = self.lib.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new().name("anyccl-ccl-abort".into()).spawn(move || {
            // A whole-value move: the closure then captures `Handle` (Send), not its raw field.
            let handle = handle;
            let comm = handle.0;
            // SAFETY: `comm` was live and is aborted exactly once, here.
            let st = unsafe { (lib.table().required.comm_abort)(comm) };
            // The receiver may have stopped waiting (StillRunning); then nobody needs the result.
            let _ = tx.send(check(&lib, "ncclCommAbort", st, std::ptr::null_mut()));
        });
        if let Err(e) = spawned {
            // The closure, and the handle with it, is gone without an abort: the communicator is leaked.
            return AbortOutcome::Done(Err(Error::backend(
                backend_name(&self.lib),
                "ncclCommAbort",
                None,
                format!("could not start a thread to abort the communicator ({e}); it is leaked"),
            )));
        }
        match rx.recv_timeout(grace) {
            Ok(r) => AbortOutcome::Done(r),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => AbortOutcome::StillRunning { after: grace },
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => AbortOutcome::Done(Err(Error::backend(
                backend_name(&self.lib),
                "ncclCommAbort",
                None,
                "the aborting thread ended without a result",
            ))),
        }
    }

    fn status(&self, call: &str, status: sys::ncclResult_t) -> Result<()> {
        check(&self.lib, call, status, self.comm)
    }

    /// `ncclAllReduce`.
    ///
    /// # Safety
    /// `send` and `recv` point to `count` elements of the reduction's type of device memory the communicator's device can
    /// access (they may be equal: in place), and `stream` is a live stream of that device.
    pub unsafe fn all_reduce(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        reduction: CclReduction,
        stream: sys::Stream,
    ) -> Result<()> {
        let (d, o) = reduction.codes_for(&self.lib)?;
        // SAFETY: the caller guarantees the buffers and stream; the comm is live.
        let st = unsafe { (self.lib.table().required.all_reduce)(send, recv, count, d, o, self.live()?, stream) };
        self.status("ncclAllReduce", st)
    }

    /// `ncclAllGather` of `count` elements per rank.
    ///
    /// # Safety
    /// `send` holds `count` elements and `recv` `world × count`, on the communicator's device; `stream` is live.
    pub unsafe fn all_gather(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DataType,
        stream: sys::Stream,
    ) -> Result<()> {
        let d = nccl_dtype(&self.lib, dtype)?;
        // SAFETY: as documented above.
        let st = unsafe { (self.lib.table().required.all_gather)(send, recv, count, d, self.live()?, stream) };
        self.status("ncclAllGather", st)
    }

    /// `ncclReduceScatter` to `count` elements per rank.
    ///
    /// # Safety
    /// `send` holds `world × count` elements and `recv` `count`, on the communicator's device; `stream` is live.
    pub unsafe fn reduce_scatter(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        reduction: CclReduction,
        stream: sys::Stream,
    ) -> Result<()> {
        let (d, o) = reduction.codes_for(&self.lib)?;
        // SAFETY: as documented above.
        let st = unsafe { (self.lib.table().required.reduce_scatter)(send, recv, count, d, o, self.live()?, stream) };
        self.status("ncclReduceScatter", st)
    }

    /// `ncclBroadcast` from `root`.
    ///
    /// # Safety
    /// Both buffers hold `count` elements on the communicator's device (`send` is read on the root only).
    pub unsafe fn broadcast(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DataType,
        root: usize,
        stream: sys::Stream,
    ) -> Result<()> {
        let d = nccl_dtype(&self.lib, dtype)?;
        let root = c_int::try_from(root).map_err(|_| InvalidArgument::BadWorld(format!("root {root}")))?;
        // SAFETY: as documented above.
        let st = unsafe { (self.lib.table().required.broadcast)(send, recv, count, d, root, self.live()?, stream) };
        self.status("ncclBroadcast", st)
    }

    /// `ncclReduce` to `root`.
    ///
    /// # Safety
    /// Both buffers hold `count` elements on the communicator's device (`recv` is written on the root only).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        reduction: CclReduction,
        root: usize,
        stream: sys::Stream,
    ) -> Result<()> {
        let (d, o) = reduction.codes_for(&self.lib)?;
        let root = c_int::try_from(root).map_err(|_| InvalidArgument::BadWorld(format!("root {root}")))?;
        // SAFETY: as documented above.
        let st = unsafe { (self.lib.table().required.reduce)(send, recv, count, d, o, root, self.live()?, stream) };
        self.status("ncclReduce", st)
    }

    /// `ncclSend` to `peer`.
    ///
    /// # Safety
    /// `buf` holds `count` elements on the communicator's device; `stream` is live.
    pub unsafe fn send(
        &self,
        buf: *const c_void,
        count: usize,
        dtype: DataType,
        peer: usize,
        stream: sys::Stream,
    ) -> Result<()> {
        let d = nccl_dtype(&self.lib, dtype)?;
        let peer = c_int::try_from(peer).map_err(|_| InvalidArgument::BadWorld(format!("peer {peer}")))?;
        // SAFETY: as documented above.
        let st = unsafe { (self.lib.table().required.send)(buf, count, d, peer, self.live()?, stream) };
        self.status("ncclSend", st)
    }

    /// `ncclRecv` from `peer`.
    ///
    /// # Safety
    /// `buf` holds `count` elements on the communicator's device; `stream` is live.
    pub unsafe fn recv(
        &self,
        buf: *mut c_void,
        count: usize,
        dtype: DataType,
        peer: usize,
        stream: sys::Stream,
    ) -> Result<()> {
        let d = nccl_dtype(&self.lib, dtype)?;
        let peer = c_int::try_from(peer).map_err(|_| InvalidArgument::BadWorld(format!("peer {peer}")))?;
        // SAFETY: as documented above.
        let st = unsafe { (self.lib.table().required.recv)(buf, count, d, peer, self.live()?, stream) };
        self.status("ncclRecv", st)
    }

    /// Registers `[ptr, ptr + size)` as a symmetric window (`NCCL_WIN_COLL_SYMMETRIC`). Collective: every rank
    /// registers its buffer of the same size. Never call it while a stream is capturing.
    ///
    /// # Safety
    /// `ptr` is `size` bytes from `ncclMemAlloc` (or another cuMem allocation) of the communicator's device,
    /// 4096-byte aligned, and outlives the window.
    pub unsafe fn window_register(&self, ptr: *mut c_void, size: usize) -> Result<Window> {
        let f = self.lib.table().optional.comm_window_register.ok_or_else(|| self.missing("ncclCommWindowRegister"))?;
        let mut win: sys::ncclWindow_t = std::ptr::null_mut();
        // SAFETY: as documented above; NCCL writes the window handle through the valid pointer.
        let st = unsafe { f(self.live()?, ptr, size, &mut win, sys::NCCL_WIN_COLL_SYMMETRIC) };
        self.status("ncclCommWindowRegister", st)?;
        Ok(Window(win))
    }

    /// Deregisters a window made by [`Self::window_register`].
    pub fn window_deregister(&self, win: Window) -> Result<()> {
        let f =
            self.lib.table().optional.comm_window_deregister.ok_or_else(|| self.missing("ncclCommWindowDeregister"))?;
        // SAFETY: `win` came from window_register on this communicator and is deregistered once (moved in).
        let st = unsafe { f(self.live()?, win.0) };
        self.status("ncclCommWindowDeregister", st)
    }

    fn missing(&self, symbol: &str) -> Error {
        missing_symbol(&self.lib, symbol)
    }

    /// `ncclCommSplit`: the ranks that pass the same `color` form a new communicator, ranked by `(key, rank
    /// here)`; a rank that passes `None` (`NCCL_SPLIT_NOCOLOR`) gets `Ok(None)`. Collective over this
    /// communicator; blocking (the default configuration). A library without the symbol (NCCL < 2.18) is refused
    /// with [`Error::Unsupported`] naming it, before anything is called. `color` and `key` must fit a
    /// non-negative `int`.
    pub fn split(&self, color: Option<u32>, key: u32) -> Result<Option<CclComm>> {
        let f = self.lib.table().optional.comm_split.ok_or_else(|| self.missing("ncclCommSplit"))?;
        let max = i32::MAX as u64;
        let c = match color {
            None => sys::NCCL_SPLIT_NOCOLOR,
            Some(c) => c_int::try_from(c).map_err(|_| InvalidArgument::OutOfRange {
                what: "split color",
                value: c.into(),
                min: 0,
                max,
            })?,
        };
        let k = c_int::try_from(key).map_err(|_| InvalidArgument::OutOfRange {
            what: "split key",
            value: key.into(),
            min: 0,
            max,
        })?;
        let mut new: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `f` is the library's ncclCommSplit; the communicator is live, the library writes one handle
        // through the valid pointer, and a null configuration asks for the default (blocking) one.
        let st = unsafe { f(self.live()?, c, k, &mut new, std::ptr::null_mut()) };
        self.status("ncclCommSplit", st)?;
        match (color, new.is_null()) {
            (Some(_), false) => Ok(Some(CclComm { lib: self.lib.clone(), comm: new, borrowed: false })),
            (None, true) => Ok(None),
            (Some(c), true) => Err(Error::backend(
                backend_name(&self.lib),
                "ncclCommSplit",
                None,
                format!("returned success but no communicator for color {c}"),
            )),
            (None, false) => {
                // Not what NCCL documents; own the handle so it is destroyed, not leaked.
                drop(CclComm { lib: self.lib.clone(), comm: new, borrowed: false });
                Ok(None)
            }
        }
    }
}

/// A registered symmetric window (`ncclWindow_t`).
#[derive(Debug)]
pub struct Window(sys::ncclWindow_t);

// SAFETY: a window handle is an opaque token NCCL accepts from any thread.
unsafe impl Send for Window {}

impl Window {
    /// The raw `ncclWindow_t`, for deregistration outside [`CclComm::window_deregister`] (the caller then owns
    /// deregistering it exactly once).
    pub fn into_raw(self) -> sys::ncclWindow_t {
        self.0
    }
}

fn missing_symbol(lib: &CclLibrary, symbol: &str) -> Error {
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

/// `ncclMemAlloc`: device memory suitable for windows and registration. Not while a stream is capturing.
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

/// `ncclCommInitAll`: one communicator per device of this process (index = rank).
pub fn init_all(lib: &Arc<CclLibrary>, devices: &[i32]) -> Result<Vec<CclComm>> {
    let f = lib.table().optional.comm_init_all.ok_or_else(|| missing_symbol(lib, "ncclCommInitAll"))?;
    let n = c_int::try_from(devices.len()).map_err(|_| InvalidArgument::BadWorld("too many devices".into()))?;
    if n == 0 {
        return Err(InvalidArgument::BadWorld("no devices".into()).into());
    }
    let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); devices.len()];
    // SAFETY: NCCL writes `n` handles into the array of `n` and reads `n` device ordinals.
    let st = unsafe { f(comms.as_mut_ptr(), n, devices.as_ptr()) };
    check(lib, "ncclCommInitAll", st, std::ptr::null_mut())?;
    Ok(comms.into_iter().map(|comm| CclComm { lib: lib.clone(), comm, borrowed: false }).collect())
}

impl CclComm {
    /// `ncclCommAbort`: tears the communicator down without waiting for peers (after a peer failed).
    pub fn abort(mut self) -> Result<()> {
        self.abort_in_place()
    }

    /// `ncclCommDestroy` here and now, with its status (dropping the value does the same and logs a failure).
    /// An aborted communicator has nothing left to destroy: `Ok`.
    pub fn destroy(mut self) -> Result<()> {
        self.destroy_in_place()
    }

    fn destroy_in_place(&mut self) -> Result<()> {
        if self.comm.is_null() {
            // Aborted (or destroyed): the library has freed it already.
            return Ok(());
        }
        let comm = std::mem::replace(&mut self.comm, std::ptr::null_mut());
        if self.borrowed {
            // Its owner destroys it.
            return Ok(());
        }
        // SAFETY: `comm` was live and is destroyed exactly once (the field is null from now on).
        let status = unsafe { (self.lib.table().required.comm_destroy)(comm) };
        check(&self.lib, "ncclCommDestroy", status, std::ptr::null_mut())
    }

    /// Moves the communicator out of `self` into a new value, leaving `self` holding nothing to destroy: for an
    /// owner that tears it down on another thread while `self` is dropped here.
    pub(crate) fn take(&mut self) -> CclComm {
        CclComm {
            lib: self.lib.clone(),
            comm: std::mem::replace(&mut self.comm, std::ptr::null_mut()),
            borrowed: self.borrowed,
        }
    }

    /// `ncclCommDestroy` on a thread of its own (named `anyccl-ccl-destroy`), returning at once: NCCL's destroy
    /// took about 500 ms on an H200 (world 1, NCCL 2.28.3). The [`Teardown`] reports when it has returned, and its
    /// status. See [`CclComm::close_in_background_with`].
    pub fn close_in_background(self) -> Teardown {
        self.close_in_background_with(())
    }

    /// [`CclComm::close_in_background`], and then `keep` is dropped on the same thread, after the destroy: what a
    /// backend tears down after the communicator, as its plain drop does (device buffers, the device context).
    ///
    /// The thread holds the library (an `Arc` of it), so it stays loaded until the destroy has returned. At a
    /// normal process exit, the exit handler this registers (once per process) waits up to
    /// [`EXIT_WAIT_LIMIT`] for every destroy still running, so the vendor libraries' own exit handlers do not run
    /// under it; after a crash, a kill or that limit, the operating system reclaims what is left with the process.
    /// An aborted communicator has nothing to destroy: the teardown has finished on return (after dropping
    /// `keep`).
    pub fn close_in_background_with<K: Send + 'static>(self, keep: K) -> Teardown {
        if self.comm.is_null() {
            drop(keep);
            return Teardown::finished(Ok(()));
        }
        wait_for_destroys_at_exit();
        // The closure owns the communicator: even unrun, dropping it would destroy it, never leak it.
        Teardown::spawn("anyccl-ccl-destroy", move || {
            let r = self.destroy();
            drop(keep);
            if let Err(e) = &r {
                tracing::warn!(error = %e, "destroying a communicator in the background failed");
            }
            r
        })
    }
}

/// How long a normal process exit waits for communicators still being destroyed in the background
/// ([`CclComm::close_in_background`]) before it goes on.
pub const EXIT_WAIT_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Registers, once per process, an exit handler that waits for background teardowns
/// ([`anyccl_core::teardown::wait_for_pending`], at most [`EXIT_WAIT_LIMIT`]). It is registered after NCCL and the
/// CUDA runtime were loaded and initialised (a communicator exists), and exit handlers run in reverse order, so it
/// runs before theirs: a destroy still running is not cut off by the library's own teardown at exit.
fn wait_for_destroys_at_exit() {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    extern "C" fn at_exit() {
        // Touches no thread-local state (gone by now on the exiting thread) and cannot panic.
        let _ = anyccl_core::teardown::wait_for_pending(EXIT_WAIT_LIMIT);
    }
    REGISTERED.call_once(|| {
        // SAFETY: registers a plain function without arguments. The C library ties it to the module it is linked
        // into and runs it at exit, or earlier if that module is unloaded, so it never outlives its code.
        if unsafe { libc::atexit(at_exit) } != 0 {
            tracing::warn!("could not register the exit handler that waits for background communicator teardowns");
        }
    });
}

impl Drop for CclComm {
    fn drop(&mut self) {
        if let Err(e) = self.destroy_in_place() {
            tracing::warn!(error = %e, "destroying a communicator failed");
        }
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
