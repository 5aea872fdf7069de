//! Output files (`bench --plot`, `tune --out`): checked before a sweep, so a bad path fails at once and by name
//! rather than after minutes of measuring; written whole or not at all.

use std::io::Write;
use std::path::Path;

use tempfile::NamedTempFile;

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

/// The directory a new file beside `path` goes into (`.` for a bare file name).
fn dir_of(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// A new, empty file beside `path`, with a name no other process can predict (`.<name>.<random>.anyccl-tmp`),
/// created exclusively (`O_CREAT | O_EXCL`: never a file or symbolic link that is already there, whoever planted
/// it), with mode 0666 less the umask. It is removed when dropped unless persisted.
fn temp_beside(path: &Path) -> std::io::Result<NamedTempFile> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    let prefix = format!(".{name}.");
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(".anyccl-tmp").rand_bytes(12);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    builder.tempfile_in(dir_of(path))
}

/// Checks that `path` (the value of `flag`, which will hold `what`) can be written the way [`write_atomically`]
/// writes it: what is there now must be a regular file or a symbolic link (which is replaced, never followed),
/// and its directory must take a new file (one is created and removed again). Anything else (a directory, FIFO,
/// device, a missing directory, no permission) is an error naming the path and the flag.
pub fn check_writable(path: &Path, flag: &str, what: &str) -> Result<()> {
    let fail = |m: String| config(path, format!("cannot write {what} here ({flag}): {m}"));
    if path.file_name().is_none() {
        return Err(fail(format!("the path names no file; {flag} takes a file name")));
    }
    // lstat: a symbolic link is judged as itself, since it is what gets replaced
    let existing = match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.is_file() && !meta.file_type().is_symlink() => {
            return Err(fail(format!("it is {}; {flag} takes a regular file", kind(meta.file_type()))));
        }
        Ok(meta) => Some(meta),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(fail(e.to_string())),
    };
    // created and removed again (on drop)
    let probe = temp_beside(path).map_err(|e| fail(e.to_string()))?;
    #[cfg(unix)]
    if let Some(existing) = existing {
        // In a sticky directory (such as /tmp) a file or link another user owns cannot be replaced: say so now
        // rather than after the whole sweep. The probe file is this process's own, so its owner is who we are.
        use std::os::unix::fs::MetadataExt;
        let me = probe.as_file().metadata().map_err(|e| fail(e.to_string()))?.uid();
        let dir = std::fs::metadata(dir_of(path)).map_err(|e| fail(e.to_string()))?;
        if dir.mode() & 0o1000 != 0 && me != 0 && existing.uid() != me && dir.uid() != me {
            return Err(fail(format!(
                "it belongs to another user (uid {}) in a shared sticky directory, so it cannot be replaced; \
                 choose another name",
                existing.uid()
            )));
        }
    }
    #[cfg(not(unix))]
    let _ = existing;
    drop(probe);
    Ok(())
}

/// Writes `bytes` to `path` whole or not at all: into a new file beside it with an unpredictable name, created
/// exclusively ([`temp_beside`]), then renamed over `path` (`rename(2)` is atomic, and replaces a symbolic link at
/// `path` instead of writing through it), so a failure (a full disk, a kill) leaves the old file as it was and
/// another user's link or planted file in a shared directory is never followed. A regular file being replaced
/// keeps its permissions.
pub fn write_atomically(path: &Path, bytes: &[u8], flag: &str, what: &str) -> Result<()> {
    let fail = |m: String| config(path, format!("cannot write {what} ({flag}): {m}"));
    let mut tmp = temp_beside(path).map_err(|e| fail(e.to_string()))?;
    let written = (|| -> std::io::Result<()> {
        tmp.as_file_mut().write_all(bytes)?;
        // An existing regular file keeps its permissions (lstat: never a link's target's).
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            if meta.is_file() {
                tmp.as_file().set_permissions(meta.permissions())?;
            }
        }
        tmp.as_file().sync_all()
    })();
    // on failure `tmp` is dropped here, which removes it
    written.map_err(|e| fail(e.to_string()))?;
    tmp.persist(path).map(drop).map_err(|e| fail(e.error.to_string()))
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::path::PathBuf;

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

    /// Another user's links in a shared directory: one at the target and one at each name the old code would
    /// have used for its temporary file. None is followed; the target's link is replaced by the new file.
    #[test]
    fn planted_links_are_replaced_never_followed() {
        let d = dir("links");
        let victim = d.join("victim");
        std::fs::write(&victim, "precious").expect("write");
        let p = d.join("t.toml");
        std::os::unix::fs::symlink(&victim, &p).expect("symlink at the target");
        let pid = std::process::id();
        let planted: Vec<PathBuf> =
            ["tmp", "check"].iter().map(|tag| d.join(format!(".t.toml.anyccl-{pid}.{tag}"))).collect();
        for link in &planted {
            std::os::unix::fs::symlink(&victim, link).expect("symlink at a predictable name");
        }
        check_writable(&p, "--out", "the table").expect("a link at the target is fine: it is replaced");
        write_atomically(&p, b"table", "--out", "the table").expect("written");
        assert_eq!(std::fs::read_to_string(&victim).expect("read"), "precious", "the link was not written through");
        let meta = std::fs::symlink_metadata(&p).expect("lstat");
        assert!(meta.is_file(), "the target is now a regular file, not the link");
        assert_eq!(std::fs::read(&p).expect("read"), b"table");
        for link in &planted {
            assert!(std::fs::symlink_metadata(link).expect("still there").file_type().is_symlink());
        }
        // a dangling link (to where another user might create a file later) is replaced too
        let q = d.join("u.toml");
        std::os::unix::fs::symlink(d.join("later"), &q).expect("symlink");
        write_atomically(&q, b"x", "--out", "the table").expect("written");
        assert!(!d.join("later").exists(), "nothing was created through the dangling link");
        assert_eq!(std::fs::read(&q).expect("read"), b"x");
        // nothing else is left behind: the victim, t.toml, u.toml and the two planted links
        let left = std::fs::read_dir(&d).expect("list").count();
        assert_eq!(left, 5);
        std::fs::remove_dir_all(&d).ok();
    }

    /// The temporary names differ from call to call and from the old `<name>.anyccl-<pid>` form.
    #[test]
    fn temporary_names_are_unpredictable() {
        let d = dir("names");
        let p = d.join("t.toml");
        let a = temp_beside(&p).expect("temp");
        let b = temp_beside(&p).expect("temp");
        assert_ne!(a.path(), b.path());
        for t in [&a, &b] {
            let name = t.path().file_name().expect("name").to_string_lossy().into_owned();
            assert!(name.starts_with(".t.toml.") && name.ends_with(".anyccl-tmp"), "{name}");
            assert!(!name.contains(&std::process::id().to_string()), "{name}");
            assert_eq!(t.path().parent(), Some(d.as_path()), "beside the target");
        }
        drop((a, b));
        std::fs::remove_dir_all(&d).ok();
    }
}
