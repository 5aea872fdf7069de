//! The communicators the drop-in created and has not yet seen destroyed: every communicator handle a caller passes
//! is checked against them before anything is forwarded.
//!
//! The real NCCL dereferences whatever handle it is given: a garbage, freed or destroyed communicator crashes the
//! process (or worse, reads memory that now belongs to something else). The drop-in sees every communicator
//! created through it (`ncclCommInitRank`, `ncclCommInitRankConfig`, `ncclCommInitAll`, `ncclCommInitRankScalable`,
//! `ncclCommSplit`, `ncclCommShrink`, `ncclCommGrow`: the handle the library wrote, when it answered `ncclSuccess`
//! or `ncclInProgress`) and every one destroyed (`ncclCommDestroy`, `ncclCommAbort`), so it answers a handle it does
//! not hold with `ncclInvalidArgument` and a text naming the function and the handle; nothing is forwarded.
//!
//! - A null handle is forwarded: NCCL defines the answer (`ncclCommDestroy(NULL)` succeeds, most calls return
//!   `ncclInvalidArgument` with its own text).
//! - `ncclCommFinalize` and `ncclCommRevoke` leave the handle live (the caller still destroys or aborts it).
//! - Destroy and abort take the handle out before forwarding, so two threads destroying one communicator cannot
//!   both reach the library: the second is refused.
//! - A handle the library hands out again for a new communicator (the same address after a destroy) is that new
//!   communicator's; an old copy of it cannot be told apart.
//!
//! The check reads a fixed table of atomic words without a lock or a read-modify-write (a multiplicative hash,
//! linear probing, a tombstone for a destroyed handle that the next creation reuses), so it adds a few
//! nanoseconds to a call; more communicators alive at once than the table holds spill into a locked set.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::api::{self, Comm};
use crate::last_error::Failure;

/// A slot never used (a lookup stops here).
const EMPTY: usize = 0;
/// A slot whose handle was taken out (a lookup goes on; a creation reuses it).
const GONE: usize = 1;

/// A set of handles: `N` atomic slots, and a locked list for what does not fit (rare: searched linearly).
pub struct Registry<const N: usize> {
    slots: [AtomicUsize; N],
    spilled: AtomicBool,
    overflow: Mutex<Vec<usize>>,
}

impl<const N: usize> Registry<N> {
    /// An empty set.
    #[allow(clippy::new_without_default)] // a const constructor for a static
    pub const fn new() -> Self {
        Registry {
            slots: [const { AtomicUsize::new(EMPTY) }; N],
            spilled: AtomicBool::new(false),
            overflow: Mutex::new(Vec::new()),
        }
    }

    fn start(h: usize) -> usize {
        // Fibonacci hashing: handles are heap addresses, whose low bits are alike.
        ((h as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize % N
    }

    fn overflow(&self) -> std::sync::MutexGuard<'_, Vec<usize>> {
        self.overflow.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds `h` (a value of 0 or 1, never a live handle's, goes to the locked set).
    pub fn insert(&self, h: usize) {
        if h > GONE {
            let mut free = None;
            let i0 = Self::start(h);
            for k in 0..N {
                let i = (i0 + k) % N;
                match self.slots[i].load(Ordering::Acquire) {
                    v if v == h => return,
                    EMPTY => {
                        free.get_or_insert(i);
                        break;
                    }
                    GONE => {
                        free.get_or_insert(i);
                    }
                    _ => {}
                }
            }
            // Claim the first free slot of the chain; one taken meanwhile by another creation: look further on.
            let mut tries = free.into_iter().chain((0..N).map(|k| (i0 + k) % N));
            if tries.any(|i| {
                let cur = self.slots[i].load(Ordering::Acquire);
                (cur == EMPTY || cur == GONE)
                    && self.slots[i].compare_exchange(cur, h, Ordering::AcqRel, Ordering::Acquire).is_ok()
            }) {
                return;
            }
        }
        let mut spilled = self.overflow();
        if !spilled.contains(&h) {
            spilled.push(h);
        }
        self.spilled.store(true, Ordering::Release);
    }

    /// Whether `h` is in the set.
    #[inline]
    pub fn contains(&self, h: usize) -> bool {
        if h > GONE {
            let i0 = Self::start(h);
            for k in 0..N {
                match self.slots[(i0 + k) % N].load(Ordering::Acquire) {
                    v if v == h => return true,
                    EMPTY => break,
                    _ => {}
                }
            }
        }
        self.spilled.load(Ordering::Acquire) && self.overflow().contains(&h)
    }

    /// Takes `h` out; whether it was in (of two threads taking the same handle, one gets `true`).
    pub fn remove(&self, h: usize) -> bool {
        if h > GONE {
            let i0 = Self::start(h);
            for k in 0..N {
                let i = (i0 + k) % N;
                match self.slots[i].load(Ordering::Acquire) {
                    v if v == h => {
                        return self.slots[i].compare_exchange(h, GONE, Ordering::AcqRel, Ordering::Acquire).is_ok()
                    }
                    EMPTY => break,
                    _ => {}
                }
            }
        }
        if !self.spilled.load(Ordering::Acquire) {
            return false;
        }
        let mut spilled = self.overflow();
        match spilled.iter().position(|v| *v == h) {
            Some(i) => {
                spilled.swap_remove(i);
                true
            }
            None => false,
        }
    }
}

/// The live communicators of this process.
static LIVE: Registry<4096> = Registry::new();

/// A communicator the library just created through the drop-in (a null one is ignored).
pub fn created(comm: Comm) {
    if !comm.is_null() {
        LIVE.insert(comm as usize);
    }
}

/// Whether `comm` is a communicator the drop-in created and has not seen destroyed.
#[inline]
pub fn is_live(comm: Comm) -> bool {
    LIVE.contains(comm as usize)
}

fn refused(function: &str, argument: &str, comm: Comm) -> Failure {
    Failure {
        code: api::NCCL_INVALID_ARGUMENT,
        message: format!(
            "{function}: {argument} {comm:?} is not a communicator of this process: the anyccl drop-in NCCL did not \
             create it, or it was already destroyed (ncclCommDestroy or ncclCommAbort); nothing was called"
        ),
    }
}

/// `Ok` when `comm` is null (the library answers that) or live; otherwise the failure `function` answers.
#[inline]
pub fn check(function: &str, argument: &str, comm: Comm) -> Result<(), Failure> {
    if comm.is_null() || is_live(comm) {
        Ok(())
    } else {
        Err(refused(function, argument, comm))
    }
}

/// As [`check`], and takes a live `comm` out of the set (it is being destroyed or aborted).
pub fn take(function: &str, argument: &str, comm: Comm) -> Result<(), Failure> {
    if comm.is_null() || LIVE.remove(comm as usize) {
        Ok(())
    } else {
        Err(refused(function, argument, comm))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_table_reuses_tombstones_and_spills_what_does_not_fit() {
        let r = Registry::<4>::new();
        for h in [0x10, 0x20, 0x30, 0x40] {
            r.insert(h);
        }
        assert!(!r.spilled.load(Ordering::Relaxed));
        // Full: the fifth spills; every one is found.
        r.insert(0x50);
        assert!(r.spilled.load(Ordering::Relaxed));
        for h in [0x10, 0x20, 0x30, 0x40, 0x50] {
            assert!(r.contains(h), "{h:#x}");
        }
        assert!(!r.contains(0x60));
        // Taken out once; a second take is refused; a tombstone does not end a lookup of another handle.
        assert!(r.remove(0x20));
        assert!(!r.remove(0x20));
        assert!(!r.contains(0x20));
        for h in [0x10, 0x30, 0x40, 0x50] {
            assert!(r.contains(h), "{h:#x}");
        }
        assert!(r.remove(0x50), "from the spilled set");
        // A new handle takes the tombstone; inserting a present one twice keeps one copy.
        r.insert(0x70);
        r.insert(0x70);
        assert!(r.contains(0x70));
        assert!(r.remove(0x70));
        assert!(!r.contains(0x70));
        // 0 and 1 are the table's markers: such handles live in the locked set.
        r.insert(1);
        assert!(r.contains(1));
        assert!(r.remove(1));
        assert!(!r.contains(1));
    }

    #[test]
    fn threads_creating_and_destroying_their_own_handles_never_lose_one() {
        let r = std::sync::Arc::new(Registry::<64>::new());
        let threads: Vec<_> = (0..4usize)
            .map(|t| {
                let r = r.clone();
                std::thread::spawn(move || {
                    for round in 0..2000usize {
                        let h = 0x1000 * (t + 1) + (round % 40) * 8 + 0x10;
                        r.insert(h);
                        assert!(r.contains(h));
                        assert!(r.remove(h));
                        assert!(!r.contains(h));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("a thread panicked");
        }
    }

    #[test]
    fn created_is_live_until_taken_and_null_always_passes() {
        let comm = 0x5eed_0001usize as Comm;
        let refusal = check("ncclCommCount", "comm", comm).expect_err("not created yet");
        assert_eq!(refusal.code, api::NCCL_INVALID_ARGUMENT);
        assert!(refusal.message.starts_with("ncclCommCount: comm 0x5eed0001 is not a communicator"), "{refusal:?}");
        created(comm);
        assert!(check("ncclCommCount", "comm", comm).is_ok());
        assert!(take("ncclCommDestroy", "comm", comm).is_ok());
        assert!(take("ncclCommDestroy", "comm", comm).is_err(), "a second destroy is refused");
        assert!(check("ncclCommCount", "comm", comm).is_err());
        assert!(check("ncclCommCount", "comm", std::ptr::null_mut()).is_ok());
        assert!(take("ncclCommDestroy", "comm", std::ptr::null_mut()).is_ok());
    }
}
