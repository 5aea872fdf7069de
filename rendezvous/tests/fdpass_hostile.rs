//! Hostile input on the fd-passing sockets (docs/security.md): descriptors lost at the fd limit, foreign, malformed and
//! silent connections in the middle of an exchange, empty packets, and server directories left by killed processes.
//!
//! Some tests run parts of themselves in a child process (this test binary again, with `--exact <test>` and
//! [`CHILD_ENV`] set): to lower `RLIMIT_NOFILE` without touching the shared test process, to be killed, or to run as
//! another user (those need root, as CI has; they fail, not skip, without it).
#![cfg(target_os = "linux")]

use std::fs::{self, File};
use std::io::{BufRead, BufReader, IoSlice, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyccl_core::Error;
use anyccl_rendezvous::fdpass::{FdChannel, FdServer, MAX_PAYLOAD, MAX_PENDING};
use nix::sys::resource::{getrlimit, setrlimit, Resource};
use nix::sys::socket::{
    connect, sendmsg, socket, AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr,
};
use nix::unistd::{getuid, setuid, Uid};

const CHILD_ENV: &str = "ANYCCL_FDPASS_TEST_CHILD";
const NOBODY: u32 = 65534;
const HEADER_LEN: usize = 12;

/// A pipe (a connected stream socket pair: read from the first, write to the second) whose ends a child process of
/// a parallel test does not inherit (close-on-exec).
fn pipe() -> (OwnedFd, OwnedFd) {
    nix::sys::socket::socketpair(AddressFamily::Unix, SockType::Stream, None, SockFlag::SOCK_CLOEXEC)
        .expect("socketpair")
}

fn is_child() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

/// Runs `test` of this binary in a child process, with `CHILD_ENV` and `envs` set.
fn spawn_self(test: &str, envs: &[(&str, String)]) -> Child {
    let exe = std::env::current_exe().expect("current_exe");
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"]).env(CHILD_ENV, "1");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn the child")
}

/// The child's stdout, line by line, through a thread (so that waiting for a line has a deadline).
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let out = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Waits (10 s at most) for a line with `tag` and returns what follows the tag.
fn expect_tag(lines: &mpsc::Receiver<String>, tag: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = lines.recv_timeout(left).unwrap_or_else(|e| panic!("no '{tag}' line from the child: {e}"));
        // libtest prints "test <name> ... " without a newline before the test's own output
        if let Some(i) = line.find(tag) {
            return line[i + tag.len()..].trim().to_string();
        }
    }
}

/// Waits for the child and asserts that it succeeded and printed `CHILD OK`.
fn expect_child_ok(child: Child, lines: Option<mpsc::Receiver<String>>) {
    let out = child.wait_with_output().expect("wait for the child");
    let mut stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if let Some(rx) = lines {
        stdout.extend(rx.iter().map(|l| l + "\n"));
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stdout.contains("CHILD OK"), "child failed: {}\n{stdout}\n{stderr}", out.status);
}

fn require_root(what: &str) {
    assert!(getuid().is_root(), "{what} needs root (to start a process of another user); CI runs the tests as root");
}

/// A server in the system temp folder with `timeout` for each exchange.
fn server_in_tmp(timeout: Duration) -> FdServer {
    FdServer::bind_in(&std::env::temp_dir()).expect("bind").with_timeout(timeout).expect("t")
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

fn header(fds: u32, len: u32) -> Vec<u8> {
    let mut h = b"AFD1".to_vec();
    h.extend_from_slice(&fds.to_le_bytes());
    h.extend_from_slice(&len.to_le_bytes());
    h
}

/// Whether every write end of the pipe is closed: the read end then sees end of file (at once, no waiting: closing
/// is synchronous, also for the descriptors the kernel discards).
fn all_writers_closed(read_end: OwnedFd) -> bool {
    let mut b = [0u8; 64];
    loop {
        match nix::sys::socket::recv(read_end.as_raw_fd(), &mut b, MsgFlags::MSG_DONTWAIT) {
            Ok(0) => return true,
            Ok(_) => {}
            // EAGAIN: a write end is still open somewhere
            Err(_) => return false,
        }
    }
}

/// A directory for one test, removed at the end.
struct TempBase(PathBuf);

impl TempBase {
    fn new(name: &str) -> TempBase {
        let p = std::env::temp_dir().join(format!("anyccl-fdpass-test-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir(&p).expect("create the test base");
        TempBase(p)
    }
}

impl Drop for TempBase {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn pid_namespace() -> u64 {
    let link = fs::read_link("/proc/self/ns/pid").expect("/proc/self/ns/pid");
    let s = link.to_str().expect("utf-8");
    s.trim_start_matches("pid:[").trim_end_matches(']').parse().expect("a namespace number")
}

/// The pid of a process that has exited and been reaped.
fn dead_pid() -> u32 {
    let mut c =
        Command::new(std::env::current_exe().expect("exe")).arg("--list").stdout(Stdio::null()).spawn().expect("spawn");
    let pid = c.id();
    c.wait().expect("wait");
    pid
}

fn open_fd_count() -> usize {
    // the listing's own descriptor is counted every time
    fs::read_dir("/proc/self/fd").expect("/proc/self/fd").count()
}

// ---------------------------------------------------------------------------------------------------------------

#[test]
fn descriptors_cut_short_at_the_fd_limit_are_closed_and_the_channel_recovers() {
    if !is_child() {
        let child = spawn_self("descriptors_cut_short_at_the_fd_limit_are_closed_and_the_channel_recovers", &[]);
        return expect_child_ok(child, None);
    }
    // In the child: a server and a client in this process.
    let server = server_in_tmp(Duration::from_secs(5));
    let client = FdChannel::connect(server.path()).expect("connect");
    let ch = server.accept().expect("accept");
    let pipes: Vec<(OwnedFd, OwnedFd)> = (0..4).map(|_| pipe()).collect();
    let ends: Vec<_> = pipes.iter().map(|(_, w)| w.as_fd()).collect();

    // Fill every free descriptor number below the highest open one, so that a limit of next + 2 leaves exactly two.
    let highest = fs::read_dir("/proc/self/fd")
        .expect("list")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .max()
        .expect("some fds");
    let mut fillers = Vec::new();
    let next = loop {
        let f = File::open("/dev/null").expect("open /dev/null");
        let n = f.as_raw_fd();
        fillers.push(f);
        if n > highest {
            break n + 1;
        }
    };
    let before = open_fd_count();
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    let low = u64::try_from(next).expect("fd") + 2;
    setrlimit(Resource::RLIMIT_NOFILE, low, hard).expect("lower RLIMIT_NOFILE");

    // four descriptors, room for two: an error of its own, and the two that arrived are closed
    client.send(&ends, b"four").expect("send four");
    let e = ch.recv(8).expect_err("cut short");
    assert!(matches!(e, Error::Backend { .. }), "{e:?}");
    assert!(e.to_string().contains("lost descriptors in transit: only 2 arrived"), "{e}");
    assert!(e.to_string().contains("RLIMIT_NOFILE"), "{e}");

    // the next valid messages still work, under the same limit: the two slots are free again
    client.send(&ends[..1], b"one").expect("send one");
    let (fds, payload) = ch.recv(8).expect("one descriptor fits");
    assert_eq!((fds.len(), payload.as_slice()), (1, &b"one"[..]));
    drop(fds);
    client.send(&ends[..2], b"two").expect("send two");
    let (fds, payload) = ch.recv(8).expect("two descriptors fit");
    assert_eq!((fds.len(), payload.as_slice()), (2, &b"two"[..]));
    let mut w = File::from(fds.into_iter().next().expect("fd"));
    w.write_all(b"x").expect("write through a received descriptor");
    drop(w);

    setrlimit(Resource::RLIMIT_NOFILE, soft, hard).expect("restore RLIMIT_NOFILE");
    assert_eq!(open_fd_count(), before, "descriptors leaked");
    let mut b = [0u8; 1];
    File::from(pipes.into_iter().next().expect("pipe").0).read_exact(&mut b).expect("read back");
    drop(fillers);
    println!("CHILD OK");
}

#[test]
fn more_descriptors_than_the_receiver_takes_are_all_closed() {
    let server = server_in_tmp(Duration::from_secs(5));
    let raw = raw_client(server.path());
    let ch = server.accept().expect("accept");
    let (r, w) = pipe();
    // the kernel's most (SCM_MAX_FD), far more than the control buffer of recv(1) has room for
    let many = vec![w.as_raw_fd(); 253];
    send_raw(&raw, &header(253, 0), &many);
    drop(w);
    let e = ch.recv(1).expect_err("too many");
    assert!(e.to_string().contains("more than the 1 descriptors expected"), "{e}");
    assert!(all_writers_closed(r), "a passed descriptor is still open");
    // and the channel goes on
    send_raw(&raw, &header(0, 2).into_iter().chain(*b"ok").collect::<Vec<_>>(), &[]);
    assert_eq!(ch.recv(1).expect("next").1, b"ok");
}

/// The hostile connections of the exchange tests: each connected and sent (or not) before the real peers.
struct Hostile {
    conns: Vec<OwnedFd>,
    /// Read end of the pipe whose write end the hostile messages carry.
    read_end: OwnedFd,
}

fn hostile_connections(path: &Path) -> Hostile {
    let (r, write_end) = pipe();
    let w = write_end.as_raw_fd();
    let mut conns = Vec::new();
    let mut send = |bytes: &[u8], fds: &[RawFd]| {
        let c = raw_client(path);
        send_raw(&c, bytes, fds);
        conns.push(c);
    };
    send(b"garbage", &[]);
    send(b"XFD1\0\0\0\0\0\0\0\0", &[]); // wrong magic
    send(&header(3, 0), &[w]); // claims 3 descriptors, carries 1
    send(&header(0, 100).into_iter().chain(*b"ab").collect::<Vec<_>>(), &[]); // claims 100 bytes, has 2
    send(b"", &[]); // empty packet
    send(&vec![0u8; HEADER_LEN + MAX_PAYLOAD + 1], &[]); // too large
    send(&header(60, 0), &vec![w; 60]); // more descriptors than the exchange takes
    drop(raw_client(path)); // connects and closes without a word
    conns.push(raw_client(path)); // connects and says nothing
                                  // the pipe's write end now lives only in the messages in flight
    drop(write_end);
    Hostile { conns, read_end: r }
}

/// Asserts that the server closed `conn` without telling it anything.
fn closed_without_a_word(conn: &OwnedFd) {
    let mut b = [0u8; 64];
    match nix::sys::socket::recv(conn.as_raw_fd(), &mut b, MsgFlags::MSG_DONTWAIT) {
        // ECONNRESET: the server closed it with the message unread
        Ok(0) | Err(nix::errno::Errno::ECONNRESET) => {}
        other => panic!("the server told a stranger something, or kept the connection open: {other:?}"),
    }
}

fn real_peers(path: &Path, ranks: &[u64]) -> (Vec<FdChannel>, OwnedFd) {
    let (r, w) = pipe();
    let chans = ranks
        .iter()
        .map(|rank| {
            let c = FdChannel::connect(path).expect("connect");
            c.send(&[w.as_fd()], &rank.to_le_bytes()).expect("send");
            c
        })
        .collect();
    (chans, r)
}

#[test]
fn foreign_malformed_and_silent_connections_do_not_end_the_exchange() {
    let server = server_in_tmp(Duration::from_secs(5)).with_pending_timeout(Duration::from_secs(3));
    let hostile = hostile_connections(server.path());
    let (_peers, _r) = real_peers(server.path(), &[1, 2]);
    let t = Instant::now();
    let arrivals = server.gather(2, 1, |_| Ok(())).expect("the real peers arrive");
    assert!(t.elapsed() < Duration::from_secs(2), "waited {:?} (for the silent connection?)", t.elapsed());
    let ranks: Vec<u64> =
        arrivals.iter().map(|a| u64::from_le_bytes(a.payload.as_slice().try_into().expect("8 bytes"))).collect();
    assert_eq!(ranks, [1, 2]);
    assert!(arrivals.iter().all(|a| a.fds.len() == 1));
    drop(server);
    // every hostile connection was closed by the server, and told nothing
    hostile.conns.iter().for_each(closed_without_a_word);
    drop(hostile.conns);
    assert!(all_writers_closed(hostile.read_end), "a descriptor of a refused message is still open");
}

#[test]
fn the_timeout_of_an_exchange_says_what_was_dropped() {
    let server = server_in_tmp(Duration::from_secs(1)).with_pending_timeout(Duration::from_millis(150));
    let hostile = hostile_connections(server.path());
    let (_peers, _r) = real_peers(server.path(), &[1, 2]);
    let e = server.gather(3, 1, |_| Ok(())).expect_err("a third peer never comes");
    let text = e.to_string();
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    assert!(text.contains("1 of 3 peers") && text.contains("(2 arrived)"), "{text}");
    // garbage, wrong magic, fd lie, length lie, empty, too large, too many fds, closed without a word
    assert!(text.contains("8 refused connection(s)"), "{text}");
    assert!(text.contains("1 connection(s) that sent nothing in time"), "{text}");
    drop(hostile.conns);
    assert!(all_writers_closed(hostile.read_end), "a descriptor of a refused message is still open");
}

#[test]
fn a_message_the_caller_refuses_is_dropped_and_the_exchange_goes_on() {
    let server = server_in_tmp(Duration::from_secs(5));
    let (_impostor, _r1) = real_peers(server.path(), &[7]);
    let (_peer, _r2) = real_peers(server.path(), &[1]);
    let mut asked = Vec::new();
    let arrivals = server
        .gather(1, 1, |a| {
            let rank = u64::from_le_bytes(a.payload.as_slice().try_into().map_err(|_| "not 8 bytes".to_string())?);
            asked.push(rank);
            if rank == 1 {
                Ok(())
            } else {
                Err(format!("rank {rank} is not a peer"))
            }
        })
        .expect("the real peer arrives");
    assert_eq!(asked, [7, 1]);
    assert_eq!(arrivals.len(), 1);
    assert_eq!(arrivals[0].payload, 1u64.to_le_bytes());
}

#[test]
fn each_pending_connection_has_its_own_deadline() {
    let server = server_in_tmp(Duration::from_secs(5)).with_pending_timeout(Duration::from_millis(200));
    // more silent connections than the server holds at once: the real peer waits in the backlog behind them
    let silent: Vec<OwnedFd> = (0..MAX_PENDING).map(|_| raw_client(server.path())).collect();
    let (_peer, _r) = real_peers(server.path(), &[1]);
    let t = Instant::now();
    let arrivals = server.gather(1, 1, |_| Ok(())).expect("the real peer arrives once the silent ones expired");
    let waited = t.elapsed();
    assert_eq!(arrivals.len(), 1);
    assert!(waited >= Duration::from_millis(200), "the silent connections were not held: {waited:?}");
    assert!(waited < Duration::from_secs(3), "waited {waited:?}");
    drop(silent);
}

#[test]
fn an_empty_packet_is_not_the_close() {
    let server = server_in_tmp(Duration::from_secs(5));
    let raw = raw_client(server.path());
    let ch = server.accept().expect("accept");
    send_raw(&raw, b"", &[]);
    let e = ch.recv(1).expect_err("empty");
    assert!(matches!(e, Error::PeerFailure(_)), "{e:?}");
    assert!(e.to_string().contains("it is empty") && !e.to_string().contains("closed"), "{e}");
    send_raw(&raw, &header(0, 0), &[]);
    assert!(ch.recv(1).expect("the connection goes on").1.is_empty());
    drop(raw);
    let e = ch.recv(1).expect_err("closed");
    assert!(e.to_string().contains("closed the connection") && !e.to_string().contains("empty"), "{e}");
}

#[test]
fn a_killed_servers_directory_is_removed_by_the_next_server() {
    const TEST: &str = "a_killed_servers_directory_is_removed_by_the_next_server";
    if is_child() {
        let base = PathBuf::from(std::env::var("ANYCCL_TEST_BASE").expect("base"));
        let server = FdServer::bind_in(&base).expect("bind");
        println!("DIR {}", server.dir().display());
        // wait to be killed (the parent holds stdin open)
        let mut s = String::new();
        let _ = std::io::stdin().read_line(&mut s);
        println!("CHILD OK");
        return;
    }
    let base = TempBase::new("stale");
    let mut child = spawn_self(TEST, &[("ANYCCL_TEST_BASE", base.0.display().to_string())]);
    let lines = lines_of(&mut child);
    let dir = PathBuf::from(expect_tag(&lines, "DIR "));
    assert!(dir.join("fd.sock").exists(), "the child's socket");
    child.kill().expect("SIGKILL");
    child.wait().expect("reap");
    assert!(dir.exists(), "a killed server leaves its directory behind");

    // look-alikes that must stay: a live pid, another namespace, a symbolic link, a wrong mode, other content,
    // a name that is not exactly ours
    let (ns, dead) = (pid_namespace(), dead_pid());
    let name = |ns: u64, pid: u32| format!("anyccl-fd-{ns}-{pid}-0123456789abcdef");
    let private = |p: &Path, mode: u32| {
        fs::create_dir(p).expect("mkdir");
        fs::set_permissions(p, fs::Permissions::from_mode(mode)).expect("chmod");
    };
    let live = base.0.join(name(ns, 1));
    private(&live, 0o700);
    let other_ns = base.0.join(name(ns + 1, dead));
    private(&other_ns, 0o700);
    let target = base.0.join("target");
    private(&target, 0o700);
    // as if the link pointed at a live server's directory: its socket must survive
    let _listener = std::os::unix::net::UnixListener::bind(target.join("fd.sock")).expect("bind a socket");
    let link = base.0.join(name(ns, dead));
    symlink(&target, &link).expect("symlink");
    let open = base.0.join(format!("anyccl-fd-{ns}-{dead}-00000000000000ff"));
    private(&open, 0o755);
    let full = base.0.join(format!("anyccl-fd-{ns}-{dead}-0000000000000eee"));
    private(&full, 0o700);
    fs::write(full.join("other"), b"x").expect("write");
    let odd = base.0.join(format!("anyccl-fd-{ns}-{dead}-0123"));
    private(&odd, 0o700);
    let empty_dead = base.0.join(format!("anyccl-fd-{ns}-{dead}-000000000000abcd"));
    private(&empty_dead, 0o700);

    let server = FdServer::bind_in(&base.0).expect("the next server");
    assert!(!dir.exists(), "the killed server's directory was not removed");
    assert!(!empty_dead.exists(), "an empty directory of a dead pid was not removed");
    for kept in [&live, &other_ns, &open, &full, &odd, &target] {
        assert!(kept.is_dir(), "{} was removed", kept.display());
    }
    assert!(fs::symlink_metadata(&link).expect("link").file_type().is_symlink(), "the link was removed");
    assert!(target.join("fd.sock").exists(), "the socket behind the link was removed");
    assert!(server.dir().exists());
    drop(server);
}

#[test]
fn drop_removes_the_directory_and_leaves_nothing_else() {
    let base = TempBase::new("drop");
    let server = FdServer::bind_in(&base.0).expect("bind");
    let dir = server.dir().to_owned();
    assert!(dir.starts_with(&base.0));
    drop(server);
    assert!(!dir.exists());
    assert_eq!(fs::read_dir(&base.0).expect("list").count(), 0, "something was left in the base directory");
}

#[test]
fn a_process_of_another_user_is_dropped_while_the_exchange_goes_on() {
    const TEST: &str = "a_process_of_another_user_is_dropped_while_the_exchange_goes_on";
    if is_child() {
        // as nobody: connect, send a well-formed message, and see what the server answers
        let path = PathBuf::from(std::env::var("ANYCCL_TEST_SOCKET").expect("socket"));
        setuid(Uid::from_raw(NOBODY)).expect("setuid(nobody)");
        let c = raw_client(&path);
        send_raw(&c, &header(0, 8).into_iter().chain(1u64.to_le_bytes()).collect::<Vec<_>>(), &[]);
        println!("SENT");
        // waits (10 s at most) until the server closes the connection
        let ten = nix::sys::time::TimeVal::new(10, 0);
        nix::sys::socket::setsockopt(&c, nix::sys::socket::sockopt::ReceiveTimeout, &ten).expect("SO_RCVTIMEO");
        let mut b = [0u8; 64];
        match nix::sys::socket::recv(c.as_raw_fd(), &mut b, MsgFlags::empty()) {
            Ok(0) | Err(nix::errno::Errno::ECONNRESET) => println!("CHILD OK"),
            other => panic!("the server told a stranger something: {other:?}"),
        }
        return;
    }
    require_root(TEST);
    for (peers, timeout) in [(2, Duration::from_secs(5)), (3, Duration::from_millis(500))] {
        let server = server_in_tmp(timeout);
        // The directory and socket are private, so a stranger cannot even reach the socket; open them up here to
        // test the second wall, the uid check.
        fs::set_permissions(server.dir(), fs::Permissions::from_mode(0o711)).expect("chmod dir");
        fs::set_permissions(server.path(), fs::Permissions::from_mode(0o666)).expect("chmod socket");
        let mut child = spawn_self(TEST, &[("ANYCCL_TEST_SOCKET", server.path().display().to_string())]);
        let lines = lines_of(&mut child);
        expect_tag(&lines, "SENT");
        let (_peers, _r) = real_peers(server.path(), &[1, 2]);
        let got = server.gather(peers, 1, |_| Ok(()));
        if peers == 2 {
            assert_eq!(got.expect("the real peers arrive").len(), 2);
        } else {
            let e = got.expect_err("no third peer");
            assert!(e.to_string().contains("(2 arrived)"), "{e}");
            assert!(e.to_string().contains("1 connection(s) of another user"), "{e}");
        }
        drop(server);
        expect_child_ok(child, Some(lines));
    }
}

#[test]
fn a_client_refuses_a_server_of_another_user() {
    const TEST: &str = "a_client_refuses_a_server_of_another_user";
    if is_child() {
        let base = PathBuf::from(std::env::var("ANYCCL_TEST_BASE").expect("base"));
        setuid(Uid::from_raw(NOBODY)).expect("setuid(nobody)");
        let server = FdServer::bind_in(&base).expect("bind as nobody");
        println!("SOCKET {}", server.path().display());
        let mut s = String::new();
        let _ = std::io::stdin().read_line(&mut s);
        drop(server);
        println!("CHILD OK");
        return;
    }
    require_root(TEST);
    let base = TempBase::new("foreign-server");
    fs::set_permissions(&base.0, fs::Permissions::from_mode(0o777)).expect("chmod");
    let mut child = spawn_self(TEST, &[("ANYCCL_TEST_BASE", base.0.display().to_string())]);
    let lines = lines_of(&mut child);
    let path = PathBuf::from(expect_tag(&lines, "SOCKET "));
    let e = FdChannel::connect(&path).expect_err("a server of uid nobody");
    assert!(matches!(e, Error::PeerFailure(_)), "{e:?}");
    assert!(e.to_string().contains(&format!("its uid {NOBODY} is not ours")), "{e}");
    drop(child.stdin.take());
    expect_child_ok(child, Some(lines));
}
