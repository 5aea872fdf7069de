//! Hostile places for the NCCL/RCCL search (docs/security.md): planted files in the working directory, FIFOs, relative
//! entries in PYTHONPATH/LD_LIBRARY_PATH/CUDA_HOME/ROCM_PATH, a library whose `ncclGetVersion` is data.
//!
//! Each case runs the real search in a child process (this test binary again, test `child`) whose working
//! directory is a planted temporary folder, with a deadline: a hang or a crash fails the case instead of hanging or
//! killing the test run. The working directory of this (multi-threaded) test process is never changed.

use anyccl_testkit::fake_ccl;
use anyccl_testkit::hostile_child;

use std::path::{Path, PathBuf};

use anyccl_ccl::find::Place;
use anyccl_ccl::loader::REQUIRED_SYMBOLS;
use anyccl_ccl::{CclLibrary, CclVendor, LoadFailure, SearchPlan};
use hostile_child::{bounded, case_dir, lose_root_read_override, mkfifo, nothing_from, os, plant, run_child};

/// A working fake NCCL (or RCCL, by `file`'s name) whose constructor prints [`hostile_child::PLANTED`].
fn planted_library(file: &str) -> PathBuf {
    let mut syms: Vec<&str> = REQUIRED_SYMBOLS.to_vec();
    if file.contains("rccl") {
        syms.push("ncclAllToAllv");
    }
    let mut c = fake_ccl::c_source(&syms, 22809, 0);
    c.push_str(&hostile_child::planted_constructor_c());
    fake_ccl::compile_once(&format!("planted/{file}"), &c, &[])
}

/// A fake NCCL whose `ncclGetVersion` is an `int`, not a function.
fn data_object_library() -> PathBuf {
    let syms: Vec<&str> = REQUIRED_SYMBOLS.iter().copied().filter(|s| *s != "ncclGetVersion").collect();
    let mut c = fake_ccl::c_source(&syms, 0, 0);
    c.push_str("int ncclGetVersion = 0;\n");
    fake_ccl::compile_once("data-object/libnccl.so.2", &c, &[])
}

/// The child half: runs one search in the working directory it was given and prints `RESULT ok PATH; tried: …`
/// or `RESULT err tried: …` (every place that failed or was skipped, with its reason).
#[test]
#[ignore = "the child half of the hostile tests, which run it in a planted working directory"]
fn child() {
    let case = std::env::var("ANYCCL_HOSTILE_CASE").expect("run by the hostile tests, which set ANYCCL_HOSTILE_CASE");
    let t = match case.as_str() {
        "search-nccl" => SearchPlan::from_env(CclVendor::Nccl).try_load(),
        "search-rccl" => SearchPlan::from_env(CclVendor::Rccl).try_load(),
        "open" => {
            let p = std::env::var_os("ANYCCL_HOSTILE_PATH").expect("path");
            let plan = SearchPlan { vendor: CclVendor::Nccl, places: vec![Place::Path(PathBuf::from(p))] };
            plan.try_load()
        }
        other => panic!("unknown case {other}"),
    };
    hostile_child::print_result(t.loaded.as_ref().map(|l| l.path()), &anyccl_ccl::find::describe_attempts(&t.attempts));
}

// ---------------------------------------------------------------------------------------------------------------
// Relative entries: never the working directory.

#[test]
fn an_empty_pythonpath_entry_does_not_load_from_the_working_directory() {
    let dir = case_dir("pythonpath-empty");
    plant(&planted_library("libnccl.so.2"), &dir, "nvidia/nccl/lib/libnccl.so.2");
    let home = dir.join("home");
    for pp in ["/nonexistent-anyccl-site:", ":/nonexistent-anyccl-site", ".", "site"] {
        if pp == "site" {
            plant(&planted_library("libnccl.so.2"), &dir, "site/nvidia/nccl/lib/libnccl.so.2");
        }
        let r = run_child("search-nccl", &dir, &[("PYTHONPATH", os(pp)), ("HOME", os(&home))]).result();
        nothing_from(&r, &dir);
        let entry = if pp.starts_with('/') || pp.starts_with(':') { "" } else { pp };
        let want = format!("nvidia/nccl/lib (not searched: PYTHONPATH entry {entry:?} is relative;");
        assert!(r.contains(&want), "PYTHONPATH={pp:?}: {r}");
    }
}

#[test]
fn relative_cuda_home_and_rocm_path_are_skipped() {
    let dir = case_dir("relative-homes");
    plant(&planted_library("libnccl.so.2"), &dir, "cuda/lib64/libnccl.so.2");
    plant(&planted_library("librccl.so.1"), &dir, "rocm/lib/librccl.so.1");
    let r = run_child("search-nccl", &dir, &[("CUDA_HOME", os("cuda"))]).result();
    nothing_from(&r, &dir);
    assert!(r.contains("cuda/lib64 (not searched: CUDA_HOME is relative;"), "{r}");
    let r = run_child("search-rccl", &dir, &[("ROCM_PATH", os("rocm"))]).result();
    nothing_from(&r, &dir);
    assert!(r.contains("rocm/lib (not searched: ROCM_PATH is relative;"), "{r}");
}

#[test]
fn a_relative_explicit_path_is_refused() {
    let dir = case_dir("explicit-relative");
    plant(&planted_library("libnccl.so.2"), &dir, "mine/libnccl.so.2");
    let r = run_child("search-nccl", &dir, &[("ANYCCL_NCCL_PATH", os("mine/libnccl.so.2"))]).result();
    nothing_from(&r, &dir);
    assert!(r.contains("mine/libnccl.so.2 (not searched: ANYCCL_NCCL_PATH is relative;"), "{r}");
}

#[test]
fn a_relative_ld_library_path_entry_keeps_sonames_from_the_working_directory() {
    let dir = case_dir("ld-library-path");
    plant(&planted_library("libnccl.so.2"), &dir, "libnccl.so.2");
    plant(&planted_library("libnccl.so.2"), &dir, "rel/libnccl.so.2");
    for llp in ["/nonexistent-anyccl-lib:", ".", "rel"] {
        let r = run_child("search-nccl", &dir, &[("LD_LIBRARY_PATH", os(llp))]).result();
        nothing_from(&r, &dir);
        let entry = if llp.starts_with('/') { "" } else { llp };
        let want =
            format!("libnccl.so.2 (not handed to the dynamic loader: LD_LIBRARY_PATH entry {entry:?} is relative");
        assert!(r.contains(&want), "LD_LIBRARY_PATH={llp:?}: {r}");
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Bare sonames go to the dynamic loader only.

#[test]
fn a_fifo_named_like_the_soname_in_the_working_directory_does_not_hang_the_search() {
    let dir = case_dir("soname-fifo");
    mkfifo(&dir.join("libnccl.so.2"));
    mkfifo(&dir.join("libnccl.so"));
    let r = run_child("search-nccl", &dir, &[]).result();
    assert!(!r.contains("FIFO"), "the FIFO in the working directory was looked at: {r}");
    // Handed to the dynamic loader, which does not search the working directory (and finds none on a machine
    // without NCCL; on one with it, a library from an absolute place).
    nothing_from(&r, &dir);
    assert!(r.contains("libnccl.so.2 (not found)") || r.starts_with("ok /"), "{r}");
}

#[test]
fn a_junk_file_named_like_the_soname_in_the_working_directory_hides_nothing() {
    let dir = case_dir("soname-junk");
    std::fs::write(dir.join("libnccl.so.2"), "junk").expect("junk");
    let real = fake_ccl::build_profile(&fake_ccl::NCCL_2_28);
    let real_dir = real.parent().expect("dir").to_owned();
    let r = run_child("search-nccl", &dir, &[("LD_LIBRARY_PATH", os(&real_dir))]).result();
    assert_eq!(r, format!("ok {}; tried: ", real.display()));
}

// ---------------------------------------------------------------------------------------------------------------
// Candidates that are not regular files, not ELF, or whose entry points are data.

#[test]
fn a_fifo_as_the_explicit_path_or_in_a_search_directory_is_refused_without_hanging() {
    let dir = case_dir("fifo");
    mkfifo(&dir.join("fifo/libnccl.so.2"));
    mkfifo(&dir.join("cuda/lib64/libnccl.so.2"));
    mkfifo(&dir.join("rocm/librccl.so.1"));
    let fifo = dir.join("fifo/libnccl.so.2");
    let r = run_child("search-nccl", &dir, &[("ANYCCL_NCCL_PATH", os(&fifo))]).result();
    nothing_from(&r, &dir);
    assert!(r.contains(&format!("{} (not a regular file: a FIFO)", fifo.display())), "{r}");
    let r = run_child("search-nccl", &dir, &[("CUDA_HOME", os(dir.join("cuda")))]).result();
    nothing_from(&r, &dir);
    assert!(
        r.contains(&format!("{} (not a regular file: a FIFO)", dir.join("cuda/lib64/libnccl.so.2").display())),
        "{r}"
    );
    let rfifo = dir.join("rocm/librccl.so.1");
    let r = run_child("search-rccl", &dir, &[("ANYCCL_RCCL_PATH", os(&rfifo))]).result();
    nothing_from(&r, &dir);
    assert!(r.contains(&format!("{} (not a regular file: a FIFO)", rfifo.display())), "{r}");
}

#[test]
fn an_ncclgetversion_that_is_data_is_refused_before_anything_is_called() {
    let lib = data_object_library();
    let dir = case_dir("data-object");
    let r = run_child("search-nccl", &dir, &[("ANYCCL_NCCL_PATH", os(&lib))]).result();
    nothing_from(&r, &dir);
    assert!(
        r.contains(&format!("{} (ncclGetVersion is not a function: it is a data object (STT_OBJECT))", lib.display())),
        "{r}"
    );
    // Found by soname through the dynamic loader: checked after dlopen, before ncclGetVersion is called.
    let r = run_child("search-nccl", &dir, &[("LD_LIBRARY_PATH", os(lib.parent().expect("dir")))]).result();
    nothing_from(&r, &dir);
    let want = format!(
        "libnccl.so.2 (the dynamic loader found {}, which is refused: ncclGetVersion is not a function: it is a data \
         object (STT_OBJECT))",
        lib.display()
    );
    assert!(r.contains(&want), "{r}");
}

#[test]
fn a_name_too_long_is_reported_as_such() {
    let dir = case_dir("too-long");
    // One component over NAME_MAX (255), and a whole path over PATH_MAX (4096) of short components.
    let component = dir.join("x".repeat(300)).join("libnccl.so.2");
    let mut path = dir.clone();
    for _ in 0..30 {
        path.push("y".repeat(200));
    }
    let path = path.join("libnccl.so.2");
    for long in [component, path] {
        let r = run_child("open", &dir, &[("ANYCCL_HOSTILE_PATH", os(&long))]).result();
        assert_eq!(r, format!("err tried: {} (name too long)", long.display()));
        assert_eq!(bounded(move || CclLibrary::open(&long).map(|_| ())), Err(LoadFailure::NameTooLong));
    }
}

#[test]
fn permission_denied_is_reported_as_such() {
    let dir = case_dir("denied");
    let lib = plant(&fake_ccl::build_profile(&fake_ccl::NCCL_2_28), &dir, "unreadable/libnccl.so.2");
    let behind = plant(&fake_ccl::build_profile(&fake_ccl::NCCL_2_28), &dir, "closed/libnccl.so.2");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&lib, std::fs::Permissions::from_mode(0o000)).expect("chmod file");
    std::fs::set_permissions(dir.join("closed"), std::fs::Permissions::from_mode(0o600)).expect("chmod dir");
    // The tests run as root in CI, and root reads anything: the check runs on a thread without that privilege.
    let got = bounded(move || {
        lose_root_read_override();
        let denied = std::fs::File::open(&lib).map_err(|e| e.raw_os_error());
        assert_eq!(denied.err(), Some(Some(nix::libc::EACCES)), "this thread can still read a mode-000 file");
        (CclLibrary::open(&lib).map(|_| ()), CclLibrary::open(&behind).map(|_| ()))
    });
    assert_eq!(got, (Err(LoadFailure::PermissionDenied), Err(LoadFailure::PermissionDenied)));
    std::fs::set_permissions(dir.join("closed"), std::fs::Permissions::from_mode(0o755)).expect("chmod back");
}

#[test]
fn what_is_not_a_regular_file_is_refused_without_being_opened() {
    let dir = case_dir("not-regular");
    mkfifo(&dir.join("fifo.so"));
    let _socket = std::os::unix::net::UnixListener::bind(dir.join("socket.so")).expect("socket");
    std::fs::create_dir_all(dir.join("dir.so")).expect("dir");
    std::os::unix::fs::symlink(dir.join("fifo.so"), dir.join("link-to-fifo.so")).expect("symlink");
    for (name, kind) in
        [("fifo.so", "a FIFO"), ("link-to-fifo.so", "a FIFO"), ("socket.so", "a socket"), ("dir.so", "a directory")]
    {
        let p = dir.join(name);
        let got = bounded(move || CclLibrary::open(&p).map(|_| ()));
        assert_eq!(got, Err(LoadFailure::NotRegularFile { file_type: kind.into() }), "{name}");
    }
    let got = bounded(|| CclLibrary::open(Path::new("/dev/null")).map(|_| ()));
    assert_eq!(got, Err(LoadFailure::NotRegularFile { file_type: "a character device".into() }));
}
