//! The drop-in's own failures: a result code and a text that `ncclGetLastError` returns on the same thread.
//!
//! A call the drop-in answers itself (no underlying library, a function the library lacks, a caught panic) stores
//! its text here and marks the thread; every call forwarded to the underlying library clears the mark, so
//! `ncclGetLastError` then forwards. `ncclGetErrorString` and `ncclGetLastError` leave the mark alone: they are how a
//! caller asks about the failure just reported.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, CString};

use crate::api::NcclResult;

/// The longest text kept (bytes); a longer one is cut at a character boundary and ends in `…`.
pub const MAX_MESSAGE_BYTES: usize = 8192;

/// A call the drop-in failed itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The `ncclResult_t` returned.
    pub code: NcclResult,
    /// What `ncclGetLastError` says.
    pub message: String,
}

thread_local! {
    static OWN: Cell<bool> = const { Cell::new(false) };
    static MESSAGE: RefCell<CString> = RefCell::new(CString::default());
}

/// The last call on this thread was forwarded: `ncclGetLastError` forwards too.
#[inline]
pub fn forwarded() {
    // Ignored when the thread is being torn down (its locals are gone): nothing can ask afterwards.
    let _ = OWN.try_with(|o| o.set(false));
}

/// Records `f` as this thread's last error and returns its code.
pub fn record(f: Failure) -> NcclResult {
    tracing::debug!(code = f.code, message = %f.message, "anyccl drop-in answered the call itself");
    let text = to_c_string(&f.message);
    let _ = MESSAGE.try_with(|m| *m.borrow_mut() = text);
    let _ = OWN.try_with(|o| o.set(true));
    f.code
}

/// This thread's own last error, if the last call on it failed in the drop-in: a pointer valid until the next call
/// that the drop-in fails on this thread (the same lifetime NCCL gives its own text).
pub fn own() -> Option<*const c_char> {
    if !OWN.try_with(|o| o.get()).unwrap_or(false) {
        return None;
    }
    MESSAGE.try_with(|m| m.borrow().as_ptr()).ok()
}

/// Sets this thread's text without marking the thread (an answer to `ncclGetLastError` itself) and returns it.
pub fn answer(message: &str) -> *const c_char {
    let text = to_c_string(message);
    MESSAGE
        .try_with(|m| {
            *m.borrow_mut() = text;
            m.borrow().as_ptr()
        })
        .unwrap_or(c"anyccl drop-in: no thread-local storage left on this thread".as_ptr())
}

/// `message` as a C string: NUL bytes replaced, at most [`MAX_MESSAGE_BYTES`].
pub fn to_c_string(message: &str) -> CString {
    let mut s: String = message.replace('\0', "\u{FFFD}");
    if s.len() > MAX_MESSAGE_BYTES {
        let mut cut = MAX_MESSAGE_BYTES - '…'.len_utf8();
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    // No NUL is left (replaced above), so this cannot fail; the fallback keeps the function total anyway.
    CString::new(s).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_and_nul_messages_become_bounded_c_strings() {
        let c = to_c_string("a\0b");
        assert_eq!(c.to_str().ok(), Some("a\u{FFFD}b"));
        let long = "é".repeat(MAX_MESSAGE_BYTES);
        let c = to_c_string(&long);
        assert!(c.as_bytes().len() <= MAX_MESSAGE_BYTES, "{}", c.as_bytes().len());
        assert!(c.to_str().is_ok_and(|s| s.ends_with('…')));
    }

    #[test]
    fn the_mark_follows_the_last_call() {
        assert!(own().is_none());
        assert_eq!(record(Failure { code: 5, message: "nope".into() }), 5);
        // SAFETY: `own` returns this thread's live message.
        let text = own().map(|p| unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned());
        assert_eq!(text.as_deref(), Some("nope"));
        forwarded();
        assert!(own().is_none());
    }
}
