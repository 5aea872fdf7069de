//! Gives the crate an `OUT_DIR` (its scratch folder for the fakes), rebuilds it when a fake's source changes, and,
//! with the `fakes` feature, compiles the kernel source of anyccl-kernels-common for the host
//! (`c/host_kernels.cpp` over `vendor_host.h`) into an object the fake HIP runtime and the fake CUDA driver link, so
//! they run the very kernels the GPUs run. The object's path reaches the crate as `ANYCCL_TESTKIT_HOST_KERNELS`;
//! when the C++ compiler (`CXX`, else `c++`) is missing or fails, that is empty and
//! `ANYCCL_TESTKIT_HOST_KERNELS_ERROR` says why, and a test that builds a fake fails with it.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    for f in ["c/fake_cuda.c", "c/fake_hip.c", "c/fake_rccl.c", "c/host_kernels.cpp", "c/host_kernels.h"] {
        println!("cargo:rerun-if-changed={f}");
    }
    println!("cargo:rerun-if-changed=../kernels-common/include");
    println!("cargo:rerun-if-changed=../kernels-common/host");
    println!("cargo:rerun-if-env-changed=CXX");
    if std::env::var_os("CARGO_FEATURE_FAKES").is_none() {
        return;
    }
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("host_kernels.o");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let result = Command::new(&cxx)
        .args(["-std=c++17", "-O2", "-fPIC", "-ffp-contract=off", "-fno-strict-aliasing", "-fno-exceptions"])
        .args(["-fno-rtti", "-Wall", "-Wno-unknown-pragmas", "-c", "-o"])
        .arg(&out)
        .arg(format!("-I{}", manifest.join("../kernels-common/host").display()))
        .arg(format!("-I{}", manifest.join("../kernels-common/include").display()))
        .arg(manifest.join("c/host_kernels.cpp"))
        .status();
    match result {
        Ok(s) if s.success() => {
            println!("cargo:rustc-env=ANYCCL_TESTKIT_HOST_KERNELS={}", out.display());
            println!("cargo:rustc-env=ANYCCL_TESTKIT_HOST_KERNELS_ERROR=");
        }
        other => {
            let why = match other {
                Ok(s) => format!("{cxx} failed ({s}) on c/host_kernels.cpp"),
                Err(e) => format!("the C++ compiler {cxx} did not run: {e}"),
            };
            println!("cargo:warning=the fakes' host kernels were not built: {why}");
            println!("cargo:rustc-env=ANYCCL_TESTKIT_HOST_KERNELS=");
            println!("cargo:rustc-env=ANYCCL_TESTKIT_HOST_KERNELS_ERROR={why}");
        }
    }
}
