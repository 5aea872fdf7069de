//! Another user of the same host against a loopback job without a secret: it cannot read the per-user key, cannot
//! join the job with any key it can make, and cannot pose as rank 0 to a rank of the job. The other user is a
//! process of uid 65534 started through `setpriv` (util-linux); that needs root, as CI has: these tests fail, not
//! skip, without it.
#![cfg(target_os = "linux")]

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyccl_rendezvous::{JobKey, Rendezvous, RendezvousConfig};

const NOBODY: &str = "65534";
const CHILD_ENV: &str = "ANYCCL_USERKEY_CHILD";

fn require_root(what: &str) {
    assert!(
        nix::unistd::geteuid().is_root(),
        "{what} needs root (to start a process of another user); CI runs the tests as root"
    );
}

/// A free loopback port (another process could take it before the test binds it; then the test fails loudly).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// The configuration a rank reads from torchrun-like variables, with `XDG_RUNTIME_DIR = runtime` and no secret.
fn env_config(rank: usize, port: u16, runtime: &Path) -> RendezvousConfig {
    let vars: HashMap<&str, OsString> = [
        ("RANK", OsString::from(rank.to_string())),
        ("WORLD_SIZE", "2".into()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("ANYCCL_MASTER_PORT", port.to_string().into()),
        ("ANYCCL_RENDEZVOUS_TIMEOUT_SECS", "30".into()),
        ("XDG_RUNTIME_DIR", runtime.as_os_str().to_owned()),
    ]
    .into_iter()
    .collect();
    RendezvousConfig::from_env_with(&|name| vars.get(name).cloned()).expect("a loopback config without a secret")
}

/// This test binary, copied where uid 65534 may run it.
fn binary_for_nobody() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let bin = dir.path().join("userkey-test");
    std::fs::copy(std::env::current_exe().expect("test binary"), &bin).expect("copy");
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    (dir, bin)
}

/// The child test `case`, run as uid/gid 65534 without supplementary groups, with `env`.
fn as_nobody(bin: &Path, case: &str, env: &[(&str, OsString)]) -> Command {
    let mut c = Command::new("setpriv");
    c.args([&format!("--reuid={NOBODY}"), &format!("--regid={NOBODY}"), "--clear-groups", "--"])
        .arg(bin)
        .args(["child", "--exact", "--ignored", "--nocapture", "--test-threads=1", "-q"])
        .env_clear()
        .env(CHILD_ENV, case)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

#[test]
fn another_user_can_neither_read_the_key_nor_join() {
    require_root("another_user_can_neither_read_the_key_nor_join");
    // this user's runtime directory (like /run/user/0: mode 0700)
    let runtime = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let cfg0 = env_config(0, port, runtime.path());
    let key_file = runtime.path().join("anyccl-rendezvous").join("rendezvous.key");
    let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o7777;
    assert_eq!(mode(&key_file), 0o600);
    assert_eq!(mode(key_file.parent().expect("dir")), 0o700);

    let listener = Rendezvous::listen(cfg0).expect("rank 0 listens");
    let rank0 = std::thread::spawn(move || listener.accept_all());
    let (_bin_dir, bin) = binary_for_nobody();
    let out = as_nobody(
        &bin,
        "join",
        &[
            ("ATTACK_PORT", port.to_string().into()),
            ("ATTACK_KEY_FILE", key_file.clone().into()),
            ("ATTACK_VICTIM_RUNTIME", runtime.path().into()),
        ],
    )
    .output()
    .expect("setpriv runs");
    let text = format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the other user's attempts must all fail as expected:\n{text}");
    for marker in ["READ refused", "VICTIM DIR refused", "OWN KEY rejected", "GUESS rejected"] {
        assert!(text.contains(marker), "missing '{marker}':\n{text}");
    }

    // the job still forms with a rank of this user, and rank 0 saw the other user's connections turned away
    let mut rank1 = Rendezvous::connect(env_config(1, port, runtime.path())).expect("a same-user rank joins");
    let mut g0 = rank0.join().expect("rank 0 thread").expect("the group forms");
    let t = std::thread::spawn(move || rank1.all_gather(b"one"));
    assert_eq!(g0.all_gather(b"zero").expect("gather"), vec![b"zero".to_vec(), b"one".to_vec()]);
    t.join().expect("rank 1 thread").expect("rank 1 gathers");
    let record = g0.rejections();
    assert!(record.count() >= 2, "{record}");
    assert!(record.first().iter().all(|r| r.contains("did not prove it holds the job key")), "{record}");
}

#[test]
fn another_user_cannot_pose_as_rank_0() {
    require_root("another_user_cannot_pose_as_rank_0");
    let runtime = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let (_bin_dir, bin) = binary_for_nobody();
    // the other user takes the job's port first, as rank 0 of a world of 2 with the best key it has
    let mut impostor =
        as_nobody(&bin, "pose", &[("ATTACK_PORT", port.to_string().into())]).spawn().expect("setpriv runs");
    let mut lines = BufReader::new(impostor.stdout.take().expect("stdout")).lines();
    let ready = lines.by_ref().map_while(Result::ok).any(|l| l.contains("LISTENING"));
    assert!(ready, "the impostor did not start listening");
    let cfg1 = RendezvousConfig { timeout: Duration::from_secs(30), ..env_config(1, port, runtime.path()) };
    let e = Rendezvous::connect(cfg1).expect_err("an impostor rank 0 must be refused");
    assert!(e.to_string().contains("did not prove it holds the job key"), "{e}");
    let _ = impostor.kill();
    let _ = impostor.wait();
    // the rank sent nothing after its hello: the impostor read no byte past its verdict
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(rest.iter().all(|l| !l.starts_with("RECEIVED") || l == "RECEIVED 0 bytes after the verdict"), "{rest:?}");
}

/// The other user's side (run through `setpriv` by the tests above).
#[test]
#[ignore = "run as another user by the tests of this file"]
fn child() {
    let case = std::env::var(CHILD_ENV).expect("run by the tests of this file");
    assert!(!nix::unistd::geteuid().is_root(), "the child must run as another user");
    let port: u16 = std::env::var("ATTACK_PORT").expect("port").parse().expect("port");
    // a runtime directory of this (other) user
    let own = tempfile::Builder::new().prefix("anyccl-other-user").tempdir_in("/tmp").expect("own runtime dir");
    match case.as_str() {
        "join" => {
            let key_file = PathBuf::from(std::env::var_os("ATTACK_KEY_FILE").expect("key file"));
            let e = std::fs::read(&key_file).expect_err("the key file must not be readable by another user");
            println!("READ refused: {e}");
            let victim = PathBuf::from(std::env::var_os("ATTACK_VICTIM_RUNTIME").expect("victim"));
            let vars = |runtime: &Path| {
                let v: HashMap<&str, OsString> = [
                    ("RANK", OsString::from("1")),
                    ("WORLD_SIZE", "2".into()),
                    ("MASTER_ADDR", "127.0.0.1".into()),
                    ("ANYCCL_MASTER_PORT", port.to_string().into()),
                    ("ANYCCL_RENDEZVOUS_TIMEOUT_SECS", "20".into()),
                    ("XDG_RUNTIME_DIR", runtime.as_os_str().to_owned()),
                ]
                .into_iter()
                .collect();
                RendezvousConfig::from_env_with(&move |name| v.get(name).cloned())
            };
            let e = vars(&victim).expect_err("the victim's directory must be refused");
            println!("VICTIM DIR refused: {e}");
            let cfg = vars(own.path()).expect("its own per-user key");
            let e = Rendezvous::connect(cfg.clone()).expect_err("its own key must not join");
            assert!(e.to_string().contains("rejected"), "{e}");
            println!("OWN KEY rejected: {e}");
            for guess in [JobKey::per_user(&[0u8; 32], "127.0.0.1", port), JobKey::from_secret(b"")] {
                let e = Rendezvous::connect(cfg.clone().with_key(guess)).expect_err("a guess must not join");
                assert!(e.to_string().contains("rejected"), "{e}");
            }
            println!("GUESS rejected");
        }
        "pose" => {
            // an impostor that answers every hello with "accepted" and the best proof it can make (it has no key
            // of the job's): a proof made with its own per-user key
            use anyccl_rendezvous::tcp::{MAGIC, PROTOCOL_VERSION};
            use std::io::{Read, Write};
            let own_key = anyccl_rendezvous::userkey::load_or_create(own.path()).expect("its own per-user secret");
            let listener = std::net::TcpListener::bind(("127.0.0.1", port)).expect("the impostor listens");
            println!("LISTENING");
            for stream in listener.incoming() {
                let Ok(mut s) = stream else { continue };
                let mut greeting = MAGIC.to_vec();
                greeting.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
                greeting.extend_from_slice(&[7u8; 32]);
                let mut hello = [0u8; 12 + 8 + 8 + 32 + 32];
                if s.write_all(&greeting).and_then(|()| s.read_exact(&mut hello)).is_err() {
                    continue;
                }
                let mut verdict = vec![0xa5u8];
                verdict.extend_from_slice(&own_key);
                let _ = s.write_all(&verdict);
                let mut rest = Vec::new();
                let _ = s.read_to_end(&mut rest);
                println!("RECEIVED {} bytes after the verdict", rest.len());
            }
        }
        other => panic!("unknown case {other}"),
    }
}
