//! The `anyccl` command as a user runs it.

#[path = "../../tests/support/fake_ccl.rs"]
mod fake_ccl;
#[cfg(feature = "rocm")]
#[path = "../../tests/support/fake_hip.rs"]
mod fake_hip;

use std::process::{Command, Output};

fn anyccl(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_anyccl"));
    c.args(args);
    for var in [
        "ANYCCL_TUNE_FILE",
        "ANYCCL_ALLREDUCE_ALGO",
        "ANYCCL_DISABLE",
        "ANYCCL_LOG",
        "ANYCCL_NCCL_PATH",
        "ANYCCL_RCCL_PATH",
        "ANYCCL_HIP_PATH",
        "NCCL_CUMEM_ENABLE",
        "NCCL_NVLS_ENABLE",
    ] {
        c.env_remove(var);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("the anyccl binary runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn tmp_file(name: &str, contents: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("anyccl-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let p = dir.join(name);
    std::fs::write(&p, contents).expect("write");
    p
}

#[test]
fn probe_json_is_valid_and_complete() {
    let out = anyccl(&["probe", "--json"], &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    assert_eq!(v["schema"], 1);
    assert_eq!(v["default_backend"], "host");
    let backends = v["backends"].as_array().expect("backends");
    assert_eq!(backends.iter().map(|b| b["name"].as_str().unwrap_or("")).collect::<Vec<_>>(), ["host", "cuda", "rocm"]);
    let caps = v["capabilities"].as_array().expect("capabilities");
    assert_eq!(caps.len(), anyccl::Capabilities::each().count());
    for c in caps {
        let enabled = c["enabled"].as_bool().expect("enabled flag");
        // Every disabled capability carries a reason, as text and as a typed object.
        assert_eq!(c["reason"].is_string(), !enabled, "{c}");
        assert_eq!(c["reason_detail"]["kind"].is_string(), !enabled, "{c}");
    }
    let host = caps.iter().find(|c| c["name"] == "host-backend").expect("host-backend listed");
    assert_eq!(host["enabled"], true);
    assert!(v["gpu"]["detail"].is_string());
    assert!(!v["selector"]["rules"].as_array().expect("rules").is_empty());
}

#[test]
fn probe_text_says_plainly_what_is_missing() {
    let out = anyccl(&["probe"], &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    assert!(s.contains("GPU: "), "{s}");
    assert!(s.contains("host   available"), "{s}");
    assert!(s.contains("[off] symmetric-windows"), "{s}");
}

#[test]
fn probe_shows_env_overrides() {
    let out = anyccl(&["probe", "--json"], &[("ANYCCL_DISABLE", "host-backend"), ("ANYCCL_ALLREDUCE_ALGO", "ring")]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let host = v["capabilities"].as_array().and_then(|a| a.iter().find(|c| c["name"] == "host-backend").cloned());
    let host = host.expect("listed");
    assert_eq!(host["enabled"], false);
    assert_eq!(host["reason_detail"]["kind"], "env-var");
    assert_eq!(v["selector"]["forced"], "ring");
}

#[test]
fn bench_host_prints_the_table() {
    let out = anyccl(
        &["bench", "--backend", "host", "--world", "3", "--sizes", "4KiB,64KiB", "--iters", "3", "--warmup", "1"],
        &[],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    for needle in ["world 3", "one-shot", "two-shot", "ring", "auto", "4 KiB", "64 KiB", "best"] {
        assert!(s.contains(needle), "missing {needle:?} in\n{s}");
    }
    // Two data rows, one per size.
    assert_eq!(
        s.lines().filter(|l| l.trim_start().starts_with("4 KiB") || l.trim_start().starts_with("64 KiB")).count(),
        2,
        "{s}"
    );
}

#[test]
fn bench_json_and_csv() {
    let out = anyccl(
        &["bench", "--world", "2", "--dtype", "f32", "--sizes", "8KiB", "--iters", "2", "--warmup", "0", "--json"],
        &[],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["rows"][0]["bytes"], 8192);
    assert_eq!(v["rows"][0]["count"], 2048);
    assert!(v["rows"][0]["auto"]["median_us"].as_f64().is_some_and(|x| x > 0.0));
    let out = anyccl(
        &["bench", "--world", "2", "--sizes", "8KiB", "--iters", "2", "--warmup", "0", "--csv", "--algos", "ring"],
        &[],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    assert!(s.starts_with("backend,world,dtype"), "{s}");
    assert_eq!(s.lines().count(), 3, "header + ring + auto:\n{s}");
}

fn assert_one_line_error(out: &Output, needle: &str) {
    assert!(!out.status.success());
    let err = text(&out.stderr);
    let lines: Vec<_> = err.lines().collect();
    assert!(lines[0].starts_with("error: ") && lines[0].contains(needle), "{err}");
    assert!(lines.len() <= 2, "one error line and at most one hint:\n{err}");
    assert!(lines.get(1).is_none_or(|l| l.starts_with("hint: ")), "{err}");
    assert!(!err.contains("panicked") && !err.contains("backtrace"), "{err}");
}

#[test]
fn bad_flags_give_one_line_and_nonzero_exit() {
    assert_one_line_error(&anyccl(&["bench", "--frobnicate"], &[]), "--frobnicate");
    assert_one_line_error(&anyccl(&["bench", "--dtype", "f128"], &[]), "f128");
    assert_one_line_error(&anyccl(&["bench", "--sizes", "12parsecs"], &[]), "12parsecs");
    assert_one_line_error(&anyccl(&["bench", "--world", "0"], &[]), "0");
    assert_one_line_error(&anyccl(&["bench", "--algos", "warp-drive"], &[]), "warp-drive");
    assert_one_line_error(&anyccl(&["bench", "--sizes", "3", "--dtype", "f32"], &[]), "--sizes: 3 B");
    assert_one_line_error(&anyccl(&["bench", "--backend", "cuda"], &[]), "cuda");
    assert_eq!(anyccl(&["bench", "--frobnicate"], &[]).status.code(), Some(2));
}

#[test]
fn bad_table_file_names_the_line() {
    let p = tmp_file("bad.toml", "version = 1\n\n[[rule]]\nworld = 2\nalgorithms = [\"one-shot\", \"teleport\"]\n");
    let ps = p.to_string_lossy().into_owned();
    let out = anyccl(&["bench", "--table", &ps, "--sizes", "4KiB", "--iters", "1"], &[]);
    assert_one_line_error(&out, &format!("{ps}:5"));
    assert!(text(&out.stderr).contains("teleport"));
    let out = anyccl(&["probe"], &[("ANYCCL_TUNE_FILE", &ps)]);
    assert_one_line_error(&out, &format!("{ps}:5"));
    let out = anyccl(&["probe"], &[("ANYCCL_TUNE_FILE", "/nonexistent/anyccl.toml")]);
    assert_one_line_error(&out, "cannot read the table file");
}

#[test]
fn table_file_and_forced_algorithm_drive_the_choice() {
    let p = tmp_file("ring.toml", "[[rule]]\nvendor = \"host\"\nalgorithms = [\"ring\"]\n");
    let ps = p.to_string_lossy().into_owned();
    let out = anyccl(
        &["bench", "--world", "2", "--sizes", "4KiB", "--iters", "1", "--warmup", "0", "--json"],
        &[("ANYCCL_TUNE_FILE", &ps)],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["rows"][0]["auto"]["algorithm"], "ring");
    assert!(
        v["rows"][0]["auto_rule"].as_str().is_some_and(|r| r.contains("ring.toml:3")),
        "{}",
        v["rows"][0]["auto_rule"]
    );
    let out = anyccl(&["probe"], &[("ANYCCL_TUNE_FILE", &ps)]);
    assert!(text(&out.stdout).contains("ring.toml (via ANYCCL_TUNE_FILE)"));

    let out = anyccl(
        &["bench", "--world", "2", "--sizes", "4KiB", "--iters", "1", "--json"],
        &[("ANYCCL_ALLREDUCE_ALGO", "two-shot")],
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["rows"][0]["auto"]["algorithm"], "two-shot");
    let out = anyccl(&["bench", "--sizes", "4KiB", "--iters", "1"], &[("ANYCCL_ALLREDUCE_ALGO", "nvls-zero-copy")]);
    assert_one_line_error(&out, "nvls-zero-copy");
    let out = anyccl(&["bench", "--sizes", "4KiB", "--iters", "1"], &[("ANYCCL_ALLREDUCE_ALGO", "fastest-please")]);
    assert_one_line_error(&out, "ANYCCL_ALLREDUCE_ALGO");
}

#[test]
fn debug_log_names_the_algorithm_and_rule() {
    let out = anyccl(
        &["bench", "--world", "2", "--sizes", "4KiB", "--iters", "1", "--warmup", "0"],
        &[("ANYCCL_LOG", "debug")],
    );
    assert!(out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("algorithm=one-shot") && err.contains("rule=defaults #2"), "{err}");
}

fn capability<'a>(v: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    v["capabilities"].as_array().and_then(|a| a.iter().find(|c| c["name"] == name)).expect("capability listed")
}

#[test]
fn probe_reports_a_fake_rccl_7_0_with_reasons() {
    let lib = fake_ccl::build_profile(&fake_ccl::RCCL_7_0);
    let ls = lib.to_string_lossy().into_owned();
    let out = anyccl(&["probe", "--json"], &[("ANYCCL_RCCL_PATH", &ls), ("NCCL_NVLS_ENABLE", "0")]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let rccl = v["libraries"].as_array().and_then(|a| a.iter().find(|l| l["name"] == "RCCL")).expect("RCCL row");
    assert_eq!(rccl["found"], true);
    assert_eq!(rccl["version"], "RCCL 2.26.6");
    assert_eq!(capability(&v, "ccl")["enabled"], true);
    assert_eq!(capability(&v, "comm-split")["enabled"], true);
    let win = capability(&v, "symmetric-windows");
    assert_eq!(win["enabled"], false);
    let canonical = lib.canonicalize().expect("exists").display().to_string();
    assert_eq!(win["reason"], format!("{canonical} (RCCL 2.26.6) does not export ncclCommWindowRegister"));
    assert_eq!(win["reason_detail"]["kind"], "missing-symbol");
    assert_eq!(capability(&v, "multicast")["reason"], "turned off by NCCL_NVLS_ENABLE=0");
    let text_out = text(&anyccl(&["probe"], &[("ANYCCL_RCCL_PATH", &ls)]).stdout);
    assert!(text_out.contains("RCCL 2.26.6 at "), "{text_out}");
    assert!(text_out.contains("does not export ncclCommWindowRegister"), "{text_out}");
}

/// The ROCm build on a machine whose HIP runtime and RCCL are the fakes (8 gfx90a devices, RCCL of ROCm 7.0):
/// the backend is available, and symmetric memory is off because RCCL 2.26.6 lacks `ncclCommWindowRegister`.
#[cfg(feature = "rocm")]
#[test]
fn probe_with_the_rocm_backend_on_a_fake_rocm_7_0() {
    let hip = fake_hip::build_hip().to_string_lossy().into_owned();
    let rccl = fake_hip::build_rccl(&fake_ccl::RCCL_7_0).to_string_lossy().into_owned();
    let env = [("ANYCCL_HIP_PATH", hip.as_str()), ("ANYCCL_RCCL_PATH", rccl.as_str()), ("NCCL_CUMEM_ENABLE", "1")];
    let out = anyccl(&["probe", "--json"], &env);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let rocm = v["backends"].as_array().and_then(|a| a.iter().find(|b| b["name"] == "rocm")).expect("rocm row");
    assert_eq!(rocm["available"], true, "{rocm}");
    assert!(rocm["detail"].as_str().unwrap_or("").contains("8 device(s): gfx90a"), "{rocm}");
    let hip_row = v["libraries"].as_array().and_then(|a| a.iter().find(|l| l["name"] == "HIP runtime")).expect("HIP");
    assert_eq!(hip_row["found"], true);
    assert_eq!(hip_row["version"], "HIP 7.0.51831");
    assert_eq!(capability(&v, "hip-runtime")["enabled"], true);
    let win = capability(&v, "symmetric-windows");
    assert_eq!(win["enabled"], false);
    assert!(
        win["reason"].as_str().unwrap_or("").ends_with("(RCCL 2.26.6) does not export ncclCommWindowRegister"),
        "{win}"
    );
    let text_out = text(&anyccl(&["probe"], &env).stdout);
    assert!(text_out.contains("does not export ncclCommWindowRegister"), "{text_out}");
    // Without the fake runtime the backend says why it is off, and nothing crashes.
    let out = anyccl(&["probe", "--json"], &[("ANYCCL_HIP_PATH", "/nonexistent/libamdhip64.so")]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn probe_reports_a_fake_nccl_2_28_and_a_broken_path() {
    let lib = fake_ccl::build_profile(&fake_ccl::NCCL_2_28);
    let out = anyccl(&["probe", "--json"], &[("ANYCCL_NCCL_PATH", &lib.to_string_lossy())]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["libraries"][0]["version"], "NCCL 2.28.9");
    for cap in ["ccl", "symmetric-windows", "device-api", "fp8", "bf16"] {
        assert_eq!(capability(&v, cap)["enabled"], true, "{cap}");
    }
    let bad = tmp_file("libnccl.so.2", "not a library");
    let out = anyccl(&["probe", "--json"], &[("ANYCCL_NCCL_PATH", &bad.to_string_lossy())]);
    assert!(out.status.success(), "a broken library is reported, not fatal");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let nccl = &v["libraries"][0];
    assert_eq!(nccl["found"], false);
    assert_eq!(nccl["tried"][0]["candidate"], bad.display().to_string());
    assert_eq!(nccl["tried"][0]["failure"]["kind"], "not-a-library");
    assert_eq!(capability(&v, "ccl")["enabled"], false);
}

#[test]
fn tune_writes_a_table_that_bench_then_uses() {
    let out = std::env::temp_dir().join(format!("anyccl-tune-{}.toml", std::process::id()));
    let os = out.to_string_lossy().into_owned();
    let r =
        anyccl(&["tune", "--world", "2", "--sizes", "4KiB,256KiB", "--iters", "3", "--warmup", "1", "--out", &os], &[]);
    assert!(r.status.success(), "{}", text(&r.stderr));
    let s = text(&r.stdout);
    assert!(s.contains("check: auto with the tuned table") && s.contains("sizes within 5%"), "{s}");
    let table = anyccl::core::SelectorTable::load(&out).expect("the written table parses");
    assert!(!table.rules.is_empty());
    assert!(table.rules.iter().all(|r| r.vendors == vec![anyccl::core::Vendor::Host] && r.world_min == 2));
    let b = anyccl(
        &["bench", "--world", "2", "--sizes", "4KiB", "--iters", "1", "--warmup", "0", "--json", "--table", &os],
        &[],
    );
    let v: serde_json::Value = serde_json::from_slice(&b.stdout).expect("JSON");
    assert!(v["rows"][0]["auto_rule"].as_str().is_some_and(|r| r.starts_with(&os)), "{}", v["rows"][0]["auto_rule"]);
    std::fs::remove_file(&out).ok();
}

#[test]
fn bench_plots_an_svg_and_refuses_other_formats() {
    let out = std::env::temp_dir().join(format!("anyccl-plot-{}.svg", std::process::id()));
    let os = out.to_string_lossy().into_owned();
    let r = anyccl(
        &["bench", "--world", "2", "--sizes", "4KiB,64KiB,1MiB", "--iters", "2", "--warmup", "0", "--plot", &os],
        &[],
    );
    assert!(r.status.success(), "{}", text(&r.stderr));
    let svg = std::fs::read_to_string(&out).expect("the plot was written");
    assert!(svg.starts_with("<svg"), "not an SVG");
    for label in ["one-shot", "two-shot", "ring", "auto", "median latency (us)", "bus bandwidth (GB/s)"] {
        assert!(svg.contains(label), "the plot lacks {label:?}");
    }
    std::fs::remove_file(&out).ok();
    assert_one_line_error(
        &anyccl(&["bench", "--sizes", "4KiB", "--iters", "1", "--plot", "chart.png"], &[]),
        "PNG is not supported",
    );
}
