//! anyccl-rendezvous: the vendor-neutral bootstrap the GPU backends build on.
//!
//! Two pieces, both without any GPU dependency:
//!
//! - [`tcp`]: a TCP rendezvous through which the N ranks of a job find each other and exchange small byte blobs
//!   (an `ncclUniqueId`, IPC handles, host names). Rank 0 listens on exactly the master address, the other ranks
//!   connect to it (star topology). Every connection is authenticated both ways before any payload moves: the rank
//!   proves to rank 0, and rank 0 to the rank, that it holds the job's secret ([`JobKey`]), by HMAC-SHA-256 over
//!   fresh nonces from both sides ([`auth`]); every later frame carries a tag from a per-connection session key.
//!   A connection that fails is told only "rejected"; rank 0 logs why and keeps a bounded record
//!   ([`Rejections`]). Handshakes run concurrently, each with its own deadline, so silent or garbage connections
//!   delay nobody. The group then offers [`Rendezvous::all_gather`], [`Rendezvous::broadcast`] and
//!   [`Rendezvous::barrier`]. Every wait has a timeout; a rank that never arrives or dies makes the others fail
//!   with [`Error::Timeout`](anyccl_core::Error::Timeout) or [`Error::PeerFailure`](anyccl_core::Error::PeerFailure)
//!   instead of hanging. [`RendezvousConfig::from_env`] reads torchrun's (or Slurm's) variables and the job's
//!   secret (`ANYCCL_RENDEZVOUS_KEY` or `ANYCCL_RENDEZVOUS_KEY_FILE`; required unless `MASTER_ADDR` is loopback,
//!   where a per-user private key ([`userkey`]) keeps other users out).
//! - [`fdpass`] (Linux): file-descriptor passing over a Unix-domain socket (`SCM_RIGHTS`) between processes of the
//!   same user, for CUDA VMM POSIX-FD memory handles. The server socket lives in a private directory (mode 0700),
//!   the socket file has mode 0600, and every accepted peer's uid is checked with `SO_PEERCRED`.
//!
//! ```
//! use std::time::Duration;
//! use anyccl_rendezvous::{Rendezvous, RendezvousConfig};
//!
//! // Rank 0 binds port 0 here so the example never collides with another process, and makes a random job key
//! // that `client_config` hands to the other rank; a real job uses `RendezvousConfig::from_env()` and
//! // `Rendezvous::establish` on every rank.
//! let cfg = RendezvousConfig::new(0, 2, "127.0.0.1:0".parse().unwrap()).with_timeout(Duration::from_secs(10));
//! let listener = Rendezvous::listen(cfg).unwrap();
//! let rank1_cfg = listener.client_config(1);
//! let rank1 = std::thread::spawn(move || {
//!     let mut group = Rendezvous::connect(rank1_cfg).unwrap();
//!     group.all_gather(b"from rank 1").unwrap()
//! });
//! let mut group = listener.accept_all().unwrap();
//! let all = group.all_gather(b"from rank 0").unwrap();
//! assert_eq!(all, rank1.join().unwrap());
//! assert_eq!(all[1], b"from rank 1");
//! ```
//!
//! The crate has no `unsafe` code: received descriptors arrive as `OwnedFd`s from `rustix`.
#![forbid(unsafe_code)]

pub mod auth;
pub mod config;
#[cfg(target_os = "linux")]
pub mod fdpass;
pub mod tcp;
#[cfg(target_os = "linux")]
pub mod userkey;

pub use auth::JobKey;
pub use config::RendezvousConfig;
#[cfg(target_os = "linux")]
pub use fdpass::{FdChannel, FdServer};
pub use tcp::{Listener, Rejections, Rendezvous};

/// The TCP rendezvous as a [`Bootstrap`](anyccl_core::Bootstrap): what the GPU backends' setup takes
/// (`&mut dyn Bootstrap`), so an engine may pass this one or its own.
impl anyccl_core::Bootstrap for Rendezvous {
    fn rank(&self) -> usize {
        Rendezvous::rank(self)
    }

    fn world(&self) -> usize {
        Rendezvous::world(self)
    }

    fn all_gather(&mut self, mine: &[u8]) -> anyccl_core::Result<Vec<Vec<u8>>> {
        Rendezvous::all_gather(self, mine)
    }

    fn broadcast(&mut self, root: usize, data: Option<&[u8]>) -> anyccl_core::Result<Vec<u8>> {
        Rendezvous::broadcast(self, root, data)
    }

    fn barrier(&mut self) -> anyccl_core::Result<()> {
        Rendezvous::barrier(self)
    }
}

/// The `backend` name this crate's [`Error::Backend`](anyccl_core::Error::Backend) errors carry.
pub const BACKEND_NAME: &str = "rendezvous";

/// An I/O failure as anyccl's error, naming the call that failed.
pub(crate) fn backend_error(call: impl Into<String>, message: impl Into<String>) -> anyccl_core::Error {
    anyccl_core::Error::backend(BACKEND_NAME, call, None, message)
}
