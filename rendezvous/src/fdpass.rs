//! File-descriptor passing over a Unix-domain socket (`SCM_RIGHTS`), between processes of the same user.
//!
//! CUDA VMM exports device memory as a POSIX file descriptor; another process can only import it after the fd was
//! passed to it through a Unix socket. [`FdServer`] creates a `SOCK_SEQPACKET` socket in a fresh private directory
//! (mode 0700, under `$XDG_RUNTIME_DIR` when set, else the temporary directory), with the socket file at mode 0600;
//! both are removed when the server is dropped, and directories that servers of dead processes left behind are
//! removed when the next server is created (see [`FdServer::bind_in`]). Both ends check the other's credentials
//! (`SO_PEERCRED`) and refuse a process of another user.
//!
//! A message is one packet: a 12-byte header (magic `AFD1`, fd count `u32`, payload length `u32`, little-endian),
//! the payload (at most [`MAX_PAYLOAD`] bytes), and up to [`MAX_FDS`] descriptors. The receive buffers have fixed
//! sizes (the header's fields are compared with what actually arrived, never used to size anything), and received
//! descriptors are [`OwnedFd`]s, closed when dropped, also when the message is refused or the kernel delivered
//! only some of them.
//!
//! An orderly close and an empty packet both make `recvmsg` return 0 bytes on a `SOCK_SEQPACKET` socket (Linux
//! sets no `MSG_EOR` on Unix sockets, and a valid message is never empty: it has a 12-byte header). They are told
//! apart by the socket's state: `recvmsg` only reports the end of the connection once the peer has shut it down,
//! which `poll` shows as `POLLRDHUP` from then on; so 0 bytes on a connection without `POLLRDHUP` were an empty
//! packet, and so were 0 bytes followed by a queued packet that is not empty (looked at with `MSG_PEEK`). An empty
//! packet with nothing after it from a peer that has already closed its end reads as the close: the peer is gone
//! either way.
//!
//! Receiving uses `rustix`'s `recvmsg`, which hands over the descriptors of a truncated control message
//! (`MSG_CTRUNC`, when this process is at its descriptor limit) as [`OwnedFd`]s; `nix`'s refuses to parse those,
//! which leaked them. The rest stays on `nix`: in particular the peer credentials, which `rustix` keeps in a
//! non-zero pid type that the kernel's pid 0 (a peer in a pid namespace this process cannot see) would break;
//! for the same reason no socket here asks for `SCM_CREDENTIALS` messages.
//!
//! [`FdServer::gather`] is the exchange: it waits for the messages of a number of peers, each connection with its
//! own deadline, and drops (and logs) every connection that is foreign, malformed, silent or refused by the caller's
//! check, without ending the exchange.

use std::cmp::min;
use std::fs;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyccl_core::{Error, Result};
use nix::errno::Errno;
use nix::libc;
use nix::sys::signal::kill;
use nix::sys::socket::{
    accept4, bind, connect, getsockopt, listen, recv, sendmsg, setsockopt, socket, sockopt, AddressFamily, Backlog,
    ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr, UnixCredentials,
};
use nix::sys::time::TimeVal;
use nix::unistd::{getuid, Pid};
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags};
use tracing::{debug, warn};

use crate::backend_error;

/// The largest payload of one message (64 KiB).
pub const MAX_PAYLOAD: usize = 64 * 1024;

/// The most file descriptors one message may carry.
pub const MAX_FDS: usize = 64;

/// How long sends, receives, accepts, connects and a whole [`FdServer::gather`] wait by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long, by default, an accepted connection may take to deliver its message in [`FdServer::gather`] before it
/// is dropped (each connection has its own deadline; the whole exchange still ends at the server's timeout).
pub const DEFAULT_PENDING_TIMEOUT: Duration = Duration::from_secs(10);

/// The most accepted connections [`FdServer::gather`] holds open while they have not sent their message; more
/// wait in the listen backlog until one is done.
pub const MAX_PENDING: usize = 64;

const MAGIC: [u8; 4] = *b"AFD1";
const HEADER_LEN: usize = 12;
const SOCKET_NAME: &str = "fd.sock";
/// Server directories are named `anyccl-fd-<pid namespace>-<pid>-<16 hex digits>`.
const DIR_PREFIX: &str = "anyccl-fd-";
const RANDOM_HEX_DIGITS: usize = 16;
/// The listen backlog (the kernel caps it at `net.core.somaxconn`).
const BACKLOG: i32 = 128;
/// How many entries of the base directory one stale-directory scan looks at, at most.
const STALE_SCAN_LIMIT: usize = 65_536;
/// How many connections one round of accepting takes before it polls again.
const ACCEPT_BATCH: usize = 2 * MAX_PENDING;

fn errno_error(call: &str, what: &str, e: Errno) -> Error {
    backend_error(call, format!("{what}: {}", e.desc()))
}

fn closed_error(pid: i32) -> Error {
    Error::PeerFailure(format!("the peer (pid {pid}) closed the connection"))
}

/// `start + d`, or a year from `start` where that overflows (a deadline that far is as good as none).
fn deadline_after(start: Instant, d: Duration) -> Instant {
    start.checked_add(d).or_else(|| start.checked_add(Duration::from_secs(365 * 24 * 3600))).unwrap_or(start)
}

fn timeval(d: Duration) -> TimeVal {
    // zero would mean "wait forever"
    let d = d.max(Duration::from_millis(1));
    let secs = libc::time_t::try_from(d.as_secs()).unwrap_or(libc::time_t::MAX);
    // infallible where suseconds_t is i64, not on targets where it is i32
    #[allow(clippy::unnecessary_fallible_conversions)]
    let micros = libc::suseconds_t::try_from(d.subsec_micros()).unwrap_or(0);
    TimeVal::new(secs, micros)
}

fn set_timeouts(fd: &OwnedFd, timeout: Duration) -> Result<()> {
    setsockopt(fd, sockopt::ReceiveTimeout, &timeval(timeout))
        .and_then(|()| setsockopt(fd, sockopt::SendTimeout, &timeval(timeout)))
        .map_err(|e| errno_error("setsockopt", "cannot set the socket timeouts", e))
}

fn peer_credentials(fd: &OwnedFd) -> Result<UnixCredentials> {
    getsockopt(fd, sockopt::PeerCredentials).map_err(|e| errno_error("getsockopt", "SO_PEERCRED", e))
}

fn unix_socket(flags: SockFlag) -> Result<OwnedFd> {
    socket(AddressFamily::Unix, SockType::SeqPacket, flags | SockFlag::SOCK_CLOEXEC, None)
        .map_err(|e| errno_error("socket", "cannot create a Unix socket", e))
}

fn socket_addr(path: &Path, call: &str) -> Result<UnixAddr> {
    UnixAddr::new(path).map_err(|e| {
        errno_error(call, &format!("{} is not a usable socket path (set a shorter TMPDIR?)", path.display()), e)
    })
}

/// `rustix`'s error as `nix`'s, for [`errno_error`].
fn from_rustix(e: rustix::io::Errno) -> Errno {
    Errno::from_raw(e.raw_os_error())
}

/// Waits until `fd` is readable or `deadline` passes.
fn wait_readable(fd: BorrowedFd<'_>, deadline: Instant) -> Result<()> {
    let mut fds = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
    poll_until(&mut fds, deadline)
}

/// `poll` until an event or `deadline` (an interrupted poll returns early: the caller looks at the clock again).
fn poll_until(fds: &mut [PollFd<'_>], deadline: Instant) -> Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    // round up to whole milliseconds, so that a wake-up never comes just before the deadline and spins
    let left = Duration::from_millis(u64::try_from(left.as_micros().div_ceil(1000)).unwrap_or(u64::MAX));
    let timeout = Timespec::try_from(left).unwrap_or(Timespec { tv_sec: i64::MAX, tv_nsec: 0 });
    match poll(fds, Some(&timeout)) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(errno_error("poll", "cannot wait on the Unix sockets", from_rustix(e))),
    }
}

/// The pid namespace of this process (`/proc/self/ns/pid`), which server directory names carry: a pid means
/// nothing in another namespace.
fn pid_namespace() -> Option<u64> {
    let link = fs::read_link("/proc/self/ns/pid").ok()?;
    let s = link.to_str()?;
    s.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    match rustix::rand::getrandom(&mut b[..], rustix::rand::GetRandomFlags::empty()) {
        Ok(8) => u64::from_le_bytes(b),
        // Not a secret: a name an attacker guessed only makes `mkdir` fail and retry (it never follows a link).
        _ => {
            static COUNTER: AtomicU64 = AtomicU64::new(0);
            let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
            nanos ^ COUNTER.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
        }
    }
}

/// `(pid namespace, pid)` from a server directory's name, or `None` when the name is not exactly ours.
fn parse_dir_name(name: &str) -> Option<(u64, u32)> {
    let mut parts = name.strip_prefix(DIR_PREFIX)?.split('-');
    let (ns, pid, random) = (parts.next()?, parts.next()?, parts.next()?);
    let digits = |s: &str| !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit());
    let hex = random.len() == RANDOM_HEX_DIGITS && random.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if parts.next().is_some() || !digits(ns) || !digits(pid) || !hex {
        return None;
    }
    Some((ns.parse().ok()?, pid.parse().ok()?))
}

/// Whether process `pid` (of this pid namespace) may still exist: only "no such process" says it is gone.
fn pid_alive(pid: u32) -> bool {
    match i32::try_from(pid) {
        // signal 0: only checks that the process exists
        Ok(p) if p > 0 => !matches!(kill(Pid::from_raw(p), None), Err(Errno::ESRCH)),
        _ => true,
    }
}

/// Removes the server directories under `base` that processes of this user and pid namespace left behind when they
/// died (killed before their server was dropped). A directory is only removed when its name is exactly a server
/// directory's, it is a real directory (not a symbolic link; nothing is followed), owned by this uid, with mode
/// 0700, its process is gone, and it holds nothing but the socket. Returns how many were removed.
fn remove_stale_dirs(base: &Path, namespace: u64) -> usize {
    let Ok(entries) = fs::read_dir(base) else { return 0 };
    let (uid, me) = (getuid().as_raw(), std::process::id());
    let mut removed = 0;
    for entry in entries.take(STALE_SCAN_LIMIT).flatten() {
        let name = entry.file_name();
        let Some((ns, pid)) = name.to_str().and_then(parse_dir_name) else { continue };
        if ns != namespace || pid == me || pid_alive(pid) {
            continue;
        }
        let path = entry.path();
        let Ok(meta) = fs::symlink_metadata(&path) else { continue };
        if !meta.file_type().is_dir() || meta.uid() != uid || meta.mode() & 0o7777 != 0o700 {
            debug!(target: "anyccl::fdpass", "left {} alone: not a private directory of uid {uid}", path.display());
            continue;
        }
        let socket = path.join(SOCKET_NAME);
        match fs::symlink_metadata(&socket) {
            Ok(m) if m.file_type().is_socket() => {
                let _ = fs::remove_file(&socket);
            }
            Ok(_) => {
                debug!(target: "anyccl::fdpass", "left {} alone: {SOCKET_NAME} is not a socket", path.display());
                continue;
            }
            Err(_) => {}
        }
        // fails (and leaves it) when anything else is inside
        match fs::remove_dir(&path) {
            Ok(()) => {
                debug!(target: "anyccl::fdpass", "removed {}, left behind by pid {pid}", path.display());
                removed += 1;
            }
            Err(e) => debug!(target: "anyccl::fdpass", "left {}: {e}", path.display()),
        }
    }
    removed
}

/// A fresh directory only this user can enter, removed (with the socket in it) on drop.
#[derive(Debug)]
struct PrivateDir {
    path: PathBuf,
}

impl PrivateDir {
    fn create(base: &Path, namespace: u64) -> Result<PrivateDir> {
        let pid = std::process::id();
        let mut last = None;
        for _ in 0..16 {
            let path = base.join(format!("{DIR_PREFIX}{namespace}-{pid}-{:016x}", random_u64()));
            match fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => {
                    let dir = PrivateDir { path };
                    // the umask can only have removed bits; make the mode exactly 0700
                    fs::set_permissions(&dir.path, fs::Permissions::from_mode(0o700)).map_err(|e| {
                        backend_error("chmod", format!("cannot make {} private: {e}", dir.path.display()))
                    })?;
                    return Ok(dir);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => {
                    return Err(backend_error(
                        "mkdir",
                        format!("cannot create a private directory in {}: {e}", base.display()),
                    ))
                }
            }
        }
        Err(backend_error(
            "mkdir",
            format!(
                "cannot create a private directory in {}: {}",
                base.display(),
                last.map(|e| e.to_string()).unwrap_or_default()
            ),
        ))
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = fs::remove_file(self.path.join(SOCKET_NAME));
        if let Err(e) = fs::remove_dir(&self.path) {
            debug!(target: "anyccl::fdpass", "cannot remove {}: {e}", self.path.display());
        }
    }
}

/// What the server dropped while it waited, for the log and for the timeout's message.
#[derive(Debug, Default)]
struct Dropped {
    foreign: usize,
    refused: usize,
    silent: usize,
    last: Option<String>,
}

impl Dropped {
    fn refuse(&mut self, why: String) {
        warn!(target: "anyccl::fdpass", "dropped a connection: {why}");
        self.refused += 1;
        self.last = Some(why);
    }

    /// `""`, or `" (dropped: …)"` for an error message.
    fn summary(&self) -> String {
        let mut parts = Vec::new();
        if self.foreign > 0 {
            parts.push(format!("{} connection(s) of another user", self.foreign));
        }
        if self.refused > 0 {
            let last = self.last.as_deref().unwrap_or_default();
            parts.push(format!("{} refused connection(s), the last because {last}", self.refused));
        }
        if self.silent > 0 {
            parts.push(format!("{} connection(s) that sent nothing in time", self.silent));
        }
        if parts.is_empty() {
            String::new()
        } else {
            format!(" (dropped: {})", parts.join("; "))
        }
    }
}

/// One message a peer sent on its connection to [`FdServer::gather`].
#[derive(Debug)]
#[non_exhaustive]
pub struct Arrival {
    /// The connection it came on, still open (it can carry an answer).
    pub channel: FdChannel,
    /// The descriptors it carried.
    pub fds: Vec<OwnedFd>,
    /// Its payload.
    pub payload: Vec<u8>,
}

/// The listening side: a Unix socket in a private directory that accepts processes of one user.
#[derive(Debug)]
pub struct FdServer {
    // non-blocking, with SO_PASSCRED (inherited by every accepted socket)
    sock: OwnedFd,
    path: PathBuf,
    timeout: Duration,
    pending_timeout: Duration,
    allowed_uid: u32,
    // dropped after `sock`: removes the socket file and the directory
    dir: PrivateDir,
}

impl FdServer {
    /// Creates the server in a new private directory under `$XDG_RUNTIME_DIR` (when set and not empty), else
    /// under [`std::env::temp_dir`].
    pub fn bind() -> Result<FdServer> {
        let base = std::env::var_os("XDG_RUNTIME_DIR")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        FdServer::bind_in(&base)
    }

    /// Creates the server in a new private directory under `base`, named `anyccl-fd-<pid namespace>-<pid>-<random>`.
    ///
    /// First removes the directories that servers of dead processes of this user (and pid namespace) left in
    /// `base`: only directories whose name has exactly that form, that are real directories (never a symbolic
    /// link), owned by this uid, with mode 0700, and hold nothing but the socket. Without a readable
    /// `/proc/self/ns/pid` nothing is removed.
    pub fn bind_in(base: &Path) -> Result<FdServer> {
        let namespace = pid_namespace();
        if let Some(ns) = namespace {
            let n = remove_stale_dirs(base, ns);
            if n > 0 {
                debug!(target: "anyccl::fdpass", "removed {n} stale server directories in {}", base.display());
            }
        }
        let dir = PrivateDir::create(base, namespace.unwrap_or(0))?;
        let path = dir.path.join(SOCKET_NAME);
        let addr = socket_addr(&path, "bind")?;
        // non-blocking: accept is only called once poll said a connection is waiting
        let sock = unix_socket(SockFlag::SOCK_NONBLOCK)?;
        bind(sock.as_raw_fd(), &addr)
            .map_err(|e| errno_error("bind", &format!("cannot bind {}", path.display()), e))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600))
            .map_err(|e| backend_error("chmod", format!("cannot restrict {}: {e}", path.display())))?;
        let backlog = Backlog::new(BACKLOG).map_err(|e| errno_error("listen", "backlog", e))?;
        listen(&sock, backlog)
            .map_err(|e| errno_error("listen", &format!("cannot listen on {}", path.display()), e))?;
        debug!(target: "anyccl::fdpass", "listening on {}", path.display());
        Ok(FdServer {
            sock,
            path,
            timeout: DEFAULT_TIMEOUT,
            pending_timeout: DEFAULT_PENDING_TIMEOUT,
            allowed_uid: getuid().as_raw(),
            dir,
        })
    }

    /// The same server with another timeout for [`FdServer::accept`] and [`FdServer::gather`] (each call waits
    /// at most this long) and for the channels it accepts.
    pub fn with_timeout(mut self, timeout: Duration) -> Result<FdServer> {
        self.timeout = timeout;
        Ok(self)
    }

    /// The same server with another deadline for each connection [`FdServer::gather`] has accepted to deliver its
    /// message (default [`DEFAULT_PENDING_TIMEOUT`]).
    pub fn with_pending_timeout(mut self, timeout: Duration) -> FdServer {
        self.pending_timeout = timeout;
        self
    }

    /// The same server, accepting only processes (and messages) of `uid` instead of this process's user. For tests
    /// and for a server that serves one other, known user.
    pub fn with_allowed_uid(mut self, uid: u32) -> FdServer {
        self.allowed_uid = uid;
        self
    }

    /// The socket's path, to hand to the peer process (e.g. through the TCP rendezvous).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The private directory the socket lives in.
    pub fn dir(&self) -> &Path {
        &self.dir.path
    }

    /// Waits (up to the timeout) for one connection from a process of the allowed user (by default this process's
    /// user). A connection from another user is closed at once, with nothing sent to it, and logged; the wait goes
    /// on. The timeout's error says how many were dropped.
    pub fn accept(&self) -> Result<FdChannel> {
        let deadline = deadline_after(Instant::now(), self.timeout);
        let mut dropped = Dropped::default();
        loop {
            if let Some(ch) = self.try_accept(&mut dropped)? {
                return Ok(ch);
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!(
                        "a process of uid {} to connect to {}{}",
                        self.allowed_uid,
                        self.path.display(),
                        dropped.summary()
                    ),
                    after: self.timeout,
                });
            }
            wait_readable(self.sock.as_fd(), deadline)?;
        }
    }

    /// Accepts the connections waiting in the backlog until one is of the allowed user; `None` when none is left.
    fn try_accept(&self, dropped: &mut Dropped) -> Result<Option<FdChannel>> {
        for _ in 0..ACCEPT_BATCH {
            // the accepted socket is blocking (it does not inherit O_NONBLOCK)
            let sock = match accept4(self.sock.as_fd(), SockFlag::SOCK_CLOEXEC) {
                Ok(s) => s,
                Err(Errno::EINTR | Errno::ECONNABORTED) => continue,
                Err(Errno::EAGAIN) => return Ok(None),
                Err(e) => return Err(errno_error("accept", &format!("on {}", self.path.display()), e)),
            };
            let cred = match peer_credentials(&sock) {
                Ok(c) => c,
                Err(e) => {
                    dropped.refuse(e.to_string());
                    continue;
                }
            };
            let pid = cred.pid();
            if cred.uid() != self.allowed_uid {
                // closed on drop; the stranger learns nothing but that
                warn!(
                    target: "anyccl::fdpass",
                    "dropped a connection from pid {pid} (uid {}) on {}: only uid {} may connect",
                    cred.uid(),
                    self.path.display(),
                    self.allowed_uid
                );
                dropped.foreign += 1;
                continue;
            }
            set_timeouts(&sock, self.timeout)?;
            debug!(target: "anyccl::fdpass", "accepted pid {pid} on {}", self.path.display());
            return Ok(Some(FdChannel { sock, peer_pid: pid, timeout: self.timeout }));
        }
        Ok(None)
    }

    /// The exchange: waits until `peers` connections of the allowed user have each sent one message (with at most
    /// `max_fds` descriptors) that `check` accepts, and returns them in the order they arrived.
    ///
    /// Connections are served concurrently, each with its own deadline (the pending timeout, see
    /// [`FdServer::with_pending_timeout`]); the whole call ends at the server's timeout with [`Error::Timeout`],
    /// which says how many connections were dropped and why. A connection of another user, one whose message is
    /// malformed (bad header, wrong sizes, too many descriptors, empty, truncated), one that closes or sends
    /// nothing before its deadline, and one whose message `check` refuses (its `Err` says why, for the log) is
    /// dropped, its descriptors closed, and the exchange goes on. Connections still pending when the last peer
    /// has arrived are closed.
    pub fn gather<F>(&self, peers: usize, max_fds: usize, mut check: F) -> Result<Vec<Arrival>>
    where
        F: FnMut(&Arrival) -> std::result::Result<(), String>,
    {
        struct Pending {
            channel: FdChannel,
            deadline: Instant,
        }
        let deadline = deadline_after(Instant::now(), self.timeout);
        let mut arrivals: Vec<Arrival> = Vec::new();
        // in the order they were accepted; a slot is emptied when its connection is done
        let mut pending: Vec<Option<Pending>> = Vec::new();
        let mut dropped = Dropped::default();
        while arrivals.len() < peers {
            let now = Instant::now();
            for slot in pending.iter_mut() {
                if let Some(p) = slot.take_if(|p| p.deadline <= now) {
                    warn!(
                        target: "anyccl::fdpass",
                        "dropped the connection of pid {}: no message within {:?}",
                        p.channel.peer_pid,
                        self.pending_timeout
                    );
                    dropped.silent += 1;
                }
            }
            pending.retain(Option::is_some);
            if now >= deadline {
                return Err(Error::Timeout {
                    what: format!(
                        "{} of {peers} peers to send their message to {} ({} arrived){}",
                        peers - arrivals.len(),
                        self.path.display(),
                        arrivals.len(),
                        dropped.summary()
                    ),
                    after: self.timeout,
                });
            }
            let wake = pending.iter().flatten().map(|p| p.deadline).fold(deadline, min);
            let listening = pending.len() < MAX_PENDING;
            let (listener_ready, ready) = {
                let mut fds = Vec::with_capacity(pending.len() + 1);
                let events = if listening { PollFlags::IN } else { PollFlags::empty() };
                fds.push(PollFd::new(&self.sock, events));
                fds.extend(pending.iter().flatten().map(|p| PollFd::new(&p.channel.sock, PollFlags::IN)));
                poll_until(&mut fds, wake)?;
                let ready: Vec<usize> =
                    (1..fds.len()).filter(|&i| !fds[i].revents().is_empty()).map(|i| i - 1).collect();
                (!fds[0].revents().is_empty(), ready)
            };
            // in the order of acceptance, until enough have arrived
            for i in ready {
                if arrivals.len() == peers {
                    break;
                }
                let Some(p) = pending.get(i).and_then(Option::as_ref) else { continue };
                let outcome = p.channel.receive(max_fds, true);
                if let Ok(None) = outcome {
                    continue;
                }
                let Some(p) = pending.get_mut(i).and_then(Option::take) else { continue };
                let pid = p.channel.peer_pid;
                match outcome {
                    Ok(Some((fds, payload))) => {
                        let arrival = Arrival { channel: p.channel, fds, payload };
                        match check(&arrival) {
                            Ok(()) => arrivals.push(arrival),
                            Err(why) => dropped.refuse(format!("pid {pid}'s message was refused: {why}")),
                        }
                    }
                    Err(e) => dropped.refuse(e.to_string()),
                    Ok(None) => {}
                }
            }
            pending.retain(Option::is_some);
            if listener_ready && arrivals.len() < peers {
                while pending.len() < MAX_PENDING {
                    let Some(channel) = self.try_accept(&mut dropped)? else { break };
                    let own = deadline_after(Instant::now(), self.pending_timeout);
                    pending.push(Some(Pending { channel, deadline: min(own, deadline) }));
                }
            }
        }
        if !pending.is_empty() {
            debug!(target: "anyccl::fdpass", "closed {} connections still pending after the exchange", pending.len());
        }
        Ok(arrivals)
    }
}

/// One connection that carries descriptors and payloads both ways.
#[derive(Debug)]
pub struct FdChannel {
    // blocking, with SO_RCVTIMEO and SO_SNDTIMEO
    sock: OwnedFd,
    peer_pid: i32,
    timeout: Duration,
}

impl FdChannel {
    /// Connects to the [`FdServer`] at `path` with the default timeout; see [`FdChannel::connect_with_timeout`].
    pub fn connect(path: &Path) -> Result<FdChannel> {
        FdChannel::connect_with_timeout(path, DEFAULT_TIMEOUT)
    }

    /// Connects to the [`FdServer`] at `path`, and refuses it unless it runs as this process's user.
    pub fn connect_with_timeout(path: &Path, timeout: Duration) -> Result<FdChannel> {
        let addr = socket_addr(path, "connect")?;
        let sock = unix_socket(SockFlag::empty())?;
        set_timeouts(&sock, timeout)?;
        loop {
            match connect(sock.as_raw_fd(), &addr) {
                Ok(()) => break,
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => {
                    return Err(Error::Timeout { what: format!("the server at {}", path.display()), after: timeout })
                }
                Err(e) => return Err(errno_error("connect", &format!("cannot connect to {}", path.display()), e)),
            }
        }
        let cred = peer_credentials(&sock)?;
        let me = getuid().as_raw();
        if cred.uid() != me {
            return Err(Error::PeerFailure(format!(
                "refused the server at {} (pid {}): its uid {} is not ours ({me})",
                path.display(),
                cred.pid(),
                cred.uid()
            )));
        }
        Ok(FdChannel { sock, peer_pid: cred.pid(), timeout })
    }

    /// The process id of the peer, as the kernel reported it when the connection was made.
    pub fn peer_pid(&self) -> i32 {
        self.peer_pid
    }

    /// Changes the send and receive timeout.
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<()> {
        set_timeouts(&self.sock, timeout)?;
        self.timeout = timeout;
        Ok(())
    }

    /// Sends `payload` (at most [`MAX_PAYLOAD`] bytes) and duplicates of `fds` (at most [`MAX_FDS`]) as one
    /// message. The caller keeps its descriptors.
    pub fn send(&self, fds: &[BorrowedFd<'_>], payload: &[u8]) -> Result<()> {
        let too_big = || {
            backend_error("sendmsg", format!("a payload of {} bytes exceeds the limit of {MAX_PAYLOAD}", payload.len()))
        };
        let too_many =
            || backend_error("sendmsg", format!("{} descriptors exceed the limit of {MAX_FDS} per message", fds.len()));
        if payload.len() > MAX_PAYLOAD {
            return Err(too_big());
        }
        if fds.len() > MAX_FDS {
            return Err(too_many());
        }
        let fd_count = u32::try_from(fds.len()).map_err(|_| too_many())?;
        let payload_len = u32::try_from(payload.len()).map_err(|_| too_big())?;
        let mut header = [0u8; HEADER_LEN];
        header[..4].copy_from_slice(&MAGIC);
        header[4..8].copy_from_slice(&fd_count.to_le_bytes());
        header[8..12].copy_from_slice(&payload_len.to_le_bytes());
        let iov = [IoSlice::new(&header), IoSlice::new(payload)];
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let rights = [ControlMessage::ScmRights(&raw)];
        let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &rights };
        let want = HEADER_LEN + payload.len();
        loop {
            match sendmsg::<()>(self.sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
                Ok(n) if n == want => return Ok(()),
                Ok(n) => return Err(backend_error("sendmsg", format!("sent {n} of {want} bytes"))),
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => {
                    return Err(Error::Timeout { what: "the peer to take a message".into(), after: self.timeout })
                }
                Err(Errno::EPIPE | Errno::ECONNRESET | Errno::ENOTCONN) => return Err(closed_error(self.peer_pid)),
                Err(e) => return Err(errno_error("sendmsg", "cannot send", e)),
            }
        }
    }

    /// Receives one message: its descriptors (at most `max_fds`, and never more than [`MAX_FDS`]) and payload.
    ///
    /// Each failure has its own error: the peer closed the connection ([`Error::PeerFailure`], "closed the
    /// connection"); an empty packet, a malformed header, an oversized payload or more descriptors than expected
    /// ([`Error::PeerFailure`], "refused a message"); descriptors lost in transit because this process could not
    /// take them, at its descriptor limit (`RLIMIT_NOFILE`) ([`Error::Backend`] of `recvmsg`); the timeout
    /// ([`Error::Timeout`]). Whatever the error, every descriptor that arrived with the message is closed, and the
    /// channel stays usable for the next message (except after the close).
    pub fn recv(&self, max_fds: usize) -> Result<(Vec<OwnedFd>, Vec<u8>)> {
        match self.receive(max_fds, false)? {
            Some(m) => Ok(m),
            None => Err(Error::Timeout { what: "a message from the peer".into(), after: self.timeout }),
        }
    }

    /// One `recvmsg`; `None` when no message came: at once with `dont_wait`, else within the receive timeout.
    fn receive(&self, max_fds: usize, dont_wait: bool) -> Result<Option<(Vec<OwnedFd>, Vec<u8>)>> {
        let limit = max_fds.min(MAX_FDS);
        let pid = self.peer_pid;
        // Fixed sizes, whatever the peer claims: the largest valid message (MSG_TRUNC beyond), and room for `limit`
        // descriptors (MSG_CTRUNC beyond; the kernel closes those that did not fit).
        let mut buf = vec![0u8; HEADER_LEN + MAX_PAYLOAD];
        let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(limit))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut flags = RecvFlags::CMSG_CLOEXEC;
        if dont_wait {
            flags |= RecvFlags::DONTWAIT;
        }
        let msg = loop {
            match recvmsg(&self.sock, &mut [IoSliceMut::new(&mut buf)], &mut control, flags) {
                Ok(m) => break m,
                Err(rustix::io::Errno::INTR) => {}
                Err(rustix::io::Errno::AGAIN) => return Ok(None),
                Err(rustix::io::Errno::CONNRESET) => return Err(closed_error(pid)),
                Err(e) => return Err(errno_error("recvmsg", "cannot receive", from_rustix(e))),
            }
        };
        // Own every descriptor that arrived before looking at anything else (also those of a truncated control
        // message, which rustix still hands over), so that each is closed whatever happens next.
        let mut fds: Vec<OwnedFd> = Vec::new();
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = m {
                fds.extend(received);
            }
        }
        let (bytes, got) = (msg.bytes, fds.len());
        let refuse = |why: String| Err(Error::PeerFailure(format!("refused a message from pid {pid}: {why}")));
        if msg.flags.contains(ReturnFlags::CTRUNC) {
            if got < limit {
                // There was room: the kernel could not install the rest in this process (EMFILE/ENFILE).
                return Err(backend_error(
                    "recvmsg",
                    format!(
                        "a message from pid {pid} lost descriptors in transit: only {got} arrived, and were closed \
                         (this process is probably at its descriptor limit, RLIMIT_NOFILE)"
                    ),
                ));
            }
            return refuse(format!("it carries more than the {limit} descriptors expected"));
        }
        if bytes == 0 && got == 0 {
            if self.at_end() {
                return Err(closed_error(pid));
            }
            return refuse(format!("it is empty (a message has at least a {HEADER_LEN}-byte header)"));
        }
        if got > limit {
            return refuse(format!("it carries {got} descriptors, more than the {limit} expected"));
        }
        if msg.flags.contains(ReturnFlags::TRUNC) {
            return refuse(format!("it is larger than {} bytes", HEADER_LEN + MAX_PAYLOAD));
        }
        if bytes < HEADER_LEN || buf[..4] != MAGIC {
            return refuse(format!("it has no valid header ({bytes} bytes)"));
        }
        let field = |at: usize| u32::from_le_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]);
        let (declared_fds, declared_len) = (field(4), field(8));
        let len = bytes - HEADER_LEN;
        if usize::try_from(declared_len).ok() != Some(len) {
            return refuse(format!("its header says {declared_len} payload bytes but it has {len}"));
        }
        if usize::try_from(declared_fds).ok() != Some(got) {
            return refuse(format!("its header says {declared_fds} descriptors but it carries {got}"));
        }
        let mut payload = Vec::new();
        payload
            .try_reserve_exact(len)
            .map_err(|e| backend_error("recvmsg", format!("cannot hold a payload of {len} bytes: {e}")))?;
        payload.extend_from_slice(&buf[HEADER_LEN..bytes]);
        Ok(Some((fds, payload)))
    }

    /// After a read of 0 bytes without descriptors: whether that was the end of the connection rather than an
    /// empty packet. The end can only be read once the peer has shut the connection down (`POLLRDHUP` from then
    /// on), and then only when nothing else is queued; a packet that is queued behind the 0 bytes (seen with
    /// `MSG_PEEK`) means they were an empty packet.
    fn at_end(&self) -> bool {
        let mut fds = [PollFd::new(&self.sock, PollFlags::RDHUP)];
        let zero = Timespec { tv_sec: 0, tv_nsec: 0 };
        loop {
            match poll(&mut fds, Some(&zero)) {
                Ok(_) => break,
                Err(rustix::io::Errno::INTR) => {}
                // cannot tell: the end is the safer guess (the channel is not used again)
                Err(_) => return true,
            }
        }
        if !fds[0].revents().intersects(PollFlags::RDHUP | PollFlags::HUP) {
            return false;
        }
        // no control buffer: a peeked packet's descriptors are not installed here
        let mut b = [0u8; 1];
        !matches!(recv(self.sock.as_raw_fd(), &mut b, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT), Ok(n) if n > 0)
    }
}

impl AsFd for FdChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp_base() -> PathBuf {
        std::env::temp_dir()
    }

    /// A raw SEQPACKET connection to `path`, to send hand-made packets.
    fn raw_client(path: &Path) -> OwnedFd {
        let sock = unix_socket(SockFlag::empty()).expect("socket");
        connect(sock.as_raw_fd(), &UnixAddr::new(path).expect("addr")).expect("connect");
        sock
    }

    fn send_raw(sock: &OwnedFd, bytes: &[u8], fds: &[RawFd]) {
        let rights = [ControlMessage::ScmRights(fds)];
        let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
        sendmsg::<()>(sock.as_raw_fd(), &[IoSlice::new(bytes)], cmsgs, MsgFlags::empty(), None).expect("sendmsg");
    }

    #[test]
    fn malformed_messages_are_refused() {
        let server = FdServer::bind_in(&tmp_base()).expect("bind").with_timeout(Duration::from_secs(5)).expect("t");
        let raw = raw_client(server.path());
        let ch = server.accept().expect("accept");

        send_raw(&raw, b"hello", &[]);
        let e = ch.recv(4).expect_err("no header");
        assert!(e.to_string().contains("no valid header"), "{e}");

        send_raw(&raw, b"AFD1\0\0\0\0\x09\0\0\0abc", &[]);
        let e = ch.recv(4).expect_err("length lie");
        assert!(e.to_string().contains("says 9 payload bytes but it has 3"), "{e}");

        let (r, _w) = nix::unistd::pipe().expect("pipe");
        send_raw(&raw, b"AFD1\x02\0\0\0\0\0\0\0", &[r.as_raw_fd()]);
        let e = ch.recv(4).expect_err("fd count lie");
        assert!(e.to_string().contains("says 2 descriptors but it carries 1"), "{e}");

        let big = vec![0u8; HEADER_LEN + MAX_PAYLOAD + 10];
        send_raw(&raw, &big, &[]);
        let e = ch.recv(4).expect_err("oversized");
        assert!(e.to_string().contains("larger than"), "{e}");

        send_raw(&raw, b"", &[]);
        let e = ch.recv(4).expect_err("empty");
        assert!(e.to_string().contains("it is empty"), "{e}");

        // still usable after all that
        send_raw(&raw, b"AFD1\0\0\0\0\x02\0\0\0ok", &[]);
        let (fds, payload) = ch.recv(4).expect("a valid message after the refused ones");
        assert!(fds.is_empty());
        assert_eq!(payload, b"ok");

        drop(raw);
        let e = ch.recv(4).expect_err("closed");
        assert!(matches!(e, Error::PeerFailure(_)) && e.to_string().contains("closed"), "{e}");
    }

    #[test]
    fn send_limits() {
        let server = FdServer::bind_in(&tmp_base()).expect("bind");
        let client = FdChannel::connect(server.path()).expect("connect");
        let e = client.send(&[], &vec![0u8; MAX_PAYLOAD + 1]).expect_err("payload too big");
        assert!(e.to_string().contains("exceeds the limit"), "{e}");
        let (r, _w) = nix::unistd::pipe().expect("pipe");
        let many: Vec<BorrowedFd<'_>> = (0..=MAX_FDS).map(|_| r.as_fd()).collect();
        let e = client.send(&many, b"").expect_err("too many fds");
        assert!(e.to_string().contains("descriptors exceed"), "{e}");
    }

    #[test]
    fn an_empty_packet_followed_by_a_message_and_the_close_is_still_an_empty_packet() {
        let server = FdServer::bind_in(&tmp_base()).expect("bind").with_timeout(Duration::from_secs(5)).expect("t");
        let raw = raw_client(server.path());
        let ch = server.accept().expect("accept");
        send_raw(&raw, b"", &[]);
        send_raw(&raw, b"AFD1\0\0\0\0\0\0\0\0", &[]);
        drop(raw);
        let e = ch.recv(1).expect_err("empty");
        assert!(e.to_string().contains("it is empty"), "{e}");
        let (fds, payload) = ch.recv(1).expect("the message behind it");
        assert!(fds.is_empty() && payload.is_empty());
        let e = ch.recv(1).expect_err("closed");
        assert!(e.to_string().contains("closed the connection"), "{e}");
    }

    #[test]
    fn timeval_is_never_zero() {
        let tv = timeval(Duration::ZERO);
        assert_eq!((tv.tv_sec(), tv.tv_usec()), (0, 1000));
        let tv = timeval(Duration::from_millis(2500));
        assert_eq!((tv.tv_sec(), tv.tv_usec()), (2, 500_000));
    }

    #[test]
    fn directory_names_are_parsed_strictly() {
        let r = "0123456789abcdef";
        assert_eq!(parse_dir_name(&format!("anyccl-fd-4026531836-42-{r}")), Some((4026531836, 42)));
        for bad in [
            format!("anyccl-fd-4026531836-42-{r}-x"),
            format!("anyccl-fd-4026531836-42-{}", &r[1..]),
            "anyccl-fd-4026531836-42-0123456789ABCDEF".to_string(),
            format!("anyccl-fd--42-{r}"),
            format!("anyccl-fd-1-+42-{r}"),
            format!("anyccl-fd-1-99999999999-{r}"),
            format!("anyccl-fdx-1-42-{r}"),
            "anyccl-fd-42-0-014b944a".to_string(),
        ] {
            assert_eq!(parse_dir_name(&bad), None, "{bad}");
        }
    }

    #[test]
    fn the_pid_namespace_is_read() {
        let ns = pid_namespace().expect("/proc/self/ns/pid");
        assert!(ns > 0);
    }
}
