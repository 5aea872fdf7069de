//! Output files (`bench --plot`, `tune --out`): checked before a sweep, so a bad path fails at once and by name
//! rather than after minutes of measuring; written whole or not at all.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyccl::core::{Error, Result};

fn config(path: &Path, message: String) -> Error {
    Error::Config { source_name: path.display().to_string(), line: None, message }
}

/// What a non-regular file is, for messages.
fn kind(ft: std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if ft.is_char_device() || ft.is_block_device() {
            return "a device";
        }
        if ft.is_socket() {
            return "a socket";
        }
    }
    if ft.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// Opens for writing without blocking (a FIFO with no reader would block a plain open) and without truncating.
fn open_for_write(options: &mut OpenOptions) -> &mut OpenOptions {
    options.write(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY);
    }
    options
}

/// Checks that `path` (the value of `flag`, which will hold `what`) can be written the way [`write_atomically`]
/// writes it: an existing file must be a regular file open for writing (it is not truncated), and its directory
/// must take a new file (one is created and removed again). Anything else (a directory, FIFO, device, a missing
/// directory, no permission) is an error naming the path and the flag.
pub fn check_writable(path: &Path, flag: &str, what: &str) -> Result<()> {
    let fail = |m: String| config(path, format!("cannot write {what} here ({flag}): {m}"));
    let not_regular = |ft: std::fs::FileType| fail(format!("it is {}; {flag} takes a regular file", kind(ft)));
    if path.file_name().is_none() {
        return Err(fail(format!("the path names no file; {flag} takes a file name")));
    }
    match std::fs::metadata(path) {
        Ok(meta) if !meta.is_file() => return Err(not_regular(meta.file_type())),
        Ok(_) => {
            let f = open_for_write(&mut OpenOptions::new()).open(path).map_err(|e| fail(e.to_string()))?;
            let ft = f.metadata().map_err(|e| fail(e.to_string()))?.file_type();
            if !ft.is_file() {
                return Err(not_regular(ft));
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail(e.to_string())),
    }
    let probe = temp_beside(path, "check");
    open_for_write(&mut OpenOptions::new()).create_new(true).open(&probe).map_err(|e| fail(e.to_string()))?;
    std::fs::remove_file(&probe).map_err(|e| fail(format!("created {} but cannot remove it: {e}", probe.display())))
}

/// The file `path` names in the end (a symlink's target), or `path` itself if it does not exist yet.
fn target(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned())
}

/// A new file's name beside `path`'s target, private to this process.
fn temp_beside(path: &Path, tag: &str) -> PathBuf {
    let t = target(path);
    let name = t.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    t.with_file_name(format!(".{name}.anyccl-{}.{tag}", std::process::id()))
}

/// Writes `bytes` to `path` whole or not at all: into a new file beside it, then renamed over it, so a failure
/// (a full disk, a kill) leaves the old file as it was. A symlink is followed (its target is replaced).
pub fn write_atomically(path: &Path, bytes: &[u8], flag: &str, what: &str) -> Result<()> {
    let fail = |m: String| config(path, format!("cannot write {what} ({flag}): {m}"));
    let target = target(path);
    let tmp = temp_beside(path, "tmp");
    let written = (|| -> std::io::Result<()> {
        let mut f: File = open_for_write(&mut OpenOptions::new()).create_new(true).open(&tmp)?;
        f.write_all(bytes)?;
        // An existing file keeps its permissions.
        if let Ok(meta) = std::fs::metadata(&target) {
            f.set_permissions(meta.permissions())?;
        }
        f.sync_all()?;
        std::fs::rename(&tmp, &target)
    })();
    written.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        fail(e.to_string())
    })
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("anyccl-output-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp dir");
        d
    }

    #[test]
    fn bad_paths_are_named_before_any_work() {
        let d = dir("check");
        let msg = |p: &Path| match check_writable(p, "--out", "the table") {
            Err(Error::Config { source_name, message, .. }) => {
                assert_eq!(source_name, p.display().to_string());
                assert!(message.contains("--out"), "{message}");
                message
            }
            other => panic!("{}: {other:?}", p.display()),
        };
        assert!(msg(&d.join("missing/x.toml")).contains("No such file"));
        assert!(msg(&d).contains("a directory"));
        assert!(msg(Path::new("")).contains("names no file"));
        assert!(msg(Path::new("/tmp/..")).contains("names no file"));
        assert!(msg(Path::new("/dev/null")).contains("a device"));
        let fifo = d.join("fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo").success());
        assert!(msg(&fifo).contains("FIFO"));
        // A new path is fine and is not left behind; an existing file is fine and keeps its contents.
        let new = d.join("new.toml");
        check_writable(&new, "--out", "the table").expect("writable");
        assert!(!new.exists());
        std::fs::write(&new, "keep").expect("write");
        check_writable(&new, "--out", "the table").expect("writable");
        assert_eq!(std::fs::read_to_string(&new).expect("read"), "keep");
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn atomic_write_replaces_whole_or_not_at_all() {
        let d = dir("atomic");
        let p = d.join("t.toml");
        std::fs::write(&p, "old").expect("write");
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o640)).expect("chmod");
        write_atomically(&p, b"new", "--out", "the table").expect("written");
        assert_eq!(std::fs::read_to_string(&p).expect("read"), "new");
        let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&p).expect("stat").permissions());
        assert_eq!(mode & 0o777, 0o640, "the file keeps its permissions");
        let e = write_atomically(&d.join("missing/t.toml"), b"x", "--out", "the table").expect_err("no dir");
        assert!(e.to_string().contains("missing/t.toml"), "{e}");
        // Nothing is left beside the target.
        let left: Vec<_> = std::fs::read_dir(&d).expect("list").filter_map(|e| e.ok()).map(|e| e.file_name()).collect();
        assert_eq!(left.len(), 1, "{left:?}");
        std::fs::remove_dir_all(&d).ok();
    }
}
