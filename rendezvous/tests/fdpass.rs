//! File-descriptor passing between two threads over the Unix socket.
#![cfg(target_os = "linux")]

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::thread;
use std::time::Duration;

use anyccl_core::Error;
use anyccl_rendezvous::fdpass::{FdChannel, FdServer, MAX_FDS};
use nix::sys::socket::{recv, socketpair, AddressFamily, MsgFlags, SockFlag, SockType};

fn base() -> PathBuf {
    std::env::temp_dir()
}

/// A pipe whose ends no child process inherits.
fn cloexec_pipe() -> (OwnedFd, OwnedFd) {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe")
}

#[test]
fn a_pipe_end_travels_and_works() {
    let server = FdServer::bind_in(&base()).expect("bind").with_timeout(Duration::from_secs(5)).expect("timeout");
    let path = server.path().to_owned();
    // close-on-exec: the reader waits for end-of-file, which a child process of a parallel test holding a copy of
    // the write end would delay until it exits
    let (read_end, write_end) = cloexec_pipe();

    let sender = thread::spawn(move || {
        let ch = FdChannel::connect(&path).expect("connect");
        ch.send(&[write_end.as_fd()], b"here is the write end").expect("send");
        // our copy closes now; the receiver's duplicate keeps the pipe open
        drop(write_end);
        // wait for the receiver's answer, with no fds
        let (fds, msg) = ch.recv(0).expect("answer");
        assert!(fds.is_empty());
        msg
    });

    let ch = server.accept().expect("accept");
    assert!(ch.peer_pid() > 0);
    let (mut fds, payload) = ch.recv(4).expect("recv");
    assert_eq!(payload, b"here is the write end");
    assert_eq!(fds.len(), 1);
    let mut w = File::from(fds.remove(0));
    w.write_all(b"written through the passed fd").expect("write through the received fd");
    drop(w); // the last write end: the reader sees EOF
    let mut got = String::new();
    File::from(read_end).read_to_string(&mut got).expect("read back");
    assert_eq!(got, "written through the passed fd");
    ch.send(&[], b"done").expect("answer");
    assert_eq!(sender.join().expect("sender"), b"done");
}

#[test]
fn several_fds_and_an_empty_payload() {
    let server = FdServer::bind_in(&base()).expect("bind");
    let client = FdChannel::connect(server.path()).expect("connect");
    let ch = server.accept().expect("accept");
    let pipes: Vec<_> = (0..3).map(|_| cloexec_pipe()).collect();
    let ends: Vec<_> = pipes.iter().map(|(_, w)| w.as_fd()).collect();
    client.send(&ends, b"").expect("send");
    let (fds, payload) = ch.recv(MAX_FDS).expect("recv");
    assert!(payload.is_empty());
    assert_eq!(fds.len(), 3);
    for (fd, (r, _)) in fds.into_iter().zip(&pipes) {
        File::from(fd).write_all(b"x").expect("write");
        let mut b = [0u8; 1];
        File::from(r.try_clone().expect("dup")).read_exact(&mut b).expect("read");
        assert_eq!(&b, b"x");
    }
}

#[test]
fn too_many_fds_for_the_receiver_are_refused_and_closed() {
    let server = FdServer::bind_in(&base()).expect("bind");
    let client = FdChannel::connect(server.path()).expect("connect");
    let ch = server.accept().expect("accept");
    // a socket pair as the pipe, so that the check below can look without waiting
    let (r, w) = socketpair(AddressFamily::Unix, SockType::Stream, None, SockFlag::SOCK_CLOEXEC).expect("socketpair");
    client.send(&[w.as_fd(), w.as_fd()], b"two").expect("send");
    drop(w);
    let e = ch.recv(1).expect_err("only one expected");
    assert!(e.to_string().contains("carries 2 descriptors, more than the 1 expected"), "{e}");
    // both received duplicates were closed: no writer is left, so the reader sees end of file at once
    let mut b = [0u8; 8];
    assert_eq!(recv(r.as_raw_fd(), &mut b, MsgFlags::MSG_DONTWAIT).expect("end of file, not EAGAIN"), 0);
}

#[test]
fn socket_and_directory_are_private_and_removed_on_drop() {
    let server = FdServer::bind_in(&base()).expect("bind");
    let (path, dir) = (server.path().to_owned(), server.dir().to_owned());
    assert_eq!(path.parent(), Some(dir.as_path()));
    let mode = |p: &PathBuf| std::fs::metadata(p).expect("metadata").permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700, "directory mode");
    assert_eq!(mode(&path), 0o600, "socket mode");
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata(&path).expect("metadata").file_type().is_socket());
    drop(server);
    assert!(!path.exists(), "socket removed");
    assert!(!dir.exists(), "directory removed");
}

#[test]
fn default_location_is_runtime_dir_or_temp() {
    let server = FdServer::bind().expect("bind");
    let expected = std::env::var_os("XDG_RUNTIME_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    assert_eq!(server.dir().parent(), Some(expected.as_path()));
}

#[test]
fn a_peer_of_another_uid_is_dropped_and_the_wait_goes_on() {
    let other_uid = nix::unistd::getuid().as_raw().wrapping_add(1);
    let server = FdServer::bind_in(&base())
        .expect("bind")
        .with_timeout(Duration::from_millis(300))
        .expect("timeout")
        .with_allowed_uid(other_uid);
    let client = FdChannel::connect(server.path()).expect("connect");
    let e = server.accept().expect_err("nobody of the allowed uid comes");
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    assert!(e.to_string().contains(&format!("a process of uid {other_uid}")), "{e}");
    assert!(e.to_string().contains("1 connection(s) of another user"), "{e}");
    // the refused connection was closed, and nothing was sent to it
    let e = client.recv(1).expect_err("closed by the server");
    assert!(e.to_string().contains("closed the connection"), "{e}");
}

#[test]
fn accept_times_out() {
    let server = FdServer::bind_in(&base()).expect("bind").with_timeout(Duration::from_millis(100)).expect("t");
    let e = server.accept().expect_err("nobody connects");
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
}

#[test]
fn recv_times_out() {
    let server = FdServer::bind_in(&base()).expect("bind").with_timeout(Duration::from_millis(100)).expect("t");
    let _client = FdChannel::connect(server.path()).expect("connect");
    let ch = server.accept().expect("accept");
    let e = ch.recv(1).expect_err("nothing sent");
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
}
