//! The host backend with one process per rank: [`communicator_over`] a [`Bootstrap`] (the TCP rendezvous, an
//! engine's own store, or [`anyccl_core::bootstrap::LocalGroup`] for ranks as threads), and [`from_env`] for ranks
//! started by `torchrun` (or any launcher that sets `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`). All ranks
//! must be on one host and run as one user.
//!
//! **Transport.** The collectives move their data through shared memory set up over the bootstrap: each rank owns
//! a segment (an anonymous memory file, `memfd_create`, sealed so its size can never change; see the `shm` module),
//! whose descriptor goes to every peer over the point-to-point mesh (`SCM_RIGHTS`), so no segment has a name in
//! `/dev/shm` or anywhere else. A collective runs in chunks of
//! at most [`HostOptions::shm_capacity`] bytes (4 MiB by default): each rank copies its chunk into its own segment
//! and publishes it with a sequence counter, waits until every peer published the same step, reads the peers'
//! chunks and reduces them locally, visiting the ranks in one fixed order per element, so every rank gets bitwise
//! identical results, equal to the threaded host backend's (the same reduction kernels). That is the one-shot
//! all-reduce; the two-shot one (the selector's choice from 8 KiB on) has each rank publish only the parts of each
//! chunk that its peers reduce and reduce only its own part (its own contribution read where it lies), in the same
//! order, publish the result in the second half of its segment and copy the peers' parts
//! from theirs, so each rank reduces 1/N of the data instead of all of it. Message sizes are
//! therefore bounded only by the callers' buffers, not by the bootstrap. The bootstrap carries only the setup
//! (socket names, tokens, agreements). Point-to-point messages go over a mesh of Unix-domain stream sockets set up
//! through the bootstrap: each rank listens on a fresh abstract-namespace name (`anyccl-host-mesh-RANK-` and 128
//! random bits: no file, so nothing is left behind whatever happens), and connects only to names of exactly that
//! form, never to a path, whatever the bootstrap says. Both ends check the other's credentials (`SO_PEERCRED`): a
//! process of another uid is refused before a byte is read from or written to it; a connecting peer then proves
//! itself with a random token exchanged over the bootstrap. Incoming connections are accepted on a thread of their
//! own while the rank connects to its lower peers, each with its own deadline (5 s to send its 40-byte hello), so a
//! silent or dripping connection costs the real ranks nothing. Every setup phase (the mesh's connections, then its
//! accepts; the segments' creation and sending, then their checks) ends with an agreement over the bootstrap: one
//! rank's failure fails every rank at once, with that rank's reason.
//!
//! **Groups and sub-communicators.** A grouped send/receive ([`anyccl_core::Communicator::p2p`]) writes its sends on
//! one thread per destination while the calling thread receives in the group's order, so a group completes
//! whatever the order of its operations on each rank (plain blocking sends of messages larger than a socket's
//! buffer, each rank sending before it receives, would stall). A split ([`anyccl_core::Communicator::split`])
//! exchanges every rank's color and key over this communicator's shared memory, then sets every color's new
//! communicator up side by side over the parent's own collectives (each setup step is one all-gather of the
//! whole parent, every rank taking its own color's part): no new rendezvous or port. The new communicator has its
//! own segments and mesh, and outlives its parent if need be.
//!
//! **Failure.** A wait for peers spins briefly (yielding to a peer on the same processor), then sleeps on the
//! awaited peer's futex word (which
//! the peer rings when it publishes a step; at most 2 ms at a time), and gives up
//! after [`HostOptions::timeout`]: a rank whose process died makes its peers fail with [`Error::PeerFailure`]
//! naming it (its point-to-point connection hangs up) within milliseconds, a rank that stalls with
//! [`Error::Timeout`] naming it, a rank that dropped its communicator or failed with [`Error::PeerFailure`];
//! receives wait at most [`HostOptions::timeout`]. Ranks that call different collectives or sizes get a
//! [`Error::PeerFailure`] describing both calls, not each other's bytes. After a failed collective the
//! communicator refuses every further collective (its peers see it failed too); make a new one.
//!
//! **Limits.** Each rank uses one segment of `shm_capacity` bytes plus a 4 KiB header of shared memory (reserved at
//! setup, so exhausted memory is an error then, not a crash later; it counts against the rank's memory cgroup, not
//! against the size of `/dev/shm`) and at most 1 MiB of scratch memory (32 KiB per rank up to 32 ranks). Linux only
//! (memfd, abstract sockets, peer credentials); the ranks must share a network namespace (abstract socket names
//! are per network namespace), as `torchrun`'s ranks do.
//!
//! **Trust.** A process of the same uid that holds a segment's descriptor or mapping (through `/proc/PID/fd` or
//! `map_files`, or by tracing a rank) can still write into it: a same-uid process can also signal, trace or rewrite
//! the ranks themselves. What it writes into the headers is checked (an error naming the rank); what it writes
//! into a data region becomes results. It can no longer truncate, grow or replace a segment.

use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use anyccl_core::bootstrap::{all_gather_padded, checked_all_gather, Bootstrap, MAX_PADDED_PAYLOAD};
use anyccl_core::comm::{
    AllGatherArgs, AllReduceArgs, AllReduceCall, BroadcastArgs, P2pArgs, P2pItem, RecvArgs, ReduceArgs,
    ReduceScatterArgs, SendArgs,
};
use anyccl_core::{
    Algorithm, CapabilityReport, CommBackend, Communicator, DataType, Error, InvalidArgument, ReduceOp, Result, Vendor,
};

use crate::reduce::{cast, cast_mut, internal, reduce_into, resolve, with_type, Op, Reducible};
use crate::shm::{Desc, Kind, ShmConfig, ShmGroup};
use crate::{
    host_capabilities, parse_split_entry, split_entry, split_io, split_members, HostBuffer, HostOptions, HostRuntime,
};

/// The all-reduce algorithms of the process backend. One-shot: every rank reads every rank's chunk from shared
/// memory and reduces all of it. Two-shot: every rank reduces its own part of each chunk (reading the peers'
/// contributions where they lie in shared memory), publishes the result beside its contribution, and copies the
/// peers' reduced parts. Both visit the ranks in the same fixed order per element, so their results are bitwise
/// equal, and equal to the threaded backend's.
pub const PROCESS_ALGORITHMS: [Algorithm; 2] = [Algorithm::OneShot, Algorithm::TwoShot];

/// The most scratch memory per peer that a reduction copies a peer's data into before reducing it.
const SCRATCH_BYTES: usize = 32 << 10;

/// Length of the token a peer proves itself with on the point-to-point mesh.
const TOKEN_LEN: usize = 32;

/// One rank of a host communicator whose ranks are separate processes (or threads) joined by a [`Bootstrap`].
/// Make one with [`communicator_over`] or [`from_env`].
pub struct ProcessComm {
    rank: usize,
    world: usize,
    /// The bootstrap the communicator was set up over, kept (not closed) for the communicator's lifetime; `None`
    /// for a sub-communicator, which was set up over its parent's collectives.
    _boot: Option<Box<dyn Bootstrap + Send>>,
    /// The options it was made with, for its sub-communicators.
    options: HostOptions,
    /// Stream to and from each peer (`None` at this rank's own index).
    peers: Vec<Option<UnixStream>>,
    /// A message header read from a peer whose length did not match the receive: the payload waits in the stream
    /// for the next receive, so a mismatched receive loses nothing.
    pending: Vec<Option<usize>>,
    /// The shared-memory segments the collectives move their data through.
    shm: ShmGroup,
    /// One block per rank: the peers' data is copied out of shared memory into these before it is reduced.
    scratch: Vec<HostBuffer>,
    runtime: HostRuntime,
    caps: CapabilityReport,
    timeout: Duration,
}

/// A host communicator over `bootstrap`: every rank calls this collectively (the bootstrap then carries the
/// setup only). `options.timeout` bounds the point-to-point setup, each receive and each wait for the peers in a
/// collective; `options.shm_capacity` sizes the shared-memory segments.
pub fn communicator_over(
    bootstrap: Box<dyn Bootstrap + Send>,
    options: HostOptions,
) -> Result<Communicator<ProcessComm>> {
    let selector = options.selector.clone();
    let comm = ProcessComm::new(bootstrap, options)?;
    Ok(Communicator::new(comm, selector))
}

/// A host communicator for a rank started by `torchrun` (or a launcher setting the same variables): joins the
/// authenticated TCP rendezvous configured by `anyccl_rendezvous::RendezvousConfig::from_env` (on `MASTER_PORT + 1`
/// or `ANYCCL_MASTER_PORT`, beside torchrun's agent), then [`communicator_over`] it.
pub fn from_env(options: HostOptions) -> Result<Communicator<ProcessComm>> {
    let cfg = anyccl_rendezvous::RendezvousConfig::from_env()?;
    let rdv = anyccl_rendezvous::Rendezvous::establish(cfg)?;
    communicator_over(Box::new(rdv), options)
}

fn peer_failure(what: String) -> Error {
    Error::PeerFailure(what)
}

fn io_error(what: &str, e: std::io::Error) -> Error {
    Error::PeerFailure(format!("{what}: {e}"))
}

impl ProcessComm {
    fn new(mut boot: Box<dyn Bootstrap + Send>, options: HostOptions) -> Result<Self> {
        let mut comm = Self::setup(boot.as_mut(), options)?;
        comm._boot = Some(boot);
        Ok(comm)
    }

    /// Sets a communicator up over `boot`, which is needed only while this runs.
    fn setup(boot: &mut dyn Bootstrap, options: HostOptions) -> Result<Self> {
        let (rank, world) = (boot.rank(), boot.world());
        if world == 0 || rank >= world {
            return Err(InvalidArgument::BadWorld(format!("bootstrap rank {rank} of world {world}")).into());
        }
        let timeout = options.timeout;
        // Refuse a bad capacity before anything is set up.
        crate::shm::checked_capacity(options.shm_capacity, world)?;
        // Shared memory and Unix sockets need every rank on this host: say so before trying either.
        if world > 1 {
            if let Err(why) = anyccl_core::topology::check_one_host(boot, &|k| std::env::var(k).ok())? {
                return Err(Error::Unsupported {
                    capability: "host-processes".into(),
                    reason: anyccl_core::Reason::Unavailable {
                        component: "one host for every rank".into(),
                        detail: format!(
                            "{why}; the host backend across processes needs them on one host (shared memory)"
                        ),
                    },
                });
            }
        }
        let sub = (SCRATCH_BYTES.saturating_mul(32) / world).clamp(64, SCRATCH_BYTES) & !63;
        let mut scratch = Vec::new();
        scratch.try_reserve_exact(world).map_err(|_| internal(format!("no memory for {world} scratch blocks")))?;
        for _ in 0..world {
            scratch.push(HostBuffer::try_zeroed(sub)?);
        }
        let peers = if world > 1 { mesh(boot, rank, world, timeout)? } else { vec![None] };
        let liveness = peers
            .iter()
            .map(|p| p.as_ref().map(UnixStream::try_clone).transpose())
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| io_error("duplicating a point-to-point stream", e))?;
        let cfg = ShmConfig { capacity: options.shm_capacity, timeout };
        let shm = ShmGroup::new(boot, &cfg, liveness)?;
        tracing::debug!(rank, world, "host communicator over a bootstrap is up");
        let pending = vec![None; world];
        Ok(ProcessComm {
            rank,
            world,
            _boot: None,
            options,
            peers,
            pending,
            shm,
            scratch,
            runtime: HostRuntime,
            caps: host_capabilities(),
            timeout,
        })
    }

    /// All-gathers `input.len()` bytes per rank into `out` through shared memory (the all-gather collective).
    fn gather_raw(&mut self, input: Option<&[u8]>, buf: &mut [u8], part: usize) -> Result<()> {
        let (rank, world) = (self.rank, self.world);
        let own = rank * part..(rank + 1) * part;
        self.shm
            .run(|shm| {
                if let Some(i) = input {
                    buf[own.clone()].copy_from_slice(&i[..part]);
                }
                let cap = shm.capacity();
                for (k, o) in chunk_starts(part, cap) {
                    let len = cap.min(part - o);
                    let mine = &buf[own.start + o..own.start + o + len];
                    shm.exchange(Desc::new(Kind::AllGather, part, k), |w| w.put(0, mine))?;
                    for q in (0..world).filter(|q| *q != rank) {
                        shm.read(q, 0, &mut buf[q * part + o..q * part + o + len])?;
                    }
                    shm.done()?;
                }
                Ok(())
            })
            .map_err(|e| at(rank, "all-gather", e))
    }

    /// Every rank's `mine` (at most [`MAX_PADDED_PAYLOAD`] bytes), over this communicator's own all-gather.
    fn exchange_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let (rank, world) = (self.rank, self.world);
        all_gather_padded(rank, world, mine, MAX_PADDED_PAYLOAD, |input, out| {
            self.gather_raw(Some(input), out, input.len())
        })
    }
}

/// Reads one message of `buf.len()` bytes from `rank`'s stream to `peer`. `pending` holds the length of a message
/// whose header was read by an earlier receive that did not match it (its payload waits in the stream): a
/// mismatched receive is refused with [`InvalidArgument::MessageMismatch`] and loses nothing.
fn read_message(
    s: &UnixStream,
    pending: &mut Option<usize>,
    (rank, peer): (usize, usize),
    timeout: Duration,
    buf: &mut [u8],
) -> Result<()> {
    let failed = |e: std::io::Error| {
        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            Error::Timeout { what: format!("rank {rank}'s message from rank {peer}"), after: timeout }
        } else {
            io_error(&format!("rank {rank}'s message from rank {peer}"), e)
        }
    };
    let mut s = s;
    let got = match pending.take() {
        Some(got) => got,
        None => {
            let mut len = [0u8; 8];
            s.read_exact(&mut len).map_err(failed)?;
            usize::try_from(u64::from_le_bytes(len)).unwrap_or(usize::MAX)
        }
    };
    if got != buf.len() {
        *pending = Some(got);
        return Err(InvalidArgument::MessageMismatch { peer, got, expected: buf.len() }.into());
    }
    s.read_exact(buf).map_err(failed)
}

/// Writes one message (its length, then its bytes) on `rank`'s stream to `peer`. A peer that does not read for
/// the stream's write timeout (`timeout`) is [`Error::Timeout`].
fn write_message(s: &UnixStream, (rank, peer): (usize, usize), timeout: Duration, msg: &[u8]) -> Result<()> {
    let mut s = s;
    s.write_all(&(msg.len() as u64).to_le_bytes()).and_then(|()| s.write_all(msg)).map_err(|e| {
        let what = format!("rank {rank}'s message to rank {peer} (the peer is not receiving)");
        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            Error::Timeout { what, after: timeout }
        } else {
            io_error(&format!("rank {rank}'s message to rank {peer}"), e)
        }
    })
}

/// The stream to `peer`, or why there is none.
fn stream_to(peers: &[Option<UnixStream>], peer: usize) -> Result<&UnixStream> {
    peers
        .get(peer)
        .and_then(Option::as_ref)
        .ok_or_else(|| peer_failure(format!("rank {peer} has no point-to-point connection")))
}

/// Frame tags of a split's setup rounds ([`Lockstep`]).
const ROUND_PAYLOAD: u8 = 0;
const ROUND_DONE: u8 = 1;
const ROUND_FAILED: u8 = 2;

/// The bootstrap a sub-communicator is set up over: every rank of the parent takes part in every round (an
/// all-gather over the parent's shared memory), each taking its own members' contributions, so that the setups of
/// all colors run side by side over one parent. A rank whose setup has ended keeps joining rounds
/// ([`finish_rounds`]) until every rank's has.
struct Lockstep<'p> {
    parent: &'p mut ProcessComm,
    /// The members' parent ranks, in new-rank order.
    members: Vec<usize>,
    /// This rank in the new communicator.
    me: usize,
}

impl Bootstrap for Lockstep<'_> {
    fn rank(&self) -> usize {
        self.me
    }

    fn world(&self) -> usize {
        self.members.len()
    }

    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut frame = Vec::new();
        frame.try_reserve_exact(mine.len() + 1).map_err(|_| internal("no memory for a split round".into()))?;
        frame.push(ROUND_PAYLOAD);
        frame.extend_from_slice(mine);
        let all = self.parent.exchange_bytes(&frame)?;
        self.members
            .iter()
            .enumerate()
            .map(|(i, q)| match all.get(*q).map(|e| e.split_first()) {
                Some(Some((&ROUND_PAYLOAD, payload))) => Ok(payload.to_vec()),
                _ => Err(peer_failure(format!(
                    "rank {i} of the new communicator (rank {q} of its parent) ended its setup early (it failed)"
                ))),
            })
            .collect()
    }
}

/// Joins the parent's setup rounds ([`Lockstep`]) with nothing to contribute until every rank's setup has ended.
fn finish_rounds(parent: &mut ProcessComm, ok: bool) -> Result<()> {
    let tag = if ok { ROUND_DONE } else { ROUND_FAILED };
    loop {
        let all = parent.exchange_bytes(&[tag])?;
        if all.iter().all(|e| e.first() != Some(&ROUND_PAYLOAD)) {
            return Ok(());
        }
    }
}

/// The abstract-namespace name of every mesh listener starts with this, followed by the rank, a dash and 32 hex
/// digits; a rank connects to no other name (see [`mesh_name`]).
const MESH_PREFIX: &str = "anyccl-host-mesh-";
/// How long one incoming mesh connection may take to prove itself (a real rank sends its hello as soon as it is
/// connected): a silent or dripping connection is closed then, and costs the others nothing meanwhile.
const HELLO_LIMIT: Duration = Duration::from_secs(5);
/// The most incoming mesh connections waiting to prove themselves at once; one more closes the oldest.
const MAX_PENDING: usize = 64;
/// How often the accepting thread looks whether setup was given up.
const ACCEPT_TICK: Duration = Duration::from_millis(50);

/// Every rank's `outcome` of one setup phase, agreed over `boot`: this rank's own error when it failed, else the
/// first peer's reason (each rank sends at most 1 KiB of it), else this rank's value. Every rank takes part whatever
/// its outcome, so a rank that fails makes every rank fail at once, with its reason, instead of leaving its peers to
/// wait out their timeouts.
///
/// When this rank's own failure is a peer's ([`Error::PeerFailure`]: a peer hung up on it, say), it may only be the
/// echo of another rank's: a peer that gave up because a third rank died closes its connections, and this rank
/// then fails to write to that peer first. The group's account (the bootstrap's abort, or another rank's reason)
/// is appended, so the error still names the rank that started it.
pub(crate) fn agree<T>(boot: &mut dyn Bootstrap, what: &str, outcome: Result<T>) -> Result<T> {
    let mine = match &outcome {
        Ok(_) => vec![0u8],
        Err(e) => {
            let mut m = vec![1u8];
            m.extend_from_slice(anyccl_core::text::sanitize_with_limit(&e.to_string(), 1024).as_bytes());
            m
        }
    };
    let gathered = checked_all_gather(boot, &mine);
    let rank = boot.rank();
    let peers_reason = |all: &[Vec<u8>]| {
        all.iter().enumerate().filter(|&(q, _)| q != rank).find_map(|(q, m)| {
            (m.first() != Some(&0)).then(|| {
                let why = anyccl_core::text::sanitize_bytes(m.get(1..).unwrap_or(&[]), 1024);
                format!("rank {q} could not set up {what}: {why}")
            })
        })
    };
    match (gathered, outcome) {
        (Err(group), Err(Error::PeerFailure(own))) => Err(peer_failure(format!("{own}; the group: {group}"))),
        (Ok(all), Err(Error::PeerFailure(own))) => match peers_reason(&all) {
            Some(theirs) => Err(peer_failure(format!("{own}; {theirs}"))),
            None => Err(peer_failure(own)),
        },
        (_, Err(e)) => Err(e),
        (Err(e), Ok(_)) => Err(e),
        (Ok(all), Ok(v)) => match peers_reason(&all) {
            Some(theirs) => Err(peer_failure(theirs)),
            None => Ok(v),
        },
    }
}

/// Fails unless the process at the other end of `s` runs as `uid` (its credentials as the kernel recorded them
/// when it connected or listened).
#[cfg(target_os = "linux")]
fn check_peer_uid(s: &UnixStream, uid: u32) -> std::result::Result<(), String> {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    let cred = getsockopt(s, PeerCredentials).map_err(|e| format!("cannot read its credentials: {e}"))?;
    if cred.uid() != uid {
        return Err(format!(
            "its process (pid {}) runs as uid {}, not as this process's effective uid {uid}",
            cred.pid(),
            cred.uid()
        ));
    }
    Ok(())
}

/// A listener on a fresh abstract-namespace name (`MESH_PREFIX`, the rank, 128 random bits): no file anywhere, so
/// nothing is left behind whatever happens to the process.
#[cfg(target_os = "linux")]
fn listen(rank: usize) -> Result<(UnixListener, String)> {
    use std::os::linux::net::SocketAddrExt;
    let mut last = None;
    for _ in 0..4 {
        let mut r = [0u8; 16];
        getrandom::fill(&mut r).map_err(|e| internal(format!("no randomness for a mesh socket name: {e}")))?;
        let name = format!("{MESH_PREFIX}{rank}-{:032x}", u128::from_le_bytes(r));
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| io_error("a mesh socket name", e))?;
        match UnixListener::bind_addr(&addr) {
            Ok(l) => return Ok((l, name)),
            Err(e) if e.kind() == ErrorKind::AddrInUse => last = Some(e),
            Err(e) => return Err(io_error("cannot listen for point-to-point connections", e)),
        }
    }
    let e = last.unwrap_or_else(|| std::io::Error::from(ErrorKind::AddrInUse));
    Err(io_error("cannot listen for point-to-point connections", e))
}

#[cfg(not(target_os = "linux"))]
fn listen(_rank: usize) -> Result<(UnixListener, String)> {
    Err(Error::Unsupported {
        capability: "host-processes".into(),
        reason: anyccl_core::Reason::Unavailable {
            component: "abstract Unix sockets".into(),
            detail: "the host backend across processes needs Linux".into(),
        },
    })
}

#[cfg(not(target_os = "linux"))]
fn check_peer_uid(_s: &UnixStream, _uid: u32) -> std::result::Result<(), String> {
    Err("peer credentials need Linux".to_owned())
}

/// Rank `i`'s mesh socket name from its setup entry (after the token), refused unless it is exactly
/// `MESH_PREFIX`, `i`, a dash and 32 lowercase hex digits: a rank is never sent to any other socket.
fn mesh_name(i: usize, name: &[u8]) -> Result<&str> {
    let bad = || peer_failure(format!("rank {i} sent a mesh address that is not an anyccl mesh socket of rank {i}"));
    let name = std::str::from_utf8(name).map_err(|_| bad())?;
    let rest = name.strip_prefix(MESH_PREFIX).and_then(|r| r.strip_prefix(&format!("{i}-"))).ok_or_else(bad)?;
    if rest.len() != 32 || !rest.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return Err(bad());
    }
    Ok(name)
}

/// Connects to every rank below this one and proves this rank with that rank's token (the hello: this rank and the
/// token); a listener that does not run as this uid is refused before anything is written to it.
fn connect_lower(all: &[Vec<u8>], rank: usize, timeout: Duration, uid: u32) -> Result<Vec<Option<UnixStream>>> {
    let mut peers: Vec<Option<UnixStream>> = (0..all.len()).map(|_| None).collect();
    for (i, entry) in all.iter().enumerate().take(rank) {
        let token = entry.get(1..=TOKEN_LEN).ok_or_else(|| internal(format!("rank {i}'s mesh entry is short")))?;
        let name = mesh_name(i, entry.get(1 + TOKEN_LEN..).unwrap_or(&[]))?;
        let s = connect_named(name).map_err(|e| io_error(&format!("rank {rank} cannot reach rank {i}"), e))?;
        check_peer_uid(&s, uid).map_err(|why| peer_failure(format!("rank {i}'s mesh socket is refused: {why}")))?;
        s.set_write_timeout(Some(timeout)).map_err(|e| io_error("socket timeout", e))?;
        let mut hello = (rank as u64).to_le_bytes().to_vec();
        hello.extend_from_slice(token);
        (&s).write_all(&hello).map_err(|e| io_error(&format!("rank {rank} cannot greet rank {i}"), e))?;
        peers[i] = Some(s);
    }
    Ok(peers)
}

#[cfg(target_os = "linux")]
fn connect_named(name: &str) -> std::io::Result<UnixStream> {
    use std::os::linux::net::SocketAddrExt;
    UnixStream::connect_addr(&std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?)
}

#[cfg(not(target_os = "linux"))]
fn connect_named(_name: &str) -> std::io::Result<UnixStream> {
    Err(std::io::Error::from(ErrorKind::Unsupported))
}

/// An incoming mesh connection that has not proved itself yet.
struct Pending {
    s: UnixStream,
    hello: [u8; 8 + TOKEN_LEN],
    got: usize,
    /// When it is closed if its hello has not come.
    by: Instant,
}

/// Accepts the ranks above this one, each proving itself with `token`, until all came, `timeout` passed, or `stop`
/// is set. Connections from another uid are closed at once, unread; each other connection has [`HELLO_LIMIT`] of
/// its own to send its hello, without holding up the others.
fn accept_higher(
    listener: &UnixListener,
    token: &[u8; TOKEN_LEN],
    (rank, world): (usize, usize),
    timeout: Duration,
    uid: u32,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<Vec<(usize, UnixStream)>> {
    listener.set_nonblocking(true).map_err(|e| io_error("socket mode", e))?;
    let start = Instant::now();
    // A timeout too long for the clock is no deadline at all (a day is as good as forever here).
    let deadline =
        start.checked_add(timeout).or_else(|| start.checked_add(Duration::from_secs(86_400))).unwrap_or(start);
    let mut came: Vec<(usize, UnixStream)> = Vec::new();
    let mut pending: std::collections::VecDeque<Pending> = std::collections::VecDeque::new();
    let want = world - 1 - rank;
    while came.len() < want {
        if stop.load(std::sync::atomic::Ordering::Acquire) {
            return Err(peer_failure("the point-to-point setup was given up".to_owned()));
        }
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<String> =
                (rank + 1..world).filter(|j| came.iter().all(|(c, _)| c != j)).map(|j| j.to_string()).collect();
            return Err(Error::Timeout {
                what: format!("rank {rank}'s point-to-point connections from rank(s) {}", missing.join(", ")),
                after: timeout,
            });
        }
        loop {
            match listener.accept() {
                Ok((s, _)) => {
                    if let Err(why) = check_peer_uid(&s, uid) {
                        tracing::warn!(rank, "closed a mesh connection at once: {why}");
                        continue;
                    }
                    s.set_nonblocking(true).map_err(|e| io_error("socket mode", e))?;
                    if pending.len() >= MAX_PENDING {
                        pending.pop_front();
                        tracing::warn!(rank, "closed the oldest of {MAX_PENDING} mesh connections still silent");
                    }
                    let by = now.checked_add(HELLO_LIMIT.min(timeout)).unwrap_or(now);
                    pending.push_back(Pending { s, hello: [0; 8 + TOKEN_LEN], got: 0, by });
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io_error("accepting a mesh connection", e)),
            }
        }
        let mut i = 0;
        while i < pending.len() {
            let p = &mut pending[i];
            let read = (&p.s).read(&mut p.hello[p.got..]);
            match read {
                Ok(0) => {
                    pending.remove(i);
                    continue;
                }
                Ok(k) => {
                    p.got += k;
                    if p.got == p.hello.len() {
                        if let Some(p) = pending.remove(i) {
                            if let Some(j) = proved(&p.hello, token, rank, world, &came)? {
                                p.s.set_nonblocking(false).map_err(|e| io_error("socket mode", e))?;
                                came.push((j, p.s));
                            }
                        }
                        continue;
                    }
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                    if now >= p.by {
                        tracing::warn!(
                            rank,
                            "closed a mesh connection that sent {} of its hello in {HELLO_LIMIT:?}",
                            p.got
                        );
                        pending.remove(i);
                        continue;
                    }
                }
                Err(_) => {
                    pending.remove(i);
                    continue;
                }
            }
            i += 1;
        }
        if came.len() == want {
            break;
        }
        let wake = pending.iter().map(|p| p.by).fold(deadline.min(now + ACCEPT_TICK), Instant::min);
        let left = wake.saturating_duration_since(Instant::now());
        let t = rustix::event::Timespec { tv_sec: left.as_secs() as _, tv_nsec: left.subsec_nanos() as _ };
        let mut fds: Vec<rustix::event::PollFd<'_>> = std::iter::once(listener.as_fd())
            .chain(pending.iter().map(|p| p.s.as_fd()))
            .map(|fd| rustix::event::PollFd::from_borrowed_fd(fd, rustix::event::PollFlags::IN))
            .collect();
        // An error (EINTR) only means looking again.
        let _ = rustix::event::poll(&mut fds, Some(&t));
    }
    Ok(came)
}

/// The rank a complete hello proves (`None`: not this rank's token, the connection is closed and logged); a rank
/// holding the token that claims an impossible or taken rank is an error.
fn proved(
    hello: &[u8; 8 + TOKEN_LEN],
    token: &[u8; TOKEN_LEN],
    rank: usize,
    world: usize,
    came: &[(usize, UnixStream)],
) -> Result<Option<usize>> {
    if hello[8..] != token[..] {
        tracing::warn!(rank, "closed a mesh connection without this rank's token");
        return Ok(None);
    }
    let mut who = [0u8; 8];
    who.copy_from_slice(&hello[..8]);
    let j = usize::try_from(u64::from_le_bytes(who)).unwrap_or(usize::MAX);
    if j <= rank || j >= world || came.iter().any(|(c, _)| *c == j) {
        return Err(peer_failure(format!("a mesh peer with the right token claimed rank {j}")));
    }
    Ok(Some(j))
}

/// Sets up the point-to-point mesh: every rank listens on an abstract socket, rank `j` connects to every rank
/// `i < j` and proves itself with `i`'s token while `i` accepts on a thread of its own. Each phase ends with an
/// agreement over `boot` ([`agree`]), so one rank's failure fails every rank at once with its reason.
fn mesh(boot: &mut dyn Bootstrap, rank: usize, world: usize, timeout: Duration) -> Result<Vec<Option<UnixStream>>> {
    let uid = rustix::process::geteuid().as_raw();
    let mut token = [0u8; TOKEN_LEN];
    getrandom::fill(&mut token).map_err(|e| internal(format!("no randomness for the host mesh token: {e}")))?;
    let listening = listen(rank);
    let mine = match &listening {
        Ok((_, name)) => [&[0u8][..], &token, name.as_bytes()].concat(),
        Err(e) => [&[1u8][..], anyccl_core::text::sanitize_with_limit(&e.to_string(), 1024).as_bytes()].concat(),
    };
    let all = checked_all_gather(boot, &mine);
    let (listener, _) = listening?;
    let all = all?;
    for (q, entry) in all.iter().enumerate() {
        match entry.split_first() {
            Some((0, rest)) if rest.len() > TOKEN_LEN && rest.len() <= TOKEN_LEN + 256 => {}
            Some((1, why)) => {
                let why = anyccl_core::text::sanitize_bytes(why, 1024);
                return Err(peer_failure(format!("rank {q} could not set up its point-to-point socket: {why}")));
            }
            _ => return Err(peer_failure(format!("rank {q} sent a malformed mesh address ({} bytes)", entry.len()))),
        }
    }
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (connected, accepted) = std::thread::scope(|sc| {
        let acceptor = std::thread::Builder::new()
            .name(format!("anyccl-host-accept-{rank}"))
            .spawn_scoped(sc, || accept_higher(&listener, &token, (rank, world), timeout, uid, &stop));
        let connected = connect_lower(&all, rank, timeout, uid);
        let connected = agree(boot, "its point-to-point connections", connected);
        if connected.is_err() {
            stop.store(true, std::sync::atomic::Ordering::Release);
        }
        let accepted = acceptor
            .map_err(|e| internal(format!("cannot start the mesh's accepting thread: {e}")))
            .and_then(|h| h.join().unwrap_or_else(|_| Err(internal("the mesh's accepting thread panicked".into()))));
        (connected, accepted)
    });
    let mut peers = connected?;
    for (j, s) in agree(boot, "its point-to-point connections", accepted)? {
        peers[j] = Some(s);
    }
    for s in peers.iter().flatten() {
        s.set_read_timeout(Some(timeout)).map_err(|e| io_error("socket timeout", e))?;
        s.set_write_timeout(Some(timeout)).map_err(|e| io_error("socket timeout", e))?;
    }
    Ok(peers)
}

impl CommBackend for ProcessComm {
    /// The operator in the host kernels' own set, resolved once per call by `check_reduction`.
    type Reduction = crate::reduce::Op;
    type Plan = ();
    type Runtime = HostRuntime;

    fn runtime(&self) -> &HostRuntime {
        &self.runtime
    }

    fn name(&self) -> &'static str {
        "host"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn vendor(&self) -> Vendor {
        Vendor::Host
    }

    fn arch(&self) -> &str {
        "host-processes"
    }

    fn capabilities(&self) -> &CapabilityReport {
        &self.caps
    }

    fn allreduce_algorithms(&self) -> &[Algorithm] {
        &PROCESS_ALGORITHMS
    }

    fn check_reduction(&self, dtype: DataType, op: ReduceOp) -> Result<Op> {
        // The host kernels implement every pair core accepts that this build knows.
        resolve(dtype, op)
    }

    fn allreduce_eligible(&self, algorithm: Algorithm, _call: &AllReduceCall) -> std::result::Result<(), String> {
        if PROCESS_ALGORITHMS.contains(&algorithm) {
            Ok(())
        } else {
            Err("the host backend across processes runs one-shot and two-shot only".to_owned())
        }
    }

    fn all_reduce(&mut self, args: AllReduceArgs<'_, Self>) -> Result<()> {
        let (dtype, bytes, args_algorithm) = (args.dtype(), args.bytes(), args.algorithm());
        if !PROCESS_ALGORITHMS.contains(&args_algorithm) {
            return Err(Error::AlgorithmNotEligible {
                algorithm: args_algorithm,
                why: "not implemented by the host backend across processes".into(),
            });
        }
        let op = args.reduction();
        let (input, buf) = split_io(args.into_bufs());
        let input = input.map(|i| &i[..bytes]);
        let buf = &mut buf[..bytes];
        let algorithm = args_algorithm;
        let desc = Desc::new(Kind::AllReduce, bytes, 0).reduction(dtype, op).algorithm(algorithm);
        let (rank, scratch) = (self.rank, &mut self.scratch);
        self.shm
            .run(|shm| {
                with_type!(dtype, T => match algorithm {
                    Algorithm::TwoShot => two_shot_steps::<T>(shm, scratch, desc, input, buf, op),
                    _ => reduce_steps::<T>(shm, scratch, desc, input, buf, op, true),
                })
            })
            .map_err(|e| at(rank, "all-reduce", e))
    }

    fn all_gather(&mut self, args: AllGatherArgs<'_, Self>) -> Result<()> {
        let part = args.count() * args.dtype().size_bytes();
        let (input, buf) = split_io(args.into_bufs());
        self.gather_raw(input, buf, part)
    }

    fn reduce_scatter(&mut self, args: ReduceScatterArgs<'_, Self>) -> Result<()> {
        let (dtype, total) = (args.dtype(), args.bytes());
        let op = args.reduction();
        let part = args.count() * dtype.size_bytes();
        let (input, buf) = split_io(args.into_bufs());
        let input = input.map(|i| &i[..total]);
        let (rank, world) = (self.rank, self.world);
        let scratch = &mut self.scratch;
        let out_base = if input.is_some() { 0 } else { rank * part };
        self.shm
            .run(|shm| {
                // Each step carries, from every rank, one slot per destination rank.
                let slot = (shm.capacity() / world) & !63;
                if slot == 0 {
                    return Err(internal(format!("a {}-byte segment cannot hold {world} slots", shm.capacity())));
                }
                for (k, o) in chunk_starts(part, slot) {
                    let len = slot.min(part - o);
                    let desc = Desc::new(Kind::ReduceScatter, part, k).reduction(dtype, op);
                    let src: &[u8] = input.unwrap_or(&*buf);
                    shm.exchange(desc, |w| {
                        for d in (0..world).filter(|d| *d != rank) {
                            w.put(d * slot, &src[d * part + o..d * part + o + len])?;
                        }
                        Ok(())
                    })?;
                    let place = Placement { own: rank * part + o, out: out_base + o, peer: rank * slot, len };
                    with_type!(dtype, T => reduce_chunk::<T>(shm, scratch, input, buf, place, op))?;
                    shm.done()?;
                }
                Ok(())
            })
            .map_err(|e| at(rank, "reduce-scatter", e))
    }

    fn broadcast(&mut self, args: BroadcastArgs<'_, Self>) -> Result<()> {
        let (bytes, root) = (args.bytes(), args.root());
        let (input, buf) = split_io(args.into_bufs());
        let rank = self.rank;
        self.shm
            .run(|shm| {
                if let (true, Some(i)) = (rank == root, input) {
                    buf[..bytes].copy_from_slice(&i[..bytes]);
                }
                let cap = shm.capacity();
                for (k, o) in chunk_starts(bytes, cap) {
                    let len = cap.min(bytes - o);
                    let mine = &buf[o..o + len];
                    shm.exchange(Desc::new(Kind::Broadcast, bytes, k).root(root), |w| {
                        if rank == root {
                            w.put(0, mine)
                        } else {
                            Ok(())
                        }
                    })?;
                    if rank != root {
                        shm.read(root, 0, &mut buf[o..o + len])?;
                    }
                    shm.done()?;
                }
                Ok(())
            })
            .map_err(|e| at(rank, "broadcast", e))
    }

    fn reduce(&mut self, args: ReduceArgs<'_, Self>) -> Result<()> {
        let (bytes, dtype, root) = (args.bytes(), args.dtype(), args.root());
        // On every rank, the root's peers too, so an unknown type or operator fails everywhere before anything moves.
        let op = args.reduction();
        let (input, buf) = split_io(args.into_bufs());
        let input = input.map(|i| &i[..bytes]);
        let buf = &mut buf[..bytes];
        let desc = Desc::new(Kind::Reduce, bytes, 0).reduction(dtype, op).root(root);
        let (rank, scratch) = (self.rank, &mut self.scratch);
        self.shm
            .run(|shm| with_type!(dtype, T => reduce_steps::<T>(shm, scratch, desc, input, buf, op, rank == root)))
            .map_err(|e| at(rank, "reduce", e))
    }

    fn send(&mut self, args: SendArgs<'_, Self>) -> Result<()> {
        let (peer, bytes) = (args.peer(), args.bytes());
        write_message(stream_to(&self.peers, peer)?, (self.rank, peer), self.timeout, &args.buf()[..bytes])
    }

    fn recv(&mut self, args: RecvArgs<'_, Self>) -> Result<()> {
        let (peer, bytes) = (args.peer(), args.bytes());
        let s = stream_to(&self.peers, peer)?;
        let pending =
            self.pending.get_mut(peer).ok_or_else(|| internal(format!("no receive state for rank {peer}")))?;
        read_message(s, pending, (self.rank, peer), self.timeout, &mut args.into_buf()[..bytes])
    }

    /// The sends go out on one thread per destination (in the group's order for each), while this thread receives
    /// in the group's order: a send blocked on a full socket never keeps this rank from receiving, so the group
    /// completes whatever the order of its operations on each rank.
    fn p2p(&mut self, mut args: P2pArgs<'_, '_, Self>) -> Result<()> {
        let (rank, timeout) = (self.rank, self.timeout);
        let mut sends: Vec<(usize, &[u8])> = Vec::new();
        let mut recvs: Vec<(usize, &mut [u8])> = Vec::new();
        for item in args.items() {
            match item {
                P2pItem::Send(s) => sends.push((s.peer(), &s.buf()[..s.bytes()])),
                P2pItem::Recv(r) => {
                    let (peer, bytes) = (r.peer(), r.bytes());
                    recvs.push((peer, &mut r.into_buf()[..bytes]));
                }
            }
        }
        let (peers, pending) = (&self.peers, &mut self.pending);
        let receive_all = |pending: &mut Vec<Option<usize>>| -> Result<()> {
            for (peer, buf) in recvs {
                let slot =
                    pending.get_mut(peer).ok_or_else(|| internal(format!("no receive state for rank {peer}")))?;
                read_message(stream_to(peers, peer)?, slot, (rank, peer), timeout, buf)?;
            }
            Ok(())
        };
        if sends.is_empty() {
            return receive_all(pending);
        }
        let mut destinations: Vec<usize> = sends.iter().map(|(p, _)| *p).collect();
        destinations.sort_unstable();
        destinations.dedup();
        let streams = destinations.iter().map(|d| stream_to(peers, *d).map(|s| (*d, s))).collect::<Result<Vec<_>>>()?;
        std::thread::scope(|sc| {
            let senders: Vec<_> = streams
                .into_iter()
                .map(|(d, s)| {
                    let mine: Vec<&[u8]> = sends.iter().filter(|(p, _)| *p == d).map(|(_, m)| *m).collect();
                    let spawned = std::thread::Builder::new()
                        .name(format!("anyccl-host-send-{rank}-{d}"))
                        .spawn_scoped(sc, move || {
                            mine.into_iter().try_for_each(|m| write_message(s, (rank, d), timeout, m))
                        });
                    spawned.map_err(|e| internal(format!("cannot start a thread to send to rank {d}: {e}")))
                })
                .collect();
            let mut result = receive_all(pending);
            for h in senders {
                let sent =
                    h.and_then(|h| h.join().unwrap_or_else(|_| Err(internal("a sending thread panicked".to_owned()))));
                if let (Ok(()), Err(e)) = (&result, sent) {
                    result = Err(e);
                }
            }
            result
        })
        .map_err(|e| at(rank, "grouped send/receive", e))
    }

    /// The ranks exchange (color, key) over this communicator's shared memory, then every color's new
    /// communicator is set up side by side over the parent's collectives (`Lockstep`): no new rendezvous.
    fn split(&mut self, color: Option<u32>, key: u32) -> Result<Option<Self>> {
        let all = self.exchange_bytes(&split_entry(color, key))?;
        let entries = all.iter().enumerate().map(|(q, e)| parse_split_entry(q, e)).collect::<Result<Vec<_>>>()?;
        let Some(c) = color else {
            finish_rounds(self, true)?;
            return Ok(None);
        };
        let members = split_members(&entries, c);
        let me = self.rank;
        let Some(new_rank) = members.iter().position(|q| *q == me) else {
            return Err(internal(format!("rank {me} is not in its own split")));
        };
        let options = self.options.clone();
        let made = {
            let mut boot = Lockstep { parent: self, members, me: new_rank };
            ProcessComm::setup(&mut boot, options)
        };
        finish_rounds(self, made.is_ok())?;
        made.map(Some)
    }

    fn rmsnorm_forms(&self) -> &[anyccl_core::RmsNormForm] {
        &crate::fused::FORMS
    }

    fn all_reduce_rmsnorm(&mut self, args: anyccl_core::fused::RmsNormArgs<'_, Self>) -> Result<()> {
        let call = *args.call();
        let dtype = crate::fused::element(&call)?;
        if call.bytes == 0 {
            return Ok(());
        }
        let b = args.into_bufs();
        let mut reduced = crate::fused::reduced_buffer(&call)?;
        let input = Some(&b.input[..call.bytes]);
        let desc = Desc::new(Kind::AllReduce, call.bytes, 0).reduction(dtype, Op::Sum);
        let (rank, scratch) = (self.rank, &mut self.scratch);
        let sum = reduced.as_bytes_mut();
        self.shm
            .run(|shm| match dtype {
                DataType::F16 => reduce_steps::<half::f16>(shm, scratch, desc, input, sum, Op::Sum, true),
                _ => reduce_steps::<half::bf16>(shm, scratch, desc, input, sum, Op::Sum, true),
            })
            .map_err(|e| at(rank, "all-reduce + RMSNorm", e))?;
        crate::fused::norm_rows(&call, reduced.as_bytes(), b.residual, b.weight, b.out)
    }

    fn barrier(&mut self, _stream: &()) -> Result<()> {
        let rank = self.rank;
        self.shm.run(ShmGroup::barrier).map_err(|e| at(rank, "barrier", e))
    }
}

/// `e`, logged with the rank and collective it stopped (the error itself names the peer at fault).
fn at(rank: usize, what: &str, e: Error) -> Error {
    tracing::warn!(rank, "host {what} failed: {e}");
    e
}

/// `(chunk index, first byte)` of each chunk of at most `cap` bytes covering `bytes` — at least one, so that a
/// zero-byte call still meets its peers and a mismatch is caught.
fn chunk_starts(bytes: usize, cap: usize) -> impl Iterator<Item = (usize, usize)> {
    let n = bytes.div_ceil(cap.max(1)).max(1);
    (0..n).map(move |k| (k, k * cap))
}

/// Where one chunk of a reduction is: this rank's own contribution at byte `own` of the input (or of the buffer,
/// in place), the result at byte `out` of the buffer, each peer's contribution at byte `peer` of its data region,
/// `len` bytes each.
#[derive(Clone, Copy)]
struct Placement {
    own: usize,
    out: usize,
    peer: usize,
    len: usize,
}

/// The chunked steps of an all-reduce or a reduce: every rank publishes each chunk of its contribution; ranks with
/// `reduce_here` reduce every rank's chunk into `buf`.
fn reduce_steps<T: Reducible>(
    shm: &mut ShmGroup,
    scratch: &mut [HostBuffer],
    desc: Desc,
    input: Option<&[u8]>,
    buf: &mut [u8],
    op: Op,
    reduce_here: bool,
) -> Result<()> {
    let (bytes, cap) = (buf.len(), shm.capacity());
    for (k, o) in chunk_starts(bytes, cap) {
        let len = cap.min(bytes - o);
        let src: &[u8] = input.unwrap_or(&*buf);
        let mine = &src[o..o + len];
        shm.exchange(desc.chunk(k), |w| w.put(0, mine))?;
        if reduce_here {
            reduce_chunk::<T>(shm, scratch, input, buf, Placement { own: o, out: o, peer: 0, len }, op)?;
        }
        shm.done()?;
    }
    Ok(())
}

/// Two-shot all-reduce in chunks of half the segment: each rank publishes its chunk in the first half, reduces its
/// own part of it (every rank's contribution, read in shared memory) into `buf` and into the same place of the
/// second half, then, one step later, copies every peer's reduced part from the peer's second half. A rank's part
/// of a chunk is a run of whole 64-byte blocks (so every offset suits every element type and the word copies),
/// the last rank's possibly shorter and trailing parts of a short chunk empty.
fn two_shot_steps<T: Reducible>(
    shm: &mut ShmGroup,
    scratch: &mut [HostBuffer],
    desc: Desc,
    input: Option<&[u8]>,
    buf: &mut [u8],
    op: Op,
) -> Result<()> {
    let (bytes, world, rank) = (buf.len(), scratch.len(), shm.rank());
    let half = (shm.capacity() / 2) & !63;
    if half == 0 {
        return Err(internal(format!("a {}-byte segment cannot hold a two-shot chunk", shm.capacity())));
    }
    let part = |len: usize, q: usize| {
        let slot = len.div_ceil(world.max(1)).next_multiple_of(64);
        (q * slot).min(len)..((q + 1) * slot).min(len)
    };
    for (k, o) in chunk_starts(bytes, half) {
        let len = half.min(bytes - o);
        let src: &[u8] = input.unwrap_or(&*buf);
        let mine = &src[o..o + len];
        let own = part(len, rank);
        // Only the peers' parts: this rank reduces its own part from its input.
        shm.exchange(desc.chunk(2 * k), |w| {
            for (at, bytes) in [(0, &mine[..own.start]), (own.end, &mine[own.end..])] {
                if !bytes.is_empty() {
                    w.put(at, bytes)?;
                }
            }
            Ok(())
        })?;
        if !own.is_empty() {
            let place = Placement { own: o + own.start, out: o + own.start, peer: own.start, len: own.len() };
            reduce_chunk::<T>(shm, scratch, input, buf, place, op)?;
            shm.put_own(half + own.start, &buf[o + own.start..o + own.end])?;
        }
        shm.next_step(desc.chunk(2 * k + 1))?;
        for q in (0..world).filter(|q| *q != rank) {
            let theirs = part(len, q);
            if !theirs.is_empty() {
                shm.read(q, half + theirs.start, &mut buf[o + theirs.start..o + theirs.end])?;
            }
        }
        shm.done()?;
    }
    Ok(())
}

/// Reduces one chunk, block by block: each rank's block is copied into its scratch block (this rank's from its
/// own contribution, the peers' out of shared memory), then reduced in rank order into `buf`.
fn reduce_chunk<T: Reducible>(
    shm: &ShmGroup,
    scratch: &mut [HostBuffer],
    input: Option<&[u8]>,
    buf: &mut [u8],
    at: Placement,
    op: Op,
) -> Result<()> {
    let world = scratch.len();
    let rank = shm.rank();
    let sub = scratch.first().map_or(0, HostBuffer::len);
    if sub == 0 {
        return Err(internal("no scratch memory for a host reduction".to_owned()));
    }
    let mut b = 0;
    while b < at.len {
        let n = sub.min(at.len - b);
        for (q, s) in scratch.iter_mut().enumerate() {
            let dst = &mut s.as_bytes_mut()[..n];
            if q == rank {
                // Out of place, this rank's own contribution is read where it lies (below); in place it is copied
                // aside, since the result overwrites it.
                if input.is_none() {
                    dst.copy_from_slice(&buf[at.own + b..at.own + b + n]);
                }
            } else {
                shm.read(q, at.peer + b, dst)?;
            }
        }
        let mut ins: Vec<&[T]> = Vec::with_capacity(world);
        for (q, s) in scratch.iter().enumerate() {
            ins.push(match input {
                Some(i) if q == rank => cast::<T>(&i[at.own + b..at.own + b + n])?,
                _ => cast::<T>(&s.as_bytes()[..n])?,
            });
        }
        reduce_into(&ins, cast_mut::<T>(&mut buf[at.out + b..at.out + b + n])?, op, world);
        b += n;
    }
    Ok(())
}

#[cfg(test)]
mod agreement_tests {
    use super::*;
    use anyccl_core::bootstrap::LocalGroup;

    /// Runs one agreement on three ranks as threads, each with its own outcome, and returns each rank's result.
    fn agree_three(outcomes: [Result<u8>; 3]) -> Vec<Result<u8>> {
        let group = LocalGroup::new(3, Duration::from_secs(30));
        std::thread::scope(|sc| {
            let hs: Vec<_> = outcomes
                .into_iter()
                .enumerate()
                .map(|(r, outcome)| {
                    let mut me = group.member(r);
                    sc.spawn(move || agree(&mut me, "a test phase", outcome))
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
        })
    }

    #[test]
    fn every_rank_hears_the_first_failing_rank() {
        let got = agree_three([Ok(0), Err(peer_failure("rank 1 broke".into())), Ok(2)]);
        for r in [0, 2] {
            let e = got[r].as_ref().expect_err("a peer failed");
            assert!(e.to_string().contains("rank 1 could not set up a test phase: peer failure: rank 1 broke"), "{e}");
        }
        assert!(got[1].as_ref().expect_err("own failure").to_string().contains("rank 1 broke"));
    }

    #[test]
    fn an_echoed_peer_failure_still_names_the_rank_that_started_it() {
        // Rank 1 died; rank 0 failed to write to it, gave up and closed, so rank 2 failed to write to rank 0: rank
        // 2's own error names only rank 0, and the agreement adds rank 0's account, which names rank 1.
        let got = agree_three([
            Err(peer_failure("rank 0 cannot send to rank 1: Broken pipe".into())),
            Err(peer_failure("rank 1 broke".into())),
            Err(peer_failure("rank 2 cannot send to rank 0: Broken pipe".into())),
        ]);
        let e = got[2].as_ref().expect_err("failed").to_string();
        assert!(e.contains("rank 2 cannot send to rank 0") && e.contains("rank 0 cannot send to rank 1"), "{e}");
    }

    #[test]
    fn an_error_of_this_ranks_own_making_is_kept_as_it_is() {
        let own = Error::Timeout { what: "rank 0's own step".into(), after: Duration::from_secs(1) };
        let got = agree_three([Err(own), Ok(1), Err(peer_failure("rank 2 broke".into()))]);
        assert!(matches!(&got[0], Err(Error::Timeout { what, .. }) if what == "rank 0's own step"), "{:?}", got[0]);
    }

    #[test]
    fn all_succeeding_gives_each_rank_its_value() {
        let got = agree_three([Ok(0), Ok(1), Ok(2)]);
        for (r, g) in got.into_iter().enumerate() {
            assert_eq!(g.expect("all succeeded"), r as u8);
        }
    }
}
