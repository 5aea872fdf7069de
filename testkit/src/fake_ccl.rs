//! Fake NCCL/RCCL libraries, compiled at test time from C with the system `cc`: each exports the symbol set of
//! one release. Shared by the loader's tests (backends/ccl/tests), the CLI tests and the
//! backends' tests.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyccl_ccl::loader::REQUIRED_SYMBOLS;

pub const BASE: &[&str] =
    &["ncclCommInitAll", "ncclCommInitRankConfig", "ncclCommFinalize", "ncclGetLastError", "ncclRedOpCreatePreMulSum"];

/// The computing fake library's C source (fake_rccl.c), over a fake runtime's memory and streams.
const COMPUTING_C: &str = include_str!("../c/fake_rccl.c");

/// Symbols `fake_rccl.c` defines itself; those in [`COMPUTING_GUARDED`] only when the release exports them.
const COMPUTING_IMPLEMENTED: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommInitAll",
    "ncclCommDestroy",
    "ncclCommCount",
    "ncclCommUserRank",
    "ncclCommCuDevice",
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
/// Symbols `fake_rccl.c` defines under `#ifdef HAVE_<symbol>`, set for the releases that export them.
const COMPUTING_GUARDED: &[&str] = &[
    "ncclMemAlloc",
    "ncclMemFree",
    "ncclCommRegister",
    "ncclCommDeregister",
    "ncclCommWindowRegister",
    "ncclCommWindowDeregister",
    "ncclCommSplit",
    "ncclAllReduceConfig",
    "ncclAllGatherConfig",
    "ncclReduceScatterConfig",
    "ncclBroadcastConfig",
    "ncclReduceConfig",
];

/// A computing fake collective library (`fake_rccl.c`) with the symbol set of `p`, built once per process at
/// `<folder>/<p.file>` and linked by soname against the fake runtime `runtime` (the fake HIP runtime, or the fake
/// CUDA driver built over it), whose memory, streams and `fakehip_enqueue` it uses, as the real RCCL links
/// libamdhip64 and NCCL the CUDA driver. Symbols it does not implement get a stub returning 0.
pub fn build_computing(p: &Profile, folder: &str, runtime: &Path) -> PathBuf {
    let dir = runtime.parent().expect("the fake runtime's folder").display().to_string();
    let soname = runtime.file_name().expect("the fake runtime's name").to_string_lossy().into_owned();
    let mut syms: Vec<&str> = REQUIRED_SYMBOLS.to_vec();
    syms.extend_from_slice(BASE);
    syms.extend_from_slice(p.extra);
    let mut c = format!("#define FAKE_VERSION {}\n", p.version);
    for s in syms.iter().filter(|s| COMPUTING_GUARDED.contains(s)) {
        let _ = writeln!(c, "#define HAVE_{s} 1");
    }
    c.push_str(COMPUTING_C);
    for s in syms.iter().filter(|s| !COMPUTING_IMPLEMENTED.contains(s) && !COMPUTING_GUARDED.contains(s)) {
        let _ = writeln!(c, "int {s}(void) {{ return 0; }}");
    }
    compile_once(
        &format!("{folder}/{}", p.file),
        &c,
        &[format!("-L{dir}"), format!("-l:{soname}"), format!("-Wl,-rpath,{dir}"), "-lpthread".into()],
    )
}

pub struct Profile {
    pub file: &'static str,
    pub version: i32,
    pub extra: &'static [&'static str],
}

pub const NCCL_2_17: Profile = Profile { file: "nccl-2.17/libnccl.so.2", version: 21701, extra: &[] };
pub const NCCL_2_18: Profile = Profile { file: "nccl-2.18/libnccl.so.2", version: 21803, extra: &["ncclCommSplit"] };
pub const NCCL_2_26: Profile = Profile {
    file: "nccl-2.26/libnccl.so.2",
    version: 22605,
    extra: &[
        "ncclCommSplit",
        "ncclCommRegister",
        "ncclCommDeregister",
        "ncclMemAlloc",
        "ncclMemFree",
        "ncclGroupSimulateEnd",
        "ncclCommInitRankScalable",
    ],
};
pub const NCCL_2_28: Profile = Profile {
    file: "nccl-2.28/libnccl.so.2",
    version: 22809,
    extra: &[
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
    ],
};
pub const RCCL_6_2: Profile = Profile {
    file: "rocm-6.2/librccl.so.1",
    version: 22005,
    extra: &[
        "ncclCommSplit",
        "ncclCommRegister",
        "ncclCommDeregister",
        "ncclMemAlloc",
        "ncclMemFree",
        "ncclAllToAllv",
        "mscclLoadAlgo",
    ],
};
pub const RCCL_7_0: Profile = Profile {
    file: "rocm-7.0/librccl.so.1",
    version: 22606,
    extra: &[
        "ncclCommSplit",
        "ncclCommRegister",
        "ncclCommDeregister",
        "ncclMemAlloc",
        "ncclMemFree",
        "ncclGroupSimulateEnd",
        "ncclCommInitRankScalable",
        "ncclAllToAllv",
        "mscclLoadAlgo",
    ],
};
pub const RCCL_7_1: Profile = Profile {
    file: "rocm-7.1/librccl.so.1",
    version: 22707,
    extra: &[
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
        "ncclAllToAllv",
        "mscclLoadAlgo",
        "ncclAllReduceWithBias",
    ],
};

/// What NCCL 2.30 and newer export beyond [`BASE`] (the 2.28 set, and what 2.28.9 and 2.29.7 added).
pub const NCCL_2_30_EXTRA: &[&str] = &[
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
    "ncclAlltoAll",
    "ncclCommRevoke",
    "ncclCommGrow",
    "ncclCommSuspend",
    "ncclCommResume",
    "ncclGetMultimemDevicePointer",
];
/// NCCL 2.30 before 2.30.7: windows, but not registered during graph capture.
pub const NCCL_2_30_3: Profile = Profile { file: "nccl-2.30.3/libnccl.so.2", version: 23003, extra: NCCL_2_30_EXTRA };
/// NCCL 2.30.7: the first that registers windows during graph capture.
pub const NCCL_2_30_7: Profile = Profile { file: "nccl-2.30.7/libnccl.so.2", version: 23007, extra: NCCL_2_30_EXTRA };
/// What NCCL 2.31 and newer export beyond [`BASE`]: [`NCCL_2_30_EXTRA`] and the per-call config collectives.
pub const NCCL_2_31_EXTRA: &[&str] = &[
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
    "ncclAlltoAll",
    "ncclCommRevoke",
    "ncclCommGrow",
    "ncclCommSuspend",
    "ncclCommResume",
    "ncclGetMultimemDevicePointer",
    "ncclAllReduceConfig",
    "ncclAllGatherConfig",
    "ncclReduceScatterConfig",
    "ncclBroadcastConfig",
    "ncclReduceConfig",
    "ncclAlltoAllConfig",
    "ncclGatherConfig",
    "ncclScatterConfig",
];
/// NCCL 2.31.2: the per-call config.
pub const NCCL_2_31: Profile = Profile { file: "nccl-2.31/libnccl.so.2", version: 23102, extra: NCCL_2_31_EXTRA };
pub const NCCL_2_32: Profile = Profile { file: "nccl-2.32/libnccl.so.2", version: 23203, extra: NCCL_2_31_EXTRA };
/// RCCL 2.27.7 of production ROCm 7.2.x: the ROCm 7.1 symbol set.
pub const RCCL_7_2: Profile = Profile { file: "rocm-7.2/librccl.so.1", version: 22707, extra: RCCL_7_1.extra };
/// RCCL 2.30.4 (ROCm 7.14, 10.0): fails to register windows inside graph capture.
pub const RCCL_2_30_4: Profile = Profile { file: "rccl-2.30.4/librccl.so.1", version: 23004, extra: RCCL_7_1.extra };
/// RCCL 2.30.7: registers windows inside graph capture.
pub const RCCL_2_30_7: Profile = Profile { file: "rccl-2.30.7/librccl.so.1", version: 23007, extra: RCCL_7_1.extra };

/// C source of a fake library exporting `symbols`; `ncclGetVersion` answers `version` with status `status`.
pub fn c_source(symbols: &[&str], version: i32, version_status: i32) -> String {
    let mut s = String::from(
        "#include <stdlib.h>\n#include <string.h>\n\
         typedef struct { char internal[128]; } ncclUniqueId;\n\
         struct fake_comm { int n; int rank; };\n",
    );
    for sym in symbols {
        let body = match *sym {
            "ncclGetVersion" => format!("int ncclGetVersion(int* v) {{ *v = {version}; return {version_status}; }}"),
            "ncclGetUniqueId" => {
                "int ncclGetUniqueId(ncclUniqueId* id) { memset(id->internal, 0x5a, 128); id->internal[0] = 1; return 0; }"
                    .to_owned()
            }
            "ncclCommInitRank" => "int ncclCommInitRank(void** c, int n, ncclUniqueId id, int r) { \
                 if (id.internal[0] != 1) return 4; struct fake_comm* f = malloc(sizeof *f); f->n = n; f->rank = r; \
                 *c = f; return 0; }"
                .to_owned(),
            "ncclCommDestroy" => "int ncclCommDestroy(void* c) { free(c); return 0; }".to_owned(),
            "ncclCommAbort" => "int ncclCommAbort(void* c) { free(c); return 0; }".to_owned(),
            "ncclCommCount" => "int ncclCommCount(void* c, int* n) { *n = ((struct fake_comm*)c)->n; return 0; }".into(),
            "ncclCommUserRank" => {
                "int ncclCommUserRank(void* c, int* r) { *r = ((struct fake_comm*)c)->rank; return 0; }".into()
            }
            "ncclCommGetAsyncError" => "int ncclCommGetAsyncError(void* c, int* e) { *e = 0; return 0; }".into(),
            "ncclGetErrorString" => "const char* ncclGetErrorString(int s) { return s == 4 ? \
                 \"invalid argument (fake)\" : \"unhandled error (fake)\"; }"
                .into(),
            "ncclGetLastError" => "const char* ncclGetLastError(void* c) { return \"fake last error\\033[2J\\n\"; }".into(),
            other => format!("int {other}(void) {{ return 0; }}"),
        };
        s.push_str(&body);
        s.push('\n');
    }
    s
}

pub fn fake_dir() -> PathBuf {
    crate::scratch_dir().join("fake-ccl")
}

/// The arguments that link the kernel source of anyccl-kernels-common, compiled for the host by the build script
/// (`c/host_kernels.cpp`), into a fake runtime (fake_hip.c includes `host_kernels.h` and runs every launch through
/// it). Panics with the build script's reason when that compile failed.
pub fn host_kernel_args() -> Vec<String> {
    let object = env!("ANYCCL_TESTKIT_HOST_KERNELS");
    assert!(
        !object.is_empty(),
        "the fakes' host kernels were not built: {}",
        env!("ANYCCL_TESTKIT_HOST_KERNELS_ERROR")
    );
    vec![format!("-I{}", concat!(env!("CARGO_MANIFEST_DIR"), "/c")), object.to_owned()]
}

/// Compiles a fake library at `fake_dir()/rel`, once per test process (tests run on parallel threads).
pub fn build(rel: &str, symbols: &[&str], version: i32, version_status: i32) -> PathBuf {
    compile_once(rel, &c_source(symbols, version, version_status), &[])
}

/// Writes `source` beside `fake_dir()/rel` and compiles it there as a shared library with the system `cc` (and
/// `extra` arguments after the source), once per test process: later calls for `rel` return the first result.
/// The output appears under its final name only when complete.
pub fn compile_once(rel: &str, source: &str, extra: &[String]) -> PathBuf {
    static BUILT: std::sync::Mutex<BTreeMap<String, PathBuf>> = std::sync::Mutex::new(BTreeMap::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = built.get(rel) {
        return p.clone();
    }
    let out = fake_dir().join(rel);
    let dir = out.parent().expect("parent").to_owned();
    std::fs::create_dir_all(&dir).expect("fake dir");
    let name = out.file_name().expect("name").to_string_lossy().into_owned();
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, source).expect("write C");
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    let st = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-shared", "-fPIC", "-O1", "-std=gnu11", "-o"])
        .arg(&tmp)
        .arg(&src)
        .args(extra)
        .status()
        .expect("the system C compiler (cc) runs");
    assert!(st.success(), "cc failed for {rel}");
    std::fs::rename(&tmp, &out).expect("rename");
    built.insert(rel.to_owned(), out.clone());
    out
}

pub fn build_profile(p: &Profile) -> PathBuf {
    let mut syms: Vec<&str> = REQUIRED_SYMBOLS.to_vec();
    syms.extend_from_slice(BASE);
    syms.extend_from_slice(p.extra);
    build(p.file, &syms, p.version, 0)
}

/// The plain fake `ncclCommDestroy` of [`c_source`], which [`SLOW_DESTROY`] replaces.
pub const PLAIN_DESTROY: &str = "int ncclCommDestroy(void* c) { free(c); return 0; }";

/// An `ncclCommDestroy` that is slow the way NCCL's own is (about 500 ms on an H200), under the test's control:
/// it blocks while the gate is closed (`fake_close_destroy_gate` / `fake_open_destroy_gate`; open at load), then
/// sleeps `FAKE_CCL_DESTROY_DELAY_MS` milliseconds when that variable is set (for a child process, whose
/// environment is fixed at its start), and then writes `destroyed` to the file `FAKE_CCL_DESTROY_MARKER` names,
/// when set (so a child can prove its destroy finished before the process ended). `fake_destroys_started` and
/// `fake_destroys_done` count calls entered and finished.
pub const SLOW_DESTROY: &str = "static int destroy_gate_closed = 0, destroys_started = 0, destroys_done = 0;\n\
    void fake_close_destroy_gate(void) { __atomic_store_n(&destroy_gate_closed, 1, __ATOMIC_SEQ_CST); }\n\
    void fake_open_destroy_gate(void) { __atomic_store_n(&destroy_gate_closed, 0, __ATOMIC_SEQ_CST); }\n\
    int fake_destroys_started(void) { return __atomic_load_n(&destroys_started, __ATOMIC_SEQ_CST); }\n\
    int fake_destroys_done(void) { return __atomic_load_n(&destroys_done, __ATOMIC_SEQ_CST); }\n\
    int ncclCommDestroy(void* c) {\n\
        __atomic_add_fetch(&destroys_started, 1, __ATOMIC_SEQ_CST);\n\
        struct timespec tick = { 0, 1000000 };\n\
        while (__atomic_load_n(&destroy_gate_closed, __ATOMIC_SEQ_CST)) nanosleep(&tick, 0);\n\
        const char* delay = getenv(\"FAKE_CCL_DESTROY_DELAY_MS\");\n\
        if (delay) { long ms = atol(delay); struct timespec d = { ms / 1000, (ms % 1000) * 1000000 }; nanosleep(&d, 0); }\n\
        free(c);\n\
        const char* marker = getenv(\"FAKE_CCL_DESTROY_MARKER\");\n\
        if (marker) { FILE* f = fopen(marker, \"w\"); if (f) { fputs(\"destroyed\\n\", f); fclose(f); } }\n\
        __atomic_add_fetch(&destroys_done, 1, __ATOMIC_SEQ_CST);\n\
        return 0;\n\
    }";

/// A fake library with the symbol set of `p` whose `ncclCommDestroy` is [`SLOW_DESTROY`].
pub fn build_slow_destroy(p: &Profile) -> PathBuf {
    let mut syms: Vec<&str> = REQUIRED_SYMBOLS.to_vec();
    syms.extend_from_slice(BASE);
    syms.extend_from_slice(p.extra);
    let plain = c_source(&syms, p.version, 0);
    assert!(plain.contains(PLAIN_DESTROY), "the fake's destroy body changed; update SLOW_DESTROY");
    let source = format!("#include <stdio.h>\n#include <time.h>\n{}", plain.replace(PLAIN_DESTROY, SLOW_DESTROY));
    compile_once(&format!("slow-destroy/{}", p.file), &source, &[])
}

/// The test hooks of a library built by [`build_slow_destroy`].
pub struct DestroyHooks {
    pub close_gate: unsafe extern "C" fn(),
    pub open_gate: unsafe extern "C" fn(),
    pub started: unsafe extern "C" fn() -> std::ffi::c_int,
    pub done: unsafe extern "C" fn() -> std::ffi::c_int,
}

impl DestroyHooks {
    /// Opens the library at `path` once more (the same loaded copy) and keeps it mapped for the process, so the
    /// hooks stay callable after the loader's own handle is gone.
    pub fn open(path: &std::path::Path) -> Self {
        // SAFETY: the fake built by `build_slow_destroy`; its initialisers do nothing, and it exports these four
        // functions with these C signatures. The handle is leaked, so the code stays mapped.
        unsafe {
            let lib = libloading::Library::new(path).expect("reopen the fake");
            let hooks = DestroyHooks {
                close_gate: *lib.get(b"fake_close_destroy_gate\0").expect("close_gate"),
                open_gate: *lib.get(b"fake_open_destroy_gate\0").expect("open_gate"),
                started: *lib.get(b"fake_destroys_started\0").expect("started"),
                done: *lib.get(b"fake_destroys_done\0").expect("done"),
            };
            std::mem::forget(lib);
            hooks
        }
    }
}
