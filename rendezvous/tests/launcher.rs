//! Ranks started the way `torchrun` starts them. torchrun's agent listens on `MASTER_PORT` itself (its TCP store,
//! which the workers join) and hands every worker `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and
//! `MASTER_PORT`. A rank 0 that binds exactly `MASTER_PORT` then fails with EADDRINUSE while the other ranks talk to
//! the agent's store (found on an H200 under the real torchrun). This stand-in launcher holds `MASTER_PORT` as the
//! agent does, starts one process per rank (this test binary again, test `rank`) with those variables, and checks
//! that the ranks form their group beside it — on `MASTER_PORT + 1`, or on `ANYCCL_MASTER_PORT` — and that none
//! of them knocked on the launcher's port.

use anyccl_testkit::launcher;

use std::io::ErrorKind;
use std::net::{Ipv4Addr, TcpListener};
use std::time::{Duration, Instant};

use launcher::hold_master_port;

use anyccl_rendezvous::{Rendezvous, RendezvousConfig};

/// A rank that has not finished by then is taken as hung.
const DEADLINE: Duration = Duration::from_secs(30);

/// Starts `world` ranks with torchrun's variables (and `extra`), and returns each one's `RESULT` line.
fn launch(world: usize, master_port: u16, extra: &[(&str, String)]) -> Vec<String> {
    let mut env = vec![("ANYCCL_LAUNCHER_CHILD", "1".to_owned()), ("ANYCCL_RENDEZVOUS_TIMEOUT_SECS", "20".to_owned())];
    env.extend(extra.iter().cloned());
    let start = Instant::now();
    let children = launcher::start_ranks(world, master_port, &env);
    children
        .into_iter()
        .enumerate()
        .map(|(r, c)| launcher::result_line(r, &launcher::finish(r, c, start, DEADLINE)))
        .collect()
}

/// Whether anyone connected to the launcher's port.
fn knocked(held: &TcpListener) -> bool {
    held.set_nonblocking(true).expect("nonblocking");
    match held.accept() {
        Ok(_) => true,
        Err(e) if e.kind() == ErrorKind::WouldBlock => false,
        Err(e) => panic!("accept on the launcher's port: {e}"),
    }
}

fn expected(world: usize, port: u16) -> Vec<String> {
    let all: Vec<String> = (0..world).map(|r| format!("rank {r}")).collect();
    (0..world).map(|r| format!("rank {r} of {world} on port {port}: {}", all.join(","))).collect()
}

#[test]
fn ranks_started_like_torchrun_form_their_group_beside_the_launchers_port() {
    let held = hold_master_port();
    let port = held.local_addr().expect("addr").port();
    assert_eq!(launch(3, port, &[]), expected(3, port + 1));
    assert!(!knocked(&held), "a rank connected to MASTER_PORT, which belongs to the launcher");
}

#[test]
fn anyccl_master_port_names_the_rendezvous_port() {
    let held = hold_master_port();
    let port = held.local_addr().expect("addr").port();
    // a free port for the rendezvous, named explicitly
    let own = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind").local_addr().expect("addr").port();
    assert_eq!(launch(2, port, &[("ANYCCL_MASTER_PORT", own.to_string())]), expected(2, own));
    assert!(!knocked(&held), "a rank connected to MASTER_PORT, which belongs to the launcher");
}

/// The rank half: reads torchrun's variables, joins the group, all-gathers its name and prints what it got.
#[test]
#[ignore = "one rank of the launcher tests, which start it with torchrun's variables"]
fn rank() {
    assert!(std::env::var_os("ANYCCL_LAUNCHER_CHILD").is_some(), "run by the launcher tests");
    let cfg = RendezvousConfig::from_env().expect("torchrun's variables");
    let port = cfg.master.port();
    let mut group = Rendezvous::establish(cfg).expect("the group forms");
    let me = format!("rank {}", group.rank());
    let all = group.all_gather(me.as_bytes()).expect("all-gather");
    let all: Vec<String> = all.iter().map(|b| String::from_utf8_lossy(b).into_owned()).collect();
    println!("RESULT {me} of {} on port {port}: {}", group.world(), all.join(","));
}
