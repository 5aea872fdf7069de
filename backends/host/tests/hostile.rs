//! The host backend across processes, attacked the way a local process would attack it: it truncates, grows or
//! reseals a live rank's segment (reached through `/proc/PID/map_files`, as root or the same user can), kills a
//! rank at moments throughout setup, holds silent or dripping connections to a rank's mesh socket (whose name any
//! local user can read in `/proc/net/unix`), answers from another uid, and, as a lying rank 0 would, points a peer
//! at a socket of its choice. Every attack must end in a typed error or no effect, within a bound: no panic, no
//! crash, no hang, nothing left behind, no wrong result.

use anyccl_testkit::launcher;

use std::io::Read;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyccl_core::bootstrap::{Bootstrap, LocalGroup, LocalRank};
use anyccl_core::{Communicator, DataType, InOut, ReduceOp};
use anyccl_host::{communicator_over, from_env, HostBuffer, HostOptions, ProcessComm};
use launcher::{hold_master_port, result_line, text};

/// A rank that has not finished by then is taken as hung.
const DEADLINE: Duration = Duration::from_secs(60);
/// The rendezvous and host timeout of the ranks in the kill tests.
const TIMEOUT_SECS: u64 = 5;
/// The timeout of the threaded setups: a test that ends well within it shows nobody waited for it.
const LONG: Duration = Duration::from_secs(60);
/// How long a setup that is not stalled may take on a loaded 2-core machine (it takes milliseconds).
const PROMPT: Duration = Duration::from_secs(20);

/// `sum over ranks q of (q + 1) * (i + 1)` for i in 0..4, as the ranks print it.
fn all_reduce_sample(comm: &mut Communicator<ProcessComm>) -> anyccl_core::Result<String> {
    let r = comm.rank() as f32 + 1.0;
    let mut buf = HostBuffer::from_elems(&[r, 2.0 * r, 3.0 * r, 4.0 * r]);
    comm.all_reduce(InOut::InPlace(buf.as_bytes_mut()), 4, DataType::F32, ReduceOp::Sum, &())?;
    Ok(buf.to_vec::<f32>().iter().map(f32::to_string).collect::<Vec<_>>().join(","))
}

fn expected(world: usize) -> String {
    let sum: f32 = (1..=world).map(|q| q as f32).sum();
    (1..=4).map(|i| (sum * i as f32).to_string()).collect::<Vec<_>>().join(",")
}

/// The rank half, started by the tests below with torchrun's variables.
#[test]
#[ignore = "one rank of the launcher tests, which start it with torchrun's variables"]
fn rank() {
    let mode = std::env::var("ANYCCL_HOSTILE_CHILD").expect("run by the launcher tests");
    let opts = HostOptions { timeout: Duration::from_secs(TIMEOUT_SECS), ..HostOptions::default() };
    match mode.as_str() {
        "hold" => {
            let mut comm = from_env(opts).expect("the host communicator forms");
            let first = all_reduce_sample(&mut comm).expect("a first all-reduce");
            let ready = PathBuf::from(std::env::var("ANYCCL_HOSTILE_READY").expect("ready file"));
            std::fs::write(ready.with_extension(comm.rank().to_string()), b"").expect("ready");
            let go = ready.with_extension("go");
            let t = Instant::now();
            while !go.exists() {
                assert!(t.elapsed() < DEADLINE, "never told to go on");
                std::thread::sleep(Duration::from_millis(10));
            }
            let second = all_reduce_sample(&mut comm).expect("an all-reduce after the attacks");
            let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
            let named = maps.lines().filter(|l| l.contains("/dev/shm/")).count();
            let memfds = maps.lines().filter(|l| l.contains("/memfd:anyccl-host-segment")).count();
            println!("RESULT {first} {second} dev-shm={named} memfds={memfds}");
        }
        "setup" => match from_env(opts).and_then(|mut c| all_reduce_sample(&mut c)) {
            Ok(s) => println!("RESULT {s}"),
            Err(e) => {
                println!("FAILED {e}");
                std::process::exit(3);
            }
        },
        "stall" => {
            // Rank 1 stops (and says so in a file) at its STAGE-th bootstrap all-gather of the setup, before it
            // contributes or after it returned, for the launcher to kill it exactly there.
            let rank: usize = std::env::var("RANK").expect("RANK").parse().expect("a rank");
            let rdv = anyccl_rendezvous::Rendezvous::establish(
                anyccl_rendezvous::RendezvousConfig::from_env().expect("the rendezvous configuration"),
            );
            let outcome = rdv.and_then(|rdv| {
                let boot: Box<dyn Bootstrap + Send> = if rank == 1 {
                    let var = |k: &str| std::env::var(k).expect(k);
                    Box::new(Stall {
                        inner: rdv,
                        n: 0,
                        stage: var("ANYCCL_HOSTILE_STAGE").parse().expect("a stage"),
                        after: var("ANYCCL_HOSTILE_AFTER") == "1",
                        ready: PathBuf::from(var("ANYCCL_HOSTILE_READY")),
                    })
                } else {
                    Box::new(rdv)
                };
                communicator_over(boot, opts).and_then(|mut c| all_reduce_sample(&mut c))
            });
            match outcome {
                Ok(s) => println!("RESULT {s}"),
                Err(e) => {
                    println!("FAILED {e}");
                    std::process::exit(3);
                }
            }
        }
        other => panic!("unknown mode {other}"),
    }
}

/// A bootstrap that stops for good at its `stage`-th all-gather (see the rank's `stall` mode).
struct Stall {
    inner: anyccl_rendezvous::Rendezvous,
    n: usize,
    stage: usize,
    after: bool,
    ready: PathBuf,
}

impl Stall {
    fn stop_here(&self) -> ! {
        std::fs::write(&self.ready, b"").expect("ready");
        std::thread::sleep(DEADLINE);
        std::process::exit(4);
    }
}

impl Bootstrap for Stall {
    fn rank(&self) -> usize {
        Bootstrap::rank(&self.inner)
    }
    fn world(&self) -> usize {
        Bootstrap::world(&self.inner)
    }
    fn all_gather(&mut self, mine: &[u8]) -> anyccl_core::Result<Vec<Vec<u8>>> {
        self.n += 1;
        if self.n == self.stage && !self.after {
            self.stop_here();
        }
        let all = self.inner.all_gather(mine)?;
        if self.n == self.stage && self.after {
            self.stop_here();
        }
        Ok(all)
    }
}

fn start(world: usize, port: u16, mode: &str, extra: &[(&str, String)]) -> Vec<Child> {
    let mut env = vec![("ANYCCL_HOSTILE_CHILD", mode.to_owned())];
    env.extend(extra.iter().cloned());
    launcher::start_ranks(world, port, &env)
}

/// The segment mappings of process `pid`: (`/proc/PID/map_files` entry, whether mapped writable).
fn segment_mappings(pid: u32) -> Vec<(PathBuf, bool)> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    maps.lines()
        .filter(|l| l.contains("/memfd:anyccl-host-segment"))
        .map(|l| {
            let mut f = l.split_whitespace();
            let range = f.next().expect("range");
            let perms = f.next().expect("perms");
            (PathBuf::from(format!("/proc/{pid}/map_files/{range}")), perms.contains('w'))
        })
        .collect()
}

/// Two live ranks; an outsider reaches every segment mapping of both through `/proc/PID/map_files`, opens it
/// read-write and tries to truncate it, grow it (by `ftruncate` and `fallocate`) and add a seal: every try is
/// refused by the kernel, and the ranks' next all-reduce is right. No mapping is a file in `/dev/shm` (there is no
/// name to replace).
#[test]
fn an_outsider_cannot_truncate_grow_or_reseal_a_live_segment() {
    let held = hold_master_port();
    let port = held.local_addr().expect("addr").port();
    let dir = tempfile::tempdir().expect("tempdir");
    let ready = dir.path().join("ready");
    let t0 = Instant::now();
    let kids = start(2, port, "hold", &[("ANYCCL_HOSTILE_READY", ready.display().to_string())]);
    while !(0..2).all(|r| ready.with_extension(r.to_string()).exists()) {
        assert!(t0.elapsed() < DEADLINE, "the ranks never became ready");
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut tries = 0;
    for k in &kids {
        let maps = segment_mappings(k.id());
        assert_eq!(maps.len(), 2, "rank pid {} maps its own segment and its peer's: {maps:?}", k.id());
        assert_eq!(maps.iter().filter(|(_, w)| *w).count(), 1, "only its own segment is writable: {maps:?}");
        for (path, _) in maps {
            let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).expect("open through map_files");
            let len = f.metadata().expect("stat").len();
            for (what, r) in [
                ("truncate", rustix::fs::ftruncate(&f, 0)),
                ("shrink", rustix::fs::ftruncate(&f, len - 4096)),
                ("grow", rustix::fs::ftruncate(&f, len * 2)),
                ("grow by fallocate", rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, len * 2)),
                ("add a seal", rustix::fs::fcntl_add_seals(&f, rustix::fs::SealFlags::WRITE)),
            ] {
                assert_eq!(r, Err(rustix::io::Errno::PERM), "{what} of {}", path.display());
                tries += 1;
            }
            assert_eq!(f.metadata().expect("stat").len(), len);
        }
    }
    assert_eq!(tries, 20);
    std::fs::write(ready.with_extension("go"), b"").expect("go");
    let want = expected(2);
    for (r, k) in kids.into_iter().enumerate() {
        let line = result_line(r, &launcher::finish(r, k, t0, DEADLINE));
        assert_eq!(line, format!("{want} {want} dev-shm=0 memfds=2"), "rank {r}");
    }
}

/// A rank killed (SIGKILL) at moments spread over its start, rendezvous and setup: every survivor ends within a
/// bound with an error or its result (never a crash or a hang), and nothing is left in the ranks' temporary
/// directory (segments are memfds, mesh sockets abstract: neither has a name on disk).
#[test]
fn a_rank_killed_at_any_moment_of_setup_leaves_nothing_behind() {
    // A whole job starts and ends in some 10-30 ms on an idle machine and several times that under load: the
    // delays spread the kill over the rank's start, the rendezvous, the mesh and the segments' exchange.
    let delays_ms = [0u64, 2, 4, 6, 8, 10, 12, 14, 17, 20, 25, 30, 40, 60];
    let mut outcomes = Vec::new();
    for delay in delays_ms {
        let held = hold_master_port();
        let port = held.local_addr().expect("addr").port();
        let tmp = tempfile::tempdir().expect("tempdir");
        let extra = [
            // Short: a rank killed before it joined the rendezvous costs the others this timeout.
            ("ANYCCL_RENDEZVOUS_TIMEOUT_SECS", "2".to_owned()),
            ("TMPDIR", tmp.path().display().to_string()),
        ];
        let t0 = Instant::now();
        let mut kids = start(3, port, "setup", &extra);
        std::thread::sleep(Duration::from_millis(delay));
        let mut victim = kids.remove(1);
        victim.kill().expect("SIGKILL rank 1");
        let _ = victim.wait();
        let killed = Instant::now();
        for (i, k) in kids.into_iter().enumerate() {
            let rank = if i == 0 { 0 } else { 2 };
            let out = launcher::finish(rank, k, t0, DEADLINE);
            let all = text(&out);
            let code = out.status.code();
            assert!(matches!(code, Some(0) | Some(3)), "rank {rank} crashed or panicked ({:?}):\n{all}", out.status);
            let waited = killed.elapsed();
            assert!(waited < Duration::from_secs(3 * TIMEOUT_SECS + 10), "rank {rank} took {waited:?}");
            let said = all.lines().find(|l| l.starts_with("FAILED ") || l.starts_with("RESULT ")).unwrap_or("");
            outcomes.push(format!("{delay} ms: rank {rank} exit {code:?} after {waited:?}: {said}"));
        }
        let left: Vec<_> = std::fs::read_dir(tmp.path()).expect("tmp").map(|e| e.expect("entry").path()).collect();
        assert!(left.is_empty(), "killed after {delay} ms, left behind: {left:?}");
    }
    eprintln!("{}", outcomes.join("\n"));
}

/// Rank 1 killed exactly at each step of the setup: before it contributes to, and after it returned from, each of
/// the setup's bootstrap all-gathers (the host check, the mesh addresses, the two agreements of the mesh and the
/// two of the segments' exchange: between them it connects, accepts, creates and sends its segment, receives and
/// maps its peers'). Every survivor fails with an error naming rank 1 within a few seconds (the host timeout is 5
/// s, the rendezvous's 2 s: nobody waits it out twice), never crashes or hangs, and nothing is left in the ranks'
/// temporary directory.
#[test]
fn a_rank_killed_at_each_step_of_setup_fails_the_others_promptly_and_leaves_nothing() {
    let mut outcomes = Vec::new();
    let mut stalled = 0;
    for stage in 1..=8usize {
        for after in [false, true] {
            let held = hold_master_port();
            let port = held.local_addr().expect("addr").port();
            let tmp = tempfile::tempdir().expect("tempdir");
            let ready = tmp.path().join("stalled");
            let dir = tempfile::tempdir().expect("tempdir");
            let ready = dir.path().join(ready.file_name().expect("name"));
            let extra = [
                ("ANYCCL_RENDEZVOUS_TIMEOUT_SECS", "2".to_owned()),
                ("TMPDIR", tmp.path().display().to_string()),
                ("ANYCCL_HOSTILE_STAGE", stage.to_string()),
                ("ANYCCL_HOSTILE_AFTER", u8::from(after).to_string()),
                ("ANYCCL_HOSTILE_READY", ready.display().to_string()),
            ];
            let t0 = Instant::now();
            let mut kids = start(3, port, "stall", &extra);
            let mut victim = kids.remove(1);
            // Rank 1 either stops at this stage, or the setup has fewer all-gathers and the job finishes.
            while !ready.exists() && victim.try_wait().expect("wait").is_none() {
                assert!(t0.elapsed() < DEADLINE, "stage {stage}: rank 1 neither stopped nor finished");
                std::thread::sleep(Duration::from_millis(5));
            }
            let hit = ready.exists();
            let _ = victim.kill();
            let _ = victim.wait();
            let killed = Instant::now();
            for (i, k) in kids.into_iter().enumerate() {
                let rank = if i == 0 { 0 } else { 2 };
                let out = launcher::finish(rank, k, t0, DEADLINE);
                let all = text(&out);
                let waited = killed.elapsed();
                let said = all.lines().find(|l| l.starts_with("FAILED ") || l.starts_with("RESULT ")).unwrap_or("");
                if hit {
                    assert_eq!(out.status.code(), Some(3), "stage {stage}/{after}: rank {rank}:\n{all}");
                    assert!(said.contains("rank 1"), "stage {stage}/{after}: rank {rank} does not name rank 1: {said}");
                    assert!(waited < Duration::from_secs(2 * TIMEOUT_SECS + 5), "rank {rank} took {waited:?}");
                } else {
                    assert_eq!(out.status.code(), Some(0), "stage {stage}/{after}: rank {rank}:\n{all}");
                }
                outcomes.push(format!("stage {stage} after={after}: rank {rank} after {waited:?}: {said}"));
            }
            stalled += usize::from(hit);
            let left: Vec<_> = std::fs::read_dir(tmp.path()).expect("tmp").map(|e| e.expect("entry").path()).collect();
            assert!(left.is_empty(), "stage {stage}/{after}: left behind: {left:?}");
        }
    }
    eprintln!("{}", outcomes.join("\n"));
    assert!(stalled >= 12, "only {stalled} kill points were inside the setup");
}

/// A bootstrap whose all-gather of the mesh addresses (the round whose entries hold `anyccl-host-mesh-` names)
/// lets `hook` look at, and change, what this rank sees.
struct Hook<F> {
    inner: LocalRank,
    hook: Option<F>,
}

fn is_mesh_round(all: &[Vec<u8>]) -> bool {
    all.iter().any(|e| e.windows(17).any(|w| w == b"anyccl-host-mesh-"))
}

impl<F: FnOnce(&mut Vec<Vec<u8>>) + Send + 'static> Bootstrap for Hook<F> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn all_gather(&mut self, mine: &[u8]) -> anyccl_core::Result<Vec<Vec<u8>>> {
        let mut all = self.inner.all_gather(mine)?;
        if is_mesh_round(&all) {
            if let Some(h) = self.hook.take() {
                h(&mut all);
            }
        }
        Ok(all)
    }
}

/// Rank 0's mesh name in the gathered entries (after the status byte and the 32-byte token).
fn name_of_rank_0(all: &[Vec<u8>]) -> Vec<u8> {
    all[0][33..].to_vec()
}

fn connect_abstract(name: &[u8]) -> std::io::Result<UnixStream> {
    use std::os::linux::net::SocketAddrExt;
    UnixStream::connect_addr(&std::os::unix::net::SocketAddr::from_abstract_name(name)?)
}

/// Sets up `world` ranks as threads over `communicator_over` (the processes' code path), rank 1's bootstrap
/// hooked: each rank's setup result and the slowest setup's time.
fn hooked_setup(
    world: usize,
    hook: impl FnOnce(&mut Vec<Vec<u8>>) + Send + 'static,
) -> (Vec<anyccl_core::Result<Communicator<ProcessComm>>>, Duration) {
    let group = LocalGroup::new(world, LONG);
    let opts = HostOptions { timeout: LONG, ..HostOptions::default() };
    let t = Instant::now();
    let mut hook = Some(hook);
    let results = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let inner = group.member(r);
                let boot: Box<dyn Bootstrap + Send> = match (r, hook.take()) {
                    (1, Some(h)) => Box::new(Hook { inner, hook: Some(h) }),
                    (_, h) => {
                        hook = h;
                        Box::new(inner)
                    }
                };
                let opts = opts.clone();
                s.spawn(move || communicator_over(boot, opts))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    (results, t.elapsed())
}

/// Silent connections, and one that drips its hello a byte at a time, wait on rank 0's mesh socket when rank 1
/// connects: the setup ends as soon as the real ranks are there (each pending connection has its own deadline
/// and costs the others nothing), far within the 60 s timeout, and the communicators work.
#[test]
fn silent_and_dripping_mesh_connections_do_not_stall_setup() {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let (results, took) = hooked_setup(3, move |all| {
        let name = name_of_rank_0(all);
        let mut silent: Vec<UnixStream> = (0..8).map(|_| connect_abstract(&name).expect("connect")).collect();
        let drip = connect_abstract(&name).expect("connect");
        std::thread::spawn(move || {
            let mut drip = drip;
            for _ in 0..40 {
                if stop2.load(std::sync::atomic::Ordering::Relaxed)
                    || std::io::Write::write_all(&mut drip, b"x").is_err()
                {
                    break;
                }
                std::thread::sleep(Duration::from_millis(250));
            }
        });
        // A connection that claims rank 2 with a wrong token, and one that hangs up half-way.
        let mut liar = connect_abstract(&name).expect("connect");
        let mut hello = 2u64.to_le_bytes().to_vec();
        hello.extend_from_slice(&[0u8; 32]);
        std::io::Write::write_all(&mut liar, &hello).expect("hello");
        let mut half = connect_abstract(&name).expect("connect");
        std::io::Write::write_all(&mut half, &hello[..5]).expect("half");
        drop(half);
        silent.push(liar);
        // Keep them open past the setup.
        std::mem::forget(silent);
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    eprintln!("3 ranks set up in {took:?} with 11 hostile connections on rank 0's mesh socket");
    assert!(took < PROMPT, "setup took {took:?}");
    let want = expected(3);
    let mut comms: Vec<_> = results.into_iter().map(|r| r.expect("the real ranks form the communicator")).collect();
    std::thread::scope(|s| {
        for c in comms.iter_mut() {
            let want = &want;
            s.spawn(move || assert_eq!(all_reduce_sample(c).expect("all-reduce"), *want));
        }
    });
}

/// As a lying rank 0 would, rank 0's mesh address is replaced by the path of a listening socket: rank 1 refuses to
/// connect (a rank connects only to anyccl mesh names), every rank fails at once with the reason, and the socket
/// never saw a connection.
#[test]
fn a_forged_socket_path_is_refused_and_every_rank_hears_why() {
    let dir = tempfile::tempdir().expect("tempdir");
    let target = dir.path().join("victim.sock");
    let listener = UnixListener::bind(&target).expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let forged: Vec<Vec<u8>> = vec![
        target.as_os_str().as_encoded_bytes().to_vec(),
        b"anyccl-host-mesh-0-../../x".to_vec(),
        b"anyccl-host-mesh-1-0123456789abcdef0123456789abcdef".to_vec(),
        b"anyccl-host-mesh-0-0123456789abcdef0123456789abcdeg".to_vec(),
        b"anyccl-host-mesh-0-0123456789ABCDEF0123456789ABCDEF".to_vec(),
        b"anyccl-host-mesh-0-0123456789abcdef0123456789abcdef0".to_vec(),
    ];
    for name in forged {
        let shown = String::from_utf8_lossy(&name).into_owned();
        let (results, took) = hooked_setup(3, move |all| {
            all[0].truncate(33);
            all[0].extend_from_slice(&name);
        });
        assert!(took < PROMPT, "{shown}: setup took {took:?}");
        for (r, res) in results.into_iter().enumerate() {
            let e = res.err().unwrap_or_else(|| panic!("{shown}: rank {r} formed a communicator"));
            let w = e.to_string();
            assert!(w.contains("not an anyccl mesh socket of rank 0"), "{shown}: rank {r}: {w}");
        }
        assert!(listener.accept().is_err(), "{shown}: the forged socket got a connection");
    }
}

/// This test binary, copied where uid 65534 may run it.
fn binary_for_nobody() -> (tempfile::TempDir, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let bin = dir.path().join("hostile-test");
    std::fs::copy(std::env::current_exe().expect("test binary"), &bin).expect("copy");
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    (dir, bin)
}

/// This test binary's `nobody` case run as uid/gid 65534 (`setpriv`, no supplementary groups): `what` (`listen` or
/// `connect`) on the abstract socket `name`.
fn as_nobody(bin: &Path, what: &str, name: &str) -> Child {
    Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(bin)
        .args(["nobody", "--exact", "--ignored", "--nocapture", "--test-threads=1", "-q"])
        .env_clear()
        .env("ANYCCL_HOSTILE_NOBODY", what)
        .env("ANYCCL_HOSTILE_NAME", name)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("setpriv runs")
}

/// The other user's side, run through `setpriv` by the tests below: `listen` prints `LISTENING`, accepts one
/// connection and prints `GOT n` with the bytes it received within 3 s; `connect` sends a well-formed hello
/// claiming rank 2 and prints `CLOSED` when the other end closes the connection, `OPEN` when it does not.
#[test]
#[ignore = "run as another user by the tests of this file"]
fn nobody() {
    use std::io::Write;
    use std::os::linux::net::SocketAddrExt;
    assert!(!rustix::process::getuid().is_root(), "the child must run as another user");
    let what = std::env::var("ANYCCL_HOSTILE_NOBODY").expect("a case");
    let name = std::env::var("ANYCCL_HOSTILE_NAME").expect("a name");
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).expect("name");
    match what.as_str() {
        "listen" => {
            let l = UnixListener::bind_addr(&addr).expect("listen");
            println!("LISTENING");
            std::io::stdout().flush().expect("flush");
            l.set_nonblocking(true).expect("nonblocking");
            let t = Instant::now();
            let mut s = loop {
                match l.accept() {
                    Ok((s, _)) => break s,
                    Err(_) if t.elapsed() < Duration::from_secs(30) => std::thread::sleep(Duration::from_millis(5)),
                    Err(e) => panic!("no connection: {e}"),
                }
            };
            s.set_nonblocking(false).expect("blocking");
            s.set_read_timeout(Some(Duration::from_secs(3))).expect("timeout");
            let mut buf = [0u8; 100];
            println!("GOT {}", s.read(&mut buf).unwrap_or(0));
        }
        "connect" => {
            let mut s = UnixStream::connect_addr(&addr).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
            let t = Instant::now();
            let mut hello = 2u64.to_le_bytes().to_vec();
            hello.extend_from_slice(&[0u8; 32]);
            let mut buf = [0u8; 100];
            let closed = match s.write_all(&hello) {
                Err(_) => true,
                Ok(()) => match s.read(&mut buf) {
                    Ok(0) => true,
                    Ok(_) => false,
                    Err(e) => matches!(e.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe),
                },
            };
            println!("{} {:?}", if closed { "CLOSED" } else { "OPEN" }, t.elapsed());
        }
        other => panic!("unknown case {other}"),
    }
}

fn wait_output(mut child: Child) -> String {
    let t = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        assert!(t.elapsed() < DEADLINE, "the other uid's process hung");
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().expect("output");
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn require_root() {
    assert!(
        rustix::process::getuid().is_root(),
        "this test needs root (to start a process of another user through setpriv); CI runs the tests as root"
    );
}

/// Another uid listens on a well-formed mesh name and a lying rank 0 points rank 1 at it: rank 1 checks the
/// listener's credentials and refuses before writing a byte; every rank fails at once.
#[test]
fn a_mesh_socket_of_another_uid_is_refused_before_anything_is_written() {
    require_root();
    // Well-formed, and this run's own (pid and time).
    let stamp = u128::from(std::process::id()) << 64
        | u128::from(std::time::UNIX_EPOCH.elapsed().expect("time").subsec_nanos());
    let name: &'static str = Box::leak(format!("anyccl-host-mesh-0-{stamp:032x}").into_boxed_str());
    let (_bin_dir, bin) = binary_for_nobody();
    let mut nobody = as_nobody(&bin, "listen", name);
    // The test harness prints its own lines first: read up to the listener's.
    let mut seen = String::new();
    let mut out = nobody.stdout.take().expect("stdout");
    let mut b = [0u8; 1];
    while !seen.lines().any(|l| l.trim() == "LISTENING") {
        if out.read(&mut b).expect("read") == 0 {
            panic!("the listener did not start: {seen}{}", wait_output(nobody));
        }
        seen.push(b[0] as char);
    }
    let (results, took) = hooked_setup(3, move |all| {
        all[0].truncate(33);
        all[0].extend_from_slice(name.as_bytes());
    });
    assert!(took < PROMPT, "setup took {took:?}");
    for (r, res) in results.into_iter().enumerate() {
        let w = res.err().unwrap_or_else(|| panic!("rank {r} formed a communicator")).to_string();
        assert!(w.contains("runs as uid 65534"), "rank {r}: {w}");
    }
    let mut rest = String::new();
    out.read_to_string(&mut rest).expect("read");
    nobody.stdout = None;
    let tail = wait_output(nobody);
    assert!(rest.contains("GOT 0"), "the other uid's socket received bytes: {rest}{tail}");
}

/// Another uid connects to rank 0's mesh socket (its name is in `/proc/net/unix` for every local user) and sends a
/// well-formed hello: the connection is closed at once, unread, and the real ranks form the communicator.
#[test]
fn a_mesh_connection_from_another_uid_is_closed_at_once() {
    require_root();
    let (_bin_dir, bin) = binary_for_nobody();
    let outputs = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = outputs.clone();
    let (results, took) = hooked_setup(3, move |all| {
        let name = String::from_utf8(name_of_rank_0(all)).expect("utf-8 name");
        sink.lock().expect("lock").push(wait_output(as_nobody(&bin, "connect", &name)));
    });
    assert!(took < PROMPT, "setup took {took:?}");
    let out = outputs.lock().expect("lock").join("");
    assert!(out.lines().any(|l| l.starts_with("CLOSED")), "the other uid's connection was not closed at once: {out}");
    for (r, res) in results.into_iter().enumerate() {
        assert!(res.is_ok(), "rank {r}: {:?}", res.err());
    }
}
