//! From a loaded library to a capability report: each missing symbol, old version or environment switch becomes
//! a disabled capability with a concrete reason.

use anyccl_core::{Capabilities, CapabilityReport, CapabilityState, Reason};

use crate::loader::{CclLibrary, CclVendor};

/// The capabilities the collective library decides (the others depend on the GPU runtime and devices).
pub const CCL_CAPABILITIES: Capabilities = Capabilities::CCL
    .union(Capabilities::COMM_SPLIT)
    .union(Capabilities::BUFFER_REGISTRATION)
    .union(Capabilities::CCL_MEM_ALLOC)
    .union(Capabilities::SYMMETRIC_WINDOWS)
    .union(Capabilities::WINDOWS_IN_CAPTURE)
    .union(Capabilities::SYMMETRIC_KERNELS)
    .union(Capabilities::PER_CALL_CONFIG)
    .union(Capabilities::COMM_SHRINK)
    .union(Capabilities::DEVICE_API)
    .union(Capabilities::BF16)
    .union(Capabilities::AVG)
    .union(Capabilities::FP8)
    .union(Capabilities::PRE_MUL_SUM)
    .union(Capabilities::LAST_ERROR);

/// Derives the capability report of `lib`. `env` reads environment variables (injectable for tests); the
/// process environment is [`process_env`].
pub fn derive(lib: &CclLibrary, env: &dyn Fn(&str) -> Option<String>) -> CapabilityReport {
    let library = lib.path().display().to_string();
    let described = lib.describe();
    let version = lib.version();
    let t = lib.table();
    let missing = |symbol: &str| Reason::MissingSymbol {
        symbol: symbol.to_owned(),
        library: library.clone(),
        version: Some(described.clone()),
    };
    let too_old = |major: u32, minor: u32| Reason::VersionTooOld {
        component: format!("{} at {library}", lib.vendor()),
        found: version.to_string(),
        required: format!("{major}.{minor}"),
    };

    let mut r = CapabilityReport::all_disabled(|_| Reason::NotApplicable {
        detail: "decided by the GPU runtime and devices, not by the collective library".into(),
    });
    r.enable(Capabilities::CCL);

    // One symbol, or several that must all be present.
    let mut by_symbols = |cap: Capabilities, symbols: &[&str]| match symbols.iter().find(|s| !t.has(s)) {
        None => r.enable(cap),
        Some(s) => r.disable(cap, missing(s)),
    };
    by_symbols(Capabilities::COMM_SPLIT, &["ncclCommSplit"]);
    by_symbols(Capabilities::BUFFER_REGISTRATION, &["ncclCommRegister", "ncclCommDeregister"]);
    by_symbols(Capabilities::CCL_MEM_ALLOC, &["ncclMemAlloc", "ncclMemFree"]);
    by_symbols(Capabilities::SYMMETRIC_WINDOWS, &["ncclCommWindowRegister", "ncclCommWindowDeregister"]);
    by_symbols(Capabilities::COMM_SHRINK, &["ncclCommShrink"]);
    by_symbols(Capabilities::DEVICE_API, &["ncclDevCommCreate"]);
    by_symbols(Capabilities::PRE_MUL_SUM, &["ncclRedOpCreatePreMulSum"]);
    by_symbols(Capabilities::LAST_ERROR, &["ncclGetLastError"]);
    by_symbols(Capabilities::PER_CALL_CONFIG, PER_CALL_CONFIG_SYMBOLS);

    // Enumerations that exist from a version on (no symbol marks them).
    let mut by_version = |cap: Capabilities, major: u32, minor: u32| {
        if version.at_least(major, minor) {
            r.enable(cap);
        } else {
            r.disable(cap, too_old(major, minor));
        }
    };
    by_version(Capabilities::BF16, 2, 10);
    by_version(Capabilities::AVG, 2, 10);
    let (fp8_major, fp8_minor) = fp8_first_version(lib.vendor());
    by_version(Capabilities::FP8, fp8_major, fp8_minor);

    // Windows on RCCL also need cuMem, which RCCL leaves off unless NCCL_CUMEM_ENABLE=1: without it
    // ncclMemAlloc falls back to hipMalloc, which graph capture rejects.
    if r.has(Capabilities::SYMMETRIC_WINDOWS) {
        if lib.vendor() == CclVendor::Rccl && env("NCCL_CUMEM_ENABLE").as_deref().map(str::trim) != Some("1") {
            let value = env("NCCL_CUMEM_ENABLE").unwrap_or_else(|| "unset (RCCL's default is 0)".into());
            r.disable(Capabilities::SYMMETRIC_WINDOWS, Reason::EnvVar { var: "NCCL_CUMEM_ENABLE".into(), value });
        } else if let Some(v) = env("NCCL_WIN_ENABLE").filter(|v| v.trim() == "0") {
            r.disable(Capabilities::SYMMETRIC_WINDOWS, Reason::EnvVar { var: "NCCL_WIN_ENABLE".into(), value: v });
        }
    }
    windows_in_capture(&mut r, lib);
    symmetric_kernels(&mut r, lib);
    r.apply_nvls_env(env);
    r
}

/// The per-call config collectives of NCCL 2.31 (each with an `ncclCollConfig_t`): [`Capabilities::PER_CALL_CONFIG`]
/// needs every one.
pub const PER_CALL_CONFIG_SYMBOLS: &[&str] = &[
    "ncclAllReduceConfig",
    "ncclAllGatherConfig",
    "ncclReduceScatterConfig",
    "ncclBroadcastConfig",
    "ncclReduceConfig",
    "ncclAlltoAllConfig",
    "ncclGatherConfig",
    "ncclScatterConfig",
];

/// The first RCCL release known to run symmetric kernels (ROCm 7.13 added them for gfx942/gfx950; RCCL 2.30.4 of
/// ROCm 7.14 has them). RCCL 2.27.7, in production ROCm 7.2.x, registers windows but has none.
pub const RCCL_SYMMETRIC_KERNELS_FIRST: (u32, u32) = (2, 30);

/// Sets [`Capabilities::SYMMETRIC_KERNELS`]: off because of symmetric windows where those are off; on NCCL on with
/// them; on RCCL on from [`RCCL_SYMMETRIC_KERNELS_FIRST`], off as too old before it (saying that the windows are
/// registered all the same).
fn symmetric_kernels(r: &mut CapabilityReport, lib: &CclLibrary) {
    if let CapabilityState::Disabled(because) = r.state(Capabilities::SYMMETRIC_WINDOWS) {
        let because = Box::new(because.clone());
        let capability = Capabilities::SYMMETRIC_WINDOWS.name().unwrap_or("symmetric-windows").to_owned();
        r.disable(Capabilities::SYMMETRIC_KERNELS, Reason::Requires { capability, because });
        return;
    }
    let (major, minor) = RCCL_SYMMETRIC_KERNELS_FIRST;
    if lib.vendor() == CclVendor::Nccl || lib.version().at_least(major, minor) {
        r.enable(Capabilities::SYMMETRIC_KERNELS);
        return;
    }
    let reason = Reason::VersionTooOld {
        component: format!(
            "RCCL at {} (it registers windows, but its collectives run no symmetric kernels; production ROCm 7.2.x \
             ships RCCL 2.27.7, ROCm 7.13 added them for gfx942/gfx950)",
            lib.path().display()
        ),
        found: lib.version().to_string(),
        required: format!("{major}.{minor}"),
    };
    r.disable(Capabilities::SYMMETRIC_KERNELS, reason);
}

/// The first release in which `NCCL_ALGO` restricts every collective: from NCCL 2.31 on, setting it leaves the
/// collectives it does not name (by a `collective:` prefix, or by an entry without one) with no algorithm; before,
/// they kept NCCL's own choice.
pub const NCCL_ALGO_RESTRICTS_ALL_FIRST: (u32, u32) = (2, 31);

/// The collectives `NCCL_ALGO` may name by prefix (`allreduce:tree`), as NCCL spells them.
const ALGO_COLLECTIVES: &[&str] = &["broadcast", "reduce", "allgather", "reducescatter", "allreduce"];

/// The collectives `value` (an `NCCL_ALGO` or `NCCL_PROTO` setting: `;`-separated entries, each `list` or
/// `collective:list`) leaves unnamed: empty when an entry without a prefix covers them all.
fn unnamed_collectives(value: &str) -> Vec<&'static str> {
    let mut named: Vec<String> = Vec::new();
    for entry in value.split(';').map(str::trim).filter(|e| !e.is_empty()) {
        match entry.split_once(':') {
            Some((colls, _)) => named.extend(colls.split(',').map(|c| c.trim().to_ascii_lowercase())),
            None => return Vec::new(),
        }
    }
    ALGO_COLLECTIVES.iter().copied().filter(|c| !named.iter().any(|n| n == c)).collect()
}

/// What `NCCL_ALGO` (read through `env`) means for `lib`, when it matters: from NCCL 2.31 on
/// ([`NCCL_ALGO_RESTRICTS_ALL_FIRST`]) a value that names only some collectives leaves the others without an
/// algorithm, so they fail with `ncclInvalidUsage` as soon as something forces them (an `NCCL_PROTO` entry without a
/// collective prefix does). `None`: unset, covering every collective, or a release that keeps the others as they
/// were. The text is for the probe's warnings and the log.
pub fn nccl_algo_warning(lib: &CclLibrary, env: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    nccl_algo_warning_for(lib.version(), &lib.describe(), env)
}

/// [`nccl_algo_warning`] for a library of `version`, described as `described` (`NCCL 2.31.2`).
pub fn nccl_algo_warning_for(
    version: crate::loader::CclVersion,
    described: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Option<String> {
    let algo = env("NCCL_ALGO")?;
    let (major, minor) = NCCL_ALGO_RESTRICTS_ALL_FIRST;
    if !version.at_least(major, minor) {
        return None;
    }
    let unnamed = unnamed_collectives(&algo);
    if unnamed.is_empty() {
        return None;
    }
    let forced = env("NCCL_PROTO").is_some_and(|p| !p.trim().is_empty() && unnamed_collectives(&p).is_empty());
    let consequence = if forced {
        "NCCL_PROTO, set without a collective prefix, forces them, so they fail with ncclInvalidUsage"
    } else {
        "they fail with ncclInvalidUsage once something forces them (an NCCL_PROTO without a collective prefix)"
    };
    Some(format!(
        "NCCL_ALGO={algo} names no algorithm for {}: from NCCL {major}.{minor} on ({described} is loaded) a \
         collective NCCL_ALGO does not name has none, and {consequence}; name them too (for example \
         \"ring,tree;{algo}\") or unset NCCL_ALGO",
        unnamed.join(", ")
    ))
}

/// The first release, of NCCL and of RCCL alike, that registers symmetric windows while a graph is captured:
/// NCCL 2.30.7 allows it; RCCL 2.30.4 fails to, 2.30.7 succeeds.
pub const WINDOWS_IN_CAPTURE_FIRST: (u32, u32, u32) = (2, 30, 7);

/// Sets [`Capabilities::WINDOWS_IN_CAPTURE`] from what `lib` is: off because of symmetric windows where those
/// are off, else on from [`WINDOWS_IN_CAPTURE_FIRST`] and off as too old before it (on RCCL the reason says that
/// 2.30.4 fails inside capture).
fn windows_in_capture(r: &mut CapabilityReport, lib: &CclLibrary) {
    if let CapabilityState::Disabled(because) = r.state(Capabilities::SYMMETRIC_WINDOWS) {
        let because = Box::new(because.clone());
        let capability = Capabilities::SYMMETRIC_WINDOWS.name().unwrap_or("symmetric-windows").to_owned();
        r.disable(Capabilities::WINDOWS_IN_CAPTURE, Reason::Requires { capability, because });
        return;
    }
    let (major, minor, patch) = WINDOWS_IN_CAPTURE_FIRST;
    if lib.version().at_least_patch(major, minor, patch) {
        r.enable(Capabilities::WINDOWS_IN_CAPTURE);
        return;
    }
    let library = lib.path().display();
    let component = match lib.vendor() {
        CclVendor::Nccl => format!("NCCL at {library}"),
        CclVendor::Rccl => format!("RCCL at {library} (RCCL 2.30.4 fails to register windows inside graph capture)"),
    };
    let reason = Reason::VersionTooOld {
        component,
        found: lib.version().to_string(),
        required: format!("{major}.{minor}.{patch}"),
    };
    r.disable(Capabilities::WINDOWS_IN_CAPTURE, reason);
}

/// The start of a GPU backend's report: every capability off as not used by `backend`, then the collective
/// library's own ([`derive()`] over `lib`, `env`), or, where none was loaded, those off with `missing` as the reason.
pub fn gpu_backend_report(
    backend: &str,
    lib: Option<&CclLibrary>,
    missing: Reason,
    env: &dyn Fn(&str) -> Option<String>,
) -> CapabilityReport {
    let detail = format!("not used by the {backend} backend");
    let mut r = CapabilityReport::all_disabled(|_| Reason::NotApplicable { detail: detail.clone() });
    match lib {
        Some(l) => r.merge_from(&derive(l, env), CCL_CAPABILITIES),
        None => r.disable(CCL_CAPABILITIES, missing),
    }
    r
}

/// Sets a GPU backend's `runtime` flag (`cuda-runtime`, `hip-runtime`) from `state` and what depends on it: when
/// usable, graph capture and IPC on and peer access off with `p2p_detail` (it is checked per communicator); when
/// not, the flag off with the reason and every one of `dependents` off because of it.
pub fn gpu_runtime(
    r: &mut CapabilityReport,
    runtime: Capabilities,
    state: Result<(), Reason>,
    dependents: Capabilities,
    p2p_detail: &str,
) {
    match state {
        Err(reason) => {
            let capability = runtime.name().unwrap_or("the GPU runtime").to_owned();
            let dep = Reason::Requires { capability, because: Box::new(reason.clone()) };
            r.disable(runtime, reason);
            r.disable(dependents, dep);
        }
        Ok(()) => {
            r.enable(runtime | Capabilities::GRAPH_CAPTURE | Capabilities::IPC);
            let p2p = Reason::Unavailable { component: "peer access".into(), detail: p2p_detail.into() };
            r.disable(Capabilities::P2P_ALL_PAIRS, p2p);
        }
    }
}

/// What one GPU vendor puts into its backend's capability report ([`gpu_report`]); the rest is the same for every
/// vendor.
pub struct GpuReport<'a> {
    /// The backend's name in messages (`"CUDA"`, `"ROCm"`).
    pub label: &'a str,
    /// Why the collective library's capabilities are off when none was loaded.
    pub missing_ccl: Reason,
    /// The runtime's flag (`cuda-runtime`, `hip-runtime`), and whether the runtime is usable (else why not).
    pub runtime: (Capabilities, Result<(), Reason>),
    /// The flags that need the runtime ([`gpu_runtime`]).
    pub dependents: Capabilities,
    /// Why multicast is off, where the vendor says so (applied after the runtime's flags).
    pub multicast_off: Option<Reason>,
    /// Whether `NCCL_NVLS_ENABLE` decides multicast too where the runtime is usable (NVIDIA only).
    pub nvls_env: bool,
    /// The custom kernels' name in reasons (`"custom CUDA kernels"`) and why they are not built, if they are not.
    pub kernels: (&'a str, Option<&'a str>),
}

/// The capability report of a GPU backend: the collective library's capabilities (over `lib`, or off with
/// [`GpuReport::missing_ccl`]), the runtime's, multicast, and the custom kernels, from the vendor's `parts`. `env`
/// reads environment variables.
pub fn gpu_report(
    parts: GpuReport<'_>,
    lib: Option<&CclLibrary>,
    env: &dyn Fn(&str) -> Option<String>,
) -> CapabilityReport {
    let GpuReport { label, missing_ccl, runtime: (flag, state), dependents, multicast_off, nvls_env, kernels } = parts;
    let mut r = gpu_backend_report(label, lib, missing_ccl, env);
    let usable = state.is_ok();
    gpu_runtime(&mut r, flag, state, dependents, "checked per communicator, when the custom kernels are set up");
    if let Some(reason) = multicast_off {
        r.disable(Capabilities::MULTICAST, reason);
    }
    if usable && nvls_env {
        r.apply_nvls_env(env);
    }
    match kernels {
        (_, None) => r.enable(Capabilities::CUSTOM_KERNELS),
        (what, Some(why)) => {
            r.disable(Capabilities::CUSTOM_KERNELS, Reason::NotCompiledIn { what: what.into(), detail: why.into() })
        }
    }
    r
}

/// The first release with fp8 reductions: NCCL 2.24; RCCL from ROCm 6.2 (RCCL 2.20, named `ncclFp8E4M3`).
pub fn fp8_first_version(vendor: CclVendor) -> (u32, u32) {
    match vendor {
        CclVendor::Nccl => (2, 24),
        CclVendor::Rccl => (2, 20),
    }
}

/// Reads the process environment through [`anyccl_core::env::var`]. A value that is not UTF-8 reads as unset here
/// (this reader cannot fail) and is logged as a warning naming the variable; the constructors check every variable
/// anyccl reads as text first ([`anyccl_core::env::check_process_env`], an error naming it), and code that can fail
/// reads through [`anyccl_core::env::CheckedEnv`] instead.
pub fn process_env(name: &str) -> Option<String> {
    match anyccl_core::env::var(name) {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(error = %e, "an environment variable is not UTF-8; read as unset");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyccl_core::CapabilityState;

    #[test]
    fn a_gpu_report_applies_the_vendor_parts_in_order() {
        let off = Reason::Unavailable { component: "AMD GPUs".into(), detail: "no multicast".into() };
        let nvls_off = |k: &str| (k == "NCCL_NVLS_ENABLE").then(|| "0".to_owned());
        let parts = |state: Result<(), Reason>, nvls_env: bool, not_built: Option<&'static str>| GpuReport {
            label: "X",
            missing_ccl: Reason::Unavailable { component: "XCCL".into(), detail: "none".into() },
            runtime: (Capabilities::HIP_RUNTIME, state),
            dependents: Capabilities::IPC | Capabilities::GRAPH_CAPTURE,
            multicast_off: Some(off.clone()),
            nvls_env,
            kernels: ("X kernels", not_built),
        };
        // A usable runtime: the vendor's multicast reason, unless NCCL_NVLS_ENABLE=0 applies (it replaces it).
        let r = gpu_report(parts(Ok(()), false, None), None, &nvls_off);
        assert!(r.has(Capabilities::HIP_RUNTIME | Capabilities::IPC | Capabilities::CUSTOM_KERNELS));
        assert_eq!(r.state(Capabilities::MULTICAST), &CapabilityState::Disabled(off.clone()));
        let r = gpu_report(parts(Ok(()), true, None), None, &nvls_off);
        assert!(matches!(r.state(Capabilities::MULTICAST), CapabilityState::Disabled(Reason::EnvVar { .. })));
        // An unusable runtime: its dependents off because of it, NCCL_NVLS_ENABLE not read, the kernels' reason.
        let gone = Reason::Unavailable { component: "runtime".into(), detail: "absent".into() };
        let r = gpu_report(parts(Err(gone.clone()), true, Some("no compiler")), None, &nvls_off);
        assert_eq!(r.state(Capabilities::HIP_RUNTIME), &CapabilityState::Disabled(gone));
        assert!(matches!(r.state(Capabilities::IPC), CapabilityState::Disabled(Reason::Requires { .. })));
        assert_eq!(r.state(Capabilities::MULTICAST), &CapabilityState::Disabled(off));
        assert_eq!(
            r.state(Capabilities::CUSTOM_KERNELS),
            &CapabilityState::Disabled(Reason::NotCompiledIn {
                what: "X kernels".into(),
                detail: "no compiler".into()
            })
        );
    }

    #[test]
    fn a_gpu_runtime_sets_its_dependents_on_or_off_with_the_reason() {
        let missing = Reason::Unavailable { component: "RCCL".into(), detail: "none".into() };
        let mut r = gpu_backend_report("ROCm", None, missing.clone(), &|_| None);
        assert_eq!(r.state(Capabilities::CCL), &CapabilityState::Disabled(missing));
        assert_eq!(
            r.state(Capabilities::HOST_BACKEND),
            &CapabilityState::Disabled(Reason::NotApplicable { detail: "not used by the ROCm backend".into() })
        );
        let off = Reason::Unavailable { component: "HIP runtime".into(), detail: "no library".into() };
        let dependents = Capabilities::GRAPH_CAPTURE | Capabilities::IPC;
        gpu_runtime(&mut r, Capabilities::HIP_RUNTIME, Err(off.clone()), dependents, "unused");
        assert_eq!(r.state(Capabilities::HIP_RUNTIME), &CapabilityState::Disabled(off.clone()));
        let dep = Reason::Requires { capability: "hip-runtime".into(), because: Box::new(off) };
        assert_eq!(r.state(Capabilities::IPC), &CapabilityState::Disabled(dep));
        assert!(!r.has(Capabilities::P2P_ALL_PAIRS));

        gpu_runtime(&mut r, Capabilities::HIP_RUNTIME, Ok(()), dependents, "checked later");
        assert!(r.has(Capabilities::HIP_RUNTIME | Capabilities::GRAPH_CAPTURE | Capabilities::IPC));
        let p2p = Reason::Unavailable { component: "peer access".into(), detail: "checked later".into() };
        assert_eq!(r.state(Capabilities::P2P_ALL_PAIRS), &CapabilityState::Disabled(p2p));
    }
}
