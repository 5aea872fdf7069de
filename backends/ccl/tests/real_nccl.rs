//! Real NCCL from the PyPI wheels (installed by `ci/install-nccl.sh`, which `ci/test.sh` runs): the loader must
//! decode each version, agree with `nm -D` about every symbol it probes, and create a unique id, with no GPU.
//!
//! Ignored in a plain `cargo test` because it needs the wheels (hundreds of MB); `ci/test.sh` runs it with
//! `--ignored` and `ANYCCL_TEST_REAL_NCCL="VERSION=PATH:…"`. Run that way without the variable, it fails.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use anyccl_ccl::loader::{OPTIONAL_SYMBOLS, REQUIRED_SYMBOLS};
use anyccl_ccl::{derive_capabilities, CclComm, CclLibrary, CclVendor, UniqueId};
use anyccl_core::{Capabilities, Error};

fn real_libraries() -> Vec<(String, String)> {
    let v = std::env::var("ANYCCL_TEST_REAL_NCCL")
        .expect("ANYCCL_TEST_REAL_NCCL is not set: run ci/install-nccl.sh and pass its output (ci/test.sh does)");
    let pairs: Vec<(String, String)> = v
        .split(':')
        .filter(|s| !s.is_empty())
        .map(|p| {
            let (ver, path) = p.split_once('=').expect("VERSION=PATH");
            (ver.to_owned(), path.to_owned())
        })
        .collect();
    assert!(pairs.len() >= 2, "need at least two real NCCL releases, got {pairs:?}");
    pairs
}

fn exported(path: &str) -> BTreeSet<String> {
    let out = Command::new("nm").args(["-D", "--defined-only", path]).output().expect("nm (binutils) runs");
    assert!(out.status.success(), "nm failed on {path}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .map(|s| s.split('@').next().unwrap_or(s).to_owned())
        .collect()
}

#[test]
#[ignore = "needs real libnccl.so.2 files: ci/test.sh installs them and runs this with --ignored"]
fn real_nccl_versions_symbols_and_unique_ids() {
    let libs = real_libraries();
    let mut saw_old = false;
    let mut saw_windows = false;
    for (version, path) in libs {
        let lib = Arc::new(CclLibrary::open(Path::new(&path)).unwrap_or_else(|e| panic!("{path}: {e}")));
        assert_eq!(lib.vendor(), CclVendor::Nccl, "{path}");
        assert_eq!(lib.version().to_string(), version, "{path}: decoded version");
        assert_eq!(lib.path(), Path::new(&path).canonicalize().expect("exists").as_path());

        let nm = exported(&path);
        for sym in REQUIRED_SYMBOLS.iter().chain(OPTIONAL_SYMBOLS) {
            assert_eq!(lib.table().has(sym), nm.contains(*sym), "{sym} in {version}: table vs nm -D");
        }
        let caps = derive_capabilities(&lib, &|_| None);
        let pairs = [
            (Capabilities::COMM_SPLIT, "ncclCommSplit"),
            (Capabilities::BUFFER_REGISTRATION, "ncclCommRegister"),
            (Capabilities::CCL_MEM_ALLOC, "ncclMemAlloc"),
            (Capabilities::SYMMETRIC_WINDOWS, "ncclCommWindowRegister"),
            (Capabilities::COMM_SHRINK, "ncclCommShrink"),
            (Capabilities::DEVICE_API, "ncclDevCommCreate"),
            (Capabilities::LAST_ERROR, "ncclGetLastError"),
            (Capabilities::PER_CALL_CONFIG, "ncclAllReduceConfig"),
            (Capabilities::SYMMETRIC_KERNELS, "ncclCommWindowRegister"),
        ];
        for (cap, sym) in pairs {
            assert_eq!(caps.has(cap), nm.contains(sym), "{cap:?} of {version} vs nm -D {sym}");
        }
        // Windows during graph capture: from 2.30.7 on (2.32.3 has it), never without windows.
        let in_capture = caps.has(Capabilities::SYMMETRIC_WINDOWS) && lib.version().at_least_patch(2, 30, 7);
        assert_eq!(caps.has(Capabilities::WINDOWS_IN_CAPTURE), in_capture, "windows-in-capture of {version}");
        saw_old |= !nm.contains("ncclCommWindowRegister");
        saw_windows |= caps.has(Capabilities::SYMMETRIC_WINDOWS);
        if !caps.has(Capabilities::SYMMETRIC_WINDOWS) {
            let reason = caps.require(Capabilities::SYMMETRIC_WINDOWS).expect_err("off").to_string();
            assert!(reason.contains(&format!("(NCCL {version}) does not export ncclCommWindowRegister")), "{reason}");
        }

        let id = UniqueId::new(&lib).expect("ncclGetUniqueId works without a GPU");
        assert!(id.as_bytes().iter().any(|b| *b != 0), "the id has content");
        assert_ne!(UniqueId::new(&lib).expect("second id"), id, "ids are unique");

        // Without a GPU, joining a communicator fails with NCCL's own words, not a crash.
        let no_gpu = !Path::new("/dev/nvidia0").exists();
        match CclComm::init_rank(lib.clone(), 1, &id, 0) {
            Err(Error::Backend { backend, call, code, message }) => {
                assert_eq!((backend.as_str(), call.as_str()), ("nccl", "ncclCommInitRank"));
                assert!(code.is_some_and(|c| c != 0) && !message.is_empty(), "{message}");
            }
            Err(other) => panic!("unexpected error kind: {other:?}"),
            Ok(comm) => {
                assert!(!no_gpu, "a communicator cannot exist without a GPU");
                assert_eq!(comm.count().ok(), Some(1));
            }
        }
    }
    assert!(saw_old && saw_windows, "cover a release without windows and one with");
}
