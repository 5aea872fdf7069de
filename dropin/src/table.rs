//! Every function of `nccl.h` 2.32.3 and of the device API's host side (`nccl_device/host.h`, the functions the
//! real 2.32.3 library exports), listed once: this one table generates the underlying library's entry points
//! ([`Api`]), the lists of names ([`NCCL_H_FUNCTIONS`], [`DEVICE_HOST_FUNCTIONS`]) and each export with its `pnccl*`
//! alias.
//!
//! **Adding a release** is one line per new function, in header order, in the list of its header: its name and
//! alias, its C signature in the types of [`crate::api`], and what the drop-in does with it:
//! - `forward`: passed on untouched; `collective`: the same, and counted by [`crate::anyccl_nccl_dropin_calls`];
//! - `check [comm, …]`: those arguments are communicator handles, checked against the communicators the drop-in
//!   created ([`crate::handles`]) before anything is forwarded; `take [comm]`: checked and forgotten (destroy,
//!   abort);
//! - `log { … }`: the fields of the `ANYCCL_LOG=debug` line; `before { … }`: run before forwarding (after the
//!   checks); `after |rc, u| { … }`: run with the library's answer (a communicator it created is registered there);
//! - `void`: a function returning nothing, forwarded (a failure of the drop-in's is left for `ncclGetLastError`);
//! - `value (DEFAULT)`: a function returning something other than `ncclResult_t` (a team, a rank, a count),
//!   forwarded; when the drop-in cannot forward it returns `DEFAULT` and leaves the reason for `ncclGetLastError`
//!   (it takes `check [comm]` too);
//! - `custom`: written by hand in `lib.rs` (the table still resolves its entry point and lists its name).
//!
//! Then `tests/nccl-2.32.3-functions.txt` and `tests/nccl-2.32.3-device-host-functions.txt` (the lists, which the
//! tests compare with this table, with the real header and with the real library's exports) are renamed and
//! regenerated, and [`crate::api::NCCL_H_VERSION`] follows. A function the loaded library does not export answers
//! `ncclInvalidUsage` with a text naming it.
//!
//! The device API's host functions are forwarded untouched (the structures they fill are the library's; a
//! communicator handle among their arguments is checked like any other). `ncclCftBarrierCreateRequirement`, which
//! `nccl_device/host.h` 2.32.3 declares but the library does not export, is not exported either; the Windows-only
//! declarations `ncclGinOutboxCreateRequirement` and `ncclGinInboxA2ACreateRequirement` are, because the Linux
//! library exports them.

use std::ffi::{c_char, c_int, c_uint, c_void};

use crate::api::{
    CollConfig, Comm, Config, DataTypeName, MultimemHandle, NcclResult, ParamHandle, RedOpName, SimInfo, Stream, Team,
    UniqueId, Window,
};
use crate::{accel, api, count_collective, entry, guarded, guarded_value, handles, register_out};

macro_rules! nccl_h {
    ($(
        $(#[$list_doc:meta])* $list:ident {
            $( $name:ident / $pname:ident ( $($arg:ident : $ty:ty),* $(,)? ) -> $ret:ty { $($how:tt)* } )*
        }
    )*) => {
        /// Every exported function, as the underlying library exports it (`None`: it does not).
        #[allow(non_snake_case)]
        #[derive(Debug, Clone, Copy, Default)]
        pub struct Api {
            $($(
                #[doc = concat!("`", stringify!($name), "`.")]
                pub $name: Option<unsafe extern "C" fn($($ty),*) -> $ret>,
            )*)*
        }

        $(
            $(#[$list_doc])*
            pub const $list: &[&str] = &[$(stringify!($name)),*];
        )*

        impl Api {
            /// Resolves every entry point through `lookup` (null: not exported), once.
            pub(crate) fn resolve(lookup: &mut dyn FnMut(&std::ffi::CStr) -> *const c_void) -> Api {
                Api {
                    $($(
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
                                // name (the loader checked it is a function in that library's own code); the
                                // target type is the signature its header declares for it, the same in every NCCL and
                                // RCCL release that exports it.
                                Some(unsafe {
                                    std::mem::transmute::<*const c_void, unsafe extern "C" fn($($ty),*) -> $ret>(p)
                                })
                            }
                        },
                    )*)*
                }
            }
        }

        $($( export! { $name / $pname ( $($arg : $ty),* ) -> $ret ; $($how)* } )*)*
    };
}

macro_rules! export {
    ($name:ident / $pname:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty ; custom) => {};
    ($name:ident / $pname:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty ; void) => {
        export!(@void $name, $name, concat!("`", stringify!($name), "` of `nccl.h`, forwarded (it returns nothing: \
            a failure of the drop-in's own is left for `ncclGetLastError`)."), ($($arg : $ty),*));
        export!(@void $name, $pname, concat!("`", stringify!($pname), "`: the profiling alias of [`",
            stringify!($name), "`]."), ($($arg : $ty),*));
    };
    (@void $name:ident, $export:ident, $doc:expr, ($($arg:ident : $ty:ty),*)) => {
        #[doc = $doc]
        ///
        /// # Safety
        /// The arguments must be what `nccl.h` requires of this function; they are passed on untouched.
        #[no_mangle]
        pub unsafe extern "C" fn $export($($arg: $ty),*) {
            let _ = guarded(stringify!($export), || {
                let (f, _u) = entry(stringify!($name), |a| a.$name)?;
                // SAFETY: `f` is the underlying library's own entry point of this name, with nccl.h's signature.
                unsafe { f($($arg),*) };
                Ok(api::NCCL_SUCCESS)
            });
        }
    };
    ($name:ident / $pname:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty ; value ($default:expr)
        $(check [$($c:ident),*])?) => {
        export!(@value $name, $name, concat!("`", stringify!($name), "` of the device API's host side, forwarded (when \
            the drop-in cannot forward it, it returns a default and leaves the reason for `ncclGetLastError`)."),
            $ret, $default, ($($arg : $ty),*) $(check [$($c),*])?);
        export!(@value $name, $pname, concat!("`", stringify!($pname), "`: the profiling alias of [`",
            stringify!($name), "`]."), $ret, $default, ($($arg : $ty),*) $(check [$($c),*])?);
    };
    (@value $name:ident, $export:ident, $doc:expr, $ret:ty, $default:expr, ($($arg:ident : $ty:ty),*)
        $(check [$($c:ident),*])?) => {
        #[doc = $doc]
        ///
        /// # Safety
        /// The arguments must be what the header requires of this function; they are passed on untouched (a
        /// communicator handle the drop-in does not hold is refused first).
        #[no_mangle]
        pub unsafe extern "C" fn $export($($arg: $ty),*) -> $ret {
            guarded_value(stringify!($export), $default, || {
                let (f, _u) = entry(stringify!($name), |a| a.$name)?;
                $( $( handles::check(stringify!($export), stringify!($c), $c)?; )* )?
                // SAFETY: `f` is the underlying library's own entry point of this name, with its header's
                // signature; the caller's arguments are passed on as the caller's contract requires.
                Ok(unsafe { f($($arg),*) })
            })
        }
    };
    ($name:ident / $pname:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty ; $kind:ident
        $(check [$($c:ident),*])? $(take [$t:ident])? $(log { $($log:tt)* })?
        $(before { $($before:tt)* })? $(after |$rc:ident, $u:ident| { $($after:tt)* })?) => {
        export!(@one $kind, $name, $name,
            concat!("`", stringify!($name), "` of `nccl.h`, forwarded to the underlying library."),
            ($($arg : $ty),*) $(check [$($c),*])? $(take [$t])? $(log { $($log)* })?
            $(before { $($before)* })? $(after |$rc, $u| { $($after)* })?);
        export!(@one $kind, $name, $pname,
            concat!("`", stringify!($pname), "`: the profiling alias of [`", stringify!($name), "`]."),
            ($($arg : $ty),*) $(check [$($c),*])? $(take [$t])? $(log { $($log)* })?
            $(before { $($before)* })? $(after |$rc, $u| { $($after)* })?);
    };
    (@count collective) => { count_collective(); };
    (@count forward) => {};
    (@one $kind:ident, $name:ident, $export:ident, $doc:expr, ($($arg:ident : $ty:ty),*)
        $(check [$($c:ident),*])? $(take [$t:ident])? $(log { $($log:tt)* })?
        $(before { $($before:tt)* })? $(after |$rc:ident, $u:ident| { $($after:tt)* })?) => {
        #[doc = $doc]
        ///
        /// # Safety
        /// The arguments must be what `nccl.h` requires of this function; they are passed on untouched (a
        /// communicator handle the drop-in does not hold is refused first).
        #[no_mangle]
        pub unsafe extern "C" fn $export($($arg: $ty),*) -> NcclResult {
            guarded(stringify!($export), || {
                let (f, _u) = entry(stringify!($name), |a| a.$name)?;
                $( $( handles::check(stringify!($export), stringify!($c), $c)?; )* )?
                $( handles::take(stringify!($export), stringify!($t), $t)?; )?
                // Before the log line: what the drop-in does first (releasing its state) is logged first.
                $( $($before)* )?
                $( tracing::debug!(function = stringify!($export), $($log)*); )?
                export!(@count $kind);
                // SAFETY: `f` is the underlying library's own entry point of this name, with nccl.h's signature;
                // the caller's arguments are passed on as the caller's contract with nccl.h requires.
                let rc = unsafe { f($($arg),*) };
                $( let ($rc, $u) = (rc, _u); { $($after)* }; )?
                Ok(rc)
            })
        }
    };
}

nccl_h! {
    /// The names of every function `nccl.h` 2.32.3 declares (without the `pnccl*` aliases), in header order.
    NCCL_H_FUNCTIONS {
    ncclMemAlloc / pncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> NcclResult {
        forward log { size, "forwarded" }
    }
    ncclMemFree / pncclMemFree(ptr: *mut c_void) -> NcclResult { forward log { ?ptr, "forwarded" } }
    ncclGetVersion / pncclGetVersion(version: *mut c_int) -> NcclResult { forward }
    ncclGetUniqueId / pncclGetUniqueId(unique_id: *mut UniqueId) -> NcclResult { forward log { "forwarded" } }
    ncclCommInitRankConfig / pncclCommInitRankConfig(
        comm: *mut Comm, nranks: c_int, comm_id: UniqueId, rank: c_int, config: Config
    ) -> NcclResult {
        forward log { nranks, rank, "forwarded" } after |rc, u| { register_out(rc, u, comm) }
    }
    ncclCommInitRank / pncclCommInitRank(comm: *mut Comm, nranks: c_int, comm_id: UniqueId, rank: c_int)
        -> NcclResult {
        forward log { nranks, rank, "forwarded" } after |rc, u| { register_out(rc, u, comm) }
    }
    ncclCommInitAll / pncclCommInitAll(comm: *mut Comm, ndev: c_int, devlist: *const c_int) -> NcclResult {
        forward log { ndev, "forwarded" }
        after |rc, _u| {
            if rc == api::NCCL_SUCCESS && !comm.is_null() {
                for i in 0..usize::try_from(ndev).unwrap_or(0) {
                    // SAFETY: the library returned success and wrote `ndev` communicators into the caller's array.
                    let c = unsafe { *comm.add(i) };
                    handles::created(c);
                    accel::register_off(c, "ncclCommInitAll: one thread drives every rank, and the custom kernels' \
                        setup needs every rank at once");
                }
            }
        }
    }
    ncclCommFinalize / pncclCommFinalize(comm: Comm) -> NcclResult {
        forward check [comm] log { ?comm, "forwarded" } before { accel::release(comm, false); }
    }
    ncclCommDestroy / pncclCommDestroy(comm: Comm) -> NcclResult {
        forward take [comm] log { ?comm, "forwarded" } before { accel::release(comm, false); }
    }
    ncclCommAbort / pncclCommAbort(comm: Comm) -> NcclResult {
        forward take [comm] log { ?comm, "forwarded" } before { accel::release(comm, true); }
    }
    ncclCommRevoke / pncclCommRevoke(comm: Comm, revoke_flags: c_int) -> NcclResult {
        forward check [comm] log { ?comm, revoke_flags, "forwarded" } before { accel::release(comm, true); }
    }
    ncclCommSplit / pncclCommSplit(comm: Comm, color: c_int, key: c_int, newcomm: *mut Comm, config: Config)
        -> NcclResult {
        forward check [comm] log { ?comm, color, key, "forwarded" } after |rc, u| { register_out(rc, u, newcomm) }
    }
    ncclCommShrink / pncclCommShrink(
        comm: Comm, exclude_ranks_list: *mut c_int, exclude_ranks_count: c_int, newcomm: *mut Comm,
        config: Config, shrink_flags: c_int
    ) -> NcclResult {
        forward check [comm] log { ?comm, exclude_ranks_count, shrink_flags, "forwarded" }
        after |rc, u| { register_out(rc, u, newcomm) }
    }
    ncclCommGetUniqueId / pncclCommGetUniqueId(comm: Comm, unique_id: *mut UniqueId) -> NcclResult {
        forward check [comm] log { ?comm, "forwarded" }
    }
    ncclCommGrow / pncclCommGrow(
        comm: Comm, nranks: c_int, unique_id: *const UniqueId, rank: c_int, newcomm: *mut Comm, config: Config
    ) -> NcclResult {
        forward check [comm] log { ?comm, nranks, rank, "forwarded" } after |rc, u| { register_out(rc, u, newcomm) }
    }
    ncclCommInitRankScalable / pncclCommInitRankScalable(
        newcomm: *mut Comm, nranks: c_int, myrank: c_int, n_id: c_int, comm_ids: *mut UniqueId, config: Config
    ) -> NcclResult {
        forward log { nranks, myrank, n_id, "forwarded" } after |rc, u| { register_out(rc, u, newcomm) }
    }
    ncclGetErrorString / pncclGetErrorString(result: NcclResult) -> *const c_char { custom }
    ncclGetLastError / pncclGetLastError(comm: Comm) -> *const c_char { custom }
    ncclResetDebugInit / pncclResetDebugInit() -> () { void }
    ncclCommGetAsyncError / pncclCommGetAsyncError(comm: Comm, async_error: *mut NcclResult) -> NcclResult {
        forward check [comm]
    }
    ncclCommCount / pncclCommCount(comm: Comm, count: *mut c_int) -> NcclResult { forward check [comm] }
    ncclCommCuDevice / pncclCommCuDevice(comm: Comm, device: *mut c_int) -> NcclResult { forward check [comm] }
    ncclCommUserRank / pncclCommUserRank(comm: Comm, rank: *mut c_int) -> NcclResult { forward check [comm] }
    ncclCommRegister / pncclCommRegister(comm: Comm, buff: *mut c_void, size: usize, handle: *mut *mut c_void)
        -> NcclResult {
        forward check [comm] log { ?comm, ?buff, size, "forwarded" }
    }
    ncclCommDeregister / pncclCommDeregister(comm: Comm, handle: *mut c_void) -> NcclResult {
        forward check [comm] log { ?comm, ?handle, "forwarded" }
    }
    ncclCommSuspend / pncclCommSuspend(comm: Comm, flags: c_int) -> NcclResult {
        forward check [comm] log { ?comm, flags, "forwarded" }
    }
    ncclCommResume / pncclCommResume(comm: Comm) -> NcclResult { forward check [comm] log { ?comm, "forwarded" } }
    ncclCommMemStats / pncclCommMemStats(comm: Comm, stat: c_int, value: *mut u64) -> NcclResult {
        forward check [comm]
    }
    ncclCommWindowRegister / pncclCommWindowRegister(
        comm: Comm, buff: *mut c_void, size: usize, win: *mut Window, win_flags: c_int
    ) -> NcclResult {
        forward check [comm] log { ?comm, ?buff, size, win_flags, "forwarded" }
        after |rc, _u| {
            if rc == api::NCCL_SUCCESS && !win.is_null() {
                // SAFETY: the library wrote the window through the caller's valid pointer.
                accel::window_registered(comm, buff, size, unsafe { *win });
            }
        }
    }
    ncclCommWindowDeregister / pncclCommWindowDeregister(comm: Comm, win: Window) -> NcclResult {
        forward check [comm] log { ?comm, ?win, "forwarded" } before { accel::window_deregistered(comm, win); }
    }
    ncclWinGetUserPtr / pncclWinGetUserPtr(comm: Comm, win: Window, out_user_ptr: *mut *mut c_void)
        -> NcclResult {
        forward check [comm]
    }
    ncclRedOpCreatePreMulSum / pncclRedOpCreatePreMulSum(
        op: *mut c_int, scalar: *mut c_void, datatype: c_int, residence: c_int, comm: Comm
    ) -> NcclResult {
        forward check [comm] log { dtype = %DataTypeName(datatype), residence, ?comm, "forwarded" }
    }
    ncclRedOpDestroy / pncclRedOpDestroy(op: c_int, comm: Comm) -> NcclResult {
        forward check [comm] log { op, ?comm, "forwarded" }
    }
    ncclReduce / pncclReduce(
        sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, root: c_int,
        comm: Comm, stream: Stream
    ) -> NcclResult {
        collective check [comm] log {
            count, dtype = %DataTypeName(datatype), op = %RedOpName(op), root, ?comm, ?stream, choice = "ccl",
            "forwarded"
        }
    }
    ncclBcast / pncclBcast(
        buff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: Comm, stream: Stream
    ) -> NcclResult {
        collective check [comm]
        log { count, dtype = %DataTypeName(datatype), root, ?comm, ?stream, choice = "ccl", "forwarded" }
    }
    ncclBroadcast / pncclBroadcast(
        sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: Comm,
        stream: Stream
    ) -> NcclResult {
        collective check [comm]
        log { count, dtype = %DataTypeName(datatype), root, ?comm, ?stream, choice = "ccl", "forwarded" }
    }
    ncclAllReduce / pncclAllReduce(
        sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, comm: Comm,
        stream: Stream
    ) -> NcclResult { custom }
    ncclReduceScatter / pncclReduceScatter(
        sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize, datatype: c_int, op: c_int, comm: Comm,
        stream: Stream
    ) -> NcclResult {
        collective check [comm] log {
            count = recvcount, dtype = %DataTypeName(datatype), op = %RedOpName(op), ?comm, ?stream,
            choice = "ccl", "forwarded"
        }
    }
    ncclAllGather / pncclAllGather(
        sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize, datatype: c_int, comm: Comm,
        stream: Stream
    ) -> NcclResult {
        collective check [comm]
        log { count = sendcount, dtype = %DataTypeName(datatype), ?comm, ?stream, choice = "ccl", "forwarded" }
    }
    ncclAlltoAll / pncclAlltoAll(
        sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, comm: Comm, stream: Stream
    ) -> NcclResult {
        collective check [comm]
        log { count, dtype = %DataTypeName(datatype), ?comm, ?stream, choice = "ccl", "forwarded" }
    }
    ncclGather / pncclGather(
        sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: Comm,
        stream: Stream
    ) -> NcclResult {
        collective check [comm]
        log { count, dtype = %DataTypeName(datatype), root, ?comm, ?stream, choice = "ccl", "forwarded" }
    }
    ncclScatter / pncclScatter(
        sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: Comm,
        stream: Stream
    ) -> NcclResult {
        collective check [comm]
        log { count, dtype = %DataTypeName(datatype), root, ?comm, ?stream, choice = "ccl", "forwarded" }
    }
    ncclAllReduceConfig / pncclAllReduceConfig(
        sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, comm: Comm,
        stream: Stream, config: CollConfig
    ) -> NcclResult { custom }
    ncclBroadcastConfig / pncclBroadcastConfig(
        sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: Comm,
        stream: Stream, config: CollConfig
    ) -> NcclResult {
        collective check [comm] log {
            count, dtype = %DataTypeName(datatype), root, ?comm, ?stream, ?config, choice = "ccl", "forwarded"
        }
    }
    ncclReduceConfig / pncclReduceConfig(
        sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, root: c_int,
        comm: Comm, stream: Stream, config: CollConfig
    ) -> NcclResult {
        collective check [comm] log {
            count, dtype = %DataTypeName(datatype), op = %RedOpName(op), root, ?comm, ?stream, ?config,
            choice = "ccl", "forwarded"
        }
    }
    ncclAllGatherConfig / pncclAllGatherConfig(
        sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize, datatype: c_int, comm: Comm,
        stream: Stream, config: CollConfig
    ) -> NcclResult {
        collective check [comm] log {
            count = sendcount, dtype = %DataTypeName(datatype), ?comm, ?stream, ?config, choice = "ccl", "forwarded"
        }
    }
    ncclReduceScatterConfig / pncclReduceScatterConfig(
        sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize, datatype: c_int, op: c_int, comm: Comm,
        stream: Stream, config: CollConfig
    ) -> NcclResult {
        collective check [comm] log {
            count = recvcount, dtype = %DataTypeName(datatype), op = %RedOpName(op), ?comm, ?stream, ?config,
            choice = "ccl", "forwarded"
        }
    }
    ncclAlltoAllConfig / pncclAlltoAllConfig(
        sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, comm: Comm, stream: Stream,
        config: CollConfig
    ) -> NcclResult {
        collective check [comm]
        log { count, dtype = %DataTypeName(datatype), ?comm, ?stream, ?config, choice = "ccl", "forwarded" }
    }
    ncclGatherConfig / pncclGatherConfig(
        sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: Comm,
        stream: Stream, config: CollConfig
    ) -> NcclResult {
        collective check [comm] log {
            count, dtype = %DataTypeName(datatype), root, ?comm, ?stream, ?config, choice = "ccl", "forwarded"
        }
    }
    ncclScatterConfig / pncclScatterConfig(
        sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: Comm,
        stream: Stream, config: CollConfig
    ) -> NcclResult {
        collective check [comm] log {
            count, dtype = %DataTypeName(datatype), root, ?comm, ?stream, ?config, choice = "ccl", "forwarded"
        }
    }
    ncclSend / pncclSend(
        sendbuff: *const c_void, count: usize, datatype: c_int, peer: c_int, comm: Comm, stream: Stream
    ) -> NcclResult {
        collective check [comm]
        log { count, dtype = %DataTypeName(datatype), peer, ?comm, ?stream, choice = "ccl", "forwarded" }
    }
    ncclRecv / pncclRecv(
        recvbuff: *mut c_void, count: usize, datatype: c_int, peer: c_int, comm: Comm, stream: Stream
    ) -> NcclResult {
        collective check [comm]
        log { count, dtype = %DataTypeName(datatype), peer, ?comm, ?stream, choice = "ccl", "forwarded" }
    }
    ncclPutSignal / pncclPutSignal(
        localbuff: *const c_void, count: usize, datatype: c_int, peer: c_int, peer_win: Window,
        peer_win_offset: usize, sig_idx: c_int, ctx: c_int, flags: c_uint, comm: Comm, stream: Stream
    ) -> NcclResult {
        collective check [comm] log {
            count, dtype = %DataTypeName(datatype), peer, ?peer_win, peer_win_offset, sig_idx, ctx, ?comm, ?stream,
            choice = "ccl", "forwarded"
        }
    }
    ncclSignal / pncclSignal(peer: c_int, sig_idx: c_int, ctx: c_int, flags: c_uint, comm: Comm, stream: Stream)
        -> NcclResult {
        collective check [comm] log { peer, sig_idx, ctx, ?comm, ?stream, choice = "ccl", "forwarded" }
    }
    ncclWaitSignal / pncclWaitSignal(n_desc: c_int, signal_descs: *mut c_void, comm: Comm, stream: Stream)
        -> NcclResult {
        collective check [comm] log { n_desc, ?comm, ?stream, choice = "ccl", "forwarded" }
    }
    ncclGroupStart / pncclGroupStart() -> NcclResult {
        forward log { "forwarded" } after |rc, _u| { if rc == api::NCCL_SUCCESS { accel::group_start(); } }
    }
    ncclGroupEnd / pncclGroupEnd() -> NcclResult {
        forward log { "forwarded" } after |_rc, _u| { accel::group_end(); }
    }
    ncclGroupSimulateEnd / pncclGroupSimulateEnd(sim_info: SimInfo) -> NcclResult {
        forward log { "forwarded" } after |_rc, _u| { accel::group_end(); }
    }
    ncclSetEncryption / pncclSetEncryption(config: *const c_void) -> NcclResult { forward log { "forwarded" } }
    ncclParamBind / pncclParamBind(out: *mut ParamHandle, key: *const c_char) -> NcclResult { forward }
    ncclParamGetI8 / pncclParamGetI8(h: ParamHandle, out: *mut i8) -> NcclResult { forward }
    ncclParamGetI16 / pncclParamGetI16(h: ParamHandle, out: *mut i16) -> NcclResult { forward }
    ncclParamGetI32 / pncclParamGetI32(h: ParamHandle, out: *mut i32) -> NcclResult { forward }
    ncclParamGetI64 / pncclParamGetI64(h: ParamHandle, out: *mut i64) -> NcclResult { forward }
    ncclParamGetU8 / pncclParamGetU8(h: ParamHandle, out: *mut u8) -> NcclResult { forward }
    ncclParamGetU16 / pncclParamGetU16(h: ParamHandle, out: *mut u16) -> NcclResult { forward }
    ncclParamGetU32 / pncclParamGetU32(h: ParamHandle, out: *mut u32) -> NcclResult { forward }
    ncclParamGetU64 / pncclParamGetU64(h: ParamHandle, out: *mut u64) -> NcclResult { forward }
    ncclParamGetStr / pncclParamGetStr(h: ParamHandle, out: *mut *const c_char) -> NcclResult { forward }
    ncclParamGet / pncclParamGet(h: ParamHandle, out: *mut c_void, max_len: c_int, len: *mut c_int)
        -> NcclResult {
        forward
    }
    ncclParamGetParameter / pncclParamGetParameter(
        key: *const c_char, value: *mut *const c_char, value_len: *mut c_int
    ) -> NcclResult {
        forward
    }
    ncclParamGetAllParameterKeys / pncclParamGetAllParameterKeys(
        table: *mut *mut *const c_char, table_len: *mut c_int
    ) -> NcclResult {
        forward
    }
    ncclParamDumpAll / pncclParamDumpAll() -> () { void }
    }
    /// The names of the device API's host functions (`nccl_device/host.h` 2.32.3) that the real library exports
    /// (without the `pnccl*` aliases), in header order.
    DEVICE_HOST_FUNCTIONS {
    ncclCommQueryProperties / pncclCommQueryProperties(comm: Comm, props: *mut c_void) -> NcclResult {
        forward check [comm]
    }
    ncclDevCommCreate / pncclDevCommCreate(comm: Comm, reqs: *const c_void, out_dev_comm: *mut c_void)
        -> NcclResult {
        forward check [comm] log { ?comm, "forwarded" }
    }
    ncclDevCommDestroy / pncclDevCommDestroy(comm: Comm, dev_comm: *const c_void) -> NcclResult {
        forward check [comm] log { ?comm, "forwarded" }
    }
    ncclGetLsaMultimemDevicePointer / pncclGetLsaMultimemDevicePointer(
        window: Window, offset: usize, out_ptr: *mut *mut c_void
    ) -> NcclResult {
        forward
    }
    ncclGetMultimemDevicePointer / pncclGetMultimemDevicePointer(
        window: Window, offset: usize, multimem: MultimemHandle, out_ptr: *mut *mut c_void
    ) -> NcclResult {
        forward
    }
    ncclGetLsaDevicePointer / pncclGetLsaDevicePointer(
        window: Window, offset: usize, lsa_rank: c_int, out_ptr: *mut *mut c_void
    ) -> NcclResult {
        forward
    }
    ncclGetPeerDevicePointer / pncclGetPeerDevicePointer(
        window: Window, offset: usize, peer: c_int, out_ptr: *mut *mut c_void
    ) -> NcclResult {
        forward
    }
    ncclGetMultimemDeviceLeInfo / pncclGetMultimemDeviceLeInfo(
        window: Window, offset: usize, le_id: *mut u32, le_offset: *mut usize
    ) -> NcclResult {
        forward
    }
    ncclGetCftDeviceLeInfo / pncclGetCftDeviceLeInfo(
        window: Window, offset: usize, peer_cft: c_int, cft_team: Team, le_id: *mut u32, le_offset: *mut usize
    ) -> NcclResult {
        forward
    }
    ncclGetPeerDeviceLeInfo / pncclGetPeerDeviceLeInfo(
        window: Window, offset: usize, peer_world: c_int, le_id: *mut u32, le_offset: *mut usize
    ) -> NcclResult {
        forward
    }
    ncclTeamWorld / pncclTeamWorld(comm: Comm) -> Team { value (Team::NONE) check [comm] }
    ncclTeamLsa / pncclTeamLsa(comm: Comm) -> Team { value (Team::NONE) check [comm] }
    ncclTeamCft / pncclTeamCft(comm: Comm, mode: c_int) -> Team { value (Team::NONE) check [comm] }
    ncclTeamCftMultimem / pncclTeamCftMultimem(comm: Comm) -> Team { value (Team::NONE) check [comm] }
    ncclTeamRankToWorld / pncclTeamRankToWorld(comm: Comm, team: Team, rank: c_int) -> c_int {
        value (-1) check [comm]
    }
    ncclTeamRankToLsa / pncclTeamRankToLsa(comm: Comm, team: Team, rank: c_int) -> c_int {
        value (-1) check [comm]
    }
    ncclTeamRail / pncclTeamRail(comm: Comm) -> Team { value (Team::NONE) check [comm] }
    ncclLsaBarrierCreateRequirement / pncclLsaBarrierCreateRequirement(
        team: Team, n_barriers: c_int, out_handle: *mut c_void, out_req: *mut c_void
    ) -> NcclResult {
        forward
    }
    ncclGinBarrierCreateRequirement / pncclGinBarrierCreateRequirement(
        comm: Comm, team: Team, n_barriers: c_int, out_handle: *mut c_void, out_req: *mut c_void
    ) -> NcclResult {
        forward check [comm]
    }
    ncclLLA2ACalcSlots / pncclLLA2ACalcSlots(max_elts: c_int, max_elt_size: c_int) -> c_int { value (-1) }
    ncclLLA2ACreateRequirement / pncclLLA2ACreateRequirement(
        n_blocks: c_int, n_slots: c_int, out_handle: *mut c_void, out_req: *mut c_void
    ) -> NcclResult {
        forward
    }
    ncclGinOutboxCreateRequirement / pncclGinOutboxCreateRequirement(
        n_blocks: c_int, size_log2: c_int, out_handle: *mut c_void, out_req: *mut c_void
    ) -> NcclResult {
        forward
    }
    ncclGinInboxA2ACreateRequirement / pncclGinInboxA2ACreateRequirement(
        peers: Team, n_blocks: c_int, size_log2: c_int, out_handle: *mut c_void, out_req: *mut c_void
    ) -> NcclResult {
        forward
    }
    }
}
