//! Tells the build scripts of the kernel crates (anyccl-kernels-cuda, anyccl-kernels-hip) where the shared kernel
//! headers are: they read it as `DEP_ANYCCL_KERNELS_COMMON_INCLUDE` and pass it to nvcc and hipcc with `-I`.

use std::path::PathBuf;

fn main() {
    let dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let include = dir.join("include");
    println!("cargo:rerun-if-changed=include");
    println!("cargo:include={}", include.display());
}
