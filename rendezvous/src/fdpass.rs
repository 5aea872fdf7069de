//! File-descriptor passing over a Unix-domain socket (`SCM_RIGHTS`), between processes of the same user.
//!
//! CUDA VMM exports device memory as a POSIX file descriptor; another process can only import it after the fd was
//! passed to it through a Unix socket. [`FdServer`] creates a `SOCK_SEQPACKET` socket in a fresh private directory
//! (mode 0700, under `$XDG_RUNTIME_DIR` when set, else the temporary directory), with the socket file at mode 0600;
//! both are removed when the server is dropped. [`FdServer::accept`] checks the peer's credentials (`SO_PEERCRED`)
//! and refuses a process of another user; [`FdChannel::connect`] checks the server's the same way.
//!
//! A message is one packet: a 12-byte header (magic `AFD1`, fd count `u32`, payload length `u32`, little-endian),
//! the payload (at most [`MAX_PAYLOAD`] bytes), and up to [`MAX_FDS`] descriptors. Received descriptors are
//! [`OwnedFd`]s, closed when dropped, also when the message is refused.

use std::fs;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyccl_core::{Error, Result};
use nix::errno::Errno;
use nix::libc;
use nix::sys::socket::{
    accept4, bind, connect, getsockopt, listen, recvmsg, sendmsg, setsockopt, socket, sockopt, AddressFamily, Backlog,
    ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr, UnixCredentials,
};
use nix::sys::time::TimeVal;
use nix::unistd::getuid;
use std::io::{IoSlice, IoSliceMut};
use tracing::{debug, warn};

use crate::backend_error;

/// The largest payload of one message (64 KiB).
pub const MAX_PAYLOAD: usize = 64 * 1024;

/// The most file descriptors one message may carry.
pub const MAX_FDS: usize = 64;

/// How long sends, receives, accepts and connects wait by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

const MAGIC: [u8; 4] = *b"AFD1";
const HEADER_LEN: usize = 12;
/// Linux's `SCM_MAX_FD`: no message can carry more, so a control buffer this large is never truncated.
const SCM_MAX_FD: usize = 253;
const SOCKET_NAME: &str = "fd.sock";

fn errno_error(call: &str, what: &str, e: Errno) -> Error {
    backend_error(call, format!("{what}: {}", e.desc()))
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

/// Takes ownership of a descriptor the kernel installed in this process for a received `SCM_RIGHTS` message.
#[allow(unsafe_code)]
fn adopt_received_fd(fd: RawFd) -> OwnedFd {
    // SAFETY: `fd` comes from an SCM_RIGHTS control message that recvmsg(2) just returned: the kernel installed it
    // in this process's descriptor table for this message only, so it is open and nothing else owns it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// A fresh directory only this user can enter, removed (with the socket in it) on drop.
#[derive(Debug)]
struct PrivateDir {
    path: PathBuf,
}

impl PrivateDir {
    fn create(base: &Path) -> Result<PrivateDir> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        let mut last = None;
        for _ in 0..16 {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let path = base.join(format!("anyccl-fd-{}-{n}-{nanos:08x}", std::process::id()));
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

/// The listening side: a Unix socket in a private directory that accepts processes of one user.
#[derive(Debug)]
pub struct FdServer {
    sock: OwnedFd,
    path: PathBuf,
    timeout: Duration,
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

    /// Creates the server in a new private directory under `base`.
    pub fn bind_in(base: &Path) -> Result<FdServer> {
        let dir = PrivateDir::create(base)?;
        let path = dir.path.join(SOCKET_NAME);
        let addr = UnixAddr::new(&path).map_err(|e| {
            errno_error("bind", &format!("{} is not a usable socket path (set a shorter TMPDIR?)", path.display()), e)
        })?;
        let sock = socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)
            .map_err(|e| errno_error("socket", "cannot create a Unix socket", e))?;
        bind(sock.as_raw_fd(), &addr)
            .map_err(|e| errno_error("bind", &format!("cannot bind {}", path.display()), e))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o600))
            .map_err(|e| backend_error("chmod", format!("cannot restrict {}: {e}", path.display())))?;
        let backlog = Backlog::new(16).map_err(|e| errno_error("listen", "backlog", e))?;
        listen(&sock, backlog)
            .map_err(|e| errno_error("listen", &format!("cannot listen on {}", path.display()), e))?;
        let server = FdServer { sock, path, timeout: DEFAULT_TIMEOUT, dir };
        set_timeouts(&server.sock, server.timeout)?;
        debug!(target: "anyccl::fdpass", "listening on {}", server.path.display());
        Ok(server)
    }

    /// The same server with another timeout for [`FdServer::accept`] and for the channels it accepts.
    pub fn with_timeout(mut self, timeout: Duration) -> Result<FdServer> {
        set_timeouts(&self.sock, timeout)?;
        self.timeout = timeout;
        Ok(self)
    }

    /// The socket's path, to hand to the peer process (e.g. through the TCP rendezvous).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The private directory the socket lives in.
    pub fn dir(&self) -> &Path {
        &self.dir.path
    }

    /// Waits (up to the timeout) for one connection from a process of this user.
    pub fn accept(&self) -> Result<FdChannel> {
        self.accept_with_uid(getuid().as_raw())
    }

    /// Waits (up to the timeout) for one connection, and accepts it only from a process running as
    /// `allowed_uid`; a connection from another uid is closed and reported as [`Error::PeerFailure`].
    pub fn accept_with_uid(&self, allowed_uid: u32) -> Result<FdChannel> {
        let sock = loop {
            match accept4(self.sock.as_fd(), SockFlag::SOCK_CLOEXEC) {
                Ok(s) => break s,
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => {
                    return Err(Error::Timeout {
                        what: format!("a process to connect to {}", self.path.display()),
                        after: self.timeout,
                    })
                }
                Err(e) => return Err(errno_error("accept", &format!("on {}", self.path.display()), e)),
            }
        };
        let cred = peer_credentials(&sock)?;
        if cred.uid() != allowed_uid {
            warn!(
                target: "anyccl::fdpass",
                "refused pid {} (uid {}) on {}: only uid {allowed_uid} may connect",
                cred.pid(),
                cred.uid(),
                self.path.display()
            );
            return Err(Error::PeerFailure(format!(
                "refused a connection on {} from pid {}: its uid {} is not the allowed uid {allowed_uid}",
                self.path.display(),
                cred.pid(),
                cred.uid()
            )));
        }
        set_timeouts(&sock, self.timeout)?;
        debug!(target: "anyccl::fdpass", "accepted pid {} on {}", cred.pid(), self.path.display());
        Ok(FdChannel { sock, peer_pid: cred.pid(), timeout: self.timeout })
    }
}

/// One connection that carries descriptors and payloads both ways.
#[derive(Debug)]
pub struct FdChannel {
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
        let addr = UnixAddr::new(path)
            .map_err(|e| errno_error("connect", &format!("{} is not a usable socket path", path.display()), e))?;
        let sock = socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)
            .map_err(|e| errno_error("socket", "cannot create a Unix socket", e))?;
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
        if payload.len() > MAX_PAYLOAD {
            return Err(backend_error(
                "sendmsg",
                format!("a payload of {} bytes exceeds the limit of {MAX_PAYLOAD}", payload.len()),
            ));
        }
        if fds.len() > MAX_FDS {
            return Err(backend_error(
                "sendmsg",
                format!("{} descriptors exceed the limit of {MAX_FDS} per message", fds.len()),
            ));
        }
        let mut header = [0u8; HEADER_LEN];
        header[..4].copy_from_slice(&MAGIC);
        header[4..8].copy_from_slice(&(fds.len() as u32).to_le_bytes());
        header[8..12].copy_from_slice(&(payload.len() as u32).to_le_bytes());
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
                Err(Errno::EPIPE | Errno::ECONNRESET | Errno::ENOTCONN) => {
                    return Err(Error::PeerFailure(format!("the peer (pid {}) closed the connection", self.peer_pid)))
                }
                Err(e) => return Err(errno_error("sendmsg", "cannot send", e)),
            }
        }
    }

    /// Receives one message: its descriptors (at most `max_fds`, and never more than [`MAX_FDS`]) and payload.
    /// A message with more descriptors, an oversized payload or a malformed header is an error, and any
    /// descriptors it carried are closed.
    pub fn recv(&self, max_fds: usize) -> Result<(Vec<OwnedFd>, Vec<u8>)> {
        let mut buf = vec![0u8; HEADER_LEN + MAX_PAYLOAD + 1];
        let mut cmsg = nix::cmsg_space!([RawFd; SCM_MAX_FD]);
        let (bytes, flags, fds, truncated_cmsg) = loop {
            let mut iov = [IoSliceMut::new(&mut buf)];
            match recvmsg::<()>(self.sock.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC) {
                Ok(msg) => {
                    // own every descriptor first, so that each is closed whatever happens next
                    let mut fds = Vec::new();
                    let truncated = match msg.cmsgs() {
                        Ok(cmsgs) => {
                            for c in cmsgs {
                                if let ControlMessageOwned::ScmRights(raw) = c {
                                    fds.extend(raw.into_iter().map(adopt_received_fd));
                                }
                            }
                            false
                        }
                        Err(_) => true,
                    };
                    break (msg.bytes, msg.flags, fds, truncated);
                }
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => {
                    return Err(Error::Timeout { what: "a message from the peer".into(), after: self.timeout })
                }
                Err(Errno::ECONNRESET) => {
                    return Err(Error::PeerFailure(format!("the peer (pid {}) closed the connection", self.peer_pid)))
                }
                Err(e) => return Err(errno_error("recvmsg", "cannot receive", e)),
            }
        };
        let malformed =
            |why: String| Err(Error::PeerFailure(format!("refused a message from pid {}: {why}", self.peer_pid)));
        if bytes == 0 && fds.is_empty() && !truncated_cmsg {
            return Err(Error::PeerFailure(format!("the peer (pid {}) closed the connection", self.peer_pid)));
        }
        if truncated_cmsg || flags.contains(MsgFlags::MSG_CTRUNC) {
            return malformed("its control data was truncated".into());
        }
        if flags.contains(MsgFlags::MSG_TRUNC) || bytes > HEADER_LEN + MAX_PAYLOAD {
            return malformed(format!("it is larger than {} bytes", HEADER_LEN + MAX_PAYLOAD));
        }
        if bytes < HEADER_LEN || buf[..4] != MAGIC {
            return malformed(format!("it has no valid header ({bytes} bytes)"));
        }
        let declared_fds = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]) as usize;
        let declared_len = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]) as usize;
        if declared_len != bytes - HEADER_LEN {
            return malformed(format!(
                "its header says {declared_len} payload bytes but it has {}",
                bytes - HEADER_LEN
            ));
        }
        if declared_fds != fds.len() {
            return malformed(format!("its header says {declared_fds} descriptors but it carries {}", fds.len()));
        }
        let limit = max_fds.min(MAX_FDS);
        if fds.len() > limit {
            return malformed(format!("it carries {} descriptors, more than the {limit} expected", fds.len()));
        }
        buf.truncate(bytes);
        buf.drain(..HEADER_LEN);
        Ok((fds, buf))
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
        let sock = socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None).expect("socket");
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
    fn timeval_is_never_zero() {
        let tv = timeval(Duration::ZERO);
        assert_eq!((tv.tv_sec(), tv.tv_usec()), (0, 1000));
        let tv = timeval(Duration::from_millis(2500));
        assert_eq!((tv.tv_sec(), tv.tv_usec()), (2, 500_000));
    }
}
