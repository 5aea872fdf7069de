//! Compiles hip/*.hip with hipcc into AMDGPU code objects (raw ELF, one per target: `hipModuleLoadData` takes
//! them as they are) for gfx90a and gfx942 where this hipcc's clang knows the target, and embeds them. Without
//! hipcc the crate still builds and says why it holds no kernels.
//!
//! The kernels are the one-shot and two-shot all-reduce of the shared source of `anyccl-kernels-common` (the same
//! algorithm the CUDA kernels run; its include directory arrives as `DEP_ANYCCL_KERNELS_COMMON_INCLUDE` and goes
//! to hipcc with `-I`), instantiated by `hip/allreduce.hip` over the HIP vendor header.
//!
//! hipcc is found through `HIPCC`, `ROCM_PATH/bin`, `HIP_PATH/bin`, `/opt/rocm/bin`, then `PATH` (CI installs
//! Debian's `hipcc libamdhip64-dev rocm-device-libs`: HIP 5.2 with clang 15, which builds gfx90a but not gfx942).

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

const SOURCES: &[&str] = &["allreduce"];
const ARCHS: &[&str] = &["gfx90a", "gfx942"];

fn find_hipcc() -> Option<PathBuf> {
    if let Some(p) = env::var_os("HIPCC") {
        return Some(PathBuf::from(p));
    }
    for var in ["ROCM_PATH", "HIP_PATH"] {
        if let Some(h) = env::var_os(var) {
            let p = Path::new(&h).join("bin").join("hipcc");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    let opt = Path::new("/opt/rocm/bin/hipcc");
    if opt.is_file() {
        return Some(opt.to_owned());
    }
    env::var_os("PATH").and_then(|paths| env::split_paths(&paths).map(|d| d.join("hipcc")).find(|p| p.is_file()))
}

/// The first line of hipcc's stderr that says what went wrong (hipcc also prints unrelated noise, such as a
/// traceback from rocm_agent_enumerator on machines without a GPU).
fn first_error(stderr: &[u8]) -> String {
    let s = String::from_utf8_lossy(stderr);
    s.lines().find(|l| l.contains("error")).unwrap_or_else(|| s.lines().last().unwrap_or("")).trim().to_owned()
}

fn main() {
    for var in ["HIPCC", "ROCM_PATH", "HIP_PATH", "PATH"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    for s in SOURCES {
        println!("cargo:rerun-if-changed=hip/{s}.hip");
    }
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let mut objects = String::new();
    let mut skipped = Vec::new();
    let result = match (find_hipcc(), common_include()) {
        (None, _) => Err("hipcc not found at build time (set HIPCC or ROCM_PATH)".to_owned()),
        (_, Err(why)) => Err(why),
        (Some(hipcc), Ok(include)) => build(&hipcc, &include, &out, &mut objects, &mut skipped),
    };
    let mut code = String::new();
    let (version, not_built) = match result {
        Ok(v) => (v, None),
        Err(why) => {
            println!("cargo:warning=anyccl-kernels-hip: HIP kernels not compiled in: {why}");
            objects.clear();
            (String::new(), Some(why))
        }
    };
    let _ = writeln!(code, "/// Every embedded code object: (source, target, bytes).");
    let _ = writeln!(code, "pub static CODE_OBJECTS: &[(&str, &str, &[u8])] = &[\n{objects}];");
    let _ = writeln!(code, "/// Targets this build tried and could not build, with the compiler's reason.");
    let _ = writeln!(code, "pub static SKIPPED_TARGETS: &[(&str, &str)] = &{skipped:?};");
    let _ = writeln!(code, "/// The hipcc that built the kernels (empty when none did).");
    let _ = writeln!(code, "pub const HIPCC_VERSION: &str = {version:?};");
    let _ = writeln!(code, "/// Why no kernels are embedded (`None`: they are).");
    let _ = writeln!(code, "pub const NOT_BUILT: Option<&str> = {not_built:?};");
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

fn build(
    hipcc: &Path,
    include: &Path,
    out: &Path,
    objects: &mut String,
    skipped: &mut Vec<(&'static str, String)>,
) -> Result<String, String> {
    let v = Command::new(hipcc)
        .env("HIP_PLATFORM", "amd")
        .arg("--version")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", hipcc.display()))?;
    let version = String::from_utf8_lossy(&v.stdout)
        .lines()
        .find(|l| l.starts_with("HIP version"))
        .unwrap_or("HIP version unknown")
        .trim()
        .to_owned();
    for src in SOURCES {
        for arch in ARCHS {
            let obj = out.join(format!("{src}.{arch}.co"));
            let o = Command::new(hipcc)
                // AMD code objects whatever else is installed: hipcc picks the NVIDIA platform when it finds nvcc.
                .env("HIP_PLATFORM", "amd")
                .args(["--cuda-device-only", "--no-gpu-bundle-output", "-O3", "-std=c++17", "-c"])
                .arg(format!("--offload-arch={arch}"))
                .arg("-I")
                .arg(include)
                .arg("-o")
                .arg(&obj)
                .arg(Path::new("hip").join(format!("{src}.hip")))
                .output()
                .map_err(|e| format!("cannot run {}: {e}", hipcc.display()))?;
            if o.status.success() && obj.is_file() {
                let _ = writeln!(objects, "    ({src:?}, {arch:?}, include_bytes!({:?})),", obj.display().to_string());
            } else {
                let why = first_error(&o.stderr);
                println!("cargo:warning=anyccl-kernels-hip: {arch} not built: {why}");
                skipped.push((arch, why));
            }
        }
    }
    if objects.is_empty() {
        return Err(format!(
            "this hipcc builds none of {}: {}",
            ARCHS.join(", "),
            skipped.first().map_or("", |s| s.1.as_str())
        ));
    }
    Ok(version)
}
