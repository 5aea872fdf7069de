//! `anyccl bench --bind`: each rank on a processor of its own, as mpirun binds its ranks to cores by default, so
//! that a comparison with Open MPI places the ranks the same way.

/// Binds the calling thread (a rank's thread, or a `--per-rank` process's only thread that runs the collectives)
/// to the `rank`-th processor this process may run on, when the `world` ranks fit on those processors; else (more
/// ranks than processors) leaves it unbound, as mpirun does when it oversubscribes. `Err` says why the rank stays
/// unbound: the benchmark still runs, and the caller reports it.
pub(crate) fn bind_rank(rank: usize, world: usize) -> Result<(), String> {
    imp(rank, world)
}

#[cfg(target_os = "linux")]
fn imp(rank: usize, world: usize) -> Result<(), String> {
    use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
    use nix::unistd::Pid;
    let me = Pid::from_raw(0);
    let allowed = match sched_getaffinity(me) {
        Ok(set) => set,
        Err(e) => return Err(format!("the allowed processors are unknown: {e}")),
    };
    let cpus: Vec<usize> = (0..CpuSet::count()).filter(|&c| allowed.is_set(c).unwrap_or(false)).collect();
    if world > cpus.len() {
        // Oversubscribed: unbound on purpose, as mpirun leaves its ranks then.
        return Ok(());
    }
    let Some(&cpu) = cpus.get(rank) else { return Err(format!("rank {rank} of {world} has no processor")) };
    let mut set = CpuSet::new();
    set.set(cpu).map_err(|e| format!("processor {cpu}: {e}"))?;
    sched_setaffinity(me, &set).map_err(|e| format!("binding to processor {cpu} failed: {e}"))
}

#[cfg(not(target_os = "linux"))]
fn imp(_rank: usize, _world: usize) -> Result<(), String> {
    Err("binding is implemented on Linux only".to_owned())
}
