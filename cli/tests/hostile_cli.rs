//! The `anyccl` command against hostile input: every bad flag, environment variable and file in the table below
//! must give a non-zero exit and one clean line (`error: …` naming the culprit, at most one `hint: …` after it),
//! with no panic, no signal, within [`LIMIT`] and under an address-space limit ([`MEMORY`] unless the case sets
//! its own). A few inputs must instead be accepted (an invalid `ANYCCL_LOG` warns once and runs).
//!
//! Every case runs even when an earlier one fails; the test then prints a table per input class (attempts, clean
//! errors, panics, hangs, crashes) and fails listing each broken case. `ANYCCL_HOSTILE_BIN=/path/to/anyccl` runs
//! the same table against another build (how the before/after numbers of docs/security.md were taken).
#![cfg(unix)]

use std::ffi::{OsStr, OsString};
use std::fmt::Write as _;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use wait_timeout::ChildExt;

/// Every case must finish within this; it is killed after it.
const LIMIT: Duration = Duration::from_secs(20);
/// The address-space limit (RLIMIT_AS) of every case, in bytes.
const MEMORY: u64 = 4_000_000_000;
/// The most output read from each stream (more is a failure in itself).
const MAX_OUTPUT: u64 = 16 << 20;

fn bin() -> OsString {
    std::env::var_os("ANYCCL_HOSTILE_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_anyccl").into())
}

/// Limits the child's address space to `bytes` (or its hard limit, if lower).
fn limit_memory(c: &mut Command, bytes: u64) {
    // SAFETY: between fork and exec the closure only calls getrlimit and setrlimit, which are async-signal-safe,
    // on a struct it owns; it allocates nothing and takes no lock.
    unsafe {
        c.pre_exec(move || {
            let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            if libc::getrlimit(libc::RLIMIT_AS, &mut lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let want = (bytes as libc::rlim_t).min(lim.rlim_max);
            lim.rlim_cur = want;
            lim.rlim_max = want;
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

struct Outcome {
    code: Option<i32>,
    signal: Option<i32>,
    stdout: String,
    stderr: String,
    took: Duration,
    timed_out: bool,
}

fn run(args: &[OsString], env: &[(&str, OsString)], memory: u64) -> Outcome {
    let mut c = Command::new(bin());
    c.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    for var in
        ["ANYCCL_TUNE_FILE", "ANYCCL_ALLREDUCE_ALGO", "ANYCCL_DISABLE", "ANYCCL_LOG", "RUST_BACKTRACE", "RUST_LOG"]
    {
        c.env_remove(var);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    limit_memory(&mut c, memory);
    let start = Instant::now();
    let mut child = c.spawn().expect("the anyccl binary starts");
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(r) = r {
                let _ = r.take(MAX_OUTPUT).read_to_end(&mut buf);
            }
            String::from_utf8_lossy(&buf).into_owned()
        })
    };
    let out = drain(child.stdout.take().map(|s| Box::new(s) as Box<dyn Read + Send>));
    let err = drain(child.stderr.take().map(|s| Box::new(s) as Box<dyn Read + Send>));
    let (status, timed_out) = match child.wait_timeout(LIMIT).expect("wait") {
        Some(st) => (st, false),
        None => {
            let _ = child.kill();
            (child.wait().expect("wait after kill"), true)
        }
    };
    let took = start.elapsed();
    Outcome {
        code: status.code(),
        signal: status.signal(),
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
        took,
        timed_out,
    }
}

/// What a case must produce.
enum Expect {
    /// A clean failure whose first stderr line names `needle`; the hint (if `Some`) must contain the first and
    /// not the second string.
    Error { needle: String, hint_has: Option<&'static str>, hint_lacks: Option<&'static str> },
    /// Success, with `check` on the outcome.
    Accept(fn(&Outcome) -> Result<(), String>),
}

struct Case {
    class: &'static str,
    name: String,
    args: Vec<OsString>,
    env: Vec<(&'static str, OsString)>,
    memory: u64,
    expect: Expect,
    /// A file that must be unchanged after the run (an existing `--out` or `--plot` target).
    keeps: Option<PathBuf>,
}

fn os(s: impl AsRef<OsStr>) -> OsString {
    s.as_ref().to_owned()
}

fn fail(class: &'static str, args: &[&str], needle: &str) -> Case {
    Case {
        class,
        name: args.join(" "),
        args: args.iter().map(os).collect(),
        env: Vec::new(),
        memory: MEMORY,
        expect: Expect::Error { needle: needle.to_owned(), hint_has: None, hint_lacks: None },
        keeps: None,
    }
}

impl Case {
    fn env(mut self, k: &'static str, v: impl AsRef<OsStr>) -> Self {
        self.name = format!("{k}={} {}", v.as_ref().to_string_lossy(), self.name);
        self.env.push((k, os(v)));
        self
    }

    fn arg_os(mut self, v: impl AsRef<OsStr>) -> Self {
        self.name = format!("{} {}", self.name, v.as_ref().to_string_lossy());
        self.args.push(os(v));
        self
    }

    fn hint(mut self, has: &'static str, lacks: &'static str) -> Self {
        if let Expect::Error { hint_has, hint_lacks, .. } = &mut self.expect {
            *hint_has = Some(has);
            *hint_lacks = Some(lacks);
        }
        self
    }

    fn memory(mut self, bytes: u64) -> Self {
        self.memory = bytes;
        self
    }

    fn keeps(mut self, file: PathBuf) -> Self {
        self.keeps = Some(file);
        self
    }

    /// Why the outcome breaks the rules, if it does; `kind` sorts it into panic / hang / crash / unclean.
    fn judge(&self, o: &Outcome) -> Result<(), (&'static str, String)> {
        if o.timed_out || o.took >= LIMIT {
            return Err(("hang", format!("still running after {:?}", o.took)));
        }
        // An abort (SIGABRT after "memory allocation of … failed") is a crash even though it prints a backtrace.
        if let Some(sig) = o.signal {
            return Err(("crash", format!("killed by signal {sig}: {}", o.stderr)));
        }
        if o.stderr.contains("memory allocation of") {
            return Err(("crash", o.stderr.clone()));
        }
        if o.stderr.contains("panicked") || o.stderr.contains("RUST_BACKTRACE") {
            return Err(("panic", o.stderr.clone()));
        }
        match &self.expect {
            Expect::Accept(check) => match o.code {
                Some(0) => check(o).map_err(|e| ("unclean", e)),
                other => Err(("unclean", format!("exit {other:?}, expected success: {}", o.stderr))),
            },
            Expect::Error { needle, hint_has, hint_lacks } => {
                if o.code == Some(0) || o.code.is_none() {
                    return Err(("unclean", format!("exit {:?}, expected a failure; stderr: {}", o.code, o.stderr)));
                }
                let lines: Vec<&str> = o.stderr.lines().collect();
                let first = lines.first().copied().unwrap_or("");
                if !first.starts_with("error: ") || !first.contains(needle.as_str()) || first.len() > 1000 {
                    return Err((
                        "unclean",
                        format!("first stderr line should be `error: …{needle}…`: {:?}", o.stderr),
                    ));
                }
                if lines.len() > 2 || lines.get(1).is_some_and(|l| !l.starts_with("hint: ")) {
                    return Err(("unclean", format!("one error line and at most one hint: {:?}", o.stderr)));
                }
                let hint = lines.get(1).copied().unwrap_or("");
                if hint_has.is_some_and(|h| !hint.contains(h)) || hint_lacks.is_some_and(|h| hint.contains(h)) {
                    return Err(("unclean", format!("hint should name {hint_has:?}, not {hint_lacks:?}: {hint:?}")));
                }
                Ok(())
            }
        }
    }
}

/// Files the cases point at, in a fresh directory.
struct Fixtures {
    dir: PathBuf,
}

impl Fixtures {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("anyccl-hostile-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("a-directory")).expect("fixture dir");
        let f = Fixtures { dir };
        let st = Command::new("mkfifo").arg(f.path("fifo")).status().expect("mkfifo runs");
        assert!(st.success(), "mkfifo");
        std::os::unix::fs::symlink(f.path("fifo"), f.path("link-to-fifo")).expect("symlink");
        std::os::unix::fs::symlink(f.path("nowhere"), f.path("dangling")).expect("symlink");
        // 100 MB on paper, nothing on disk.
        std::fs::File::create(f.path("100MB.toml")).and_then(|h| h.set_len(100_000_000)).expect("sparse file");
        std::fs::write(f.path("latin1.toml"), b"# caf\xe9\n").expect("write");
        let overlap = "[[rule]]\nbytes = \"0-1MiB\"\nalgorithms = [\"ring\"]\n[[rule]]\nbytes = \"4KiB-\"\nalgorithms = [\"ring\"]\n";
        std::fs::write(f.path("overlap.toml"), overlap).expect("write");
        std::fs::write(f.path("bad\nname.toml"), overlap).expect("write");
        std::fs::write(f.path("unreadable.toml"), overlap).expect("write");
        std::fs::set_permissions(f.path("unreadable.toml"), std::os::unix::fs::PermissionsExt::from_mode(0o000))
            .expect("chmod");
        std::fs::write(f.path("binary.toml"), [0u8, 159, 146, 150, 255, 0, 1, 2]).expect("write");
        // 30 000 disjoint rules, under the 4 MiB cap: accepted, and fast.
        let mut many = String::new();
        for i in 0..30_000u64 {
            let _ = writeln!(
                many,
                "[[rule]]\nvendor = \"host\"\nbytes = \"{}-{}\"\nalgorithms = [\"ring\"]",
                i * 16,
                i * 16 + 16
            );
        }
        std::fs::write(f.path("30k-rules.toml"), many).expect("write");
        // Just under the 4 MiB cap: deep nesting (the TOML parser has a recursion limit), one huge string, and
        // 100 000 small rules apart by world.
        let deep = format!("x = {}{}\n", "[".repeat(1_000_000), "]".repeat(1_000_000));
        std::fs::write(f.path("deep-arrays.toml"), deep).expect("write");
        let deep = format!("x = {}1{}\n", "{a=".repeat(300_000), "}".repeat(300_000));
        std::fs::write(f.path("deep-tables.toml"), deep).expect("write");
        std::fs::write(f.path("open-array.toml"), format!("[[rule]]\nalgorithms = {}\n", "[".repeat(100_000)))
            .expect("write");
        let huge = format!("[[rule]]\nvendor = \"{}\"\nalgorithms = [\"ring\"]\n", "a".repeat(4_000_000));
        std::fs::write(f.path("huge-string.toml"), huge).expect("write");
        let mut small = String::new();
        for i in 1..=100_000u64 {
            let _ = writeln!(small, "[[rule]]\nworld={i}\nalgorithms=[\"ring\"]");
        }
        assert!(small.len() < 4 << 20, "{} bytes", small.len());
        std::fs::write(f.path("100k-rules.toml"), small).expect("write");
        f
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn s(&self, name: &str) -> String {
        self.path(name).to_string_lossy().into_owned()
    }
}

impl Drop for Fixtures {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn cases(f: &Fixtures) -> Vec<Case> {
    let bench = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = vec!["bench".into()];
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let b = |class, extra: &[&str], needle: &str| {
        let args = bench(extra);
        fail(class, &args.iter().map(String::as_str).collect::<Vec<_>>(), needle)
    };
    let out = f.s("tuned.toml");
    let many_sizes = vec!["4KiB"; 65].join(",");
    let long_number = "9".repeat(10_000);
    let mut v = vec![
        // Sizes.
        b("size flags", &["--sizes", "9223372036854775808"], "--sizes"),
        b("size flags", &["--sizes", "18446744073709551616"], "18446744073709551616"),
        b("size flags", &["--sizes", "18446744073709551615"], "--sizes"),
        b("size flags", &["--sizes", "100GiB"], "--sizes"),
        b("size flags", &["--sizes", "17179869184GiB"], "17179869184GiB"),
        b("size flags", &["--world", "8", "--sizes", "1GiB"], "--sizes"),
        b("size flags", &["--world", "64", "--sizes", "64MiB"], "--sizes"),
        b("size flags", &["--sizes", "0"], "--sizes"),
        b("size flags", &["--sizes", "-4"], "-4"),
        b("size flags", &["--sizes", ""], "--sizes"),
        b("size flags", &["--sizes", ","], "--sizes"),
        b("size flags", &["--sizes", "４KiB"], "４KiB"),
        b("size flags", &["--sizes", "1.5B"], "1.5B"),
        b("size flags", &["--sizes", "1e9"], "1e9"),
        b("size flags", &["--sizes", "NaN"], "NaN"),
        b("size flags", &["--sizes", "3", "--dtype", "f32"], "--sizes"),
        b("size flags", &["--sizes", &many_sizes], "65 sizes"),
        b("size flags", &["--sizes", &long_number], "--sizes"),
        // nccl-tests' -b/-e/-f.
        b("size flags", &["-b", "1", "-e", "18446744073709551615"], "-b/-e/-f: 1 B is not a positive multiple"),
        b("size flags", &["-b", "2", "-e", "18446744073709551615"], "-b/-e/-f"),
        b("size flags", &["-b", "18446744073709551616", "-e", "1"], "18446744073709551616"),
        b("size flags", &["-b", "4KiB", "-e", "8KiB", "-f", "0"], "--stepfactor"),
        b("size flags", &["-b", "4KiB", "-e", "8KiB", "-f", "1025"], "--stepfactor"),
        b("size flags", &["-b", "4KiB", "-e", "8KiB", "-f", "99999999999999999999"], "--stepfactor"),
        b("size flags", &["-b", "8KiB", "-e", "4KiB"], "-b/--minbytes (8 KiB) is above -e/--maxbytes (4 KiB)"),
        b("size flags", &["-b", "0", "-e", "4KiB"], "-b/--minbytes"),
        b("size flags", &["-e", "4KiB"], "--minbytes"),
        b("size flags", &["--sizes", "4KiB", "-b", "4KiB", "-e", "4KiB"], "--sizes"),
        fail("size flags", &["tune", "-b", "4KiB", "-e", "4GiB", "--out", &out], "-b/-e/-f"),
        fail("size flags", &["tune", "--sizes", "4611686018427387904", "--out", &out], "--sizes"),
        fail("size flags", &["tune", "--sizes", "2GiB", "--world", "2", "--out", &out], "--sizes"),
        // Counts.
        b("count flags", &["--sizes", "4KiB", "--iters", "4294967295"], "--iters"),
        b("count flags", &["--sizes", "4KiB", "--iters", "4294967296"], "--iters"),
        b("count flags", &["--sizes", "4KiB", "--iters", "10001"], "--iters"),
        b("count flags", &["--sizes", "4KiB", "--iters", "0"], "--iters"),
        b("count flags", &["--sizes", "4KiB", "--iters", "-1"], "-1"),
        b("count flags", &["--sizes", "4KiB", "--iters", "1", "--warmup", "4294967295"], "--warmup"),
        b("count flags", &["--sizes", "4KiB", "--iters", "1", "--warmup", "10001"], "--warmup"),
        b("count flags", &["--sizes", "4KiB", "--iters", "²"], "--iters"),
        b("world", &["--world", "0"], "--world"),
        b("world", &["--world", "65"], "--world"),
        b("world", &["--world", "100000"], "--world"),
        b("world", &["--world", "18446744073709551617"], "--world"),
        b("world", &["--world", "-1"], "-1"),
        b("world", &["--world", ""], "--world"),
        // Names.
        b("names", &["--dtype", "f128"], "f128"),
        b("names", &["--dtype", "ｆ32"], "ｆ32"),
        b("names", &["--dtype", ""], "--dtype"),
        b("names", &["--op", "xor"], "xor"),
        b("names", &["--algos", "warp-drive"], "warp-drive"),
        b("names", &["--algos", ""], "--algos"),
        b("names", &["--algos", "ring,,ring"], "--algos"),
        b("names", &["--backend", "tpu"], "tpu"),
        b("names", &["--frobnicate"], "--frobnicate"),
        fail("names", &["tune", "--algos", "nvls-zero-copy", "--sizes", "4KiB", "--out", &out], "nvls-zero-copy"),
        fail("names", &["tune", "--algos", "nvls-zero-copy,ccl", "--sizes", "4KiB", "--out", &out], "not implemented"),
        // Output paths: refused before any sweep.
        b("output paths", &["--sizes", "4KiB", "--plot", "/nonexistent/dir/x.svg"], "/nonexistent/dir/x.svg"),
        b("output paths", &["--sizes", "4KiB", "--plot", "chart.png"], "PNG"),
        fail(
            "output paths",
            &["tune", "--sizes", "4KiB", "--out", "/nonexistent/dir/x.toml"],
            "/nonexistent/dir/x.toml",
        )
        .hint("--out", "ANYCCL_TUNE_FILE"),
        fail("output paths", &["tune", "--sizes", "4KiB", "--out", &f.s("a-directory")], "a directory"),
        fail("output paths", &["tune", "--sizes", "4KiB", "--out", &f.s("fifo")], "FIFO"),
        fail("output paths", &["tune", "--sizes", "4KiB", "--out", "/dev/null"], "/dev/null"),
    ];
    // Table files, by the variable and by --table.
    for (name, needle) in [
        ("/dev/urandom", "/dev/urandom"),
        ("/dev/zero", "/dev/zero"),
        ("/dev/stdin", "/dev/stdin"),
        ("/proc/self/mem", "/proc/self/mem"),
        (&*f.s("fifo"), "FIFO"),
        (&*f.s("link-to-fifo"), "link-to-fifo"),
        (&*f.s("dangling"), "dangling"),
        (&*f.s("a-directory"), "a directory"),
        (&*f.s("100MB.toml"), "limited to 4 MiB"),
        (&*f.s("latin1.toml"), "not UTF-8"),
        (&*f.s("binary.toml"), "binary.toml"),
        (&*f.s("overlap.toml"), "overlap.toml:6"),
        (&*f.s("missing.toml"), "missing.toml"),
        (&*f.s("deep-arrays.toml"), "deep-arrays.toml:1"),
        (&*f.s("deep-tables.toml"), "deep-tables.toml:1"),
        (&*f.s("open-array.toml"), "open-array.toml:2"),
        (&*f.s("huge-string.toml"), "huge-string.toml:2"),
    ] {
        v.push(
            fail("table files", &["probe"], needle).env("ANYCCL_TUNE_FILE", name).hint("ANYCCL_TUNE_FILE", "--table"),
        );
        v.push(
            fail("table files", &["bench", "--sizes", "4KiB", "--iters", "1", "--table", name], needle)
                .hint("--table", "ANYCCL_TUNE_FILE"),
        );
    }
    // Root reads a mode-000 file anyway (permission checks do not apply to it), so the case expects the file's
    // own error then, and "Permission denied" otherwise: a clean error naming the file either way.
    let unreadable_needle = if running_as_root() { "unreadable.toml:6" } else { "Permission denied" };
    v.push(fail("table files", &["probe"], unreadable_needle).env("ANYCCL_TUNE_FILE", f.path("unreadable.toml")));
    // A file name with a newline: the error still fits on one line (the newline is escaped).
    v.push(fail("table files", &["probe", "--table"], "bad\\nname.toml").arg_os(f.path("bad\nname.toml")));
    // Environment variables.
    v.extend([
        fail("environment", &["bench", "--sizes", "4KiB", "--iters", "1"], "ANYCCL_ALLREDUCE_ALGO")
            .env("ANYCCL_ALLREDUCE_ALGO", "fastest-please")
            .hint("ANYCCL_ALLREDUCE_ALGO", "ANYCCL_TUNE_FILE"),
        fail("environment", &["bench", "--sizes", "4KiB", "--iters", "1"], "ANYCCL_ALLREDUCE_ALGO")
            .env("ANYCCL_ALLREDUCE_ALGO", OsStr::from_bytes(b"ring\xff"))
            .hint("ANYCCL_ALLREDUCE_ALGO", "ANYCCL_TUNE_FILE"),
        fail("environment", &["bench", "--sizes", "4KiB", "--iters", "1"], "nvls-zero-copy")
            .env("ANYCCL_ALLREDUCE_ALGO", "nvls-zero-copy"),
        fail("environment", &["bench", "--sizes", "4KiB", "--iters", "1"], "ANYCCL_DISABLE")
            .env("ANYCCL_DISABLE", "host-backend")
            .hint("ANYCCL_DISABLE", "ANYCCL_TUNE_FILE"),
        fail("environment", &["tune", "--sizes", "4KiB", "--iters", "1", "--out", &out], "ANYCCL_DISABLE")
            .env("ANYCCL_DISABLE", "host-backend"),
        fail("environment", &["bench", "--sizes", "4KiB", "--iters", "1"], "bogus")
            .env("ANYCCL_DISABLE", "bogus")
            .hint("ANYCCL_DISABLE", "ANYCCL_TUNE_FILE"),
        fail("environment", &["bench", "--sizes", "4KiB", "--iters", "1"], "ANYCCL_DISABLE")
            .env("ANYCCL_DISABLE", OsStr::from_bytes(b"\xfe")),
        fail("environment", &["probe"], "missing").env("ANYCCL_TUNE_FILE", f.path("missing")),
    ]);
    // A `--per-rank` rank with a broken launcher environment: refused before any network or memory use.
    let per_rank = ["bench", "--per-rank", "--sizes", "4KiB", "--iters", "1"];
    let launcher = |class, needle: &str, vars: &[(&str, &str)]| {
        let mut c = fail(class, &per_rank, needle).hint("torchrun", "ANYCCL_TUNE_FILE");
        for (k, v) in [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")] {
            let v = vars.iter().find(|(n, _)| *n == k).map_or(v, |(_, v)| *v);
            c = c.env(k, v);
        }
        c
    };
    v.extend([
        launcher("per-rank", "WORLD_SIZE", &[("WORLD_SIZE", "99999999999999999999")]),
        launcher("per-rank", "WORLD_SIZE", &[("WORLD_SIZE", "0")]),
        launcher("per-rank", "RANK", &[("RANK", "5")]),
        launcher("per-rank", "RANK", &[("RANK", "-1")]),
        launcher("per-rank", "MASTER_ADDR", &[("MASTER_ADDR", "")]),
        launcher("per-rank", "MASTER_PORT", &[("MASTER_PORT", "65536")]),
        // Off loopback, the job's key is required (anyone reaching the port could join otherwise).
        fail("per-rank", &per_rank, "ANYCCL_RENDEZVOUS_KEY")
            .env("RANK", "0")
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "192.0.2.1")
            .env("MASTER_PORT", "29500"),
        fail("per-rank", &["tune", "--per-rank", "--out", &out], "--per-rank"),
    ]);
    // Memory: within the caps, but more than this process may have; a typed error, not an abort.
    v.push(
        b(
            "memory",
            &["--world", "2", "--sizes", "1GiB", "--algos", "ring", "--iters", "1", "--warmup", "0"],
            "out of memory",
        )
        .memory(1_500_000_000),
    );
    v.push(
        b(
            "memory",
            &["--world", "1", "--sizes", "1GiB", "--algos", "ring", "--iters", "1", "--warmup", "0"],
            "out of memory",
        )
        .memory(1_000_000_000),
    );
    v.push(
        fail(
            "memory",
            &["tune", "--world", "2", "--sizes", "512MiB", "--iters", "1", "--warmup", "0", "--out", &out],
            "out of memory",
        )
        .memory(1_000_000_000),
    );
    // Data: an existing output file survives a run that fails, before or during the sweep.
    let keep = f.s("existing.toml");
    let keep_svg = f.s("existing.svg");
    let sweep_oom = ["--world", "2", "--sizes", "512MiB", "--iters", "1", "--warmup", "0"];
    v.extend([
        fail("data", &["tune", "--sizes", "2GiB", "--out", &keep], "--sizes").keeps(f.path("existing.toml")),
        fail("data", &["tune", "--algos", "nvls-zero-copy", "--out", &keep], "nvls-zero-copy")
            .keeps(f.path("existing.toml")),
        fail("data", &[&["tune", "--out", &keep][..], &sweep_oom[..]].concat(), "out of memory")
            .memory(1_000_000_000)
            .keeps(f.path("existing.toml")),
        fail("data", &[&["bench", "--plot", &keep_svg][..], &sweep_oom[..]].concat(), "out of memory")
            .memory(1_000_000_000)
            .keeps(f.path("existing.svg")),
        fail("data", &["tune", "--sizes", "4KiB", "--out", &keep], "existing.toml")
            .env("ANYCCL_TUNE_FILE", f.path("existing.toml"))
            .keeps(f.path("existing.toml")),
        fail("data", &["tune", "--sizes", "4KiB", "--out", ""], "--out"),
    ]);
    // Accepted: an invalid ANYCCL_LOG warns once and runs; an empty table variable is ignored; a large valid
    // table is read quickly.
    let mut accept =
        |class, args: &[&str], env: (&'static str, OsString), check: fn(&Outcome) -> Result<(), String>| {
            v.push(Case {
                class,
                name: format!("{}={} {}", env.0, env.1.to_string_lossy(), args.join(" ")),
                args: args.iter().map(os).collect(),
                env: vec![env],
                memory: MEMORY,
                expect: Expect::Accept(check),
                keeps: None,
            })
        };
    // Other warnings may come from probing this machine's libraries; exactly one line may be about ANYCCL_LOG.
    let one_warning: fn(&Outcome) -> Result<(), String> = |o| {
        let about: Vec<&str> = o.stderr.lines().filter(|l| l.contains("ANYCCL_LOG")).collect();
        if about.len() == 1 && about[0].starts_with("warning: ANYCCL_LOG") && about[0].contains("not a valid") {
            Ok(())
        } else {
            Err(format!("expected exactly one warning naming ANYCCL_LOG: {:?}", o.stderr))
        }
    };
    for bad in ["debug=[", "=info", "info,,x=bogus", "\u{202e}trace"] {
        accept("environment", &["probe"], ("ANYCCL_LOG", os(bad)), one_warning);
    }
    accept("environment", &["probe"], ("ANYCCL_LOG", os(OsStr::from_bytes(b"\xff"))), one_warning);
    accept("environment", &["probe", "--json"], ("ANYCCL_TUNE_FILE", os("")), |o| {
        if o.stdout.contains("\"kind\": \"defaults\"") && !o.stderr.contains("ANYCCL_TUNE_FILE") {
            Ok(())
        } else {
            Err(format!("an empty ANYCCL_TUNE_FILE should mean the defaults: {}", o.stderr))
        }
    });
    accept("table files", &["probe", "--json"], ("ANYCCL_TUNE_FILE", os(f.path("30k-rules.toml"))), |o| {
        if o.stdout.contains("30k-rules.toml:120000:") {
            Ok(())
        } else {
            Err("the last of 30 000 rules is not listed".into())
        }
    });
    accept(
        "table files",
        &["bench", "--world", "1", "--sizes", "4KiB", "--iters", "1", "--warmup", "0", "--json"],
        ("ANYCCL_TUNE_FILE", os(f.path("100k-rules.toml"))),
        |o| {
            if o.stdout.contains("100k-rules.toml:3") {
                Ok(())
            } else {
                Err(format!("the first of 100 000 rules should choose: {}", o.stdout))
            }
        },
    );
    v
}

#[test]
fn hostile_input_gets_one_clean_line() {
    let f = Fixtures::new();
    let cases = cases(&f);
    // Per class: attempts, clean, panic, hang, crash, unclean, data lost.
    let mut table: Vec<(&str, [usize; 7])> = Vec::new();
    let mut broken = Vec::new();
    for case in &cases {
        let sentinel = format!("not a table: {}\n", case.name);
        if let Some(k) = &case.keeps {
            std::fs::write(k, &sentinel).expect("sentinel");
        }
        let o = run(&case.args, &case.env, case.memory);
        let row = match table.iter_mut().find(|(c, _)| *c == case.class) {
            Some(r) => r,
            None => {
                table.push((case.class, [0; 7]));
                table.last_mut().expect("just pushed")
            }
        };
        row.1[0] += 1;
        if let Some(k) = &case.keeps {
            if std::fs::read_to_string(k).ok().as_deref() != Some(sentinel.as_str()) {
                row.1[6] += 1;
                broken.push(format!("[data lost] {}: {} was changed", case.name, k.display()));
            }
        }
        match case.judge(&o) {
            Ok(()) => row.1[1] += 1,
            Err((kind, why)) => {
                let col = match kind {
                    "panic" => 2,
                    "hang" => 3,
                    "crash" => 4,
                    _ => 5,
                };
                row.1[col] += 1;
                let why: String = why.chars().take(600).collect();
                broken.push(format!("[{kind}] {}: {why}", case.name.chars().take(200).collect::<String>()));
            }
        }
    }
    let mut report = format!(
        "{:<14} {:>8} {:>6} {:>6} {:>5} {:>6} {:>8} {:>5}\n",
        "class", "attempts", "clean", "panic", "hang", "crash", "unclean", "lost"
    );
    for (class, r) in &table {
        let _ = writeln!(
            report,
            "{class:<14} {:>8} {:>6} {:>6} {:>5} {:>6} {:>8} {:>5}",
            r[0], r[1], r[2], r[3], r[4], r[5], r[6]
        );
    }
    eprintln!("{report}");
    assert!(broken.is_empty(), "{} of {} cases broken:\n{}\n{report}", broken.len(), cases.len(), broken.join("\n"));
}

/// A check of the harness itself: a case that does break the rules is caught (so a green run means
/// something), and the address-space limit reaches the child.
#[test]
fn the_harness_catches_a_crash_and_a_hang() {
    let case = fail("self-test", &[], "x");
    let crash = Outcome {
        code: None,
        signal: Some(6),
        stdout: String::new(),
        stderr: "memory allocation of 1 bytes failed".into(),
        took: Duration::from_millis(5),
        timed_out: false,
    };
    assert_eq!(case.judge(&crash).map_err(|e| e.0), Err("crash"));
    let hang = Outcome { timed_out: true, took: LIMIT, signal: Some(9), ..crash };
    assert_eq!(case.judge(&hang).map_err(|e| e.0), Err("hang"));
    let panic = Outcome {
        code: Some(101),
        signal: None,
        stdout: String::new(),
        stderr: "thread 'main' panicked at src/main.rs:1:1".into(),
        took: Duration::from_millis(5),
        timed_out: false,
    };
    assert_eq!(case.judge(&panic).map_err(|e| e.0), Err("panic"));
    let clean = Outcome { stderr: "error: x is wrong\nhint: fix x".into(), code: Some(1), ..panic };
    assert!(case.judge(&clean).is_ok());
    let two_errors = Outcome { stderr: "error: x\nerror: y\nhint: z".into(), ..clean };
    assert!(case.judge(&two_errors).is_err());
    // The memory limit really applies to the child: a shell asking for more than it fails.
    let p = Path::new("/bin/sh");
    if p.exists() {
        let o = {
            let mut c = Command::new(p);
            c.args(["-c", "ulimit -v"]);
            limit_memory(&mut c, MEMORY);
            c.output().expect("sh runs")
        };
        let kib: u64 = String::from_utf8_lossy(&o.stdout).trim().parse().expect("ulimit -v prints KiB");
        assert!(kib <= MEMORY / 1024, "the limit did not apply: {kib} KiB");
    }
}
