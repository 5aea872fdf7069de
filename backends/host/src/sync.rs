//! Point-to-point waits for host ranks as threads: a receive waits on a condition variable until its message
//! arrives, its sender leaves, or the wait times out. (The collectives synchronise through the step counters of
//! the `shm` module instead.)
//!
//! A rank that leaves fails only the receives that wait for it: the other pairs keep exchanging messages.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyccl_core::{Error, Result};

pub(crate) struct MailSync {
    /// Index = rank: whether the rank dropped its communicator.
    left: Mutex<Vec<bool>>,
    cv: Condvar,
}

impl MailSync {
    pub(crate) fn new(world: usize) -> Self {
        MailSync { left: Mutex::new(vec![false; world]), cv: Condvar::new() }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<bool>> {
        // Poisoning only means a thread panicked while holding the lock; the flags are still consistent because
        // every update is a single assignment.
        self.left.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until `poll` yields a value (a message from `peer`), `peer` leaves, or `timeout` passes. A message
    /// that `peer` sent before it left is still received.
    pub(crate) fn wait_for<T>(
        &self,
        rank: usize,
        peer: usize,
        timeout: Duration,
        mut poll: impl FnMut() -> Option<T>,
    ) -> Result<T> {
        let deadline = Instant::now() + timeout;
        let mut left = self.lock();
        loop {
            if let Some(v) = poll() {
                return Ok(v);
            }
            if left.get(peer).copied().unwrap_or(true) {
                return Err(Error::PeerFailure(format!(
                    "rank {peer} left the communicator before sending the message rank {rank} waits for"
                )));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout { what: format!("rank {rank}'s message from rank {peer}"), after: timeout });
            }
            left = self.cv.wait_timeout(left, deadline - now).map(|(g, _)| g).unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Wakes every waiter (after a message was posted).
    pub(crate) fn notify_all(&self) {
        let _left = self.lock();
        self.cv.notify_all();
    }

    /// Marks `rank` as gone: receives from it that find no message fail.
    pub(crate) fn leave(&self, rank: usize) {
        let mut left = self.lock();
        if let Some(l) = left.get_mut(rank) {
            *l = true;
        }
        self.cv.notify_all();
    }
}
