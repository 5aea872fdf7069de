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
//! The check is one read of a sharded map (`dashmap`) per call.

use std::sync::OnceLock;

use dashmap::DashSet;

use crate::api::{self, Comm};
use crate::last_error::Failure;

fn live() -> &'static DashSet<usize> {
    static LIVE: OnceLock<DashSet<usize>> = OnceLock::new();
    LIVE.get_or_init(DashSet::new)
}

/// A communicator the library just created through the drop-in (a null one is ignored).
pub fn created(comm: Comm) {
    if !comm.is_null() {
        live().insert(comm as usize);
    }
}

/// Whether `comm` is a communicator the drop-in created and has not seen destroyed.
pub fn is_live(comm: Comm) -> bool {
    live().contains(&(comm as usize))
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
    if comm.is_null() || live().remove(&(comm as usize)).is_some() {
        Ok(())
    } else {
        Err(refused(function, argument, comm))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
