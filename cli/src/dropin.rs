//! `anyccl probe`'s report of the drop-in libnccl (`libanyccl_nccl.so`, built by the `anyccl-nccl` crate).
//!
//! Where it looks, in order, stopping at the first drop-in:
//! - `ANYCCL_DROPIN_PATH`, when set (an absolute path of the library, or of a folder holding `libanyccl_nccl.so`):
//!   the only place then;
//! - otherwise the folder of the running `anyccl` binary (`target/release` after
//!   `cargo build --release -p anyccl-cli -p anyccl-nccl`), then `../lib` beside it (an install prefix).
//!
//! A candidate is loaded only if it is a regular file whose dynamic symbol table exports the drop-in's marker,
//! `anyccl_nccl_dropin_marker`, and its report functions (checked by reading the file, before `dlopen`, with the
//! same checks anyccl's library search applies). It is then opened with `dlopen` (`RTLD_LOCAL`, so its `nccl*`
//! symbols stay out of the process's global scope) and asked for its marker version and what it forwards to
//! (`anyccl_nccl_dropin_underlying`, which makes the drop-in run its own search for the real NCCL or RCCL). Loading a
//! library runs its code: the places searched are the user's own (the variable, the binary's folder), as for
//! `ANYCCL_NCCL_PATH`. The `anyccl` command does not depend on the `anyccl-nccl` crate; it only opens its file.

use std::ffi::{c_char, c_int, CStr};
use std::path::{Path, PathBuf};

use anyccl::ccl::find::{self, Exports};

/// The drop-in's file name.
pub const FILE_NAME: &str = "libanyccl_nccl.so";
/// The variable naming the drop-in (file or folder).
pub const ENV_PATH: &str = "ANYCCL_DROPIN_PATH";
/// The longest text kept from the drop-in (bytes).
const MAX_TEXT: usize = 4096;

/// The symbols a candidate must export to be loaded.
const EXPORTS: Exports<'static> = Exports {
    required: &["anyccl_nccl_dropin_marker", "anyccl_nccl_dropin_underlying", "ncclGetLastError"],
    optional: &["anyccl_nccl_dropin_calls", "anyccl_nccl_dropin_no_log_subscriber"],
};

/// A place looked at and why it was not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tried {
    /// The path.
    pub candidate: PathBuf,
    /// Where the path came from.
    pub origin: &'static str,
    /// Why it was not used.
    pub failure: String,
}

/// What `anyccl probe` found of the drop-in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DropinReport {
    /// The drop-in loaded: its path and where the path came from.
    pub found: Option<(PathBuf, &'static str)>,
    /// Its marker version (`anyccl_nccl_dropin_marker()`).
    pub marker: Option<i32>,
    /// What it forwards to (`"NCCL 2.28.9 /path/libnccl.so.2"`), `None` when it found nothing.
    pub underlying: Option<String>,
    /// When it found nothing underneath: the drop-in's `ncclGetLastError` text (every place it tried).
    pub underlying_error: Option<String>,
    /// The places refused before, or all of them when none was a drop-in.
    pub tried: Vec<Tried>,
}

/// The places to look at, given `ANYCCL_DROPIN_PATH` and the running binary's path.
pub fn candidates(env_path: Option<PathBuf>, exe: Option<PathBuf>) -> Vec<(PathBuf, &'static str)> {
    if let Some(p) = env_path {
        let p = if p.is_dir() { p.join(FILE_NAME) } else { p };
        return vec![(p, ENV_PATH)];
    }
    let Some(dir) = exe.as_deref().and_then(Path::parent) else { return Vec::new() };
    let mut v = vec![(dir.join(FILE_NAME), "beside the anyccl binary")];
    if let Some(prefix) = dir.parent() {
        v.push((prefix.join("lib").join(FILE_NAME), "the lib folder beside the anyccl binary's"));
    }
    v
}

/// Copies a C string the drop-in returned, at most [`MAX_TEXT`] bytes (lossy UTF-8).
///
/// # Safety
/// `p` is null or a NUL-terminated string that stays valid during the call.
unsafe fn text(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the caller's contract.
    let bytes = unsafe { CStr::from_ptr(p) }.to_bytes();
    let cut = &bytes[..bytes.len().min(MAX_TEXT)];
    Some(String::from_utf8_lossy(cut).into_owned())
}

/// Looks for the drop-in in the places of [`candidates`] (the process's environment and binary).
pub fn probe() -> DropinReport {
    let env_path = std::env::var_os(ENV_PATH).filter(|v| !v.is_empty()).map(PathBuf::from);
    probe_in(candidates(env_path, std::env::current_exe().ok()))
}

fn probe_in(places: Vec<(PathBuf, &'static str)>) -> DropinReport {
    let mut report =
        DropinReport { found: None, marker: None, underlying: None, underlying_error: None, tried: Vec::new() };
    for (path, origin) in places {
        let refuse = |failure: String| Tried { candidate: path.clone(), origin, failure };
        if !path.is_absolute() {
            report.tried.push(refuse(format!("{ENV_PATH} must be an absolute path")));
            continue;
        }
        let lib = match find::open_checked(&path, &EXPORTS) {
            Ok(lib) => lib,
            Err(e) => {
                report.tried.push(refuse(e.to_string()));
                continue;
            }
        };
        // SAFETY: the file exports anyccl_nccl_dropin_marker (checked in its symbol table before it was opened), so
        // it is an anyccl drop-in, whose exports have these C signatures (anyccl-nccl's lib.rs): `int
        // anyccl_nccl_dropin_marker(void)`, `const char* anyccl_nccl_dropin_underlying(void)` (a string that lives
        // as long as the process) and nccl.h's `const char* ncclGetLastError(ncclComm_t)` (null allowed; valid
        // until the next failing call on this thread), and `void anyccl_nccl_dropin_no_log_subscriber(void)` where
        // it exists. Each is called once here, on this thread.
        unsafe {
            type Marker = unsafe extern "C" fn() -> c_int;
            type Underlying = unsafe extern "C" fn() -> *const c_char;
            type LastError = unsafe extern "C" fn(*mut std::ffi::c_void) -> *const c_char;
            type NoLogSubscriber = unsafe extern "C" fn();
            // This command has its own log subscriber and has warned about a bad ANYCCL_LOG already.
            if let Ok(f) = lib.get::<NoLogSubscriber>(b"anyccl_nccl_dropin_no_log_subscriber\0") {
                f();
            }
            let marker = lib.get::<Marker>(b"anyccl_nccl_dropin_marker\0").ok().map(|f| f());
            let underlying = lib.get::<Underlying>(b"anyccl_nccl_dropin_underlying\0").ok().and_then(|f| text(f()));
            let underlying = underlying.filter(|u| !u.is_empty());
            if underlying.is_none() {
                report.underlying_error =
                    lib.get::<LastError>(b"ncclGetLastError\0").ok().and_then(|f| text(f(std::ptr::null_mut())));
            }
            report.marker = marker;
            report.underlying = underlying;
        }
        // Never closed: the drop-in keeps the library it forwards to (and that library's threads) loaded for the
        // life of the process, and a Rust library with thread-local destructors must not be unloaded.
        std::mem::forget(lib);
        report.found = Some((path, origin));
        return report;
    }
    report
}

impl DropinReport {
    /// The report as JSON (the `dropin` key of `anyccl probe --json`).
    pub fn to_json(&self) -> serde_json::Value {
        let tried: Vec<serde_json::Value> = self
            .tried
            .iter()
            .map(|t| {
                serde_json::json!({
                    "candidate": t.candidate.display().to_string(),
                    "origin": t.origin,
                    "failure": t.failure,
                })
            })
            .collect();
        serde_json::json!({
            "found": self.found.is_some(),
            "path": self.found.as_ref().map(|(p, _)| p.display().to_string()),
            "origin": self.found.as_ref().map(|(_, o)| *o),
            "marker": self.marker,
            "underlying": self.underlying,
            "underlying_error": self.underlying_error,
            "tried": tried,
        })
    }

    /// The report as text (a section of `anyccl probe`).
    pub fn render_text(&self) -> String {
        use std::fmt::Write;
        let mut s = String::from("\nDrop-in libnccl (anyccl-nccl):\n");
        match &self.found {
            Some((p, origin)) => {
                let marker = self.marker.map_or_else(|| "?".to_owned(), |m| m.to_string());
                let _ = writeln!(s, "  {:<12} {} ({origin}; marker {marker})", "found", p.display());
                match (&self.underlying, &self.underlying_error) {
                    (Some(u), _) => {
                        let _ = writeln!(s, "  {:<12} {u}", "forwards to");
                    }
                    (None, e) => {
                        let why = e.as_deref().unwrap_or("(no reason given)");
                        let _ = writeln!(s, "  {:<12} nothing: {why}", "forwards to");
                    }
                }
            }
            None => {
                let _ = writeln!(
                    s,
                    "  not found (build it with `cargo build --release -p anyccl-nccl`, or set {ENV_PATH} to it)"
                );
            }
        }
        for t in &self.tried {
            let _ = writeln!(s, "  {:<12} tried {} ({}): {}", "", t.candidate.display(), t.origin, t.failure);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_alone_or_the_binary_folder_then_its_lib_folder() {
        let exe = Some(PathBuf::from("/opt/x/bin/anyccl"));
        assert_eq!(
            candidates(None, exe.clone()),
            [
                (PathBuf::from("/opt/x/bin/libanyccl_nccl.so"), "beside the anyccl binary"),
                (PathBuf::from("/opt/x/lib/libanyccl_nccl.so"), "the lib folder beside the anyccl binary's")
            ]
        );
        assert_eq!(
            candidates(Some(PathBuf::from("/nonexistent/libx.so")), exe),
            [(PathBuf::from("/nonexistent/libx.so"), ENV_PATH)]
        );
        // A folder names the file in it.
        let dir = std::env::temp_dir();
        assert_eq!(candidates(Some(dir.clone()), None), [(dir.join(FILE_NAME), ENV_PATH)]);
        assert!(candidates(None, None).is_empty());
    }

    #[test]
    fn a_relative_or_missing_path_is_refused_with_the_reason_and_nothing_loaded() {
        let r = probe_in(vec![(PathBuf::from("libanyccl_nccl.so"), ENV_PATH)]);
        assert!(r.found.is_none());
        assert_eq!(r.tried[0].failure, "ANYCCL_DROPIN_PATH must be an absolute path");
        let r = probe_in(vec![(PathBuf::from("/nonexistent/anyccl/libanyccl_nccl.so"), ENV_PATH)]);
        assert!(r.found.is_none());
        assert_eq!(r.tried.len(), 1);
        assert!(r.render_text().contains("not found (build it with `cargo build --release -p anyccl-nccl`"));
        assert_eq!(r.to_json()["found"], false);
    }
}
