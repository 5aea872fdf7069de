//! Where the ranks run: one host or several. Paths that need every rank on one host (shared memory, IPC handles, the
//! custom kernels) check it through the bootstrap before they try anything, so a job that spans hosts gets the
//! reason ("ranks span 2 hosts: …") instead of a failed `open` or a hang.
//!
//! A rank's host identity is its host name and the kernel's boot id (`/proc/sys/kernel/random/boot_id`), so two
//! containers with different host names count as different hosts (they do not share `/dev/shm` or IPC either, as
//! a rule). `ANYCCL_HOST_ID` overrides it per rank: a job on one machine can then run as if on several, which is
//! how the decision is tested without a second machine.

use crate::bootstrap::{checked_all_gather, Bootstrap};
use crate::error::{Error, InvalidArgument, Result};

/// The variable that overrides this rank's host identity (tests, and launchers that know better).
pub const ENV_HOST_ID: &str = "ANYCCL_HOST_ID";

/// The longest host identity accepted, in bytes (an override, or a host name plus a boot id).
pub const MAX_HOST_ID: usize = 512;

/// This rank's host identity: `ANYCCL_HOST_ID` if set (1 to [`MAX_HOST_ID`] printable ASCII characters), else the
/// host name and the boot id. `env` reads a variable (the process environment in production).
pub fn local_host_id(env: &dyn Fn(&str) -> Option<String>) -> Result<String> {
    if let Some(v) = env(ENV_HOST_ID) {
        let ok = !v.is_empty() && v.len() <= MAX_HOST_ID && v.bytes().all(|b| b.is_ascii_graphic() || b == b' ');
        if !ok {
            return Err(InvalidArgument::BadWorld(format!(
                "{ENV_HOST_ID} must be 1 to {MAX_HOST_ID} printable ASCII characters ({} bytes given)",
                v.len()
            ))
            .into());
        }
        return Ok(v);
    }
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .ok()
            .map(|s| s.trim().chars().filter(|c| c.is_ascii_graphic()).take(256).collect())
    };
    let name: String = read("/proc/sys/kernel/hostname").unwrap_or_else(|| "unknown-host".to_owned());
    let boot: String = read("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    Ok(format!("{name} {boot}"))
}

/// Every rank's host identity, gathered through `bootstrap` (collective: every rank calls it).
pub fn gather_host_ids(bootstrap: &mut dyn Bootstrap, mine: &str) -> Result<Vec<String>> {
    let all = checked_all_gather(bootstrap, mine.as_bytes())?;
    all.into_iter()
        .enumerate()
        .map(|(rank, bytes)| {
            if bytes.is_empty() || bytes.len() > MAX_HOST_ID {
                return Err(Error::PeerFailure(format!("rank {rank} sent a host identity of {} bytes", bytes.len())));
            }
            String::from_utf8(bytes)
                .map_err(|_| Error::PeerFailure(format!("rank {rank} sent a host identity that is not UTF-8")))
        })
        .collect()
}

/// `Ok` when every rank is on one host; otherwise why not, naming how many hosts and the first rank on each
/// (identities are shown only by their host-name part, never the boot id).
pub fn one_host(ids: &[String]) -> std::result::Result<(), String> {
    let mut firsts: Vec<(usize, &str)> = Vec::new();
    for (rank, id) in ids.iter().enumerate() {
        if !firsts.iter().any(|(r, _)| ids[*r] == *id) {
            firsts.push((rank, id.split(' ').next().unwrap_or_default()));
        }
    }
    if firsts.len() <= 1 {
        return Ok(());
    }
    let shown: Vec<String> = firsts.iter().take(4).map(|(r, name)| format!("rank {r} on {name}")).collect();
    let more = if firsts.len() > 4 { ", …" } else { "" };
    Err(format!("ranks span {} hosts ({}{more})", firsts.len(), shown.join(", ")))
}

/// Gathers every rank's host identity and checks they are one host: `Ok(Err(why))` when they are not (the same
/// answer on every rank, from the same exchange), `Err` when the exchange itself failed.
pub fn check_one_host(
    bootstrap: &mut dyn Bootstrap,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<std::result::Result<(), String>> {
    // A bad override still joins the exchange (as an identity no other rank has), so no peer waits for it; the
    // error is returned after.
    let mine = local_host_id(env);
    let sent = match &mine {
        Ok(id) => id.clone(),
        Err(_) => format!("invalid-{ENV_HOST_ID}-rank-{}", bootstrap.rank()),
    };
    let all = gather_host_ids(bootstrap, &sent)?;
    mine?;
    Ok(one_host(&all))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::LocalGroup;

    fn env(v: Option<&'static str>) -> impl Fn(&str) -> Option<String> {
        move |k| (k == ENV_HOST_ID).then(|| v.map(str::to_owned)).flatten()
    }

    #[test]
    fn the_local_identity_is_the_host_and_boot_unless_overridden() {
        let id = local_host_id(&env(None)).expect("an identity");
        assert!(!id.is_empty() && id.len() <= MAX_HOST_ID, "{id}");
        assert_eq!(local_host_id(&env(Some("node-a"))).expect("override"), "node-a");
        for bad in ["", "tab\there", "\u{1b}[2J"] {
            let e = local_host_id(&move |k: &str| (k == ENV_HOST_ID).then(|| bad.to_owned())).expect_err(bad);
            assert!(e.to_string().contains(ENV_HOST_ID), "{e}");
        }
        let long = "x".repeat(MAX_HOST_ID + 1);
        assert!(local_host_id(&move |k: &str| (k == ENV_HOST_ID).then(|| long.clone())).is_err());
    }

    #[test]
    fn one_host_names_how_many_hosts_and_the_first_rank_on_each() {
        let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(one_host(&ids(&["a 1", "a 1", "a 1"])), Ok(()));
        assert_eq!(one_host(&ids(&["a 1"])), Ok(()));
        let e = one_host(&ids(&["a 1", "a 1", "b 2", "b 2"])).expect_err("two hosts");
        assert_eq!(e, "ranks span 2 hosts (rank 0 on a, rank 2 on b)");
        // Same name, another boot: another host (a rebooted or cloned machine); the boot id is never shown.
        let e = one_host(&ids(&["a 1", "a 2"])).expect_err("two boots");
        assert_eq!(e, "ranks span 2 hosts (rank 0 on a, rank 1 on a)");
        let many: Vec<String> = (0..6).map(|i| format!("h{i} x")).collect();
        assert!(one_host(&many).expect_err("six").starts_with("ranks span 6 hosts (rank 0 on h0, rank 1 on h1"));
    }

    #[test]
    fn ranks_as_threads_agree_on_the_answer_and_a_bad_override_fails_only_its_rank() {
        let run = |hosts: Vec<Option<&'static str>>| {
            let group = LocalGroup::new(hosts.len(), std::time::Duration::from_secs(10));
            std::thread::scope(|s| {
                let handles: Vec<_> = hosts
                    .into_iter()
                    .enumerate()
                    .map(|(rank, h)| (group.member(rank), h))
                    .map(|(mut b, h)| s.spawn(move || check_one_host(&mut b, &env(h)).map_err(|e| e.to_string())))
                    .collect();
                handles.into_iter().map(|h| h.join().expect("no panic")).collect::<Vec<_>>()
            })
        };
        let same = run(vec![Some("n1"), Some("n1"), Some("n1")]);
        assert!(same.iter().all(|r| r == &Ok(Ok(()))), "{same:?}");
        let split = run(vec![Some("n1"), Some("n2"), Some("n1")]);
        for r in &split {
            assert_eq!(r, &Ok(Err("ranks span 2 hosts (rank 0 on n1, rank 1 on n2)".to_owned())), "{split:?}");
        }
        let bad = run(vec![Some("n1"), Some("")]);
        assert!(matches!(&bad[0], Ok(Err(why)) if why.contains("ranks span 2 hosts")), "{bad:?}");
        assert!(matches!(&bad[1], Err(e) if e.contains(ENV_HOST_ID)), "{bad:?}");
    }
}
