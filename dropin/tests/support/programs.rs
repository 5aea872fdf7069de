//! Building and running the C test programs linked to the drop-in library built by this `cargo test`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use wait_timeout::ChildExt;

/// A program run that has not ended by then has hung (the real NCCL needs well under a second without a GPU).
pub const DEADLINE: Duration = Duration::from_secs(30);

/// `dropin/tests/c`.
pub fn c_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests").join("c")
}

/// The `libanyccl_nccl.so` cargo built for this test run: cargo builds the package's library (both its crate types)
/// before its tests, into the folder of the test binaries (`target/<profile>/deps`) and copies it one level up.
pub fn dropin_so() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("the test binary's folder");
    let candidates = [deps.join("libanyccl_nccl.so"), deps.join("..").join("libanyccl_nccl.so")];
    for c in &candidates {
        if c.is_file() {
            return c.canonicalize().expect("canonical path of the drop-in");
        }
    }
    panic!("the drop-in library was not built where cargo puts it: {candidates:?}");
}

/// The drop-in as programs link to it: `libnccl.so.2` (its SONAME) in a folder of this test process's own, a
/// symbolic link to [`dropin_so`]. A program linked to the drop-in records `libnccl.so.2` whatever file name it was
/// linked by, so the dynamic loader looks for that name at run time.
pub fn dropin_as_linked() -> PathBuf {
    static LINKED: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    LINKED
        .get_or_init(|| {
            let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("dropin-{}-soname", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("soname folder");
            let link = dir.join("libnccl.so.2");
            std::os::unix::fs::symlink(dropin_so(), &link).expect("link libnccl.so.2 to the drop-in");
            link
        })
        .clone()
}

/// The arguments that link a program to the drop-in (as `-lnccl` would, by its SONAME) and find it at run time.
pub fn link_to_dropin() -> Vec<OsString> {
    let linked = dropin_as_linked();
    link_to(linked.parent().expect("folder"), "libnccl.so.2")
}

/// A fresh folder for one test under cargo's per-target temporary folder (removed first).
pub fn case_dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("dropin-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("case folder");
    d
}

/// Compiles `sources` (with `args` after them) into the executable `out` with the system C compiler.
pub fn cc(out: &Path, sources: &[PathBuf], args: &[OsString]) {
    let st = Command::new(std::env::var_os("CC").unwrap_or_else(|| "cc".into()))
        .args(["-std=gnu11", "-O1", "-Wall", "-Werror", "-o"])
        .arg(out)
        .args(sources)
        .args(args)
        .status()
        .expect("the system C compiler (cc) runs");
    assert!(st.success(), "cc failed for {}", out.display());
}

/// The arguments that link a program to the library `file` in `dir` by that file name (`DT_NEEDED` is the name, as
/// for `-lnccl`), found at run time through the run path `dir`.
pub fn link_to(dir: &Path, file: &str) -> Vec<OsString> {
    let mut l = OsString::from("-L");
    l.push(dir);
    let mut rpath = OsString::from("-Wl,-rpath,");
    rpath.push(dir);
    vec![l, format!("-l:{file}").into(), rpath, "-ldl".into()]
}

/// What a program printed.
#[derive(Debug)]
pub struct Output {
    /// Exit status (`None`: killed by a signal).
    pub code: Option<i32>,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

/// Runs `program` with `args` in the folder `dir` (which keeps its output files), in an empty environment but `env`,
/// within [`DEADLINE`].
pub fn run(program: &Path, dir: &Path, args: &[&str], env: &[(&str, OsString)]) -> Output {
    let (out_path, err_path) = (dir.join("stdout.txt"), dir.join("stderr.txt"));
    let mut child = Command::new(program)
        .args(args)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).expect("stdout file"))
        .stderr(std::fs::File::create(&err_path).expect("stderr file"))
        .spawn()
        .expect("start the test program");
    let status = match child.wait_timeout(DEADLINE).expect("wait") {
        Some(s) => s,
        None => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{} did not finish within {DEADLINE:?}", program.display());
        }
    };
    Output {
        code: status.code(),
        stdout: std::fs::read_to_string(&out_path).unwrap_or_default(),
        stderr: std::fs::read_to_string(&err_path).unwrap_or_default(),
    }
}
