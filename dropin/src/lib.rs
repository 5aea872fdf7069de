//! A drop-in `libnccl`: the whole `nccl.h` API of NCCL 2.32.3 and the device API's host functions the real library
//! exports (`nccl_device/host.h`), with their `pnccl*` profiling aliases, as a C library, `libanyccl_nccl.so`
//! (SONAME `libnccl.so.2`), that forwards every call to the real NCCL (or RCCL) anyccl's library search finds.
//! Every function is listed once, in [`table`], which generates the exports.
//!
//! - **Loading**: lazily, once per process, at the first call (thread-safe, [`std::sync::OnceLock`]); see
//!   [`load`] for the search and how the drop-in never loads itself. Every entry point is resolved then, with
//!   `dlsym` on the library's own handle; no symbol is looked up afterwards (so never during graph capture).
//! - **Forwarding**: arguments, results and error codes pass through untouched; `ncclGetVersion` reports the
//!   underlying version and `ncclGetErrorString` forwards. The per-call config forms of NCCL 2.31 and later
//!   (`ncclAllReduceConfig`, …) are handled like their plain forms: `ncclAllReduceConfig` with a null config (the
//!   plain call, as `nccl.h` defines it) or with one that asks for nothing beyond the plain call goes through
//!   anyccl's all-reduce below; a config that names an algorithm or sets anything else only the library honours
//!   (or one the library refuses) is forwarded untouched ([`coll_config`]). The other `*Config` calls forward, as
//!   their plain forms do.
//! - **Handles checked** ([`handles`]): a communicator handle the drop-in did not create, or one already destroyed
//!   or aborted, is answered with `ncclInvalidArgument` (4) and a text naming the function and the handle; nothing
//!   is forwarded, so a garbage, freed or destroyed handle never crashes the process.
//! - **Failures of its own**: with no library underneath every call returns `ncclSystemError` (2): finding and
//!   loading an external library is a system failure in `nccl.h`'s terms (`ncclSystemError` is "a system call or
//!   external library call failed"), and nothing the caller changes in the call fixes it. A function the underlying
//!   library does not export (an older NCCL; RCCL 7.0 without `ncclCommWindowRegister`) returns `ncclInvalidUsage`
//!   (5): the program asked for something this installation does not offer, as NCCL answers a feature that is
//!   turned off; it is never called through a null pointer. A panic inside the drop-in is caught at the boundary and
//!   returns `ncclInternalError` (3). In each case `ncclGetLastError` on that thread returns the drop-in's text
//!   (naming the function, the library's path and version, or every place tried) until a later call is forwarded;
//!   otherwise it forwards too. The text stays readable for the life of the process, as NCCL's does
//!   ([`last_error`]).
//! - **Logging**: `ANYCCL_LOG=debug` logs each collective and group call with its arguments and what was chosen
//!   (see [`logging`]).
//! - **Proof of interposition**: [`anyccl_nccl_dropin_calls`] counts the collective and point-to-point calls
//!   forwarded, so a program that preloads the drop-in (PyTorch) can check that its calls really went through it.
//! - **anyccl's all-reduce** ([`accel`]): for communicators created through the drop-in, `ncclAllReduce` asks
//!   anyccl's selector ([`dispatch_all_reduce`]); eligible same-node calls run anyccl's custom one-shot / two-shot
//!   kernels (CUDA over NCCL, HIP over RCCL), set up lazily and collectively over the communicator itself at the
//!   first eligible call outside capture; everything else is forwarded. That setup (device buffers, IPC mappings,
//!   the kernels' module) is the only device memory the drop-in allocates, never during capture, and it is
//!   released before the caller's `ncclCommDestroy`/`ncclCommAbort`/`ncclCommFinalize` is forwarded.
//!   `ANYCCL_DISABLE=custom-kernels` turns it off; [`anyccl_nccl_dropin_custom_calls`] counts the calls it ran.
#![deny(unsafe_op_in_unsafe_fn)]

use std::ffi::{c_char, c_int, c_void};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

pub mod accel;
pub mod agree;
pub mod api;
pub mod coll_config;
pub mod handles;
pub mod last_error;
pub mod load;
pub mod logging;
pub mod table;

use api::{Api, CollConfig, Comm, DataTypeName, NcclResult, RedOpName, Stream};
use last_error::Failure;
use load::{State, Underlying};

static STATE: OnceLock<State> = OnceLock::new();

thread_local! {
    static LOADING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Set by [`anyccl_nccl_dropin_no_log_subscriber`]: the program logs for itself.
static NO_LOG_SUBSCRIBER: AtomicBool = AtomicBool::new(false);

/// The library underneath, loaded at the first call; `Err` says why there is none. The first call also installs
/// the drop-in's log subscriber when `ANYCCL_LOG` asks for one ([`logging`]), unless the program asked for none first ([`anyccl_nccl_dropin_no_log_subscriber`]).
pub fn underlying() -> Result<&'static Underlying, &'static str> {
    static LOGGING: std::sync::Once = std::sync::Once::new();
    LOGGING.call_once(|| {
        if !NO_LOG_SUBSCRIBER.load(Ordering::Relaxed) {
            logging::init();
        }
    });
    load_underlying()
}

fn load_underlying() -> Result<&'static Underlying, &'static str> {
    let state = match STATE.get() {
        Some(s) => s,
        None => {
            // A call back into the drop-in from inside the load (a library initialiser calling an nccl.h function
            // that resolves to us) would wait for itself: it fails instead.
            if LOADING.try_with(|l| l.replace(true)).unwrap_or(true) {
                return Err("the anyccl drop-in NCCL was called again while it was loading the library underneath");
            }
            // Cleared however the load ends (a panic in it leaves the cell empty for a later call to retry).
            struct Loading;
            impl Drop for Loading {
                fn drop(&mut self) {
                    let _ = LOADING.try_with(|l| l.set(false));
                }
            }
            let _loading = Loading;
            STATE.get_or_init(load::load)
        }
    };
    match state {
        State::Loaded(u) => Ok(u),
        State::Missing(why) => Err(why),
    }
}

/// The entry point `pick` chooses, or the drop-in's own failure for `name`.
#[inline]
pub(crate) fn entry<F>(name: &str, pick: impl FnOnce(&Api) -> Option<F>) -> Result<(F, &'static Underlying), Failure> {
    match underlying() {
        Ok(u) => match pick(&u.api) {
            Some(f) => Ok((f, u)),
            None => Err(missing(name, u)),
        },
        Err(why) => Err(Failure { code: api::NCCL_SYSTEM_ERROR, message: format!("{name}: {why}") }),
    }
}

fn missing(name: &str, u: &Underlying) -> Failure {
    Failure {
        code: api::NCCL_INVALID_USAGE,
        message: format!(
            "{name} is not available: the library under the anyccl drop-in NCCL, {} ({}), does not export it (the \
             drop-in implements nccl.h {}); nothing was called",
            u.library.path().display(),
            u.library.describe(),
            api::NCCL_H_VERSION
        ),
    }
}

/// Runs `body` for the export `name` with panics caught: its result code, or the drop-in's own failure recorded
/// for `ncclGetLastError`.
#[inline]
pub(crate) fn guarded(name: &'static str, body: impl FnOnce() -> Result<NcclResult, Failure>) -> NcclResult {
    // AssertUnwindSafe: after a panic nothing `body` touched is used again; the call only reports the failure.
    match std::panic::catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(code)) => {
            last_error::forwarded();
            code
        }
        Ok(Err(f)) => last_error::record(f),
        Err(_) => last_error::record(Failure {
            code: api::NCCL_INTERNAL_ERROR,
            message: format!("{name}: internal error in the anyccl drop-in NCCL (a panic, caught)"),
        }),
    }
}

/// As [`guarded`], for a function that returns something other than a result code: `default` when the drop-in
/// failed the call itself (the reason recorded for `ncclGetLastError`).
#[inline]
pub(crate) fn guarded_value<T>(name: &'static str, default: T, body: impl FnOnce() -> Result<T, Failure>) -> T {
    // AssertUnwindSafe: after a panic nothing `body` touched is used again; the call only reports the failure.
    match std::panic::catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(value)) => {
            last_error::forwarded();
            value
        }
        Ok(Err(f)) => {
            last_error::record(f);
            default
        }
        Err(_) => {
            last_error::record(Failure {
                code: api::NCCL_INTERNAL_ERROR,
                message: format!("{name}: internal error in the anyccl drop-in NCCL (a panic, caught)"),
            });
            default
        }
    }
}

/// Marks this library as an anyccl drop-in: a library search that finds this symbol in a candidate never
/// forwards to it (see [`load`]). Returns 1, the version of this marker.
#[no_mangle]
pub extern "C" fn anyccl_nccl_dropin_marker() -> c_int {
    1
}

/// Collective and point-to-point calls forwarded so far (see [`anyccl_nccl_dropin_calls`]).
static CALLS: AtomicU64 = AtomicU64::new(0);

#[inline]
pub(crate) fn count_collective() {
    // Relaxed: a statistic read by a program that wants to know its calls went through the drop-in; it orders
    // nothing else.
    CALLS.fetch_add(1, Ordering::Relaxed);
}

/// How many collective and point-to-point calls (`ncclAllReduce`, `ncclReduce`, `ncclBcast`, `ncclBroadcast`,
/// `ncclReduceScatter`, `ncclAllGather`, `ncclAlltoAll`, `ncclGather`, `ncclScatter`, `ncclSend`, `ncclRecv`, their
/// `*Config` forms, `ncclPutSignal`, `ncclSignal`, `ncclWaitSignal` and their `pnccl*` names) this process has made through the drop-in that reached the library underneath (or, for
/// `ncclAllReduce`, ran on anyccl's own kernels: [`anyccl_nccl_dropin_custom_calls`]), from any thread, whatever
/// the answer. A program that preloads the drop-in reads it to prove its calls were interposed
/// (a program linked to NCCL statically, or one that bypasses the global symbol scope, leaves it at 0). Calls the
/// drop-in answers itself (no library; a caught panic) are not counted.
#[no_mangle]
pub extern "C" fn anyccl_nccl_dropin_calls() -> u64 {
    CALLS.load(Ordering::Relaxed)
}

/// How many `ncclAllReduce` calls (and `pncclAllReduce`, `ncclAllReduceConfig`, `pncclAllReduceConfig`) this
/// process has run on anyccl's own custom kernels instead of the library underneath (those are counted by
/// [`anyccl_nccl_dropin_calls`] too).
#[no_mangle]
pub extern "C" fn anyccl_nccl_dropin_custom_calls() -> u64 {
    accel::CUSTOM_CALLS.load(Ordering::Relaxed)
}

/// After a call that created a communicator at `out` (`ncclCommInitRank`, `ncclCommSplit`, …) returned `rc`:
/// anyccl's state for it, after the agreement round over it (see [`accel::register`]). A non-blocking communicator
/// is registered off without a round: NCCL's (and RCCL's) init, split and shrink of one always return
/// `ncclInProgress` (the work runs on a thread of the library's), never `ncclSuccess`.
pub(crate) fn register_out(rc: NcclResult, u: &'static Underlying, out: *mut Comm) {
    if out.is_null() || (rc != api::NCCL_SUCCESS && rc != api::NCCL_IN_PROGRESS) {
        return;
    }
    // SAFETY: the library returned success (or in-progress, which writes the handle too) through the caller's
    // valid pointer.
    let comm = unsafe { *out };
    handles::created(comm);
    if rc == api::NCCL_IN_PROGRESS {
        accel::register_off_nonblocking(comm);
    } else {
        accel::register(&u.library, &u.api, comm);
    }
}

/// Asks the drop-in to install no log subscriber of its own: the calling program logs for itself and has read
/// `ANYCCL_LOG` already (`anyccl probe` calls this before anything else, so a bad value is warned about once). Acts
/// only before the drop-in's first call that loads the library underneath.
#[no_mangle]
pub extern "C" fn anyccl_nccl_dropin_no_log_subscriber() {
    // Relaxed: read by the first loading call, on this thread in the one caller there is (`anyccl probe`), or on
    // another after this returned; a late read only means the subscriber is installed as before.
    NO_LOG_SUBSCRIBER.store(true, Ordering::Relaxed);
}

/// What the drop-in forwards to: `"NCCL 2.32.3 /path/libnccl.so.2"`, or an empty string when it found nothing
/// (then `ncclGetLastError` says why). Loads the library if no call has yet. The text lives as long as the process.
#[no_mangle]
pub extern "C" fn anyccl_nccl_dropin_underlying() -> *const c_char {
    match std::panic::catch_unwind(underlying) {
        Ok(Ok(u)) => u.description.as_ptr(),
        _ => c"".as_ptr(),
    }
}

/// The arguments of one `ncclAllReduce` call.
#[derive(Debug, Clone, Copy)]
pub struct AllReduceCall {
    /// `sendbuff`.
    pub sendbuff: *const c_void,
    /// `recvbuff`.
    pub recvbuff: *mut c_void,
    /// `count` (elements).
    pub count: usize,
    /// `datatype` (`ncclDataType_t`).
    pub datatype: c_int,
    /// `op` (`ncclRedOp_t`).
    pub op: c_int,
    /// `comm`.
    pub comm: Comm,
    /// `stream`.
    pub stream: Stream,
}

/// The one place `ncclAllReduce` is decided: anyccl's selector ([`accel`]) runs eligible calls of communicators
/// created through the drop-in on the custom one-shot / two-shot kernels; everything else goes to the underlying
/// library untouched through `forward` (its result code is returned as it is). `Err`: anyccl failed the call itself.
///
/// # Safety
/// `call` holds what `nccl.h` requires of `ncclAllReduce`'s arguments; `forward` makes the caller's call (with
/// `call`'s arguments, untouched) to the underlying library.
#[inline]
pub unsafe fn dispatch_all_reduce(
    function: &'static str,
    call: AllReduceCall,
    forward: impl FnOnce(&AllReduceCall) -> NcclResult,
) -> Result<NcclResult, Failure> {
    if !accel::any_registered() {
        // The path of every call before any communicator was created through the drop-in: as cheap as forwarding.
        tracing::debug!(
            function,
            count = call.count,
            dtype = %DataTypeName(call.datatype),
            op = %RedOpName(call.op),
            comm = ?call.comm,
            stream = ?call.stream,
            choice = "ccl",
            why = "no communicator was created through the drop-in",
            "forwarded"
        );
        return Ok(forward(&call));
    }
    let log = |choice: &str, why: &dyn std::fmt::Display, what: &str| {
        tracing::debug!(
            function,
            count = call.count,
            dtype = %DataTypeName(call.datatype),
            op = %RedOpName(call.op),
            comm = ?call.comm,
            stream = ?call.stream,
            choice,
            why = %why,
            "{what}"
        );
    };
    match accel::all_reduce(&call) {
        accel::Outcome::Forward(why) => {
            log("ccl", &why, "forwarded");
            Ok(forward(&call))
        }
        accel::Outcome::Ran(algorithm, why) => {
            log(&algorithm.to_string(), &why, "anyccl");
            Ok(api::NCCL_SUCCESS)
        }
        accel::Outcome::Failed(failure) => {
            log("none", &failure.message, "failed");
            // Named after the function the caller called (ncclAllReduce, ncclAllReduceConfig or an alias).
            Err(Failure { code: failure.code, message: format!("{function}: {}", failure.message) })
        }
    }
}

fn all_reduce(function: &'static str, call: AllReduceCall) -> NcclResult {
    guarded("ncclAllReduce", || {
        let (f, _u) = entry("ncclAllReduce", |a| a.ncclAllReduce)?;
        handles::check(function, "comm", call.comm)?;
        count_collective();
        let forward = |c: &AllReduceCall| {
            // SAFETY: `f` is the underlying ncclAllReduce; the arguments are the caller's.
            unsafe { f(c.sendbuff, c.recvbuff, c.count, c.datatype, c.op, c.comm, c.stream) }
        };
        // SAFETY: the caller's arguments, as nccl.h requires them; `forward` is the underlying ncclAllReduce with
        // those arguments.
        unsafe { dispatch_all_reduce(function, call, forward) }
    })
}

/// `ncclAllReduceConfig` (NCCL 2.31 and later), handled like its plain form: a null config (the plain call, as
/// `nccl.h` defines it) or one that asks for nothing beyond it ([`coll_config::Asks::Nothing`]: every field at its
/// `NCCL_COLLCONFIG_INITIALIZER` value) is decided in [`dispatch_all_reduce`] like `ncclAllReduce`; a config that
/// asks for something only the library honours (an algorithm by name, CTA counts, a launch event, a profiler tag),
/// or one the library refuses itself (bad magic, too small), is forwarded. Whatever is forwarded is the caller's
/// `ncclAllReduceConfig` call, config included, untouched.
fn all_reduce_config(function: &'static str, call: AllReduceCall, config: CollConfig) -> NcclResult {
    guarded("ncclAllReduceConfig", || {
        let (with_config, _u) = entry("ncclAllReduceConfig", |a| a.ncclAllReduceConfig)?;
        handles::check(function, "comm", call.comm)?;
        count_collective();
        let forward = |c: &AllReduceCall| {
            // SAFETY: the library's own ncclAllReduceConfig with the caller's arguments and config, untouched.
            unsafe { with_config(c.sendbuff, c.recvbuff, c.count, c.datatype, c.op, c.comm, c.stream, config) }
        };
        let asks = if config.is_null() {
            coll_config::Asks::Nothing
        } else {
            // SAFETY: nccl.h's contract for a non-null config: an ncclCollConfig_t made with
            // NCCL_COLLCONFIG_INITIALIZER, readable within its declared size.
            unsafe { coll_config::read(config) }
        };
        if asks == coll_config::Asks::Nothing {
            // SAFETY: the caller's arguments, as nccl.h requires them; `forward` makes the caller's own call.
            return unsafe { dispatch_all_reduce(function, call, forward) };
        }
        tracing::debug!(
            function,
            count = call.count,
            dtype = %DataTypeName(call.datatype),
            op = %RedOpName(call.op),
            comm = ?call.comm,
            stream = ?call.stream,
            ?config,
            choice = "ccl",
            why = %asks,
            "forwarded"
        );
        Ok(forward(&call))
    })
}

/// `ncclAllReduceConfig` of `nccl.h`: with a null config, or one that asks for nothing beyond the plain call,
/// decided in [`dispatch_all_reduce`] like [`ncclAllReduce`]; with a config that asks for more (or one the library
/// refuses), forwarded untouched (see [`coll_config`]).
///
/// # Safety
/// The arguments must be what `nccl.h` requires of `ncclAllReduceConfig`.
#[no_mangle]
#[allow(clippy::too_many_arguments)] // nccl.h's signature
pub unsafe extern "C" fn ncclAllReduceConfig(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    comm: Comm,
    stream: Stream,
    config: CollConfig,
) -> NcclResult {
    let call = AllReduceCall { sendbuff, recvbuff, count, datatype, op, comm, stream };
    all_reduce_config("ncclAllReduceConfig", call, config)
}

/// `pncclAllReduceConfig`: the profiling alias of [`ncclAllReduceConfig`].
///
/// # Safety
/// As for [`ncclAllReduceConfig`].
#[no_mangle]
#[allow(clippy::too_many_arguments)] // nccl.h's signature
pub unsafe extern "C" fn pncclAllReduceConfig(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    comm: Comm,
    stream: Stream,
    config: CollConfig,
) -> NcclResult {
    let call = AllReduceCall { sendbuff, recvbuff, count, datatype, op, comm, stream };
    all_reduce_config("pncclAllReduceConfig", call, config)
}

/// `ncclAllReduce` of `nccl.h`, decided in [`dispatch_all_reduce`].
///
/// # Safety
/// The arguments must be what `nccl.h` requires of `ncclAllReduce`.
#[no_mangle]
pub unsafe extern "C" fn ncclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    comm: Comm,
    stream: Stream,
) -> NcclResult {
    all_reduce("ncclAllReduce", AllReduceCall { sendbuff, recvbuff, count, datatype, op, comm, stream })
}

/// `pncclAllReduce`: the profiling alias of [`ncclAllReduce`].
///
/// # Safety
/// As for [`ncclAllReduce`].
#[no_mangle]
pub unsafe extern "C" fn pncclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    comm: Comm,
    stream: Stream,
) -> NcclResult {
    all_reduce("pncclAllReduce", AllReduceCall { sendbuff, recvbuff, count, datatype, op, comm, stream })
}

fn error_string(code: NcclResult) -> *const c_char {
    let forwarded = std::panic::catch_unwind(|| match underlying() {
        // SAFETY: the library's own ncclGetErrorString; it takes any int and returns a static string.
        Ok(u) => u.api.ncclGetErrorString.map(|f| unsafe { f(code) }),
        Err(_) => None,
    });
    match forwarded {
        Ok(Some(p)) => p,
        _ => api::own_error_string(code).as_ptr(),
    }
}

/// `ncclGetErrorString` of `nccl.h`: the underlying library's text; the drop-in's own only when there is no library.
/// Does not change what `ncclGetLastError` reports.
#[no_mangle]
pub extern "C" fn ncclGetErrorString(result: NcclResult) -> *const c_char {
    error_string(result)
}

/// `pncclGetErrorString`: the profiling alias of [`ncclGetErrorString`].
#[no_mangle]
pub extern "C" fn pncclGetErrorString(result: NcclResult) -> *const c_char {
    error_string(result)
}

fn last_error_text(comm: Comm) -> *const c_char {
    let answer = std::panic::catch_unwind(|| {
        if let Some(own) = last_error::own() {
            return own;
        }
        match underlying() {
            Ok(u) => match u.api.ncclGetLastError {
                // A handle the drop-in does not hold is not passed on (NCCL's answer does not depend on it).
                // SAFETY: the library's own ncclGetLastError with a live communicator or null, as nccl.h allows.
                Some(f) => unsafe { f(if handles::is_live(comm) { comm } else { std::ptr::null_mut() }) },
                None => last_error::answer(&missing("ncclGetLastError", u).message),
            },
            Err(why) => last_error::answer(why),
        }
    });
    answer.unwrap_or(c"anyccl drop-in NCCL: internal error (a panic, caught) in ncclGetLastError".as_ptr())
}

/// `ncclGetLastError` of `nccl.h`: the drop-in's own text when it failed the last call on this thread itself
/// (valid for the life of the process, like NCCL's; see [`last_error`]), else the underlying library's.
///
/// # Safety
/// None beyond `nccl.h`'s: any `comm` is accepted (one the drop-in does not hold is not passed on).
#[no_mangle]
pub unsafe extern "C" fn ncclGetLastError(comm: Comm) -> *const c_char {
    last_error_text(comm)
}

/// `pncclGetLastError`: the profiling alias of [`ncclGetLastError`].
///
/// # Safety
/// As for [`ncclGetLastError`].
#[no_mangle]
pub unsafe extern "C" fn pncclGetLastError(comm: Comm) -> *const c_char {
    last_error_text(comm)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_internal_error_with_a_text_and_a_forwarded_call_clears_it() {
        let _serial = last_error::tests::serial();
        let code = guarded("ncclTestPanic", || panic!("a test panic"));
        assert_eq!(code, api::NCCL_INTERNAL_ERROR);
        // SAFETY: `own` returns this thread's live message.
        let text = last_error::own().map(|p| unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned());
        assert_eq!(text.as_deref(), Some("ncclTestPanic: internal error in the anyccl drop-in NCCL (a panic, caught)"));
        assert_eq!(guarded("ncclTestOk", || Ok(7)), 7);
        assert!(last_error::own().is_none());
    }
}
