//! The capability model: what this machine's libraries and hardware allow, and for each thing they do not, why.

use std::fmt;

use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};

use crate::error::{Error, Result};

bitflags::bitflags! {
    /// Features anyccl can use when the libraries and hardware present provide them.
    ///
    /// Each flag's documentation says what provides it. A [`CapabilityReport`] says, per flag, whether it is enabled
    /// and, if not, the concrete [`Reason`].
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
    pub struct Capabilities: u32 {
        /// Host backend: ranks as threads over host memory. Provided by the `host` cargo feature (on by default).
        const HOST_BACKEND = 1 << 0;
        /// CUDA runtime: the `cuda` feature compiled in, `libcuda.so.1` loadable, at least one NVIDIA device.
        const CUDA_RUNTIME = 1 << 1;
        /// HIP runtime: the `rocm` feature compiled in, `libamdhip64.so` loadable, at least one AMD device.
        const HIP_RUNTIME = 1 << 2;
        /// A collective library (NCCL or RCCL) loaded with every required `nccl*` symbol.
        const CCL = 1 << 3;
        /// Communicator split: `ncclCommSplit` (NCCL ≥ 2.18, RCCL from ROCm 6.0).
        const COMM_SPLIT = 1 << 4;
        /// User-buffer registration: `ncclCommRegister`/`ncclCommDeregister` (NCCL ≥ 2.19, RCCL from ROCm 6.2).
        const BUFFER_REGISTRATION = 1 << 5;
        /// Library-allocated memory suitable for registration: `ncclMemAlloc`/`ncclMemFree` (NCCL ≥ 2.19).
        const CCL_MEM_ALLOC = 1 << 6;
        /// Symmetric memory windows: `ncclCommWindowRegister`/`Deregister` (NCCL ≥ 2.27; on RCCL also
        /// `NCCL_CUMEM_ENABLE=1`, since RCCL's default allocation is not capture-safe).
        const SYMMETRIC_WINDOWS = 1 << 7;
        /// Communicator shrink: `ncclCommShrink` (NCCL ≥ 2.27).
        const COMM_SHRINK = 1 << 8;
        /// The device-side API: `ncclDevCommCreate` (NCCL ≥ 2.28).
        const DEVICE_API = 1 << 9;
        /// bf16 reductions: on the GPU backends the collective library's `ncclBfloat16` (NCCL ≥ 2.10); the host
        /// backend reduces bf16 itself.
        const BF16 = 1 << 10;
        /// The `avg` operator: on the GPU backends the collective library's `ncclAvg` (NCCL ≥ 2.10); the host
        /// backend implements it itself.
        const AVG = 1 << 11;
        /// fp8 reductions: on the GPU backends the collective library's `ncclFloat8e4m3`/`e5m2` (NCCL ≥ 2.24; RCCL
        /// from ROCm 6.2); the host backend reduces fp8 itself.
        const FP8 = 1 << 12;
        /// Pre-multiplied sum: `ncclRedOpCreatePreMulSum` (NCCL ≥ 2.11).
        const PRE_MUL_SUM = 1 << 13;
        /// The library's last-error text: `ncclGetLastError` (NCCL ≥ 2.13).
        const LAST_ERROR = 1 << 14;
        /// Peer-to-peer access between every pair of devices of the communicator (`cuDeviceCanAccessPeer`,
        /// `hipDeviceCanAccessPeer`); required by the custom IPC kernels.
        const P2P_ALL_PAIRS = 1 << 15;
        /// Inter-process memory handles (`cuIpcGetMemHandle`, `hipIpcGetMemHandle`).
        const IPC = 1 << 16;
        /// NVLink multicast (NVLS): `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED`, a CUDA ≥ 12.1 driver, and
        /// `NCCL_NVLS_ENABLE` not set to 0.
        const MULTICAST = 1 << 17;
        /// Custom all-reduce kernels compiled into this build (nvcc or hipcc found at build time).
        const CUSTOM_KERNELS = 1 << 18;
        /// Collectives may be captured into CUDA/HIP graphs (the runtime reports capture status).
        const GRAPH_CAPTURE = 1 << 19;
        /// Programmatic dependent launch: a kernel may start while the stream's previous kernel finishes
        /// (`cuLaunchKernelEx` with the programmatic-stream-serialization attribute: compute capability 9.0 or
        /// newer, a CUDA ≥ 11.8 driver). The push one-shot uses it where on, and launches plainly where off.
        const DEPENDENT_LAUNCH = 1 << 20;
        /// Symmetric-window registration while a CUDA/HIP graph is being captured: needs [`SYMMETRIC_WINDOWS`]
        /// and a library that registers windows inside capture (NCCL >= 2.30.7; RCCL >= 2.30.7, since RCCL 2.30.4
        /// fails to). Decided from the loaded library's vendor and version.
        ///
        /// [`SYMMETRIC_WINDOWS`]: Capabilities::SYMMETRIC_WINDOWS
        const WINDOWS_IN_CAPTURE = 1 << 21;
        /// The per-call config of NCCL 2.31 and later (`ncclAllReduceConfig` and the other seven `*Config`
        /// collectives with an `ncclCollConfig_t`: per-call algorithm, CTA policy, profiler tag).
        const PER_CALL_CONFIG = 1 << 22;
        /// The library's own symmetric-memory kernels over registered windows: needs [`SYMMETRIC_WINDOWS`]; NCCL
        /// has them wherever it registers windows, RCCL only from a release that ships them (RCCL 2.27.7, in
        /// production ROCm 7.2.x, registers windows but runs no symmetric kernels).
        ///
        /// [`SYMMETRIC_WINDOWS`]: Capabilities::SYMMETRIC_WINDOWS
        const SYMMETRIC_KERNELS = 1 << 23;
    }
}

/// Name and provider of every capability, in display order.
const CAPABILITY_INFO: &[(Capabilities, &str, &str)] = &[
    (Capabilities::HOST_BACKEND, "host-backend", "cargo feature `host`"),
    (Capabilities::CUDA_RUNTIME, "cuda-runtime", "cargo feature `cuda` + libcuda.so.1 + an NVIDIA device"),
    (Capabilities::HIP_RUNTIME, "hip-runtime", "cargo feature `rocm` + libamdhip64.so + an AMD device"),
    (Capabilities::CCL, "ccl", "libnccl.so.2 / librccl.so.1 with all required symbols"),
    (Capabilities::COMM_SPLIT, "comm-split", "ncclCommSplit (NCCL >= 2.18)"),
    (Capabilities::BUFFER_REGISTRATION, "buffer-registration", "ncclCommRegister (NCCL >= 2.19)"),
    (Capabilities::CCL_MEM_ALLOC, "ccl-mem-alloc", "ncclMemAlloc (NCCL >= 2.19)"),
    (Capabilities::SYMMETRIC_WINDOWS, "symmetric-windows", "ncclCommWindowRegister (NCCL >= 2.27)"),
    (Capabilities::WINDOWS_IN_CAPTURE, "windows-in-capture", "window registration in graph capture (>= 2.30.7)"),
    (
        Capabilities::SYMMETRIC_KERNELS,
        "symmetric-kernels",
        "the library's symmetric kernels (NCCL >= 2.27, RCCL >= 2.30)",
    ),
    (Capabilities::COMM_SHRINK, "comm-shrink", "ncclCommShrink (NCCL >= 2.27)"),
    (Capabilities::DEVICE_API, "device-api", "ncclDevCommCreate (NCCL >= 2.28)"),
    (
        Capabilities::PER_CALL_CONFIG,
        "per-call-config",
        "ncclAllReduceConfig and the other *Config calls (NCCL >= 2.31)",
    ),
    (Capabilities::BF16, "bf16", "ncclBfloat16 (NCCL >= 2.10)"),
    (Capabilities::AVG, "avg", "ncclAvg (NCCL >= 2.10)"),
    (Capabilities::FP8, "fp8", "ncclFloat8e4m3/e5m2 (NCCL >= 2.24)"),
    (Capabilities::PRE_MUL_SUM, "pre-mul-sum", "ncclRedOpCreatePreMulSum"),
    (Capabilities::LAST_ERROR, "last-error", "ncclGetLastError"),
    (Capabilities::P2P_ALL_PAIRS, "p2p-all-pairs", "peer access between every pair of devices"),
    (Capabilities::IPC, "ipc", "cuIpc*/hipIpc* memory handles"),
    (Capabilities::MULTICAST, "multicast", "CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED + driver >= 12.1"),
    (Capabilities::CUSTOM_KERNELS, "custom-kernels", "kernels compiled at build time (nvcc/hipcc)"),
    (Capabilities::GRAPH_CAPTURE, "graph-capture", "stream capture status from the runtime"),
    (Capabilities::DEPENDENT_LAUNCH, "dependent-launch", "cuLaunchKernelEx on sm_90+ (CUDA >= 11.8)"),
];

/// Which capability needs which: a dependent is usable only while its prerequisite is. Turning a prerequisite off
/// by name (`ANYCCL_DISABLE`, [`CapabilityReport::apply_disable_list`]) turns its dependents off too, each with a
/// [`Reason::Requires`] naming the prerequisite and why it is off.
const DEPENDENCIES: &[(Capabilities, Capabilities)] = &[
    // Window registration inside capture, and the library's symmetric kernels, both run on registered windows.
    (Capabilities::WINDOWS_IN_CAPTURE, Capabilities::SYMMETRIC_WINDOWS),
    (Capabilities::SYMMETRIC_KERNELS, Capabilities::SYMMETRIC_WINDOWS),
];

impl Capabilities {
    /// The capabilities this one (a single flag) needs directly: [`Capabilities::WINDOWS_IN_CAPTURE`] and
    /// [`Capabilities::SYMMETRIC_KERNELS`] need [`Capabilities::SYMMETRIC_WINDOWS`]; empty for the others.
    pub fn requires(self) -> Capabilities {
        DEPENDENCIES.iter().filter(|(dep, _)| *dep == self).fold(Capabilities::empty(), |acc, (_, pre)| acc | *pre)
    }

    /// The capability's stable kebab-case name (`"symmetric-windows"`), for `anyccl probe` and `ANYCCL_DISABLE`.
    /// Returns `None` for a value that is not a single flag.
    pub fn name(self) -> Option<&'static str> {
        CAPABILITY_INFO.iter().find(|(c, _, _)| *c == self).map(|(_, n, _)| *n)
    }

    /// What provides the capability, in a few words.
    pub fn provider(self) -> Option<&'static str> {
        CAPABILITY_INFO.iter().find(|(c, _, _)| *c == self).map(|(_, _, p)| *p)
    }

    /// Looks a single capability up by its kebab-case name.
    pub fn from_kebab_name(name: &str) -> Option<Capabilities> {
        let name = name.trim().to_ascii_lowercase().replace('_', "-");
        CAPABILITY_INFO.iter().find(|(_, n, _)| *n == name).map(|(c, _, _)| *c)
    }

    /// Every single flag, in display order.
    pub fn each() -> impl Iterator<Item = Capabilities> {
        CAPABILITY_INFO.iter().map(|(c, _, _)| *c)
    }
}

/// Why a capability is disabled: always a concrete cause a user can act on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Reason {
    /// The library does not export a symbol the capability needs.
    MissingSymbol {
        /// The symbol (`ncclCommWindowRegister`).
        symbol: String,
        /// The library file that was loaded.
        library: String,
        /// The library's vendor and version (`RCCL 2.26.6`), where known.
        version: Option<String>,
    },
    /// A component is older than the capability needs.
    VersionTooOld {
        /// What is too old (`"NCCL at /usr/lib/libnccl.so.2"`).
        component: String,
        /// The version found.
        found: String,
        /// The oldest version that works.
        required: String,
    },
    /// The device lacks a hardware attribute.
    DeviceAttribute {
        /// The device (`"device 0 (NVIDIA H200)"`).
        device: String,
        /// The attribute and the value read (`"CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0"`).
        attribute: String,
    },
    /// An environment variable turned it off.
    EnvVar {
        /// The variable.
        var: String,
        /// Its value.
        value: String,
    },
    /// This build does not contain it.
    NotCompiledIn {
        /// What is missing (`"cargo feature cuda"`, `"CUDA kernels"`).
        what: String,
        /// Why (`"nvcc not found at build time"`).
        detail: String,
    },
    /// A library, driver or device it needs is not present.
    Unavailable {
        /// What is missing (`"libcuda.so.1"`).
        component: String,
        /// Details (`"not found by the dynamic loader"`).
        detail: String,
    },
    /// It does not apply to this backend at all (for example NCCL symbols on the host backend).
    NotApplicable {
        /// Why.
        detail: String,
    },
    /// It needs another capability that is disabled.
    Requires {
        /// The capability it needs.
        capability: String,
        /// Why that one is disabled.
        because: Box<Reason>,
    },
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::MissingSymbol { symbol, library, version: Some(v) } => {
                write!(f, "{library} ({v}) does not export {symbol}")
            }
            Reason::MissingSymbol { symbol, library, version: None } => {
                write!(f, "{library} does not export {symbol}")
            }
            Reason::VersionTooOld { component, found, required } => {
                write!(f, "{component} is version {found}; {required} or newer is required")
            }
            Reason::DeviceAttribute { device, attribute } => {
                write!(f, "{device} reports {attribute}")
            }
            Reason::EnvVar { var, value } => write!(f, "turned off by {var}={value}"),
            Reason::NotCompiledIn { what, detail } => write!(f, "{what} not compiled in: {detail}"),
            Reason::Unavailable { component, detail } => {
                write!(f, "{component} unavailable: {detail}")
            }
            Reason::NotApplicable { detail } => write!(f, "not applicable: {detail}"),
            Reason::Requires { capability, because } => write!(f, "requires {capability}, which is off: {because}"),
        }
    }
}

/// Whether one capability is on, and if not, why.
///
/// Not `#[non_exhaustive]`: a capability is usable or not; what grows is [`Reason`], which is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CapabilityState {
    /// Usable.
    Enabled,
    /// Not usable, for this reason.
    Disabled(Reason),
}

impl CapabilityState {
    /// True when enabled.
    pub fn is_enabled(&self) -> bool {
        matches!(self, CapabilityState::Enabled)
    }
}

/// For every [`Capabilities`] flag: enabled, or disabled with a [`Reason`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapabilityReport {
    states: Vec<(Capabilities, CapabilityState)>,
}

impl CapabilityReport {
    /// A report where every capability is disabled for the reason `reason_for` gives.
    pub fn all_disabled(mut reason_for: impl FnMut(Capabilities) -> Reason) -> Self {
        let states = Capabilities::each().map(|c| (c, CapabilityState::Disabled(reason_for(c)))).collect();
        CapabilityReport { states }
    }

    /// Marks `caps` (one or more flags) enabled.
    pub fn enable(&mut self, caps: Capabilities) {
        for (c, s) in &mut self.states {
            if caps.contains(*c) {
                *s = CapabilityState::Enabled;
            }
        }
    }

    /// Marks `caps` (one or more flags) disabled for `reason`.
    pub fn disable(&mut self, caps: Capabilities, reason: Reason) {
        for (c, s) in &mut self.states {
            if caps.contains(*c) {
                *s = CapabilityState::Disabled(reason.clone());
            }
        }
    }

    /// Copies the states of `caps` (one or more flags) from `other`.
    pub fn merge_from(&mut self, other: &CapabilityReport, caps: Capabilities) {
        for (c, s) in &mut self.states {
            if caps.contains(*c) {
                *s = other.state(*c).clone();
            }
        }
    }

    /// The state of one flag.
    pub fn state(&self, cap: Capabilities) -> &CapabilityState {
        // Every single flag is in `states` by construction (`all_disabled` walks `Capabilities::each`); a
        // multi-flag value finds nothing and reads as not applicable.
        static MULTI: CapabilityState = CapabilityState::Disabled(Reason::NotApplicable { detail: String::new() });
        self.states.iter().find(|(c, _)| *c == cap).map(|(_, s)| s).unwrap_or(&MULTI)
    }

    /// The set of enabled flags.
    pub fn enabled(&self) -> Capabilities {
        self.states.iter().filter(|(_, s)| s.is_enabled()).fold(Capabilities::empty(), |acc, (c, _)| acc | *c)
    }

    /// Whether `cap` is enabled.
    pub fn has(&self, cap: Capabilities) -> bool {
        self.enabled().contains(cap)
    }

    /// `Ok` when `cap` is enabled, else [`Error::Unsupported`] with the reason.
    pub fn require(&self, cap: Capabilities) -> Result<()> {
        match self.state(cap) {
            CapabilityState::Enabled => Ok(()),
            CapabilityState::Disabled(reason) => Err(Error::Unsupported {
                capability: cap.name().unwrap_or("capability").to_owned(),
                reason: reason.clone(),
            }),
        }
    }

    /// Applies `ANYCCL_DISABLE` (a comma-separated list of capability names): each named capability is disabled
    /// with the variable as its reason, and so is every capability that needs one of them
    /// ([`Capabilities::requires`]; `symmetric-windows` takes `windows-in-capture` and `symmetric-kernels` with
    /// it), with a [`Reason::Requires`] that names the prerequisite and the variable. An unknown name is an error
    /// naming it; then nothing is changed.
    pub fn apply_disable_list(&mut self, var: &str, value: &str) -> Result<()> {
        let mut named = Vec::new();
        for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let Some(cap) = Capabilities::from_kebab_name(name) else {
                let known: Vec<_> = Capabilities::each().filter_map(Capabilities::name).collect();
                return Err(Error::Config {
                    source_name: var.to_owned(),
                    line: None,
                    message: format!("unknown capability '{name}' (known: {})", known.join(", ")),
                });
            };
            named.push(cap);
        }
        let mut off = Capabilities::empty();
        for cap in named {
            self.disable(cap, Reason::EnvVar { var: var.to_owned(), value: value.to_owned() });
            off |= cap;
        }
        self.disable_dependents(off);
        Ok(())
    }

    /// Disables, transitively, every enabled capability that needs one of `off` ([`Capabilities::requires`]),
    /// with a [`Reason::Requires`] carrying the prerequisite's own reason.
    fn disable_dependents(&mut self, mut off: Capabilities) {
        // Each pass disables at least one more flag or stops: at most one pass per flag.
        loop {
            let next = DEPENDENCIES.iter().find(|(dep, pre)| off.contains(*pre) && self.has(*dep));
            let Some(&(dep, pre)) = next else { return };
            let because = match self.state(pre) {
                CapabilityState::Disabled(r) => Box::new(r.clone()),
                CapabilityState::Enabled => return,
            };
            let capability = pre.name().unwrap_or("capability").to_owned();
            self.disable(dep, Reason::Requires { capability, because });
            off |= dep;
        }
    }

    /// Reads `ANYCCL_DISABLE` from the environment and applies it (see [`Self::apply_disable_list`]); a value that
    /// is not UTF-8 is an [`Error::Config`] naming the variable, like any other invalid value.
    pub fn apply_env(&mut self) -> Result<()> {
        match crate::env::var("ANYCCL_DISABLE")? {
            Some(v) => self.apply_disable_list("ANYCCL_DISABLE", &v),
            None => Ok(()),
        }
    }

    /// Disables [`Capabilities::MULTICAST`] when `NCCL_NVLS_ENABLE` (read through `env`) turns NVLS off
    /// ([`nvls_off_by_env`]); an explicit switch is the reason users act on, so it replaces any other.
    pub fn apply_nvls_env(&mut self, env: &dyn Fn(&str) -> Option<String>) {
        if let Some(reason) = nvls_off_by_env(env) {
            self.disable(Capabilities::MULTICAST, reason);
        }
    }

    /// Every flag with its state, in display order.
    pub fn iter(&self) -> impl Iterator<Item = (Capabilities, &CapabilityState)> {
        self.states.iter().map(|(c, s)| (*c, s))
    }
}

/// A table, one line per capability in display order: `[on ]` and the name for an enabled one, `[off]`, the name
/// padded to a column and the reason for a disabled one (the form `anyccl probe` prints). Every line ends in a
/// newline.
///
/// ```
/// use anyccl_core::{Capabilities, CapabilityReport, Reason};
///
/// let mut report = CapabilityReport::all_disabled(|_| Reason::NotApplicable { detail: "no GPU".into() });
/// report.enable(Capabilities::HOST_BACKEND);
/// let text = report.to_string();
/// assert!(text.starts_with("[on ] host-backend\n[off] cuda-runtime         not applicable: no GPU\n"));
/// ```
impl fmt::Display for CapabilityReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (c, state) in self.iter() {
            let name = c.name().unwrap_or("?");
            match state {
                CapabilityState::Enabled => writeln!(f, "[on ] {name}")?,
                CapabilityState::Disabled(reason) => writeln!(f, "[off] {name:<20} {reason}")?,
            }
        }
        Ok(())
    }
}

/// The variable NCCL reads to turn NVLink SHARP (multicast, NVLS) off; anyccl honours it too.
pub const NVLS_ENABLE_VAR: &str = "NCCL_NVLS_ENABLE";

/// Why multicast is off when [`NVLS_ENABLE_VAR`], read through `env`, is set to 0 as an integer (as NCCL reads
/// it; spaces around it are ignored, so `0`, ` 0 ` and `00` all turn it off); `None` when it is unset or anything
/// else. The one reading of the variable: the capability reports, the multicast manager and its driver's
/// interlock all ask here.
pub fn nvls_off_by_env(env: &dyn Fn(&str) -> Option<String>) -> Option<Reason> {
    let value = env(NVLS_ENABLE_VAR)?;
    (value.trim().parse::<i64>() == Ok(0)).then(|| Reason::EnvVar { var: NVLS_ENABLE_VAR.to_owned(), value })
}

/// JSON form: a list of `{ "name", "enabled", "provider", "reason", "reason_detail" }` objects.
impl Serialize for CapabilityReport {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        struct Entry<'a>(Capabilities, &'a CapabilityState);
        impl Serialize for Entry<'_> {
            fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
                let mut s = serializer.serialize_struct("Capability", 5)?;
                s.serialize_field("name", &self.0.name())?;
                s.serialize_field("enabled", &self.1.is_enabled())?;
                s.serialize_field("provider", &self.0.provider())?;
                match self.1 {
                    CapabilityState::Enabled => {
                        s.serialize_field("reason", &Option::<String>::None)?;
                        s.serialize_field("reason_detail", &Option::<Reason>::None)?;
                    }
                    CapabilityState::Disabled(r) => {
                        s.serialize_field("reason", &r.to_string())?;
                        s.serialize_field("reason_detail", r)?;
                    }
                }
                s.end()
            }
        }
        serializer.collect_seq(self.states.iter().map(|(c, s)| Entry(*c, s)))
    }
}

/// The capabilities `ANYCCL_DISABLE` turns off (an invalid value is a [`Error::Config`] naming the variable).
pub fn disabled_by_env() -> Result<Capabilities> {
    const VAR: &str = "ANYCCL_DISABLE";
    let Some(value) = crate::env::var(VAR)? else { return Ok(Capabilities::empty()) };
    let mut all = CapabilityReport::all_disabled(|_| Reason::NotApplicable { detail: String::new() });
    all.enable(Capabilities::all());
    all.apply_disable_list(VAR, &value)?;
    Ok(Capabilities::all().difference(all.enabled()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> CapabilityReport {
        CapabilityReport::all_disabled(|_| Reason::NotApplicable { detail: "test".into() })
    }

    #[test]
    fn nvls_is_off_only_for_an_integer_zero() {
        let with = |v: &'static str| move |k: &str| (k == NVLS_ENABLE_VAR).then(|| v.to_owned());
        for off in ["0", " 0 ", "00", "-0"] {
            let want = Reason::EnvVar { var: "NCCL_NVLS_ENABLE".into(), value: off.into() };
            assert_eq!(nvls_off_by_env(&with(off)), Some(want.clone()), "{off:?}");
            let mut r = CapabilityReport::all_disabled(|_| Reason::NotApplicable { detail: "x".into() });
            r.enable(Capabilities::MULTICAST);
            r.apply_nvls_env(&with(off));
            assert_eq!(r.state(Capabilities::MULTICAST), &CapabilityState::Disabled(want));
        }
        for on in ["1", "2", "", "off", "0x"] {
            assert_eq!(nvls_off_by_env(&with(on)), None, "{on:?}");
            let mut r = report();
            r.enable(Capabilities::MULTICAST);
            r.apply_nvls_env(&with(on));
            assert!(r.has(Capabilities::MULTICAST), "{on:?}");
        }
        assert_eq!(nvls_off_by_env(&|_| None), None);
    }

    #[test]
    fn every_flag_has_a_unique_name() {
        let names: Vec<_> = Capabilities::each().map(|c| c.name().expect("named")).collect();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(names.len(), sorted.len());
        assert_eq!(Capabilities::each().fold(Capabilities::empty(), |a, c| a | c), Capabilities::all());
    }

    #[test]
    fn enable_disable_require() {
        let mut r = report();
        assert!(r.require(Capabilities::CCL).is_err());
        r.enable(Capabilities::CCL | Capabilities::BF16);
        assert!(r.require(Capabilities::CCL).is_ok());
        assert_eq!(r.enabled(), Capabilities::CCL | Capabilities::BF16);
        r.disable(
            Capabilities::BF16,
            Reason::VersionTooOld { component: "NCCL".into(), found: "2.9.9".into(), required: "2.10.0".into() },
        );
        let err = r.require(Capabilities::BF16).expect_err("disabled");
        assert_eq!(err.to_string(), "bf16 is not available: NCCL is version 2.9.9; 2.10.0 or newer is required");
    }

    #[test]
    fn disable_list_names_the_variable_and_rejects_unknown_names() {
        let mut r = report();
        r.enable(Capabilities::all());
        r.apply_disable_list("ANYCCL_DISABLE", "symmetric-windows, multicast").expect("valid list");
        assert!(!r.has(Capabilities::SYMMETRIC_WINDOWS));
        assert!(!r.has(Capabilities::MULTICAST));
        assert!(r.has(Capabilities::CCL));
        assert_eq!(
            r.state(Capabilities::MULTICAST),
            &CapabilityState::Disabled(Reason::EnvVar {
                var: "ANYCCL_DISABLE".into(),
                value: "symmetric-windows, multicast".into()
            })
        );
        let err = r.apply_disable_list("ANYCCL_DISABLE", "symetric").expect_err("typo");
        assert!(matches!(err, Error::Config { .. }));
        assert!(err.to_string().contains("unknown capability 'symetric'"));
    }

    #[test]
    fn disabling_a_capability_by_name_disables_what_needs_it() {
        let mut r = report();
        r.enable(Capabilities::all());
        r.apply_disable_list("ANYCCL_DISABLE", "symmetric-windows").expect("valid list");
        let env = Reason::EnvVar { var: "ANYCCL_DISABLE".into(), value: "symmetric-windows".into() };
        assert_eq!(r.state(Capabilities::SYMMETRIC_WINDOWS), &CapabilityState::Disabled(env.clone()));
        let dep = Reason::Requires { capability: "symmetric-windows".into(), because: Box::new(env) };
        for c in [Capabilities::WINDOWS_IN_CAPTURE, Capabilities::SYMMETRIC_KERNELS] {
            assert_eq!(r.state(c), &CapabilityState::Disabled(dep.clone()), "{c:?}");
            let e = r.require(c).expect_err("off");
            assert!(e.to_string().contains("requires symmetric-windows, which is off: turned off by ANYCCL_DISABLE"));
        }
        // Nothing else is touched, and a dependent named itself keeps its own reason.
        assert_eq!(
            r.enabled(),
            Capabilities::all().difference(
                Capabilities::SYMMETRIC_WINDOWS | Capabilities::WINDOWS_IN_CAPTURE | Capabilities::SYMMETRIC_KERNELS
            )
        );
        let mut r = report();
        r.enable(Capabilities::all());
        r.apply_disable_list("ANYCCL_DISABLE", "symmetric-kernels").expect("valid list");
        assert!(r.has(Capabilities::SYMMETRIC_WINDOWS) && r.has(Capabilities::WINDOWS_IN_CAPTURE));
        assert!(!r.has(Capabilities::SYMMETRIC_KERNELS));
        // An invalid list changes nothing.
        let mut r = report();
        r.enable(Capabilities::all());
        r.apply_disable_list("ANYCCL_DISABLE", "symmetric-windows, nope").expect_err("unknown");
        assert_eq!(r.enabled(), Capabilities::all());
        assert_eq!(Capabilities::SYMMETRIC_KERNELS.requires(), Capabilities::SYMMETRIC_WINDOWS);
        assert_eq!(Capabilities::CCL.requires(), Capabilities::empty());
    }

    #[test]
    fn reasons_read_as_sentences() {
        let r = Reason::MissingSymbol {
            symbol: "ncclCommWindowRegister".into(),
            library: "/opt/rocm/lib/librccl.so.1".into(),
            version: Some("RCCL 2.26.6".into()),
        };
        assert_eq!(r.to_string(), "/opt/rocm/lib/librccl.so.1 (RCCL 2.26.6) does not export ncclCommWindowRegister");
    }

    #[test]
    fn display_is_one_line_per_capability_with_its_reason() {
        let mut r = CapabilityReport::all_disabled(|c| {
            if c == Capabilities::MULTICAST {
                Reason::EnvVar { var: "NCCL_NVLS_ENABLE".into(), value: "0".into() }
            } else {
                Reason::NotApplicable { detail: "test".into() }
            }
        });
        r.enable(Capabilities::HOST_BACKEND | Capabilities::COMM_SPLIT | Capabilities::BF16 | Capabilities::AVG);
        let want = "\
[on ] host-backend
[off] cuda-runtime         not applicable: test
[off] hip-runtime          not applicable: test
[off] ccl                  not applicable: test
[on ] comm-split
[off] buffer-registration  not applicable: test
[off] ccl-mem-alloc        not applicable: test
[off] symmetric-windows    not applicable: test
[off] windows-in-capture   not applicable: test
[off] symmetric-kernels    not applicable: test
[off] comm-shrink          not applicable: test
[off] device-api           not applicable: test
[off] per-call-config      not applicable: test
[on ] bf16
[on ] avg
[off] fp8                  not applicable: test
[off] pre-mul-sum          not applicable: test
[off] last-error           not applicable: test
[off] p2p-all-pairs        not applicable: test
[off] ipc                  not applicable: test
[off] multicast            turned off by NCCL_NVLS_ENABLE=0
[off] custom-kernels       not applicable: test
[off] graph-capture        not applicable: test
[off] dependent-launch     not applicable: test
";
        assert_eq!(r.to_string(), want);
    }

    #[test]
    fn json_lists_every_flag() {
        let r = report();
        let v = serde_json::to_value(&r).expect("serializes");
        let arr = v.as_array().expect("array");
        assert_eq!(arr.len(), Capabilities::each().count());
        assert_eq!(arr[0]["enabled"], false);
        assert_eq!(arr[0]["reason_detail"]["kind"], "not-applicable");
    }
}
