//! Loading the HIP runtime (`libamdhip64.so`) at run time and resolving every symbol anyccl calls, once.
//!
//! Why not a crate: `hip-sys` and the other bindings on crates.io link `libamdhip64` at build time (the binary then
//! fails to start where ROCm is absent), and the one that loads at run time aborts the process when the library
//! is missing. anyccl must build and run with no ROCm and say why the ROCm backend is off, so it resolves its
//! ~40 HIP symbols itself through `libloading`, the same way the NCCL/RCCL loader does.

use std::ffi::{c_void, CStr};
use std::fmt;
use std::path::{Path, PathBuf};

use anyccl_ccl::find::{self, Attempt, Exports, Place, PlaceList, Tried};
use anyccl_ccl::LoadFailure;
use serde::Serialize;

use crate::sys;

/// Why the HIP runtime could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[non_exhaustive]
pub enum HipLoadError {
    /// No candidate loaded; every place tried, with its reason.
    #[error("HIP runtime (libamdhip64.so) not found; tried: {}", find::describe_attempts(tried))]
    NotFound {
        /// Every attempt, in order.
        tried: Vec<Attempt>,
    },
    /// A symbol anyccl needs is missing.
    #[error("{path} does not export {symbol}, which anyccl needs (HIP runtime too old or not a HIP runtime)")]
    MissingRequired {
        /// The symbol.
        symbol: String,
        /// The library.
        path: String,
    },
}

/// The environment variable with an explicit HIP runtime path.
pub const ENV_HIP_PATH: &str = "ANYCCL_HIP_PATH";

macro_rules! hip_table {
    (
        required { $( $field:ident : $ty:ident = $sym:literal ),* $(,)? }
        optional { $( $ofield:ident : $oty:ident = $osym:literal ),* $(,)? }
    ) => {
        /// Every HIP function anyccl calls, resolved at load time: required ones as plain function pointers,
        /// optional ones (which differ between HIP releases) as `Option`.
        #[derive(Clone, Copy)]
        #[non_exhaustive]
        pub struct HipTable {
            $( #[doc = concat!("`", $sym, "`")] pub $field: sys::$ty, )*
            $( #[doc = concat!("`", $osym, "`, where the runtime has it")] pub $ofield: Option<sys::$oty>, )*
        }

        /// The required symbol names of [`HipTable`], in field order.
        pub const REQUIRED_SYMBOLS: &[&str] = &[$( $sym ),*];
        /// The optional symbol names of [`HipTable`].
        pub const OPTIONAL_SYMBOLS: &[&str] = &[$( $osym ),*];

        impl HipTable {
            /// Resolves every symbol through `lookup` (which returns null for a missing one).
            pub fn resolve(
                path: &Path,
                lookup: &mut dyn FnMut(&CStr) -> *const c_void,
            ) -> Result<Self, HipLoadError> {
                let mut find = |name: &'static str| -> *const c_void {
                    match CStr::from_bytes_with_nul(name.as_bytes()) {
                        Ok(c) => lookup(c),
                        Err(_) => std::ptr::null(),
                    }
                };
                Ok(HipTable {
                    $( $field: {
                        let p = find(concat!($sym, "\0"));
                        if p.is_null() {
                            return Err(HipLoadError::MissingRequired {
                                symbol: $sym.into(),
                                path: path.display().to_string(),
                            });
                        }
                        // SAFETY: `p` is the non-null address of the exported function `$sym`, whose C signature
                        // is the one `sys::$ty` declares (hip_runtime_api.h).
                        unsafe { std::mem::transmute::<*const c_void, sys::$ty>(p) }
                    }, )*
                    $( $ofield: {
                        let p = find(concat!($osym, "\0"));
                        // SAFETY: as above, for the optional symbol `$osym` when present.
                        (!p.is_null()).then(|| unsafe { std::mem::transmute::<*const c_void, sys::$oty>(p) })
                    }, )*
                })
            }
        }
    };
}

hip_table! {
    required {
    get_device_count: GetDeviceCount = "hipGetDeviceCount",
    set_device: SetDevice = "hipSetDevice",
    get_device: GetDevice = "hipGetDevice",
    device_get_name: DeviceGetName = "hipDeviceGetName",
    runtime_get_version: RuntimeGetVersion = "hipRuntimeGetVersion",
    get_error_string: GetErrorString = "hipGetErrorString",
    malloc: Malloc = "hipMalloc",
    free: Free = "hipFree",
    mem_get_address_range: MemGetAddressRange = "hipMemGetAddressRange",
    memcpy_async: MemcpyAsync = "hipMemcpyAsync",
    memset_async: MemsetAsync = "hipMemsetAsync",
    stream_create_with_flags: StreamCreateWithFlags = "hipStreamCreateWithFlags",
    stream_destroy: StreamDestroy = "hipStreamDestroy",
    stream_synchronize: StreamSynchronize = "hipStreamSynchronize",
    stream_query: StreamQuery = "hipStreamQuery",
    stream_get_capture_info: StreamGetCaptureInfo = "hipStreamGetCaptureInfo",
    stream_begin_capture: StreamBeginCapture = "hipStreamBeginCapture",
    stream_end_capture: StreamEndCapture = "hipStreamEndCapture",
    graph_instantiate: GraphInstantiate = "hipGraphInstantiate",
    graph_launch: GraphLaunch = "hipGraphLaunch",
    graph_exec_destroy: GraphExecDestroy = "hipGraphExecDestroy",
    graph_destroy: GraphDestroy = "hipGraphDestroy",
    ipc_get_mem_handle: IpcGetMemHandle = "hipIpcGetMemHandle",
    ipc_open_mem_handle: IpcOpenMemHandle = "hipIpcOpenMemHandle",
    ipc_close_mem_handle: IpcCloseMemHandle = "hipIpcCloseMemHandle",
    device_can_access_peer: DeviceCanAccessPeer = "hipDeviceCanAccessPeer",
    device_enable_peer_access: DeviceEnablePeerAccess = "hipDeviceEnablePeerAccess",
    module_load_data: ModuleLoadData = "hipModuleLoadData",
    module_unload: ModuleUnload = "hipModuleUnload",
    module_get_function: ModuleGetFunction = "hipModuleGetFunction",
    module_launch_kernel: ModuleLaunchKernel = "hipModuleLaunchKernel",
    event_create: EventCreate = "hipEventCreate",
    event_record: EventRecord = "hipEventRecord",
    event_synchronize: EventSynchronize = "hipEventSynchronize",
    event_elapsed_time: EventElapsedTime = "hipEventElapsedTime",
    event_destroy: EventDestroy = "hipEventDestroy",
    }
    optional {
        // HIP 6 renamed the struct's layout into a versioned entry point and kept the old one for old binaries.
        get_device_properties_r0600: GetDeviceProperties = "hipGetDevicePropertiesR0600",
        get_device_properties: GetDeviceProperties = "hipGetDeviceProperties",
        // Optional so a runtime without it still loads; `HipRuntime::memory_info` says it is missing.
        mem_get_info: MemGetInfo = "hipMemGetInfo",
        // Lets anyccl allocate in relaxed capture mode, so a capture it cannot see is never invalidated by it.
        thread_exchange_stream_capture_mode: ThreadExchangeStreamCaptureMode = "hipThreadExchangeStreamCaptureMode",
        // The abort word's stream-ordered write; without it a 4-byte hipMemcpyAsync on the control stream does it.
        stream_write_value32: StreamWriteValue32 = "hipStreamWriteValue32",
        // The compute-unit count (occupancy of emulated ranks); without it the count is unknown (0).
        device_get_attribute: DeviceGetAttribute = "hipDeviceGetAttribute",
    }
}

/// The loaded HIP runtime. Never unloaded (like NCCL/RCCL, the runtime starts threads that outlive handles).
pub struct HipLibrary {
    table: HipTable,
    path: PathBuf,
    version: i32,
    /// The live streams made through this runtime, and the captures anyccl began on them.
    streams: anyccl_core::capture::KnownStreams,
    _lib: Option<std::mem::ManuallyDrop<libloading::Library>>,
}

impl fmt::Debug for HipLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HipLibrary").field("path", &self.path).field("version", &self.version).finish_non_exhaustive()
    }
}

/// The entry points anyccl resolves from the HIP runtime: the file is checked for them before anything in it runs.
pub const HIP_EXPORTS: Exports<'static> = Exports { required: REQUIRED_SYMBOLS, optional: OPTIONAL_SYMBOLS };

/// The HIP runtime's sonames, newest first (HIP 7, 6, 5).
pub const HIP_SONAMES: &[&str] = &["libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so"];

/// The standard places, by the rules of [`anyccl_ccl::find`]: `ANYCCL_HIP_PATH` (absolute), the sonames for the
/// dynamic loader (unless a relative `LD_LIBRARY_PATH` entry rules that out), then `libamdhip64.so` in
/// `$ROCM_PATH/lib` (absolute) and `/opt/rocm/lib`. `env` returns `None` for unset or empty variables.
pub fn places(env: &dyn Fn(&str) -> Option<PathBuf>) -> Vec<Place> {
    let mut p = PlaceList::new(env, HIP_SONAMES).dir_names(&["libamdhip64.so"]);
    p.explicit(ENV_HIP_PATH);
    p.loader();
    if let Some(r) = env("ROCM_PATH") {
        p.dir("ROCM_PATH", r.join("lib"));
    }
    p.dir("the default", PathBuf::from("/opt/rocm/lib"));
    p.finish()
}

impl HipLibrary {
    /// Finds and loads the HIP runtime from the standard [`places`] of the process environment.
    pub fn load() -> Result<Self, HipLoadError> {
        Self::load_from(&places(&find::process_env))
    }

    /// Tries `places` in order; the first runtime that passes the checks and resolves every symbol.
    pub fn load_from(places: &[Place]) -> Result<Self, HipLoadError> {
        let t = Self::try_load_from(places);
        t.loaded.ok_or(HipLoadError::NotFound { tried: t.attempts })
    }

    /// Like [`HipLibrary::load_from`], and also says which places failed (or were skipped) before the one that
    /// loaded.
    pub fn try_load_from(places: &[Place]) -> Tried<Self> {
        find::try_in_order(places, &mut |c| Self::open_checked(c))
    }

    /// Opens the runtime at `path` (an absolute path, or a bare soname for the dynamic loader) and resolves every
    /// symbol. The file is checked before anything in it is called ([`anyccl_ccl::find::open_checked`]).
    pub fn open(path: &Path) -> Result<Self, HipLoadError> {
        Self::open_checked(path).map_err(|failure| match failure {
            LoadFailure::MissingRequired { symbol } => {
                HipLoadError::MissingRequired { symbol, path: path.display().to_string() }
            }
            failure => HipLoadError::NotFound { tried: vec![Attempt::new(path.display().to_string(), failure)] },
        })
    }

    fn open_checked(path: &Path) -> Result<Self, LoadFailure> {
        let lib = find::open_checked(path, &HIP_EXPORTS)?;
        let table = HipTable::resolve(path, &mut |name: &CStr| {
            // SAFETY: looking a symbol up only reads the library's dynamic symbol table; the file's checks found
            // every entry point anyccl resolves a function.
            match unsafe { lib.get::<*const c_void>(name.to_bytes_with_nul()) } {
                Ok(sym) => *sym,
                Err(_) => std::ptr::null(),
            }
        })
        .map_err(|e| match e {
            HipLoadError::MissingRequired { symbol, .. } => LoadFailure::MissingRequired { symbol },
            other => LoadFailure::LoaderError { message: other.to_string() },
        })?;
        let real_path = find::file_of_address(table.runtime_get_version as usize).unwrap_or_else(|| path.to_owned());
        Ok(Self::finish(table, real_path, Some(std::mem::ManuallyDrop::new(lib))))
    }

    /// Builds a library from symbols supplied by `lookup` (no dlopen): the seam tests use to count lookups.
    pub fn load_with(path: &Path, lookup: &mut dyn FnMut(&CStr) -> *const c_void) -> Result<Self, HipLoadError> {
        let table = HipTable::resolve(path, lookup)?;
        Ok(Self::finish(table, path.to_owned(), None))
    }

    fn finish(table: HipTable, path: PathBuf, lib: Option<std::mem::ManuallyDrop<libloading::Library>>) -> Self {
        let mut version = 0;
        // SAFETY: hipRuntimeGetVersion writes one int.
        let st = unsafe { (table.runtime_get_version)(&mut version) };
        if st != sys::HIP_SUCCESS {
            version = 0;
        }
        HipLibrary { table, path, version, streams: anyccl_core::capture::KnownStreams::new(), _lib: lib }
    }

    /// The resolved functions.
    pub fn table(&self) -> &HipTable {
        &self.table
    }

    /// The live streams made through this runtime, and the captures anyccl began on them: what calls without a
    /// stream (allocation, freeing, registration) consult under the capture rules.
    pub fn known_streams(&self) -> &anyccl_core::capture::KnownStreams {
        &self.streams
    }

    /// Where the library was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `hipRuntimeGetVersion` (`major * 10_000_000 + minor * 100_000 + patch`), 0 when it failed.
    pub fn version(&self) -> i32 {
        self.version
    }

    /// "HIP 6.2.41133" or "HIP (version unknown)".
    pub fn describe(&self) -> String {
        if self.version <= 0 {
            return "HIP (version unknown)".into();
        }
        let v = self.version;
        format!("HIP {}.{}.{}", v / 10_000_000, (v / 100_000) % 100, v % 100_000)
    }

    /// The error text HIP gives for `status`.
    pub fn error_string(&self, status: sys::hipError_t) -> String {
        // SAFETY: hipGetErrorString takes any value and returns a static string or null.
        let p = unsafe { (self.table.get_error_string)(status) };
        if p.is_null() {
            return format!("hip error {status}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}
