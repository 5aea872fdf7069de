//! The machine-level capability report: what this build contains, what this machine offers, and what anyccl will
//! use ([`MachineReport::probe`]). The `anyccl probe` command prints it as text, or as JSON (`anyccl probe --json`,
//! its serde serialisation).
//!
//! The JSON form is a stable schema, versioned by its `schema` field:
//!
//! | field | type | meaning |
//! | --- | --- | --- |
//! | `schema` | integer | 1 |
//! | `anyccl_version` | string | the crate version |
//! | `default_backend` | string | what `anyccl bench` runs with no `--backend` |
//! | `backends[]` | `{name, compiled_in, available, detail}` | host, cuda, rocm |
//! | `gpu` | `{found, detail}` | whether an accelerator device node exists |
//! | `libraries[]` | `{name, found, path, version, detail, tried[]}` | vendor libraries; `tried[]` = `{candidate, failure{kind,…}}` |
//! | `capabilities[]` | `{name, enabled, provider, reason, reason_detail}` | one per capability flag; `reason_detail` has a `kind` |
//! | `selector` | `{source, forced, rules[]}` | the active algorithm table and where it came from |
//! | `warnings[]` | string | problems that did not stop the probe |

use std::path::Path;

use std::sync::Arc;

use anyccl_ccl::caps::CCL_CAPABILITIES;
use anyccl_ccl::{CclLibrary, CclVendor, SearchPlan};
use serde::Serialize;

use crate::core::selector::TableSource;
use crate::core::{Algorithm, Capabilities, CapabilityReport, Reason, Selector};

/// One backend: compiled in, usable here, and why (not).
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct BackendStatus {
    /// `host`, `cuda` or `rocm`.
    pub name: &'static str,
    /// Whether this build contains it.
    pub compiled_in: bool,
    /// Whether it can run here.
    pub available: bool,
    /// Why, in a sentence.
    pub detail: String,
}

/// Whether an accelerator is present.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct GpuStatus {
    /// True when a GPU device node was found.
    pub found: bool,
    /// What was looked at and found.
    pub detail: String,
}

/// A vendor library anyccl looks for.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct LibraryStatus {
    /// `NCCL`, `RCCL`, `CUDA driver`, `HIP runtime`.
    pub name: &'static str,
    /// Whether it was found.
    pub found: bool,
    /// Where, if found.
    pub path: Option<String>,
    /// Its vendor and version (`NCCL 2.28.9`), if found.
    pub version: Option<String>,
    /// What was done to find it.
    pub detail: String,
    /// Every place tried before it was found (or not), with the reason each failed.
    pub tried: Vec<anyccl_ccl::find::Attempt>,
}

/// The active algorithm table.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct SelectorInfo {
    /// Where it came from.
    pub source: TableSource,
    /// The algorithm forced by `ANYCCL_ALLREDUCE_ALGO`, if any.
    pub forced: Option<Algorithm>,
    /// The rules, first match wins, as text.
    pub rules: Vec<String>,
}

/// Everything `anyccl probe` reports: the machine-level capability report of this build.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct MachineReport {
    /// JSON schema version.
    pub schema: u32,
    /// The crate version.
    pub anyccl_version: &'static str,
    /// What `anyccl bench` runs with no `--backend`.
    pub default_backend: &'static str,
    /// Backends.
    pub backends: Vec<BackendStatus>,
    /// Accelerator presence.
    pub gpu: GpuStatus,
    /// Vendor libraries.
    pub libraries: Vec<LibraryStatus>,
    /// Capabilities with reasons.
    pub capabilities: CapabilityReport,
    /// The algorithm table.
    pub selector: SelectorInfo,
    /// Problems that did not stop the probe.
    pub warnings: Vec<String>,
}

fn backend_statuses() -> Vec<BackendStatus> {
    vec![
        BackendStatus {
            name: "host",
            compiled_in: cfg!(feature = "host"),
            available: cfg!(feature = "host"),
            detail: if cfg!(feature = "host") {
                "ranks as threads over host memory; always available".into()
            } else {
                "not compiled in (cargo feature `host`)".into()
            },
        },
        cuda_status(),
        rocm_status(),
    ]
}

/// The HIP runtime, loaded once per process (the probe reports it in three places).
#[cfg(feature = "rocm")]
fn hip_runtime() -> &'static Result<anyccl_rocm::HipLibrary, anyccl_rocm::HipLoadError> {
    static HIP: std::sync::OnceLock<Result<anyccl_rocm::HipLibrary, anyccl_rocm::HipLoadError>> =
        std::sync::OnceLock::new();
    HIP.get_or_init(anyccl_rocm::HipLibrary::load)
}

#[cfg(feature = "rocm")]
fn rocm_status() -> BackendStatus {
    let (available, detail) = match hip_runtime() {
        Err(e) => (false, e.to_string()),
        Ok(lib) => match anyccl_rocm::runtime::device_count(lib) {
            Err(e) => (false, format!("{} at {}: {e}", lib.describe(), lib.path().display())),
            Ok(0) => (false, format!("{} at {}: no HIP devices", lib.describe(), lib.path().display())),
            Ok(n) => {
                let archs: Vec<String> = (0..n as i32)
                    .map(|o| anyccl_rocm::runtime::arch_of(lib, o).unwrap_or_else(|e| e.to_string()))
                    .collect();
                (true, format!("{}; {n} device(s): {}", lib.describe(), archs.join(", ")))
            }
        },
    };
    BackendStatus {
        name: "rocm",
        compiled_in: true,
        available,
        detail: if available { format!("{detail}; RCCL collectives, bench and tune in one process") } else { detail },
    }
}

#[cfg(not(feature = "rocm"))]
fn rocm_status() -> BackendStatus {
    BackendStatus {
        name: "rocm",
        compiled_in: false,
        available: false,
        detail: "not compiled in (build with --features rocm)".into(),
    }
}

#[cfg(feature = "cuda")]
fn cuda_status() -> BackendStatus {
    match anyccl_cuda::available() {
        Ok(info) => {
            let devs: Vec<String> = info
                .devices
                .iter()
                .map(|d| format!("device {}: {} ({}, {} GiB)", d.ordinal, d.name, d.arch(), d.total_memory >> 30))
                .collect();
            BackendStatus {
                name: "cuda",
                compiled_in: true,
                available: true,
                detail: format!("driver {}; {}", info.version_string(), devs.join("; ")),
            }
        }
        Err(reason) => BackendStatus { name: "cuda", compiled_in: true, available: false, detail: reason.to_string() },
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_status() -> BackendStatus {
    BackendStatus {
        name: "cuda",
        compiled_in: false,
        available: false,
        detail: "not compiled in (build with --features cuda)".into(),
    }
}

/// The backend `anyccl bench` uses when none is named: the first of cuda and rocm that can run here (compiled in,
/// present, not turned off by `ANYCCL_DISABLE`), else host ([`crate::dynamic::communicators`]' order).
pub fn default_backend() -> &'static str {
    #[cfg(any(feature = "cuda", feature = "rocm"))]
    {
        use crate::dynamic::{disabled_by_env, unavailable, BackendKind};
        let disabled = disabled_by_env().unwrap_or(Capabilities::empty());
        for k in [BackendKind::Cuda, BackendKind::Rocm] {
            if unavailable(k, 1, disabled).is_none() {
                return k.name();
            }
        }
    }
    "host"
}

/// Looks for accelerator device nodes: `/dev/nvidia0`…, `/dev/kfd` (AMD). `dev` is `/dev` except in tests.
pub fn detect_gpu(dev: &Path) -> GpuStatus {
    let nvidia: Vec<String> = std::fs::read_dir(dev)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| {
                    n.strip_prefix("nvidia").is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
                })
                .collect()
        })
        .unwrap_or_default();
    let kfd = dev.join("kfd").exists();
    let mut found = Vec::new();
    if !nvidia.is_empty() {
        found.push(format!("{} NVIDIA device node(s) in {}", nvidia.len(), dev.display()));
    }
    if kfd {
        found.push(format!("the AMD kernel driver node {}", dev.join("kfd").display()));
    }
    if found.is_empty() {
        GpuStatus {
            found: false,
            detail: format!(
                "no GPU: no NVIDIA device nodes ({0}/nvidia0, …) and no AMD driver node ({0}/kfd)",
                dev.display()
            ),
        }
    } else {
        GpuStatus { found: true, detail: format!("found {}", found.join(" and ")) }
    }
}

/// Looks for NCCL and RCCL with the standard search plans; returns their statuses and the first that loaded.
fn collective_libraries() -> (Vec<LibraryStatus>, Option<Arc<CclLibrary>>) {
    let mut out = Vec::new();
    let mut first = None;
    for (name, vendor) in [("NCCL", CclVendor::Nccl), ("RCCL", CclVendor::Rccl)] {
        match SearchPlan::from_env(vendor).load() {
            Ok(lib) => {
                out.push(LibraryStatus {
                    name,
                    found: true,
                    path: Some(lib.path().display().to_string()),
                    version: Some(lib.describe()),
                    detail: "loaded; every required symbol resolved".into(),
                    tried: Vec::new(),
                });
                first.get_or_insert(Arc::new(lib));
            }
            Err(nf) => out.push(LibraryStatus {
                name,
                found: false,
                path: None,
                version: None,
                detail: format!("not found ({} places tried)", nf.tried.len()),
                tried: nf.tried,
            }),
        }
    }
    out.push(cuda_driver_status());
    out.push(hip_runtime_status());
    (out, first)
}

fn hip_runtime_status() -> LibraryStatus {
    #[cfg(feature = "rocm")]
    {
        match hip_runtime() {
            Ok(lib) => LibraryStatus {
                name: "HIP runtime",
                found: true,
                path: Some(lib.path().display().to_string()),
                version: Some(lib.describe()),
                detail: "loaded; every required symbol resolved".into(),
                tried: Vec::new(),
            },
            Err(e) => LibraryStatus {
                name: "HIP runtime",
                found: false,
                path: None,
                version: None,
                detail: e.to_string(),
                tried: Vec::new(),
            },
        }
    }
    #[cfg(not(feature = "rocm"))]
    LibraryStatus {
        name: "HIP runtime",
        found: false,
        path: None,
        version: None,
        detail: "not probed: the rocm backend is not compiled in".into(),
        tried: Vec::new(),
    }
}

fn cuda_driver_status() -> LibraryStatus {
    #[cfg(feature = "cuda")]
    {
        let r = anyccl_cuda::available();
        LibraryStatus {
            name: "CUDA driver",
            found: r.is_ok(),
            path: r.is_ok().then(|| "libcuda.so.1".to_owned()),
            version: r.as_ref().ok().map(|i| format!("CUDA {}", i.version_string())),
            detail: match r {
                Ok(_) => "loaded through cudarc".into(),
                Err(reason) => reason.to_string(),
            },
            tried: Vec::new(),
        }
    }
    #[cfg(not(feature = "cuda"))]
    LibraryStatus {
        name: "CUDA driver",
        found: false,
        path: None,
        version: None,
        detail: "not probed: the cuda backend is not compiled in".into(),
        tried: Vec::new(),
    }
}

/// The machine-level capability report of this build: the collective library found with the standard search,
/// each compiled-in backend's own report, and `ANYCCL_DISABLE` (an invalid value is logged and ignored; `probe`
/// reports it as a warning).
pub fn capabilities() -> CapabilityReport {
    let (_, ccl) = collective_libraries();
    let mut caps = capabilities_with(ccl.as_deref());
    if let Err(e) = caps.apply_env() {
        tracing::warn!(error = %e, "ANYCCL_DISABLE ignored");
    }
    caps
}

/// The report for the collective library `ccl`, before `ANYCCL_DISABLE`: what this build does not compile in,
/// then the library's and every compiled-in backend's own report over it.
fn capabilities_with(ccl: Option<&CclLibrary>) -> CapabilityReport {
    // Only what is not compiled in keeps this reason: a compiled-in backend's report replaces it below.
    let gpu_backend = |feature: &str| Reason::NotCompiledIn {
        what: format!("cargo feature `{feature}`"),
        detail: format!("build with --features {feature}"),
    };
    let no_loader = Reason::Unavailable {
        component: "NCCL/RCCL".into(),
        detail: "no libnccl.so.2 or librccl.so.1 could be loaded (see the libraries section for the places tried)"
            .into(),
    };
    let cuda = gpu_backend("cuda");
    let rocm = gpu_backend("rocm");
    let mut caps = CapabilityReport::all_disabled(|c| {
        if c == Capabilities::CUDA_RUNTIME {
            cuda.clone()
        } else if c == Capabilities::HIP_RUNTIME {
            rocm.clone()
        } else if c == Capabilities::HOST_BACKEND {
            Reason::NotCompiledIn { what: "cargo feature `host`".into(), detail: "build with --features host".into() }
        } else if c == Capabilities::CUSTOM_KERNELS {
            Reason::NotCompiledIn {
                what: "custom all-reduce kernels".into(),
                detail: "the CUDA kernels come with the cuda backend (build with --features cuda, nvcc at build time)"
                    .into(),
            }
        } else if c == Capabilities::CCL {
            no_loader.clone()
        } else if [
            Capabilities::P2P_ALL_PAIRS,
            Capabilities::IPC,
            Capabilities::MULTICAST,
            Capabilities::GRAPH_CAPTURE,
            Capabilities::DEPENDENT_LAUNCH,
        ]
        .contains(&c)
        {
            Reason::Requires { capability: "cuda-runtime or hip-runtime".into(), because: Box::new(cuda.clone()) }
        } else {
            Reason::Requires { capability: "ccl".into(), because: Box::new(no_loader.clone()) }
        }
    });
    if cfg!(feature = "host") {
        caps.enable(Capabilities::HOST_BACKEND);
    }
    if let Some(lib) = ccl {
        caps.merge_from(&anyccl_ccl::derive_capabilities(lib, &anyccl_ccl::caps::process_env), CCL_CAPABILITIES);
    }
    #[cfg(feature = "cuda")]
    caps.merge_from(
        &anyccl_cuda::capabilities(ccl, &anyccl_ccl::caps::process_env),
        Capabilities::CUDA_RUNTIME
            | Capabilities::P2P_ALL_PAIRS
            | Capabilities::IPC
            | Capabilities::MULTICAST
            | Capabilities::GRAPH_CAPTURE
            | Capabilities::CUSTOM_KERNELS
            | Capabilities::DEPENDENT_LAUNCH,
    );
    #[cfg(feature = "rocm")]
    {
        let r = anyccl_rocm::capabilities(hip_runtime().as_ref(), ccl, &anyccl_ccl::caps::process_env);
        caps.merge_from(&r, Capabilities::HIP_RUNTIME);
        // The device-level flags come from ROCm only where a HIP device is usable and CUDA is not.
        if r.has(Capabilities::HIP_RUNTIME) && !caps.has(Capabilities::CUDA_RUNTIME) {
            caps.merge_from(
                &r,
                Capabilities::P2P_ALL_PAIRS
                    | Capabilities::IPC
                    | Capabilities::MULTICAST
                    | Capabilities::GRAPH_CAPTURE
                    | Capabilities::CUSTOM_KERNELS
                    | Capabilities::DEPENDENT_LAUNCH,
            );
        }
    }
    // An explicit switch is the reason users act on, so it is shown over hardware reasons.
    caps.apply_nvls_env(&|k| std::env::var(k).ok());
    caps
}

impl MachineReport {
    /// The JSON schema version this struct serialises to ([`MachineReport::schema`]).
    pub const SCHEMA: u32 = 1;

    /// Probes this machine for this build. `selector` is the active algorithm selector (from the environment and
    /// flags, e.g. [`Selector::from_env`]). Problems that do not stop the probe (an invalid `ANYCCL_DISABLE`, a GPU
    /// with no GPU backend compiled in) are in [`MachineReport::warnings`].
    pub fn probe(selector: &Selector) -> MachineReport {
        probe(selector)
    }
}

fn probe(selector: &Selector) -> MachineReport {
    let mut warnings = Vec::new();
    let (libraries, ccl) = collective_libraries();
    let mut caps = capabilities_with(ccl.as_deref());
    if let Err(e) = caps.apply_env() {
        warnings.push(e.to_string());
    }
    // NCCL_ALGO means something else from NCCL 2.31 on: a value that leaves collectives without an algorithm.
    if let Some(w) = ccl.as_deref().and_then(|l| anyccl_ccl::caps::nccl_algo_warning(l, &anyccl_ccl::caps::process_env))
    {
        warnings.push(w);
    }
    let gpu = detect_gpu(Path::new("/dev"));
    if gpu.found && !cfg!(any(feature = "cuda", feature = "rocm")) {
        warnings.push("a GPU is present, but this build has no GPU backend; anyccl runs on the host backend".into());
    }
    MachineReport {
        schema: MachineReport::SCHEMA,
        anyccl_version: env!("CARGO_PKG_VERSION"),
        default_backend: default_backend(),
        backends: backend_statuses(),
        gpu,
        libraries,
        capabilities: caps,
        selector: SelectorInfo {
            source: selector.source().clone(),
            forced: selector.forced(),
            rules: selector.table().rules.iter().map(ToString::to_string).collect(),
        },
        warnings,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_detection_reads_device_nodes() {
        let dir = std::env::temp_dir().join(format!("anyccl-dev-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        assert!(!detect_gpu(&dir).found);
        std::fs::write(dir.join("nvidiactl"), b"").expect("file");
        assert!(!detect_gpu(&dir).found, "nvidiactl is not a device");
        std::fs::write(dir.join("nvidia0"), b"").expect("file");
        let g = detect_gpu(&dir);
        assert!(g.found && g.detail.contains("1 NVIDIA"), "{}", g.detail);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn machine_report_lists_every_backend_with_this_builds_features() {
        let r = MachineReport::probe(&Selector::defaults());
        assert_eq!(r.schema, 1);
        let names: Vec<&str> = r.backends.iter().map(|b| b.name).collect();
        assert_eq!(names, ["host", "cuda", "rocm"]);
        let compiled: Vec<bool> = r.backends.iter().map(|b| b.compiled_in).collect();
        assert_eq!(compiled, [cfg!(feature = "host"), cfg!(feature = "cuda"), cfg!(feature = "rocm")]);
        assert_eq!(r.capabilities.has(Capabilities::HOST_BACKEND), cfg!(feature = "host"));
        assert_eq!(r.selector.rules.len(), Selector::defaults().table().rules.len());
        assert!(r.selector.forced.is_none());
    }

    #[test]
    fn capability_report_explains_every_disabled_flag() {
        let r = capabilities();
        assert_eq!(r.has(Capabilities::HOST_BACKEND), cfg!(feature = "host"));
        for (c, st) in r.iter() {
            if let crate::core::CapabilityState::Disabled(reason) = st {
                assert!(!reason.to_string().is_empty(), "{c:?}");
            }
        }
        assert!(!r.has(Capabilities::CCL));
    }
}
