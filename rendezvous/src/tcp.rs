//! TCP rendezvous: rank 0 listens, the other ranks connect; collectives run as a star through rank 0.
//!
//! ## Wire protocol (version 2, little-endian)
//!
//! Handshake (see [`crate::auth`] for what the proofs cover):
//!
//! 1. both sides send at once: the client its preamble (magic `ANYCCLRV`, version `u32`: 12 bytes); rank 0 its
//!    greeting (magic, version, its nonce: 44 bytes);
//! 2. the client, having read the greeting: world `u64`, rank `u64`, its nonce, its proof (80 bytes);
//! 3. rank 0: one verdict byte, `0xA5` followed by its own proof (32 bytes) when it accepts, `0x5A` and nothing
//!    else when it rejects (then it closes). A rejected peer learns nothing more: not why, not the world size,
//!    not the key. The reason goes to rank 0's log and its [`Rejections`] record.
//!
//! Then frames, each a 26-byte header (kind `u8`, op `u8`, sequence `u64`, argument `u64`, length `u64`), `length`
//! bytes of payload (at most `max_message`), and a 32-byte tag from the connection's session key. Once every rank
//! has joined, rank 0 sends `Ready` to all (or `Abort` with the reason when it gives up). When a rank that proved it
//! holds the job key contradicts the job (another world size, rank 0, or a rank that already joined), the job cannot
//! form: rank 0 admits that rank only to send it `Reject` with the reason, sends `Reject` to every rank that joined,
//! and gives up at once instead of waiting out the timeout. A peer that did not prove the key still learns nothing.
//! Ranks that had not connected yet are told too: for a short grace period ([`LATE_GRACE`], or the timeout if that
//! is shorter) rank 0 keeps listening, and answers each connection that proves the key with the same `Reject` and
//! reason (every other connection gets the one "rejected" byte, as before), until every rank of the job has been
//! told, the grace period ends, or [`MAX_LATE_ANSWERS`] late ranks were answered.
//! In a collective each client sends one `Data` frame tagged with the operation and its sequence number; rank 0
//! checks the tags (a rank calling another collective than the others is an error, not a silent mix-up), and
//! replies with the result frames, or with `Abort` to everyone when a rank failed.
//!
//! ## Pending connections
//!
//! Rank 0 runs every handshake at once on non-blocking sockets (one `mio` poll loop on the calling thread, no
//! thread per connection): each pending connection has its own deadline ([`HANDSHAKE_LIMIT`]) and costs the others
//! no time, so silent or slow connections delay nobody. At most [`MAX_PENDING`] handshakes are pending; a new
//! connection beyond that closes the oldest pending one at once. The oldest is the one to go because a real rank
//! completes its handshake within a round trip of connecting, so whatever has waited longest is the least likely to
//! be a real rank, and closing the newest instead would let whoever filled the table first lock everyone out until
//! their deadlines. A real rank whose connection is closed before the verdict simply connects again.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyccl_core::text::{sanitize, sanitize_bytes};
use anyccl_core::{Error, InvalidArgument, Result};
use mio::{Events, Interest, Poll, Token};
use tracing::{debug, info, warn};

use crate::auth::{self, JobKey, Session, Side, Transcript};
use crate::backend_error;
use crate::config::{RendezvousConfig, KEY_VAR, MAX_TIMEOUT};

/// The first bytes of every preamble and greeting.
pub const MAGIC: [u8; 8] = *b"ANYCCLRV";

/// The wire protocol version this crate speaks (2: authenticated both ways, every frame tagged).
pub const PROTOCOL_VERSION: u32 = 2;

/// How long one pending connection may take to complete its handshake with rank 0.
pub const HANDSHAKE_LIMIT: Duration = Duration::from_secs(5);

/// The most connections rank 0 keeps in their handshake at once; see the module documentation.
pub const MAX_PENDING: usize = 512;

/// How long rank 0 keeps listening after it found that the job cannot form, to tell ranks that connect late why
/// (the rendezvous timeout where that is shorter); see the module documentation.
pub const LATE_GRACE: Duration = Duration::from_secs(5);

/// The most late connections rank 0 answers with the reason the job cannot form before it stops listening.
pub const MAX_LATE_ANSWERS: usize = 1024;

/// Magic and version.
const PREAMBLE_LEN: usize = 8 + 4;
/// Rank 0's greeting: magic, version, nonce.
const GREETING_LEN: usize = PREAMBLE_LEN + auth::LEN;
/// What a client sends, preamble included: magic, version, world, rank, nonce, proof.
const HELLO_LEN: usize = PREAMBLE_LEN + 8 + 8 + auth::LEN + auth::LEN;
/// The verdict bytes.
const ACCEPT: u8 = 0xa5;
const REJECT: u8 = 0x5a;
/// Length of a frame header: kind, op, sequence, argument, payload length.
const HEADER_LEN: usize = 1 + 1 + 8 + 8 + 8;
/// How long rank 0 spends telling the other ranks that it gave up, or answering a verdict.
const ABORT_LIMIT: Duration = Duration::from_secs(1);
/// How soon rank 0 tries `accept` again after it failed (out of file descriptors, say).
const ACCEPT_RETRY: Duration = Duration::from_millis(10);
/// The most connections accepted in one go before the pending ones get their turn.
const ACCEPT_BATCH: usize = 64;
/// Payloads are read in chunks of at most this size, so a frame that claims more than it carries costs no memory.
const READ_CHUNK: usize = 64 * 1024;
/// The longest peer-supplied reason shown in an error (bytes).
const MAX_REASON: usize = 4096;
/// The listener's token in the poll.
const LISTENER: Token = Token(usize::MAX);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Ready = 3,
    Abort = 4,
    Data = 5,
    /// The job cannot form (a world-size contradiction, a rank claimed twice): sent, with the reason, to every rank
    /// that proved it holds the job key.
    Reject = 6,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        [Kind::Ready, Kind::Abort, Kind::Data, Kind::Reject].into_iter().find(|k| *k as u8 == b)
    }
}

/// The operation a frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Setup = 0,
    AllGather = 1,
    Broadcast = 2,
    Barrier = 3,
}

impl Op {
    fn from_u8(b: u8) -> Option<Op> {
        [Op::Setup, Op::AllGather, Op::Broadcast, Op::Barrier].into_iter().find(|o| *o as u8 == b)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Setup => "setup",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
        })
    }
}

/// What a frame to be sent is: its kind, operation, sequence number and argument.
#[derive(Debug, Clone, Copy)]
struct Out {
    kind: Kind,
    op: Op,
    seq: u64,
    arg: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    kind: Kind,
    op: Op,
    seq: u64,
    arg: u64,
    len: u64,
}

/// Who is on the other side of a stream and what we are doing, for error messages.
struct Ctx<'a> {
    peer: &'a str,
    what: &'a str,
    after: Duration,
    max: usize,
}

impl Ctx<'_> {
    fn io(&self, e: io::Error) -> Error {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                Error::Timeout { what: format!("{} during {}", self.peer, self.what), after: self.after }
            }
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => {
                Error::PeerFailure(format!("{} closed the connection during {}", self.peer, self.what))
            }
            _ => backend_error(self.what, format!("{}: {e}", self.peer)),
        }
    }

    fn protocol(&self, msg: impl fmt::Display) -> Error {
        Error::PeerFailure(format!("{} broke the protocol during {}: {msg}", self.peer, self.what))
    }
}

fn remaining(deadline: Instant) -> Option<Duration> {
    deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero())
}

/// `now + timeout`, or an error where that is beyond the clock's range (a validated timeout never is).
fn deadline_after(timeout: Duration) -> Result<Instant> {
    Instant::now().checked_add(timeout).ok_or_else(|| {
        Error::InvalidArgument(InvalidArgument::BadWorld(format!(
            "a timeout of {timeout:?} reaches beyond the clock's range (the maximum is {} seconds)",
            MAX_TIMEOUT.as_secs()
        )))
    })
}

/// `deadline`, or `limit` from now if that is later (to say goodbye even after a deadline passed).
fn at_least(deadline: Instant, limit: Duration) -> Instant {
    Instant::now().checked_add(limit).map_or(deadline, |t| deadline.max(t))
}

/// `deadline`, or `limit` from now if that is sooner.
fn at_most(deadline: Instant, limit: Duration) -> Instant {
    Instant::now().checked_add(limit).map_or(deadline, |t| deadline.min(t))
}

fn timed_out() -> io::Error {
    io::Error::from(io::ErrorKind::TimedOut)
}

/// `read_exact` that gives up at `deadline` (the socket timeout is reset before every read).
fn read_exact_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        stream.set_read_timeout(Some(remaining(deadline).ok_or_else(timed_out)?))?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `write_all` that gives up at `deadline`.
fn write_all_by(stream: &mut TcpStream, mut buf: &[u8], deadline: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        stream.set_write_timeout(Some(remaining(deadline).ok_or_else(timed_out)?))?;
        match stream.write(buf) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn encode_header(kind: Kind, op: Op, seq: u64, arg: u64, len: usize) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0] = kind as u8;
    h[1] = op as u8;
    h[2..10].copy_from_slice(&seq.to_le_bytes());
    h[10..18].copy_from_slice(&arg.to_le_bytes());
    h[18..26].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    if let Some(src) = at.checked_add(8).and_then(|end| b.get(at..end)) {
        w.copy_from_slice(src);
    }
    u64::from_le_bytes(w)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    if let Some(src) = at.checked_add(4).and_then(|end| b.get(at..end)) {
        w.copy_from_slice(src);
    }
    u32::from_le_bytes(w)
}

fn array_at(b: &[u8], at: usize) -> [u8; auth::LEN] {
    let mut w = [0u8; auth::LEN];
    if let Some(src) = at.checked_add(auth::LEN).and_then(|end| b.get(at..end)) {
        w.copy_from_slice(src);
    }
    w
}

fn preamble() -> [u8; PREAMBLE_LEN] {
    let mut p = [0u8; PREAMBLE_LEN];
    p[..8].copy_from_slice(&MAGIC);
    p[8..].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    p
}

/// One established, authenticated connection.
#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    session: Session,
}

impl Conn {
    /// Sends one frame (header, payload, tag) by `deadline`.
    fn send(&mut self, out: Out, payload: &[u8], deadline: Instant, ctx: &Ctx<'_>) -> Result<()> {
        self.send_all(out, std::slice::from_ref(&payload), deadline, ctx)
    }

    /// Sends one frame per payload, all described by `out`, in one write (a reply of `world` results must not cost
    /// `world` segments and wake-ups).
    fn send_all<P: AsRef<[u8]>>(&mut self, out: Out, payloads: &[P], deadline: Instant, ctx: &Ctx<'_>) -> Result<()> {
        let total = payloads
            .iter()
            .try_fold(0usize, |acc, p| acc.checked_add(HEADER_LEN + auth::LEN)?.checked_add(p.as_ref().len()));
        let mut frames = Vec::new();
        total
            .and_then(|t| frames.try_reserve_exact(t).ok())
            .ok_or_else(|| backend_error(out.op.to_string(), format!("cannot allocate {total:?} bytes of frames")))?;
        for payload in payloads {
            let payload = payload.as_ref();
            let header = encode_header(out.kind, out.op, out.seq, out.arg, payload.len());
            let tag = self.session.seal(&header, payload)?;
            frames.extend_from_slice(&header);
            frames.extend_from_slice(payload);
            frames.extend_from_slice(&tag);
        }
        write_all_by(&mut self.stream, &frames, deadline).map_err(|e| ctx.io(e))
    }

    /// Reads one frame. The length is checked against `ctx.max` before anything is allocated, the payload is read
    /// in chunks (memory grows only with the bytes that really arrive), and the tag is checked before the frame is
    /// looked at.
    fn recv(&mut self, deadline: Instant, ctx: &Ctx<'_>) -> Result<(Header, Vec<u8>)> {
        let mut h = [0u8; HEADER_LEN];
        read_exact_by(&mut self.stream, &mut h, deadline).map_err(|e| ctx.io(e))?;
        let claimed = u64_at(&h, 18);
        let len = match usize::try_from(claimed) {
            Ok(len) if len <= ctx.max => len,
            _ => {
                return Err(
                    ctx.protocol(format_args!("a frame of {claimed} bytes exceeds max_message ({} bytes)", ctx.max))
                )
            }
        };
        // payload and tag together (one read for a small frame)
        let with_tag = len + auth::LEN;
        let mut payload = Vec::new();
        while payload.len() < with_tag {
            let start = payload.len();
            let step = (with_tag - start).min(READ_CHUNK);
            payload.try_reserve(step).map_err(|e| ctx.protocol(format_args!("cannot buffer the frame: {e}")))?;
            payload.resize(start + step, 0);
            read_exact_by(&mut self.stream, &mut payload[start..], deadline).map_err(|e| ctx.io(e))?;
        }
        let tag = payload.split_off(len);
        if !self.session.open(&h, &payload, &tag)? {
            return Err(Error::PeerFailure(format!(
                "a frame from {} during {} failed authentication: it was changed, replayed or forged on the way",
                ctx.peer, ctx.what
            )));
        }
        let kind = Kind::from_u8(h[0]).ok_or_else(|| ctx.protocol(format_args!("unknown frame kind {:#04x}", h[0])))?;
        let op = Op::from_u8(h[1]).ok_or_else(|| ctx.protocol(format_args!("unknown operation {:#04x}", h[1])))?;
        Ok((Header { kind, op, seq: u64_at(&h, 2), arg: u64_at(&h, 10), len: claimed }, payload))
    }
}

/// "rank 2" / "ranks 2, 3" (at most 16 listed).
fn rank_list(ranks: &[usize]) -> String {
    const SHOWN: usize = 16;
    let mut s = if ranks.len() == 1 { "rank ".to_owned() } else { "ranks ".to_owned() };
    let shown: Vec<String> = ranks.iter().take(SHOWN).map(|r| r.to_string()).collect();
    s.push_str(&shown.join(", "));
    if ranks.len() > SHOWN {
        s.push_str(&format!(" and {} more", ranks.len() - SHOWN));
    }
    s
}

/// What rank 0 turned away while the group formed: how many connections, and why for the first few. Bounded
/// whatever the number of connections.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rejections {
    count: u64,
    first: Vec<String>,
}

impl Rejections {
    /// How many reasons are kept (the rest are only counted).
    pub const KEPT: usize = 8;

    /// How many connections were turned away (rejected, timed out, closed during the handshake, or closed to make
    /// room).
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The first [`Rejections::KEPT`] of them: `"<address>: <reason>"`, sanitized.
    pub fn first(&self) -> &[String] {
        &self.first
    }

    fn record(&mut self, from: Option<SocketAddr>, reason: &str) {
        self.count = self.count.saturating_add(1);
        let line = match from {
            Some(a) => format!("{a}: {}", sanitize(reason)),
            None => sanitize(reason),
        };
        if self.first.len() < Self::KEPT {
            warn!(target: "anyccl::rendezvous", "turned away a connection: {line}");
            self.first.push(line);
        } else {
            debug!(target: "anyccl::rendezvous", "turned away a connection: {line}");
        }
    }
}

impl fmt::Display for Rejections {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} connection{} turned away", self.count, if self.count == 1 { "" } else { "s" })?;
        if !self.first.is_empty() {
            write!(f, ": {}", self.first.join("; "))?;
        }
        let more = self.count.saturating_sub(self.first.len() as u64);
        if more > 0 && !self.first.is_empty() {
            write!(f, " and {more} more")?;
        }
        Ok(())
    }
}

/// Rank 0's listening socket, bound but not yet accepting: [`Listener::local_addr`] tells the port when the
/// configuration asked for port 0 (tests, in-process groups).
#[derive(Debug)]
pub struct Listener {
    listener: TcpListener,
    addr: SocketAddr,
    cfg: RendezvousConfig,
    key: JobKey,
    max_pending: usize,
}

impl Listener {
    /// The address rank 0 listens on (with the real port when port 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The configuration for rank `rank` of this group: this listener's real address, and the same world, job
    /// key (the random one made by [`Rendezvous::listen`] where the configuration had none), timeout and message
    /// limit as rank 0.
    pub fn client_config(&self, rank: usize) -> RendezvousConfig {
        RendezvousConfig { rank, local_rank: None, master: self.addr, key: Some(self.key.clone()), ..self.cfg.clone() }
    }

    /// Lowers the pending-handshake cap (tests of the eviction).
    #[cfg(test)]
    pub(crate) fn with_max_pending(mut self, max_pending: usize) -> Self {
        self.max_pending = max_pending.max(1);
        self
    }

    /// Waits (up to the configured timeout) until every other rank has connected and proved it holds the job key,
    /// then tells them the group is ready. A rank that proves the key but contradicts the job (another world size,
    /// rank 0, a rank that already joined) ends the wait: it and every rank that joined get a `Reject` frame with
    /// the reason at once, ranks that connect within the grace period ([`LATE_GRACE`], or the timeout if that is
    /// shorter) get it as they prove the key, and this returns [`InvalidArgument::BadWorld`] with it once every rank
    /// was told or the grace period ended.
    ///
    /// All handshakes run at once, each with its own deadline (see the module documentation). A connection that
    /// fails its handshake (bad magic, another protocol version, no proof of the key) is told only that it was
    /// rejected, and closed; the
    /// reason is logged and kept in [`Rendezvous::rejections`]. When the timeout passes, the error names the ranks
    /// that did not join (and the connections turned away), and the ranks that did join are told why the group was
    /// abandoned.
    pub fn accept_all(self) -> Result<Rendezvous> {
        let Listener { listener, addr, cfg, key, max_pending } = self;
        let world = cfg.world;
        let start = Instant::now();
        let deadline = deadline_after(cfg.timeout)?;
        let mut gate = Gate::new(listener, &cfg, key, max_pending, deadline)?;
        while gate.joined < world - 1 {
            if remaining(deadline).is_none() {
                let missing: Vec<usize> =
                    gate.peers.iter().enumerate().filter(|(_, p)| p.is_none()).map(|(i, _)| i + 1).collect();
                let mut what = format!("{} to join the rendezvous at {addr} (world {world})", rank_list(&missing));
                if gate.rejections.count() > 0 {
                    what.push_str(&format!("; {}", gate.rejections));
                }
                let err = Error::Timeout { what, after: cfg.timeout };
                warn!(target: "anyccl::rendezvous", "{err}");
                abort_all(gate.peers.iter_mut().flatten(), &err.to_string());
                return Err(err);
            }
            if let Err(e) = gate.turn() {
                abort_all(gate.peers.iter_mut().flatten(), &format!("rank 0 failed: {e}"));
                return Err(e);
            }
            if let Some(reason) = gate.fatal.take() {
                warn!(target: "anyccl::rendezvous", "rendezvous at {addr}: {reason}");
                reject_all(gate.peers.iter_mut().flatten(), &reason);
                gate.tell_late_ranks(&reason, cfg.timeout.min(LATE_GRACE));
                return Err(Error::InvalidArgument(InvalidArgument::BadWorld(reason)));
            }
        }
        let Gate { peers, rejections, .. } = gate;
        let peers: Vec<Conn> = peers.into_iter().flatten().collect();
        let mut group = Rendezvous { cfg, role: Role::Root { peers }, seq: 0, broken: None, rejections };
        let ready_by = at_least(deadline, ABORT_LIMIT);
        if let Role::Root { peers } = &mut group.role {
            for i in 0..peers.len() {
                let peer = format!("rank {}", i + 1);
                let ctx = Ctx { peer: &peer, what: "the rendezvous setup", after: group.cfg.timeout, max: 0 };
                let ready = Out { kind: Kind::Ready, op: Op::Setup, seq: 0, arg: world as u64 };
                let sent = match peers.get_mut(i) {
                    Some(c) => c.send(ready, &[], ready_by, &ctx),
                    None => Ok(()),
                };
                if let Err(err) = sent {
                    abort_all(peers.iter_mut(), &err.to_string());
                    return Err(err);
                }
            }
        }
        info!(
            target: "anyccl::rendezvous",
            "rendezvous at {addr}: all {world} ranks joined in {:?} ({})",
            start.elapsed(),
            group.rejections
        );
        Ok(group)
    }
}

/// A connection in its handshake with rank 0.
struct Pending {
    stream: mio::net::TcpStream,
    from: SocketAddr,
    deadline: Instant,
    server_nonce: [u8; auth::LEN],
    greeting: [u8; GREETING_LEN],
    greeted: usize,
    hello: [u8; HELLO_LEN],
    got: usize,
}

/// Where a pending handshake stands after some I/O.
enum Progress {
    /// Waiting for more bytes (or room to write).
    Wait,
    /// The whole hello arrived.
    Done,
    /// The connection failed or closed (there is nobody to answer).
    Gone(String),
    /// The peer sent something that is not a hello of this protocol (answer "rejected").
    Bad(String),
}

impl Pending {
    /// Writes what is left of the greeting and reads what has arrived of the hello, without blocking.
    fn progress(&mut self) -> Progress {
        while self.greeted < GREETING_LEN {
            match self.stream.write(&self.greeting[self.greeted..]) {
                Ok(0) => return Progress::Gone("the connection closed during the handshake".into()),
                Ok(n) => self.greeted += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Progress::Gone(format!("the handshake failed: {e}")),
            }
        }
        while self.got < HELLO_LEN {
            match self.stream.read(&mut self.hello[self.got..]) {
                Ok(0) => {
                    return Progress::Gone(format!(
                        "the connection closed during the handshake after {} bytes",
                        self.got
                    ))
                }
                Ok(n) => {
                    self.got += n;
                    if let Some(bad) = self.check_preamble() {
                        return Progress::Bad(bad);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Progress::Gone(format!("the handshake failed: {e}")),
            }
        }
        if self.got == HELLO_LEN && self.greeted == GREETING_LEN {
            Progress::Done
        } else {
            Progress::Wait
        }
    }

    /// A reason to reject as soon as the bytes so far cannot begin a hello of this protocol.
    fn check_preamble(&self) -> Option<String> {
        let seen = self.got.min(MAGIC.len());
        if self.hello[..seen] != MAGIC[..seen] {
            return Some(format!(
                "bad magic '{}': not an anyccl rendezvous client",
                sanitize_bytes(&self.hello[..seen], 32)
            ));
        }
        if self.got >= PREAMBLE_LEN {
            let version = u32_at(&self.hello, 8);
            if version != PROTOCOL_VERSION {
                return Some(format!(
                    "protocol version {version} is not supported (rank 0 speaks version {PROTOCOL_VERSION})"
                ));
            }
        }
        None
    }

    /// Answers "rejected" (best effort, without blocking) and closes.
    fn reject(mut self, registry: &mio::Registry) {
        let _ = self.stream.write(&[REJECT]);
        let _ = self.stream.shutdown(Shutdown::Both);
        let _ = registry.deregister(&mut self.stream);
    }

    /// Closes without a word.
    fn close(mut self, registry: &mio::Registry) {
        let _ = self.stream.shutdown(Shutdown::Both);
        let _ = registry.deregister(&mut self.stream);
    }
}

/// Rank 0's side of the group forming: the listener, the pending handshakes and the ranks that joined.
struct Gate<'a> {
    poll: Poll,
    events: Events,
    listener: mio::net::TcpListener,
    cfg: &'a RendezvousConfig,
    key: JobKey,
    max_pending: usize,
    deadline: Instant,
    pending: BTreeMap<usize, Pending>,
    next_token: usize,
    accept_again: Option<Instant>,
    /// One slot per rank 1..world (index rank - 1).
    peers: Vec<Option<Conn>>,
    joined: usize,
    rejections: Rejections,
    /// Why the job cannot form, once a rank holding the key contradicted it.
    fatal: Option<String>,
    /// The same reason, while rank 0 tells ranks that connect late ([`Gate::tell_late_ranks`]).
    closing: Option<String>,
    /// While closing: which ranks (index rank - 1) were told why the job cannot form.
    told: Vec<bool>,
    /// While closing: how many late connections were told.
    late_answers: usize,
}

impl<'a> Gate<'a> {
    fn new(
        listener: TcpListener,
        cfg: &'a RendezvousConfig,
        key: JobKey,
        max_pending: usize,
        deadline: Instant,
    ) -> Result<Gate<'a>> {
        let others = cfg.world - 1;
        let mut peers: Vec<Option<Conn>> = Vec::new();
        peers
            .try_reserve_exact(others)
            .map_err(|e| backend_error("accept_all", format!("cannot allocate a table of {others} ranks: {e}")))?;
        peers.resize_with(others, || None);
        listener.set_nonblocking(true).map_err(|e| backend_error("set_nonblocking", e.to_string()))?;
        let mut listener = mio::net::TcpListener::from_std(listener);
        let poll = Poll::new().map_err(|e| backend_error("poll", e.to_string()))?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)
            .map_err(|e| backend_error("poll register", e.to_string()))?;
        Ok(Gate {
            poll,
            events: Events::with_capacity(256),
            listener,
            cfg,
            key,
            max_pending,
            deadline,
            pending: BTreeMap::new(),
            next_token: 0,
            // connections may be queued already
            accept_again: Some(Instant::now()),
            peers,
            joined: 0,
            rejections: Rejections::default(),
            fatal: None,
            closing: None,
            told: Vec::new(),
            late_answers: 0,
        })
    }

    /// After the job was found unable to form (and the joined ranks were told): keeps listening for `grace`, and
    /// tells every connection that proves the key why ([`Gate::finish`]), until every rank was told, the grace
    /// period ends, or [`MAX_LATE_ANSWERS`] were answered. Each pending connection keeps its own deadline (never
    /// past the end of the grace period). Best effort: a failure here ends the grace period early.
    fn tell_late_ranks(&mut self, reason: &str, grace: Duration) {
        let Some(until) = Instant::now().checked_add(grace) else { return };
        self.deadline = until;
        for p in self.pending.values_mut() {
            p.deadline = p.deadline.min(until);
        }
        self.told = self.peers.iter().map(Option::is_some).collect();
        self.closing = Some(reason.to_owned());
        while remaining(self.deadline).is_some()
            && self.late_answers < MAX_LATE_ANSWERS
            && self.told.iter().any(|told| !told)
        {
            if let Err(e) = self.turn() {
                debug!(target: "anyccl::rendezvous", "stopped telling late ranks why the job cannot form: {e}");
                break;
            }
        }
        debug!(
            target: "anyccl::rendezvous",
            "told {} late connection(s) why the job cannot form; {} rank(s) never came",
            self.late_answers,
            self.told.iter().filter(|told| !**told).count()
        );
        let registry = self.poll.registry();
        for (_, p) in std::mem::take(&mut self.pending) {
            p.close(registry);
        }
    }

    /// One wait for events (until the earliest deadline), and the work they bring.
    fn turn(&mut self) -> Result<()> {
        let now = Instant::now();
        let expired: Vec<usize> = self.pending.iter().filter(|(_, p)| p.deadline <= now).map(|(t, _)| *t).collect();
        for token in expired {
            if let Some(p) = self.pending.remove(&token) {
                self.rejections.record(Some(p.from), "no handshake arrived in time");
                p.close(self.poll.registry());
            }
        }
        let mut wake = self.deadline;
        for p in self.pending.values() {
            wake = wake.min(p.deadline);
        }
        if let Some(t) = self.accept_again {
            wake = wake.min(t);
        }
        match self.poll.poll(&mut self.events, Some(wake.saturating_duration_since(now))) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(()),
            Err(e) => return Err(backend_error("poll", e.to_string())),
        }
        let mut accept = self.accept_again.is_some_and(|t| t <= Instant::now());
        let ready: Vec<Token> = self.events.iter().map(|e| e.token()).collect();
        for token in ready {
            if token == LISTENER {
                accept = true;
            } else {
                self.advance(token.0)?;
            }
        }
        if accept {
            self.accept_batch()?;
        }
        Ok(())
    }

    /// Accepts up to [`ACCEPT_BATCH`] connections (more wait for the next turn, so the pending ones are never
    /// starved by a flood).
    fn accept_batch(&mut self) -> Result<()> {
        self.accept_again = None;
        for _ in 0..ACCEPT_BATCH {
            match self.listener.accept() {
                Ok((stream, from)) => self.start(stream, from)?,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors, say: make room, and try again soon (the poll will not tell us again).
                    self.rejections.record(None, &format!("accept failed: {e}"));
                    self.evict_oldest();
                    self.accept_again = Instant::now().checked_add(ACCEPT_RETRY);
                    return Ok(());
                }
            }
        }
        self.accept_again = Some(Instant::now());
        Ok(())
    }

    fn evict_oldest(&mut self) {
        if let Some((_, old)) = self.pending.pop_first() {
            self.rejections
                .record(Some(old.from), "closed to make room: too many connections were waiting for their handshake");
            old.close(self.poll.registry());
        }
    }

    /// Starts the handshake of a new connection: sends the greeting, and waits for the hello in the poll.
    fn start(&mut self, mut stream: mio::net::TcpStream, from: SocketAddr) -> Result<()> {
        if self.pending.len() >= self.max_pending {
            self.evict_oldest();
        }
        let token = self.next_token;
        self.next_token = self.next_token.wrapping_add(1);
        if self.next_token == LISTENER.0 {
            self.next_token = 0;
        }
        if let Err(e) =
            self.poll.registry().register(&mut stream, Token(token), Interest::READABLE | Interest::WRITABLE)
        {
            self.rejections.record(Some(from), &format!("cannot watch the connection: {e}"));
            return Ok(());
        }
        let _ = stream.set_nodelay(true);
        let server_nonce = auth::nonce()?;
        let mut greeting = [0u8; GREETING_LEN];
        greeting[..PREAMBLE_LEN].copy_from_slice(&preamble());
        greeting[PREAMBLE_LEN..].copy_from_slice(&server_nonce);
        let pending = Pending {
            stream,
            from,
            deadline: at_most(self.deadline, HANDSHAKE_LIMIT),
            server_nonce,
            greeting,
            greeted: 0,
            hello: [0u8; HELLO_LEN],
            got: 0,
        };
        self.pending.insert(token, pending);
        self.advance(token)
    }

    /// Moves one pending handshake on after an event.
    fn advance(&mut self, token: usize) -> Result<()> {
        let Some(p) = self.pending.get_mut(&token) else { return Ok(()) };
        match p.progress() {
            Progress::Wait => Ok(()),
            Progress::Gone(reason) => {
                if let Some(p) = self.pending.remove(&token) {
                    self.rejections.record(Some(p.from), &reason);
                    p.close(self.poll.registry());
                }
                Ok(())
            }
            Progress::Bad(reason) => {
                if let Some(p) = self.pending.remove(&token) {
                    self.rejections.record(Some(p.from), &reason);
                    p.reject(self.poll.registry());
                }
                Ok(())
            }
            Progress::Done => match self.pending.remove(&token) {
                Some(p) => self.finish(p),
                None => Ok(()),
            },
        }
    }

    /// Checks a complete hello; admits the rank (answering with rank 0's proof) or rejects the connection.
    fn finish(&mut self, p: Pending) -> Result<()> {
        let hello = p.hello;
        let from = p.from;
        let transcript = Transcript {
            version: PROTOCOL_VERSION,
            world: u64_at(&hello, PREAMBLE_LEN),
            rank: u64_at(&hello, PREAMBLE_LEN + 8),
            client_nonce: array_at(&hello, PREAMBLE_LEN + 16),
            server_nonce: p.server_nonce,
        };
        let proof = array_at(&hello, PREAMBLE_LEN + 16 + auth::LEN);
        let authentic = transcript.check_client_proof(&self.key, &proof)?;
        if let Some(reason) = self.closing.clone() {
            // The job already cannot form: a late rank that proves the key is told why; anyone else learns nothing.
            if !authentic {
                self.rejections
                    .record(Some(p.from), "did not prove it holds the job key (after the job could not form)");
                p.reject(self.poll.registry());
                return Ok(());
            }
            if transcript.world == self.cfg.world as u64 {
                if let Some(told) = usize::try_from(transcript.rank)
                    .ok()
                    .and_then(|r| r.checked_sub(1))
                    .and_then(|i| self.told.get_mut(i))
                {
                    *told = true;
                }
            }
            self.late_answers += 1;
            self.rejections.record(Some(p.from), &format!("rank {} came late and was told: {reason}", transcript.rank));
            self.admit_to_reject(p, &transcript, &reason)?;
            return Ok(());
        }
        let verdict = if !authentic {
            Err(format!(
                "did not prove it holds the job key (a rank with another {KEY_VAR}, MASTER_ADDR or MASTER_PORT, a \
                 process of another job, or a stranger)"
            ))
        } else if transcript.world != self.cfg.world as u64 {
            Err(format!(
                "a rank holding the job key has world size {}, rank 0 has {} (check WORLD_SIZE)",
                transcript.world, self.cfg.world
            ))
        } else {
            match usize::try_from(transcript.rank) {
                Ok(0) => Err("a rank holding the job key claimed rank 0 (two processes with RANK=0?)".to_owned()),
                Ok(r) if r < self.cfg.world => match self.peers.get(r - 1) {
                    Some(Some(_)) => Err(format!("rank {r} already joined (two processes with RANK={r}?)")),
                    _ => Ok(r),
                },
                _ => Err(format!("rank {} is out of range for a world of {}", transcript.rank, self.cfg.world)),
            }
        };
        let rank = match verdict {
            Ok(rank) => rank,
            // A rank holding the key that contradicts the job: it is told why (after rank 0 proved itself to it, so
            // only key holders read the reason), and so is everyone else, at once.
            Err(reason) if authentic => {
                let reason = format!("the job cannot form: {reason}");
                self.rejections.record(Some(p.from), &reason);
                self.admit_to_reject(p, &transcript, &reason)?;
                self.fatal = Some(reason);
                return Ok(());
            }
            Err(reason) => {
                self.rejections.record(Some(p.from), &reason);
                p.reject(self.poll.registry());
                return Ok(());
            }
        };
        let (stream, session, sent) = self.admit(p, &transcript)?;
        if let Err(e) = sent {
            self.rejections.record(Some(from), &format!("rank {rank} passed the handshake but the reply failed: {e}"));
            return Ok(());
        }
        debug!(target: "anyccl::rendezvous", "rank {rank} joined from {from}");
        if let Some(slot) = self.peers.get_mut(rank - 1) {
            *slot = Some(Conn { stream, session });
            self.joined += 1;
        }
        Ok(())
    }

    /// Answers a hello that proved the key with "accepted" and rank 0's proof (blocking, by the deadline or
    /// [`ABORT_LIMIT`] from now): the stream in blocking mode, its session, and whether the answer went out.
    fn admit(&mut self, mut p: Pending, transcript: &Transcript) -> Result<(TcpStream, Session, io::Result<()>)> {
        let mut reply = [0u8; 1 + auth::LEN];
        reply[0] = ACCEPT;
        reply[1..].copy_from_slice(&transcript.server_proof(&self.key)?);
        let session = transcript.session(&self.key, Side::Root)?;
        let _ = self.poll.registry().deregister(&mut p.stream);
        let mut stream: TcpStream = p.stream.into();
        let sent = stream
            .set_nonblocking(false)
            .and_then(|()| write_all_by(&mut stream, &reply, at_least(self.deadline, ABORT_LIMIT)));
        Ok((stream, session, sent))
    }

    /// Admits a rank that proved the key only to send it `Reject` with `reason`, then closes the connection.
    fn admit_to_reject(&mut self, p: Pending, transcript: &Transcript, reason: &str) -> Result<()> {
        let (stream, session, sent) = self.admit(p, transcript)?;
        if sent.is_ok() {
            let mut conn = Conn { stream, session };
            reject_all(std::iter::once(&mut conn), reason);
        }
        Ok(())
    }
}

/// Tells every connection that the group is abandoned (best effort, about one second in all).
fn abort_all<'a>(conns: impl Iterator<Item = &'a mut Conn>, reason: &str) {
    tell_all(conns, Kind::Abort, reason)
}

/// Tells every connection that the job cannot form, and why (best effort, about one second in all).
fn reject_all<'a>(conns: impl Iterator<Item = &'a mut Conn>, reason: &str) {
    tell_all(conns, Kind::Reject, reason)
}

fn tell_all<'a>(conns: impl Iterator<Item = &'a mut Conn>, kind: Kind, reason: &str) {
    let reason = sanitize_bytes(reason.as_bytes(), MAX_REASON);
    let by = at_least(Instant::now(), ABORT_LIMIT);
    let ctx = Ctx { peer: "a rank", what: "an abort", after: ABORT_LIMIT, max: 0 };
    let abort = Out { kind, op: Op::Setup, seq: 0, arg: 0 };
    for c in conns {
        let _ = c.send(abort, reason.as_bytes(), by, &ctx);
        let _ = c.stream.shutdown(Shutdown::Write);
    }
}

#[derive(Debug)]
enum Role {
    /// Rank 0: one connection per other rank, index `rank - 1`.
    Root { peers: Vec<Conn> },
    /// Any other rank: the connection to rank 0.
    Client { conn: Conn },
}

/// An established rendezvous group: every rank connected (star through rank 0) and authenticated, ready for
/// collectives.
///
/// After a failure (a peer died, a timeout, a protocol error, a frame that failed authentication) the group is
/// broken: every later call returns [`Error::PeerFailure`] with the first failure's text. Dropping a rank closes its
/// connections, which its peers see as a [`Error::PeerFailure`] in their next collective.
#[derive(Debug)]
pub struct Rendezvous {
    cfg: RendezvousConfig,
    role: Role,
    seq: u64,
    broken: Option<String>,
    rejections: Rejections,
}

/// How a client's handshake attempt ended, when it did not succeed.
enum Attempt {
    /// The connection closed before rank 0's verdict (rank 0 made room, or was busy): connecting again may work.
    Retry(String),
    /// A definite answer (rejected, not an anyccl rendezvous, an impostor, the deadline).
    Fatal(Error),
}

impl Rendezvous {
    /// Rank 0's first step: binds exactly `cfg.master` (port 0 picks a free port; see [`Listener::local_addr`]).
    /// Where the configuration has no key, a random one is made (see [`Listener::client_config`]). Then call
    /// [`Listener::accept_all`].
    pub fn listen(cfg: RendezvousConfig) -> Result<Listener> {
        cfg.validate()?;
        if cfg.rank != 0 {
            return Err(Error::InvalidArgument(InvalidArgument::BadWorld(format!(
                "rank {} cannot listen: only rank 0 does (the others call Rendezvous::connect)",
                cfg.rank
            ))));
        }
        let key = match &cfg.key {
            Some(k) => k.clone(),
            None => JobKey::random()?,
        };
        let listener = TcpListener::bind(cfg.master)
            .map_err(|e| backend_error("bind", format!("cannot listen on {}: {e}", cfg.master)))?;
        let addr = listener.local_addr().map_err(|e| backend_error("local_addr", e.to_string()))?;
        debug!(target: "anyccl::rendezvous", "rank 0 listening on {addr} for {} ranks", cfg.world);
        Ok(Listener { listener, addr, cfg, key, max_pending: MAX_PENDING })
    }

    /// A rank other than 0: connects to rank 0 (retrying until the timeout, since rank 0 may start later or be
    /// busy), proves it holds the job key, checks that rank 0 holds it too, and waits until rank 0 reports that
    /// every rank joined. Nothing but the handshake is sent before rank 0 has proved itself.
    pub fn connect(cfg: RendezvousConfig) -> Result<Rendezvous> {
        cfg.validate()?;
        if cfg.rank == 0 {
            return Err(Error::InvalidArgument(InvalidArgument::BadWorld(
                "rank 0 cannot connect: it listens (call Rendezvous::listen or Rendezvous::establish)".into(),
            )));
        }
        let Some(key) = cfg.key.clone() else {
            return Err(Error::Config {
                source_name: KEY_VAR.into(),
                line: None,
                message: format!(
                    "rank {} has no job key: take its configuration from Listener::client_config, call \
                     RendezvousConfig::with_key, or set {KEY_VAR} for RendezvousConfig::from_env",
                    cfg.rank
                ),
            });
        };
        let deadline = deadline_after(cfg.timeout)?;
        let master = cfg.master;
        let mut backoff = Duration::from_millis(10);
        let mut attempts = 0u64;
        let mut last: Option<String> = None;
        let mut conn = loop {
            let Some(left) = remaining(deadline) else {
                let mut what = format!("rank 0 to accept a connection at {master}");
                if let Some(last) = &last {
                    what.push_str(&format!(" ({attempts} attempts; the last: {last})"));
                }
                return Err(Error::Timeout { what, after: cfg.timeout });
            };
            match TcpStream::connect_timeout(&master, left) {
                Ok(mut stream) => {
                    attempts += 1;
                    match client_handshake(&mut stream, &cfg, &key, deadline) {
                        Ok(session) => break Conn { stream, session },
                        Err(Attempt::Fatal(e)) => return Err(e),
                        Err(Attempt::Retry(why)) => {
                            debug!(target: "anyccl::rendezvous", "rank {}: {why}; connecting again", cfg.rank);
                            last = Some(why);
                        }
                    }
                }
                Err(e) => {
                    debug!(target: "anyccl::rendezvous", "rank {}: connecting to {master} failed ({e}); retrying", cfg.rank);
                }
            }
            if let Some(left) = remaining(deadline) {
                std::thread::sleep(left.min(backoff));
            }
            backoff = (backoff * 2).min(Duration::from_millis(500));
        };
        let peer = format!("rank 0 at {master}");
        let ctx = Ctx { peer: &peer, what: "the wait for all ranks to join", after: cfg.timeout, max: cfg.max_message };
        let (h, payload) = conn.recv(deadline, &ctx).map_err(|e| match e {
            Error::Timeout { after, .. } => Error::Timeout {
                what: format!("rank 0 at {master} to report that all {} ranks joined", cfg.world),
                after,
            },
            e => e,
        })?;
        match h.kind {
            Kind::Ready if h.arg == cfg.world as u64 => {}
            Kind::Ready => return Err(ctx.protocol(format_args!("Ready for a world of {}", h.arg))),
            Kind::Abort => {
                return Err(Error::PeerFailure(format!(
                    "rank 0 abandoned the rendezvous: {}",
                    sanitize_bytes(&payload, MAX_REASON)
                )))
            }
            Kind::Reject => {
                return Err(Error::InvalidArgument(InvalidArgument::BadWorld(format!(
                    "rank 0 at {master}: {}",
                    sanitize_bytes(&payload, MAX_REASON)
                ))))
            }
            other => return Err(ctx.protocol(format_args!("expected Ready or Abort, got {other:?}"))),
        }
        debug!(target: "anyccl::rendezvous", "rank {} joined the rendezvous at {master}", cfg.rank);
        Ok(Rendezvous { cfg, role: Role::Client { conn }, seq: 0, broken: None, rejections: Rejections::default() })
    }

    /// Every rank's entry point: rank 0 listens on `cfg.master` and accepts the others; the others connect.
    pub fn establish(cfg: RendezvousConfig) -> Result<Rendezvous> {
        if cfg.rank == 0 {
            Rendezvous::listen(cfg)?.accept_all()
        } else {
            Rendezvous::connect(cfg)
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.cfg.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.cfg.world
    }

    /// The configuration the group was formed with.
    pub fn config(&self) -> &RendezvousConfig {
        &self.cfg
    }

    /// On rank 0, the connections turned away while the group formed (empty on the other ranks).
    pub fn rejections(&self) -> &Rejections {
        &self.rejections
    }

    /// Changes how long each later collective may take before [`Error::Timeout`] (a zero duration is ignored; a
    /// longer one than [`MAX_TIMEOUT`] means [`MAX_TIMEOUT`]).
    pub fn set_timeout(&mut self, timeout: Duration) {
        if !timeout.is_zero() {
            self.cfg.timeout = timeout.min(MAX_TIMEOUT);
        }
    }

    /// Every rank's `data`, indexed by rank. Each rank's contribution may differ in length, up to `max_message`.
    pub fn all_gather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.collective(Op::AllGather, 0, data)
    }

    /// The root's `data` on every rank. The root must pass `Some(data)`; the other ranks' `data` is ignored.
    pub fn broadcast(&mut self, root: usize, data: Option<&[u8]>) -> Result<Vec<u8>> {
        if root >= self.cfg.world {
            return Err(Error::InvalidArgument(InvalidArgument::RankOutOfRange {
                what: "root",
                rank: root,
                world: self.cfg.world,
            }));
        }
        let mine: &[u8] = match (root == self.cfg.rank, data) {
            (true, Some(d)) => d,
            (true, None) => {
                return Err(backend_error("broadcast", format!("rank {root} is the root but passed no data")));
            }
            (false, _) => &[],
        };
        let mut out = self.collective(Op::Broadcast, root as u64, mine)?;
        out.pop().ok_or_else(|| backend_error("broadcast", "rank 0 sent no result"))
    }

    /// Returns once every rank has called `barrier`.
    pub fn barrier(&mut self) -> Result<()> {
        self.collective(Op::Barrier, 0, &[]).map(|_| ())
    }

    /// One star collective: every client sends its contribution to rank 0, which replies with the result frames
    /// (all contributions for all-gather, the root's for broadcast, one empty frame for barrier).
    fn collective(&mut self, op: Op, arg: u64, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        if let Some(reason) = &self.broken {
            return Err(Error::PeerFailure(format!(
                "the rendezvous group is unusable after an earlier failure: {reason}"
            )));
        }
        if data.len() > self.cfg.max_message {
            return Err(backend_error(
                op.to_string(),
                format!("a message of {} bytes exceeds max_message ({} bytes)", data.len(), self.cfg.max_message),
            ));
        }
        let seq = self.seq;
        self.seq = self.seq.saturating_add(1);
        let result = match &mut self.role {
            Role::Root { peers } => root_collective(&self.cfg, peers, op, seq, arg, data),
            Role::Client { conn } => client_collective(&self.cfg, conn, op, seq, arg, data),
        };
        if let Err(e) = &result {
            warn!(target: "anyccl::rendezvous", "rank {}: {op} #{seq} failed: {e}", self.cfg.rank);
            self.broken = Some(e.to_string());
        }
        result
    }
}

/// One handshake attempt on a fresh connection (see the module documentation); the session on success.
fn client_handshake(
    stream: &mut TcpStream,
    cfg: &RendezvousConfig,
    key: &JobKey,
    deadline: Instant,
) -> std::result::Result<Session, Attempt> {
    let master = cfg.master;
    let peer = format!("rank 0 at {master}");
    let ctx = Ctx { peer: &peer, what: "the rendezvous handshake", after: cfg.timeout, max: 0 };
    // Before the verdict, a closed connection is worth another try; a timeout or anything else is final.
    let early = |e: io::Error, when: &str| match e.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe => Attempt::Retry(format!("{peer} closed the connection {when}")),
        _ => Attempt::Fatal(ctx.io(e)),
    };
    let _ = stream.set_nodelay(true);
    write_all_by(stream, &preamble(), deadline).map_err(|e| early(e, "before the handshake"))?;
    // the preamble first: a rank 0 of another protocol version may send less than a whole greeting
    let mut greeting = [0u8; GREETING_LEN];
    read_exact_by(stream, &mut greeting[..PREAMBLE_LEN], deadline).map_err(|e| early(e, "before the handshake"))?;
    if greeting[..8] != MAGIC {
        return Err(Attempt::Fatal(ctx.protocol("bad magic: the service there is not an anyccl rendezvous")));
    }
    let version = u32_at(&greeting, 8);
    if version != PROTOCOL_VERSION {
        return Err(Attempt::Fatal(
            ctx.protocol(format_args!("rank 0 speaks protocol version {version}, this rank speaks {PROTOCOL_VERSION}")),
        ));
    }
    read_exact_by(stream, &mut greeting[PREAMBLE_LEN..], deadline).map_err(|e| early(e, "before the handshake"))?;
    let client_nonce = auth::nonce().map_err(Attempt::Fatal)?;
    let transcript = Transcript {
        version: PROTOCOL_VERSION,
        world: cfg.world as u64,
        rank: cfg.rank as u64,
        client_nonce,
        server_nonce: array_at(&greeting, PREAMBLE_LEN),
    };
    let mut hello = [0u8; HELLO_LEN - PREAMBLE_LEN];
    hello[..8].copy_from_slice(&transcript.world.to_le_bytes());
    hello[8..16].copy_from_slice(&transcript.rank.to_le_bytes());
    hello[16..16 + auth::LEN].copy_from_slice(&client_nonce);
    hello[16 + auth::LEN..].copy_from_slice(&transcript.client_proof(key).map_err(Attempt::Fatal)?);
    write_all_by(stream, &hello, deadline).map_err(|e| early(e, "during the handshake"))?;
    let mut verdict = [0u8; 1];
    read_exact_by(stream, &mut verdict, deadline).map_err(|e| early(e, "before its verdict"))?;
    match verdict[0] {
        ACCEPT => {}
        REJECT => {
            return Err(Attempt::Fatal(Error::PeerFailure(format!(
                "rank 0 at {master} rejected rank {} (a different job key, world size or rank, or a rank that \
                 already joined; rank 0's log says which)",
                cfg.rank
            ))))
        }
        other => return Err(Attempt::Fatal(ctx.protocol(format_args!("unknown verdict {other:#04x}")))),
    }
    let mut proof = [0u8; auth::LEN];
    read_exact_by(stream, &mut proof, deadline).map_err(|e| Attempt::Fatal(ctx.io(e)))?;
    if !transcript.check_server_proof(key, &proof).map_err(Attempt::Fatal)? {
        return Err(Attempt::Fatal(Error::PeerFailure(format!(
            "{peer} did not prove it holds the job key: it is not this job's rank 0 (another job on the same port, \
             a different {KEY_VAR}, or an impostor); nothing was sent to it"
        ))));
    }
    transcript.session(key, Side::Client).map_err(Attempt::Fatal)
}

fn result_count(op: Op, world: usize) -> usize {
    match op {
        Op::AllGather => world,
        _ => 1,
    }
}

fn root_collective(
    cfg: &RendezvousConfig,
    peers: &mut [Conn],
    op: Op,
    seq: u64,
    arg: u64,
    data: &[u8],
) -> Result<Vec<Vec<u8>>> {
    let deadline = deadline_after(cfg.timeout)?;
    let what = format!("{op} #{seq}");
    let mut contributions: Vec<Vec<u8>> = Vec::new();
    contributions
        .try_reserve_exact(cfg.world)
        .map_err(|e| backend_error(what.clone(), format!("cannot allocate {} results: {e}", cfg.world)))?;
    contributions.push(data.to_vec());
    for i in 0..peers.len() {
        let rank = i + 1;
        let peer = format!("rank {rank}");
        let ctx = Ctx { peer: &peer, what: &what, after: cfg.timeout, max: cfg.max_message };
        let received = match peers.get_mut(i) {
            Some(conn) => conn.recv(deadline, &ctx).and_then(|(h, payload)| {
                if h.kind != Kind::Data {
                    Err(ctx.protocol(format_args!("expected a Data frame, got {:?}", h.kind)))
                } else if (h.op, h.seq, h.arg) != (op, seq, arg) {
                    Err(Error::PeerFailure(format!(
                        "rank {rank} called {} #{} (argument {}) while rank 0 called {op} #{seq} (argument {arg}): \
                         the ranks must call the same collectives in the same order",
                        h.op, h.seq, h.arg
                    )))
                } else {
                    Ok(payload)
                }
            }),
            None => Err(backend_error(what.clone(), format!("no connection to rank {rank}"))),
        };
        match received {
            Ok(payload) => contributions.push(payload),
            Err(e) => {
                // everyone hears it, the failed rank too (it may be alive and waiting, e.g. after its frame failed
                // authentication on the way)
                abort_all(peers.iter_mut(), &format!("rank 0 gave up {what}: {e}"));
                return Err(e);
            }
        }
    }
    let results: Vec<Vec<u8>> = match op {
        Op::AllGather => contributions,
        Op::Broadcast => {
            let root = usize::try_from(arg).unwrap_or(usize::MAX);
            vec![contributions.into_iter().nth(root).unwrap_or_default()]
        }
        _ => vec![Vec::new()],
    };
    for i in 0..peers.len() {
        let peer = format!("rank {}", i + 1);
        let ctx = Ctx { peer: &peer, what: &what, after: cfg.timeout, max: cfg.max_message };
        let sent = match peers.get_mut(i) {
            Some(conn) => conn.send_all(Out { kind: Kind::Data, op, seq, arg }, &results, deadline, &ctx),
            None => Ok(()),
        };
        if let Err(e) = sent {
            let others = peers.iter_mut().enumerate().filter(|(j, _)| *j != i).map(|(_, s)| s);
            abort_all(others, &format!("rank 0 gave up {what}: {e}"));
            return Err(e);
        }
    }
    Ok(results)
}

fn client_collective(
    cfg: &RendezvousConfig,
    conn: &mut Conn,
    op: Op,
    seq: u64,
    arg: u64,
    data: &[u8],
) -> Result<Vec<Vec<u8>>> {
    let deadline = deadline_after(cfg.timeout)?;
    let what = format!("{op} #{seq}");
    let ctx = Ctx { peer: "rank 0", what: &what, after: cfg.timeout, max: cfg.max_message };
    conn.send(Out { kind: Kind::Data, op, seq, arg }, data, deadline, &ctx)?;
    let n = result_count(op, cfg.world);
    let mut out = Vec::new();
    out.try_reserve_exact(n).map_err(|e| backend_error(what.clone(), format!("cannot allocate {n} results: {e}")))?;
    for _ in 0..n {
        let (h, payload) = conn.recv(deadline, &ctx)?;
        match h.kind {
            Kind::Data if (h.op, h.seq, h.arg) == (op, seq, arg) => out.push(payload),
            Kind::Data => {
                return Err(ctx.protocol(format_args!(
                    "a reply for {} #{} (argument {}) arrived during {op} #{seq} (argument {arg})",
                    h.op, h.seq, h.arg
                )))
            }
            Kind::Abort => return Err(Error::PeerFailure(sanitize_bytes(&payload, MAX_REASON))),
            other => return Err(ctx.protocol(format_args!("expected a Data frame, got {other:?}"))),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    //! Protocol-level tests: raw sockets speak (bad) handshakes and frames to a real rank 0, and a hand-made rank 0
    //! (holding the key, or not) talks to a real client.
    use super::*;
    use std::thread;

    const SECRET: &[u8] = b"unit-test secret 0123456789abcdef";

    fn key() -> JobKey {
        JobKey::from_secret(SECRET)
    }

    fn root_cfg(world: usize, timeout_ms: u64) -> RendezvousConfig {
        let addr: SocketAddr = "127.0.0.1:0".parse().expect("addr");
        RendezvousConfig::new(0, world, addr).with_timeout(Duration::from_millis(timeout_ms)).with_key(key())
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    fn read_greeting(s: &mut TcpStream) -> [u8; GREETING_LEN] {
        let mut g = [0u8; GREETING_LEN];
        read_exact_by(s, &mut g, soon()).expect("greeting");
        assert_eq!(g[..PREAMBLE_LEN], preamble());
        g
    }

    /// A client's hello for rank 0's `greeting`, proved with `key`.
    fn hello_for(greeting: &[u8], key: &JobKey, world: u64, rank: u64) -> Vec<u8> {
        let t = Transcript {
            version: PROTOCOL_VERSION,
            world,
            rank,
            client_nonce: [7; auth::LEN],
            server_nonce: array_at(greeting, PREAMBLE_LEN),
        };
        let mut h = preamble().to_vec();
        h.extend_from_slice(&world.to_le_bytes());
        h.extend_from_slice(&rank.to_le_bytes());
        h.extend_from_slice(&t.client_nonce);
        h.extend_from_slice(&t.client_proof(key).expect("proof"));
        h
    }

    /// Everything rank 0 sends until it closes.
    fn rest(s: &mut TcpStream) -> Vec<u8> {
        let mut out = Vec::new();
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        let _ = s.read_to_end(&mut out);
        out
    }

    /// One bad hello in a world of 3 whose rank 1 already joined: the peer is told only "rejected" (one byte),
    /// rank 0 records the reason, and the group still forms when the real rank 2 arrives.
    fn rejects(hello: impl FnOnce(&[u8]) -> Vec<u8>, expected: &str) {
        let listener = Rendezvous::listen(root_cfg(3, 5000)).expect("listen");
        let addr = listener.local_addr();
        let (c1, c2) = (listener.client_config(1), listener.client_config(2));
        let root = thread::spawn(move || listener.accept_all());
        // rank 1 joins by hand first (the duplicate-rank case relies on it): rank 0 has admitted it once its
        // verdict arrived, and handles the next connection only after that
        let mut s1 = TcpStream::connect(addr).expect("connect");
        let Ok(session) = client_handshake(&mut s1, &c1, &key(), soon()) else { panic!("rank 1's handshake") };
        let mut rank1 = Conn { stream: s1, session };
        let mut s = TcpStream::connect(addr).expect("connect");
        let greeting = read_greeting(&mut s);
        s.write_all(&hello(&greeting)).expect("write hello");
        assert_eq!(rest(&mut s), [REJECT], "the only answer is 'rejected', then the connection closes");
        let t2 = thread::spawn(move || Rendezvous::connect(c2).and_then(|mut g| g.barrier()));
        let mut g0 = root.join().expect("root thread").expect("rank 0 survives the bad connection");
        let record = g0.rejections().clone();
        assert_eq!(record.count(), 1, "{record}");
        assert!(record.first()[0].contains(expected), "the record '{record}' should mention '{expected}'");
        let ctx = Ctx { peer: "rank 0", what: "test", after: Duration::from_secs(5), max: 1 << 20 };
        assert_eq!(rank1.recv(soon(), &ctx).expect("ready").0.kind, Kind::Ready);
        let t0 = thread::spawn(move || g0.barrier());
        rank1.send(Out { kind: Kind::Data, op: Op::Barrier, seq: 0, arg: 0 }, &[], soon(), &ctx).expect("barrier 1");
        assert_eq!(rank1.recv(soon(), &ctx).expect("barrier result").0.kind, Kind::Data);
        t0.join().expect("t0").expect("barrier 0");
        t2.join().expect("t2").expect("rank 2 joins after the rejection, barrier 2");
    }

    #[test]
    fn rejects_bad_magic() {
        rejects(|_| b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), "bad magic 'G");
    }

    #[test]
    fn rejects_wrong_version_and_protocol_1_clients() {
        rejects(
            |g| {
                let mut h = hello_for(g, &key(), 3, 2);
                h[8..12].copy_from_slice(&7u32.to_le_bytes());
                h
            },
            "protocol version 7 is not supported",
        );
        // a version-1 hello (magic, version 1, world, rank, key in clear)
        rejects(
            |_| {
                let mut h = MAGIC.to_vec();
                h.extend_from_slice(&1u32.to_le_bytes());
                h.extend_from_slice(&[0u8; 24]);
                h
            },
            "protocol version 1 is not supported",
        );
    }

    #[test]
    fn rejects_a_wrong_key_a_forged_proof_and_a_replayed_one() {
        rejects(|g| hello_for(g, &JobKey::from_secret(b"another job's secret!!"), 3, 2), "did not prove");
        rejects(
            |g| {
                let mut h = hello_for(g, &key(), 3, 2);
                let last = h.len() - 1;
                h[last] ^= 1;
                h
            },
            "did not prove",
        );
        // a proof made for another connection's nonce
        rejects(|_| hello_for(&[0u8; GREETING_LEN], &key(), 3, 2), "did not prove");
    }

    /// A rank that proves it holds the key but contradicts the job (`world`, `rank` in its hello): the job cannot
    /// form, and everyone hears it at once with the reason: rank 0 (an error, long before its timeout), the rank
    /// that joined before (a `Reject` frame), and the contradicting rank itself (admitted only to be told why).
    fn cannot_form(world: usize, rank: usize, expected: &str) {
        let timeout = Duration::from_secs(120);
        let listener = Rendezvous::listen(root_cfg(3, 120_000)).expect("listen");
        let addr = listener.local_addr();
        let c1 = listener.client_config(1);
        let started = Instant::now();
        let root = thread::spawn(move || listener.accept_all());
        let by = Instant::now() + Duration::from_secs(30);
        let mut s1 = TcpStream::connect(addr).expect("connect");
        let Ok(session) = client_handshake(&mut s1, &c1, &key(), by) else { panic!("rank 1's handshake") };
        let mut rank1 = Conn { stream: s1, session };
        let liar_cfg = RendezvousConfig { world, rank, ..c1 };
        let mut s = TcpStream::connect(addr).expect("connect");
        let Ok(session) = client_handshake(&mut s, &liar_cfg, &key(), by) else {
            panic!("a key holder passes the handshake (rank 0 proves itself before it tells why)")
        };
        let mut liar = Conn { stream: s, session };
        let ctx = Ctx { peer: "rank 0", what: "test", after: timeout, max: 1 << 20 };
        for (who, conn) in [("the contradicting rank", &mut liar), ("rank 1", &mut rank1)] {
            let (h, reason) = conn.recv(by, &ctx).expect("a frame");
            let reason = String::from_utf8_lossy(&reason).into_owned();
            assert_eq!(h.kind, Kind::Reject, "{who}");
            assert!(reason.contains(expected) && reason.contains("cannot form"), "{who}: {reason}");
        }
        match root.join().expect("root thread") {
            Err(Error::InvalidArgument(InvalidArgument::BadWorld(msg))) => assert!(msg.contains(expected), "{msg}"),
            other => panic!("rank 0 must give up with the reason, got {other:?}"),
        }
        // generous for a loaded machine, and far below the 120 s a rank would otherwise wait
        assert!(started.elapsed() < Duration::from_secs(60), "{:?}", started.elapsed());
    }

    #[test]
    fn a_world_mismatch_fails_every_rank_at_once() {
        cannot_form(4, 2, "has world size 4, rank 0 has 3");
    }

    #[test]
    fn a_rank_out_of_range_fails_every_rank_at_once() {
        cannot_form(3, 3, "rank 3 is out of range for a world of 3");
    }

    #[test]
    fn a_second_rank_0_fails_every_rank_at_once() {
        cannot_form(3, 0, "claimed rank 0");
    }

    #[test]
    fn a_duplicate_rank_fails_every_rank_at_once() {
        cannot_form(3, 1, "rank 1 already joined");
    }

    /// After the job cannot form, rank 0 keeps listening for the grace period: a stranger gets the one "rejected"
    /// byte and nothing else, a silent connection holds nobody up, and a late rank holding the key is admitted only
    /// to be told why (a `Reject` frame with the reason); rank 0 then returns, since every rank was told.
    #[test]
    fn late_ranks_are_told_why_and_strangers_nothing() {
        let listener = Rendezvous::listen(root_cfg(3, 120_000)).expect("listen");
        let addr = listener.local_addr();
        let (c1, c2) = (listener.client_config(1), listener.client_config(2));
        let started = Instant::now();
        let root = thread::spawn(move || listener.accept_all());
        let by = Instant::now() + Duration::from_secs(30);
        let ctx = Ctx { peer: "rank 0", what: "test", after: Duration::from_secs(120), max: 1 << 20 };
        let expected = "the job cannot form: rank 3 is out of range for a world of 3";
        let liar_cfg = RendezvousConfig { rank: 3, ..c1.clone() };
        let mut s = TcpStream::connect(addr).expect("connect");
        let Ok(session) = client_handshake(&mut s, &liar_cfg, &key(), by) else { panic!("the liar's handshake") };
        let (h, _) = Conn { stream: s, session }.recv(by, &ctx).expect("a frame");
        assert_eq!(h.kind, Kind::Reject);
        let _silent = TcpStream::connect(addr).expect("a silent connection");
        let mut stranger = TcpStream::connect(addr).expect("connect");
        let greeting = read_greeting(&mut stranger);
        stranger
            .write_all(&hello_for(&greeting, &JobKey::from_secret(b"another job's secret!!"), 3, 1))
            .expect("hello");
        assert_eq!(rest(&mut stranger), [REJECT], "a stranger learns nothing after the job failed either");
        for cfg in [c1, c2] {
            let mut s = TcpStream::connect(addr).expect("connect");
            let Ok(session) = client_handshake(&mut s, &cfg, &key(), by) else { panic!("a late rank's handshake") };
            let (h, reason) = Conn { stream: s, session }.recv(by, &ctx).expect("a frame");
            let reason = String::from_utf8_lossy(&reason).into_owned();
            assert_eq!(h.kind, Kind::Reject, "{reason}");
            assert!(reason.contains(expected), "{reason}");
        }
        assert!(matches!(root.join().expect("root"), Err(Error::InvalidArgument(_))));
        // generous for a loaded machine, and far below the 120 s timeout
        assert!(started.elapsed() < Duration::from_secs(60), "{:?}", started.elapsed());
    }

    /// Through the public API: a rank with the wrong world size gets a typed error with the reason at once, and
    /// so does a rank that had joined.
    #[test]
    fn connect_reports_why_the_job_cannot_form() {
        let listener = Rendezvous::listen(root_cfg(3, 120_000)).expect("listen");
        let addr = listener.local_addr();
        let c1 = listener.client_config(1);
        let wrong = RendezvousConfig { world: 5, rank: 2, ..listener.client_config(2) };
        let started = Instant::now();
        let root = thread::spawn(move || listener.accept_all());
        let by = Instant::now() + Duration::from_secs(30);
        let mut s1 = TcpStream::connect(addr).expect("connect");
        let Ok(session) = client_handshake(&mut s1, &c1, &key(), by) else { panic!("rank 1's handshake") };
        let mut rank1 = Conn { stream: s1, session };
        match Rendezvous::connect(wrong) {
            Err(Error::InvalidArgument(InvalidArgument::BadWorld(msg))) => {
                assert!(msg.contains("has world size 5, rank 0 has 3"), "{msg}")
            }
            other => panic!("expected a typed error with the reason, got {other:?}"),
        }
        let ctx = Ctx { peer: "rank 0", what: "test", after: Duration::from_secs(120), max: 1 << 20 };
        assert_eq!(rank1.recv(by, &ctx).expect("a frame").0.kind, Kind::Reject);
        assert!(matches!(root.join().expect("root"), Err(Error::InvalidArgument(_))));
        assert!(started.elapsed() < Duration::from_secs(60), "{:?}", started.elapsed());
    }

    #[test]
    fn rejections_are_reported_when_the_group_never_forms() {
        // 2 s: long enough to turn the stranger away before the deadline on a loaded machine
        let listener = Rendezvous::listen(root_cfg(2, 2000)).expect("listen");
        let addr = listener.local_addr();
        let root = thread::spawn(move || listener.accept_all());
        let mut s = TcpStream::connect(addr).expect("connect");
        let g = read_greeting(&mut s);
        s.write_all(&hello_for(&g, &JobKey::from_secret(b"wrong wrong wrong wrong"), 2, 1)).expect("hello");
        assert_eq!(rest(&mut s), [REJECT]);
        let err = root.join().expect("root").expect_err("rank 1 never joined");
        let text = err.to_string();
        assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
        assert!(text.contains("rank 1 to join") && text.contains("1 connection turned away"), "{text}");
        assert!(text.contains("did not prove it holds the job key"), "{text}");
    }

    #[test]
    fn the_rejection_record_is_bounded() {
        let listener = Rendezvous::listen(root_cfg(2, 5000)).expect("listen");
        let addr = listener.local_addr();
        let c1 = listener.client_config(1);
        let root = thread::spawn(move || listener.accept_all());
        for i in 0..20u8 {
            let mut s = TcpStream::connect(addr).expect("connect");
            s.write_all(&[b'x', i]).expect("garbage");
            let _ = rest(&mut s);
        }
        let _g1 = Rendezvous::connect(c1).expect("rank 1");
        let g0 = root.join().expect("root").expect("group");
        let r = g0.rejections();
        assert_eq!((r.count(), r.first().len()), (20, Rejections::KEPT), "{r}");
        assert!(r.to_string().ends_with("and 12 more"), "{r}");
    }

    #[test]
    fn a_full_pending_table_closes_the_oldest_and_real_ranks_still_join() {
        let listener = Rendezvous::listen(root_cfg(3, 10_000)).expect("listen").with_max_pending(4);
        let addr = listener.local_addr();
        let (c1, c2) = (listener.client_config(1), listener.client_config(2));
        let root = thread::spawn(move || listener.accept_all());
        // 20 silent connections; each one past the fourth pushes the oldest out
        let silent: Vec<TcpStream> = (0..20).map(|_| TcpStream::connect(addr).expect("connect")).collect();
        let start = Instant::now();
        let t1 = thread::spawn(move || Rendezvous::connect(c1));
        let _g2 = Rendezvous::connect(c2).expect("rank 2");
        let _g1 = t1.join().expect("t1").expect("rank 1");
        let g0 = root.join().expect("root").expect("group");
        // well under the 10 s timeout: the real ranks did not wait for the silent connections' deadlines
        assert!(start.elapsed() < Duration::from_secs(8), "took {:?}", start.elapsed());
        assert!(g0.rejections().count() >= 16, "{}", g0.rejections());
        assert!(g0.rejections().first().iter().any(|r| r.contains("closed to make room")), "{}", g0.rejections());
        drop(silent);
    }

    #[test]
    fn a_client_closed_before_the_verdict_connects_again() {
        let std_listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = std_listener.local_addr().expect("addr");
        let cfg = RendezvousConfig { master: addr, ..root_cfg(2, 5000) };
        let c1 = RendezvousConfig { rank: 1, ..cfg.clone() };
        let client = thread::spawn(move || Rendezvous::connect(c1).and_then(|mut g| g.all_gather(b"one")));
        // the first connection is dropped unanswered, as when rank 0 makes room
        drop(std_listener.accept().expect("first connection"));
        let listener = Listener { listener: std_listener, addr, cfg, key: key(), max_pending: MAX_PENDING };
        let mut g0 = listener.accept_all().expect("the second attempt joins");
        assert_eq!(g0.all_gather(b"zero").expect("gather"), vec![b"zero".to_vec(), b"one".to_vec()]);
        assert_eq!(client.join().expect("client").expect("rank 1"), vec![b"zero".to_vec(), b"one".to_vec()]);
    }

    /// Joins a world of 2 as rank 1 by hand, returning rank 0's thread and the raw authenticated connection.
    fn raw_rank1(max_message: usize) -> (thread::JoinHandle<Result<Rendezvous>>, Conn) {
        let listener = Rendezvous::listen(root_cfg(2, 3000).with_max_message(max_message)).expect("listen");
        let cfg = listener.client_config(1);
        let root = thread::spawn(move || listener.accept_all());
        let mut stream = TcpStream::connect(cfg.master).expect("connect");
        let Ok(session) = client_handshake(&mut stream, &cfg, &key(), soon()) else { panic!("handshake failed") };
        let mut conn = Conn { stream, session };
        let ctx = Ctx { peer: "rank 0", what: "test", after: Duration::from_secs(5), max: 1 << 20 };
        assert_eq!(conn.recv(soon(), &ctx).expect("ready").0.kind, Kind::Ready);
        (root, conn)
    }

    /// A frame sealed by `conn` for rank 0, as bytes (to be changed before sending).
    fn sealed(conn: &mut Conn, kind: u8, op: Op, payload: &[u8]) -> Vec<u8> {
        let mut header = encode_header(Kind::Data, op, 0, 0, payload.len());
        header[0] = kind;
        let tag = conn.session.seal(&header, payload).expect("seal");
        [&header[..], payload, &tag[..]].concat()
    }

    #[test]
    fn oversized_frame_is_rejected_without_allocating_it() {
        let (root, mut c) = raw_rank1(1024);
        let mut g0 = root.join().expect("root").expect("group");
        // claims 2^62 bytes (allocating that would abort the process), then sends a few
        let mut frame = sealed(&mut c, Kind::Data as u8, Op::AllGather, b"tiny");
        frame[18..26].copy_from_slice(&(1u64 << 62).to_le_bytes());
        c.stream.write_all(&frame).expect("frame");
        let err = g0.all_gather(b"x").expect_err("oversized frame");
        assert!(matches!(err, Error::PeerFailure(_)), "{err:?}");
        assert!(err.to_string().contains("exceeds max_message (1024 bytes)"), "{err}");
        let err = g0.all_gather(b"x").expect_err("broken group");
        assert!(err.to_string().contains("unusable after an earlier failure"), "{err}");

        // just over the limit, and properly sealed, is rejected too
        let (root, mut c) = raw_rank1(1024);
        let mut g0 = root.join().expect("root").expect("group");
        let frame = sealed(&mut c, Kind::Data as u8, Op::AllGather, &[0u8; 1025]);
        c.stream.write_all(&frame).expect("frame");
        let err = g0.all_gather(b"x").expect_err("1025 > 1024");
        assert!(err.to_string().contains("a frame of 1025 bytes exceeds max_message"), "{err}");
    }

    #[test]
    fn a_frame_that_claims_more_than_it_sends_times_out() {
        let (root, mut c) = raw_rank1(1 << 20);
        let mut g0 = root.join().expect("root").expect("group");
        g0.set_timeout(Duration::from_millis(300));
        let mut frame = sealed(&mut c, Kind::Data as u8, Op::AllGather, b"tiny");
        frame[18..26].copy_from_slice(&(1u64 << 20).to_le_bytes());
        c.stream.write_all(&frame).expect("frame");
        let err = g0.all_gather(b"x").expect_err("short frame");
        assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    }

    #[test]
    fn mismatched_collectives_are_an_error() {
        let (root, mut c) = raw_rank1(1 << 20);
        let mut g0 = root.join().expect("root").expect("group");
        let frame = sealed(&mut c, Kind::Data as u8, Op::Barrier, &[]);
        c.stream.write_all(&frame).expect("frame");
        let err = g0.all_gather(b"x").expect_err("rank 1 called barrier");
        assert!(err.to_string().contains("rank 1 called barrier #0"), "{err}");
    }

    #[test]
    fn garbage_frame_kind_is_an_error() {
        let (root, mut c) = raw_rank1(1 << 20);
        let mut g0 = root.join().expect("root").expect("group");
        let frame = sealed(&mut c, 0xee, Op::AllGather, b"x");
        c.stream.write_all(&frame).expect("frame");
        let err = g0.all_gather(b"x").expect_err("bad kind");
        assert!(err.to_string().contains("unknown frame kind 0xee"), "{err}");
    }

    #[test]
    fn changed_forged_and_replayed_frames_fail_authentication() {
        type Change = fn(&mut Conn) -> Vec<u8>;
        let changes: [(&str, Change); 3] = [
            ("changed", |c| {
                let mut f = sealed(c, Kind::Data as u8, Op::AllGather, b"genuine");
                f[HEADER_LEN] ^= 0x20;
                f
            }),
            ("forged", |_| {
                let mut f = encode_header(Kind::Data, Op::AllGather, 0, 0, 6).to_vec();
                f.extend_from_slice(b"forged");
                f.extend_from_slice(&[0u8; auth::LEN]);
                f
            }),
            ("replayed", |c| {
                // the first frame is genuine (frame 0); its replay claims to be frame 1
                let f = sealed(c, Kind::Data as u8, Op::AllGather, b"genuine");
                [f.clone(), f].concat()
            }),
        ];
        for (what, make) in changes {
            let (root, mut c) = raw_rank1(1 << 20);
            let mut g0 = root.join().expect("root").expect("group");
            let bytes = make(&mut c);
            c.stream.write_all(&bytes).expect("frame");
            let err = match what {
                "replayed" => {
                    g0.all_gather(b"x").expect("the genuine frame");
                    g0.all_gather(b"x").expect_err("its replay")
                }
                _ => g0.all_gather(b"x").expect_err(what),
            };
            assert!(err.to_string().contains("failed authentication"), "{what}: {err}");
        }
    }

    /// A hand-made rank 0 on `listener` that holds `key` (or not): admits one client and returns its connection.
    fn fake_root(listener: &TcpListener, key: &JobKey) -> (Conn, Vec<u8>) {
        let (mut s, _) = listener.accept().expect("accept");
        let mut greeting = preamble().to_vec();
        greeting.extend_from_slice(&[3u8; auth::LEN]);
        s.write_all(&greeting).expect("greeting");
        let mut hello = [0u8; HELLO_LEN];
        read_exact_by(&mut s, &mut hello, soon()).expect("hello");
        let t = Transcript {
            version: PROTOCOL_VERSION,
            world: u64_at(&hello, PREAMBLE_LEN),
            rank: u64_at(&hello, PREAMBLE_LEN + 8),
            client_nonce: array_at(&hello, PREAMBLE_LEN + 16),
            server_nonce: [3u8; auth::LEN],
        };
        let mut reply = vec![ACCEPT];
        reply.extend_from_slice(&t.server_proof(key).expect("proof"));
        s.write_all(&reply).expect("verdict");
        (Conn { stream: s, session: t.session(key, Side::Root).expect("session") }, hello.to_vec())
    }

    #[test]
    fn an_impostor_rank_0_is_refused_before_any_payload_and_sees_no_key() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let cfg = RendezvousConfig::new(1, 2, listener.local_addr().expect("addr"))
            .with_timeout(Duration::from_secs(5))
            .with_key(key());
        let client = thread::spawn(move || Rendezvous::connect(cfg).and_then(|mut g| g.all_gather(b"PAYLOAD")));
        let (mut conn, hello) = fake_root(&listener, &JobKey::from_secret(b"the impostor's guess at it"));
        let err = client.join().expect("client").expect_err("the impostor's proof is wrong");
        assert!(err.to_string().contains("did not prove it holds the job key"), "{err}");
        // the client sent its hello and nothing else, and neither the secret nor the key
        let mut sent = hello;
        sent.extend(rest(&mut conn.stream));
        assert_eq!(sent.len(), HELLO_LEN, "the client sent more than its hello");
        let has = |needle: &[u8]| sent.windows(needle.len()).any(|w| w == needle);
        assert!(!has(SECRET) && !has(key().bytes()) && !has(b"PAYLOAD"));
    }

    #[test]
    fn peer_text_is_sanitized_in_errors() {
        let evil = b"\x1b[2J\x1b[31mFAKE\nINFO: all good\x07";
        // a rank 0 holding the key abandons the rendezvous with escape codes in the reason
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let cfg = RendezvousConfig::new(1, 2, listener.local_addr().expect("addr"))
            .with_timeout(Duration::from_secs(5))
            .with_key(key());
        let c2 = cfg.clone();
        let client = thread::spawn(move || Rendezvous::connect(cfg));
        let (mut conn, _) = fake_root(&listener, &key());
        let abort = Out { kind: Kind::Abort, op: Op::Setup, seq: 0, arg: 0 };
        let ctx = Ctx { peer: "test", what: "test", after: Duration::from_secs(5), max: 0 };
        conn.send(abort, evil, soon(), &ctx).expect("abort");
        let text = client.join().expect("client").expect_err("abandoned").to_string();
        assert!(!text.contains('\x1b') && !text.contains('\n') && !text.contains('\x07'), "{text:?}");
        assert!(text.contains("\\u{1b}[2J\\u{1b}[31mFAKE\\nINFO: all good\\u{7}"), "{text:?}");

        // and in the middle of a collective, with a megabyte of it
        let client = thread::spawn(move || Rendezvous::connect(c2).and_then(|mut g| g.barrier()));
        let (mut conn, _) = fake_root(&listener, &key());
        let ready = Out { kind: Kind::Ready, op: Op::Setup, seq: 0, arg: 2 };
        conn.send(ready, &[], soon(), &ctx).expect("ready");
        let long: Vec<u8> = evil.iter().copied().cycle().take(1 << 20).collect();
        conn.send(abort, &long, soon(), &ctx).expect("abort");
        let text = client.join().expect("client").expect_err("aborted").to_string();
        assert!(!text.contains('\x1b') && !text.contains('\n'), "{:?}", &text[..100]);
        assert!(text.len() < MAX_REASON + 200, "{} bytes", text.len());
    }

    #[test]
    fn a_protocol_1_rank_0_is_named_at_once() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let cfg = RendezvousConfig::new(1, 2, listener.local_addr().expect("addr"))
            .with_timeout(Duration::from_secs(30))
            .with_key(key());
        let start = Instant::now();
        let client = thread::spawn(move || Rendezvous::connect(cfg));
        let (mut s, _) = listener.accept().expect("accept");
        let mut v1 = MAGIC.to_vec();
        v1.extend_from_slice(&1u32.to_le_bytes());
        s.write_all(&v1).expect("a version-1 preamble, and then nothing");
        let err = client.join().expect("client").expect_err("another version");
        assert!(err.to_string().contains("rank 0 speaks protocol version 1, this rank speaks 2"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    }

    #[test]
    fn huge_timeouts_and_worlds_are_errors_not_panics() {
        let addr: SocketAddr = "127.0.0.1:0".parse().expect("addr");
        for cfg in [
            RendezvousConfig::new(0, 1_000_000_000_000, addr),
            RendezvousConfig::new(0, usize::MAX, addr),
            RendezvousConfig::new(0, 2, addr).with_timeout(Duration::from_secs(10_000_000_000_000_000_000)),
            RendezvousConfig::new(0, 2, addr).with_timeout(Duration::MAX),
            RendezvousConfig::new(0, 2, addr).with_max_message(usize::MAX),
        ] {
            let e = Rendezvous::listen(cfg.clone()).expect_err("out of bounds");
            assert!(matches!(e, Error::InvalidArgument(InvalidArgument::BadWorld(_))), "{e:?}");
            let e = Rendezvous::connect(RendezvousConfig { rank: 1, ..cfg }).expect_err("out of bounds");
            assert!(matches!(e, Error::InvalidArgument(InvalidArgument::BadWorld(_))), "{e:?}");
        }
        let mut g = Rendezvous::establish(RendezvousConfig::new(0, 1, addr)).expect("world 1");
        g.set_timeout(Duration::MAX);
        assert_eq!(g.config().timeout, MAX_TIMEOUT);
        g.barrier().expect("a barrier with the longest timeout");
        assert!(deadline_after(Duration::MAX).is_err());
    }

    #[test]
    fn rank_lists_read_well() {
        assert_eq!(rank_list(&[2]), "rank 2");
        assert_eq!(rank_list(&[2, 3]), "ranks 2, 3");
        let many: Vec<usize> = (1..40).collect();
        assert!(rank_list(&many).ends_with("16 and 23 more"));
    }
}
