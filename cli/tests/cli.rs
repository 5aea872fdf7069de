//! The `anyccl` command as a user runs it.

use anyccl_testkit::fake_ccl;
#[cfg(feature = "cuda")]
use anyccl_testkit::fake_cuda;
#[cfg(feature = "rocm")]
use anyccl_testkit::fake_hip;
use anyccl_testkit::launcher;

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn anyccl(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_anyccl"));
    c.args(args);
    for var in [
        "ANYCCL_TUNE_FILE",
        "ANYCCL_ALLREDUCE_ALGO",
        "ANYCCL_FUSED_RMSNORM",
        "ANYCCL_DISABLE",
        "ANYCCL_LOG",
        "ANYCCL_NCCL_PATH",
        "ANYCCL_RCCL_PATH",
        "ANYCCL_HIP_PATH",
        "ANYCCL_DROPIN_PATH",
        "NCCL_CUMEM_ENABLE",
        "NCCL_NVLS_ENABLE",
        "NCCL_ALGO",
        "NCCL_PROTO",
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
    // The capability report's own table, indented under its heading.
    assert!(s.contains("\nCapabilities:\n  [on ] host-backend\n  [off] cuda-runtime         "), "{s}");
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
    assert_eq!(v["schema"], 2);
    assert_eq!((v["launch"].as_str(), v["wrong"].as_u64()), (Some("threads"), Some(0)));
    assert!(v["library"].is_null(), "no vendor library on the host");
    let ranks = v["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 2);
    assert!(ranks.iter().enumerate().all(|(r, k)| k["rank"] == r && k["pid"].as_u64().is_some()), "{ranks:?}");
    let row = &v["rows"][0];
    assert_eq!(row["bytes"], 8192);
    assert_eq!(row["count"], 2048);
    assert_eq!(row["wrong"], 0);
    assert!(row["auto"]["median_us"].as_f64().is_some_and(|x| x > 0.0));
    // Out of place at the row's top level (as in schema 1), in place beside it; every cell checked.
    for place in [row, &row["in_place"]] {
        let cells = place["cells"].as_array().expect("cells");
        assert_eq!(cells.len(), 3);
        assert!(cells.iter().chain([&place["auto"]]).all(|c| c["wrong"] == 0), "{place}");
        assert!(place["auto"]["rank_spread"]["max_us"].as_f64().is_some(), "{place}");
    }
    let out = anyccl(
        &["bench", "--world", "2", "--sizes", "8KiB", "--iters", "2", "--warmup", "0", "--csv", "--algos", "ring"],
        &[],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    assert!(
        s.starts_with("backend,world,dtype")
            && s.lines().next().is_some_and(|h| h.ends_with(",wrong,rank_min_us,rank_avg_us,rank_max_us,schema")),
        "{s}"
    );
    assert_eq!(s.lines().count(), 5, "header + (ring + auto) out of place and in place:\n{s}");
    assert!(s.lines().skip(1).all(|l| l.ends_with(",2") && l.contains(",0,")), "{s}");
    let in_place = s.lines().skip(1).filter(|l| l.split(',').nth(13) == Some("true")).count();
    assert_eq!(in_place, 2, "two in-place lines:\n{s}");
}

/// nccl-tests' `-b MIN -e MAX -f FACTOR` as a sweep, and its mistakes refused with the flag named.
#[test]
fn bench_sweeps_like_nccl_tests() {
    let sizes = |args: &[&str]| -> Vec<u64> {
        let mut all = vec!["bench", "--world", "2", "--iters", "1", "--warmup", "0", "--algos", "ring", "--json"];
        all.extend_from_slice(args);
        let out = anyccl(&all, &[]);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        v["rows"].as_array().expect("rows").iter().map(|r| r["bytes"].as_u64().expect("bytes")).collect()
    };
    assert_eq!(sizes(&["-b", "4KiB", "-e", "64KiB", "-f", "4"]), [4096, 16384, 65536]);
    assert_eq!(sizes(&["--minbytes", "8K", "--maxbytes", "40K"]), [8192, 16384, 32768], "factor 2 by default");
    assert_eq!(sizes(&["-b", "1M", "-e", "1M"]), [1 << 20]);
    assert_one_line_error(&anyccl(&["bench", "-b", "8K"], &[]), "--maxbytes");
    assert_one_line_error(&anyccl(&["bench", "-f", "2"], &[]), "--minbytes");
    assert_one_line_error(&anyccl(&["bench", "--sizes", "4K", "-b", "4K", "-e", "8K"], &[]), "--sizes");
    assert_one_line_error(&anyccl(&["bench", "-b", "4K", "-e", "8K", "-f", "1"], &[]), "--stepfactor");
    assert_one_line_error(&anyccl(&["bench", "-b", "16K", "-e", "8K"], &[]), "-b/--minbytes (16 KiB) is above");
    assert_one_line_error(&anyccl(&["bench", "-b", "6", "-e", "6", "--dtype", "f32"], &[]), "-b/-e/-f: 6 B");
    assert_one_line_error(
        &anyccl(&["bench", "--world", "2", "-b", "2", "-e", "16G"], &[]),
        "-b/-e/-f: 2 GiB is above this backend's largest message",
    );
    assert_eq!(anyccl(&["bench", "-b", "8K"], &[]).status.code(), Some(2));
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

/// A variable anyccl reads that is not UTF-8 is an error naming it, in `probe` too (it used to ignore a
/// non-UTF-8 `ANYCCL_DISABLE` in silence), and an out-of-range size from the environment is one as well.
#[cfg(unix)]
#[test]
fn probe_names_a_variable_that_is_not_utf8() {
    use std::os::unix::ffi::OsStrExt;
    for var in ["ANYCCL_DISABLE", "ANYCCL_CUSTOM_MAX_BYTES", "ANYCCL_FUSED_RMSNORM"] {
        let out = Command::new(env!("CARGO_BIN_EXE_anyccl"))
            .arg("probe")
            .env_remove("ANYCCL_TUNE_FILE")
            .env(var, std::ffi::OsStr::from_bytes(b"ccl\xfe"))
            .output()
            .expect("run anyccl");
        assert_one_line_error(&out, var);
        assert!(text(&out.stderr).contains("not valid UTF-8"), "{var}: {}", text(&out.stderr));
    }
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

/// `windows-in-capture` follows the loaded release: off before 2.30.7 with the version as the reason (on RCCL
/// naming 2.30.4's failure inside capture), on from 2.30.7, for NCCL and RCCL alike; the text table says the same.
#[test]
fn probe_keys_windows_in_capture_on_the_release() {
    let releases = [
        (&fake_ccl::NCCL_2_30_3, "ANYCCL_NCCL_PATH", "NCCL 2.30.3", false),
        (&fake_ccl::NCCL_2_30_7, "ANYCCL_NCCL_PATH", "NCCL 2.30.7", true),
        (&fake_ccl::RCCL_2_30_4, "ANYCCL_RCCL_PATH", "RCCL 2.30.4", false),
        (&fake_ccl::RCCL_2_30_7, "ANYCCL_RCCL_PATH", "RCCL 2.30.7", true),
    ];
    for (p, var, label, in_capture) in releases {
        let lib = fake_ccl::build_profile(p).to_string_lossy().into_owned();
        let env = [(var, lib.as_str()), ("NCCL_CUMEM_ENABLE", "1")];
        let out = anyccl(&["probe", "--json"], &env);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        let row = v["libraries"].as_array().and_then(|a| a.iter().find(|l| l["version"] == label));
        assert!(row.is_some_and(|r| r["found"] == true), "{label}: {}", v["libraries"]);
        assert_eq!(capability(&v, "symmetric-windows")["enabled"], true, "{label}");
        let cap = capability(&v, "windows-in-capture");
        let table = text(&anyccl(&["probe"], &env).stdout);
        if in_capture {
            assert_eq!(cap["enabled"], true, "{label}: {cap}");
            assert!(table.contains("\n  [on ] windows-in-capture\n"), "{label}: {table}");
            continue;
        }
        assert_eq!(cap["enabled"], false, "{label}: {cap}");
        assert_eq!(cap["reason_detail"]["kind"], "version-too-old", "{label}");
        let reason = cap["reason"].as_str().unwrap_or_default();
        let (vendor, version) = label.split_once(' ').expect("vendor and version");
        assert!(reason.starts_with(&format!("{vendor} at ")), "{reason}");
        assert!(reason.ends_with(&format!(" is version {version}; 2.30.7 or newer is required")), "{reason}");
        assert_eq!(
            reason.contains("(RCCL 2.30.4 fails to register windows inside graph capture)"),
            vendor == "RCCL",
            "{reason}"
        );
        assert!(table.contains(&format!("  [off] windows-in-capture   {reason}\n")), "{label}: {table}");
    }
}

/// RCCL 2.27.7 (production ROCm 7.2.x) registers windows but runs no symmetric kernels, and no RCCL has the per-call
/// config; NCCL 2.32 has both, and there an `NCCL_ALGO` that names only the all-reduce is a warning naming the
/// collectives it leaves without an algorithm.
#[test]
fn probe_reports_symmetric_kernels_the_per_call_config_and_nccl_algo_by_release() {
    let rccl = fake_ccl::build_profile(&fake_ccl::RCCL_7_2).to_string_lossy().into_owned();
    let env = [("ANYCCL_RCCL_PATH", rccl.as_str()), ("NCCL_CUMEM_ENABLE", "1")];
    let out = anyccl(&["probe", "--json"], &env);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(capability(&v, "symmetric-windows")["enabled"], true);
    let kernels = capability(&v, "symmetric-kernels");
    assert_eq!(kernels["enabled"], false, "{kernels}");
    let reason = kernels["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("production ROCm 7.2.x ships RCCL 2.27.7"), "{reason}");
    assert!(reason.ends_with(" is version 2.27.7; 2.30 or newer is required"), "{reason}");
    let per_call = capability(&v, "per-call-config");
    assert_eq!(per_call["enabled"], false, "{per_call}");
    assert!(per_call["reason"].as_str().unwrap_or_default().ends_with("does not export ncclAllReduceConfig"));

    let nccl = fake_ccl::build_profile(&fake_ccl::NCCL_2_32).to_string_lossy().into_owned();
    let env = [("ANYCCL_NCCL_PATH", nccl.as_str()), ("NCCL_ALGO", "allreduce:tree"), ("NCCL_PROTO", "Simple")];
    let out = anyccl(&["probe", "--json"], &env);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(capability(&v, "per-call-config")["enabled"], true);
    assert_eq!(capability(&v, "symmetric-kernels")["enabled"], true);
    let warnings = v["warnings"].to_string();
    assert!(
        warnings
            .contains("NCCL_ALGO=allreduce:tree names no algorithm for broadcast, reduce, allgather, reducescatter"),
        "{warnings}"
    );
    let table = text(&anyccl(&["probe"], &env).stdout);
    assert!(table.contains("\nwarning: NCCL_ALGO=allreduce:tree names no algorithm"), "{table}");
    // The same setting over NCCL 2.30.7, which kept the collectives NCCL_ALGO does not name: nothing to say.
    let old = fake_ccl::build_profile(&fake_ccl::NCCL_2_30_7).to_string_lossy().into_owned();
    let env = [("ANYCCL_NCCL_PATH", old.as_str()), ("NCCL_ALGO", "allreduce:tree"), ("NCCL_PROTO", "Simple")];
    let out = anyccl(&["probe", "--json"], &env);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert!(!v["warnings"].to_string().contains("NCCL_ALGO"), "{}", v["warnings"]);
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

/// `bench --backend rocm` and `tune --backend rocm` on the fake HIP runtime (8 gfx90a devices) with the computing
/// fake RCCL: one process, a thread per GPU, through the type-erased communicator. With RCCL 2.27.7 (ROCm 7.1) and
/// `NCCL_CUMEM_ENABLE=1` the bench measures ccl, ccl-symmetric (windows) and, where the HIP kernels are built, the
/// custom one-shot and two-shot (launched by the ROCm communicator, run by the fake's emulation), and every result
/// is right, timed with HIP events; with RCCL 2.26.6 (ROCm 7.0) ccl-symmetric is not eligible because the library
/// lacks the window symbol. Tune writes an `amd`/`gfx90a` table and its check passes.
#[cfg(feature = "rocm")]
#[test]
fn bench_and_tune_run_on_the_rocm_backend_over_the_fakes() {
    let hip = fake_hip::build_hip().to_string_lossy().into_owned();
    let rccl = fake_hip::build_rccl(&fake_ccl::RCCL_7_1).to_string_lossy().into_owned();
    let env = [("ANYCCL_HIP_PATH", hip.as_str()), ("ANYCCL_RCCL_PATH", rccl.as_str()), ("NCCL_CUMEM_ENABLE", "1")];
    let sweep = ["--backend", "rocm", "--world", "2", "--sizes", "4KiB,64KiB", "--iters", "2", "--warmup", "1"];
    // The table: the header names the fake RCCL and every #wrong is 0.
    let out = anyccl(&[&["bench"][..], &sweep].concat(), &env);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert!(table.contains("backend rocm, world 2"), "{table}");
    assert!(table.contains(&format!("library: RCCL 2.27.7 ({rccl})")), "{table}");
    assert!(table.contains("device GPU 1 (gfx90a)"), "{table}");
    let rows: Vec<&str> = table
        .lines()
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.get(3) == Some(&"out") || f.first() == Some(&"in")
        })
        .collect();
    assert_eq!(rows.len(), 4, "two sizes, out and in place: {table}");
    for row in &rows {
        let fields: Vec<&str> = row.split_whitespace().collect();
        let best = fields
            .iter()
            .rposition(|f| ["ccl", "ccl-symmetric", "one-shot", "two-shot"].contains(f))
            .expect("a best column");
        assert_eq!(fields[best - 1], "0", "#wrong: {row}");
    }
    // The JSON: the same sweep in detail, eager this time.
    let out = anyccl(&[&["bench"][..], &sweep, &["--eager", "--json"]].concat(), &env);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!((v["backend"].as_str(), v["schema"].as_u64(), v["wrong"].as_u64()), (Some("rocm"), Some(2), Some(0)));
    // Each eager call between two HIP events (the fake's hipEventElapsedTime reports 1 µs), as on CUDA.
    let method = v["method"].as_str().unwrap_or("");
    assert!(method.contains("each eager call timed with device events"), "{method}");
    let ineligible = v["ineligible"].as_array().expect("ineligible");
    if anyccl::rocm::kernels::NOT_BUILT.is_none() {
        assert_eq!(v["algorithms"], serde_json::json!(["ccl", "ccl-symmetric", "one-shot", "two-shot"]));
        assert!(ineligible.is_empty(), "{ineligible:?}");
    } else {
        assert_eq!(v["algorithms"], serde_json::json!(["ccl", "ccl-symmetric"]));
        for (i, name) in ineligible.iter().zip(["one-shot", "two-shot"]) {
            assert_eq!(i["algorithm"], name);
            assert!(i["reason"].as_str().unwrap_or("").contains("HIP kernels not compiled in"), "{i}");
        }
    }
    for row in v["rows"].as_array().expect("rows") {
        for place in [row, &row["in_place"]] {
            for c in place["cells"].as_array().expect("cells").iter().chain([&place["auto"]]) {
                assert_eq!(c["wrong"], 0, "{c}");
                assert!(c["median_us"].as_f64().is_some_and(|m| m > 0.0), "{c}");
            }
        }
    }
    // RCCL of ROCm 7.0 has no windows: ccl-symmetric is listed with the reason.
    let rccl70 = fake_hip::build_rccl(&fake_ccl::RCCL_7_0).to_string_lossy().into_owned();
    let env70 = [("ANYCCL_HIP_PATH", hip.as_str()), ("ANYCCL_RCCL_PATH", rccl70.as_str()), ("NCCL_CUMEM_ENABLE", "1")];
    let out = anyccl(&[&["bench"][..], &sweep, &["--json"]].concat(), &env70);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let custom = if anyccl::rocm::kernels::NOT_BUILT.is_none() { &["one-shot", "two-shot"][..] } else { &[] };
    let want: Vec<&str> = ["ccl"].iter().chain(custom).copied().collect();
    assert_eq!((v["algorithms"].clone(), v["wrong"].as_u64()), (serde_json::json!(want), Some(0)));
    // Graph replays between HIP events too.
    let method = v["method"].as_str().unwrap_or("");
    assert!(method.contains("each replay timed with device events"), "{method}");
    let sym = v["ineligible"].as_array().and_then(|a| a.iter().find(|i| i["algorithm"] == "ccl-symmetric"));
    assert!(sym.is_some_and(|s| s["reason"].as_str().unwrap_or("").contains("ncclCommWindowRegister")), "{v}");
    // Tune: one algorithm, so the check cannot depend on timing noise.
    let table_path = std::env::temp_dir().join(format!("anyccl-tune-rocm-{}.toml", std::process::id()));
    let tp = table_path.to_string_lossy().into_owned();
    let out = anyccl(&[&["tune"][..], &sweep, &["--algos", "ccl", "--out", &tp]].concat(), &env);
    assert!(out.status.success(), "{}\n{}", text(&out.stdout), text(&out.stderr));
    let s = text(&out.stdout);
    assert!(s.contains("measured on the rocm backend, world 2") && s.contains("check: 2 of 2 sizes within 5%"), "{s}");
    let t = anyccl::core::SelectorTable::load(&table_path).expect("the written table parses");
    assert!(!t.rules.is_empty());
    for r in &t.rules {
        assert_eq!(
            (r.vendors.clone(), r.arch.as_deref(), r.world_min),
            (vec![anyccl::core::Vendor::Amd], Some("gfx90a"), 2)
        );
    }
    std::fs::remove_file(&table_path).ok();
    // Not there: the reason, not a crash.
    let out = anyccl(
        &["bench", "--backend", "rocm", "--sizes", "4KiB"],
        &[("ANYCCL_HIP_PATH", "/nonexistent/libamdhip64.so")],
    );
    assert_one_line_error(&out, "the rocm backend is unavailable");
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

/// `tune --out` and `bench --plot` into a directory where another user planted links: a link at the target is
/// replaced by the new file (never written through), and a link at the name the temporary file used to have is
/// left alone.
#[cfg(unix)]
#[test]
fn tune_and_plot_replace_a_planted_link_instead_of_following_it() {
    let dir = std::env::temp_dir().join(format!("anyccl-planted-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let victim = dir.join("victim");
    std::fs::write(&victim, "precious").expect("write");
    for name in ["t.toml", "p.svg"] {
        std::os::unix::fs::symlink(&victim, dir.join(name)).expect("link at the target");
    }
    let out = dir.join("t.toml").to_string_lossy().into_owned();
    let plot = dir.join("p.svg").to_string_lossy().into_owned();
    let args = ["--world", "2", "--sizes", "4KiB", "--iters", "1", "--warmup", "0"];
    let r = anyccl(&[&["tune"][..], &args, &["--algos", "ring", "--out", &out]].concat(), &[]);
    assert!(r.status.success(), "{}", text(&r.stderr));
    let r = anyccl(&[&["bench"][..], &args, &["--plot", &plot]].concat(), &[]);
    assert!(r.status.success(), "{}", text(&r.stderr));
    assert_eq!(std::fs::read_to_string(&victim).expect("read"), "precious", "no link was written through");
    for name in ["t.toml", "p.svg"] {
        let meta = std::fs::symlink_metadata(dir.join(name)).expect("lstat");
        assert!(meta.is_file(), "{name} is now a regular file");
    }
    anyccl::core::SelectorTable::load(&dir.join("t.toml")).expect("the table was written whole");
    assert!(std::fs::read_to_string(dir.join("p.svg")).expect("read").contains("<svg"));
    // nothing but the victim and the two outputs is left in the directory
    assert_eq!(std::fs::read_dir(&dir).expect("list").count(), 3);
    std::fs::remove_dir_all(&dir).ok();
}

/// Another user's link in a shared sticky directory (mode 1777, like `/tmp`): run as uid 65533, `tune --out` at a
/// symbolic link that uid 65534 owns fails at once, before the sweep (which would take far longer than the bound),
/// with one error line naming the path and the owner, since `rename` could not replace the link there; the link
/// and its target are untouched and nothing is left in the directory. Starting a process of another user needs
/// root, as CI has: without it this test fails, it is not skipped.
#[cfg(target_os = "linux")]
#[test]
fn another_users_link_in_a_sticky_directory_is_refused_at_once() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    assert!(
        root,
        "this test needs root (to start a process of another user through setpriv); CI runs the tests as root"
    );
    let shared = tempfile::Builder::new().prefix("anyccl-sticky").tempdir().expect("tempdir");
    std::fs::set_permissions(shared.path(), std::fs::Permissions::from_mode(0o1777)).expect("chmod 1777");
    let victim = shared.path().join("victim");
    std::fs::write(&victim, "precious").expect("write");
    let link = shared.path().join("t.toml");
    std::os::unix::fs::symlink(&victim, &link).expect("symlink");
    std::os::unix::fs::lchown(&link, Some(65534), Some(65534)).expect("lchown the link to uid 65534");
    // this build's binary, copied where uid 65533 may run it
    let bin_dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(bin_dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let bin = bin_dir.path().join("anyccl");
    std::fs::copy(env!("CARGO_BIN_EXE_anyccl"), &bin).expect("copy the binary");
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let out_path = link.to_string_lossy().into_owned();
    let logs = tempfile::tempdir().expect("tempdir");
    let (stdout_path, stderr_path) = (logs.path().join("stdout"), logs.path().join("stderr"));
    let started = Instant::now();
    let mut child = Command::new("setpriv")
        .args(["--reuid", "65533", "--regid", "65533", "--clear-groups", "--"])
        .arg(&bin)
        .args(["tune", "--world", "2", "--sizes", "64MiB", "--iters", "2000", "--warmup", "0", "--algos", "ring"])
        .args(["--out", &out_path])
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&stdout_path).expect("stdout file"))
        .stderr(std::fs::File::create(&stderr_path).expect("stderr file"))
        .spawn()
        .expect("setpriv runs");
    // the sweep would run for minutes: a run still going after this bound did not refuse at once
    let status = match wait_timeout::ChildExt::wait_timeout(&mut child, Duration::from_secs(30)).expect("wait") {
        Some(status) => status,
        None => {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "tune --out at another user's link was still running after 30 s: it did not refuse before the sweep"
            );
        }
    };
    let r = Output {
        status,
        stdout: std::fs::read(&stdout_path).expect("stdout"),
        stderr: std::fs::read(&stderr_path).expect("stderr"),
    };
    let took = started.elapsed();
    let err = text(&r.stderr);
    assert_eq!(r.status.code(), Some(1), "stdout: {}\nstderr: {err}", text(&r.stdout));
    let first = err.lines().next().unwrap_or("");
    assert!(first.starts_with("error: ") && first.contains(&out_path), "{err}");
    assert!(first.contains("belongs to another user (uid 65534)") && first.contains("sticky"), "{err}");
    assert!(err.lines().count() <= 2, "one error line and at most a hint: {err}");
    assert!(text(&r.stdout).is_empty(), "nothing was measured: {}", text(&r.stdout));
    // the sweep of 2 × 2000 all-reduces of 64 MiB would take far longer; generous for a loaded machine
    assert!(took < Duration::from_secs(10), "took {took:?}");
    let meta = std::fs::symlink_metadata(&link).expect("lstat");
    assert!(meta.file_type().is_symlink() && meta.uid() == 65534, "the link is still uid 65534's link");
    assert_eq!(std::fs::read_link(&link).expect("readlink"), victim);
    assert_eq!(std::fs::read_to_string(&victim).expect("read"), "precious", "the link's target is untouched");
    let left: Vec<_> =
        std::fs::read_dir(shared.path()).expect("list").filter_map(|e| e.ok()).map(|e| e.file_name()).collect();
    assert_eq!(left.len(), 2, "only the victim and the link are left: {left:?}");
}

#[test]
fn tune_writes_a_table_that_bench_then_uses() {
    let out = std::env::temp_dir().join(format!("anyccl-tune-{}.toml", std::process::id()));
    let os = out.to_string_lossy().into_owned();
    // One algorithm: the check's verdict cannot depend on timing noise (auto runs the only, hence best, column).
    let args = ["tune", "--world", "2", "--sizes", "4KiB,256KiB", "--iters", "3", "--warmup", "1", "--algos", "ring"];
    let r = anyccl(&[&args[..], &["--out", &os]].concat(), &[]);
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

    // Its own check failing is an error: ANYCCL_ALLREDUCE_ALGO overrides the tuned table, so auto does not follow
    // it. The table is still written, and the message says which sizes failed and why.
    let r = anyccl(&[&args[..], &["--out", &os]].concat(), &[("ANYCCL_ALLREDUCE_ALGO", "one-shot")]);
    assert_eq!(r.status.code(), Some(1), "{}", text(&r.stdout));
    assert!(text(&r.stdout).contains("NOT THE TUNED TABLE'S CHOICE"), "{}", text(&r.stdout));
    assert_one_line_error(&r, "tune's check failed at 2 of 2 sizes");
    assert!(text(&r.stderr).contains("4 KiB: auto chose one-shot by a rule that is not the tuned table's"));
    assert!(anyccl::core::SelectorTable::load(&out).is_ok(), "the table stays written");
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

/// Starts `world` `anyccl` processes the way torchrun does (a stand-in holds `MASTER_PORT`; each process gets
/// `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `XDG_RUNTIME_DIR` and nothing else), rank `r`
/// with `args(r)`, and waits for all of them (60 s at most).
fn per_rank(world: usize, args: &dyn Fn(usize) -> Vec<String>) -> Vec<Output> {
    let held = launcher::hold_master_port();
    let port = held.local_addr().expect("addr").port();
    let start = Instant::now();
    let kids: Vec<Child> = (0..world)
        .map(|rank| {
            Command::new(env!("CARGO_BIN_EXE_anyccl"))
                .args(args(rank))
                .env_clear()
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                // where the per-user key of a loopback job without a secret lives (torchrun passes it on)
                .env("XDG_RUNTIME_DIR", launcher::runtime_dir())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("start a rank")
        })
        .collect();
    let outs =
        kids.into_iter().enumerate().map(|(r, k)| launcher::finish(r, k, start, Duration::from_secs(60))).collect();
    drop(held);
    outs
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| (*a).to_owned()).collect()
}

/// `bench --per-rank` under a torchrun stand-in: one process per rank on the host backend (shared memory); every
/// rank measures, rank 0 alone prints, each cell carries the spread of the ranks' medians, every result is checked.
#[test]
fn per_rank_bench_aggregates_over_processes() {
    let args = strings(&["bench", "--per-rank", "--sizes", "4KiB,64KiB", "--iters", "3", "--warmup", "1", "--json"]);
    let outs = per_rank(3, &|_| args.clone());
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {r}: {}", launcher::text(o));
        if r > 0 {
            assert!(o.stdout.is_empty(), "only rank 0 prints; rank {r}: {}", text(&o.stdout));
        }
    }
    let v: serde_json::Value = serde_json::from_slice(&outs[0].stdout).expect("rank 0 prints JSON");
    assert_eq!(
        (v["schema"].as_u64(), v["launch"].as_str(), v["world"].as_u64()),
        (Some(2), Some("processes"), Some(3))
    );
    assert_eq!(v["algorithms"], serde_json::json!(["one-shot", "two-shot"]), "the host backend across processes");
    assert_eq!(v["wrong"], 0);
    let ranks = v["ranks"].as_array().expect("ranks");
    let pids: std::collections::BTreeSet<u64> = ranks.iter().filter_map(|k| k["pid"].as_u64()).collect();
    assert_eq!(pids.len(), 3, "three processes: {ranks:?}");
    assert!(ranks.iter().all(|k| k["device"] == "host"), "{ranks:?}");
    let rows = v["rows"].as_array().expect("rows");
    assert_eq!(rows.iter().map(|r| r["bytes"].as_u64()).collect::<Vec<_>>(), [Some(4096), Some(65536)]);
    for row in rows {
        for place in [row, &row["in_place"]] {
            for c in place["cells"].as_array().expect("cells").iter().chain([&place["auto"]]) {
                assert_eq!(c["wrong"], 0, "{c}");
                let f = |k: &str| c["rank_spread"][k].as_f64().unwrap_or(f64::NAN);
                let (min, avg, max) = (f("min_us"), f("avg_us"), f("max_us"));
                assert!(0.0 < min && min <= avg && avg <= max, "{c}");
                // The headline is the average over the ranks, as nccl-tests reports it.
                assert_eq!(c["median_us"].as_f64(), Some(avg), "{c}");
            }
        }
    }
}

/// Ranks started with different flags refuse together, naming the odd one, instead of calling different
/// collectives; `--world` must match the launcher's; outside a launcher the error says how to start one.
#[test]
fn per_rank_ranks_must_agree() {
    let outs = per_rank(2, &|r| {
        let iters = if r == 1 { "4" } else { "3" };
        strings(&["bench", "--per-rank", "--sizes", "4KiB", "--iters", iters, "--warmup", "0"])
    });
    for (r, o) in outs.iter().enumerate() {
        assert_one_line_error(o, "rank 1 was started with other settings than rank 0");
        assert!(o.stdout.is_empty(), "rank {r} printed a report");
    }
    let outs = per_rank(2, &|_| strings(&["bench", "--per-rank", "--world", "4", "--sizes", "4KiB", "--iters", "1"]));
    for o in &outs {
        assert_one_line_error(o, "--world 4 differs from the launcher's WORLD_SIZE (2)");
    }
    let out = anyccl(&["bench", "--per-rank", "--sizes", "4KiB", "--iters", "1"], &[]);
    assert_one_line_error(&out, "WORLD_SIZE");
    assert!(text(&out.stderr).contains("torchrun --nproc-per-node"), "{}", text(&out.stderr));
}

/// The drop-in library cargo built for this test run: `anyccl-nccl` is a dev-dependency of the command, so cargo
/// builds its library (both crate types) before the tests, into the folder of the test binaries.
fn dropin_so() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("the test binary's folder");
    for c in [deps.join("libanyccl_nccl.so"), deps.join("..").join("libanyccl_nccl.so")] {
        if c.is_file() {
            return c.canonicalize().expect("canonical path of the drop-in");
        }
    }
    panic!("libanyccl_nccl.so was not built beside the test binaries in {}", deps.display());
}

#[test]
fn probe_reports_the_drop_in_named_by_anyccl_dropin_path_and_what_it_forwards_to() {
    let so = dropin_so();
    let lib = fake_ccl::build_profile(&fake_ccl::NCCL_2_28);
    let (so_s, lib_s) = (so.to_string_lossy().into_owned(), lib.to_string_lossy().into_owned());
    // The file, then the folder holding it: the same library.
    let folder = so.parent().expect("folder").to_string_lossy().into_owned();
    for named in [&so_s, &folder] {
        let out = anyccl(&["probe", "--json"], &[("ANYCCL_DROPIN_PATH", named), ("ANYCCL_NCCL_PATH", &lib_s)]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        let d = &v["dropin"];
        assert_eq!(d["found"], true, "{d}");
        assert_eq!(d["path"], so_s);
        assert_eq!(d["origin"], "ANYCCL_DROPIN_PATH");
        assert_eq!(d["marker"], 1);
        // The drop-in ran its own search: the library ANYCCL_NCCL_PATH names, as anyccl's loader reads it.
        assert_eq!(d["underlying"], format!("NCCL 2.28.9 {lib_s}"));
        assert_eq!(d["tried"].as_array().map(Vec::len), Some(0));
        // The library's own report is still all there.
        assert_eq!(v["libraries"][0]["version"], "NCCL 2.28.9");
    }
    let out = anyccl(&["probe"], &[("ANYCCL_DROPIN_PATH", &so_s), ("ANYCCL_NCCL_PATH", &lib_s)]);
    let s = text(&out.stdout);
    assert!(
        s.contains(&format!("Drop-in libnccl (anyccl-nccl):\n  found        {so_s} (ANYCCL_DROPIN_PATH; marker 1)\n")),
        "{s}"
    );
    assert!(s.contains(&format!("  forwards to  NCCL 2.28.9 {lib_s}\n")), "{s}");
}

#[test]
fn probe_refuses_a_library_that_is_not_the_drop_in_and_says_when_there_is_none() {
    // The fake NCCL is a library, but not a drop-in: refused from its symbol table, never opened as one.
    let lib = fake_ccl::build_profile(&fake_ccl::NCCL_2_28);
    let lib_s = lib.to_string_lossy().into_owned();
    let out = anyccl(&["probe", "--json"], &[("ANYCCL_DROPIN_PATH", &lib_s)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let d = &v["dropin"];
    assert_eq!(d["found"], false, "{d}");
    assert_eq!(d["path"], serde_json::Value::Null);
    assert_eq!(d["tried"][0]["candidate"], lib_s);
    let why = d["tried"][0]["failure"].as_str().expect("a reason");
    assert!(why.contains("anyccl_nccl_dropin_marker"), "{why}");
    let missing = "/nonexistent/anyccl/libanyccl_nccl.so";
    let out = anyccl(&["probe"], &[("ANYCCL_DROPIN_PATH", missing)]);
    assert!(out.status.success(), "a missing drop-in is reported, not fatal");
    let s = text(&out.stdout);
    assert!(
        s.contains(
            "  not found (build it with `cargo build --release -p anyccl-nccl`, or set ANYCCL_DROPIN_PATH to it)"
        ),
        "{s}"
    );
    assert!(s.contains(&format!("tried {missing} (ANYCCL_DROPIN_PATH): ")), "{s}");
}

#[test]
fn probe_finds_the_drop_in_beside_the_anyccl_binary() {
    let root =
        std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("probe-beside-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).expect("folder");
    // A hard link of the command (same file system as the target folder), or a copy.
    let exe = bin.join("anyccl");
    if std::fs::hard_link(env!("CARGO_BIN_EXE_anyccl"), &exe).is_err() {
        std::fs::copy(env!("CARGO_BIN_EXE_anyccl"), &exe).expect("copy the command");
    }
    let beside = bin.join("libanyccl_nccl.so");
    std::fs::copy(dropin_so(), &beside).expect("copy the drop-in");
    let lib = fake_ccl::build_profile(&fake_ccl::NCCL_2_28);
    let run = || {
        let out = Command::new(&exe)
            .args(["probe", "--json"])
            .env_remove("ANYCCL_DROPIN_PATH")
            .env("ANYCCL_NCCL_PATH", &lib)
            .output()
            .expect("the command runs");
        assert!(out.status.success(), "{}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        v["dropin"].clone()
    };
    let d = run();
    assert_eq!(d["found"], true, "{d}");
    assert_eq!(d["path"], beside.display().to_string());
    assert_eq!(d["origin"], "beside the anyccl binary");
    assert_eq!(d["underlying"], format!("NCCL 2.28.9 {}", lib.display()));
    std::fs::remove_file(&beside).expect("remove the drop-in");
    let d = run();
    assert_eq!(d["found"], false, "{d}");
    let tried: Vec<&str> =
        d["tried"].as_array().expect("tried").iter().filter_map(|t| t["candidate"].as_str()).collect();
    assert_eq!(tried, [beside.display().to_string(), root.join("lib").join("libanyccl_nccl.so").display().to_string()]);
    let _ = std::fs::remove_dir_all(&root);
}

/// `bench --backend cuda` and `tune --backend cuda` on the fake CUDA driver (4 sm_90 devices over the fake HIP
/// runtime, which emulates anyccl's kernels) with the computing fake NCCL 2.28: the command finds the driver through
/// the dynamic loader, as on a GPU machine. Every result is right (`#wrong` 0) for ccl, ccl-symmetric and the custom
/// one-shot and two-shot (run by the CUDA communicator from the real sm_90 cubin's kernel names), and tune's check
/// passes. Timings are meaningless here (the fake's events report a constant).
#[cfg(feature = "cuda")]
#[test]
fn bench_and_tune_run_on_the_cuda_backend_over_the_fake_driver() {
    let cuda = fake_cuda::build_cuda();
    let dir = cuda.parent().expect("the fake driver's folder").to_string_lossy().into_owned();
    let nccl = fake_cuda::build_nccl(&fake_ccl::NCCL_2_28).to_string_lossy().into_owned();
    let env = [("LD_LIBRARY_PATH", dir.as_str()), ("ANYCCL_NCCL_PATH", nccl.as_str())];
    let sweep = ["--backend", "cuda", "--world", "2", "--sizes", "4KiB,64KiB", "--iters", "2", "--warmup", "1"];
    let out = anyccl(&[&["bench"][..], &sweep, &["--json"]].concat(), &env);
    assert!(out.status.success(), "{}\n{}", text(&out.stdout), text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!((v["backend"].as_str(), v["schema"].as_u64(), v["wrong"].as_u64()), (Some("cuda"), Some(2), Some(0)));
    let algos: Vec<&str> = v["algorithms"].as_array().expect("algorithms").iter().filter_map(|a| a.as_str()).collect();
    assert!(algos.contains(&"ccl") && algos.contains(&"ccl-symmetric"), "{algos:?}");
    let custom = algos.contains(&"one-shot") && algos.contains(&"two-shot");
    if std::env::var_os("ANYCCL_REQUIRE_KERNELS").is_some() {
        assert!(custom, "the CUDA kernels are required in this run but not measured: {}", v["ineligible"]);
    } else if !custom {
        eprintln!("NOT CHECKED: the custom kernels (not compiled in: set ANYCCL_CUDA_TOOLKIT): {}", v["ineligible"]);
    }
    let mut cells = 0;
    for row in v["rows"].as_array().expect("rows") {
        for place in [row, &row["in_place"]] {
            for c in place["cells"].as_array().expect("cells").iter().chain([&place["auto"]]) {
                assert_eq!(c["wrong"], 0, "{c}");
                cells += 1;
            }
        }
    }
    assert_eq!(cells, 2 * 2 * (algos.len() + 1), "two sizes, in and out of place, every algorithm and auto");
    // Tune over one algorithm, so its check cannot depend on timing noise.
    let table_path = std::env::temp_dir().join(format!("anyccl-tune-cuda-{}.toml", std::process::id()));
    let tp = table_path.to_string_lossy().into_owned();
    let out = anyccl(&[&["tune"][..], &sweep, &["--algos", "ccl", "--out", &tp]].concat(), &env);
    assert!(out.status.success(), "{}\n{}", text(&out.stdout), text(&out.stderr));
    let s = text(&out.stdout);
    assert!(s.contains("measured on the cuda backend, world 2") && s.contains("check: 2 of 2 sizes within 5%"), "{s}");
    let t = anyccl::core::SelectorTable::load(&table_path).expect("the written table parses");
    assert!(!t.rules.is_empty());
    let _ = std::fs::remove_file(&table_path);
}

/// `anyccl bench --fused rmsnorm` on host ranks: every form measured per token count, `auto`'s form, the
/// fused/unfused ratio and `#wrong` 0, as a table and as JSON; bad flags and values refused, naming the culprit.
#[test]
fn bench_fused_rmsnorm_on_the_host() {
    let quick =
        ["bench", "--fused", "rmsnorm", "--backend", "host", "--world", "2", "--hidden", "64", "--tokens", "1,3"];
    let args: Vec<&str> = quick.iter().copied().chain(["--iters", "2", "--warmup", "0"]).collect();
    let out = anyccl(&args, &[]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    for col in ["tokens", "fused-one-shot", "fused-two-shot", "unfused", "auto", "fused/unfused", "#wrong"] {
        assert!(stdout.contains(col), "{col}: {stdout}");
    }
    let rows: Vec<&str> =
        stdout.lines().filter(|l| !l.starts_with('#') && !l.trim_start().starts_with("tokens")).collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    assert!(rows.iter().all(|r| r.split_whitespace().last() == Some("0")), "#wrong 0: {stdout}");

    let json_args: Vec<&str> = args.iter().copied().chain(["--json"]).collect();
    let out = anyccl(&json_args, &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["wrong"], 0);
    assert_eq!(v["rows"].as_array().map(Vec::len), Some(2));
    assert_eq!(v["rows"][0]["cells"].as_array().map(Vec::len), Some(4));
    // The host refuses the fused push one-shot (a GPU form) with the reason; the table says n/a and why.
    let push = &v["rows"][0]["cells"][3];
    assert_eq!((push["form"].as_str(), push["us"].is_null()), (Some("fused-push"), true), "{push}");
    assert!(push["ineligible"].as_str().is_some_and(|w| w.contains("host")), "{push}");
    assert!(stdout.contains("fused-push: n/a"), "{stdout}");
    assert_eq!(v["rows"][0]["auto"], "fused-one-shot");

    // The environment's form is what `auto` runs.
    let out = anyccl(&json_args, &[("ANYCCL_FUSED_RMSNORM", "unfused")]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(
        (v["rows"][1]["auto"].as_str(), v["rows"][1]["why"].as_str()),
        (Some("unfused"), Some("forced by ANYCCL_FUSED_RMSNORM"))
    );

    let fails = |extra: &[&str], env: &[(&str, &str)], want: &str| {
        let a: Vec<&str> = extra.to_vec();
        let out = anyccl(&a, env);
        let err = text(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{a:?}: {err}");
    };
    fails(&["bench", "--fused", "rmsnorm", "--backend", "host", "--hidden", "12"], &[], "RmsNormSpec::hidden");
    fails(&["bench", "--fused", "rmsnorm", "--backend", "host", "--dtype", "f32", "--hidden", "64"], &[], "f32");
    fails(
        &["bench", "--fused", "rmsnorm", "--backend", "host", "--hidden", "64"],
        &[("ANYCCL_FUSED_RMSNORM", "fast")],
        "ANYCCL_FUSED_RMSNORM",
    );
    fails(&["bench", "--fused", "rmsnorm", "--algos", "ring"], &[], "--algos");
    fails(&["bench", "--hidden", "64"], &[], "--fused");
    fails(&["bench", "--fused", "layernorm"], &[], "layernorm");

    // tune --fused rmsnorm writes fused_rmsnorm rules that load back.
    let out_path = tmp_file("fused-tune.toml", "");
    let out_s = out_path.display().to_string();
    let tune_args = [
        "tune",
        "--out",
        &out_s,
        "--fused",
        "rmsnorm",
        "--backend",
        "host",
        "--world",
        "2",
        "--hidden",
        "64",
        "--tokens",
        "1,64",
        "--iters",
        "2",
        "--warmup",
        "0",
    ];
    let out = anyccl(&tune_args, &[]);
    assert!(out.status.success(), "{}{}", text(&out.stdout), text(&out.stderr));
    let written = std::fs::read_to_string(&out_path).expect("the tuned table");
    assert_eq!(written.matches("fused_rmsnorm = [").count(), 2, "{written}");
    assert!(!written.contains("algorithms"), "{written}");
    // It parses back through the selector: two rules naming forms (all four, or all but the host's refused push)
    // and no all-reduce algorithms, over host ranks of world 2.
    let table = anyccl::core::SelectorTable::load(&out_path).expect("the written fused table parses");
    assert_eq!(table.rules.len(), 2, "{written}");
    assert!(
        table.rules.iter().all(|r| r.algorithms.is_empty()
            && r.fused.len() >= 3
            && r.vendors == vec![anyccl::core::Vendor::Host]
            && (r.world_min, r.world_max) == (2, 2)),
        "{written}"
    );
    let bench_with = [
        "bench",
        "--fused",
        "rmsnorm",
        "--backend",
        "host",
        "--world",
        "2",
        "--hidden",
        "64",
        "--tokens",
        "1",
        "--iters",
        "1",
        "--json",
        "--table",
        &out_s,
    ];
    let out = anyccl(&bench_with, &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert!(v["rows"][0]["why"].as_str().is_some_and(|w| w.contains("fused-tune.toml")), "{v}");
}
