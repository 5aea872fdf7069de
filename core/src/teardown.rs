//! Closing a communicator without waiting for it: [`Teardown`], the handle of work that finishes on a thread of
//! its own ([`crate::Communicator::close_in_background`]).
//!
//! NCCL's own `ncclCommDestroy` took about 500 ms on an H200 (world 1, NCCL 2.28.3), long enough to stall an engine
//! that rebuilds sub-communicators. A backend that can, destroys its communicator on a named thread and returns a
//! [`Teardown`] at once; one with nothing slow to do finishes before it returns ([`Teardown::finished`]).
//!
//! At process exit: teardowns still running are counted ([`pending`]); the collective-library layer waits for them
//! (at most a bounded time) before the process's exit handlers unload the vendor libraries, and
//! [`wait_for_pending`] lets an engine do the same itself before it exits.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Teardowns started and not finished, in this process.
static PENDING: AtomicUsize = AtomicUsize::new(0);

/// Background teardowns started in this process and not finished yet.
pub fn pending() -> usize {
    PENDING.load(Ordering::SeqCst)
}

/// Waits until no background teardown is running, for at most `limit`; `true` when none is left.
///
/// It polls an atomic counter every millisecond and touches no thread-local state, so it may run in a process
/// exit handler (where Rust's thread-locals of the exiting thread are already gone).
pub fn wait_for_pending(limit: Duration) -> bool {
    let start = Instant::now();
    while PENDING.load(Ordering::SeqCst) > 0 {
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

#[derive(Default)]
struct State {
    result: Mutex<Option<Result<()>>>,
    done: Condvar,
}

impl State {
    fn lock(&self) -> MutexGuard<'_, Option<Result<()>>> {
        self.result.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Completes a teardown's state once: with the job's result, or with an error when the job's thread unwound.
struct Finisher {
    state: Option<Arc<State>>,
}

impl Finisher {
    fn finish(mut self, result: Result<()>) {
        if let Some(state) = self.state.take() {
            complete(&state, result);
        }
    }
}

impl Drop for Finisher {
    fn drop(&mut self) {
        if let Some(state) = self.state.take() {
            complete(&state, Err(Error::PeerFailure("the background teardown thread panicked".into())));
        }
    }
}

fn complete(state: &State, result: Result<()>) {
    *state.lock() = Some(result);
    state.done.notify_all();
    PENDING.fetch_sub(1, Ordering::SeqCst);
}

/// A communicator's teardown, running or finished: [`Teardown::is_done`], [`Teardown::wait`],
/// [`Teardown::wait_timeout`]. Clones share the same teardown. Dropping the handle does not stop or wait for it.
#[derive(Clone)]
pub struct Teardown {
    state: Arc<State>,
}

impl fmt::Debug for Teardown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Teardown").field("done", &self.is_done()).finish()
    }
}

impl Teardown {
    /// A teardown that has already finished with `result` (a backend with nothing left to do in the background).
    pub fn finished(result: Result<()>) -> Self {
        Teardown { state: Arc::new(State { result: Mutex::new(Some(result)), done: Condvar::new() }) }
    }

    /// Runs `job` on a new thread named `name` and returns at once. Everything `job` owns is dropped on that
    /// thread when it returns, before the teardown counts as done (so whatever it holds, such as a loaded library,
    /// stays alive until then). If no thread can be started, `job` runs here before this returns.
    pub fn spawn<F>(name: &str, job: F) -> Self
    where
        F: FnOnce() -> Result<()> + Send + 'static,
    {
        let state = Arc::new(State::default());
        PENDING.fetch_add(1, Ordering::SeqCst);
        // The job waits in a slot both sides can reach: if the thread cannot start, it is taken back and run here.
        let slot = Arc::new(Mutex::new(Some(job)));
        let (thread_slot, thread_state) = (slot.clone(), state.clone());
        let spawned = std::thread::Builder::new().name(name.to_owned()).spawn(move || {
            // Made first thing, so a panic of the job still completes the teardown (with an error).
            let finisher = Finisher { state: Some(thread_state) };
            let job = thread_slot.lock().unwrap_or_else(PoisonError::into_inner).take();
            drop(thread_slot);
            let result = job.map_or(Ok(()), |job| job());
            finisher.finish(result);
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, thread = name, "could not start a teardown thread; tearing down here");
            let job = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
            let finisher = Finisher { state: Some(state.clone()) };
            finisher.finish(job.map_or(Ok(()), |job| job()));
        }
        Teardown { state }
    }

    /// Whether the teardown has finished.
    pub fn is_done(&self) -> bool {
        self.state.lock().is_some()
    }

    /// Blocks until the teardown has finished, and returns its result (the library's status).
    pub fn wait(&self) -> Result<()> {
        let mut r = self.state.lock();
        loop {
            if let Some(r) = r.as_ref() {
                return r.clone();
            }
            r = self.state.done.wait(r).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Waits at most `limit` for the teardown: its result once finished, `None` while it still runs.
    pub fn wait_timeout(&self, limit: Duration) -> Option<Result<()>> {
        let guard = self.state.lock();
        let (r, _) =
            self.state.done.wait_timeout_while(guard, limit, |r| r.is_none()).unwrap_or_else(PoisonError::into_inner);
        r.clone()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;

    #[test]
    fn a_finished_teardown_is_done_at_once() {
        let t = Teardown::finished(Ok(()));
        assert!(t.is_done());
        assert_eq!(t.wait(), Ok(()));
        assert_eq!(t.wait_timeout(Duration::ZERO), Some(Ok(())));
        let failed = Teardown::finished(Err(Error::PeerFailure("x".into())));
        assert_eq!(failed.wait(), Err(Error::PeerFailure("x".into())));
    }

    #[test]
    fn a_spawned_teardown_runs_on_its_named_thread_and_drops_what_it_holds_there() {
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let held = Arc::new(());
        let weak = Arc::downgrade(&held);
        let t = Teardown::spawn("anyccl-test-teardown", move || {
            let _held = held;
            go_rx.recv().map_err(|_| Error::PeerFailure("gate dropped".into()))?;
            if std::thread::current().name() != Some("anyccl-test-teardown") {
                return Err(Error::PeerFailure("ran on the wrong thread".into()));
            }
            Err(Error::PeerFailure("the library's status".into()))
        });
        assert!(!t.is_done());
        assert_eq!(t.wait_timeout(Duration::from_millis(20)), None, "still running");
        assert!(weak.upgrade().is_some(), "what the job holds lives until it finishes");
        go_tx.send(()).expect("open the gate");
        let also = t.clone();
        assert_eq!(t.wait(), Err(Error::PeerFailure("the library's status".into())));
        assert!(also.is_done());
        assert!(weak.upgrade().is_none(), "dropped on the teardown thread before it counted as done");
        assert_eq!(also.wait_timeout(Duration::ZERO), Some(Err(Error::PeerFailure("the library's status".into()))));
    }

    #[test]
    fn a_panicking_job_completes_with_an_error_instead_of_hanging_its_waiters() {
        let t = Teardown::spawn("anyccl-test-panic", || -> Result<()> { panic!("boom") });
        let e = t.wait().expect_err("the job panicked");
        assert!(e.to_string().contains("panicked"), "{e}");
    }

    #[test]
    fn pending_teardowns_are_awaited_with_a_limit() {
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let t = Teardown::spawn("anyccl-test-pending", move || {
            let _ = go_rx.recv();
            Ok(())
        });
        assert!(pending() >= 1);
        assert!(!wait_for_pending(Duration::from_millis(10)), "one is still running");
        go_tx.send(()).expect("open the gate");
        t.wait().expect("finished");
    }
}
