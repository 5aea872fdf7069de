//! The drop-in under a C program compiled against the real `nccl.h` 2.32.3 (from the PyPI wheel), with the real
//! `libnccl.so.2` underneath and no GPU: the version, every error string and the last-error text equal the real
//! library's, `ncclGetUniqueId` succeeds as the real one does without a GPU, `ncclCommInitRank` fails cleanly
//! with the real library's code and text, the 2.32 calls that have an answer without a GPU (suspend, resume,
//! memory statistics, the per-call config collectives on a null communicator, the parameter registry) answer as
//! the library does, the device API's host functions that have an answer without a GPU answer as the library does,
//! and a function an older NCCL lacks is answered with `ncclInvalidUsage`. The exports are compared with the real
//! library's (every `nccl*`/`pnccl*` function) and with its headers. Then how it links: a
//! program linked against the drop-in starts against the real `libnccl.so.2` and the other way round, and the
//! drop-in built for glibc 2.28 has the SONAME `libnccl.so.2` and needs no `GLIBC_` version above 2.28.
//!
//! Needs the wheels, so it is ignored by a plain `cargo test`; CI runs it (ci/test.sh) with
//! `ANYCCL_TEST_NCCL_SDK="$(dropin/ci/install-nccl-sdk.sh)"` (the 2.32.3 headers and library),
//! `ANYCCL_TEST_REAL_NCCL` from `ci/install-nccl.sh` (older and newer libraries, `VERSION=PATH:VERSION=PATH`) and
//! `ANYCCL_TEST_DROPIN_GLIBC_2_28="$(dropin/ci/build-glibc-2.28.sh)"` (the drop-in linked against glibc 2.28), and
//! fails when one is missing. `ANYCCL_TEST_KEEP=1` keeps the C program's output under cargo's temporary folder.

mod support;
use support::{header, programs};

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

/// `NCCL_VERSION_CODE` of the SDK's `nccl.h`.
fn header_version_code(sdk: &Path) -> i32 {
    let text = std::fs::read_to_string(sdk.join("include").join("nccl.h")).expect("nccl.h in the SDK folder");
    text.lines()
        .find_map(|l| l.strip_prefix("#define NCCL_VERSION_CODE "))
        .and_then(|v| v.trim().parse().ok())
        .expect("NCCL_VERSION_CODE in nccl.h")
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

/// A C file that takes the address of every device API host function (and its alias) of the snapshot, declared
/// here without their types (nccl_device/host.h needs CUDA's headers): linking it to the drop-in fails if one is
/// missing.
fn device_functions_c() -> String {
    let names: Vec<String> = header::device_snapshot().iter().flat_map(|n| [n.to_string(), format!("p{n}")]).collect();
    let mut s = String::from("typedef void (*anyccl_fn)(void);\n");
    for n in &names {
        s.push_str(&format!("extern void {n}(void);\n"));
    }
    s.push_str("const anyccl_fn anyccl_test_device_functions[] = {\n");
    for n in &names {
        s.push_str(&format!("    {n},\n"));
    }
    s.push_str(&format!("}};\nconst int anyccl_test_device_function_count = {};\n", names.len()));
    s
}

fn build(sdk: &Path, dir: &Path) -> PathBuf {
    let header_text = std::fs::read_to_string(sdk.join("include").join("nccl.h")).expect("nccl.h in the SDK folder");
    let names = header::functions(&header_text);
    let plain: Vec<&str> = names.iter().filter(|n| n.starts_with("nccl")).map(String::as_str).collect();
    assert_eq!(plain, header::snapshot(), "tests/nccl-2.32.3-functions.txt no longer matches the header");
    for n in &plain {
        assert!(names.contains(&format!("p{n}")), "the header declares {n} without its pnccl alias");
    }
    assert_eq!(names.len(), 2 * plain.len(), "{names:?}");
    let functions = dir.join("functions.c");
    std::fs::write(&functions, functions_c(&names)).expect("write functions.c");
    let device_functions = dir.join("device_functions.c");
    std::fs::write(&device_functions, device_functions_c()).expect("write device_functions.c");
    let program = dir.join("real_nccl");
    // NCCL_OS_LINUX: nccl.h 2.32 declares ncclResetDebugInit only under it (NCCL's own build defines it; the Linux
    // library exports the function either way).
    let mut args: Vec<OsString> = vec!["-Wno-deprecated-declarations".into(), "-DNCCL_OS_LINUX".into(), "-I".into()];
    args.push(programs::c_dir().join("shim").into_os_string());
    args.push("-I".into());
    args.push(sdk.join("include").into_os_string());
    args.extend(programs::link_to_dropin());
    cc(&program, &[programs::c_dir().join("real_nccl.c"), functions, device_functions], &args);
    program
}

#[test]
#[ignore = "needs the real NCCL: ANYCCL_TEST_NCCL_SDK and ANYCCL_TEST_REAL_NCCL (see the file's documentation)"]
fn the_real_nccl_under_the_drop_in_answers_as_it_does_alone() {
    let sdk = PathBuf::from(required_env("ANYCCL_TEST_NCCL_SDK"));
    let header_code = header_version_code(&sdk);
    let sdk_version = format!("{}.{}.{}", header_code / 10000, header_code / 100 % 100, header_code % 100);
    let mut libraries = vec![(sdk_version, sdk.join("lib").join("libnccl.so.2"))];
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
        assert!(has(&format!("device functions linked: {}", 2 * header::device_snapshot().len())), "{context}");
        assert!(has(&format!("underlying: NCCL {version} {}", lib.display())), "{context}");
        let code = version_code(version);
        assert!(has(&format!("ncclGetVersion rc=0 version={code} real={code} header={header_code}")), "{context}");
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
                     2.32.3); nothing was called",
                    lib.display()
                )),
                "{context}"
            );
        }
        // The 2.32 calls: compared where the library has them (the C program checks code and text), refused with
        // ncclInvalidUsage where it does not.
        assert!(has("2.32 calls compared"), "{context}");
        assert!(has("device API host calls compared"), "{context}");
        if code >= 23200 {
            for f in [
                "ncclCommSuspend",
                "ncclCommResume",
                "ncclAllReduceConfig",
                "ncclParamGetParameter",
                "ncclCommQueryProperties",
                "ncclGetPeerDevicePointer",
            ] {
                let line = starts(&format!("{f} rc=")).unwrap_or_default();
                assert!(line.ends_with("exported=1"), "{f}: {context}");
            }
        } else {
            assert!(has("ncclCommSuspend rc=5 exported=0"), "{context}");
            assert!(has("ncclAllReduceConfig rc=5 exported=0"), "{context}");
            assert!(has("ncclGetPeerDevicePointer rc=5 exported=0"), "{context}");
            assert!(has("ncclLLA2ACalcSlots value=-1 exported=0"), "{context}");
        }
    }
    assert!(older_seen, "no library without ncclCommWindowRegister was tested (ci/install-nccl.sh installs 2.26.5)");
    if std::env::var_os("ANYCCL_TEST_KEEP").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// What `tool args…` printed (it must succeed).
fn tool(tool: &str, args: &[&std::ffi::OsStr]) -> String {
    let out = std::process::Command::new(tool).args(args).output().unwrap_or_else(|e| panic!("{tool} runs: {e}"));
    assert!(out.status.success(), "{tool} {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The `DT_SONAME` and `DT_NEEDED` entries `readelf -d` shows.
fn dynamic_names(file: &Path, kind: &str) -> Vec<String> {
    tool("readelf", &["-d".as_ref(), file.as_os_str()])
        .lines()
        .filter(|l| l.contains(&format!("({kind})")))
        .filter_map(|l| l.split('[').nth(1).and_then(|r| r.split(']').next()).map(str::to_owned))
        .collect()
}

/// The highest `GLIBC_x.y[.z]` version `objdump -T` shows the file needs, as numbers.
fn highest_glibc(file: &Path) -> Option<Vec<u32>> {
    let text = tool("objdump", &["-T".as_ref(), file.as_os_str()]);
    text.split(|c: char| c.is_whitespace() || c == '(' || c == ')')
        .filter_map(|w| w.strip_prefix("GLIBC_"))
        .filter_map(|v| v.split('.').map(|p| p.parse::<u32>().ok()).collect::<Option<Vec<u32>>>())
        .max()
}

#[test]
#[ignore = "needs the real NCCL: ANYCCL_TEST_NCCL_SDK (see the file's documentation)"]
fn a_program_linked_to_either_starts_against_the_other() {
    let sdk = PathBuf::from(required_env("ANYCCL_TEST_NCCL_SDK"));
    let real_dir = sdk.join("lib");
    let code = header_version_code(&sdk);
    let dir = case_dir("linkage");
    let source = dir.join("starts.c");
    std::fs::write(
        &source,
        "#include <stdio.h>\nint ncclGetVersion(int*);\n\
         const char* anyccl_nccl_dropin_underlying(void) __attribute__((weak));\n\
         int main(void) { int v = -1; int rc = ncclGetVersion(&v);\n\
         printf(\"rc=%d version=%d dropin=%d\\n\", rc, v, anyccl_nccl_dropin_underlying != 0); return rc; }\n",
    )
    .expect("write starts.c");
    // Linked to the drop-in (by its SONAME, no run path): run where only the real library is.
    let linked = programs::dropin_as_linked();
    let to_dropin = dir.join("to_dropin");
    let mut l = std::ffi::OsString::from("-L");
    l.push(linked.parent().expect("folder"));
    cc(&to_dropin, std::slice::from_ref(&source), &[l, "-l:libnccl.so.2".into()]);
    assert_eq!(dynamic_names(&to_dropin, "NEEDED").iter().filter(|n| n.starts_with("libnccl")).count(), 1);
    assert!(dynamic_names(&to_dropin, "NEEDED").contains(&"libnccl.so.2".to_owned()));
    let out = run(&to_dropin, &dir, &[], &[("LD_LIBRARY_PATH", real_dir.clone().into_os_string())]);
    assert_eq!((out.code, out.stdout.trim()), (Some(0), format!("rc=0 version={code} dropin=0").as_str()), "{out:?}");
    // Linked to the real library: run where the drop-in is installed as libnccl.so.2 (forwarding to the real one).
    let to_real = dir.join("to_real");
    let mut l = std::ffi::OsString::from("-L");
    l.push(&real_dir);
    cc(&to_real, std::slice::from_ref(&source), &[l, "-l:libnccl.so.2".into()]);
    assert!(dynamic_names(&to_real, "NEEDED").contains(&"libnccl.so.2".to_owned()));
    let env = [
        ("LD_LIBRARY_PATH", linked.parent().expect("folder").as_os_str().to_owned()),
        ("ANYCCL_NCCL_PATH", real_dir.join("libnccl.so.2").into_os_string()),
    ];
    let out = run(&to_real, &dir, &[], &env);
    assert_eq!((out.code, out.stdout.trim()), (Some(0), format!("rc=0 version={code} dropin=1").as_str()), "{out:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "needs the drop-in built for glibc 2.28: ANYCCL_TEST_DROPIN_GLIBC_2_28 (see the file's documentation)"]
fn the_drop_in_built_for_glibc_2_28_is_named_and_versioned_like_libnccl() {
    let built = PathBuf::from(required_env("ANYCCL_TEST_DROPIN_GLIBC_2_28"));
    assert_eq!(dynamic_names(&built, "SONAME"), ["libnccl.so.2"], "{}", built.display());
    let highest = highest_glibc(&built).expect("the drop-in needs some GLIBC_ version");
    assert!(
        highest <= vec![2, 28],
        "{} needs GLIBC_{:?}, above 2.28 (the real NCCL 2.32.3 needs at most 2.27)",
        built.display(),
        highest
    );
    // The library cargo built for these tests has the same SONAME (its glibc floor is the build machine's).
    assert_eq!(dynamic_names(&programs::dropin_so(), "SONAME"), ["libnccl.so.2"]);
}

/// The `nccl*` and `pnccl*` functions `nm -D --defined-only` lists for `file` (weak or not), each once, sorted.
fn defined_functions(file: &Path) -> Vec<String> {
    let mut names: Vec<String> = tool("nm", &["-D".as_ref(), "--defined-only".as_ref(), file.as_os_str()])
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, kind, name) = (f.next()?, f.next()?, f.next()?);
            let name = name.split('@').next()?;
            (matches!(kind, "T" | "W" | "i") && (name.starts_with("nccl") || name.starts_with("pnccl")))
                .then(|| name.to_owned())
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

/// What the real library exports beyond its headers' declarations, each with why the drop-in leaves it out: a new
/// function cannot slip by unnamed.
const NOT_EXPORTED: &[(&str, &str)] = &[(
    "ncclResetDebugInitInternal",
    "internal: declared in no header and without a pncclResetDebugInitInternal alias",
)];

#[test]
#[ignore = "needs the real NCCL: ANYCCL_TEST_NCCL_SDK (see the file's documentation)"]
fn the_exports_match_the_real_library_and_its_headers() {
    let sdk = PathBuf::from(required_env("ANYCCL_TEST_NCCL_SDK"));
    let header_text = std::fs::read_to_string(sdk.join("include").join("nccl.h")).expect("nccl.h in the SDK folder");
    let host_text = std::fs::read_to_string(sdk.join("include").join("nccl_device").join("host.h"))
        .expect("nccl_device/host.h in the SDK folder");
    let real = defined_functions(&sdk.join("lib").join("libnccl.so.2"));
    let mine = defined_functions(&programs::dropin_so());
    // Every nccl*/pnccl* function the real library exports, the drop-in exports too, but the named exceptions...
    let missing: Vec<&String> =
        real.iter().filter(|n| !mine.contains(n) && !NOT_EXPORTED.iter().any(|(x, _)| x == n)).collect();
    assert!(missing.is_empty(), "exported by the real library but not by the drop-in: {missing:?}");
    // ...and nothing else.
    let extra: Vec<&String> = mine.iter().filter(|n| !real.contains(n)).collect();
    assert!(extra.is_empty(), "exported by the drop-in but not by the real library: {extra:?}");
    for (n, why) in NOT_EXPORTED {
        assert!(real.contains(&n.to_string()), "{n} ({why}) is no longer exported by the real library");
    }
    // Each is declared: by nccl.h (the snapshot, with its alias) or by nccl_device/host.h (the device snapshot).
    let mut declared = header::functions(&header_text);
    let host_declared = header::functions(&host_text);
    for n in header::device_snapshot() {
        assert!(host_declared.iter().any(|d| d == n), "nccl_device/host.h does not declare {n}");
        declared.push(n.to_owned());
        declared.push(format!("p{n}"));
    }
    declared.sort();
    assert_eq!(mine, declared, "the drop-in's exports and the headers' declarations (as the snapshots list) differ");
    println!(
        "real library: {} nccl*/pnccl* functions; drop-in: {}; not exported: {NOT_EXPORTED:?}",
        real.len(),
        mine.len()
    );
}
