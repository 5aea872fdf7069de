//! A stand-in for `torchrun`, shared by the tests that start ranks the way it does: it
//! holds `MASTER_PORT` as torchrun's agent store does, and starts one process per rank (the calling test binary
//! again, its `#[ignore]`d test `rank`) with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT`.

use std::net::{Ipv4Addr, TcpListener};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The launcher's own listener on `MASTER_PORT`, at a port whose successor (the rendezvous's default port) is free
/// when checked (another process could still take it before rank 0 binds it; then the test fails loudly).
pub fn hold_master_port() -> TcpListener {
    for _ in 0..50 {
        let held = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind the launcher's port");
        let port = held.local_addr().expect("addr").port();
        if port < u16::MAX && TcpListener::bind((Ipv4Addr::LOCALHOST, port + 1)).is_ok() {
            return held;
        }
    }
    panic!("found no port whose successor is free in 50 tries");
}

/// A private directory of this test process (mode 0700) that its ranks get as `XDG_RUNTIME_DIR`.
pub fn runtime_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("anyccl-launcher-{}", std::process::id()));
    let mut builder = std::fs::DirBuilder::new();
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.recursive(true).create(&dir).expect("the ranks' runtime directory");
    dir
}

/// Starts `world` ranks (this test binary's test `rank`) with a cleared environment holding torchrun's variables,
/// `MASTER_PORT = master_port`, and `env`.
pub fn start_ranks(world: usize, master_port: u16, env: &[(&str, String)]) -> Vec<Child> {
    start_ranks_each(world, master_port, env, &|_| Vec::new())
}

/// [`start_ranks`], with variables of each rank's own on top (`per_rank(rank)`), as a launcher spanning hosts would
/// set them.
/// The variables that keep NVLink multicast off (NCCL, PyTorch, NVSHMEM), passed on to every rank when set.
const MULTICAST_OFF: [&str; 3] = ["NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"];

#[allow(dead_code)] // Not every suite that includes this file starts ranks with variables of their own.
pub fn start_ranks_each(
    world: usize,
    master_port: u16,
    env: &[(&str, String)],
    per_rank: &dyn Fn(usize) -> Vec<(&'static str, String)>,
) -> Vec<Child> {
    let exe = std::env::current_exe().expect("test binary");
    (0..world)
        .map(|rank| {
            let mut cmd = Command::new(&exe);
            cmd.args(["rank", "--exact", "--ignored", "--nocapture", "--test-threads=1", "-q"])
                .env_clear()
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", master_port.to_string())
                // torchrun passes its own environment on; of it, the ranks need the place of the per-user key
                // that a loopback job without a secret uses (one directory of this test's own, shared by its ranks)
                .env("XDG_RUNTIME_DIR", runtime_dir())
                // What keeps NVLink multicast off on shared machines travels with the ranks.
                .envs(MULTICAST_OFF.iter().filter_map(|k| std::env::var(k).ok().map(|v| (*k, v))))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env {
                cmd.env(k, v);
            }
            for (k, v) in per_rank(rank) {
                cmd.env(k, v);
            }
            cmd.spawn().expect("start a rank")
        })
        .collect()
}

/// Waits for `child` until `start + deadline`, killing it (and failing) then.
pub fn finish(rank: usize, mut child: Child, start: Instant, deadline: Duration) -> Output {
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            panic!("rank {rank} still ran after {deadline:?}");
        }
        // std has no wait with a deadline: poll the child's exit.
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().expect("output")
}

/// A rank's stdout and stderr, for failure messages.
pub fn text(out: &Output) -> String {
    format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// The `RESULT` line of a rank that must have succeeded.
pub fn result_line(rank: usize, out: &Output) -> String {
    assert!(out.status.success(), "rank {rank} failed ({}):\n{}", out.status, text(out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .unwrap_or_else(|| panic!("rank {rank} printed no RESULT:\n{}", text(out)))
        .to_owned()
}
