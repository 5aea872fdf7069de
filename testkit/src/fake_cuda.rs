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
    let lib = fake_ccl::compile_once(
        &format!("cuda/{CUDA_SONAME}"),
        &source,
        // nodelete: the streams' worker threads run code of the library (see fake_hip.rs).
        &[
            format!("-Wl,-soname,{CUDA_SONAME}"),
            "-Wl,-z,nodelete".into(),
            "-lpthread".into(),
            // The emulated kernels' f32 arithmetic (see fake_hip.rs).
            "-lm".into(),
            "-ffp-contract=off".into(),
        ],
    );
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
