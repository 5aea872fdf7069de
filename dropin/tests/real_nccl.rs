//! The drop-in under a C program compiled against the real `nccl.h` 2.28.9 (from the PyPI wheel), with the real
//! `libnccl.so.2` underneath and no GPU: the version, every error string and the last-error text equal the real
//! library's, `ncclGetUniqueId` succeeds as the real one does without a GPU, `ncclCommInitRank` fails cleanly
//! with the real library's code and text, and a function an older NCCL lacks is answered with `ncclInvalidUsage`.
//!
//! Needs the wheels, so it is ignored by a plain `cargo test`; CI runs it (ci/test.sh) with
//! `ANYCCL_TEST_NCCL_SDK="$(dropin/ci/install-nccl-sdk.sh)"` (the 2.28.9 headers and library) and
//! `ANYCCL_TEST_REAL_NCCL` from `ci/install-nccl.sh` (older and newer libraries, `VERSION=PATH:VERSION=PATH`), and
//! fails when either is missing.

#[path = "support/header.rs"]
mod header;
#[path = "support/programs.rs"]
mod programs;

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use programs::{case_dir, cc, run};

fn required_env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set; see this test's documentation"))
}

/// `2.28.9` → 22809.
fn version_code(v: &str) -> i32 {
    let p: Vec<i32> = v.split('.').map(|x| x.parse().expect("a numeric version")).collect();
    assert_eq!(p.len(), 3, "{v}");
    p[0] * 10000 + p[1] * 100 + p[2]
}

/// A C file that takes the address of every function `names` (from the header) names: linking it to the drop-in
/// fails if one is missing.
fn functions_c(names: &[String]) -> String {
    let mut s = String::from(
        "#include <nccl.h>\ntypedef void (*anyccl_fn)(void);\nconst anyccl_fn anyccl_test_functions[] = {\n",
    );
    for n in names {
        s.push_str(&format!("    (anyccl_fn){n},\n"));
    }
    s.push_str(&format!("}};\nconst int anyccl_test_function_count = {};\n", names.len()));
    s
}

fn build(sdk: &Path, dir: &Path) -> PathBuf {
    let header_text = std::fs::read_to_string(sdk.join("include").join("nccl.h")).expect("nccl.h in the SDK folder");
    let names = header::functions(&header_text);
    let plain: Vec<&str> = names.iter().filter(|n| n.starts_with("nccl")).map(String::as_str).collect();
    assert_eq!(plain, header::snapshot(), "tests/nccl-2.28.9-functions.txt no longer matches the header");
    for n in &plain {
        assert!(names.contains(&format!("p{n}")), "the header declares {n} without its pnccl alias");
    }
    assert_eq!(names.len(), 2 * plain.len(), "{names:?}");
    let functions = dir.join("functions.c");
    std::fs::write(&functions, functions_c(&names)).expect("write functions.c");
    let program = dir.join("real_nccl");
    let mut args: Vec<OsString> = vec!["-Wno-deprecated-declarations".into(), "-I".into()];
    args.push(programs::c_dir().join("shim").into_os_string());
    args.push("-I".into());
    args.push(sdk.join("include").into_os_string());
    args.extend(programs::link_to_dropin());
    cc(&program, &[programs::c_dir().join("real_nccl.c"), functions], &args);
    program
}

#[test]
#[ignore = "needs the real NCCL: ANYCCL_TEST_NCCL_SDK and ANYCCL_TEST_REAL_NCCL (see the file's documentation)"]
fn the_real_nccl_under_the_drop_in_answers_as_it_does_alone() {
    let sdk = PathBuf::from(required_env("ANYCCL_TEST_NCCL_SDK"));
    let mut libraries = vec![("2.28.9".to_owned(), sdk.join("lib").join("libnccl.so.2"))];
    for pair in required_env("ANYCCL_TEST_REAL_NCCL").split(':').filter(|p| !p.is_empty()) {
        let (v, path) = pair.split_once('=').expect("VERSION=PATH");
        libraries.push((v.to_owned(), PathBuf::from(path)));
    }
    let dir = case_dir("real-nccl");
    let program = build(&sdk, &dir);
    let mut older_seen = false;
    for (version, lib) in &libraries {
        let run_dir = dir.join(version);
        std::fs::create_dir_all(&run_dir).expect("folder");
        let lib_arg = lib.to_str().expect("a UTF-8 path");
        let out = run(&program, &run_dir, &[lib_arg], &[("ANYCCL_NCCL_PATH", lib.clone().into_os_string())]);
        let context = format!("NCCL {version}:\n{}\nstderr:\n{}", out.stdout, out.stderr);
        assert_eq!(out.code, Some(0), "{context}");
        let has = |l: &str| out.stdout.lines().any(|x| x == l);
        let starts = |p: &str| out.stdout.lines().find(|x| x.starts_with(p)).map(str::to_owned);
        assert!(has("ALL CHECKS PASSED"), "{context}");
        assert!(has(&format!("functions linked: {}", 2 * header::snapshot().len())), "{context}");
        assert!(has(&format!("underlying: NCCL {version} {}", lib.display())), "{context}");
        let code = version_code(version);
        assert!(has(&format!("ncclGetVersion rc=0 version={code} real={code} header=22809")), "{context}");
        // Without a GPU the real NCCL hands out a unique id (its bootstrap needs no device)...
        assert!(has("ncclGetUniqueId rc=0 nonzero=1"), "{context}");
        // ...and refuses a communicator with ncclUnhandledCudaError (1), saying why; the drop-in passes both on.
        assert!(has("ncclCommInitRank rc=1 comm_is_null=1"), "{context}");
        let last = starts("last after ncclCommInitRank: ").unwrap_or_default();
        assert!(last.contains("Cuda failure") || last.contains("CUDA"), "{context}");
        if starts("ncclCommWindowRegister rc=").is_some_and(|l| l.ends_with("exported=0")) {
            older_seen = true;
            assert!(has("ncclCommWindowRegister rc=5 exported=0"), "{context}");
            assert!(
                has(&format!(
                    "last after ncclCommWindowRegister: ncclCommWindowRegister is not available: the library under \
                     the anyccl drop-in NCCL, {} (NCCL {version}), does not export it (the drop-in implements nccl.h \
                     2.28.9); nothing was called",
                    lib.display()
                )),
                "{context}"
            );
        }
    }
    assert!(older_seen, "no library without ncclCommWindowRegister was tested (ci/install-nccl.sh installs 2.26.5)");
    let _ = std::fs::remove_dir_all(&dir);
}
