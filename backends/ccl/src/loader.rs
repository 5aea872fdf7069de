//! Loading a `nccl.h`-ABI library: every symbol resolved once, here, and never again.

use std::ffi::{c_int, c_void, CStr};
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::sys;

/// Which vendor's library this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum CclVendor {
    /// NVIDIA NCCL.
    Nccl,
    /// AMD RCCL.
    Rccl,
}

impl fmt::Display for CclVendor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CclVendor::Nccl => "NCCL",
            CclVendor::Rccl => "RCCL",
        })
    }
}

/// A decoded `ncclGetVersion` code.
///
/// Not `#[non_exhaustive]`: major, minor, patch and the raw code are all a version has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct CclVersion {
    /// Major.
    pub major: u32,
    /// Minor.
    pub minor: u32,
    /// Patch.
    pub patch: u32,
    /// The raw code.
    pub code: i32,
}

impl CclVersion {
    /// Decodes both encodings: `X*1000 + Y*100 + Z` up to 2.8, `X*10000 + Y*100 + Z` from 2.9 on. Returns `None`
    /// for a code no NCCL release produces (negative, or major 0).
    pub fn decode(code: i32) -> Option<Self> {
        let c = u32::try_from(code).ok()?;
        let (major, minor, patch) =
            if c >= 10_000 { (c / 10_000, (c % 10_000) / 100, c % 100) } else { (c / 1000, (c % 1000) / 100, c % 100) };
        (major > 0).then_some(CclVersion { major, minor, patch, code })
    }

    /// Whether this version is at least `major.minor`.
    pub fn at_least(&self, major: u32, minor: u32) -> bool {
        (self.major, self.minor) >= (major, minor)
    }

    /// Whether this version is at least `major.minor.patch`.
    pub fn at_least_patch(&self, major: u32, minor: u32, patch: u32) -> bool {
        (self.major, self.minor, self.patch) >= (major, minor, patch)
    }
}

impl fmt::Display for CclVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Entry points the communicator cannot work without.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Required {
    /// `ncclGetVersion`.
    pub get_version: sys::GetVersion,
    /// `ncclGetUniqueId`.
    pub get_unique_id: sys::GetUniqueId,
    /// `ncclCommInitRank`.
    pub comm_init_rank: sys::CommInitRank,
    /// `ncclCommDestroy`.
    pub comm_destroy: sys::CommUnary,
    /// `ncclCommAbort`.
    pub comm_abort: sys::CommUnary,
    /// `ncclCommCount`.
    pub comm_count: sys::CommQuery,
    /// `ncclCommUserRank`.
    pub comm_user_rank: sys::CommQuery,
    /// `ncclCommCuDevice`.
    pub comm_cu_device: sys::CommQuery,
    /// `ncclCommGetAsyncError`.
    pub comm_get_async_error: sys::CommGetAsyncError,
    /// `ncclGetErrorString`.
    pub get_error_string: sys::GetErrorString,
    /// `ncclAllReduce`.
    pub all_reduce: sys::AllReduce,
    /// `ncclAllGather`.
    pub all_gather: sys::AllGather,
    /// `ncclReduceScatter`.
    pub reduce_scatter: sys::ReduceScatter,
    /// `ncclBroadcast`.
    pub broadcast: sys::Broadcast,
    /// `ncclReduce`.
    pub reduce: sys::Reduce,
    /// `ncclSend`.
    pub send: sys::Send,
    /// `ncclRecv`.
    pub recv: sys::Recv,
    /// `ncclGroupStart`.
    pub group_start: sys::Group,
    /// `ncclGroupEnd`.
    pub group_end: sys::Group,
}

/// Entry points that only some releases export. `None` means the loaded library does not.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct Optional {
    /// `ncclCommInitAll`.
    pub comm_init_all: Option<sys::CommInitAll>,
    /// `ncclCommInitRankConfig`.
    pub comm_init_rank_config: Option<sys::Opaque>,
    /// `ncclCommFinalize`.
    pub comm_finalize: Option<sys::CommUnary>,
    /// `ncclGetLastError`.
    pub get_last_error: Option<sys::GetLastError>,
    /// `ncclRedOpCreatePreMulSum`.
    pub red_op_create_pre_mul_sum: Option<sys::Opaque>,
    /// `ncclCommSplit` (NCCL 2.18).
    pub comm_split: Option<sys::CommSplit>,
    /// `ncclCommRegister` (2.19).
    pub comm_register: Option<sys::CommRegister>,
    /// `ncclCommDeregister` (2.19).
    pub comm_deregister: Option<sys::CommDeregister>,
    /// `ncclMemAlloc` (2.19).
    pub mem_alloc: Option<sys::MemAlloc>,
    /// `ncclMemFree` (2.19).
    pub mem_free: Option<sys::MemFree>,
    /// `ncclGroupSimulateEnd` (2.22).
    pub group_simulate_end: Option<sys::Opaque>,
    /// `ncclCommInitRankScalable` (2.23).
    pub comm_init_rank_scalable: Option<sys::Opaque>,
    /// `ncclCommWindowRegister` (2.27).
    pub comm_window_register: Option<sys::CommWindowRegister>,
    /// `ncclCommWindowDeregister` (2.27).
    pub comm_window_deregister: Option<sys::CommWindowDeregister>,
    /// `ncclCommShrink` (2.27).
    pub comm_shrink: Option<sys::Opaque>,
    /// `ncclDevCommCreate` (2.28, the device API).
    pub dev_comm_create: Option<sys::Opaque>,
    /// `ncclAllReduceConfig` (2.31, the per-call config).
    pub all_reduce_config: Option<sys::Opaque>,
    /// `ncclAllGatherConfig` (2.31, the per-call config).
    pub all_gather_config: Option<sys::Opaque>,
    /// `ncclReduceScatterConfig` (2.31, the per-call config).
    pub reduce_scatter_config: Option<sys::Opaque>,
    /// `ncclBroadcastConfig` (2.31, the per-call config).
    pub broadcast_config: Option<sys::Opaque>,
    /// `ncclReduceConfig` (2.31, the per-call config).
    pub reduce_config: Option<sys::Opaque>,
    /// `ncclAlltoAllConfig` (2.31, the per-call config).
    pub all_to_all_config: Option<sys::Opaque>,
    /// `ncclGatherConfig` (2.31, the per-call config).
    pub gather_config: Option<sys::Opaque>,
    /// `ncclScatterConfig` (2.31, the per-call config).
    pub scatter_config: Option<sys::Opaque>,
    /// `ncclAllToAllv` (RCCL only).
    pub rccl_all_to_allv: Option<sys::Opaque>,
    /// `mscclLoadAlgo` (RCCL only).
    pub rccl_msccl_load_algo: Option<sys::Opaque>,
    /// `ncclAllReduceWithBias` (newer RCCL only).
    pub rccl_all_reduce_with_bias: Option<sys::Opaque>,
}

/// Names of the required symbols, in [`Required`] field order.
pub const REQUIRED_SYMBOLS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommDestroy",
    "ncclCommAbort",
    "ncclCommCount",
    "ncclCommUserRank",
    "ncclCommCuDevice",
    "ncclCommGetAsyncError",
    "ncclGetErrorString",
    "ncclAllReduce",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclBroadcast",
    "ncclReduce",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
];

/// Names of the optional symbols anyccl probes.
pub const OPTIONAL_SYMBOLS: &[&str] = &[
    "ncclCommInitAll",
    "ncclCommInitRankConfig",
    "ncclCommFinalize",
    "ncclGetLastError",
    "ncclRedOpCreatePreMulSum",
    "ncclCommSplit",
    "ncclCommRegister",
    "ncclCommDeregister",
    "ncclMemAlloc",
    "ncclMemFree",
    "ncclGroupSimulateEnd",
    "ncclCommInitRankScalable",
    "ncclCommWindowRegister",
    "ncclCommWindowDeregister",
    "ncclCommShrink",
    "ncclDevCommCreate",
    "ncclAllReduceConfig",
    "ncclAllGatherConfig",
    "ncclReduceScatterConfig",
    "ncclBroadcastConfig",
    "ncclReduceConfig",
    "ncclAlltoAllConfig",
    "ncclGatherConfig",
    "ncclScatterConfig",
    "ncclAllToAllv",
    "mscclLoadAlgo",
    "ncclAllReduceWithBias",
];

/// Symbols only RCCL exports.
pub const RCCL_ONLY_SYMBOLS: &[&str] = &["ncclAllToAllv", "mscclLoadAlgo", "ncclAllReduceWithBias"];

/// The resolved table: required entry points as plain function pointers, optional ones as `Option`.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct CclTable {
    /// Always present.
    pub required: Required,
    /// Present in some releases.
    pub optional: Optional,
}

/// Why a library could not be loaded from one place.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[serde(tag = "kind", rename_all = "kebab-case")]
#[non_exhaustive]
pub enum LoadFailure {
    /// Nothing at that path or name.
    #[error("not found")]
    NotFound,
    /// A relative path or directory (from the named variable): never resolved against the working directory.
    #[error(
        "not searched: {origin} is relative; anyccl looks only in absolute directories, never in the working directory"
    )]
    RelativePath {
        /// Where it came from: a variable (`PYTHONPATH entry ""`, `CUDA_HOME`, `ANYCCL_NCCL_PATH`, …).
        origin: String,
    },
    /// A bare soname not handed to the dynamic loader, whose search would include the working directory.
    #[error(
        "not handed to the dynamic loader: LD_LIBRARY_PATH entry {entry:?} is relative, so it would search the \
         working directory; LD_LIBRARY_PATH's absolute entries and the system library directories are searched instead"
    )]
    LoaderSearchesWorkingDirectory {
        /// The relative entry of `LD_LIBRARY_PATH` (empty for `::` or a leading/trailing `:`).
        entry: String,
    },
    /// Something other than a regular file (a FIFO, a directory, a device): never opened for reading or loaded.
    #[error("not a regular file: {file_type}")]
    NotRegularFile {
        /// What it is.
        file_type: String,
    },
    /// The file or a directory on its path may not be read (`EACCES`).
    #[error("permission denied")]
    PermissionDenied,
    /// The path or one of its components is longer than the system allows (`ENAMETOOLONG`).
    #[error("name too long")]
    NameTooLong,
    /// Another error from `stat` or `open`.
    #[error("cannot be read: {detail}")]
    Unreadable {
        /// The system's message.
        detail: String,
    },
    /// The file exists but is not an ELF shared library.
    #[error("not a shared library ({detail})")]
    NotALibrary {
        /// What was found instead.
        detail: String,
    },
    /// A shared library for another machine.
    #[error("wrong architecture: {detail}")]
    WrongArchitecture {
        /// What the file is built for.
        detail: String,
    },
    /// An entry point anyccl would call is defined as something other than a function (a data object, say).
    #[error("{symbol} is not a function: {detail}")]
    SymbolNotAFunction {
        /// The entry point.
        symbol: String,
        /// What it is instead.
        detail: String,
    },
    /// The dynamic loader found a file by soname that fails the checks a path gets.
    #[error("the dynamic loader found {path}, which is refused: {reason}")]
    LoadedFileRefused {
        /// The file the loader mapped.
        path: String,
        /// Why it is refused.
        reason: Box<LoadFailure>,
    },
    /// The dynamic loader refused it (missing dependency, bad ELF, …).
    #[error("the dynamic loader refused it: {message}")]
    LoaderError {
        /// The loader's message.
        message: String,
    },
    /// A required symbol is missing.
    #[error("missing required symbol {symbol}")]
    MissingRequired {
        /// The symbol.
        symbol: String,
    },
    /// `ncclGetVersion` failed or returned a code no release uses.
    #[error("ncclGetVersion {detail}")]
    BadVersion {
        /// What went wrong.
        detail: String,
    },
}

/// Resolves every symbol through `lookup` (which returns null for a missing one), in one pass.
///
/// This is the only place symbols are looked up; the returned table is used for the library's whole life.
pub fn resolve(lookup: &mut dyn FnMut(&CStr) -> *const c_void) -> Result<CclTable, LoadFailure> {
    let mut get = |name: &str| -> *const c_void {
        let mut bytes = name.as_bytes().to_vec();
        bytes.push(0);
        match CStr::from_bytes_with_nul(&bytes) {
            Ok(c) => lookup(c),
            Err(_) => std::ptr::null(),
        }
    };
    macro_rules! required {
        ($name:literal, $ty:ty) => {{
            let p = get($name);
            if p.is_null() {
                return Err(LoadFailure::MissingRequired { symbol: $name.to_owned() });
            }
            // SAFETY: `p` is the non-null address the library exports under this `nccl.h` name; the target type
            // is that entry point's signature from nccl.h (sys.rs), the same in NCCL and RCCL.
            unsafe { std::mem::transmute::<*const c_void, $ty>(p) }
        }};
    }
    macro_rules! optional {
        ($name:literal, $ty:ty) => {{
            let p = get($name);
            if p.is_null() {
                None
            } else {
                // SAFETY: as for required symbols: a non-null export cast to its nccl.h signature.
                Some(unsafe { std::mem::transmute::<*const c_void, $ty>(p) })
            }
        }};
    }
    let required = Required {
        get_version: required!("ncclGetVersion", sys::GetVersion),
        get_unique_id: required!("ncclGetUniqueId", sys::GetUniqueId),
        comm_init_rank: required!("ncclCommInitRank", sys::CommInitRank),
        comm_destroy: required!("ncclCommDestroy", sys::CommUnary),
        comm_abort: required!("ncclCommAbort", sys::CommUnary),
        comm_count: required!("ncclCommCount", sys::CommQuery),
        comm_user_rank: required!("ncclCommUserRank", sys::CommQuery),
        comm_cu_device: required!("ncclCommCuDevice", sys::CommQuery),
        comm_get_async_error: required!("ncclCommGetAsyncError", sys::CommGetAsyncError),
        get_error_string: required!("ncclGetErrorString", sys::GetErrorString),
        all_reduce: required!("ncclAllReduce", sys::AllReduce),
        all_gather: required!("ncclAllGather", sys::AllGather),
        reduce_scatter: required!("ncclReduceScatter", sys::ReduceScatter),
        broadcast: required!("ncclBroadcast", sys::Broadcast),
        reduce: required!("ncclReduce", sys::Reduce),
        send: required!("ncclSend", sys::Send),
        recv: required!("ncclRecv", sys::Recv),
        group_start: required!("ncclGroupStart", sys::Group),
        group_end: required!("ncclGroupEnd", sys::Group),
    };
    let optional = Optional {
        comm_init_all: optional!("ncclCommInitAll", sys::CommInitAll),
        comm_init_rank_config: optional!("ncclCommInitRankConfig", sys::Opaque),
        comm_finalize: optional!("ncclCommFinalize", sys::CommUnary),
        get_last_error: optional!("ncclGetLastError", sys::GetLastError),
        red_op_create_pre_mul_sum: optional!("ncclRedOpCreatePreMulSum", sys::Opaque),
        comm_split: optional!("ncclCommSplit", sys::CommSplit),
        comm_register: optional!("ncclCommRegister", sys::CommRegister),
        comm_deregister: optional!("ncclCommDeregister", sys::CommDeregister),
        mem_alloc: optional!("ncclMemAlloc", sys::MemAlloc),
        mem_free: optional!("ncclMemFree", sys::MemFree),
        group_simulate_end: optional!("ncclGroupSimulateEnd", sys::Opaque),
        comm_init_rank_scalable: optional!("ncclCommInitRankScalable", sys::Opaque),
        comm_window_register: optional!("ncclCommWindowRegister", sys::CommWindowRegister),
        comm_window_deregister: optional!("ncclCommWindowDeregister", sys::CommWindowDeregister),
        comm_shrink: optional!("ncclCommShrink", sys::Opaque),
        dev_comm_create: optional!("ncclDevCommCreate", sys::Opaque),
        all_reduce_config: optional!("ncclAllReduceConfig", sys::Opaque),
        all_gather_config: optional!("ncclAllGatherConfig", sys::Opaque),
        reduce_scatter_config: optional!("ncclReduceScatterConfig", sys::Opaque),
        broadcast_config: optional!("ncclBroadcastConfig", sys::Opaque),
        reduce_config: optional!("ncclReduceConfig", sys::Opaque),
        all_to_all_config: optional!("ncclAlltoAllConfig", sys::Opaque),
        gather_config: optional!("ncclGatherConfig", sys::Opaque),
        scatter_config: optional!("ncclScatterConfig", sys::Opaque),
        rccl_all_to_allv: optional!("ncclAllToAllv", sys::Opaque),
        rccl_msccl_load_algo: optional!("mscclLoadAlgo", sys::Opaque),
        rccl_all_reduce_with_bias: optional!("ncclAllReduceWithBias", sys::Opaque),
    };
    Ok(CclTable { required, optional })
}

impl CclTable {
    /// Whether the optional symbol `name` was resolved.
    pub fn has(&self, name: &str) -> bool {
        let o = &self.optional;
        match name {
            "ncclCommInitAll" => o.comm_init_all.is_some(),
            "ncclCommInitRankConfig" => o.comm_init_rank_config.is_some(),
            "ncclCommFinalize" => o.comm_finalize.is_some(),
            "ncclGetLastError" => o.get_last_error.is_some(),
            "ncclRedOpCreatePreMulSum" => o.red_op_create_pre_mul_sum.is_some(),
            "ncclCommSplit" => o.comm_split.is_some(),
            "ncclCommRegister" => o.comm_register.is_some(),
            "ncclCommDeregister" => o.comm_deregister.is_some(),
            "ncclMemAlloc" => o.mem_alloc.is_some(),
            "ncclMemFree" => o.mem_free.is_some(),
            "ncclGroupSimulateEnd" => o.group_simulate_end.is_some(),
            "ncclCommInitRankScalable" => o.comm_init_rank_scalable.is_some(),
            "ncclCommWindowRegister" => o.comm_window_register.is_some(),
            "ncclCommWindowDeregister" => o.comm_window_deregister.is_some(),
            "ncclCommShrink" => o.comm_shrink.is_some(),
            "ncclDevCommCreate" => o.dev_comm_create.is_some(),
            "ncclAllReduceConfig" => o.all_reduce_config.is_some(),
            "ncclAllGatherConfig" => o.all_gather_config.is_some(),
            "ncclReduceScatterConfig" => o.reduce_scatter_config.is_some(),
            "ncclBroadcastConfig" => o.broadcast_config.is_some(),
            "ncclReduceConfig" => o.reduce_config.is_some(),
            "ncclAlltoAllConfig" => o.all_to_all_config.is_some(),
            "ncclGatherConfig" => o.gather_config.is_some(),
            "ncclScatterConfig" => o.scatter_config.is_some(),
            "ncclAllToAllv" => o.rccl_all_to_allv.is_some(),
            "mscclLoadAlgo" => o.rccl_msccl_load_algo.is_some(),
            "ncclAllReduceWithBias" => o.rccl_all_reduce_with_bias.is_some(),
            _ => REQUIRED_SYMBOLS.contains(&name),
        }
    }

    /// Whether any RCCL-only symbol was resolved.
    pub fn has_rccl_symbols(&self) -> bool {
        RCCL_ONLY_SYMBOLS.iter().any(|s| self.has(s))
    }

    /// Calls `ncclGetVersion` and decodes the result.
    pub fn query_version(&self) -> Result<CclVersion, LoadFailure> {
        let mut code: c_int = 0;
        // SAFETY: `get_version` is the library's ncclGetVersion; it writes one int through the valid pointer.
        let status = unsafe { (self.required.get_version)(&mut code) };
        if status != sys::NCCL_SUCCESS {
            return Err(LoadFailure::BadVersion { detail: format!("returned error {status}") });
        }
        CclVersion::decode(code).ok_or_else(|| LoadFailure::BadVersion { detail: format!("returned code {code}") })
    }
}

/// The dynamic loader's message for a failed `dlopen`, with every underlying cause appended (libloading nests
/// the `dlerror` text as a source). Shared by the HIP runtime loader.
pub fn dl_error_text(e: &libloading::Error) -> String {
    let mut message = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        message = format!("{message}: {s}");
        src = s.source();
    }
    message
}

/// A loaded library with its table, version and vendor. The library stays loaded while this value (or an `Arc` of
/// it held by a communicator) lives.
pub struct CclLibrary {
    table: CclTable,
    version: CclVersion,
    vendor: CclVendor,
    path: PathBuf,
    // Keeps the code the table points into mapped. Never closed: NCCL starts threads (the bootstrap root that
    // `ncclGetUniqueId` spawns, proxy threads) that outlive every handle, and unloading the library under them
    // crashed the process at exit in our tests with the real NCCL 2.26/2.32. The dynamic loader's reference
    // count keeps one mapping per process however often it is opened.
    _lib: Option<std::mem::ManuallyDrop<libloading::Library>>,
}

impl fmt::Debug for CclLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CclLibrary")
            .field("path", &self.path)
            .field("vendor", &self.vendor)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl CclLibrary {
    /// Opens the library at `path` (an absolute path, or a bare soname for the dynamic loader) and resolves
    /// everything. The file is checked before anything in it is called ([`crate::find::open_checked`]): a path before
    /// `dlopen`, a soname's file after the loader found it and before `ncclGetVersion` is called.
    pub fn open(path: &Path) -> Result<Self, LoadFailure> {
        let lib = crate::find::open_checked(path, &crate::find::CCL_EXPORTS)?;
        let table = resolve(&mut |name: &CStr| {
            // SAFETY: looking a symbol up by name only reads the library's dynamic symbol table; the pointer is
            // cast to its nccl.h type in `resolve`, and the file's checks found every such entry point a function.
            match unsafe { lib.get::<*const c_void>(name.to_bytes_with_nul()) } {
                Ok(sym) => *sym,
                Err(_) => std::ptr::null(),
            }
        })?;
        let real_path =
            crate::find::file_of_address(table.required.get_version as usize).unwrap_or_else(|| path.to_owned());
        Self::finish(table, real_path, Some(std::mem::ManuallyDrop::new(lib)))
    }

    /// Builds a library from symbols supplied by `lookup` (no dlopen): the seam tests use.
    pub fn load_with(path: &Path, lookup: &mut dyn FnMut(&CStr) -> *const c_void) -> Result<Self, LoadFailure> {
        let table = resolve(lookup)?;
        Self::finish(table, path.to_owned(), None)
    }

    fn finish(
        table: CclTable,
        path: PathBuf,
        lib: Option<std::mem::ManuallyDrop<libloading::Library>>,
    ) -> Result<Self, LoadFailure> {
        let version = table.query_version()?;
        let name_says_rccl = path.file_name().is_some_and(|n| n.to_string_lossy().contains("rccl"));
        let vendor = if table.has_rccl_symbols() || name_says_rccl { CclVendor::Rccl } else { CclVendor::Nccl };
        tracing::debug!(path = %path.display(), %vendor, %version, "loaded collective library");
        Ok(CclLibrary { table, version, vendor, path, _lib: lib })
    }

    /// The symbol table.
    pub fn table(&self) -> &CclTable {
        &self.table
    }

    /// The decoded version.
    pub fn version(&self) -> CclVersion {
        self.version
    }

    /// NCCL or RCCL.
    pub fn vendor(&self) -> CclVendor {
        self.vendor
    }

    /// The file loaded.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `"NCCL 2.28.9"`.
    pub fn describe(&self) -> String {
        format!("{} {}", self.vendor, self.version)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_both_version_encodings() {
        let v = CclVersion::decode(2804).expect("2.8.4");
        assert_eq!((v.major, v.minor, v.patch), (2, 8, 4));
        let v = CclVersion::decode(22707).expect("2.27.7");
        assert_eq!((v.major, v.minor, v.patch), (2, 27, 7));
        assert_eq!(CclVersion::decode(21903).map(|v| v.to_string()), Some("2.19.3".into()));
        assert!(CclVersion::decode(-1).is_none());
        assert!(CclVersion::decode(0).is_none());
        assert!(CclVersion::decode(22707).is_some_and(|v| v.at_least(2, 27) && !v.at_least(2, 28)));
    }
}
