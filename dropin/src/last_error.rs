//! The drop-in's own failures: a result code and a text that `ncclGetLastError` returns on the same thread.
//!
//! A call the drop-in answers itself (no underlying library, a function the library lacks, a handle it did not
//! create, a caught panic) stores its text here and marks the thread; every call forwarded to the underlying
//! library clears the mark, so `ncclGetLastError` then forwards. `ncclGetErrorString` and `ncclGetLastError` leave
//! the mark alone: they are how a caller asks about the failure just reported.
//!
//! **Lifetime of the text.** NCCL's `ncclGetLastError` returns a static buffer that a later failure overwrites: the
//! pointer stays valid for the life of the process, only its contents change. The drop-in gives the same
//! guarantee: each thread writes into a fixed buffer of [`MAX_MESSAGE_BYTES`] + 1 bytes that is never freed (a
//! later failure on that thread overwrites it in place; when the thread ends its buffer goes to a pool that the
//! next thread to fail reuses). A pointer the drop-in returned can therefore always be read; like NCCL's, it shows
//! the newest text written into that buffer.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, CString};
use std::sync::Mutex;

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

/// One thread's text: [`MAX_MESSAGE_BYTES`] bytes and the terminating NUL, allocated once and never freed.
type Buffer = [u8; MAX_MESSAGE_BYTES + 1];

/// Buffers of threads that have ended, for the next thread that fails a call (so a program that starts many
/// threads keeps only as many buffers as it ever had failing threads at once).
static POOL: Mutex<Vec<&'static mut Buffer>> = Mutex::new(Vec::new());

/// A thread's buffer, handed back to [`POOL`] when the thread ends (the memory itself stays allocated).
struct Held(Option<&'static mut Buffer>);

impl Held {
    fn buffer(&mut self) -> &mut Buffer {
        self.0.get_or_insert_with(|| {
            let reused = POOL.lock().unwrap_or_else(|p| p.into_inner()).pop();
            reused.unwrap_or_else(|| Box::leak(Box::new([0u8; MAX_MESSAGE_BYTES + 1])))
        })
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(b) = self.0.take() {
            POOL.lock().unwrap_or_else(|p| p.into_inner()).push(b);
        }
    }
}

thread_local! {
    static OWN: Cell<bool> = const { Cell::new(false) };
    static MESSAGE: RefCell<Held> = const { RefCell::new(Held(None)) };
}

/// The last call on this thread was forwarded: `ncclGetLastError` forwards too.
#[inline]
pub fn forwarded() {
    // Ignored when the thread is being torn down (its locals are gone): nothing can ask afterwards.
    let _ = OWN.try_with(|o| o.set(false));
}

/// Writes `message` (bounded, NULs replaced) into this thread's buffer in place and returns the buffer's address.
fn write(message: &str) -> Option<*const c_char> {
    let text = to_c_string(message);
    MESSAGE
        .try_with(|m| {
            let mut held = m.borrow_mut();
            let buf = held.buffer();
            let bytes = text.as_bytes_with_nul();
            // `to_c_string` keeps the text within MAX_MESSAGE_BYTES, so it and its NUL fit.
            let n = bytes.len().min(buf.len());
            buf[..n].copy_from_slice(&bytes[..n]);
            buf[buf.len() - 1] = 0;
            buf.as_ptr().cast::<c_char>()
        })
        .ok()
}

/// Records `f` as this thread's last error and returns its code.
pub fn record(f: Failure) -> NcclResult {
    tracing::debug!(code = f.code, message = %f.message, "anyccl drop-in answered the call itself");
    if write(&f.message).is_some() {
        let _ = OWN.try_with(|o| o.set(true));
    }
    f.code
}

/// This thread's own last error, if the last call on it failed in the drop-in: a pointer that stays valid for the
/// life of the process (see the module documentation).
pub fn own() -> Option<*const c_char> {
    if !OWN.try_with(|o| o.get()).unwrap_or(false) {
        return None;
    }
    MESSAGE.try_with(|m| m.borrow_mut().buffer().as_ptr().cast::<c_char>()).ok()
}

/// Sets this thread's text without marking the thread (an answer to `ncclGetLastError` itself) and returns it.
pub fn answer(message: &str) -> *const c_char {
    write(message).unwrap_or(c"anyccl drop-in: no thread-local storage left on this thread".as_ptr())
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
pub(crate) mod tests {
    use super::*;

    /// Held by every unit test that records a failure: the pool hands a buffer of a thread that ended to the next
    /// thread that fails, so a test reading an ended thread's buffer must not run beside another that records.
    pub(crate) static SERIAL: Mutex<()> = Mutex::new(());

    pub(crate) fn serial() -> std::sync::MutexGuard<'static, ()> {
        SERIAL.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn read(p: *const c_char) -> String {
        // SAFETY: every pointer this module hands out points into a buffer that is never freed and always holds a
        // NUL within it.
        unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

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
        let _serial = serial();
        assert!(own().is_none());
        assert_eq!(record(Failure { code: 5, message: "nope".into() }), 5);
        let text = own().map(read);
        assert_eq!(text.as_deref(), Some("nope"));
        forwarded();
        assert!(own().is_none());
    }

    #[test]
    fn an_earlier_pointer_stays_readable_after_later_failures_and_after_its_thread_ended() {
        let _serial = serial();
        let long = "x".repeat(MAX_MESSAGE_BYTES * 2);
        let first = std::thread::spawn(move || {
            record(Failure { code: 4, message: "the first failure".into() });
            let p = own().expect("a text") as usize;
            // A longer text, then a shorter one: the same buffer, overwritten in place, NUL-terminated each time.
            record(Failure { code: 4, message: long });
            assert_eq!(own().map(|q| q as usize), Some(p));
            assert_eq!(read(p as *const c_char).len(), MAX_MESSAGE_BYTES);
            record(Failure { code: 5, message: "short".into() });
            assert_eq!(read(p as *const c_char), "short");
            p
        })
        .join()
        .expect("the thread ran");
        // The thread has ended: its buffer is still allocated (NCCL's text lives as long as the process).
        assert_eq!(read(first as *const c_char), "short");
        // Another thread may reuse it; the pointer then shows that thread's newest text, never freed memory.
        std::thread::spawn(|| record(Failure { code: 3, message: "a later thread".into() }))
            .join()
            .expect("the thread ran");
        let now = read(first as *const c_char);
        assert!(now == "short" || now == "a later thread", "{now}");
    }
}
