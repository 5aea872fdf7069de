//! Graph capture, written once for every GPU runtime: the one refusal that every call which is not capture-safe
//! gets ([`refuse`], [`InvalidArgument::DuringCapture`]), and [`KnownStreams`], the streams a runtime watches so
//! that calls which take no stream (allocation, freeing, registration) can tell whether a capture would be broken
//! by them.
//!
//! The rule is the CUDA driver's, and HIP follows it. While a stream is being captured into a graph,
//! "potentially unsafe" calls (a synchronous allocation or free, a synchronous copy, a synchronize, opening an IPC
//! handle, loading a module) are refused by the driver with code 900 **and the capture is invalidated** (ending it
//! then fails with 901) when they come from the thread that began a global- or thread-local-mode capture, or from
//! any thread while a global-mode capture runs. A relaxed-mode capture refuses nothing. Querying or synchronizing
//! the capturing stream itself is refused in every mode.
//!
//! anyccl refuses such calls itself, before the driver sees them, whenever it can see a capture they would break:
//! - a capture that anyccl's own graph helpers began ([`KnownStreams::began_capture`] records its mode and thread):
//!   refused on that thread unless the capture is relaxed, and on every thread when it is global, as the driver
//!   does;
//! - a capture on a stream the runtime knows (one it made, or an engine's stream it wraps) that something else
//!   began: its mode and thread are unknown, so it counts as global and the call is refused on every thread;
//! - calls that take a stream also ask that stream first (`upload`, `download`, `wait`, `query`).
//!
//! A capture on a stream anyccl has never been given cannot be found without a call that would itself break it.
//! The GPU runtimes therefore make their own allocation in relaxed capture mode (`cuThreadExchangeStreamCaptureMode`
//! / `hipThreadExchangeStreamCaptureMode`), so that even such a capture is not invalidated by anyccl: the
//! allocation then succeeds outside the graph, as an allocation made just before the capture would.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::thread::ThreadId;

use crate::error::{Error, InvalidArgument, Result};
use crate::runtime::CaptureMode;

/// The error of a call refused because a capture is running: [`InvalidArgument::DuringCapture`] naming `what`.
pub fn refuse(what: &'static str) -> Error {
    Error::InvalidArgument(InvalidArgument::DuringCapture { what })
}

/// [`refuse`] when `capturing`, else `Ok`.
pub fn refuse_if(what: &'static str, capturing: bool) -> Result<()> {
    if capturing {
        return Err(refuse(what));
    }
    Ok(())
}

/// A stream registered with [`KnownStreams::register`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StreamKey(u64);

/// A capture that anyccl began on a known stream: its mode and the thread that began it.
#[derive(Debug, Clone, Copy)]
struct Began {
    mode: CaptureMode,
    thread: ThreadId,
}

impl Began {
    /// Whether this capture makes the driver refuse (and be invalidated by) a potentially unsafe call on `thread`.
    fn blocks(&self, thread: ThreadId) -> bool {
        match self.mode {
            CaptureMode::Global => true,
            CaptureMode::ThreadLocal => self.thread == thread,
            CaptureMode::Relaxed => false,
        }
    }
}

#[derive(Debug)]
struct Entry {
    key: u64,
    /// The raw stream handle, as an integer (it is handed back to the runtime's query only).
    handle: usize,
    began: Option<Began>,
}

#[derive(Debug, Default)]
struct Entries {
    next: u64,
    list: Vec<Entry>,
}

/// The streams of one runtime that are alive now (made by it, or borrowed from an engine and wrapped), and the
/// captures anyccl began on them: what a call that takes no stream consults before it does anything that a
/// capture forbids ([`KnownStreams::check`]). A runtime registers a stream when it makes or wraps it and
/// unregisters it when the wrapper drops.
#[derive(Debug)]
pub struct KnownStreams {
    entries: Mutex<Entries>,
}

impl Default for KnownStreams {
    fn default() -> Self {
        Self::new()
    }
}

impl KnownStreams {
    /// No streams yet (usable in a `static`).
    pub const fn new() -> Self {
        KnownStreams { entries: Mutex::new(Entries { next: 0, list: Vec::new() }) }
    }

    fn lock(&self) -> MutexGuard<'_, Entries> {
        // A panic while holding the lock (in a runtime's query) leaves a consistent list behind.
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds the stream with raw handle `handle`; it stays known until [`KnownStreams::unregister`].
    pub fn register(&self, handle: usize) -> StreamKey {
        let mut e = self.lock();
        let key = e.next;
        e.next = e.next.wrapping_add(1);
        e.list.push(Entry { key, handle, began: None });
        StreamKey(key)
    }

    /// Forgets a stream (its wrapper is dropping). Unknown keys are ignored.
    pub fn unregister(&self, key: StreamKey) {
        self.lock().list.retain(|e| e.key != key.0);
    }

    /// How many streams are known now.
    pub fn len(&self) -> usize {
        self.lock().list.len()
    }

    /// Whether no stream is known now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records that anyccl began a capture in `mode` on the stream `key` on this thread, until the returned scope
    /// drops (call it right after the driver accepted the begin, drop it right after the end). With the mode and
    /// thread known, the capture blocks exactly the calls the driver would refuse.
    pub fn began_capture(&self, key: StreamKey, mode: CaptureMode) -> CaptureScope<'_> {
        let thread = std::thread::current().id();
        if let Some(e) = self.lock().list.iter_mut().find(|e| e.key == key.0) {
            e.began = Some(Began { mode, thread });
        }
        CaptureScope { streams: self, key }
    }

    /// Whether a capture that a potentially unsafe call on this thread would break is running on a known stream.
    /// `is_capturing` asks the runtime about one raw handle (a query that is legal during capture, such as
    /// `cuStreamIsCapturing`); it is asked only about streams whose capture anyccl did not begin itself. Its
    /// error is returned.
    pub fn capture_blocks_this_thread(&self, is_capturing: &mut dyn FnMut(usize) -> Result<bool>) -> Result<bool> {
        let thread = std::thread::current().id();
        let e = self.lock();
        for entry in &e.list {
            let blocked = match entry.began {
                Some(b) => b.blocks(thread),
                // Begun by someone else: mode and thread unknown, so it counts as global.
                None => is_capturing(entry.handle)?,
            };
            if blocked {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Refuses `what` ([`refuse`]) while a capture that it would break runs on a known stream
    /// ([`KnownStreams::capture_blocks_this_thread`]).
    pub fn check(&self, what: &'static str, is_capturing: &mut dyn FnMut(usize) -> Result<bool>) -> Result<()> {
        refuse_if(what, self.capture_blocks_this_thread(is_capturing)?)
    }
}

/// A capture anyccl began on a known stream ([`KnownStreams::began_capture`]); forgotten when dropped.
#[derive(Debug)]
pub struct CaptureScope<'a> {
    streams: &'a KnownStreams,
    key: StreamKey,
}

impl Drop for CaptureScope<'_> {
    fn drop(&mut self) {
        if let Some(e) = self.streams.lock().list.iter_mut().find(|e| e.key == self.key.0) {
            e.began = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_refusal_for_every_call() {
        assert!(refuse_if("x", false).is_ok());
        let e = refuse_if("MemoryRuntime::alloc (cuMemAlloc)", true).expect_err("refused");
        assert_eq!(
            e,
            Error::InvalidArgument(InvalidArgument::DuringCapture { what: "MemoryRuntime::alloc (cuMemAlloc)" })
        );
        let text = e.to_string();
        assert!(text.starts_with("invalid argument: MemoryRuntime::alloc (cuMemAlloc) is not allowed while a stream"));
        assert!(text.contains("before the capture begins"), "{text}");
    }

    #[test]
    fn captures_anyccl_began_block_what_the_driver_would_refuse() {
        let streams = KnownStreams::new();
        let a = streams.register(0xa);
        let _b = streams.register(0xb);
        let mut asked = Vec::new();
        let mut never = |h: usize| -> Result<bool> {
            asked.push(h);
            Ok(false)
        };
        assert!(!streams.capture_blocks_this_thread(&mut never).expect("query"));
        assert_eq!(asked, [0xa, 0xb], "streams nobody captured through anyccl are asked");
        let on_other_thread = |s: &KnownStreams| {
            std::thread::scope(|sc| {
                sc.spawn(|| s.capture_blocks_this_thread(&mut |_| Ok(false)).expect("query")).join().expect("thread")
            })
        };
        for (mode, here, elsewhere) in [
            (CaptureMode::Global, true, true),
            (CaptureMode::ThreadLocal, true, false),
            (CaptureMode::Relaxed, false, false),
        ] {
            let scope = streams.began_capture(a, mode);
            let mut asked_a = false;
            let blocked = streams
                .capture_blocks_this_thread(&mut |h| {
                    asked_a |= h == 0xa;
                    Ok(false)
                })
                .expect("query");
            assert!(!asked_a, "{mode:?}: a capture anyccl began is not asked about");
            assert_eq!((blocked, on_other_thread(&streams)), (here, elsewhere), "{mode:?}");
            let refused = streams.check("alloc", &mut |_| Ok(false));
            assert_eq!(refused.is_err(), here, "{mode:?}");
            drop(scope);
            assert!(!streams.capture_blocks_this_thread(&mut |_| Ok(false)).expect("query"), "{mode:?}: ended");
        }
    }

    #[test]
    fn a_capture_someone_else_began_counts_as_global_and_errors_are_returned() {
        let streams = KnownStreams::new();
        let a = streams.register(0xa);
        // The runtime says the stream captures: blocked on this thread and every other.
        assert!(streams.capture_blocks_this_thread(&mut |h| Ok(h == 0xa)).expect("query"));
        let elsewhere = std::thread::scope(|sc| {
            sc.spawn(|| streams.capture_blocks_this_thread(&mut |h| Ok(h == 0xa)).expect("query")).join()
        });
        assert!(elsewhere.expect("thread"));
        let failed = Error::PeerFailure("query failed".into());
        assert_eq!(streams.check("alloc", &mut |_| Err(failed.clone())), Err(failed));
        streams.unregister(a);
        assert!(streams.is_empty());
        assert!(!streams.capture_blocks_this_thread(&mut |_| Ok(true)).expect("nothing known, nothing asked"));
    }
}
