//! The per-user secret that closes single-host jobs to other users when no secret is configured.
//!
//! A file of 32 random bytes, `anyccl-rendezvous/rendezvous.key`, in a directory private to the user:
//! `$XDG_RUNTIME_DIR` where it is set, else `$HOME/.cache`. The `anyccl-rendezvous` directory (its own, not the
//! `anyccl` download cache, which other tools create with ordinary modes) is created with mode 0700 and the file with mode
//! 0600, exclusively and without following symbolic links; on every read the directory and the file must be owned
//! by this process's effective uid with no access for group or others, and the file must be a regular file of
//! exactly 32 bytes. Anything else is an error naming the path (never a silent fallback to a weaker key). The first
//! rank to need the file creates it under a temporary name and links it into place, so ranks starting at the same
//! moment all read the same complete file.
//!
//! Every process of the user (with the same base directory) reads the same secret, so `torchrun` on one host needs
//! no configuration; processes of another uid cannot read it (the kernel's file permissions), so they cannot join
//! nor pose as rank 0. root can read it, as it can read any process's memory.

use std::ffi::OsString;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyccl_core::text::sanitize;
use anyccl_core::{Error, Result};
use rustix::fs::{AtFlags, Mode, OFlags, CWD};
use tracing::debug;

/// The directory created in the base directory: the key's alone (`~/.cache/anyccl` holds downloads, with
/// ordinary modes).
pub const DIR_NAME: &str = "anyccl-rendezvous";

/// The key file's name in [`DIR_NAME`].
pub const FILE_NAME: &str = "rendezvous.key";

/// The length of the per-user secret (bytes).
pub const SECRET_LEN: usize = 32;

/// The base directory of the per-user secret ([`DIR_NAME`] goes in it) for an environment read through `get_os`:
/// `$XDG_RUNTIME_DIR` when that is set to an absolute path, else `$HOME/.cache` (`HOME` absolute); `None` when
/// neither is usable.
pub fn base_dir(get_os: &dyn Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let absolute = |v: OsString| Some(PathBuf::from(v)).filter(|p| p.is_absolute());
    get_os("XDG_RUNTIME_DIR").and_then(absolute).or_else(|| get_os("HOME").and_then(absolute).map(|h| h.join(".cache")))
}

fn error(path: &Path, message: impl std::fmt::Display) -> Error {
    Error::Config {
        source_name: sanitize(&path.to_string_lossy()),
        line: None,
        message: format!(
            "{message}; the per-user rendezvous key (used on a loopback MASTER_ADDR when no {} is set) must be \
             private to this user. Fix or remove it, or set {}",
            crate::config::KEY_VAR,
            crate::config::KEY_VAR
        ),
    }
}

/// Refuses `meta` unless it is owned by `uid` and neither group nor others have any access.
fn check_private(path: &Path, meta: &std::fs::Metadata, uid: u32, what: &str) -> Result<()> {
    if meta.uid() != uid {
        return Err(error(path, format!("the {what} is owned by uid {}, not by this user (uid {uid})", meta.uid())));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(error(path, format!("the {what} has mode {mode:04o}: group or others have access")));
    }
    Ok(())
}

/// The per-user secret in `base/anyccl-rendezvous/rendezvous.key`, created on first use (see the module documentation).
pub fn load_or_create(base: &Path) -> Result<[u8; SECRET_LEN]> {
    let uid = nix::unistd::geteuid().as_raw();
    // `~/.cache` may not exist yet; `$XDG_RUNTIME_DIR` always does (its owner's login made it)
    if !base.exists() {
        let mut builder = std::fs::DirBuilder::new();
        std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
        builder.recursive(true).create(base).map_err(|e| error(base, format!("cannot create the directory: {e}")))?;
    }
    let dir_path = base.join(DIR_NAME);
    let base_fd = rustix::fs::openat(CWD, base, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| error(base, format!("cannot open the directory: {e}")))?;
    match rustix::fs::mkdirat(&base_fd, DIR_NAME, Mode::from_raw_mode(0o700)) {
        Ok(()) => debug!(target: "anyccl::rendezvous", "created {}", dir_path.display()),
        Err(rustix::io::Errno::EXIST) => {}
        Err(e) => return Err(error(&dir_path, format!("cannot create the directory: {e}"))),
    }
    // never through a symbolic link: the directory is judged as itself
    let dir = rustix::fs::openat(
        &base_fd,
        DIR_NAME,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| error(&dir_path, format!("cannot open the directory (a symbolic link is refused): {e}")))?;
    let dir_meta = File::from(dir.try_clone().map_err(|e| error(&dir_path, e))?)
        .metadata()
        .map_err(|e| error(&dir_path, format!("cannot inspect the directory: {e}")))?;
    check_private(&dir_path, &dir_meta, uid, "directory")?;
    let file_path = dir_path.join(FILE_NAME);
    // at most twice: read; or create, then read what was linked into place (ours or another rank's)
    for _ in 0..2 {
        match open_key(&dir) {
            Ok(fd) => return read_key(fd, &file_path, uid),
            Err(rustix::io::Errno::NOENT) => create_key(&dir, &file_path)?,
            Err(e) => {
                return Err(error(&file_path, format!("cannot open the key file (a symbolic link is refused): {e}")))
            }
        }
    }
    Err(error(&file_path, "the key file disappeared as soon as it was created"))
}

fn open_key(dir: &OwnedFd) -> rustix::io::Result<OwnedFd> {
    // non-blocking: a FIFO put there cannot hang the rank (it is refused below as not a regular file)
    rustix::fs::openat(
        dir,
        FILE_NAME,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

fn read_key(fd: OwnedFd, path: &Path, uid: u32) -> Result<[u8; SECRET_LEN]> {
    let mut file = File::from(fd);
    let meta = file.metadata().map_err(|e| error(path, format!("cannot inspect the key file: {e}")))?;
    if !meta.is_file() {
        return Err(error(path, "the key file is not a regular file"));
    }
    check_private(path, &meta, uid, "key file")?;
    if meta.len() != SECRET_LEN as u64 {
        return Err(error(path, format!("the key file holds {} bytes, not {SECRET_LEN}", meta.len())));
    }
    let mut secret = [0u8; SECRET_LEN];
    file.read_exact(&mut secret).map_err(|e| error(path, format!("cannot read the key file: {e}")))?;
    Ok(secret)
}

/// Writes a new secret under a temporary name (created exclusively, mode 0600) and links it to [`FILE_NAME`]; when
/// another rank linked its own first, that one stays and is the key.
fn create_key(dir: &OwnedFd, path: &Path) -> Result<()> {
    let mut secret = [0u8; SECRET_LEN];
    crate::auth::fill_random(&mut secret)?;
    let mut tag = [0u8; 8];
    crate::auth::fill_random(&mut tag)?;
    let tmp: String = format!("{FILE_NAME}.{}.tmp", tag.iter().map(|b| format!("{b:02x}")).collect::<String>());
    let fd = rustix::fs::openat(
        dir,
        tmp.as_str(),
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(|e| error(path, format!("cannot create a new key file: {e}")))?;
    let mut file = File::from(fd);
    let written = file.write_all(&secret).and_then(|()| file.sync_all());
    secret.fill(0);
    let linked = written.map_err(|e| error(path, format!("cannot write a new key file: {e}"))).and_then(|()| {
        match rustix::fs::linkat(dir.as_fd(), tmp.as_str(), dir.as_fd(), FILE_NAME, AtFlags::empty()) {
            Ok(()) => {
                debug!(target: "anyccl::rendezvous", "created the per-user rendezvous key {}", path.display());
                Ok(())
            }
            // another rank was first: its file is the key
            Err(rustix::io::Errno::EXIST) => Ok(()),
            Err(e) => Err(error(path, format!("cannot put the new key file in place: {e}"))),
        }
    });
    let _ = rustix::fs::unlinkat(dir, tmp.as_str(), AtFlags::empty());
    linked
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn created_private_once_and_read_back_the_same() {
        let base = tempfile::tempdir().expect("tempdir");
        let a = load_or_create(base.path()).expect("created");
        let b = load_or_create(base.path()).expect("read back");
        assert_eq!(a, b);
        let dir = base.path().join(DIR_NAME);
        let mode = |p: &Path| std::fs::symlink_metadata(p).expect("stat").permissions().mode() & 0o7777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join(FILE_NAME)), 0o600);
        // nothing but the key file is left in the directory
        assert_eq!(std::fs::read_dir(&dir).expect("list").count(), 1);
        // another base, another secret
        let other = tempfile::tempdir().expect("tempdir");
        assert_ne!(load_or_create(other.path()).expect("other"), a);
    }

    #[test]
    fn ranks_starting_together_read_one_key() {
        let base = tempfile::tempdir().expect("tempdir");
        let path = base.path().to_owned();
        let keys: Vec<_> = (0..8)
            .map(|_| {
                let p = path.clone();
                std::thread::spawn(move || load_or_create(&p))
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().expect("thread").expect("key"))
            .collect();
        assert!(keys.windows(2).all(|w| w[0] == w[1]));
    }

    #[test]
    fn anything_not_private_is_refused_by_name() {
        let expect_refused = |base: &Path, needle: &str| match load_or_create(base) {
            Err(Error::Config { source_name, message, .. }) => {
                assert!(source_name.contains(DIR_NAME), "{source_name}");
                assert!(message.contains(needle), "{message}");
            }
            other => panic!("expected a refusal mentioning '{needle}', got {other:?}"),
        };
        // a directory others may enter
        let base = tempfile::tempdir().expect("tempdir");
        load_or_create(base.path()).expect("created");
        let dir = base.path().join(DIR_NAME);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        expect_refused(base.path(), "mode 0755");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        // a key file group may read
        let file = dir.join(FILE_NAME);
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o640)).expect("chmod");
        expect_refused(base.path(), "mode 0640");
        // a key file of another length
        std::fs::remove_file(&file).expect("rm");
        std::fs::write(&file, b"short").expect("write");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        expect_refused(base.path(), "holds 5 bytes");
        // a symbolic link in place of the key file, or of the directory
        std::fs::remove_file(&file).expect("rm");
        let elsewhere = base.path().join("elsewhere");
        std::fs::write(&elsewhere, [7u8; SECRET_LEN]).expect("write");
        std::os::unix::fs::symlink(&elsewhere, &file).expect("symlink");
        expect_refused(base.path(), "symbolic link");
        let base2 = tempfile::tempdir().expect("tempdir");
        let real = base2.path().join("real");
        std::fs::create_dir(&real).expect("mkdir");
        std::os::unix::fs::symlink(&real, base2.path().join(DIR_NAME)).expect("symlink");
        expect_refused(base2.path(), "symbolic link");
        // a key file owned by another user: tests/userkey.rs (it needs root to make one)
    }
}
