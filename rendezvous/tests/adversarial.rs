//! The rendezvous under attack, through its public API and raw sockets on 127.0.0.1 (port 0, no GPU): key probes,
//! guessed keys, replayed handshakes, an impostor rank 0, a man in the middle, slowloris, floods, truncated and
//! oversized handshakes, escape codes. Each attack runs while the real ranks form their group, and the test checks
//! that the real ranks get exactly their own data, quickly, and the attacker gets nothing.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyccl_core::Error;
use anyccl_rendezvous::tcp::{HANDSHAKE_LIMIT, MAGIC, PROTOCOL_VERSION};
use anyccl_rendezvous::{JobKey, Listener, Rendezvous, RendezvousConfig};

const GREETING_LEN: usize = 12 + 32;
const HELLO_LEN: usize = 12 + 8 + 8 + 32 + 32;
const REJECT: u8 = 0x5a;
const ACCEPT: u8 = 0xa5;
const SECRET: &[u8] = b"adversarial-suite secret 0123456789";

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().expect("addr")
}

fn listen(world: usize, timeout: Duration) -> Listener {
    let cfg = RendezvousConfig::new(0, world, any_port()).with_timeout(timeout).with_key(JobKey::from_secret(SECRET));
    Rendezvous::listen(cfg).expect("listen")
}

fn preamble() -> Vec<u8> {
    let mut p = MAGIC.to_vec();
    p.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    p
}

/// Everything the other side sends until it closes (or 5 s pass).
fn rest(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let _ = s.read_to_end(&mut out);
    out
}

fn random_bytes(n: usize) -> Vec<u8> {
    // not cryptographic; the attacker's "random" guesses
    let mut x = 0x9e37_79b9_7f4a_7c15_u64 ^ (Instant::now().elapsed().as_nanos() as u64) ^ n as u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Rank 0 accepting (and then all-gathering "rank 0") on its own thread, and the other ranks' configurations.
struct Group {
    root: thread::JoinHandle<anyccl_core::Result<(Rendezvous, Vec<Vec<u8>>)>>,
    configs: Vec<RendezvousConfig>,
}

/// Starts rank 0's `accept_all`, so that attacks meet a rank 0 that is forming its group.
fn start_root(listener: Listener) -> Group {
    let world = listener.client_config(0).world;
    let configs = (1..world).map(|rank| listener.client_config(rank)).collect();
    let root = thread::spawn(move || {
        let mut g0 = listener.accept_all()?;
        let all = g0.all_gather(b"rank 0")?;
        Ok((g0, all))
    });
    Group { root, configs }
}

/// Starts the other ranks (threads) of `group`; every rank all-gathers its own name. Checks that every rank got
/// exactly the real ranks' data, and returns rank 0's group and how long the ranks took from their start.
fn join_ranks(group: Group) -> (Rendezvous, Duration) {
    let world = group.configs.len() + 1;
    let start = Instant::now();
    let clients: Vec<_> = group
        .configs
        .into_iter()
        .map(|cfg| {
            thread::spawn(move || {
                let name = format!("rank {}", cfg.rank);
                Rendezvous::connect(cfg).and_then(|mut g| g.all_gather(name.as_bytes()))
            })
        })
        .collect();
    let want: Vec<Vec<u8>> = (0..world).map(|r| format!("rank {r}").into_bytes()).collect();
    for (i, c) in clients.into_iter().enumerate() {
        assert_eq!(c.join().expect("rank thread").expect("rank joins and gathers"), want, "rank {}", i + 1);
    }
    let (g0, all) = group.root.join().expect("rank 0 thread").expect("rank 0 forms the group");
    assert_eq!(all, want, "rank 0 got exactly the real ranks' data");
    (g0, start.elapsed())
}

// ---- hostile clients ----

#[test]
fn key_probes_learn_nothing_and_cannot_join() {
    let listener = listen(3, Duration::from_secs(10));
    let addr = listener.local_addr();
    let group = start_root(listener);
    // five probes with every combination of wrong world, rank and proof: each is told the same single byte
    let mut replies = Vec::new();
    for (world, rank) in [(1u64, 2u64), (3, 2), (2, 2), (3, 1), (4, 5)] {
        let mut s = TcpStream::connect(addr).expect("connect");
        let mut hello = preamble();
        hello.extend_from_slice(&world.to_le_bytes());
        hello.extend_from_slice(&rank.to_le_bytes());
        hello.extend(random_bytes(64));
        s.write_all(&hello).expect("hello");
        let reply = rest(&mut s);
        assert_eq!(reply.len(), GREETING_LEN + 1, "{reply:?}");
        assert_eq!(reply[..12], preamble()[..], "the greeting is magic, version and a nonce");
        replies.push(reply);
    }
    // after the greeting (whose nonce is fresh every time) the answer is one byte, the same for every probe
    assert!(replies.iter().all(|r| r[GREETING_LEN..] == [REJECT]));
    let nonces: std::collections::HashSet<&[u8]> = replies.iter().map(|r| &r[12..GREETING_LEN]).collect();
    assert_eq!(nonces.len(), replies.len(), "every connection gets a fresh nonce");

    let (g0, took) = join_ranks(group);
    assert!(took < Duration::from_secs(5), "took {took:?}");
    let record = g0.rejections();
    assert_eq!(record.count(), 5, "{record}");
    assert!(record.first().iter().all(|r| r.contains("did not prove it holds the job key")), "{record}");
}

#[test]
fn guessed_keys_cannot_join() {
    let listener = listen(3, Duration::from_secs(10));
    let addr = listener.local_addr();
    let guesses = [
        JobKey::per_user(&[0u8; 32], &addr.ip().to_string(), addr.port()),
        JobKey::per_user(b"", "127.0.0.1", addr.port()),
        JobKey::from_secret(b""),
        JobKey::from_secret(&SECRET[..SECRET.len() - 1]),
        JobKey::random().expect("random"),
    ];
    let template = listener.client_config(2);
    let group = start_root(listener);
    for guess in guesses {
        let cfg = template.clone().with_key(guess).with_timeout(Duration::from_secs(5));
        let e = Rendezvous::connect(cfg).expect_err("a guessed key");
        assert!(matches!(e, Error::PeerFailure(_)), "{e:?}");
        assert!(e.to_string().contains("rejected rank 2"), "{e}");
    }
    let (g0, took) = join_ranks(group);
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert_eq!(g0.rejections().count(), 5, "{}", g0.rejections());
}

/// A TCP relay in front of `target` for one connection, recording both directions; it can flip one byte of the
/// client's stream (at `flip_up`) or of rank 0's stream (at `flip_down`) on the way.
struct Relay {
    addr: SocketAddr,
    up: Arc<Mutex<Vec<u8>>>,
    down: Arc<Mutex<Vec<u8>>>,
}

impl Relay {
    fn start(target: SocketAddr, flip_up: Option<usize>, flip_down: Option<usize>) -> Relay {
        let listener = TcpListener::bind(any_port()).expect("relay bind");
        let addr = listener.local_addr().expect("relay addr");
        let (up, down) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
        let (u, d) = (up.clone(), down.clone());
        thread::spawn(move || {
            let Ok((client, _)) = listener.accept() else { return };
            let Ok(server) = TcpStream::connect(target) else { return };
            let (c2, s2) = (client.try_clone().expect("clone"), server.try_clone().expect("clone"));
            let a = thread::spawn(move || copy(client, server, &u, flip_up));
            copy(s2, c2, &d, flip_down);
            let _ = a.join();
        });
        Relay { addr, up, down }
    }
}

fn copy(mut from: TcpStream, mut to: TcpStream, record: &Mutex<Vec<u8>>, flip: Option<usize>) {
    let mut buf = [0u8; 4096];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut rec = record.lock().expect("lock");
        let at = rec.len();
        if let Some(f) = flip.filter(|f| (at..at + n).contains(f)) {
            buf[f - at] ^= 0x01;
        }
        rec.extend_from_slice(&buf[..n]);
        drop(rec);
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

#[test]
fn replayed_handshakes_are_rejected_both_ways() {
    // record a genuine session of rank 1 through a relay
    let listener = listen(2, Duration::from_secs(5));
    let relay = Relay::start(listener.local_addr(), None, None);
    let c1 = RendezvousConfig { master: relay.addr, ..listener.client_config(1) };
    let client = thread::spawn(move || Rendezvous::connect(c1).and_then(|mut g| g.all_gather(b"one")));
    let mut g0 = listener.accept_all().expect("genuine group");
    g0.all_gather(b"zero").expect("genuine gather");
    client.join().expect("client").expect("genuine rank 1");
    drop(g0);
    let up = relay.up.lock().expect("lock").clone();
    let down = relay.down.lock().expect("lock").clone();
    assert!(up.len() > HELLO_LEN && down.len() > GREETING_LEN + 33, "{} / {} bytes", up.len(), down.len());

    // the client's handshake, replayed at a fresh rank 0 with the same key and rank 1's slot free (rank 0 waits 3 s:
    // long enough to turn both replays away on a loaded machine before its deadline ends the group)
    let listener = listen(2, Duration::from_secs(3));
    let addr = listener.local_addr();
    let root = thread::spawn(move || listener.accept_all());
    let mut s = TcpStream::connect(addr).expect("connect");
    let mut greeting = [0u8; GREETING_LEN];
    s.read_exact(&mut greeting).expect("greeting");
    s.write_all(&up[..HELLO_LEN]).expect("replay");
    assert_eq!(rest(&mut s), [REJECT]);
    // and the whole recorded stream, frames and all
    let mut s = TcpStream::connect(addr).expect("connect");
    let _ = s.write_all(&up);
    let reply = rest(&mut s);
    assert!(reply.len() <= GREETING_LEN + 1, "{reply:?}");
    let err = root.join().expect("root").expect_err("nobody joined");
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(err.to_string().contains("2 connections turned away"), "{err}");
    assert!(err.to_string().contains("did not prove it holds the job key"), "{err}");

    // rank 0's side replayed to a real client: greeting, verdict, proof, Ready and results
    let fake = TcpListener::bind(any_port()).expect("bind");
    let cfg = RendezvousConfig::new(1, 2, fake.local_addr().expect("addr"))
        .with_timeout(Duration::from_secs(5))
        .with_key(JobKey::from_secret(SECRET));
    let client = thread::spawn(move || Rendezvous::connect(cfg).and_then(|mut g| g.all_gather(b"PAYLOAD")));
    let (mut s, _) = fake.accept().expect("accept");
    s.write_all(&down).expect("replay rank 0");
    let sent = rest(&mut s);
    let err = client.join().expect("client").expect_err("a replayed rank 0");
    assert!(err.to_string().contains("did not prove it holds the job key"), "{err}");
    assert_eq!(sent.len(), HELLO_LEN, "the client sent its hello and nothing more");
}

#[test]
fn a_man_in_the_middle_cannot_change_a_frame() {
    // a byte of rank 1's all-gather payload (after its hello and the frame header) flipped on the way
    let listener = listen(2, Duration::from_secs(5));
    let relay = Relay::start(listener.local_addr(), Some(HELLO_LEN + 26), None);
    let c1 = RendezvousConfig { master: relay.addr, ..listener.client_config(1) };
    let client = thread::spawn(move || Rendezvous::connect(c1).and_then(|mut g| g.all_gather(b"one")));
    let mut g0 = listener.accept_all().expect("group");
    let e0 = g0.all_gather(b"zero").expect_err("a changed frame");
    assert!(e0.to_string().contains("rank 1 during all_gather #0 failed authentication"), "{e0}");
    let e1 = client.join().expect("client").expect_err("rank 0 gave up");
    assert!(e1.to_string().contains("failed authentication"), "{e1}");

    // a byte of rank 0's Ready frame flipped on the way to rank 1
    let listener = listen(2, Duration::from_secs(5));
    let relay = Relay::start(listener.local_addr(), None, Some(GREETING_LEN + 33 + 10));
    let c1 = RendezvousConfig { master: relay.addr, ..listener.client_config(1) };
    let client = thread::spawn(move || Rendezvous::connect(c1));
    let _g0 = listener.accept_all().expect("group");
    let e1 = client.join().expect("client").expect_err("a changed Ready");
    assert!(e1.to_string().contains("failed authentication"), "{e1}");
}

#[test]
fn truncated_and_oversized_handshakes() {
    let listener = listen(3, Duration::from_secs(10));
    let addr = listener.local_addr();
    let group = start_root(listener);
    // half a hello, then gone. Rank 0's greeting is read first: closing a socket with unread data resets the
    // connection (RST), which rank 0 could see before the 42 bytes, instead of the orderly close this case is about.
    let mut s = TcpStream::connect(addr).expect("connect");
    let mut greeting = [0u8; GREETING_LEN];
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    s.read_exact(&mut greeting).expect("rank 0's greeting");
    let mut hello = preamble();
    hello.extend_from_slice(&[0u8; 30]);
    s.write_all(&hello).expect("half a hello");
    drop(s);
    // megabytes after a valid preamble: rank 0 reads one hello's worth, rejects it and closes the connection, so
    // the sender's writes fail with a reset or a broken pipe (not a timeout: nobody reads them). The kernel's
    // socket buffers can hold tens of MiB on loopback (tcp_rmem's maximum is 32 MiB on common hosts), so a write
    // may succeed before the reset arrives: keep writing 1 MiB at a time, and fail only if far more than any
    // buffer holds (256 MiB) went through, which would mean rank 0 kept reading.
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_write_timeout(Some(Duration::from_secs(5))).expect("timeout");
    s.write_all(&preamble()).expect("a valid preamble");
    let junk = vec![b'z'; 1 << 20];
    let sent = (0..256)
        .find_map(|_| s.write_all(&junk).err())
        .expect("rank 0 must close a connection that sends megabytes, yet it took 256 MiB");
    assert!(matches!(sent.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe), "{sent:?}");
    let (g0, took) = join_ranks(group);
    assert!(took < Duration::from_secs(5), "took {took:?}");
    let record = g0.rejections().to_string();
    assert!(record.contains("closed during the handshake after 42 bytes"), "{record}");
    assert!(record.contains("did not prove"), "{record}");
}

#[test]
fn escape_codes_in_what_a_stranger_sends_are_sanitized() {
    let listener = listen(2, Duration::from_secs(2));
    let addr = listener.local_addr();
    let root = thread::spawn(move || listener.accept_all());
    let mut s = TcpStream::connect(addr).expect("connect");
    s.write_all(b"\x1b]0;pwned\x07\x1b[2J\nERROR").expect("write");
    let _ = rest(&mut s);
    let err = root.join().expect("root").expect_err("nobody joined");
    let text = err.to_string();
    assert!(!text.contains('\x1b') && !text.contains('\n') && !text.contains('\x07'), "{text:?}");
    assert!(text.contains("bad magic '\\u{1b}"), "{text:?}");
}

// ---- hostile rank 0 ----

fn client_of(fake: &TcpListener, timeout: Duration) -> thread::JoinHandle<anyccl_core::Result<Vec<Vec<u8>>>> {
    let cfg = RendezvousConfig::new(1, 2, fake.local_addr().expect("addr"))
        .with_timeout(timeout)
        .with_key(JobKey::from_secret(SECRET));
    thread::spawn(move || Rendezvous::connect(cfg).and_then(|mut g| g.all_gather(b"PAYLOAD")))
}

#[test]
fn an_impostor_rank_0_gets_no_payload_and_no_key() {
    let fake = TcpListener::bind(any_port()).expect("bind");
    let has = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).any(|w| w == needle);

    // it pretends to accept, with a made-up proof
    let client = client_of(&fake, Duration::from_secs(5));
    let (mut s, _) = fake.accept().expect("accept");
    let mut greeting = preamble();
    greeting.extend(random_bytes(32));
    s.write_all(&greeting).expect("greeting");
    let mut hello = vec![0u8; HELLO_LEN];
    s.read_exact(&mut hello).expect("hello");
    let mut verdict = vec![ACCEPT];
    verdict.extend(random_bytes(32));
    s.write_all(&verdict).expect("verdict");
    let after = rest(&mut s);
    let err = client.join().expect("client").expect_err("an impostor");
    assert!(err.to_string().contains("did not prove it holds the job key"), "{err}");
    assert!(after.is_empty(), "the client sent {} more bytes after its hello", after.len());
    assert!(!has(&hello, SECRET) && !has(&hello, b"PAYLOAD"));

    // it rejects
    let client = client_of(&fake, Duration::from_secs(5));
    let (mut s, _) = fake.accept().expect("accept");
    s.write_all(&greeting).expect("greeting");
    s.read_exact(&mut hello).expect("hello");
    s.write_all(&[REJECT]).expect("verdict");
    drop(s);
    let err = client.join().expect("client").expect_err("rejected");
    assert!(err.to_string().contains("rejected rank 1"), "{err}");

    // it speaks another protocol
    let client = client_of(&fake, Duration::from_secs(5));
    let (mut s, _) = fake.accept().expect("accept");
    s.write_all(b"SSH-2.0-OpenSSH_9.6\r\n\x1b[2J....................").expect("banner");
    let err = client.join().expect("client").expect_err("not a rendezvous");
    assert!(err.to_string().contains("not an anyccl rendezvous"), "{err}");

    // it hangs up on every connection: the client tries again until its timeout, then says so
    let stop = Arc::new(AtomicBool::new(false));
    let client = client_of(&fake, Duration::from_secs(2));
    let stopper = stop.clone();
    fake.set_nonblocking(true).expect("nonblocking");
    let hangups = thread::spawn(move || {
        let mut n = 0;
        while !stopper.load(Ordering::Relaxed) {
            match fake.accept() {
                Ok((s, _)) => {
                    n += 1;
                    drop(s);
                }
                Err(_) => thread::sleep(Duration::from_millis(2)),
            }
        }
        n
    });
    let err = client.join().expect("client").expect_err("nobody answers");
    stop.store(true, Ordering::Relaxed);
    let n = hangups.join().expect("hangups");
    assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
    assert!(err.to_string().contains("attempts; the last: rank 0 at"), "{err}");
    assert!(n >= 2, "the client connected {n} times");
}

// ---- many connections ----

/// Opens `n` connections to `addr` and keeps them (silent ones when `garbage` is false; otherwise four kinds of
/// garbage in turn: random bytes, a bare preamble, a preamble and half a hello, 64 KiB of junk). Signals `started`
/// after the first tenth, so the real ranks join while the attack goes on.
fn attack(addr: SocketAddr, n: usize, garbage: bool, started: mpsc::Sender<()>) -> Vec<TcpStream> {
    let mut held = Vec::with_capacity(n);
    for i in 0..n {
        if i == n / 10 {
            let _ = started.send(());
        }
        let Ok(mut s) = TcpStream::connect(addr) else { continue };
        if garbage {
            let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
            let bytes = match i % 4 {
                0 => random_bytes(64),
                1 => preamble(),
                2 => [preamble(), vec![0u8; 40]].concat(),
                _ => vec![b'A'; 64 << 10],
            };
            let _ = s.write_all(&bytes);
        }
        held.push(s);
    }
    held
}

/// The real ranks (a group of 4) join while `n` silent or garbage connections are held open: all of them made
/// before the ranks start, or (`concurrent`) the ranks start once a tenth are made and the rest keep coming.
fn under_attack(n: usize, garbage: bool, timeout: Duration, concurrent: bool) {
    let listener = listen(4, timeout);
    let addr = listener.local_addr();
    let group = start_root(listener);
    let (tx, rx) = mpsc::channel();
    let attacker = thread::spawn(move || attack(addr, n, garbage, tx));
    let (pending_attack, before) = if concurrent {
        rx.recv().expect("the attack started");
        (Some(attacker), None)
    } else {
        let all = attacker.join().expect("attacker");
        assert_eq!(all.len(), n, "every attacking connection was made");
        (None, Some(all))
    };
    let (g0, took) = join_ranks(group);
    // connections attempted after the group formed find the port closed
    let held = match (pending_attack, before) {
        (Some(a), _) => a.join().expect("attacker"),
        (None, Some(all)) => all,
        (None, None) => Vec::new(),
    };
    eprintln!(
        "{n} {} connections ({}), timeout {timeout:?}: the group of 4 formed and gathered in {took:?}; rank 0 \
         turned away {} while forming; the attacker holds {}",
        if garbage { "garbage" } else { "silent" },
        if concurrent { "while the ranks joined" } else { "before the ranks started" },
        g0.rejections().count(),
        held.len()
    );
    assert!(held.len() >= n / 10);
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(took < HANDSHAKE_LIMIT, "the real ranks waited for an attacker's handshake deadline: {took:?}");
    assert!(g0.rejections().first().len() <= anyccl_rendezvous::Rejections::KEPT);
}

#[test]
fn slowloris_100_silent_sockets_at_the_default_timeout() {
    under_attack(100, false, anyccl_rendezvous::config::DEFAULT_TIMEOUT, false);
}

#[test]
fn slowloris_100_silent_sockets_at_20s() {
    under_attack(100, false, Duration::from_secs(20), false);
}

#[test]
fn flood_500_garbage_connections_at_the_default_timeout() {
    under_attack(500, true, anyccl_rendezvous::config::DEFAULT_TIMEOUT, false);
}

#[test]
fn flood_500_garbage_connections_at_20s() {
    under_attack(500, true, Duration::from_secs(20), false);
}

#[test]
fn ranks_join_while_the_attacks_go_on() {
    under_attack(100, false, anyccl_rendezvous::config::DEFAULT_TIMEOUT, true);
    under_attack(500, true, Duration::from_secs(20), true);
}

#[test]
fn the_listener_binds_exactly_the_configured_address() {
    let listener = listen(2, Duration::from_secs(5));
    let addr = listener.local_addr();
    assert_eq!(addr.ip(), any_port().ip());
    // another loopback address on the same port reaches nothing: the socket is not bound to 0.0.0.0
    let other: SocketAddr = SocketAddr::new("127.0.0.2".parse().expect("ip"), addr.port());
    assert!(TcpStream::connect_timeout(&other, Duration::from_secs(2)).is_err());
}

/// Connections that drip a preamble and a hello one byte every 200 ms (a handshake never silent long enough for a
/// per-read timeout, that would take 18 s to finish): rank 0 closes each at its own deadline, `HANDSHAKE_LIMIT`
/// after it connected whatever bytes keep coming, and the real ranks then form their group at once.
#[test]
fn dripping_handshakes_are_cut_at_their_own_deadline() {
    let listener = listen(3, Duration::from_secs(60));
    let addr = listener.local_addr();
    let group = start_root(listener);
    let drips: Vec<_> = (0..4)
        .map(|_| {
            thread::spawn(move || {
                let mut s = TcpStream::connect(addr).expect("connect");
                s.set_read_timeout(Some(Duration::from_millis(200))).expect("timeout");
                s.set_write_timeout(Some(Duration::from_secs(2))).expect("timeout");
                let t = Instant::now();
                let mut sink = [0u8; 64];
                for b in [preamble(), random_bytes(HELLO_LEN)].concat() {
                    if s.write_all(&[b]).is_err() {
                        return Some(t.elapsed());
                    }
                    // Reading (the greeting) between bytes also paces the drip and sees the close.
                    match s.read(&mut sink) {
                        Ok(0) => return Some(t.elapsed()),
                        Ok(_) => {}
                        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                        }
                        Err(_) => return Some(t.elapsed()),
                    }
                }
                None
            })
        })
        .collect();
    for d in drips {
        let cut = d.join().expect("drip").expect("a dripping handshake is cut before it ends");
        // Closed at its deadline, not a per-byte timeout (which the drip never hits) and not after it finished.
        assert!(cut >= HANDSHAKE_LIMIT - Duration::from_millis(500), "cut after {cut:?}");
        assert!(cut < HANDSHAKE_LIMIT + Duration::from_secs(8), "cut after {cut:?}");
    }
    let (_g0, took) = join_ranks(group);
    assert!(took < HANDSHAKE_LIMIT, "the real ranks took {took:?}");
}
