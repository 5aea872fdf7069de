//! Group synchronisation for host ranks: a barrier that fails (instead of hanging) when a peer leaves or a wait
//! times out, and a condition wait for point-to-point messages.
//!
//! Written by hand because `std::sync::Barrier` has neither a timeout nor a way to abort waiters, and a rank that
//! dies must not leave its peers blocked forever.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyccl_core::{Error, Result};

struct State {
    arrived: usize,
    generation: u64,
    /// Set once a rank leaves or times out; every later wait fails with it.
    broken: Option<String>,
}

pub(crate) struct GroupSync {
    world: usize,
    state: Mutex<State>,
    cv: Condvar,
}

impl GroupSync {
    pub(crate) fn new(world: usize) -> Self {
        GroupSync { world, state: Mutex::new(State { arrived: 0, generation: 0, broken: None }), cv: Condvar::new() }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Poisoning only means a thread panicked while holding the lock; the counters are still consistent
        // because every update below is a single assignment.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until all `world` ranks have called `wait` for this generation.
    pub(crate) fn wait(&self, rank: usize, timeout: Duration) -> Result<()> {
        let mut st = self.lock();
        if let Some(b) = &st.broken {
            return Err(Error::PeerFailure(b.clone()));
        }
        let gen = st.generation;
        st.arrived += 1;
        if st.arrived == self.world {
            st.arrived = 0;
            st.generation = st.generation.wrapping_add(1);
            self.cv.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        loop {
            if st.generation != gen {
                return Ok(());
            }
            if let Some(b) = &st.broken {
                return Err(Error::PeerFailure(b.clone()));
            }
            let now = Instant::now();
            if now >= deadline {
                st.broken = Some(format!("rank {rank} timed out after {timeout:?} at a barrier"));
                self.cv.notify_all();
                return Err(Error::Timeout { what: format!("rank {rank}'s peers at a barrier"), after: timeout });
            }
            st = self.cv.wait_timeout(st, deadline - now).map(|(g, _)| g).unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Waits until `poll` yields a value (a message from `peer`), the group breaks, or `timeout` passes.
    pub(crate) fn wait_for<T>(
        &self,
        rank: usize,
        peer: usize,
        timeout: Duration,
        mut poll: impl FnMut() -> Option<T>,
    ) -> Result<T> {
        let deadline = Instant::now() + timeout;
        let mut st = self.lock();
        loop {
            if let Some(v) = poll() {
                return Ok(v);
            }
            if let Some(b) = &st.broken {
                return Err(Error::PeerFailure(b.clone()));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout { what: format!("rank {rank}'s message from rank {peer}"), after: timeout });
            }
            st = self.cv.wait_timeout(st, deadline - now).map(|(g, _)| g).unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Wakes every waiter (after a message was posted).
    pub(crate) fn notify_all(&self) {
        let _st = self.lock();
        self.cv.notify_all();
    }

    /// Marks `rank` as gone: current and later waits of its peers fail.
    pub(crate) fn leave(&self, rank: usize) {
        let mut st = self.lock();
        if st.broken.is_none() {
            st.broken = Some(format!("rank {rank} left the communicator"));
        }
        self.cv.notify_all();
    }
}
