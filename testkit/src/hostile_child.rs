//! Shared pieces of the hostile library-search tests (docs/security.md): planted folders and libraries, FIFOs, and a
//! child run of the including test binary's own `child` test in a planted working directory, with a cleared
//! environment and a deadline, so a hang or a crash fails the case instead of hanging or killing the test run.
//! Used by `backends/ccl/tests/hostile.rs` and `backends/rocm/tests/hostile.rs`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Printed by the constructor of every planted library: it must never appear.
pub const PLANTED: &str = "PLANTED-CONSTRUCTOR-RAN";
/// A child or call that has not finished by then is taken as hung.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// A C snippet whose constructor writes [`PLANTED`] to stdout when the library is loaded.
pub fn planted_constructor_c() -> String {
    format!(
        "#include <unistd.h>\n__attribute__((constructor)) static void anyccl_planted(void) {{ \
         static const char m[] = \"{PLANTED}\\n\"; (void)!write(1, m, sizeof m - 1); }}\n"
    )
}

/// A fresh folder for one case (absolute; under the target dir, named after the test binary, removed first).
pub fn case_dir(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let stem = exe.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    // The test binary's name without cargo's `-<hash>` suffix.
    let binary = stem.rsplit_once('-').map_or(stem.as_str(), |(name, _)| name).to_owned();
    let d = crate::scratch_dir().join(format!("hostile-{binary}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("case dir");
    d
}

/// A FIFO at `p` (its folder created first).
pub fn mkfifo(p: &Path) {
    std::fs::create_dir_all(p.parent().expect("parent")).expect("dir");
    nix::unistd::mkfifo(p, nix::sys::stat::Mode::from_bits_truncate(0o644)).expect("mkfifo");
}

/// Copies `from` to `dir/rel`.
pub fn plant(from: &Path, dir: &Path, rel: &str) -> PathBuf {
    let to = dir.join(rel);
    std::fs::create_dir_all(to.parent().expect("parent")).expect("dir");
    std::fs::copy(from, &to).expect("copy");
    to
}

/// An environment value.
pub fn os(s: impl Into<OsString>) -> OsString {
    s.into()
}

/// How a child run of one case ended.
#[derive(Debug)]
pub struct Outcome {
    /// The case it ran (`ANYCCL_HOSTILE_CASE`).
    pub case: String,
    /// How it ended.
    pub end: End,
}

/// How a child process ended.
#[derive(Debug)]
pub enum End {
    /// It exited; its stdout.
    Exited { code: Option<i32>, stdout: String },
    /// A signal killed it (a crash).
    Crashed { signal: i32, stdout: String },
    /// Still running at the deadline (killed then).
    Hung,
}

impl Outcome {
    /// The `RESULT` line the child printed, after checking that it ended cleanly in time and that no planted
    /// constructor ran.
    pub fn result(&self) -> String {
        let case = &self.case;
        match &self.end {
            End::Exited { code: Some(0), stdout } => {
                assert!(!stdout.contains(PLANTED), "case {case}: a planted library's constructor ran:\n{stdout}");
                stdout
                    .lines()
                    .find_map(|l| l.strip_prefix("RESULT "))
                    .unwrap_or_else(|| panic!("case {case}: no RESULT line:\n{stdout}"))
                    .to_owned()
            }
            End::Crashed { signal, stdout } => panic!("case {case}: the child crashed with signal {signal}:\n{stdout}"),
            End::Exited { code, stdout } => panic!("case {case}: the child failed ({code:?}):\n{stdout}"),
            End::Hung => panic!("case {case}: the child still ran after {DEADLINE:?}: a hang"),
        }
    }
}

/// Runs this test binary's `child` test in `cwd` with only `ANYCCL_HOSTILE_CASE=case` and `env` set, and waits at
/// most [`DEADLINE`] (killing it then).
pub fn run_child(case: &str, cwd: &Path, env: &[(&str, OsString)]) -> Outcome {
    let mut cmd = Command::new(std::env::current_exe().expect("test binary"));
    cmd.args(["child", "--exact", "--ignored", "--nocapture", "--test-threads=1", "-q"])
        .current_dir(cwd)
        .env_clear()
        .env("ANYCCL_HOSTILE_CASE", case)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn the child");
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break Some(st);
        }
        if start.elapsed() > DEADLINE {
            break None;
        }
        // Polling the child's exit: std has no wait with a deadline.
        std::thread::sleep(Duration::from_millis(20));
    };
    let case = case.to_owned();
    let Some(status) = status else {
        child.kill().expect("kill the hung child");
        let _ = child.wait();
        return Outcome { case, end: End::Hung };
    };
    let mut stdout = String::new();
    if let Some(mut out) = child.stdout.take() {
        use std::io::Read;
        out.read_to_string(&mut stdout).expect("read stdout");
    }
    use std::os::unix::process::ExitStatusExt;
    let end = match status.signal() {
        Some(signal) => End::Crashed { signal, stdout },
        None => End::Exited { code: status.code(), stdout },
    };
    Outcome { case, end }
}

/// Not from the working directory: `r` (a `RESULT` line) says a library was loaded from an absolute place
/// outside `cwd` (a real one on this machine), or that none was.
pub fn nothing_from(r: &str, cwd: &Path) {
    if let Some(rest) = r.strip_prefix("ok ") {
        let path = rest.split("; tried:").next().unwrap_or(rest);
        assert!(path.starts_with('/') && !Path::new(path).starts_with(cwd), "loaded from the working directory: {r}");
    } else {
        assert!(r.starts_with("err "), "{r}");
    }
}

/// Runs `f` on its own thread and waits at most [`DEADLINE`] for it: a hang fails the test instead of hanging it.
pub fn bounded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(DEADLINE) {
        Ok(v) => v,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("still running after {DEADLINE:?}: a hang"),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("the checked call panicked"),
    }
}

/// Drops, on the calling thread only, the capabilities that let root read any file (Linux capabilities are per
/// thread); a no-op for a user who lacks them. The tests run as root in CI, and root reads anything.
pub fn lose_root_read_override() {
    use caps::{CapSet, Capability};
    for cap in [Capability::CAP_DAC_OVERRIDE, Capability::CAP_DAC_READ_SEARCH] {
        if caps::has_cap(None, CapSet::Effective, cap).expect("capget") {
            caps::drop(None, CapSet::Effective, cap).expect("drop a capability from this thread");
        }
    }
}

/// The child half's report, read back by [`Outcome::result`]: `RESULT ok PATH; tried: …` when a library at
/// `loaded` was loaded, else `RESULT err tried: …` (`tried`: every place that failed or was skipped, with its reason).
pub fn print_result(loaded: Option<&Path>, tried: &str) {
    match loaded {
        Some(path) => println!("RESULT ok {}; tried: {tried}", path.display()),
        None => println!("RESULT err tried: {tried}"),
    }
}
