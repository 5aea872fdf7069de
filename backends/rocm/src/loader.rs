//! Loading the HIP runtime (`libamdhip64.so`) at run time and resolving every symbol anyccl calls, once.
//!
//! Why not a crate: `hip-sys` and the other bindings on crates.io link `libamdhip64` at build time (the binary then
//! fails to start where ROCm is absent), and the one that loads at run time aborts the process when the library
//! is missing. anyccl must build and run with no ROCm and say why the ROCm backend is off, so it resolves its
//! ~40 HIP symbols itself through `libloading`, the same way the NCCL/RCCL loader does.

use std::ffi::{c_void, CStr};
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::sys;

/// Why the HIP runtime could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
pub enum HipLoadError {
    /// No candidate loaded; every place tried, with the loader's message.
    #[error("HIP runtime (libamdhip64.so) not found; tried: {}", tried.iter().map(|(c, why)| format!("{c} ({why})")).collect::<Vec<_>>().join("; "))]
    NotFound {
        /// (candidate, why it failed).
        tried: Vec<(String, String)>,
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
    }
}

/// The loaded HIP runtime. Never unloaded (like NCCL/RCCL, the runtime starts threads that outlive handles).
pub struct HipLibrary {
    table: HipTable,
    path: PathBuf,
    version: i32,
    _lib: Option<std::mem::ManuallyDrop<libloading::Library>>,
}

impl fmt::Debug for HipLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HipLibrary").field("path", &self.path).field("version", &self.version).finish_non_exhaustive()
    }
}

/// The standard candidates: `ANYCCL_HIP_PATH`, the sonames of HIP 7, 6 and 5, then `$ROCM_PATH/lib` and
/// `/opt/rocm/lib`.
pub fn candidates(env: &dyn Fn(&str) -> Option<PathBuf>) -> Vec<PathBuf> {
    let mut c = Vec::new();
    if let Some(p) = env(ENV_HIP_PATH) {
        c.push(p);
    }
    for n in ["libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so"] {
        c.push(PathBuf::from(n));
    }
    for dir in env("ROCM_PATH").into_iter().chain([PathBuf::from("/opt/rocm")]) {
        c.push(dir.join("lib").join("libamdhip64.so"));
    }
    c
}

impl HipLibrary {
    /// Finds and loads the HIP runtime with the standard candidates from the process environment.
    pub fn load() -> Result<Self, HipLoadError> {
        let env = |k: &str| std::env::var_os(k).map(PathBuf::from).filter(|p| !p.as_os_str().is_empty());
        let mut tried = Vec::new();
        for c in candidates(&env) {
            match Self::open(&c) {
                Ok(l) => return Ok(l),
                Err(HipLoadError::NotFound { tried: t }) => tried.extend(t),
                Err(e) => tried.push((c.display().to_string(), e.to_string())),
            }
        }
        Err(HipLoadError::NotFound { tried })
    }

    /// Opens the library at `path` (or a bare soname) and resolves every symbol.
    pub fn open(path: &Path) -> Result<Self, HipLoadError> {
        // SAFETY: loading a shared library runs its initialisers; anyccl opens only HIP runtimes, by name or by
        // the user's explicit choice.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| HipLoadError::NotFound {
            tried: vec![(path.display().to_string(), anyccl_ccl::loader::dl_error_text(&e))],
        })?;
        let table = HipTable::resolve(path, &mut |name: &CStr| {
            // SAFETY: looking a symbol up only reads the library's dynamic symbol table.
            match unsafe { lib.get::<*const c_void>(name.to_bytes_with_nul()) } {
                Ok(sym) => *sym,
                Err(_) => std::ptr::null(),
            }
        })?;
        Ok(Self::finish(table, path.to_owned(), Some(std::mem::ManuallyDrop::new(lib))))
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
        HipLibrary { table, path, version, _lib: lib }
    }

    /// The resolved functions.
    pub fn table(&self) -> &HipTable {
        &self.table
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
