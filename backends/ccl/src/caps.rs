//! From a loaded library to a capability report: each missing symbol, old version or environment switch becomes
//! a disabled capability with a concrete reason.

use anyccl_core::{Capabilities, CapabilityReport, Reason};

use crate::loader::{CclLibrary, CclVendor};

/// The capabilities the collective library decides (the others depend on the GPU runtime and devices).
pub const CCL_CAPABILITIES: Capabilities = Capabilities::CCL
    .union(Capabilities::COMM_SPLIT)
    .union(Capabilities::BUFFER_REGISTRATION)
    .union(Capabilities::CCL_MEM_ALLOC)
    .union(Capabilities::SYMMETRIC_WINDOWS)
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
    r.apply_nvls_env(env);
    r
}

/// The first release with fp8 reductions: NCCL 2.24; RCCL from ROCm 6.2 (RCCL 2.20, named `ncclFp8E4M3`).
pub fn fp8_first_version(vendor: CclVendor) -> (u32, u32) {
    match vendor {
        CclVendor::Nccl => (2, 24),
        CclVendor::Rccl => (2, 20),
    }
}

/// Reads the process environment.
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}
