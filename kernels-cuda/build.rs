//! Compiles cuda/*.cu with nvcc into cubins (machine code, no PTX: PTX from a newer nvcc does not load on an older
//! driver) for sm_80 and sm_90, and sm_100 where this nvcc supports it, and embeds them. Without nvcc the crate
//! still builds and says why it holds no kernels.
//!
//! The one-shot and two-shot all-reduce come from the shared source of `anyccl-kernels-common` (its include
//! directory arrives as `DEP_ANYCCL_KERNELS_COMMON_INCLUDE` and goes to nvcc with `-I`); `cuda/allreduce.cu`
//! instantiates them and adds the CUDA-only NVLS kernels.
//!
//! nvcc is found through `NVCC`, `ANYCCL_CUDA_TOOLKIT/bin`, `CUDA_HOME/bin`, `CUDA_PATH/bin`, then `PATH`
//! (`ci/install-cuda.sh` installs the PyPI `nvidia-cuda-nvcc` toolkit and sets `ANYCCL_CUDA_TOOLKIT`).

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

const SOURCES: &[&str] = &["allreduce"];
const ARCHS: &[&str] = &["sm_80", "sm_90", "sm_100"];

fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = env::var_os("NVCC") {
        return Some(PathBuf::from(p));
    }
    for var in ["ANYCCL_CUDA_TOOLKIT", "CUDA_HOME", "CUDA_PATH"] {
        if let Some(h) = env::var_os(var) {
            let p = Path::new(&h).join("bin").join("nvcc");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    env::var_os("PATH").and_then(|paths| env::split_paths(&paths).map(|d| d.join("nvcc")).find(|p| p.is_file()))
}

fn main() {
    for var in ["NVCC", "ANYCCL_CUDA_TOOLKIT", "CUDA_HOME", "CUDA_PATH", "PATH"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    for s in SOURCES {
        println!("cargo:rerun-if-changed=cuda/{s}.cu");
    }
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let mut code = String::new();
    let status = match (find_nvcc(), common_include()) {
        (None, _) => Err("nvcc not found at build time (set NVCC, ANYCCL_CUDA_TOOLKIT or CUDA_HOME)".to_owned()),
        (_, Err(why)) => Err(why),
        (Some(nvcc), Ok(include)) => build(&nvcc, &include, &out, &mut code),
    };
    match status {
        Ok(version) => {
            let _ = writeln!(code, "/// The nvcc that built the kernels.\npub const NVCC_VERSION: &str = {version:?};");
            let _ = writeln!(
                code,
                "/// Why no kernels are embedded (`None`: they are).\npub const NOT_BUILT: Option<&str> = None;"
            );
        }
        Err(why) => {
            println!("cargo:warning=anyccl-kernels-cuda: custom kernels not compiled in: {why}");
            code.clear();
            let _ = writeln!(
                code,
                "/// Every embedded cubin: (source, arch, bytes).\npub static CUBINS: &[(&str, &str, &[u8])] = &[];"
            );
            let _ = writeln!(code, "/// The nvcc that built the kernels.\npub const NVCC_VERSION: &str = \"\";");
            let _ = writeln!(code, "/// Why no kernels are embedded (`None`: they are).\npub const NOT_BUILT: Option<&str> = Some({why:?});");
        }
    }
    std::fs::write(out.join("kernels.rs"), code).expect("write kernels.rs");
}

/// The shared kernel headers' directory, from anyccl-kernels-common's `links` metadata; every header in it is
/// watched for changes.
fn common_include() -> Result<PathBuf, String> {
    let dir = env::var_os("DEP_ANYCCL_KERNELS_COMMON_INCLUDE")
        .map(PathBuf::from)
        .ok_or("DEP_ANYCCL_KERNELS_COMMON_INCLUDE is not set (anyccl-kernels-common is a dependency)")?;
    let headers = dir.join("anyccl");
    let entries = std::fs::read_dir(&headers).map_err(|e| format!("cannot list {}: {e}", headers.display()))?;
    for e in entries.flatten() {
        println!("cargo:rerun-if-changed={}", e.path().display());
    }
    Ok(dir)
}

fn build(nvcc: &Path, include: &Path, out: &Path, code: &mut String) -> Result<String, String> {
    let version =
        Command::new(nvcc).arg("--version").output().map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
    let version = String::from_utf8_lossy(&version.stdout).lines().last().unwrap_or("").trim().to_owned();
    let listed =
        Command::new(nvcc).arg("--list-gpu-code").output().map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    let supported = |arch: &str| listed.as_ref().map_or(arch != "sm_100", |l| l.split_whitespace().any(|a| a == arch));
    let _ = writeln!(
        code,
        "/// Every embedded cubin: (source, arch, bytes).\npub static CUBINS: &[(&str, &str, &[u8])] = &["
    );
    let mut built = 0;
    for src in SOURCES {
        for arch in ARCHS.iter().filter(|a| supported(a)) {
            let cubin = out.join(format!("{src}.{arch}.cubin"));
            let o = Command::new(nvcc)
                .args(["-cubin", "-O3", "-std=c++17", &format!("-arch={arch}")])
                .arg("-I")
                .arg(include)
                .arg("-o")
                .arg(&cubin)
                .arg(Path::new("cuda").join(format!("{src}.cu")))
                .output()
                .map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
            if !o.status.success() {
                return Err(format!("nvcc failed on {src}.cu for {arch}: {}", String::from_utf8_lossy(&o.stderr)));
            }
            let _ = writeln!(code, "    ({src:?}, {arch:?}, include_bytes!({:?})),", cubin.display().to_string());
            built += 1;
        }
    }
    let _ = writeln!(code, "];");
    if built == 0 {
        return Err("this nvcc supports none of sm_80, sm_90, sm_100".into());
    }
    Ok(version)
}
