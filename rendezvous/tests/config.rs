//! The configuration parsers under hostile values: they never panic, every error names its variable, sizes and
//! timeouts are bounded, and the job's secret comes only from where it safely can.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::Write;
use std::time::Duration;

use anyccl_core::Error;
use anyccl_rendezvous::config::{
    KEY_FILE_VAR, KEY_VAR, MAX_KEY_FILE_LEN, MAX_TIMEOUT, MAX_WORLD, MIN_SECRET_LEN, TIMEOUT_VAR,
};
use anyccl_rendezvous::{JobKey, RendezvousConfig};
use proptest::prelude::*;

const BASE: [(&str, &str); 4] =
    [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];

fn read(vars: &[(String, String)]) -> anyccl_core::Result<RendezvousConfig> {
    let map: HashMap<String, String> = vars.iter().cloned().collect();
    RendezvousConfig::from_env_with(&move |name| map.get(name).cloned().map(OsString::from))
}

/// The base variables with `extra` set (replacing their base values, if any).
fn with(extra: &[(&str, &str)]) -> Vec<(String, String)> {
    // the per-user key of loopback jobs lives in a directory of this test process's own
    let runtime = std::env::temp_dir().join(format!("anyccl-config-test-{}", std::process::id()));
    let mut v: Vec<(String, String)> = [("XDG_RUNTIME_DIR", runtime.to_string_lossy().as_ref())]
        .iter()
        .chain(BASE.iter())
        .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    v.extend(extra.iter().map(|(k, val)| (k.to_string(), val.to_string())));
    v
}

/// The variable a config error names, and its message.
fn config_error(vars: &[(String, String)]) -> (String, String) {
    match read(vars) {
        Err(Error::Config { source_name, line: None, message }) => (source_name, message),
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn huge_worlds_and_timeouts_are_config_errors() {
    for world in ["1000000000000", "18446744073709551615", "18446744073709551616", "65537"] {
        let (var, msg) = config_error(&with(&[("WORLD_SIZE", world)]));
        assert_eq!(var, "WORLD_SIZE", "{world}");
        assert!(msg.contains("at most 65536") || msg.contains("is not a world size"), "{msg}");
    }
    let cfg = read(&with(&[("WORLD_SIZE", &MAX_WORLD.to_string())])).expect("the largest world");
    assert_eq!(cfg.world, MAX_WORLD);

    for t in ["1e19", "1e300", "inf", "NaN", "-1", "0", "0.0000000001", "604800.5", "", "1s"] {
        let (var, msg) = config_error(&with(&[(TIMEOUT_VAR, t)]));
        assert_eq!(var, TIMEOUT_VAR, "{t}: {msg}");
    }
    let (_, msg) = config_error(&with(&[(TIMEOUT_VAR, "1e19")]));
    assert!(msg.contains("longer than the maximum of 604800 seconds"), "{msg}");
    let cfg = read(&with(&[(TIMEOUT_VAR, "604800")])).expect("the longest timeout");
    assert_eq!(cfg.timeout, MAX_TIMEOUT);
    assert_eq!(read(&with(&[(TIMEOUT_VAR, "0.25")])).expect("a fraction").timeout, Duration::from_millis(250));
}

#[test]
fn values_shown_in_errors_are_sanitized() {
    let (_, msg) = config_error(&with(&[("WORLD_SIZE", "\u{1b}[2J8\n")]));
    assert!(!msg.contains('\u{1b}') && !msg.contains('\n'), "{msg:?}");
    let (_, msg) = config_error(&with(&[("MASTER_ADDR", "host\u{1b}]0;x\u{7}")]));
    assert!(!msg.contains('\u{1b}') && !msg.contains('\u{7}'), "{msg:?}");
    let long = "9".repeat(100_000);
    let (_, msg) = config_error(&with(&[("MASTER_PORT", &long)]));
    assert!(msg.len() < 2000, "{} bytes", msg.len());
}

fn var_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[0-9]{0,25}",
        "-?[0-9]{0,5}(\\.[0-9]{0,5})?(e-?[0-9]{1,3})?",
        Just("18446744073709551615".to_owned()),
        Just("1e19".to_owned()),
        Just(" 4 ".to_owned()),
    ]
}

proptest! {
    #[test]
    fn no_value_makes_the_parser_panic_and_errors_name_the_variable(
        var in prop::sample::select(vec!["WORLD_SIZE", "RANK", "MASTER_PORT", "LOCAL_RANK", TIMEOUT_VAR]),
        value in var_strategy(),
    ) {
        match read(&with(&[(var, &value)])) {
            Ok(cfg) => {
                prop_assert!(cfg.world >= 1 && cfg.world <= MAX_WORLD);
                prop_assert!(cfg.rank < cfg.world);
                prop_assert!(!cfg.timeout.is_zero() && cfg.timeout <= MAX_TIMEOUT);
                prop_assert!(cfg.key.is_some());
            }
            Err(Error::Config { source_name, .. }) => {
                // a bad RANK may also be reported as out of range for the world, which is still RANK
                prop_assert_eq!(source_name, var);
            }
            Err(other) => prop_assert!(false, "not a config error: {other:?}"),
        }
    }

    #[test]
    fn world_and_rank_together_are_checked(world in "[0-9]{1,8}", rank in "[0-9]{1,8}") {
        match read(&with(&[("WORLD_SIZE", &world), ("RANK", &rank)])) {
            Ok(cfg) => prop_assert!(cfg.rank < cfg.world && cfg.world <= MAX_WORLD),
            Err(Error::Config { source_name, .. }) => {
                prop_assert!(source_name == "WORLD_SIZE" || source_name == "RANK", "{}", source_name)
            }
            Err(other) => prop_assert!(false, "not a config error: {other:?}"),
        }
    }
}

// ---- the job's secret ----

#[test]
fn a_secret_is_required_off_loopback() {
    let (var, msg) = config_error(&with(&[("MASTER_ADDR", "10.1.2.3")]));
    assert_eq!(var, KEY_VAR);
    assert!(msg.contains("not a loopback address"), "{msg}");
    assert!(msg.contains("openssl rand -hex 32") && msg.contains(KEY_FILE_VAR), "{msg}");
    // 0.0.0.0 is not loopback either
    assert_eq!(config_error(&with(&[("MASTER_ADDR", "0.0.0.0")])).0, KEY_VAR);
    let secret = "0123456789abcdef0123";
    let cfg = read(&with(&[("MASTER_ADDR", "10.1.2.3"), (KEY_VAR, secret)])).expect("with a secret");
    assert_eq!(cfg.key, Some(JobKey::from_secret(secret.as_bytes())));
    // on loopback the per-user key is the default, the same on every rank (and every world size)
    let a = read(&with(&[])).expect("loopback");
    let b = read(&with(&[("RANK", "1")])).expect("loopback");
    assert_eq!(a.key, b.key);
    assert_eq!(a.key, read(&with(&[("WORLD_SIZE", "3")])).expect("loopback").key);
    // from the user's private file and the rendezvous port, MASTER_PORT + 1
    let runtime = with(&[]).into_iter().find(|(k, _)| k == "XDG_RUNTIME_DIR").expect("set").1;
    let user = anyccl_rendezvous::userkey::load_or_create(std::path::Path::new(&runtime)).expect("user key");
    assert_eq!(a.key, Some(JobKey::per_user(&user, "127.0.0.1", 29501)));
    assert_ne!(a.key, read(&with(&[("MASTER_PORT", "29600")])).expect("loopback").key);
    // another user's directory (here: another base) gives another key
    let other = tempfile::tempdir().expect("tempdir");
    let c = read(&with(&[("XDG_RUNTIME_DIR", other.path().to_str().expect("utf8"))])).expect("loopback");
    assert_ne!(a.key, c.key);
    // with neither XDG_RUNTIME_DIR nor HOME there is no private place for it: an error naming the secret
    let bare: Vec<(String, String)> = BASE.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let (var, msg) = config_error(&bare);
    assert_eq!(var, KEY_VAR);
    assert!(msg.contains("XDG_RUNTIME_DIR") && msg.contains("HOME"), "{msg}");
    let v6 = read(&with(&[("MASTER_ADDR", "::1")])).expect("IPv6 loopback");
    assert!(v6.key.is_some());
}

#[test]
fn secrets_must_be_long_and_unambiguous() {
    let (var, msg) = config_error(&with(&[(KEY_VAR, "job-42")]));
    assert_eq!(var, KEY_VAR);
    assert!(msg.contains(&format!("at least {MIN_SECRET_LEN}")), "{msg}");
    assert!(!msg.contains("job-42"), "the error must not repeat the secret: {msg}");
    assert_eq!(config_error(&with(&[(KEY_VAR, "   ")])).0, KEY_VAR);
    let (var, msg) = config_error(&with(&[(KEY_VAR, "0123456789abcdef"), (KEY_FILE_VAR, "/nonexistent")]));
    assert_eq!(var, KEY_FILE_VAR);
    assert!(msg.contains("set only one"), "{msg}");
    // white space around the secret does not matter
    let a = read(&with(&[(KEY_VAR, "0123456789abcdef")])).expect("key");
    let b = read(&with(&[(KEY_VAR, " 0123456789abcdef\n")])).expect("key");
    assert_eq!(a.key, b.key);
}

/// Two secrets that differ only in bytes that are not UTF-8 (equal after a lossy conversion) are two secrets: they
/// give two keys, and a rank holding one cannot join a rank 0 holding the other.
#[cfg(unix)]
#[test]
fn secrets_are_bytes_not_lossy_text() {
    use anyccl_rendezvous::Rendezvous;
    use std::os::unix::ffi::OsStringExt;
    let a = b"0123456789abcdef-\xff".to_vec();
    let b = b"0123456789abcdef-\xfe".to_vec();
    assert_eq!(String::from_utf8_lossy(&a), String::from_utf8_lossy(&b), "the premise: lossily equal");
    let read_with = |rank: &str, secret: &[u8]| {
        let mut vars: HashMap<String, OsString> =
            with(&[("RANK", rank)]).into_iter().map(|(k, v)| (k, OsString::from(v))).collect();
        vars.insert(KEY_VAR.into(), OsString::from_vec(secret.to_vec()));
        RendezvousConfig::from_env_with(&move |name| vars.get(name).cloned()).expect("a non-UTF-8 secret is fine")
    };
    let cfg_a = read_with("0", &a);
    let cfg_b = read_with("1", &b);
    assert_eq!(cfg_a.key, Some(JobKey::from_secret(&a)), "the raw bytes are the secret");
    assert_ne!(cfg_a.key, cfg_b.key);
    // and at the level of the group: rank 1 with the other secret is turned away at once
    let timeout = Duration::from_secs(20);
    let cfg0 = RendezvousConfig { master: "127.0.0.1:0".parse().expect("addr"), timeout, ..cfg_a };
    let listener = Rendezvous::listen(cfg0).expect("listen");
    let cfg1 = RendezvousConfig { master: listener.local_addr(), timeout, ..cfg_b };
    // rank 0 waits in its own thread (left to time out on its own: the test does not wait for it)
    let _rank0 = std::thread::spawn(move || listener.accept_all());
    let e = Rendezvous::connect(cfg1).expect_err("another secret");
    assert!(e.to_string().contains("rejected"), "{e}");
}

/// Every text variable that is set but not UTF-8 is an error naming it (never read lossily, never ignored).
#[cfg(unix)]
#[test]
fn text_variables_that_are_not_utf8_are_named() {
    use std::os::unix::ffi::OsStringExt;
    for var in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", TIMEOUT_VAR, "ANYCCL_MASTER_PORT"] {
        let mut vars: HashMap<String, OsString> = with(&[]).into_iter().map(|(k, v)| (k, OsString::from(v))).collect();
        vars.insert(var.into(), OsString::from_vec(b"1\xff".to_vec()));
        match RendezvousConfig::from_env_with(&move |name| vars.get(name).cloned()) {
            Err(Error::Config { source_name, message, .. }) => {
                assert_eq!(source_name, var);
                assert!(message.contains("not valid UTF-8"), "{message}");
            }
            other => panic!("{var}: expected a config error, got {other:?}"),
        }
    }
}

#[cfg(unix)]
mod key_file {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn file_error(path: &str) -> String {
        let (var, msg) = config_error(&with(&[(KEY_FILE_VAR, path)]));
        assert_eq!(var, KEY_FILE_VAR);
        msg
    }

    fn key_file(dir: &tempfile::TempDir, name: &str, contents: &[u8], mode: u32) -> String {
        let path = dir.path().join(name);
        let mut f = std::fs::File::create(&path).expect("create");
        f.write_all(contents).expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
        path.to_string_lossy().into_owned()
    }

    #[test]
    fn a_private_key_file_gives_the_same_key_as_the_text() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = key_file(&dir, "key", b"0123456789abcdef0123456789abcdef\n", 0o600);
        let cfg = read(&with(&[("MASTER_ADDR", "10.1.2.3"), (KEY_FILE_VAR, &path)])).expect("key file");
        let text = read(&with(&[(KEY_VAR, "0123456789abcdef0123456789abcdef")])).expect("key text");
        assert_eq!(cfg.key, text.key);
        // read-only for the owner is fine too
        let ro = key_file(&dir, "ro", b"0123456789abcdef0123456789abcdef", 0o400);
        assert_eq!(read(&with(&[(KEY_FILE_VAR, &ro)])).expect("0400").key, text.key);
        // and a symbolic link to it
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&path, &link).expect("symlink");
        assert_eq!(read(&with(&[(KEY_FILE_VAR, &link.to_string_lossy())])).expect("link").key, text.key);
    }

    #[test]
    fn unsafe_key_files_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        for mode in [0o644, 0o640, 0o604, 0o660, 0o666] {
            let path = key_file(&dir, &format!("k{mode:o}"), b"0123456789abcdef0123", mode);
            let msg = file_error(&path);
            assert!(msg.contains(&format!("has mode {mode:04o}")) && msg.contains("chmod 600"), "{msg}");
        }
        let big = key_file(&dir, "big", &vec![b'k'; MAX_KEY_FILE_LEN as usize + 1], 0o600);
        assert!(file_error(&big).contains("a key file holds at most 4096"));
        let short = key_file(&dir, "short", b"short\n", 0o600);
        assert!(file_error(&short).contains("at least 16"));
        let empty = key_file(&dir, "empty", b"", 0o600);
        assert!(file_error(&empty).contains("is empty"));
        assert!(file_error(&dir.path().to_string_lossy()).contains("is not a regular file"));
        assert!(file_error(&dir.path().join("missing").to_string_lossy()).contains("cannot open"));
        assert!(file_error("").contains("is empty"));
        // a character device would never end
        assert!(file_error("/dev/zero").contains("is not a regular file"));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_fifo_key_file_is_refused_without_hanging() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("mkfifo");
        // opening a FIFO for reading blocks until a writer comes, unless the open is non-blocking; the parse runs
        // on a thread so that a hang fails this test instead of stalling the run
        let path = fifo.to_string_lossy().into_owned();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(read(&with(&[(KEY_FILE_VAR, &path)])));
        });
        match rx.recv_timeout(Duration::from_secs(5)) {
            Ok(Err(Error::Config { source_name, message, .. })) => {
                assert_eq!(source_name, KEY_FILE_VAR);
                assert!(message.contains("is not a regular file"), "{message}");
            }
            Ok(other) => panic!("expected a config error, got {other:?}"),
            Err(_) => panic!("reading a FIFO as the key file hung"),
        }
    }
}
