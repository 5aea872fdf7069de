//! The fake CUDA driver (`libcuda.so.1`: `fake_hip.c` and the CUDA driver API facade `fake_cuda.c` compiled as one
//! translation unit, so it shares the fake HIP runtime's memory, streams, graphs, capture rules, IPC and kernel
//! emulation) and a computing fake NCCL (`fake_rccl.c` with an NCCL profile's symbol set, linked against that
//! driver by soname, as the fake RCCL links the fake HIP runtime), compiled at test time with the system `cc`.
//! Used together with [`crate::fake_hip`] (whose `FakeHip` reads the records: the
//! driver exports the `fakehip_*` test interface too).

use std::path::PathBuf;

use crate::fake_ccl::{self, Profile};

const HIP_C: &str = include_str!("../c/fake_hip.c");
const CUDA_C: &str = include_str!("../c/fake_cuda.c");
/// The fake driver's soname.
pub const CUDA_SONAME: &str = "libcuda.so.1";

/// The fake CUDA driver, built once per test process: `<dir>/libcuda.so.1`, with `<dir>/libcuda.so` linking to it
/// (the first name cudarc tries), so a process started with `LD_LIBRARY_PATH=<dir>` loads it by either name.
pub fn build_cuda() -> PathBuf {
    // Once per process: the tests of a binary call this from several threads, and the link is made here.
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(build_cuda_uncached).clone()
}

fn build_cuda_uncached() -> PathBuf {
    let source = format!("{HIP_C}\n/* ---- fake_cuda.c ---- */\n{CUDA_C}");
    // The host kernels first: the libraries after them resolve their references.
    let mut args = fake_ccl::host_kernel_args();
    args.extend([
        format!("-Wl,-soname,{CUDA_SONAME}"),
        // nodelete: the streams' worker threads run code of the library (see fake_hip.rs).
        "-Wl,-z,nodelete".into(),
        "-lpthread".into(),
        // The host kernels' and the multicast emulation's f32 arithmetic (see fake_hip.rs).
        "-lm".into(),
        "-ffp-contract=off".into(),
    ]);
    let lib = fake_ccl::compile_once(&format!("cuda/{CUDA_SONAME}"), &source, &args);
    let dir = lib.parent().expect("the fake driver's folder");
    let link = dir.join("libcuda.so");
    if std::fs::read_link(&link).ok().as_deref() != Some(std::path::Path::new(CUDA_SONAME)) {
        let tmp = dir.join(format!(".libcuda.so.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(CUDA_SONAME, &tmp).expect("symlink libcuda.so");
        std::fs::rename(&tmp, &link).expect("rename the libcuda.so link");
    }
    lib
}

/// A computing fake NCCL with the symbol set of `p`, linked against the fake CUDA driver (whose `hipMalloc` and
/// `fakehip_enqueue` it calls).
pub fn build_nccl(p: &Profile) -> PathBuf {
    fake_ccl::build_computing(p, "cuda-compute", &build_cuda())
}

/// What the fake driver's multicast emulation (`FAKECUDA_MULTICAST=1`) holds alive now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct McLive {
    /// Multicast objects (freed once no handle, mapping or exported descriptor refers to them).
    pub objects: i32,
    /// Allocation handles (multicast and physical) not released.
    pub handles: i32,
    /// Physical allocations (`cuMemCreate`) not freed.
    pub allocations: i32,
    /// Bindings of memory to multicast objects.
    pub bindings: i32,
    /// Address reservations not freed.
    pub reservations: i32,
    /// Mappings (physical or multicast) not unmapped.
    pub mappings: i32,
}

/// A line of [`FakeMulticast::log`] reduced to its call and the kind of handle it names (`"cuMemRelease mc"` of
/// `"cuMemRelease mc#0 ..."`; the call alone where it names none).
pub fn call_kind(line: &str) -> String {
    let mut words = line.split_whitespace();
    let call = words.next().unwrap_or_default();
    match words.next().and_then(|w| w.split_once('#')) {
        Some((kind, _)) => format!("{call} {kind}"),
        None => call.to_owned(),
    }
}

/// The [`call_kind`]s that set up one NVLS buffer of a rank, in the order the multicast log holds them: the
/// physical memory created, mapped and made accessible, bound to the multicast object, then mapped through the
/// multicast handle.
pub const BUFFER_SETUP_CALLS: [&str; 8] = [
    "cuMemCreate mem",
    "cuMemAddressReserve",
    "cuMemMap mem",
    "cuMemSetAccess mem",
    "cuMulticastBindMem mc",
    "cuMemAddressReserve",
    "cuMemMap mc",
    "cuMemSetAccess mc",
];

/// The fake driver's multicast records, read through its test interface (`fakecuda_mc_*`).
pub struct FakeMulticast {
    lib: libloading::Library,
}

impl FakeMulticast {
    /// Opens the fake driver at `path` (already loaded by the process: the same instance).
    pub fn open(path: &std::path::Path) -> Self {
        // SAFETY: the fake driver, which has no initialisers beyond its statics.
        FakeMulticast { lib: unsafe { libloading::Library::new(path) }.expect("open the fake CUDA driver") }
    }

    /// The multicast call log since the last reset, one entry per line ("cuMulticastCreate mc#0 ...").
    pub fn log(&self) -> Vec<String> {
        // SAFETY: the symbol's C signature; it writes at most `n` bytes into the buffer.
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn(*mut u8, usize) -> usize>(b"fakecuda_mc_log\0")
                .expect("fakecuda_mc_log");
            let mut buf = vec![0u8; 1 << 16];
            let n = f(buf.as_mut_ptr(), buf.len());
            buf.truncate(n);
            String::from_utf8_lossy(&buf).lines().map(str::to_owned).collect()
        }
    }

    /// Makes the `nth` call of `name` from now on fail (`CUDA_ERROR_OUT_OF_MEMORY`); `nth` 0 fails none.
    pub fn fail(&self, name: &str, nth: i32) {
        let name = std::ffi::CString::new(name).expect("a call name");
        // SAFETY: the symbol's C signature; the name is a NUL-terminated string it copies.
        unsafe {
            self.lib.get::<unsafe extern "C" fn(*const std::ffi::c_char, i32)>(b"fakecuda_mc_fail\0").expect("sym")(
                name.as_ptr(),
                nth,
            )
        }
    }

    /// Clears the log.
    pub fn reset(&self) {
        // SAFETY: the symbol's C signature.
        unsafe { self.lib.get::<unsafe extern "C" fn()>(b"fakecuda_mc_log_reset\0").expect("sym")() }
    }

    /// What is alive now.
    pub fn live(&self) -> McLive {
        let mut v = [0i32; 6];
        // SAFETY: the symbol's C signature; it writes six ints.
        unsafe {
            self.lib.get::<unsafe extern "C" fn(*mut i32)>(b"fakecuda_mc_live\0").expect("fakecuda_mc_live")(
                v.as_mut_ptr(),
            )
        };
        McLive { objects: v[0], handles: v[1], allocations: v[2], bindings: v[3], reservations: v[4], mappings: v[5] }
    }
}
