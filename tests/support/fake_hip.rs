//! The fake HIP runtime (`fake_hip.c`) and fake RCCL libraries whose collectives compute on its host-backed
//! "device" memory (`fake_rccl.c`), compiled at test time with the system `cc`. Each RCCL profile of
//! `fake_ccl.rs` gives the exported symbol set; the fake RCCL links the fake HIP runtime by soname, as the real
//! one links libamdhip64. Used through `#[path]` together with `fake_ccl.rs`.
#![allow(dead_code)]

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::fake_ccl::{self, Profile};

const HIP_C: &str = include_str!("fake_hip.c");
const RCCL_C: &str = include_str!("fake_rccl.c");
/// The fake HIP runtime's soname.
pub const HIP_SONAME: &str = "libamdhip64.so.6";

/// Symbols `fake_rccl.c` defines itself; those in `GUARDED` only when the release exports them.
const IMPLEMENTED: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommInitAll",
    "ncclCommDestroy",
    "ncclCommCount",
    "ncclCommUserRank",
    "ncclCommGetAsyncError",
    "ncclCommAbort",
    "ncclGetErrorString",
    "ncclGetLastError",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclAllReduce",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclBroadcast",
    "ncclReduce",
    "ncclSend",
    "ncclRecv",
];
const GUARDED: &[&str] = &[
    "ncclMemAlloc",
    "ncclMemFree",
    "ncclCommRegister",
    "ncclCommDeregister",
    "ncclCommWindowRegister",
    "ncclCommWindowDeregister",
];

/// The fake HIP runtime, built once per test process.
pub fn build_hip() -> PathBuf {
    fake_ccl::compile_once(
        &format!("hip/{HIP_SONAME}"),
        HIP_C,
        &[format!("-Wl,-soname,{HIP_SONAME}"), "-lpthread".into()],
    )
}

/// A computing fake RCCL with the symbol set of `p`, linked against the fake HIP runtime.
pub fn build_rccl(p: &Profile) -> PathBuf {
    let hip = build_hip();
    let hip_dir = hip.parent().expect("hip dir").display().to_string();
    let mut syms: Vec<&str> = anyccl_ccl::loader::REQUIRED_SYMBOLS.to_vec();
    syms.extend_from_slice(fake_ccl::BASE);
    syms.extend_from_slice(p.extra);
    let mut c = format!("#define FAKE_VERSION {}\n", p.version);
    for s in syms.iter().filter(|s| GUARDED.contains(s)) {
        let _ = writeln!(c, "#define HAVE_{s} 1");
    }
    c.push_str(RCCL_C);
    for s in syms.iter().filter(|s| !IMPLEMENTED.contains(s) && !GUARDED.contains(s)) {
        let _ = writeln!(c, "int {s}(void) {{ return 0; }}");
    }
    fake_ccl::compile_once(
        &format!("compute/{}", p.file),
        &c,
        &[format!("-L{hip_dir}"), format!("-l:{HIP_SONAME}"), format!("-Wl,-rpath,{hip_dir}"), "-lpthread".into()],
    )
}

/// The fake HIP runtime's test interface, reached through the same loaded copy the backend uses.
pub struct FakeHip {
    lib: libloading::Library,
}

impl FakeHip {
    /// Opens the fake runtime (already loaded by the backend or the fake RCCL: the same instance).
    pub fn open(path: &Path) -> Self {
        // SAFETY: the fake runtime built above; its initialisers do nothing.
        FakeHip { lib: unsafe { libloading::Library::new(path) }.expect("open the fake HIP runtime") }
    }

    /// Capture violations recorded so far.
    pub fn violations(&self) -> Vec<String> {
        // SAFETY: the fake exports these with these C signatures.
        unsafe {
            let count = self.lib.get::<unsafe extern "C" fn() -> i32>(b"fakehip_violation_count\0").expect("sym");
            let get = self
                .lib
                .get::<unsafe extern "C" fn(i32) -> *const std::ffi::c_char>(b"fakehip_violation\0")
                .expect("sym");
            (0..count()).map(|i| std::ffi::CStr::from_ptr(get(i)).to_string_lossy().into_owned()).collect()
        }
    }

    /// How often `name` was called.
    pub fn calls(&self, name: &str) -> i32 {
        let c = std::ffi::CString::new(name).expect("name");
        // SAFETY: as above.
        unsafe {
            let f = self.lib.get::<unsafe extern "C" fn(*const std::ffi::c_char) -> i32>(b"fakehip_call_count\0");
            f.expect("sym")(c.as_ptr())
        }
    }

    /// Clears the records.
    pub fn reset(&self) {
        // SAFETY: as above.
        unsafe { self.lib.get::<unsafe extern "C" fn()>(b"fakehip_reset\0").expect("sym")() }
    }

    /// Marks `stream` busy (its work never finishes, as with a peer that died) or idle again.
    pub fn set_busy(&self, stream: *mut std::ffi::c_void, busy: bool) {
        // SAFETY: as above.
        unsafe {
            let f = self.lib.get::<unsafe extern "C" fn(*mut std::ffi::c_void, i32)>(b"fakehip_set_busy\0");
            f.expect("sym")(stream, i32::from(busy))
        }
    }

    /// Makes the next `hipMalloc` return success with a null pointer, as a broken runtime might.
    pub fn next_malloc_null(&self) {
        // SAFETY: as above.
        unsafe { self.lib.get::<unsafe extern "C" fn()>(b"fakehip_next_malloc_null\0").expect("sym")() }
    }

    /// Makes `hipMemGetAddressRange` report every allocation `bytes` shorter than it is (0: the truth).
    pub fn set_range_shrink(&self, bytes: usize) {
        // SAFETY: as above.
        unsafe { self.lib.get::<unsafe extern "C" fn(usize)>(b"fakehip_set_range_shrink\0").expect("sym")(bytes) }
    }

    /// Calls `hipMalloc` directly (to prove the fake enforces the rules); returns HIP's status.
    pub fn raw_malloc(&self, bytes: usize) -> i32 {
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: hipMalloc writes one pointer.
        unsafe {
            let f = self.lib.get::<unsafe extern "C" fn(*mut *mut std::ffi::c_void, usize) -> i32>(b"hipMalloc\0");
            f.expect("sym")(&mut p, bytes)
        }
    }
}
