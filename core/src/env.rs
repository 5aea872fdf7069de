//! Reading anyccl's environment variables through one checked reader: a value that is not valid UTF-8 is an
//! [`Error::Config`] naming its variable (never read lossily, never taken as unset), and every size read from the
//! environment has an upper bound.
//!
//! Secrets and paths are the exception: they are bytes, and their readers take them as the operating system gives
//! them (`std::env::var_os`), without any conversion. [`check_process_env`] knows which variables those are.

use std::ffi::OsString;

use crate::error::{Error, Result};
use crate::units::{format_bytes, parse_bytes};

/// The prefix of anyccl's own variables.
pub const PREFIX: &str = "ANYCCL_";

/// Variables read elsewhere that anyccl also reads as text.
pub const OTHER_TEXT_VARS: &[&str] =
    &["NCCL_NVLS_ENABLE", "NCCL_CUMEM_ENABLE", "NCCL_WIN_ENABLE", "NCCL_ALGO", "NCCL_PROTO"];

/// The largest `ANYCCL_CUSTOM_MAX_BYTES` accepted (1 GiB): each rank allocates staging and scratch buffers of this
/// size on its GPU and maps every peer's, so a typo such as `64GiB` for `64MiB` must be an error naming the
/// variable rather than an out-of-memory failure (or a huge mapping) at setup.
pub const MAX_CUSTOM_MAX_BYTES: u64 = 1 << 30;

/// The smallest `ANYCCL_CUSTOM_MAX_BYTES` accepted (16 bytes, one vector of the custom kernels).
pub const MIN_CUSTOM_MAX_BYTES: u64 = 16;

/// The variable naming the custom kernels' staging size.
pub const CUSTOM_MAX_BYTES_VAR: &str = "ANYCCL_CUSTOM_MAX_BYTES";

fn config(var: &str, message: impl Into<String>) -> Error {
    Error::Config { source_name: var.to_owned(), line: None, message: message.into() }
}

/// `value` (of the variable `name`) as text: `None` when unset, an error naming `name` when it is not UTF-8.
pub fn text(name: &str, value: Option<OsString>) -> Result<Option<String>> {
    match value.map(OsString::into_string) {
        None => Ok(None),
        Some(Ok(text)) => Ok(Some(text)),
        Some(Err(_)) => Err(config(name, "the value is not valid UTF-8")),
    }
}

/// The process's variable `name` as text (`std::env::var_os`, then [`text`]): `None` when unset, an error naming
/// `name` when it is not UTF-8.
pub fn var(name: &str) -> Result<Option<String>> {
    text(name, std::env::var_os(name))
}

/// The process environment for code that takes an environment reader (`&dyn Fn(&str) -> Option<String>`, so tests
/// can inject one): each variable is read through [`var`], and the first one whose value is not UTF-8 is kept, to be
/// returned by [`CheckedEnv::finish`] (it reads as unset meanwhile). A reader that cannot fail is thus never lossy:
///
/// ```
/// let env = anyccl_core::env::CheckedEnv::new();
/// let nvls = env.get("NCCL_NVLS_ENABLE");
/// env.finish()?; // an error naming the variable if one read was not UTF-8
/// # let _ = nvls;
/// # Ok::<(), anyccl_core::Error>(())
/// ```
#[derive(Debug, Default)]
pub struct CheckedEnv {
    first_error: std::sync::Mutex<Option<Error>>,
}

impl CheckedEnv {
    /// A reader of the process environment with no error yet.
    pub fn new() -> Self {
        CheckedEnv::default()
    }

    /// The variable `name` as text; `None` when unset, and when not UTF-8 (then kept for [`CheckedEnv::finish`]).
    pub fn get(&self, name: &str) -> Option<String> {
        self.check(var(name))
    }

    /// [`CheckedEnv::get`] over a value already read (by [`var`] or [`text`], whose error names the variable): for
    /// tests and for readers that take the environment from elsewhere.
    pub fn check(&self, value: Result<Option<String>>) -> Option<String> {
        match value {
            Ok(v) => v,
            Err(e) => {
                let mut first = self.first_error.lock().unwrap_or_else(|p| p.into_inner());
                first.get_or_insert(e);
                None
            }
        }
    }

    /// `Ok` when every variable read was unset or text, else the error naming the first that was not.
    pub fn finish(self) -> Result<()> {
        match self.first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }
}

/// Whether anyccl reads `name` as bytes or as a path (a secret, a file, a directory, a library): such a value may
/// be anything the operating system allows.
pub fn is_bytes_var(name: &str) -> bool {
    ["_KEY", "_FILE", "_PATH", "_DIR", "_LIB"].iter().any(|end| name.ends_with(end))
        // reported by name as a warning by the logging set-up, which runs before anything can fail
        || name == "ANYCCL_LOG"
}

/// Checks `vars` (name, value pairs such as `std::env::vars_os()`): every `ANYCCL_*` variable and each of
/// [`OTHER_TEXT_VARS`] that is set must be valid UTF-8, except those [`is_bytes_var`] names. The first one that is
/// not is an [`Error::Config`] naming it.
pub fn check_vars(vars: impl IntoIterator<Item = (OsString, OsString)>) -> Result<()> {
    for (name, value) in vars {
        let Some(name) = name.to_str() else { continue };
        let ours = name.starts_with(PREFIX) || OTHER_TEXT_VARS.contains(&name);
        if ours && !is_bytes_var(name) && value.to_str().is_none() {
            return Err(config(name, "the value is not valid UTF-8"));
        }
    }
    Ok(())
}

/// [`check_vars`] over this process's environment.
pub fn check_process_env() -> Result<()> {
    check_vars(std::env::vars_os())
}

/// A byte size from the variable `var` (text as [`parse_bytes`] reads it), within `min..=max`; anything else is an
/// [`Error::Config`] naming the variable and the bounds.
pub fn bounded_size(var: &str, value: &str, min: u64, max: u64) -> Result<u64> {
    let bytes = parse_bytes(value).map_err(|e| config(var, e.to_string()))?;
    if bytes < min || bytes > max {
        return Err(config(
            var,
            format!(
                "{} is outside the accepted range {} to {} ({min} to {max} bytes)",
                format_bytes(bytes),
                format_bytes(min),
                format_bytes(max)
            ),
        ));
    }
    Ok(bytes)
}

/// The custom kernels' staging size: [`CUSTOM_MAX_BYTES_VAR`] read through `env`, or `default` when it is unset;
/// within [`MIN_CUSTOM_MAX_BYTES`]`..=`[`MAX_CUSTOM_MAX_BYTES`], rounded up to a multiple of 16 bytes.
pub fn custom_max_bytes(env: &dyn Fn(&str) -> Option<String>, default: usize) -> Result<usize> {
    let Some(value) = env(CUSTOM_MAX_BYTES_VAR) else { return Ok(default) };
    let bytes = bounded_size(CUSTOM_MAX_BYTES_VAR, &value, MIN_CUSTOM_MAX_BYTES, MAX_CUSTOM_MAX_BYTES)?;
    // at most 1 GiB, so the rounding cannot overflow and the result fits a usize on every supported target
    let rounded = bytes.next_multiple_of(16);
    usize::try_from(rounded).map_err(|_| config(CUSTOM_MAX_BYTES_VAR, "the size does not fit this platform"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn a_checked_reader_keeps_the_first_variable_that_is_not_text() {
        let env = CheckedEnv::new();
        assert_eq!(env.check(Ok(Some("1".into()))), Some("1".into()));
        assert_eq!(env.check(Ok(None)), None);
        assert_eq!(env.check(text("NCCL_ALGO", Some(bytes(b"ring\xff")))), None);
        assert_eq!(env.check(text("NCCL_PROTO", Some(bytes(b"\xfe")))), None);
        let e = env.finish().expect_err("a value that is not UTF-8");
        assert!(matches!(&e, Error::Config { source_name, .. } if source_name == "NCCL_ALGO"), "{e:?}");
        assert!(e.to_string().contains("NCCL_ALGO"), "{e}");
        let env = CheckedEnv::new();
        assert_eq!(env.check(Ok(Some("x".into()))), Some("x".into()));
        assert!(env.finish().is_ok());
    }

    #[cfg(unix)]
    fn bytes(b: &[u8]) -> OsString {
        use std::os::unix::ffi::OsStringExt;
        OsString::from_vec(b.to_vec())
    }

    #[cfg(unix)]
    #[test]
    fn a_value_that_is_not_utf8_is_an_error_naming_its_variable() {
        assert_eq!(text("ANYCCL_X", None).expect("unset"), None);
        assert_eq!(text("ANYCCL_X", Some("a".into())).expect("text"), Some("a".into()));
        match text("ANYCCL_DISABLE", Some(bytes(b"ccl\xfe"))) {
            Err(Error::Config { source_name, message, .. }) => {
                assert_eq!(source_name, "ANYCCL_DISABLE");
                assert!(message.contains("not valid UTF-8"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        let bad = |name: &str| vec![("PATH".into(), "/bin".into()), (name.into(), bytes(b"\xff"))];
        for name in ["ANYCCL_DISABLE", "ANYCCL_CUSTOM_MAX_BYTES", "ANYCCL_ALLREDUCE_ALGO", "NCCL_NVLS_ENABLE"] {
            let e = check_vars(bad(name)).expect_err(name);
            assert!(matches!(&e, Error::Config { source_name, .. } if source_name == name), "{e:?}");
        }
        // secrets, paths and other programs' variables are not ours to judge
        for name in ["ANYCCL_RENDEZVOUS_KEY", "ANYCCL_TUNE_FILE", "ANYCCL_NCCL_PATH", "HOME", "LANG", "ANYCCL_LOG"] {
            check_vars(bad(name)).expect(name);
        }
    }

    #[test]
    fn sizes_from_the_environment_are_bounded() {
        let env = |v: &'static str| move |k: &str| (k == CUSTOM_MAX_BYTES_VAR).then(|| v.to_owned());
        assert_eq!(custom_max_bytes(&|_| None, 8 << 20).expect("default"), 8 << 20);
        assert_eq!(custom_max_bytes(&env("64MiB"), 0).expect("64 MiB"), 64 << 20);
        assert_eq!(custom_max_bytes(&env("1000"), 0).expect("rounded"), 1008);
        assert_eq!(custom_max_bytes(&env("1GiB"), 0).expect("the largest"), 1 << 30);
        for bad in ["1GiB1", "1.5GiB", "64GiB", "18446744073709551615", "15", "0", "lots", ""] {
            match custom_max_bytes(&env(bad), 0) {
                Err(Error::Config { source_name, message, .. }) => {
                    assert_eq!(source_name, CUSTOM_MAX_BYTES_VAR, "{bad}: {message}")
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        let e = custom_max_bytes(&env("64GiB"), 0).expect_err("too big");
        assert!(e.to_string().contains("1 GiB"), "{e}");
    }
}
