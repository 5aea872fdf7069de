//! The fake HIP runtime (`fake_hip.c`) and fake RCCL libraries whose collectives compute on its host-backed
//! "device" memory (`fake_rccl.c`), compiled at test time with the system `cc`. Each RCCL profile of
//! `fake_ccl.rs` gives the exported symbol set; the fake RCCL links the fake HIP runtime by soname, as the real
//! one links libamdhip64. Used through `#[path]` together with `fake_ccl.rs`.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

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

fn cc(args: &[&str], out: &Path, src: &Path, extra: &[String]) {
    let tmp = out.with_extension(format!("tmp{}", std::process::id()));
    let st = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-shared", "-fPIC", "-O1", "-std=gnu11"])
        .args(args)
        .arg("-o")
        .arg(&tmp)
        .arg(src)
        .args(extra)
        .status()
        .expect("the system C compiler (cc) runs");
    assert!(st.success(), "cc failed for {}", out.display());
    std::fs::rename(&tmp, out).expect("rename");
}

fn once(key: &str, build: impl FnOnce() -> PathBuf) -> PathBuf {
    static BUILT: std::sync::Mutex<BTreeMap<String, PathBuf>> = std::sync::Mutex::new(BTreeMap::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = built.get(key) {
        return p.clone();
    }
    let p = build();
    built.insert(key.to_owned(), p.clone());
    p
}

/// The fake HIP runtime, built once per test process.
pub fn build_hip() -> PathBuf {
    once("hip", || {
        let dir = fake_ccl::fake_dir().join("hip");
        std::fs::create_dir_all(&dir).expect("dir");
        let src = dir.join("fake_hip.c");
        std::fs::write(&src, HIP_C).expect("write C");
        let out = dir.join(HIP_SONAME);
        cc(&[&format!("-Wl,-soname,{HIP_SONAME}")], &out, &src, &["-lpthread".into()]);
        out
    })
}

/// A computing fake RCCL with the symbol set of `p`, linked against the fake HIP runtime.
pub fn build_rccl(p: &Profile) -> PathBuf {
    let hip = build_hip();
    once(&format!("rccl:{}", p.file), || {
        let out = fake_ccl::fake_dir().join("compute").join(p.file);
        let dir = out.parent().expect("parent").to_owned();
        std::fs::create_dir_all(&dir).expect("dir");
        let mut syms: Vec<&str> = anyccl_ccl::loader::REQUIRED_SYMBOLS.to_vec();
        syms.extend_from_slice(fake_ccl::BASE);
        syms.extend_from_slice(p.extra);
        let mut c = format!("#define FAKE_VERSION {}\n", p.version);
        for s in &syms {
            if GUARDED.contains(s) {
                let _ = writeln!(c, "#define HAVE_{s} 1");
            }
        }
        c.push_str(RCCL_C);
        for s in syms.iter().filter(|s| !IMPLEMENTED.contains(s) && !GUARDED.contains(s)) {
            let _ = writeln!(c, "int {s}(void) {{ return 0; }}");
        }
        let src = dir.join(format!("{}.c", out.file_name().expect("name").to_string_lossy()));
        std::fs::write(&src, c).expect("write C");
        let hip_dir = hip.parent().expect("hip dir").display().to_string();
        cc(
            &[],
            &out,
            &src,
            &[format!("-L{hip_dir}"), format!("-l:{HIP_SONAME}"), format!("-Wl,-rpath,{hip_dir}"), "-lpthread".into()],
        );
        out
    })
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
