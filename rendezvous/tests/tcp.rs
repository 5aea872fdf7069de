//! The TCP rendezvous through its public API, ranks as threads on 127.0.0.1 (port 0, never a fixed port).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::thread;
use std::time::{Duration, Instant};

use anyccl_core::{Error, InvalidArgument};
use anyccl_rendezvous::{JobKey, Rendezvous, RendezvousConfig};

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().expect("addr")
}

/// Forms a group of `world` ranks (rank 0 on this thread's listener, every rank on its own thread) and runs `f`
/// on each; returns the results by rank.
fn run_group<T: Send + 'static>(
    world: usize,
    timeout: Duration,
    f: impl Fn(&mut Rendezvous) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let listener =
        Rendezvous::listen(RendezvousConfig::new(0, world, any_port()).with_timeout(timeout)).expect("listen");
    let clients: Vec<_> = (1..world)
        .map(|rank| {
            let cfg = listener.client_config(rank);
            let f = f.clone();
            thread::spawn(move || {
                let mut g = Rendezvous::connect(cfg).expect("connect");
                assert_eq!((g.rank(), g.world()), (rank, world));
                f(&mut g)
            })
        })
        .collect();
    let root = thread::spawn(move || {
        let mut g = listener.accept_all().expect("accept_all");
        f(&mut g)
    });
    let mut out = vec![root.join().expect("rank 0 thread")];
    out.extend(clients.into_iter().map(|h| h.join().expect("rank thread")));
    out
}

#[test]
fn all_gather_broadcast_barrier_in_worlds_1_to_4() {
    for world in 1..=4 {
        let results = run_group(world, Duration::from_secs(10), move |g| {
            let me = g.rank();
            // distinct data of distinct lengths per rank, over several rounds
            let mut gathered = Vec::new();
            for round in 0..3u8 {
                let data: Vec<u8> = (0..=me).map(|i| round * 100 + me as u8 * 10 + i as u8).collect();
                gathered.push(g.all_gather(&data).expect("all_gather"));
            }
            let mut bcasts = Vec::new();
            for root in 0..g.world() {
                let id = format!("unique id from rank {root}").into_bytes();
                let mine = (me == root).then_some(id.as_slice());
                bcasts.push(g.broadcast(root, mine).expect("broadcast"));
            }
            g.barrier().expect("barrier");
            let empty = g.all_gather(&[]).expect("empty all_gather");
            (gathered, bcasts, empty)
        });
        for (rank, (gathered, bcasts, empty)) in results.iter().enumerate() {
            for (round, all) in gathered.iter().enumerate() {
                assert_eq!(all.len(), world, "world {world} rank {rank}");
                for (r, d) in all.iter().enumerate() {
                    let want: Vec<u8> = (0..=r).map(|i| (round * 100 + r * 10 + i) as u8).collect();
                    assert_eq!(d, &want, "world {world}, rank {rank} sees rank {r}'s data");
                }
            }
            for (root, b) in bcasts.iter().enumerate() {
                assert_eq!(b, format!("unique id from rank {root}").as_bytes());
            }
            assert_eq!(empty, &vec![Vec::<u8>::new(); world]);
        }
    }
}

#[test]
fn ncclunique_id_sized_blobs_and_max_message() {
    let results = run_group(3, Duration::from_secs(10), |g| {
        let id = [g.rank() as u8; 128];
        let ids = g.all_gather(&id).expect("128-byte ids");
        let big = vec![7u8; 1 << 20];
        let bcast = g.broadcast(2, (g.rank() == 2).then_some(big.as_slice())).expect("1 MiB broadcast");
        (ids, bcast.len())
    });
    for (ids, n) in results {
        assert_eq!(ids, vec![vec![0u8; 128], vec![1u8; 128], vec![2u8; 128]]);
        assert_eq!(n, 1 << 20);
    }
}

#[test]
fn local_argument_errors_send_nothing() {
    let results = run_group(2, Duration::from_secs(10), |g| {
        let bad_root = g.broadcast(5, Some(b"x")).expect_err("root out of range");
        assert!(matches!(
            bad_root,
            Error::InvalidArgument(InvalidArgument::RankOutOfRange { what: "root", rank: 5, world: 2 })
        ));
        if g.rank() == 1 {
            let e = g.broadcast(1, None).expect_err("root without data");
            assert!(e.to_string().contains("is the root but passed no data"), "{e}");
        }
        let too_big = vec![0u8; (1 << 20) + 1];
        let e = g.all_gather(&too_big).expect_err("over max_message");
        assert!(e.to_string().contains("exceeds max_message"), "{e}");
        // nothing was sent, so the group still works
        g.all_gather(&[g.rank() as u8]).expect("all_gather after local errors")
    });
    assert_eq!(results, vec![vec![vec![0], vec![1]]; 2]);
}

#[test]
fn missing_peers_time_out_naming_them() {
    // long enough for rank 1's thread to start and prove itself on a loaded machine (2 cores, debug build), so the
    // verdict names exactly the ranks that never came
    let timeout = Duration::from_secs(2);
    let listener = Rendezvous::listen(RendezvousConfig::new(0, 4, any_port()).with_timeout(timeout)).expect("listen");
    // rank 1 waits longer than rank 0, so it hears rank 0's verdict rather than timing out itself
    let cfg1 = listener.client_config(1).with_timeout(Duration::from_secs(10));
    let start = Instant::now();
    let root = thread::spawn(move || listener.accept_all());
    let client = thread::spawn(move || Rendezvous::connect(cfg1));
    let err = root.join().expect("root").expect_err("ranks 2 and 3 never come");
    assert!(start.elapsed() < Duration::from_secs(8), "took {:?}", start.elapsed());
    match &err {
        Error::Timeout { what, after } => {
            assert_eq!(*after, timeout);
            assert!(what.starts_with("ranks 2, 3 to join the rendezvous"), "{what}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    // rank 1 joined and is told why the group was abandoned
    let e1 = client.join().expect("client").expect_err("group never formed");
    assert!(matches!(e1, Error::PeerFailure(_) | Error::Timeout { .. }), "{e1:?}");
    assert!(e1.to_string().contains("ranks 2, 3"), "{e1}");
}

#[test]
fn client_without_rank_0_times_out() {
    // a port that nobody listens on: bind, learn it, close
    let addr = std::net::TcpListener::bind(any_port()).expect("bind").local_addr().expect("addr");
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    let cfg = RendezvousConfig::new(1, 2, addr).with_timeout(timeout).with_key(JobKey::random().expect("key"));
    let err = Rendezvous::connect(cfg).expect_err("no rank 0");
    assert!(start.elapsed() < Duration::from_secs(3), "took {:?}", start.elapsed());
    match err {
        Error::Timeout { what, after } => {
            assert_eq!(after, timeout);
            assert!(what.contains("rank 0 to accept a connection"), "{what}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
}

#[test]
fn rank_0_may_start_after_the_others() {
    // learn a free port, then start rank 1 first: it retries until rank 0 listens
    let addr = std::net::TcpListener::bind(any_port()).expect("bind").local_addr().expect("addr");
    let key = JobKey::from_secret(b"a secret both ranks were given");
    let cfg0 = RendezvousConfig::new(0, 2, addr).with_timeout(Duration::from_secs(10)).with_key(key);
    let cfg1 = RendezvousConfig { rank: 1, ..cfg0.clone() };
    let client = thread::spawn(move || Rendezvous::connect(cfg1).and_then(|mut g| g.all_gather(b"one")));
    thread::sleep(Duration::from_millis(150));
    let mut g0 = Rendezvous::establish(cfg0).expect("rank 0");
    assert_eq!(g0.all_gather(b"zero").expect("gather"), vec![b"zero".to_vec(), b"one".to_vec()]);
    assert_eq!(client.join().expect("client").expect("rank 1"), vec![b"zero".to_vec(), b"one".to_vec()]);
}

#[test]
fn a_rejected_client_is_told_only_that_it_was_rejected() {
    let secret = b"the job's secret, 0123456789abcdef";
    let key = JobKey::from_secret(secret);
    let listener = Rendezvous::listen(
        RendezvousConfig::new(0, 2, any_port()).with_timeout(Duration::from_secs(20)).with_key(key.clone()),
    )
    .expect("listen");
    let good = listener.client_config(1);
    let wrong_key = listener.client_config(1).with_key(JobKey::from_secret(b"not the job's secret at all"));
    let root = thread::spawn(move || listener.accept_all());
    let e = Rendezvous::connect(wrong_key).expect_err("wrong key");
    assert!(matches!(e, Error::PeerFailure(_)), "{e:?}");
    let text = e.to_string();
    assert!(text.contains("rejected rank 1"), "{text}");
    // the peer learns nothing about rank 0's world size or key
    assert!(!text.contains("world size 2") && !text.contains("rank 0 has"), "{text}");
    assert!(!text.contains(std::str::from_utf8(secret).expect("utf8")), "{text}");
    let _g1 = Rendezvous::connect(good).expect("the real rank 1");
    let g0 = root.join().expect("root").expect("rank 0 survived the rejection");
    // rank 0's own record says why
    let record = g0.rejections();
    assert_eq!(record.count(), 1, "{record}");
    assert!(record.first()[0].contains("did not prove it holds the job key"), "{record}");
}

/// A rank that holds the key but has another world size: the job cannot form, and both it and rank 0 say why at
/// once (a typed error), instead of rank 0 waiting out its timeout.
#[test]
fn a_key_holder_with_another_world_size_ends_the_job_at_once_with_the_reason() {
    let key = JobKey::from_secret(b"the job's secret, 0123456789abcdef");
    let timeout = Duration::from_secs(120);
    let listener = Rendezvous::listen(RendezvousConfig::new(0, 2, any_port()).with_timeout(timeout).with_key(key))
        .expect("listen");
    let wrong_world = RendezvousConfig { world: 3, ..listener.client_config(1) };
    let started = std::time::Instant::now();
    let root = thread::spawn(move || listener.accept_all());
    match Rendezvous::connect(wrong_world) {
        Err(Error::InvalidArgument(InvalidArgument::BadWorld(m))) => {
            assert!(m.contains("has world size 3, rank 0 has 2"), "{m}")
        }
        other => panic!("expected the reason, got {other:?}"),
    }
    match root.join().expect("root") {
        Err(Error::InvalidArgument(InvalidArgument::BadWorld(m))) => assert!(m.contains("cannot form"), "{m}"),
        other => panic!("rank 0 must give up with the reason, got {other:?}"),
    }
    assert!(started.elapsed() < timeout / 2, "{:?}", started.elapsed());
}

/// Ranks that connect only after rank 0 found that the job cannot form are told why as they prove the key, instead
/// of finding nobody listening and waiting out their timeout; a connection without the key learns nothing.
#[test]
fn ranks_that_connect_after_the_job_cannot_form_are_told_why_at_once() {
    let key = JobKey::from_secret(b"the job's secret, 0123456789abcdef");
    let timeout = Duration::from_secs(20);
    let listener =
        Rendezvous::listen(RendezvousConfig::new(0, 3, any_port()).with_timeout(timeout).with_key(key.clone()))
            .expect("listen");
    let (c1, c2) = (listener.client_config(1), listener.client_config(2));
    let wrong_world = RendezvousConfig { world: 4, ..listener.client_config(2) };
    let stranger = listener.client_config(2).with_key(JobKey::from_secret(b"not the job's secret at all"));
    let started = Instant::now();
    let root = thread::spawn(move || listener.accept_all());
    // the contradiction comes first: when this returns, rank 0 has found that the job cannot form
    match Rendezvous::connect(wrong_world) {
        Err(Error::InvalidArgument(InvalidArgument::BadWorld(m))) => {
            assert!(m.contains("has world size 4, rank 0 has 3"), "{m}")
        }
        other => panic!("expected the reason, got {other:?}"),
    }
    // a connection without the key, after the contradiction: only "rejected", not the reason
    let e = Rendezvous::connect(stranger).expect_err("no key");
    let text = e.to_string();
    assert!(matches!(e, Error::PeerFailure(_)) && text.contains("rejected rank 2"), "{e:?}");
    assert!(!text.contains("cannot form") && !text.contains("world size 4"), "{text}");
    // the real ranks 1 and 2 connect late: each hears the reason as it proves the key
    let late: Vec<_> = [c1, c2]
        .into_iter()
        .map(|cfg| {
            thread::spawn(move || {
                let t = Instant::now();
                (Rendezvous::connect(cfg).map(|_| ()), t.elapsed())
            })
        })
        .collect();
    for (rank, h) in (1..).zip(late) {
        let (result, took) = h.join().expect("late rank");
        match result {
            Err(Error::InvalidArgument(InvalidArgument::BadWorld(m))) => {
                assert!(m.contains("the job cannot form") && m.contains("has world size 4, rank 0 has 3"), "{m}")
            }
            other => panic!("rank {rank} must be told why the job cannot form, got {other:?}"),
        }
        // generous for a loaded machine, and far below the 20 s it would otherwise wait
        assert!(took < timeout / 2, "rank {rank} took {took:?}");
    }
    match root.join().expect("root") {
        Err(Error::InvalidArgument(InvalidArgument::BadWorld(m))) => assert!(m.contains("has world size 4"), "{m}"),
        other => panic!("rank 0 must give up with the reason, got {other:?}"),
    }
    // rank 0 gives up well before its timeout too (it stops listening once every rank of the job was told)
    assert!(started.elapsed() < timeout / 2, "{:?}", started.elapsed());
}

#[test]
fn a_peer_that_dies_mid_collective_fails_the_others_fast() {
    let timeout = Duration::from_secs(10);
    let listener = Rendezvous::listen(RendezvousConfig::new(0, 3, any_port()).with_timeout(timeout)).expect("listen");
    let (c1, c2) = (listener.client_config(1), listener.client_config(2));
    let r1 = thread::spawn(move || {
        let mut g = Rendezvous::connect(c1)?;
        g.barrier()?;
        g.all_gather(b"rank 1")
    });
    let r2 = thread::spawn(move || {
        let mut g = Rendezvous::connect(c2)?;
        g.barrier()?;
        drop(g); // dies instead of calling all_gather
        Ok::<_, Error>(())
    });
    let mut g0 = listener.accept_all().expect("accept_all");
    g0.barrier().expect("barrier");
    r2.join().expect("r2").expect("rank 2");
    let start = Instant::now();
    let e0 = g0.all_gather(b"rank 0").expect_err("rank 2 is gone");
    let e1 = r1.join().expect("r1").expect_err("rank 1 must learn of it");
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    assert!(matches!(e0, Error::PeerFailure(_)), "{e0:?}");
    assert!(e0.to_string().contains("rank 2 closed the connection during all_gather #1"), "{e0}");
    assert!(matches!(e1, Error::PeerFailure(_)), "{e1:?}");
    assert!(e1.to_string().contains("rank 2 closed the connection"), "{e1}");
    // the group stays broken
    let again = g0.barrier().expect_err("broken");
    assert!(again.to_string().contains("unusable after an earlier failure"), "{again}");
}

#[test]
fn a_dead_rank_0_fails_the_client() {
    let listener =
        Rendezvous::listen(RendezvousConfig::new(0, 2, any_port()).with_timeout(Duration::from_secs(10))).expect("l");
    let c1 = listener.client_config(1);
    let root = thread::spawn(move || listener.accept_all());
    let mut g1 = Rendezvous::connect(c1).expect("connect");
    drop(root.join().expect("root").expect("group"));
    let start = Instant::now();
    let e = g1.all_gather(b"x").expect_err("rank 0 is gone");
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(e.to_string().contains("rank 0 closed the connection"), "{e}");
}

#[test]
fn a_slow_peer_times_out() {
    // the group forms under a generous timeout; only the barrier gets the short one
    let listener = Rendezvous::listen(RendezvousConfig::new(0, 2, any_port()).with_timeout(Duration::from_secs(10)))
        .expect("listen");
    let c1 = listener.client_config(1);
    let root = thread::spawn(move || listener.accept_all());
    let g1 = Rendezvous::connect(c1).expect("connect");
    let mut g0 = root.join().expect("root").expect("group");
    g0.set_timeout(Duration::from_millis(300));
    let e = g0.barrier().expect_err("rank 1 never calls barrier");
    match e {
        Error::Timeout { what, .. } => assert!(what.contains("rank 1 during barrier #0"), "{what}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    drop(g1);
}

#[test]
fn wrong_roles_are_refused() {
    let e = Rendezvous::listen(RendezvousConfig::new(1, 2, any_port())).expect_err("rank 1 cannot listen");
    assert!(matches!(e, Error::InvalidArgument(InvalidArgument::BadWorld(_))), "{e:?}");
    let e = Rendezvous::connect(RendezvousConfig::new(0, 2, any_port())).expect_err("rank 0 cannot connect");
    assert!(matches!(e, Error::InvalidArgument(InvalidArgument::BadWorld(_))), "{e:?}");
    let e = Rendezvous::establish(RendezvousConfig::new(2, 2, any_port())).expect_err("rank 2 of 2");
    assert!(e.to_string().contains("out of range"), "{e}");
}

// ---- configuration from the environment ----

fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<std::ffi::OsString> {
    let mut map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    // the per-user key of loopback jobs lives in a directory of this test process's own
    let runtime = std::env::temp_dir().join(format!("anyccl-tcp-test-{}", std::process::id()));
    map.entry("XDG_RUNTIME_DIR".into()).or_insert_with(|| runtime.to_string_lossy().into_owned());
    move |name| map.get(name).cloned().map(Into::into)
}

fn config_error(vars: &[(&str, &str)]) -> (String, String) {
    match RendezvousConfig::from_env_with(&env(vars)) {
        Err(Error::Config { source_name, line: None, message }) => (source_name, message),
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn from_env_torchrun() {
    let cfg = RendezvousConfig::from_env_with(&env(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
        // torchrun wins over Slurm
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "16"),
        ("SLURM_LOCALID", "0"),
    ]))
    .expect("torchrun config");
    assert_eq!((cfg.rank, cfg.world, cfg.local_rank), (3, 8, Some(1)));
    // torchrun's agent holds MASTER_PORT: the rendezvous listens one port above
    assert_eq!(cfg.master, "127.0.0.1:29501".parse::<SocketAddr>().expect("addr"));
    assert_eq!(cfg.timeout, anyccl_rendezvous::config::DEFAULT_TIMEOUT);
    assert_eq!(cfg.max_message, 1 << 20);
    // no secret set and a loopback MASTER_ADDR: this user's per-user key
    let runtime = std::env::temp_dir().join(format!("anyccl-tcp-test-{}", std::process::id()));
    let user = anyccl_rendezvous::userkey::load_or_create(&runtime).expect("user key");
    assert_eq!(cfg.key, Some(JobKey::per_user(&user, "127.0.0.1", 29501)));
}

#[test]
fn from_env_slurm_with_options() {
    let cfg = RendezvousConfig::from_env_with(&env(&[
        ("SLURM_PROCID", "2"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_LOCALID", "2"),
        ("MASTER_ADDR", "localhost"),
        ("MASTER_PORT", "12345"),
        ("ANYCCL_RENDEZVOUS_TIMEOUT_SECS", "0.3"),
        ("ANYCCL_RENDEZVOUS_KEY", "job-42 0123456789abcdef"),
    ]))
    .expect("slurm config");
    assert_eq!((cfg.rank, cfg.world, cfg.local_rank), (2, 4, Some(2)));
    assert!(cfg.master.ip().is_loopback() && cfg.master.port() == 12346, "{}", cfg.master);
    assert_eq!(cfg.timeout, Duration::from_millis(300));
    let other_job = RendezvousConfig::from_env_with(&env(&[
        ("SLURM_PROCID", "2"),
        ("SLURM_NTASKS", "4"),
        ("MASTER_ADDR", "localhost"),
        ("MASTER_PORT", "12345"),
        ("ANYCCL_RENDEZVOUS_KEY", "job-43 0123456789abcdef"),
    ]))
    .expect("config");
    assert_ne!(cfg.key, other_job.key);
    assert_eq!(cfg.key, Some(JobKey::from_secret(b"job-42 0123456789abcdef")));
    assert_eq!(other_job.local_rank, None);
}

#[test]
fn from_env_errors_name_the_variable() {
    let base = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
    let with = |k: &'static str, v: &'static str| -> Vec<(&str, &str)> {
        base.iter().copied().filter(|(n, _)| *n != k).chain(std::iter::once((k, v))).collect()
    };
    let without = |k: &str| -> Vec<(&str, &str)> { base.iter().copied().filter(|(n, _)| *n != k).collect() };

    let (var, msg) = config_error(&with("WORLD_SIZE", "two"));
    assert_eq!(var, "WORLD_SIZE");
    assert!(msg.contains("'two' is not a world size"), "{msg}");
    // a malformed WORLD_SIZE is not silently replaced by Slurm's value
    let mut v = with("WORLD_SIZE", "-1");
    v.push(("SLURM_NTASKS", "2"));
    assert_eq!(config_error(&v).0, "WORLD_SIZE");
    assert_eq!(config_error(&with("WORLD_SIZE", "0")).0, "WORLD_SIZE");

    let (var, msg) = config_error(&with("RANK", "2"));
    assert_eq!(var, "RANK");
    assert!(msg.contains("rank 2 is out of range for WORLD_SIZE=2"), "{msg}");
    assert_eq!(config_error(&with("RANK", "x")).0, "RANK");

    let (var, msg) = config_error(&without("RANK"));
    assert_eq!(var, "RANK");
    assert!(msg.contains("SLURM_PROCID"), "{msg}");
    assert_eq!(config_error(&without("WORLD_SIZE")).0, "WORLD_SIZE");
    assert_eq!(config_error(&without("MASTER_ADDR")).0, "MASTER_ADDR");
    assert_eq!(config_error(&without("MASTER_PORT")).0, "MASTER_PORT");
    assert_eq!(config_error(&with("MASTER_PORT", "70000")).0, "MASTER_PORT");
    // MASTER_PORT + 1 must exist, and ANYCCL_MASTER_PORT, when set, is the port and is checked the same way
    let (var, msg) = config_error(&with("MASTER_PORT", "65535"));
    assert!(var == "MASTER_PORT" && msg.contains("ANYCCL_MASTER_PORT"), "{var}: {msg}");
    let mut v = base.to_vec();
    v.push(("ANYCCL_MASTER_PORT", "0"));
    assert_eq!(config_error(&v).0, "ANYCCL_MASTER_PORT");
    let mut v = base.to_vec();
    v.push(("ANYCCL_MASTER_PORT", "40000"));
    assert_eq!(RendezvousConfig::from_env_with(&env(&v)).expect("own port").master.port(), 40000);
    let v: Vec<_> =
        base.iter().copied().filter(|(k, _)| *k != "MASTER_PORT").chain([("ANYCCL_MASTER_PORT", "40000")]).collect();
    assert_eq!(RendezvousConfig::from_env_with(&env(&v)).expect("no MASTER_PORT needed").master.port(), 40000);
    assert_eq!(config_error(&with("MASTER_ADDR", "no such host!")).0, "MASTER_ADDR");
    assert_eq!(config_error(&with("LOCAL_RANK", "first")).0, "LOCAL_RANK");

    let mut v = base.to_vec();
    v.push(("ANYCCL_RENDEZVOUS_TIMEOUT_SECS", "soon"));
    assert_eq!(config_error(&v).0, "ANYCCL_RENDEZVOUS_TIMEOUT_SECS");
    let mut v = base.to_vec();
    v.push(("ANYCCL_RENDEZVOUS_TIMEOUT_SECS", "0"));
    assert_eq!(config_error(&v).0, "ANYCCL_RENDEZVOUS_TIMEOUT_SECS");
    let mut v = base.to_vec();
    v.push(("ANYCCL_RENDEZVOUS_KEY", " "));
    assert_eq!(config_error(&v).0, "ANYCCL_RENDEZVOUS_KEY");
}

#[test]
fn env_configs_form_a_group() {
    // every rank reads the same variables but its own RANK; rank 0 binds port 0 only because tests never use a
    // fixed port, so the clients take the real port from the listener.
    let vars = |rank: &'static str| {
        env(&[("RANK", rank), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")])
    };
    let cfg0 = RendezvousConfig::from_env_with(&vars("0")).expect("cfg0");
    let cfg1 = RendezvousConfig::from_env_with(&vars("1")).expect("cfg1");
    assert_eq!(cfg0.key, cfg1.key);
    let listener = Rendezvous::listen(RendezvousConfig { master: any_port(), ..cfg0 }).expect("listen");
    let cfg1 = RendezvousConfig { master: listener.local_addr(), ..cfg1 };
    let client = thread::spawn(move || Rendezvous::connect(cfg1).and_then(|mut g| g.broadcast(0, None)));
    let mut g0 = listener.accept_all().expect("group");
    assert_eq!(g0.broadcast(0, Some(b"id")).expect("bcast"), b"id");
    assert_eq!(client.join().expect("client").expect("rank 1"), b"id");
}
