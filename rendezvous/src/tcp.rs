//! TCP rendezvous: rank 0 listens, the other ranks connect; collectives run as a star through rank 0.
//!
//! ## Wire protocol (version 1, little-endian)
//!
//! - client hello (36 bytes): magic `ANYCCLRV`, version `u32`, world `u64`, rank `u64`, key `u64`;
//! - every reply and every later message: magic and version (12 bytes, only before the first frame of rank 0's
//!   reply), then frames of a 26-byte header (kind `u8`, op `u8`, sequence `u64`, argument `u64`, length `u64`)
//!   followed by `length` bytes, at most `max_message`.
//!
//! Rank 0 answers a hello with `Accept` or `Reject` (the reason as payload, then it closes the connection), and
//! once every rank has joined it sends `Ready` to all (or `Abort` with the reason when it gives up). In a
//! collective each client sends one `Data` frame tagged with the operation and its sequence number; rank 0 checks
//! the tags (a rank calling another collective than the others is an error, not a silent mix-up), and replies with
//! the result frames, or with `Abort` to everyone when a rank failed.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyccl_core::{Error, InvalidArgument, Result};
use tracing::{debug, info, warn};

use crate::backend_error;
use crate::config::RendezvousConfig;

/// The first bytes of every hello and of rank 0's reply.
pub const MAGIC: [u8; 8] = *b"ANYCCLRV";

/// The wire protocol version this crate speaks.
pub const PROTOCOL_VERSION: u32 = 1;

/// Length of a client's hello: magic, version, world, rank, key.
const HELLO_LEN: usize = 8 + 4 + 8 + 8 + 8;
/// Length of a frame header: kind, op, sequence, argument, payload length.
const HEADER_LEN: usize = 1 + 1 + 8 + 8 + 8;
/// A connected client sends its hello at once; rank 0 gives a silent connection at most this long.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(5);
/// How long rank 0 spends telling the other ranks that it gave up.
const ABORT_LIMIT: Duration = Duration::from_secs(1);
/// How often rank 0 looks for a new connection while it waits for the ranks to join.
const ACCEPT_POLL: Duration = Duration::from_millis(5);
/// Payloads are read in chunks of at most this size, so a frame that claims more than it carries costs no memory.
const READ_CHUNK: usize = 64 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Accept = 1,
    Reject = 2,
    Ready = 3,
    Abort = 4,
    Data = 5,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        [Kind::Accept, Kind::Reject, Kind::Ready, Kind::Abort, Kind::Data].into_iter().find(|k| *k as u8 == b)
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

fn encode_frame(kind: Kind, op: Op, seq: u64, arg: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.push(kind as u8);
    out.push(op as u8);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&arg.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

fn encode_hello(world: u64, rank: u64, key: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(HELLO_LEN);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.extend_from_slice(&world.to_le_bytes());
    out.extend_from_slice(&rank.to_le_bytes());
    out.extend_from_slice(&key.to_le_bytes());
    out
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    if let Some(src) = b.get(at..at + 8) {
        w.copy_from_slice(src);
    }
    u64::from_le_bytes(w)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    if let Some(src) = b.get(at..at + 4) {
        w.copy_from_slice(src);
    }
    u32::from_le_bytes(w)
}

/// Reads one frame. The length is checked against `ctx.max` before anything is allocated, and the payload is read
/// in chunks, so memory grows only with the bytes that really arrive.
fn read_frame(stream: &mut TcpStream, deadline: Instant, ctx: &Ctx<'_>) -> Result<(Header, Vec<u8>)> {
    let mut h = [0u8; HEADER_LEN];
    read_exact_by(stream, &mut h, deadline).map_err(|e| ctx.io(e))?;
    let kind = Kind::from_u8(h[0]).ok_or_else(|| ctx.protocol(format_args!("unknown frame kind {:#04x}", h[0])))?;
    let op = Op::from_u8(h[1]).ok_or_else(|| ctx.protocol(format_args!("unknown operation {:#04x}", h[1])))?;
    let header = Header { kind, op, seq: u64_at(&h, 2), arg: u64_at(&h, 10), len: u64_at(&h, 18) };
    let len = match usize::try_from(header.len) {
        Ok(len) if len <= ctx.max => len,
        _ => {
            return Err(
                ctx.protocol(format_args!("a frame of {} bytes exceeds max_message ({} bytes)", header.len, ctx.max))
            )
        }
    };
    let mut payload = Vec::new();
    while payload.len() < len {
        let start = payload.len();
        payload.resize(start + (len - start).min(READ_CHUNK), 0);
        read_exact_by(stream, &mut payload[start..], deadline).map_err(|e| ctx.io(e))?;
    }
    Ok((header, payload))
}

/// Reads rank 0's magic and version, which precede its first frame.
fn read_server_preamble(stream: &mut TcpStream, deadline: Instant, ctx: &Ctx<'_>) -> Result<()> {
    let mut b = [0u8; 12];
    read_exact_by(stream, &mut b, deadline).map_err(|e| ctx.io(e))?;
    if b[..8] != MAGIC {
        return Err(ctx.protocol("bad magic: the service there is not an anyccl rendezvous"));
    }
    let version = u32_at(&b, 8);
    if version != PROTOCOL_VERSION {
        return Err(
            ctx.protocol(format_args!("rank 0 speaks protocol version {version}, this rank speaks {PROTOCOL_VERSION}"))
        );
    }
    Ok(())
}

fn server_preamble() -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out
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

/// Rank 0's listening socket, bound but not yet accepting: [`Listener::local_addr`] tells the port when the
/// configuration asked for port 0 (tests, in-process groups).
#[derive(Debug)]
pub struct Listener {
    listener: TcpListener,
    addr: SocketAddr,
    cfg: RendezvousConfig,
}

impl Listener {
    /// The address rank 0 listens on (with the real port when port 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The configuration for rank `rank` of this group: this listener's real address, and the same world, job
    /// key, timeout and message limit as rank 0.
    pub fn client_config(&self, rank: usize) -> RendezvousConfig {
        RendezvousConfig { rank, local_rank: None, master: self.addr, ..self.cfg.clone() }
    }

    /// Waits (up to the configured timeout) until every other rank has connected and passed the handshake, then
    /// tells them the group is ready.
    ///
    /// A connection with a bad handshake (bad magic, another protocol version, another world size or job key, a
    /// rank out of range, rank 0, or a rank that already joined) is answered with the reason, closed and logged;
    /// rank 0 keeps waiting for the real ranks. When the timeout passes, the error names the ranks that did not
    /// join (and the rejected connections), and the ranks that did join are told why the group was abandoned.
    pub fn accept_all(self) -> Result<Rendezvous> {
        let Listener { listener, addr, cfg } = self;
        let world = cfg.world;
        let start = Instant::now();
        let deadline = start + cfg.timeout;
        let mut peers: Vec<Option<TcpStream>> = (1..world).map(|_| None).collect();
        let mut rejected: Vec<String> = Vec::new();
        listener.set_nonblocking(true).map_err(|e| backend_error("set_nonblocking", e.to_string()))?;

        while peers.iter().any(Option::is_none) {
            if remaining(deadline).is_none() {
                let missing: Vec<usize> =
                    peers.iter().enumerate().filter(|(_, p)| p.is_none()).map(|(i, _)| i + 1).collect();
                let mut what = format!("{} to join the rendezvous at {addr} (world {world})", rank_list(&missing));
                if !rejected.is_empty() {
                    const SHOWN: usize = 8;
                    let shown: Vec<&str> = rejected.iter().take(SHOWN).map(String::as_str).collect();
                    what.push_str(&format!("; rejected connections: {}", shown.join("; ")));
                    if rejected.len() > SHOWN {
                        what.push_str(&format!(" and {} more", rejected.len() - SHOWN));
                    }
                }
                let err = Error::Timeout { what, after: cfg.timeout };
                warn!(target: "anyccl::rendezvous", "{err}");
                abort_all(peers.iter_mut().flatten(), &err.to_string());
                return Err(err);
            }
            match listener.accept() {
                Ok((mut stream, from)) => match admit(&mut stream, from, &cfg, &peers, deadline) {
                    Ok(rank) => {
                        debug!(target: "anyccl::rendezvous", "rank {rank} joined from {from}");
                        if let Some(slot) = peers.get_mut(rank - 1) {
                            *slot = Some(stream);
                        }
                    }
                    Err(reason) => {
                        warn!(target: "anyccl::rendezvous", "rejected a connection from {from}: {reason}");
                        rejected.push(format!("{from}: {reason}"));
                    }
                },
                Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => {
                    if let Some(left) = remaining(deadline) {
                        std::thread::sleep(left.min(ACCEPT_POLL));
                    }
                }
                Err(e) => {
                    warn!(target: "anyccl::rendezvous", "accept on {addr} failed: {e}");
                    rejected.push(format!("accept failed: {e}"));
                    if let Some(left) = remaining(deadline) {
                        std::thread::sleep(left.min(ACCEPT_POLL));
                    }
                }
            }
        }

        let peers: Vec<TcpStream> = peers.into_iter().flatten().collect();
        let ready = encode_frame(Kind::Ready, Op::Setup, 0, world as u64, &[]);
        let mut group = Rendezvous { cfg, role: Role::Root { peers }, seq: 0, broken: None };
        if let Role::Root { peers } = &mut group.role {
            for (i, stream) in peers.iter_mut().enumerate() {
                let peer = format!("rank {}", i + 1);
                let ctx = Ctx { peer: &peer, what: "the rendezvous setup", after: group.cfg.timeout, max: 0 };
                if let Err(e) = write_all_by(stream, &ready, deadline.max(Instant::now() + ABORT_LIMIT)) {
                    let err = ctx.io(e);
                    abort_all(peers.iter_mut(), &err.to_string());
                    return Err(err);
                }
            }
        }
        info!(target: "anyccl::rendezvous", "rendezvous at {addr}: all {world} ranks joined in {:?}", start.elapsed());
        Ok(group)
    }
}

/// Reads and checks one hello; on success answers `Accept` and returns the rank, else answers `Reject` (where the
/// connection still works), closes it, and returns the reason.
fn admit(
    stream: &mut TcpStream,
    from: SocketAddr,
    cfg: &RendezvousConfig,
    peers: &[Option<TcpStream>],
    deadline: Instant,
) -> std::result::Result<usize, String> {
    let limit = deadline.min(Instant::now() + HANDSHAKE_LIMIT);
    let reply_by = deadline.max(Instant::now() + ABORT_LIMIT);
    let setup = |s: &TcpStream| -> io::Result<()> {
        s.set_nonblocking(false)?;
        s.set_nodelay(true)
    };
    if let Err(e) = setup(stream) {
        return Err(format!("cannot configure the connection: {e}"));
    }
    let checked = check_hello(stream, cfg, peers, limit);
    match checked {
        Ok(rank) => {
            let mut reply = server_preamble();
            reply.extend_from_slice(&encode_frame(Kind::Accept, Op::Setup, 0, rank as u64, &[]));
            write_all_by(stream, &reply, reply_by)
                .map_err(|e| format!("rank {rank} passed the handshake but the reply failed: {e}"))?;
            Ok(rank)
        }
        Err(reason) => {
            if reason.reply {
                let mut reply = server_preamble();
                reply.extend_from_slice(&encode_frame(Kind::Reject, Op::Setup, 0, 0, reason.text.as_bytes()));
                if let Err(e) = write_all_by(stream, &reply, limit.max(Instant::now() + ABORT_LIMIT)) {
                    debug!(target: "anyccl::rendezvous", "could not tell {from} why it was rejected: {e}");
                }
            }
            let _ = stream.shutdown(Shutdown::Write);
            if reason.reply {
                drain(stream);
            }
            Err(reason.text)
        }
    }
}

/// Reads and drops what a rejected client still sends (briefly), so that closing the connection does not reset it
/// before the client has read the reason.
fn drain(stream: &mut TcpStream) {
    let until = Instant::now() + Duration::from_millis(250);
    let mut buf = [0u8; 4096];
    let mut total = 0usize;
    while total < READ_CHUNK {
        let Some(left) = remaining(until) else { break };
        if stream.set_read_timeout(Some(left)).is_err() {
            break;
        }
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => total += n,
        }
    }
}

struct Rejection {
    text: String,
    /// Whether the connection can still carry the reason back.
    reply: bool,
}

fn check_hello(
    stream: &mut TcpStream,
    cfg: &RendezvousConfig,
    peers: &[Option<TcpStream>],
    limit: Instant,
) -> std::result::Result<usize, Rejection> {
    let io_fail = |e: io::Error| Rejection {
        text: match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => "no handshake arrived in time".to_owned(),
            io::ErrorKind::UnexpectedEof => "the connection closed during the handshake".to_owned(),
            _ => format!("the handshake failed: {e}"),
        },
        reply: false,
    };
    let reject = |text: String| Err(Rejection { text, reply: true });
    let mut hello = [0u8; HELLO_LEN];
    read_exact_by(stream, &mut hello[..8], limit).map_err(io_fail)?;
    if hello[..8] != MAGIC {
        return reject(format!(
            "bad magic {:?}: not an anyccl rendezvous client (expected {:?})",
            String::from_utf8_lossy(&hello[..8]),
            String::from_utf8_lossy(&MAGIC)
        ));
    }
    read_exact_by(stream, &mut hello[8..12], limit).map_err(io_fail)?;
    let version = u32_at(&hello, 8);
    if version != PROTOCOL_VERSION {
        return reject(format!(
            "protocol version {version} is not supported (rank 0 speaks version {PROTOCOL_VERSION})"
        ));
    }
    read_exact_by(stream, &mut hello[12..], limit).map_err(io_fail)?;
    let (world, rank, key) = (u64_at(&hello, 12), u64_at(&hello, 20), u64_at(&hello, 28));
    if world != cfg.world as u64 {
        return reject(format!("world size mismatch: the client has world size {world}, rank 0 has {}", cfg.world));
    }
    if key != cfg.key {
        return reject(format!(
            "job key mismatch: the client has key {key:#018x}, rank 0 has {:#018x} (a process of another job? check \
             ANYCCL_RENDEZVOUS_KEY, MASTER_ADDR and MASTER_PORT)",
            cfg.key
        ));
    }
    let rank = match usize::try_from(rank) {
        Ok(r) if r < cfg.world => r,
        _ => return reject(format!("rank {rank} is out of range for a world of {}", cfg.world)),
    };
    if rank == 0 {
        return reject("a client claimed rank 0, which is the listener (two processes with RANK=0?)".into());
    }
    if peers.get(rank - 1).is_some_and(Option::is_some) {
        return reject(format!("rank {rank} already joined (two processes with RANK={rank}?)"));
    }
    Ok(rank)
}

/// Tells every stream that the group is abandoned (best effort, about one second in all).
fn abort_all<'a>(streams: impl Iterator<Item = &'a mut TcpStream>, reason: &str) {
    let frame = encode_frame(Kind::Abort, Op::Setup, 0, 0, reason.as_bytes());
    let by = Instant::now() + ABORT_LIMIT;
    for s in streams {
        let _ = write_all_by(s, &frame, by);
        let _ = s.shutdown(Shutdown::Write);
    }
}

#[derive(Debug)]
enum Role {
    /// Rank 0: one stream per other rank, index `rank - 1`.
    Root { peers: Vec<TcpStream> },
    /// Any other rank: the stream to rank 0.
    Client { stream: TcpStream },
}

/// An established rendezvous group: every rank connected (star through rank 0), ready for collectives.
///
/// After a failure (a peer died, a timeout, a protocol error) the group is broken: every later call returns
/// [`Error::PeerFailure`] with the first failure's text. Dropping a rank closes its connections, which its peers
/// see as a [`Error::PeerFailure`] in their next collective.
#[derive(Debug)]
pub struct Rendezvous {
    cfg: RendezvousConfig,
    role: Role,
    seq: u64,
    broken: Option<String>,
}

impl Rendezvous {
    /// Rank 0's first step: binds exactly `cfg.master` (port 0 picks a free port; see [`Listener::local_addr`]).
    /// Then call [`Listener::accept_all`].
    pub fn listen(cfg: RendezvousConfig) -> Result<Listener> {
        cfg.validate()?;
        if cfg.rank != 0 {
            return Err(Error::InvalidArgument(InvalidArgument::BadWorld(format!(
                "rank {} cannot listen: only rank 0 does (the others call Rendezvous::connect)",
                cfg.rank
            ))));
        }
        let listener = TcpListener::bind(cfg.master)
            .map_err(|e| backend_error("bind", format!("cannot listen on {}: {e}", cfg.master)))?;
        let addr = listener.local_addr().map_err(|e| backend_error("local_addr", e.to_string()))?;
        debug!(target: "anyccl::rendezvous", "rank 0 listening on {addr} for {} ranks", cfg.world);
        Ok(Listener { listener, addr, cfg })
    }

    /// A rank other than 0: connects to rank 0 (retrying until the timeout, since rank 0 may start later), passes
    /// the handshake, and waits until rank 0 reports that every rank joined.
    pub fn connect(cfg: RendezvousConfig) -> Result<Rendezvous> {
        cfg.validate()?;
        if cfg.rank == 0 {
            return Err(Error::InvalidArgument(InvalidArgument::BadWorld(
                "rank 0 cannot connect: it listens (call Rendezvous::listen or Rendezvous::establish)".into(),
            )));
        }
        let deadline = Instant::now() + cfg.timeout;
        let master = cfg.master;
        let mut backoff = Duration::from_millis(10);
        let mut stream = loop {
            let Some(left) = remaining(deadline) else {
                return Err(Error::Timeout {
                    what: format!("rank 0 to accept a connection at {master}"),
                    after: cfg.timeout,
                });
            };
            match TcpStream::connect_timeout(&master, left) {
                Ok(s) => break s,
                Err(e) => {
                    debug!(target: "anyccl::rendezvous", "rank {}: connecting to {master} failed ({e}); retrying", cfg.rank);
                    if let Some(left) = remaining(deadline) {
                        std::thread::sleep(left.min(backoff));
                    }
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
            }
        };
        let peer = format!("rank 0 at {master}");
        let ctx = Ctx { peer: &peer, what: "the rendezvous handshake", after: cfg.timeout, max: cfg.max_message };
        stream.set_nodelay(true).map_err(|e| ctx.io(e))?;
        let hello = encode_hello(cfg.world as u64, cfg.rank as u64, cfg.key);
        write_all_by(&mut stream, &hello, deadline).map_err(|e| ctx.io(e))?;
        read_server_preamble(&mut stream, deadline, &ctx)?;
        let (h, payload) = read_frame(&mut stream, deadline, &ctx)?;
        match h.kind {
            Kind::Accept => {}
            Kind::Reject => {
                return Err(Error::PeerFailure(format!(
                    "rank 0 at {master} rejected rank {}: {}",
                    cfg.rank,
                    String::from_utf8_lossy(&payload)
                )))
            }
            other => return Err(ctx.protocol(format_args!("expected Accept or Reject, got {other:?}"))),
        }
        let ctx = Ctx { what: "the wait for all ranks to join", ..ctx };
        let (h, payload) = read_frame(&mut stream, deadline, &ctx).map_err(|e| match e {
            Error::Timeout { after, .. } => Error::Timeout {
                what: format!("rank 0 at {master} to report that all {} ranks joined", cfg.world),
                after,
            },
            e => e,
        })?;
        match h.kind {
            Kind::Ready => {}
            Kind::Abort => {
                return Err(Error::PeerFailure(format!(
                    "rank 0 abandoned the rendezvous: {}",
                    String::from_utf8_lossy(&payload)
                )))
            }
            other => return Err(ctx.protocol(format_args!("expected Ready or Abort, got {other:?}"))),
        }
        debug!(target: "anyccl::rendezvous", "rank {} joined the rendezvous at {master}", cfg.rank);
        Ok(Rendezvous { cfg, role: Role::Client { stream }, seq: 0, broken: None })
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

    /// Changes how long each later collective may take before [`Error::Timeout`] (a zero duration is ignored).
    pub fn set_timeout(&mut self, timeout: Duration) {
        if !timeout.is_zero() {
            self.cfg.timeout = timeout;
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
        self.seq += 1;
        let result = match &mut self.role {
            Role::Root { peers } => root_collective(&self.cfg, peers, op, seq, arg, data),
            Role::Client { stream } => client_collective(&self.cfg, stream, op, seq, arg, data),
        };
        if let Err(e) = &result {
            warn!(target: "anyccl::rendezvous", "rank {}: {op} #{seq} failed: {e}", self.cfg.rank);
            self.broken = Some(e.to_string());
        }
        result
    }
}

fn result_count(op: Op, world: usize) -> usize {
    match op {
        Op::AllGather => world,
        _ => 1,
    }
}

fn root_collective(
    cfg: &RendezvousConfig,
    peers: &mut [TcpStream],
    op: Op,
    seq: u64,
    arg: u64,
    data: &[u8],
) -> Result<Vec<Vec<u8>>> {
    let deadline = Instant::now() + cfg.timeout;
    let what = format!("{op} #{seq}");
    let mut contributions = Vec::with_capacity(cfg.world);
    contributions.push(data.to_vec());
    for i in 0..peers.len() {
        let rank = i + 1;
        let peer = format!("rank {rank}");
        let ctx = Ctx { peer: &peer, what: &what, after: cfg.timeout, max: cfg.max_message };
        let received = match peers.get_mut(i) {
            Some(stream) => read_frame(stream, deadline, &ctx).and_then(|(h, payload)| {
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
                let others = peers.iter_mut().enumerate().filter(|(j, _)| *j != i).map(|(_, s)| s);
                abort_all(others, &format!("rank 0 gave up {what}: {e}"));
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
    let mut reply = Vec::new();
    for r in &results {
        reply.extend_from_slice(&encode_frame(Kind::Data, op, seq, arg, r));
    }
    for i in 0..peers.len() {
        let peer = format!("rank {}", i + 1);
        let ctx = Ctx { peer: &peer, what: &what, after: cfg.timeout, max: cfg.max_message };
        let sent = match peers.get_mut(i) {
            Some(stream) => write_all_by(stream, &reply, deadline).map_err(|e| ctx.io(e)),
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
    stream: &mut TcpStream,
    op: Op,
    seq: u64,
    arg: u64,
    data: &[u8],
) -> Result<Vec<Vec<u8>>> {
    let deadline = Instant::now() + cfg.timeout;
    let what = format!("{op} #{seq}");
    let ctx = Ctx { peer: "rank 0", what: &what, after: cfg.timeout, max: cfg.max_message };
    write_all_by(stream, &encode_frame(Kind::Data, op, seq, arg, data), deadline).map_err(|e| ctx.io(e))?;
    let n = result_count(op, cfg.world);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let (h, payload) = read_frame(stream, deadline, &ctx)?;
        match h.kind {
            Kind::Data if (h.op, h.seq, h.arg) == (op, seq, arg) => out.push(payload),
            Kind::Data => {
                return Err(ctx.protocol(format_args!(
                    "a reply for {} #{} (argument {}) arrived during {op} #{seq} (argument {arg})",
                    h.op, h.seq, h.arg
                )))
            }
            Kind::Abort => return Err(Error::PeerFailure(String::from_utf8_lossy(&payload).into_owned())),
            other => return Err(ctx.protocol(format_args!("expected a Data frame, got {other:?}"))),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    //! Protocol-level tests: a raw `TcpStream` speaks (bad) handshakes and frames to a real rank 0.
    use super::*;
    use std::thread;

    const KEY: u64 = 0x5eed;

    fn root_cfg(world: usize, timeout_ms: u64) -> RendezvousConfig {
        let addr: SocketAddr = "127.0.0.1:0".parse().expect("addr");
        RendezvousConfig::new(0, world, addr).with_timeout(Duration::from_millis(timeout_ms)).with_key(KEY)
    }

    /// Sends `hello` on a raw connection and returns rank 0's reply: the reply frame's kind and payload.
    fn raw_hello(addr: SocketAddr, hello: &[u8]) -> (Kind, String) {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.write_all(hello).expect("write hello");
        let deadline = Instant::now() + Duration::from_secs(5);
        let ctx = Ctx { peer: "rank 0", what: "test", after: Duration::from_secs(5), max: 1 << 20 };
        read_server_preamble(&mut s, deadline, &ctx).expect("preamble");
        let (h, payload) = read_frame(&mut s, deadline, &ctx).expect("reply frame");
        if h.kind == Kind::Reject {
            // rank 0 closes a rejected connection
            let mut rest = Vec::new();
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            assert_eq!(s.read_to_end(&mut rest).expect("read to EOF"), 0, "rank 0 must close after a rejection");
        }
        (h.kind, String::from_utf8_lossy(&payload).into_owned())
    }

    /// One bad hello in a world of 3 whose rank 1 already joined; rank 0 rejects it and still forms the group
    /// when the real rank 2 arrives.
    fn rejects(hello: impl FnOnce(&Listener) -> Vec<u8>, expected: &str) {
        let listener = Rendezvous::listen(root_cfg(3, 5000)).expect("listen");
        let addr = listener.local_addr();
        let (c1, c2) = (listener.client_config(1), listener.client_config(2));
        let bad = hello(&listener);
        let root = thread::spawn(move || listener.accept_all());
        let r1 = thread::spawn(move || Rendezvous::connect(c1));
        // rank 1 must be in before the bad hello (the duplicate-rank case relies on it)
        thread::sleep(Duration::from_millis(300));
        let (kind, reason) = raw_hello(addr, &bad);
        assert_eq!(kind, Kind::Reject, "{reason}");
        assert!(reason.contains(expected), "rejection '{reason}' should mention '{expected}'");
        let mut g2 = Rendezvous::connect(c2).expect("rank 2 joins after the rejection");
        let mut g0 = root.join().expect("root thread").expect("rank 0 survives the bad connection");
        let mut g1 = r1.join().expect("rank 1 thread").expect("rank 1 joins");
        let t1 = thread::spawn(move || g1.barrier());
        let t2 = thread::spawn(move || g2.barrier());
        g0.barrier().expect("barrier 0");
        t1.join().expect("t1").expect("barrier 1");
        t2.join().expect("t2").expect("barrier 2");
    }

    #[test]
    fn rejects_bad_magic() {
        rejects(|_| b"GET / HTTP/1.1\r\nHost: x\r\n\r\n-----------".to_vec(), "bad magic");
    }

    #[test]
    fn rejects_wrong_version() {
        rejects(
            |_| {
                let mut h = encode_hello(3, 2, KEY);
                h[8..12].copy_from_slice(&7u32.to_le_bytes());
                h
            },
            "protocol version 7 is not supported",
        );
    }

    #[test]
    fn rejects_world_mismatch() {
        rejects(|_| encode_hello(4, 2, KEY), "world size mismatch: the client has world size 4, rank 0 has 3");
    }

    #[test]
    fn rejects_wrong_key() {
        rejects(|_| encode_hello(3, 2, KEY + 1), "job key mismatch");
    }

    #[test]
    fn rejects_rank_out_of_range() {
        rejects(|_| encode_hello(3, 3, KEY), "rank 3 is out of range for a world of 3");
        rejects(|_| encode_hello(3, u64::MAX, KEY), "out of range");
    }

    #[test]
    fn rejects_rank_zero_claimed() {
        rejects(|_| encode_hello(3, 0, KEY), "claimed rank 0");
    }

    #[test]
    fn rejects_duplicate_rank() {
        rejects(|_| encode_hello(3, 1, KEY), "rank 1 already joined");
    }

    #[test]
    fn rejections_are_reported_when_the_group_never_forms() {
        let listener = Rendezvous::listen(root_cfg(2, 400)).expect("listen");
        let addr = listener.local_addr();
        let root = thread::spawn(move || listener.accept_all());
        let (kind, _) = raw_hello(addr, &encode_hello(2, 1, KEY ^ 1));
        assert_eq!(kind, Kind::Reject);
        let err = root.join().expect("root").expect_err("rank 1 never joined");
        let text = err.to_string();
        assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
        assert!(text.contains("rank 1 to join") && text.contains("job key mismatch"), "{text}");
    }

    #[test]
    fn silent_connection_does_not_block_the_group() {
        let listener = Rendezvous::listen(root_cfg(2, 3000)).expect("listen");
        let addr = listener.local_addr();
        let c1 = listener.client_config(1);
        let root = thread::spawn(move || listener.accept_all());
        // connects and closes without a word
        drop(TcpStream::connect(addr).expect("connect"));
        let g1 = Rendezvous::connect(c1).expect("rank 1 joins");
        let g0 = root.join().expect("root").expect("group forms");
        assert_eq!((g0.world(), g1.rank()), (2, 1));
    }

    /// Joins a world of 2 as rank 1 by hand, returning rank 0's thread and the raw stream.
    fn raw_rank1(max_message: usize) -> (thread::JoinHandle<Result<Rendezvous>>, TcpStream) {
        let listener = Rendezvous::listen(root_cfg(2, 3000).with_max_message(max_message)).expect("listen");
        let addr = listener.local_addr();
        let root = thread::spawn(move || listener.accept_all());
        let mut s = TcpStream::connect(addr).expect("connect");
        s.write_all(&encode_hello(2, 1, KEY)).expect("hello");
        let deadline = Instant::now() + Duration::from_secs(5);
        let ctx = Ctx { peer: "rank 0", what: "test", after: Duration::from_secs(5), max: 1 << 20 };
        read_server_preamble(&mut s, deadline, &ctx).expect("preamble");
        assert_eq!(read_frame(&mut s, deadline, &ctx).expect("accept").0.kind, Kind::Accept);
        assert_eq!(read_frame(&mut s, deadline, &ctx).expect("ready").0.kind, Kind::Ready);
        (root, s)
    }

    #[test]
    fn oversized_frame_is_rejected_without_allocating_it() {
        let (root, mut s) = raw_rank1(1024);
        let mut g0 = root.join().expect("root").expect("group");
        // claims 2^62 bytes (allocating that would abort the process), then sends a few
        let mut frame = encode_frame(Kind::Data, Op::AllGather, 0, 0, b"tiny");
        frame[18..26].copy_from_slice(&(1u64 << 62).to_le_bytes());
        s.write_all(&frame).expect("frame");
        let err = g0.all_gather(b"x").expect_err("oversized frame");
        assert!(matches!(err, Error::PeerFailure(_)), "{err:?}");
        assert!(err.to_string().contains("exceeds max_message (1024 bytes)"), "{err}");
        // just over the limit is rejected too, and the group stays broken
        let err = g0.all_gather(b"x").expect_err("broken group");
        assert!(err.to_string().contains("unusable after an earlier failure"), "{err}");

        let (root, mut s) = raw_rank1(1024);
        let mut g0 = root.join().expect("root").expect("group");
        s.write_all(&encode_frame(Kind::Data, Op::AllGather, 0, 0, &[0u8; 1025])).expect("frame");
        let err = g0.all_gather(b"x").expect_err("1025 > 1024");
        assert!(err.to_string().contains("a frame of 1025 bytes exceeds max_message"), "{err}");
    }

    #[test]
    fn a_frame_that_claims_more_than_it_sends_times_out() {
        let (root, mut s) = raw_rank1(1 << 20);
        let mut g0 = root.join().expect("root").expect("group");
        g0.set_timeout(Duration::from_millis(300));
        let mut frame = encode_frame(Kind::Data, Op::AllGather, 0, 0, b"tiny");
        frame[18..26].copy_from_slice(&(1u64 << 20).to_le_bytes());
        s.write_all(&frame).expect("frame");
        let err = g0.all_gather(b"x").expect_err("short frame");
        assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    }

    #[test]
    fn mismatched_collectives_are_an_error() {
        let (root, mut s) = raw_rank1(1 << 20);
        let mut g0 = root.join().expect("root").expect("group");
        s.write_all(&encode_frame(Kind::Data, Op::Barrier, 0, 0, &[])).expect("frame");
        let err = g0.all_gather(b"x").expect_err("rank 1 called barrier");
        assert!(err.to_string().contains("rank 1 called barrier #0"), "{err}");
    }

    #[test]
    fn garbage_frame_kind_is_an_error() {
        let (root, mut s) = raw_rank1(1 << 20);
        let mut g0 = root.join().expect("root").expect("group");
        let mut frame = encode_frame(Kind::Data, Op::AllGather, 0, 0, b"x");
        frame[0] = 0xee;
        s.write_all(&frame).expect("frame");
        let err = g0.all_gather(b"x").expect_err("bad kind");
        assert!(err.to_string().contains("unknown frame kind 0xee"), "{err}");
    }

    #[test]
    fn rank_lists_read_well() {
        assert_eq!(rank_list(&[2]), "rank 2");
        assert_eq!(rank_list(&[2, 3]), "ranks 2, 3");
        let many: Vec<usize> = (1..40).collect();
        assert!(rank_list(&many).ends_with("16 and 23 more"));
    }
}
