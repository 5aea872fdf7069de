//! Fake NCCL/RCCL libraries compiled at test time from C with the system `cc`, each exporting the symbol set of
//! one release, and broken ones. Every test asserts the exact capability report and its reasons.

use anyccl_testkit::fake_ccl;

use std::collections::BTreeMap;
use std::ffi::{c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyccl_ccl::find::Place;
use anyccl_ccl::loader::{OPTIONAL_SYMBOLS, REQUIRED_SYMBOLS};
use anyccl_ccl::{derive_capabilities, CclComm, CclLibrary, CclVendor, LoadFailure, SearchPlan, UniqueId};
use anyccl_core::{Capabilities, CapabilityState, DataType, Error, InvalidArgument, ReduceOp};
use fake_ccl::*;

fn no_env(_: &str) -> Option<String> {
    None
}

/// The state of each collective-library capability, as text: "on", or the reason.
fn ccl_states(lib: &CclLibrary, env: &dyn Fn(&str) -> Option<String>) -> BTreeMap<&'static str, String> {
    let r = derive_capabilities(lib, env);
    Capabilities::each()
        .map(|c| {
            let s = match r.state(c) {
                CapabilityState::Enabled => "on".to_owned(),
                CapabilityState::Disabled(reason) => reason.to_string(),
            };
            (c.name().expect("named"), s)
        })
        .collect()
}

fn expect_states(lib: &CclLibrary, env: &dyn Fn(&str) -> Option<String>, expected: &[(&str, &str)]) {
    let got = ccl_states(lib, env);
    for (name, state) in &got {
        let want = expected.iter().find(|(n, _)| n == name).map(|(_, w)| *w);
        match want {
            Some(w) => assert_eq!(state, w, "capability {name} of {}", lib.describe()),
            None => assert!(
                state.starts_with("not applicable: decided by the GPU runtime"),
                "capability {name} of {}: {state}",
                lib.describe()
            ),
        }
    }
}

fn missing(lib: &CclLibrary, sym: &str) -> String {
    format!("{} ({}) does not export {sym}", lib.path().display(), lib.describe())
}

/// The reason `windows-in-capture` gives when symmetric windows are off `because`.
fn no_windows(because: &str) -> String {
    format!("requires symmetric-windows, which is off: {because}")
}

/// The reason `windows-in-capture` gives for a release of `lib`'s vendor before 2.30.7.
fn capture_too_old(lib: &CclLibrary) -> String {
    let path = lib.path().display();
    let component = if lib.vendor() == CclVendor::Rccl {
        format!("RCCL at {path} (RCCL 2.30.4 fails to register windows inside graph capture)")
    } else {
        format!("NCCL at {path}")
    };
    format!("{component} is version {}; 2.30.7 or newer is required", lib.version())
}

#[test]
fn nccl_2_17_has_no_split() {
    let lib = CclLibrary::open(&build_profile(&NCCL_2_17)).expect("loads");
    assert_eq!((lib.vendor(), lib.version().to_string()), (CclVendor::Nccl, "2.17.1".to_owned()));
    let too_old =
        |need: &str| format!("NCCL at {} is version 2.17.1; {need} or newer is required", lib.path().display());
    expect_states(
        &lib,
        &no_env,
        &[
            ("ccl", "on"),
            ("comm-split", &missing(&lib, "ncclCommSplit")),
            ("buffer-registration", &missing(&lib, "ncclCommRegister")),
            ("ccl-mem-alloc", &missing(&lib, "ncclMemAlloc")),
            ("symmetric-windows", &missing(&lib, "ncclCommWindowRegister")),
            ("windows-in-capture", &no_windows(&missing(&lib, "ncclCommWindowRegister"))),
            ("symmetric-kernels", &no_windows(&missing(&lib, "ncclCommWindowRegister"))),
            ("per-call-config", &missing(&lib, "ncclAllReduceConfig")),
            ("comm-shrink", &missing(&lib, "ncclCommShrink")),
            ("device-api", &missing(&lib, "ncclDevCommCreate")),
            ("bf16", "on"),
            ("avg", "on"),
            ("fp8", &too_old("2.24")),
            ("pre-mul-sum", "on"),
            ("last-error", "on"),
        ],
    );
}

#[test]
fn nccl_2_18_has_split_but_no_mem_alloc() {
    let lib = CclLibrary::open(&build_profile(&NCCL_2_18)).expect("loads");
    assert_eq!(lib.version().to_string(), "2.18.3");
    let fp8 = format!("NCCL at {} is version 2.18.3; 2.24 or newer is required", lib.path().display());
    expect_states(
        &lib,
        &no_env,
        &[
            ("ccl", "on"),
            ("comm-split", "on"),
            ("buffer-registration", &missing(&lib, "ncclCommRegister")),
            ("ccl-mem-alloc", &missing(&lib, "ncclMemAlloc")),
            ("symmetric-windows", &missing(&lib, "ncclCommWindowRegister")),
            ("windows-in-capture", &no_windows(&missing(&lib, "ncclCommWindowRegister"))),
            ("symmetric-kernels", &no_windows(&missing(&lib, "ncclCommWindowRegister"))),
            ("per-call-config", &missing(&lib, "ncclAllReduceConfig")),
            ("comm-shrink", &missing(&lib, "ncclCommShrink")),
            ("device-api", &missing(&lib, "ncclDevCommCreate")),
            ("bf16", "on"),
            ("avg", "on"),
            ("fp8", &fp8),
            ("pre-mul-sum", "on"),
            ("last-error", "on"),
        ],
    );
    // fp8 refused by the dtype mapping too, with the version in the message.
    let err = anyccl_ccl::nccl_dtype(&lib, DataType::Fp8E4M3).expect_err("no fp8 before 2.24");
    assert!(err.to_string().contains("NCCL 2.18.3 has no fp8e4m3"), "{err}");
}

#[test]
fn nccl_2_26_has_no_windows() {
    let lib = CclLibrary::open(&build_profile(&NCCL_2_26)).expect("loads");
    expect_states(
        &lib,
        &no_env,
        &[
            ("ccl", "on"),
            ("comm-split", "on"),
            ("buffer-registration", "on"),
            ("ccl-mem-alloc", "on"),
            ("symmetric-windows", &missing(&lib, "ncclCommWindowRegister")),
            ("windows-in-capture", &no_windows(&missing(&lib, "ncclCommWindowRegister"))),
            ("symmetric-kernels", &no_windows(&missing(&lib, "ncclCommWindowRegister"))),
            ("per-call-config", &missing(&lib, "ncclAllReduceConfig")),
            ("comm-shrink", &missing(&lib, "ncclCommShrink")),
            ("device-api", &missing(&lib, "ncclDevCommCreate")),
            ("bf16", "on"),
            ("avg", "on"),
            ("fp8", "on"),
            ("pre-mul-sum", "on"),
            ("last-error", "on"),
        ],
    );
}

#[test]
fn nccl_2_28_has_everything_and_env_switches_show_as_reasons() {
    let lib = CclLibrary::open(&build_profile(&NCCL_2_28)).expect("loads");
    let all_on: Vec<(&str, &str)> = [
        "ccl",
        "comm-split",
        "buffer-registration",
        "ccl-mem-alloc",
        "symmetric-windows",
        "comm-shrink",
        "device-api",
        "bf16",
        "avg",
        "fp8",
        "pre-mul-sum",
        "last-error",
        "symmetric-kernels",
    ]
    .into_iter()
    .map(|n| (n, "on"))
    .collect();
    let per_call = missing(&lib, "ncclAllReduceConfig");
    // 2.28.9 registers windows, but not during graph capture (from 2.30.7 on).
    let capture = capture_too_old(&lib);
    assert_eq!(capture, format!("NCCL at {} is version 2.28.9; 2.30.7 or newer is required", lib.path().display()));
    let mut all_on = all_on;
    all_on.push(("windows-in-capture", &capture));
    all_on.push(("per-call-config", &per_call));
    expect_states(&lib, &no_env, &all_on);
    let env = |k: &str| match k {
        "NCCL_NVLS_ENABLE" => Some("0".to_owned()),
        "NCCL_WIN_ENABLE" => Some("0".to_owned()),
        _ => None,
    };
    let mut with_env = all_on.clone();
    with_env.retain(|(n, _)| !["symmetric-windows", "windows-in-capture", "symmetric-kernels"].contains(n));
    with_env.push(("symmetric-windows", "turned off by NCCL_WIN_ENABLE=0"));
    let win_off = no_windows("turned off by NCCL_WIN_ENABLE=0");
    with_env.push(("windows-in-capture", &win_off));
    with_env.push(("symmetric-kernels", &win_off));
    with_env.push(("multicast", "turned off by NCCL_NVLS_ENABLE=0"));
    expect_states(&lib, &env, &with_env);

    // Every data type and operator anyccl-core has today maps to its nccl.h value (`DataType` and `ReduceOp` are
    // `#[non_exhaustive]`; the mapping's fallback arm must not have taken any of them).
    // nccl.h numbers bf16 (9) after f64 (8), unlike `DataType::ALL`.
    let types = [
        (DataType::I8, 0),
        (DataType::U8, 1),
        (DataType::I32, 2),
        (DataType::U32, 3),
        (DataType::I64, 4),
        (DataType::U64, 5),
        (DataType::F16, 6),
        (DataType::F32, 7),
        (DataType::F64, 8),
        (DataType::Bf16, 9),
        (DataType::Fp8E4M3, 10),
        (DataType::Fp8E5M2, 11),
    ];
    assert_eq!(types.len(), DataType::ALL.len(), "a data type without an expected code");
    for (dtype, code) in types {
        assert_eq!(anyccl_ccl::nccl_dtype(&lib, dtype).ok(), Some(code), "{dtype}");
    }
    // ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg: max before min, unlike `ReduceOp::ALL`.
    let ops = [(ReduceOp::Sum, 0), (ReduceOp::Prod, 1), (ReduceOp::Max, 2), (ReduceOp::Min, 3), (ReduceOp::Avg, 4)];
    assert_eq!(ops.len(), ReduceOp::ALL.len(), "an operator without an expected code");
    for (op, code) in ops {
        assert_eq!(anyccl_ccl::nccl_op(&lib, op, DataType::F32).ok(), Some(code), "{op}");
    }
}

#[test]
fn rccl_6_2_is_told_apart_and_has_fp8() {
    let lib = CclLibrary::open(&build_profile(&RCCL_6_2)).expect("loads");
    assert_eq!((lib.vendor(), lib.describe()), (CclVendor::Rccl, "RCCL 2.20.5".to_owned()));
    expect_states(
        &lib,
        &no_env,
        &[
            ("ccl", "on"),
            ("comm-split", "on"),
            ("buffer-registration", "on"),
            ("ccl-mem-alloc", "on"),
            ("symmetric-windows", &missing(&lib, "ncclCommWindowRegister")),
            ("windows-in-capture", &no_windows(&missing(&lib, "ncclCommWindowRegister"))),
            ("symmetric-kernels", &no_windows(&missing(&lib, "ncclCommWindowRegister"))),
            ("per-call-config", &missing(&lib, "ncclAllReduceConfig")),
            ("comm-shrink", &missing(&lib, "ncclCommShrink")),
            ("device-api", &missing(&lib, "ncclDevCommCreate")),
            ("bf16", "on"),
            ("avg", "on"),
            ("fp8", "on"),
            ("pre-mul-sum", "on"),
            ("last-error", "on"),
        ],
    );
    assert_eq!(anyccl_ccl::nccl_dtype(&lib, DataType::Fp8E5M2).ok(), Some(11));
}

#[test]
fn rccl_7_0_has_no_window_register_and_says_so() {
    let lib = CclLibrary::open(&build_profile(&RCCL_7_0)).expect("loads");
    assert_eq!(lib.describe(), "RCCL 2.26.6");
    let reason = missing(&lib, "ncclCommWindowRegister");
    assert!(reason.ends_with("(RCCL 2.26.6) does not export ncclCommWindowRegister"), "{reason}");
    // Even with cuMem on, the symbol is what is missing.
    let cumem = |k: &str| (k == "NCCL_CUMEM_ENABLE").then(|| "1".to_owned());
    for env in [&no_env as &dyn Fn(&str) -> Option<String>, &cumem] {
        expect_states(
            &lib,
            env,
            &[
                ("ccl", "on"),
                ("comm-split", "on"),
                ("buffer-registration", "on"),
                ("ccl-mem-alloc", "on"),
                ("symmetric-windows", &reason),
                ("windows-in-capture", &no_windows(&reason)),
                ("symmetric-kernels", &no_windows(&reason)),
                ("per-call-config", &missing(&lib, "ncclAllReduceConfig")),
                ("comm-shrink", &missing(&lib, "ncclCommShrink")),
                ("device-api", &missing(&lib, "ncclDevCommCreate")),
                ("bf16", "on"),
                ("avg", "on"),
                ("fp8", "on"),
                ("pre-mul-sum", "on"),
                ("last-error", "on"),
            ],
        );
    }
}

#[test]
fn rccl_7_1_windows_need_cumem() {
    let lib = CclLibrary::open(&build_profile(&RCCL_7_1)).expect("loads");
    let base = |windows: &'static str| {
        vec![
            ("ccl", "on"),
            ("comm-split", "on"),
            ("buffer-registration", "on"),
            ("ccl-mem-alloc", "on"),
            ("symmetric-windows", windows),
            ("comm-shrink", "on"),
            ("bf16", "on"),
            ("avg", "on"),
            ("fp8", "on"),
            ("pre-mul-sum", "on"),
            ("last-error", "on"),
        ]
    };
    let dev = missing(&lib, "ncclDevCommCreate");
    let per_call = missing(&lib, "ncclAllReduceConfig");
    let cumem_off = "turned off by NCCL_CUMEM_ENABLE=unset (RCCL's default is 0)";
    let mut off = base(cumem_off);
    off.push(("device-api", &dev));
    off.push(("per-call-config", &per_call));
    let capture_off = no_windows(cumem_off);
    off.push(("windows-in-capture", &capture_off));
    off.push(("symmetric-kernels", &capture_off));
    expect_states(&lib, &no_env, &off);
    let cumem = |k: &str| (k == "NCCL_CUMEM_ENABLE").then(|| "1".to_owned());
    let mut on = base("on");
    on.push(("device-api", &dev));
    on.push(("per-call-config", &per_call));
    let capture = capture_too_old(&lib);
    on.push(("windows-in-capture", &capture));
    let kernels = rccl_kernels_too_old(&lib);
    on.push(("symmetric-kernels", &kernels));
    expect_states(&lib, &cumem, &on);
}

/// The reason `symmetric-kernels` gives for an RCCL before 2.30 that registers windows.
fn rccl_kernels_too_old(lib: &CclLibrary) -> String {
    format!(
        "RCCL at {} (it registers windows, but its collectives run no symmetric kernels; production ROCm 7.2.x ships \
         RCCL 2.27.7, ROCm 7.13 added them for gfx942/gfx950) is version {}; 2.30 or newer is required",
        lib.path().display(),
        lib.version()
    )
}

/// Every library-decided capability of a release that registers windows (NCCL 2.30 on, RCCL 2.27.7 on), with
/// `windows-in-capture`, `device-api`, `symmetric-kernels` and `per-call-config` as given.
fn windows_release(capture: &str, device_api: &str, kernels: &str, per_call: &str) -> Vec<(&'static str, String)> {
    let mut v: Vec<(&'static str, String)> = [
        "ccl",
        "comm-split",
        "buffer-registration",
        "ccl-mem-alloc",
        "symmetric-windows",
        "comm-shrink",
        "bf16",
        "avg",
        "fp8",
        "pre-mul-sum",
        "last-error",
    ]
    .into_iter()
    .map(|n| (n, "on".to_owned()))
    .collect();
    v.push(("device-api", device_api.to_owned()));
    v.push(("windows-in-capture", capture.to_owned()));
    v.push(("symmetric-kernels", kernels.to_owned()));
    v.push(("per-call-config", per_call.to_owned()));
    v
}

fn expect_owned(lib: &CclLibrary, env: &dyn Fn(&str) -> Option<String>, expected: &[(&'static str, String)]) {
    let borrowed: Vec<(&str, &str)> = expected.iter().map(|(n, s)| (*n, s.as_str())).collect();
    expect_states(lib, env, &borrowed);
}

#[test]
fn nccl_registers_windows_during_capture_from_2_30_7() {
    let releases = [
        (&NCCL_2_30_3, "2.30.3", false),
        (&NCCL_2_30_7, "2.30.7", true),
        (&NCCL_2_31, "2.31.2", true),
        (&NCCL_2_32, "2.32.3", true),
    ];
    for (p, version, in_capture) in releases {
        let lib = CclLibrary::open(&build_profile(p)).expect("loads");
        assert_eq!((lib.vendor(), lib.version().to_string()), (CclVendor::Nccl, version.to_owned()));
        let capture = if in_capture {
            "on".to_owned()
        } else {
            format!("NCCL at {} is version {version}; 2.30.7 or newer is required", lib.path().display())
        };
        // The per-call config from 2.31 on.
        let per_call =
            if lib.version().at_least(2, 31) { "on".to_owned() } else { missing(&lib, "ncclAllReduceConfig") };
        expect_owned(&lib, &no_env, &windows_release(&capture, "on", "on", &per_call));
        // Windows switched off take registration during capture and the symmetric kernels with them, whatever the
        // release.
        let env = |k: &str| (k == "NCCL_WIN_ENABLE").then(|| "0".to_owned());
        let win_off = no_windows("turned off by NCCL_WIN_ENABLE=0");
        let mut off = windows_release(&win_off, "on", &win_off, &per_call);
        off.retain(|(n, _)| *n != "symmetric-windows");
        off.push(("symmetric-windows", "turned off by NCCL_WIN_ENABLE=0".to_owned()));
        expect_owned(&lib, &env, &off);
    }
}

#[test]
fn nccl_algo_naming_only_some_collectives_is_a_warning_from_2_31_on() {
    use anyccl_ccl::caps::nccl_algo_warning;
    let algo = |value: &'static str, proto: Option<&'static str>| {
        move |k: &str| match k {
            "NCCL_ALGO" => Some(value.to_owned()),
            "NCCL_PROTO" => proto.map(str::to_owned),
            _ => None,
        }
    };
    let vllm = algo("allreduce:tree", Some("Simple"));
    for (p, warned) in [(&NCCL_2_30_7, false), (&NCCL_2_31, true), (&NCCL_2_32, true), (&RCCL_2_30_7, false)] {
        let lib = CclLibrary::open(&build_profile(p)).expect("loads");
        let got = nccl_algo_warning(&lib, &vllm);
        if !warned {
            // Before 2.31 the collectives NCCL_ALGO does not name keep NCCL's own choice.
            assert_eq!(got, None, "{}", lib.describe());
            continue;
        }
        let want = format!(
            "NCCL_ALGO=allreduce:tree names no algorithm for broadcast, reduce, allgather, reducescatter: from NCCL \
             2.31 on ({} is loaded) a collective NCCL_ALGO does not name has none, and NCCL_PROTO, set without a \
             collective prefix, forces them, so they fail with ncclInvalidUsage; name them too (for example \
             \"ring,tree;allreduce:tree\") or unset NCCL_ALGO",
            lib.describe()
        );
        assert_eq!(got.as_deref(), Some(want.as_str()));
        // Without a forcing NCCL_PROTO: still named, as what would make them fail.
        let got = nccl_algo_warning(&lib, &algo("allreduce:tree", None)).expect("a warning");
        assert!(got.contains("once something forces them"), "{got}");
        let got = nccl_algo_warning(&lib, &algo("allreduce:tree", Some("allreduce:simple"))).expect("a warning");
        assert!(got.contains("once something forces them"), "{got}");
        // A value that covers every collective, or none set: nothing to say.
        assert_eq!(nccl_algo_warning(&lib, &algo("ring,tree;allreduce:tree", Some("Simple"))), None);
        assert_eq!(nccl_algo_warning(&lib, &algo("ring", Some("Simple"))), None);
        assert_eq!(
            nccl_algo_warning(&lib, &algo("allreduce,broadcast,reduce,allgather,reducescatter:ring", None)),
            None
        );
        assert_eq!(nccl_algo_warning(&lib, &no_env), None);
    }
}

#[test]
fn rccl_registers_windows_during_capture_from_2_30_7_and_says_2_30_4_fails() {
    let cumem = |k: &str| (k == "NCCL_CUMEM_ENABLE").then(|| "1".to_owned());
    for (p, version, in_capture) in
        [(&RCCL_7_2, "2.27.7", false), (&RCCL_2_30_4, "2.30.4", false), (&RCCL_2_30_7, "2.30.7", true)]
    {
        let lib = CclLibrary::open(&build_profile(p)).expect("loads");
        assert_eq!(lib.describe(), format!("RCCL {version}"));
        let path = lib.path().display().to_string();
        let capture = if in_capture {
            "on".to_owned()
        } else {
            format!(
                "RCCL at {path} (RCCL 2.30.4 fails to register windows inside graph capture) is version {version}; \
                 2.30.7 or newer is required"
            )
        };
        let dev = missing(&lib, "ncclDevCommCreate");
        // RCCL 2.27.7 (production ROCm 7.2.x) registers windows but runs no symmetric kernels; no RCCL has the
        // per-call config of NCCL 2.31.
        let kernels = if lib.version().at_least(2, 30) { "on".to_owned() } else { rccl_kernels_too_old(&lib) };
        let per_call = missing(&lib, "ncclAllReduceConfig");
        expect_owned(&lib, &cumem, &windows_release(&capture, &dev, &kernels, &per_call));
        // Without cuMem RCCL's windows are off, and with them registration during capture and the symmetric
        // kernels, even on 2.30.7.
        let cumem_off = "turned off by NCCL_CUMEM_ENABLE=unset (RCCL's default is 0)";
        let mut off = windows_release(&no_windows(cumem_off), &dev, &no_windows(cumem_off), &per_call);
        off.retain(|(n, _)| *n != "symmetric-windows");
        off.push(("symmetric-windows", cumem_off.to_owned()));
        expect_owned(&lib, &no_env, &off);
    }
}

#[test]
fn broken_libraries_fail_with_reasons() {
    let mut syms: Vec<&str> = REQUIRED_SYMBOLS.iter().copied().filter(|s| *s != "ncclAllGather").collect();
    syms.extend_from_slice(BASE);
    let p = build("broken-missing/libnccl.so.2", &syms, 22809, 0);
    assert_eq!(
        CclLibrary::open(&p).expect_err("missing"),
        LoadFailure::MissingRequired { symbol: "ncclAllGather".into() }
    );

    let mut all: Vec<&str> = REQUIRED_SYMBOLS.to_vec();
    all.extend_from_slice(BASE);
    let p = build("broken-version/libnccl.so.2", &all, 22809, 1);
    assert!(matches!(CclLibrary::open(&p), Err(LoadFailure::BadVersion { ref detail }) if detail.contains("error 1")));
    let p = build("broken-code/libnccl.so.2", &all, -5, 0);
    assert!(matches!(CclLibrary::open(&p), Err(LoadFailure::BadVersion { ref detail }) if detail.contains("-5")));

    let text = fake_dir().join("broken-text/libnccl.so.2");
    std::fs::create_dir_all(text.parent().expect("dir")).expect("dir");
    std::fs::write(&text, "#!/bin/sh\necho not a library\n").expect("write");
    assert!(matches!(CclLibrary::open(&text), Err(LoadFailure::NotALibrary { .. })));

    // A search that meets all of them reports each one.
    let plan = SearchPlan {
        vendor: CclVendor::Nccl,
        places: vec![
            Place::Path(text.clone()),
            Place::Path(fake_dir().join("broken-missing/libnccl.so.2")),
            Place::Path(fake_dir().join("broken-version/libnccl.so.2")),
        ],
    };
    let msg = plan.load().expect_err("none of them loads").to_string();
    assert!(msg.contains("not a shared library (no ELF header)"), "{msg}");
    assert!(msg.contains("missing required symbol ncclAllGather"), "{msg}");
    assert!(msg.contains("ncclGetVersion returned error 1"), "{msg}");
}

#[test]
fn explicit_path_from_env_is_used_first() {
    let p = build_profile(&RCCL_7_0);
    let plan = SearchPlan::with_env(CclVendor::Rccl, &|k| (k == "ANYCCL_RCCL_PATH").then(|| p.clone()));
    let lib = plan.load().expect("explicit path loads");
    assert_eq!(lib.path(), p.canonicalize().expect("exists").as_path());
    assert_eq!(lib.describe(), "RCCL 2.26.6");
}

#[test]
fn no_symbol_is_looked_up_after_load() {
    let p = build_profile(&NCCL_2_28);
    // SAFETY: a fake library compiled above from plain C with no initialisers.
    let raw = unsafe { libloading::Library::new(&p) }.expect("dlopen");
    let lookups = AtomicUsize::new(0);
    let mut lookup = |name: &CStr| -> *const c_void {
        lookups.fetch_add(1, Ordering::SeqCst);
        // SAFETY: reads the symbol table only.
        unsafe { raw.get::<*const c_void>(name.to_bytes_with_nul()) }.map(|s| *s).unwrap_or(std::ptr::null())
    };
    let lib = Arc::new(CclLibrary::load_with(&p, &mut lookup).expect("loads"));
    let after_load = lookups.load(Ordering::SeqCst);
    assert_eq!(after_load, REQUIRED_SYMBOLS.len() + OPTIONAL_SYMBOLS.len(), "one lookup per symbol, in one pass");
    // Use everything: version, ids, a communicator, queries, mappings, the report.
    let id = UniqueId::new(&lib).expect("id");
    let comm = CclComm::init_rank(lib.clone(), 4, &id, 2).expect("init");
    assert_eq!((comm.count().ok(), comm.user_rank().ok()), (Some(4), Some(2)));
    comm.async_error().expect("healthy");
    let _ = derive_capabilities(&lib, &no_env);
    anyccl_ccl::nccl_op(&lib, ReduceOp::Avg, DataType::F32).expect("avg");
    drop(comm);
    assert_eq!(lookups.load(Ordering::SeqCst), after_load, "a symbol was looked up after load");
}

#[test]
fn unique_ids_round_trip_and_errors_carry_vendor_text() {
    let lib = Arc::new(CclLibrary::open(&build_profile(&NCCL_2_28)).expect("loads"));
    let id = UniqueId::new(&lib).expect("id");
    let bytes = id.as_bytes().to_vec();
    assert_eq!(UniqueId::from_bytes(&bytes).expect("128 bytes"), id);
    assert!(UniqueId::from_bytes(&bytes[..100]).is_err());
    // The fake refuses an id it did not make, as NCCL does with ncclInvalidArgument (4).
    let bogus = UniqueId::from_bytes(&[0u8; 128]).expect("128 bytes");
    let err = CclComm::init_rank(lib.clone(), 2, &bogus, 0).err().expect("refused");
    match err {
        Error::Backend { backend, call, code, message } => {
            assert_eq!((backend.as_str(), call.as_str(), code), ("nccl", "ncclCommInitRank", Some(4)));
            // The library's text reaches the error sanitised: its escape sequence and newline are escaped.
            assert_eq!(message, "invalid argument (fake); last error: fake last error\\u{1b}[2J\\n");
        }
        other => panic!("{other:?}"),
    }
    assert!(CclComm::init_rank(lib, 2, &id, 2).is_err(), "rank out of range");
}

#[test]
fn loading_twice_from_two_threads_and_dropping_while_a_communicator_lives() {
    let p = build_profile(&NCCL_2_26);
    let libs: Vec<Arc<CclLibrary>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2).map(|_| s.spawn(|| CclLibrary::open(&p).map(Arc::new))).collect();
        hs.into_iter().map(|h| h.join().expect("thread").expect("loads")).collect()
    });
    assert_eq!(libs[0].version(), libs[1].version());
    let id = UniqueId::new(&libs[0]).expect("id");
    let comm = CclComm::init_rank(libs[0].clone(), 3, &id, 1).expect("init");
    drop(libs); // the communicator keeps its library loaded
    assert_eq!(comm.count().ok(), Some(3));
    assert_eq!(comm.library().describe(), "NCCL 2.26.5");
    drop(comm);
}

#[test]
fn library_path_on_failure_names_every_place() {
    let plan = SearchPlan {
        vendor: CclVendor::Rccl,
        places: vec![
            Place::Path(Path::new("/nonexistent/librccl.so.1").to_owned()),
            Place::Soname("librccl-anyccl-absent.so.1".into()),
            Place::Path(PathBuf::from("/nonexistent-rocm/lib/librccl.so.1")),
        ],
    };
    let e = plan.load().expect_err("nothing there");
    let msg = e.to_string();
    assert!(msg.starts_with("RCCL not found; tried: /nonexistent/librccl.so.1 (not found)"), "{msg}");
    assert_eq!(e.tried.len(), 3);
}

#[test]
fn nccl_2_8_uses_the_old_version_encoding_and_lacks_bf16_and_avg() {
    // 2.8.4 is encoded 2*1000 + 8*100 + 4 = 2804; it predates every optional symbol.
    let p = build("nccl-2.8/libnccl.so.2", REQUIRED_SYMBOLS, 2804, 0);
    let lib = CclLibrary::open(&p).expect("loads");
    assert_eq!(lib.describe(), "NCCL 2.8.4");
    let old = |need: &str| format!("NCCL at {} is version 2.8.4; {need} or newer is required", lib.path().display());
    expect_states(
        &lib,
        &no_env,
        &[
            ("ccl", "on"),
            ("comm-split", &missing(&lib, "ncclCommSplit")),
            ("buffer-registration", &missing(&lib, "ncclCommRegister")),
            ("ccl-mem-alloc", &missing(&lib, "ncclMemAlloc")),
            ("symmetric-windows", &missing(&lib, "ncclCommWindowRegister")),
            ("windows-in-capture", &no_windows(&missing(&lib, "ncclCommWindowRegister"))),
            ("symmetric-kernels", &no_windows(&missing(&lib, "ncclCommWindowRegister"))),
            ("per-call-config", &missing(&lib, "ncclAllReduceConfig")),
            ("comm-shrink", &missing(&lib, "ncclCommShrink")),
            ("device-api", &missing(&lib, "ncclDevCommCreate")),
            ("bf16", &old("2.10")),
            ("avg", &old("2.10")),
            ("fp8", &old("2.24")),
            ("pre-mul-sum", &missing(&lib, "ncclRedOpCreatePreMulSum")),
            ("last-error", &missing(&lib, "ncclGetLastError")),
        ],
    );
    let e = anyccl_ccl::nccl_op(&lib, ReduceOp::Avg, DataType::F32).expect_err("no avg");
    assert!(e.to_string().contains("NCCL 2.8.4 has no ncclAvg"), "{e}");
    let e = anyccl_ccl::nccl_dtype(&lib, DataType::Bf16).expect_err("no bf16");
    assert!(e.to_string().contains("NCCL 2.8.4 has no bf16"), "{e}");
    assert_eq!(anyccl_ccl::nccl_dtype(&lib, DataType::F16).ok(), Some(6));
    // Without ncclGetLastError, errors still carry the error string.
    let bogus = UniqueId::from_bytes(&[0u8; 128]).expect("128 bytes");
    let err = CclComm::init_rank(Arc::new(lib), 2, &bogus, 0).err().expect("refused");
    assert!(matches!(err, Error::Backend { ref message, .. } if message == "invalid argument (fake)"), "{err:?}");
}

/// One rank of a world-1 communicator on the fake library at `path`.
fn world_1_rank(path: &Path) -> CclComm {
    let lib = Arc::new(CclLibrary::open(path).expect("loads"));
    let id = UniqueId::new(&lib).expect("id");
    CclComm::init_rank(lib, 1, &id, 0).expect("communicator")
}

#[test]
fn a_wait_that_never_finishes_aborts_the_communicator_and_later_calls_fail() {
    let mut rank = world_1_rank(&build_profile(&NCCL_2_28));
    // Work that finishes: the wait returns once the query says so.
    let mut polls = 0;
    let mut stops = 0;
    rank.wait_or_abort(
        std::time::Duration::from_secs(30),
        &mut || {
            polls += 1;
            Ok(polls == 3)
        },
        &mut || stops += 1,
    )
    .expect("finishes");
    assert_eq!(polls, 3);
    assert!(!rank.is_aborted());
    // A stream error is passed through, and the communicator stays usable.
    let e = rank
        .wait_or_abort(
            std::time::Duration::from_secs(30),
            &mut || Err(Error::PeerFailure("stream broke".into())),
            &mut || stops += 1,
        )
        .expect_err("stream error");
    assert_eq!(e.to_string(), Error::PeerFailure("stream broke".into()).to_string());
    assert_eq!(rank.count().expect("still live"), 1);
    assert_eq!(stops, 0, "the backend's kernels are stopped only before an abort");
    // Work that never finishes (a peer died): a timeout within the limit, the backend's kernels stopped once,
    // the communicator aborted.
    let start = std::time::Instant::now();
    let e = rank
        .wait_or_abort(std::time::Duration::from_millis(200), &mut || Ok(false), &mut || stops += 1)
        .expect_err("times out");
    assert_eq!(stops, 1);
    assert!(start.elapsed() < std::time::Duration::from_secs(10));
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("the communicator was aborted"), "{e}");
    assert!(rank.is_aborted());
    // Every later call says so instead of touching the freed communicator; dropping it destroys nothing twice.
    let later = rank.count().expect_err("aborted");
    assert!(matches!(later, Error::PeerFailure(ref m) if m.contains("aborted")), "{later}");
    assert!(rank.async_error().is_err());
    drop(rank);
}

#[test]
fn an_asynchronous_library_error_while_waiting_aborts_with_the_library_text() {
    let mut syms: Vec<&str> = REQUIRED_SYMBOLS.to_vec();
    syms.extend_from_slice(BASE);
    let source = c_source(&syms, 22809, 0).replace(
        "int ncclCommGetAsyncError(void* c, int* e) { *e = 0; return 0; }",
        "int ncclCommGetAsyncError(void* c, int* e) { *e = 1; return 0; }",
    );
    assert!(source.contains("*e = 1"), "the fake's async-error body changed; update this test");
    let path = compile_once("nccl-async-error/libnccl.so.2", &source, &[]);
    let mut rank = world_1_rank(&path);
    let mut stops = 0;
    let e = rank
        .wait_or_abort(std::time::Duration::from_secs(30), &mut || Ok(false), &mut || stops += 1)
        .expect_err("library error");
    assert_eq!(stops, 1, "the backend's kernels are stopped before the abort");
    assert!(matches!(e, Error::PeerFailure(_)), "{e}");
    let text = e.to_string();
    assert!(text.contains("unhandled error (fake)") && text.contains("the communicator was aborted"), "{text}");
    assert!(rank.is_aborted());
}

#[test]
fn a_wait_returns_within_its_grace_when_the_library_abort_blocks() {
    // The real ncclCommAbort frees device memory, which waits for the device: behind a kernel that waits for a
    // dead peer it never returns. This fake's abort blocks until the test opens its gate.
    let mut syms: Vec<&str> = REQUIRED_SYMBOLS.to_vec();
    syms.extend_from_slice(BASE);
    let plain = "int ncclCommAbort(void* c) { free(c); return 0; }";
    let gated = "static int gate_open = 0, aborts_done = 0;\n\
        void fake_open_abort_gate(void) { __atomic_store_n(&gate_open, 1, __ATOMIC_SEQ_CST); }\n\
        int fake_aborts_done(void) { return __atomic_load_n(&aborts_done, __ATOMIC_SEQ_CST); }\n\
        int ncclCommAbort(void* c) {\n\
            struct timespec t = { 0, 1000000 };\n\
            while (!__atomic_load_n(&gate_open, __ATOMIC_SEQ_CST)) nanosleep(&t, 0);\n\
            free(c); __atomic_add_fetch(&aborts_done, 1, __ATOMIC_SEQ_CST); return 0;\n\
        }";
    let source = format!("#include <time.h>\n{}", c_source(&syms, 22809, 0).replace(plain, gated));
    assert!(source.contains("fake_open_abort_gate"), "the fake's abort body changed; update this test");
    let path = compile_once("nccl-blocking-abort/libnccl.so.2", &source, &[]);
    let mut rank = world_1_rank(&path);
    // SAFETY: the fake library that `rank` loaded (the loader's handle keeps it mapped); both symbols are defined
    // above with these signatures.
    let (open_gate, aborts_done) = unsafe {
        let lib = libloading::Library::new(&path).expect("reopen the fake");
        let open: unsafe extern "C" fn() = *lib.get(b"fake_open_abort_gate\0").expect("gate symbol");
        let done: unsafe extern "C" fn() -> std::ffi::c_int = *lib.get(b"fake_aborts_done\0").expect("count symbol");
        std::mem::forget(lib); // the loader never unloads it either
        (open, done)
    };

    // The wait runs on a thread of its own, so a wait that blocks in the abort fails this test instead of hanging.
    let limit = std::time::Duration::from_millis(200);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let start = std::time::Instant::now();
        let r = rank.wait_or_abort(limit, &mut || Ok(false), &mut || {});
        let _ = tx.send((rank, r, start.elapsed()));
    });
    let Ok((rank, r, took)) = rx.recv_timeout(std::time::Duration::from_secs(10)) else {
        // SAFETY: a plain call into the fake; it releases the blocked abort.
        unsafe { open_gate() };
        panic!("the wait blocked in the library's abort");
    };
    let e = r.expect_err("times out");
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    let bound = limit + anyccl_ccl::ABORT_GRACE;
    assert!(took >= bound && took < bound + std::time::Duration::from_secs(3), "returned after {took:?}");
    let text = e.to_string();
    assert!(text.contains("abort had not returned after 2s and goes on in the background"), "{text}");
    // Later calls fail at once, although the abort has not finished.
    assert!(rank.is_aborted());
    let later = rank.count().expect_err("aborted");
    assert!(matches!(later, Error::PeerFailure(ref m) if m.contains("aborted")), "{later}");

    // SAFETY: plain calls into the fake; no arguments.
    assert_eq!(unsafe { aborts_done() }, 0, "the abort is still blocked");
    unsafe { open_gate() };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    // SAFETY: as above.
    while unsafe { aborts_done() } == 0 {
        assert!(std::time::Instant::now() < deadline, "the background abort never finished");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // SAFETY: as above.
    assert_eq!(unsafe { aborts_done() }, 1, "aborted exactly once");
    drop(rank); // destroys nothing: the background abort freed the communicator
}

#[test]
fn a_reduction_is_mapped_once_for_its_library_and_refused_by_another() {
    let new = world_1_rank(&build_profile(&NCCL_2_28));
    let old = world_1_rank(&build_profile(&NCCL_2_26));
    // At world 1 avg is asked for as sum; avg on fp8 stays refused as asked.
    let avg = new.check_reduction(DataType::F32, ReduceOp::Avg).expect("avg on f32");
    assert_eq!((avg.dtype(), avg.op()), (DataType::F32, ReduceOp::Sum));
    let e = new.check_reduction(DataType::Fp8E4M3, ReduceOp::Avg).expect_err("no avg on fp8");
    assert!(matches!(e, Error::InvalidArgument(InvalidArgument::UnsupportedReduction { .. })), "{e:?}");
    let sum = new.check_reduction(DataType::F32, ReduceOp::Sum).expect("sum");
    let (d, o) = sum.codes(new.library()).expect("its own library");
    let null = std::ptr::null_mut();
    let comm = new.handle().expect("live");
    // SAFETY: a live communicator of the library; the fake's ncclAllReduce returns success without reading or
    // writing the buffers or the stream.
    unsafe { anyccl_ccl::result::all_reduce(new.library(), null, null, 4, d, o, comm, null) }.expect("its codes");
    // The codes of one library version are not handed to another.
    let e = sum.codes(old.library()).expect_err("another library");
    assert!(
        matches!(&e, Error::InvalidArgument(InvalidArgument::UnsupportedReduction { why, .. }) if why.contains("another library")),
        "{e:?}"
    );
}

#[test]
fn a_background_close_returns_at_once_and_keeps_the_library_loaded_until_the_destroy_returns() {
    let path = build_slow_destroy(&NCCL_2_28);
    let hooks = DestroyHooks::open(&path);
    let rank = world_1_rank(&path);
    let lib = Arc::downgrade(rank.library());
    // What a backend drops after the communicator (its buffers): records how many destroys had finished by then.
    struct Kept(Arc<std::sync::atomic::AtomicI32>, unsafe extern "C" fn() -> std::ffi::c_int);
    impl Drop for Kept {
        fn drop(&mut self) {
            // SAFETY: a plain call into the fake (kept mapped by `DestroyHooks::open`).
            self.0.store(unsafe { (self.1)() }, Ordering::SeqCst);
        }
    }
    let seen = Arc::new(std::sync::atomic::AtomicI32::new(-1));
    let kept = Kept(seen.clone(), hooks.done);
    // SAFETY: plain calls into the fake; no arguments.
    let before = unsafe { (hooks.done)() };
    // SAFETY: as above. The destroy now blocks until the gate opens, as NCCL's takes its ~500 ms.
    unsafe { (hooks.close_gate)() };
    // Closed on a thread of its own, so a close that waits for the destroy fails this test instead of hanging it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let start = std::time::Instant::now();
        let t = rank.close_in_background_with(kept);
        let _ = tx.send((t, start.elapsed()));
    });
    let Ok((t, took)) = rx.recv_timeout(std::time::Duration::from_secs(10)) else {
        // SAFETY: as above; releases the blocked destroy.
        unsafe { (hooks.open_gate)() };
        panic!("close_in_background waited for the library's destroy");
    };
    assert!(took < std::time::Duration::from_secs(1), "returned after {took:?}");
    assert!(!t.is_done(), "the destroy is still blocked at the gate");
    assert_eq!(t.wait_timeout(std::time::Duration::from_millis(50)), None);
    assert!(lib.upgrade().is_some(), "the library stays loaded while its destroy runs");
    // SAFETY: as above.
    assert_eq!(unsafe { (hooks.done)() }, before);
    assert_eq!(seen.load(Ordering::SeqCst), -1, "what the backend keeps is dropped only after the destroy");
    // SAFETY: as above.
    unsafe { (hooks.open_gate)() };
    assert_eq!(t.wait(), Ok(()));
    assert!(t.is_done());
    // SAFETY: as above.
    assert_eq!(unsafe { (hooks.done)() }, before + 1, "destroyed exactly once");
    assert_eq!(seen.load(Ordering::SeqCst), before + 1, "dropped after the destroy had returned");
    assert!(lib.upgrade().is_none(), "the teardown thread let go of the library before it counted as done");
}

#[test]
fn closing_an_aborted_communicator_in_the_background_has_nothing_left_to_do() {
    let mut rank = world_1_rank(&build_profile(&NCCL_2_28));
    let e = rank.wait_or_abort(std::time::Duration::ZERO, &mut || Ok(false), &mut || {}).expect_err("times out");
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(rank.is_aborted());
    let t = rank.close_in_background();
    assert!(t.is_done(), "nothing to destroy after an abort");
    assert_eq!(t.wait(), Ok(()));
}

#[test]
fn a_capture_refusal_from_the_stream_query_aborts_nothing() {
    let mut rank = world_1_rank(&build_profile(&NCCL_2_28));
    let mut stops = 0;
    let refused = anyccl_core::capture::refuse("Communicator::wait");
    let e = rank
        .wait_or_abort(std::time::Duration::from_secs(30), &mut || Err(refused.clone()), &mut || stops += 1)
        .expect_err("refused");
    assert_eq!(e, refused);
    assert_eq!(stops, 0, "the backend's kernels are not told to stop");
    assert!(!rank.is_aborted(), "the communicator stays usable");
    assert_eq!(rank.count().expect("still live"), 1);
}

#[test]
fn a_borrowed_communicator_never_destroys_or_aborts_what_it_borrows() {
    let mut syms: Vec<&str> = REQUIRED_SYMBOLS.to_vec();
    syms.extend_from_slice(BASE);
    let counting = "static int destroys = 0, aborts = 0;\n\
        int fake_destroys(void) { return destroys; }\n\
        int fake_aborts(void) { return aborts; }\n\
        int ncclCommDestroy(void* c) { free(c); destroys++; return 0; }";
    let source = c_source(&syms, 22809, 0).replace(PLAIN_DESTROY, counting).replace(
        "int ncclCommAbort(void* c) { free(c); return 0; }",
        "int ncclCommAbort(void* c) { free(c); aborts++; return 0; }",
    );
    assert!(
        source.contains("aborts++") && source.contains("destroys++"),
        "the fake's bodies changed; update this test"
    );
    let path = compile_once("nccl-counting-destroy/libnccl.so.2", &source, &[]);
    let lib = Arc::new(CclLibrary::open(&path).expect("loads"));
    // SAFETY: the fake built above; its initialisers do nothing.
    let fake = unsafe { libloading::Library::new(&path) }.expect("open the fake");
    // SAFETY: the counters' C signatures.
    let (destroys, aborts) = unsafe {
        let d: unsafe extern "C" fn() -> std::ffi::c_int = *fake.get(b"fake_destroys\0").expect("symbol");
        let a: unsafe extern "C" fn() -> std::ffi::c_int = *fake.get(b"fake_aborts\0").expect("symbol");
        (d, a)
    };
    let id = UniqueId::new(&lib).expect("id");
    let owner = CclComm::init_rank(lib.clone(), 1, &id, 0).expect("communicator");
    // SAFETY: `owner` keeps the communicator live for as long as the borrowed values below are used.
    let borrowed = unsafe { CclComm::from_raw_borrowed(lib.clone(), owner.raw()) }.expect("borrowed");
    assert!(borrowed.is_borrowed() && !owner.is_borrowed());
    assert_eq!((borrowed.rank(), borrowed.world()), (0, 1), "the library's answer");
    assert_eq!(borrowed.count().expect("a query through the borrowed handle"), 1);
    drop(borrowed);
    // SAFETY: as above.
    let borrowed = unsafe { CclComm::from_raw_borrowed(lib.clone(), owner.raw()) }.expect("borrowed");
    borrowed.destroy().expect("forgetting is fine");
    // SAFETY: as above.
    let mut borrowed = unsafe { CclComm::from_raw_borrowed(lib.clone(), owner.raw()) }.expect("borrowed");
    let e = borrowed.abort_in_place().expect_err("a borrowed communicator is not aborted");
    assert!(e.to_string().contains("borrowed"), "{e}");
    assert!(borrowed.is_aborted(), "the handle is forgotten: later calls fail instead of touching it");
    assert!(borrowed.count().is_err());
    drop(borrowed);
    // SAFETY: counter reads.
    assert_eq!(unsafe { (destroys(), aborts()) }, (0, 0), "nothing borrowed was destroyed or aborted");
    assert_eq!(owner.count().expect("the owner's communicator is untouched"), 1);
    owner.destroy().expect("destroy");
    // SAFETY: a counter read.
    assert_eq!(unsafe { destroys() }, 1, "the owner destroys it, once");
}
