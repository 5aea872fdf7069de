//! Hostile places for the HIP runtime search (docs/security.md), the same rules as the NCCL/RCCL search: planted files in
//! the working directory, FIFOs, relative `ROCM_PATH`/`LD_LIBRARY_PATH` entries, a runtime whose
//! `hipRuntimeGetVersion` is data, unreadable and over-long paths.
//!
//! The cases that depend on the working directory or on `LD_LIBRARY_PATH` (read by the dynamic loader at start)
//! run `HipLibrary::load` in a child process (this test binary again, test `child`) with a deadline, so a hang or a
//! crash fails the case instead of hanging or killing the run; this process's working directory never changes.

use anyccl_testkit::fake_ccl;
use anyccl_testkit::fake_hip;
use anyccl_testkit::hostile_child;

use std::path::{Path, PathBuf};

use anyccl_rocm::HipLibrary;
use hostile_child::{bounded, case_dir, lose_root_read_override, mkfifo, os, plant};

/// A shared library with no HIP symbols whose constructor prints [`hostile_child::PLANTED`].
fn planted_library() -> PathBuf {
    fake_ccl::compile_once("planted-hip/libamdhip64.so", &hostile_child::planted_constructor_c(), &[])
}

/// A HIP runtime exporting every symbol anyccl needs as a function, except `hipRuntimeGetVersion`: an `int`.
fn data_object_runtime() -> PathBuf {
    let mut c = String::new();
    for s in anyccl_rocm::loader::REQUIRED_SYMBOLS.iter().filter(|s| **s != "hipRuntimeGetVersion") {
        c.push_str(&format!("int {s}(void) {{ return 0; }}\n"));
    }
    c.push_str("int hipRuntimeGetVersion = 0;\n");
    fake_ccl::compile_once("data-object-hip/libamdhip64.so.7", &c, &[])
}

/// Runs this test binary's `child` test in `cwd` with only `env` set; the `RESULT` line it printed, after
/// checking that it ended cleanly in time and that no planted constructor ran.
fn run_child(case: &str, cwd: &Path, env: &[(&str, std::ffi::OsString)]) -> String {
    hostile_child::run_child(case, cwd, env).result()
}

/// The child half: loads the HIP runtime as the probe does and prints `RESULT ok PATH; tried: …` or
/// `RESULT err tried: …` (every place that failed or was skipped, with its reason).
#[test]
#[ignore = "the child half of the hostile tests, which run it in a planted working directory"]
fn child() {
    use anyccl_ccl::find::{self, Place};
    let case = std::env::var("ANYCCL_HOSTILE_CASE").expect("run by the hostile tests, which set ANYCCL_HOSTILE_CASE");
    let places = match case.as_str() {
        "load" => anyccl_rocm::loader::places(&find::process_env),
        "open" => vec![Place::Path(PathBuf::from(std::env::var_os("ANYCCL_HOSTILE_PATH").expect("path")))],
        other => panic!("unknown case {other}"),
    };
    let t = HipLibrary::try_load_from(&places);
    hostile_child::print_result(t.loaded.as_ref().map(|l| l.path()), &find::describe_attempts(&t.attempts));
}

/// Not from the working directory: loaded from an absolute place outside `cwd` (a real runtime on this machine)
/// or not found; and `must_mention` is among the reasons either way.
fn nothing_from_cwd(r: &str, cwd: &Path, must_mention: &str) {
    hostile_child::nothing_from(r, cwd);
    assert!(r.contains(must_mention), "{r}");
}

#[test]
fn a_fifo_as_anyccl_hip_path_is_refused_without_hanging() {
    let dir = case_dir("fifo");
    let fifo = dir.join("libamdhip64.so");
    mkfifo(&fifo);
    let r = run_child("load", &dir, &[("ANYCCL_HIP_PATH", os(&fifo))]);
    nothing_from_cwd(&r, &dir, &format!("{} (not a regular file: a FIFO)", fifo.display()));
    mkfifo(&dir.join("rocm/lib/libamdhip64.so"));
    let r = run_child("load", &dir, &[("ROCM_PATH", os(dir.join("rocm")))]);
    if r.starts_with("err ") {
        // Reached only when no runtime loads by soname first.
        let fifo = dir.join("rocm/lib/libamdhip64.so");
        assert!(r.contains(&format!("{} (not a regular file: a FIFO)", fifo.display())), "{r}");
    }
}

#[test]
fn relative_rocm_path_and_ld_library_path_entries_never_reach_the_working_directory() {
    let dir = case_dir("relative");
    let planted = planted_library();
    plant(&planted, &dir, "rocm/lib/libamdhip64.so");
    for soname in ["libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so"] {
        plant(&planted, &dir, soname);
    }
    // ROCM_PATH comes after the sonames: the skip shows only where no runtime loads by soname (the plan's own test
    // checks it everywhere).
    let r = run_child("load", &dir, &[("ROCM_PATH", os("rocm"))]);
    nothing_from_cwd(
        &r,
        &dir,
        if r.starts_with("err ") { "rocm/lib (not searched: ROCM_PATH is relative" } else { "" },
    );
    let r = run_child("load", &dir, &[("ANYCCL_HIP_PATH", os("rocm/lib/libamdhip64.so"))]);
    nothing_from_cwd(&r, &dir, "rocm/lib/libamdhip64.so (not searched: ANYCCL_HIP_PATH is relative");
    for llp in ["/nonexistent-anyccl-lib:", ".", "rocm/lib"] {
        let r = run_child("load", &dir, &[("LD_LIBRARY_PATH", os(llp))]);
        nothing_from_cwd(&r, &dir, "not handed to the dynamic loader: LD_LIBRARY_PATH entry");
    }
}

#[test]
fn a_file_named_like_a_soname_in_the_working_directory_is_not_looked_at() {
    let dir = case_dir("soname-fifo");
    for soname in ["libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so"] {
        mkfifo(&dir.join(soname));
    }
    let r = run_child("load", &dir, &[]);
    assert!(!r.contains("FIFO"), "{r}");
    nothing_from_cwd(&r, &dir, "libamdhip64.so.7 (not found)");
}

#[test]
fn a_runtime_whose_version_entry_point_is_data_is_refused_before_anything_is_called() {
    let lib = data_object_runtime();
    let dir = case_dir("data-object");
    let r = run_child("load", &dir, &[("ANYCCL_HIP_PATH", os(&lib))]);
    let why = "hipRuntimeGetVersion is not a function: it is a data object (STT_OBJECT)";
    nothing_from_cwd(&r, &dir, &format!("{} ({why})", lib.display()));
    // Found by soname through the dynamic loader (first in LD_LIBRARY_PATH): checked before it is called.
    let r = run_child("load", &dir, &[("LD_LIBRARY_PATH", os(lib.parent().expect("dir")))]);
    nothing_from_cwd(
        &r,
        &dir,
        &format!("libamdhip64.so.7 (the dynamic loader found {}, which is refused: {why})", lib.display()),
    );
}

#[test]
fn the_fake_runtime_still_loads_by_path_and_by_soname() {
    let hip = fake_hip::build_hip();
    let dir = case_dir("good");
    let r = run_child("load", &dir, &[("ANYCCL_HIP_PATH", os(&hip))]);
    assert_eq!(r, format!("ok {}; tried: ", hip.display()));
    // By soname: the fake is libamdhip64.so.6; a machine with a system libamdhip64.so.7 loads that one first.
    let r = run_child("load", &dir, &[("LD_LIBRARY_PATH", os(hip.parent().expect("dir")))]);
    assert!(r.starts_with(&format!("ok {};", hip.display())) || r.starts_with("ok /"), "{r}");
}

#[test]
fn a_name_too_long_is_reported_as_such() {
    let dir = case_dir("too-long");
    let long = dir.join("x".repeat(300)).join("libamdhip64.so");
    let r = run_child("open", &dir, &[("ANYCCL_HOSTILE_PATH", os(&long))]);
    assert_eq!(r, format!("err tried: {} (name too long)", long.display()));
}

#[test]
fn the_plan_skips_relative_entries_and_keeps_sonames_from_a_relative_ld_library_path() {
    use anyccl_ccl::find::Place;
    use anyccl_ccl::LoadFailure;
    let env = |k: &str| match k {
        "ANYCCL_HIP_PATH" => Some(PathBuf::from("build/libamdhip64.so")),
        "ROCM_PATH" => Some(PathBuf::from("rocm")),
        "LD_LIBRARY_PATH" => Some(PathBuf::from("/opt/hip/lib:")),
        _ => None,
    };
    let places = anyccl_rocm::loader::places(&env);
    let rel = |origin: &str| LoadFailure::RelativePath { origin: origin.into() };
    let skipped: Vec<(String, LoadFailure)> = places
        .iter()
        .filter_map(|p| match p {
            Place::Skipped(a) => Some((a.candidate.clone(), a.failure.clone())),
            _ => None,
        })
        .collect();
    let loader = LoadFailure::LoaderSearchesWorkingDirectory { entry: String::new() };
    assert_eq!(
        skipped,
        [
            ("build/libamdhip64.so".to_owned(), rel("ANYCCL_HIP_PATH")),
            ("libamdhip64.so.7".to_owned(), loader.clone()),
            ("libamdhip64.so.6".to_owned(), loader.clone()),
            ("libamdhip64.so.5".to_owned(), loader.clone()),
            ("libamdhip64.so".to_owned(), loader),
            ("rocm/lib".to_owned(), rel("ROCM_PATH")),
        ]
    );
    for p in &places {
        assert!(!matches!(p, Place::Soname(_)), "{p:?}");
        if let Place::Path(p) = p {
            assert!(p.is_absolute(), "{p:?}");
        }
    }
    // LD_LIBRARY_PATH's absolute entry is searched as a path under every soname, and /opt/rocm/lib as before.
    assert!(places.contains(&Place::Path(PathBuf::from("/opt/hip/lib/libamdhip64.so.6"))), "{places:?}");
    assert_eq!(places.last(), Some(&Place::Path(PathBuf::from("/opt/rocm/lib/libamdhip64.so"))));
}

/// The reason `HipLibrary::open` gave for its one candidate.
fn open_failure(p: PathBuf) -> anyccl_ccl::LoadFailure {
    match HipLibrary::open(&p) {
        Err(anyccl_rocm::HipLoadError::NotFound { tried }) if tried.len() == 1 => tried[0].failure.clone(),
        Err(other) => panic!("{}: {other}", p.display()),
        Ok(lib) => panic!("{} loaded: {lib:?}", p.display()),
    }
}

#[test]
fn unreadable_and_non_regular_candidates_get_precise_reasons() {
    use anyccl_ccl::LoadFailure;
    let dir = case_dir("precise");
    let hip = fake_hip::build_hip();
    let denied = plant(&hip, &dir, "denied/libamdhip64.so");
    let behind = plant(&hip, &dir, "closed/libamdhip64.so");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&denied, std::fs::Permissions::from_mode(0o000)).expect("chmod file");
    std::fs::set_permissions(dir.join("closed"), std::fs::Permissions::from_mode(0o600)).expect("chmod dir");
    // The tests run as root in CI, and root reads anything: the check runs on a thread that lost that privilege
    // (Linux capabilities are per thread), which is asserted first.
    let got = bounded(move || {
        lose_root_read_override();
        let e = std::fs::File::open(&denied).map_err(|e| e.raw_os_error()).err();
        assert_eq!(e, Some(Some(nix::libc::EACCES)), "this thread can still read a mode-000 file");
        (open_failure(denied), open_failure(behind))
    });
    assert_eq!(got, (LoadFailure::PermissionDenied, LoadFailure::PermissionDenied));
    std::fs::set_permissions(dir.join("closed"), std::fs::Permissions::from_mode(0o755)).expect("chmod back");

    mkfifo(&dir.join("fifo.so"));
    let fifo = dir.join("fifo.so");
    assert_eq!(bounded(move || open_failure(fifo)), LoadFailure::NotRegularFile { file_type: "a FIFO".into() });
    let d = dir.clone();
    assert_eq!(bounded(move || open_failure(d)), LoadFailure::NotRegularFile { file_type: "a directory".into() });
    let rel = PathBuf::from("lib/libamdhip64.so");
    assert_eq!(open_failure(rel), LoadFailure::RelativePath { origin: "the path".into() });
    // The real NCCL-style fake is an ELF library of this machine, but not a HIP runtime.
    let nccl = fake_ccl::build_profile(&fake_ccl::NCCL_2_28);
    match HipLibrary::open(&nccl) {
        Err(anyccl_rocm::HipLoadError::MissingRequired { symbol, path }) => {
            assert_eq!((symbol.as_str(), path), ("hipGetDeviceCount", nccl.display().to_string()));
        }
        other => panic!("{other:?}"),
    }
}
