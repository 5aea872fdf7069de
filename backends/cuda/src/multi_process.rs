//! Multi-process setup: ranks find each other through the rendezvous (torchrun / Slurm environment), rank 0
//! creates the NCCL unique id and sends it to the others, and every rank joins the communicator on its GPU. The
//! same rendezvous then exchanges IPC handles.
//!
//! Bring your own bootstrap: an engine that moves the NCCL id itself ([`new_unique_id`], [`UniqueId::as_bytes`],
//! [`UniqueId::from_bytes`]) joins with [`communicator_with_id`], passing any [`Bootstrap`] (its own byte exchange,
//! or the TCP [`Rendezvous`]) for the custom kernels' and graph buffers' handles. Every function here that needs
//! peers takes `&mut dyn Bootstrap`.

use std::os::fd::AsFd;
use std::sync::Arc;

pub use anyccl_ccl::UniqueId;
use anyccl_core::{Bootstrap, Communicator, Error, Result, Selector};
use anyccl_gpu::multi_process as generic;
use anyccl_rendezvous::{FdChannel, FdServer, Rendezvous, RendezvousConfig};

use crate::comm::CudaComm;
use crate::ipc::{LegacyMapping, VmmBuffer};
use crate::platform::Cuda;
use crate::runtime::{DeviceBuffer, DeviceContext};

pub use crate::platform::load_nccl;

/// Joins the communicator described by `cfg` on GPU `device` (default: `LOCAL_RANK`, else rank modulo the GPU
/// count). Returns the communicator and the rendezvous, which stays usable for exchanging handles (it is a
/// [`Bootstrap`]: pass it to [`Communicator::register_graph_buffers`]).
///
/// The rendezvous comes first, so a peer that never arrives fails with [`Error::Timeout`] naming it, before any
/// GPU work. Rank 0 then makes the NCCL unique id and sends it to the others ([`broadcast_unique_id`]), and every
/// rank joins through [`communicator_with_id`].
pub fn communicator(
    cfg: RendezvousConfig,
    device: Option<i32>,
    selector: Arc<Selector>,
) -> Result<(Communicator<CudaComm>, Rendezvous)> {
    generic::communicator::<Cuda>(cfg, device, selector)
}

/// A fresh NCCL unique id, made on one rank. Move its bytes ([`UniqueId::as_bytes`]) to the other ranks however the
/// engine does (a file, an environment variable, its own store), rebuild it there with [`UniqueId::from_bytes`],
/// and join with [`communicator_with_id`]; or let [`broadcast_unique_id`] do it through a [`Bootstrap`].
pub fn new_unique_id() -> Result<UniqueId> {
    generic::new_unique_id::<Cuda>()
}

/// Rank 0 makes an NCCL unique id and sends it to every rank through `bootstrap`. Collective.
pub fn broadcast_unique_id(bootstrap: &mut dyn Bootstrap) -> Result<UniqueId> {
    generic::broadcast_unique_id::<Cuda>(bootstrap)
}

/// Joins communicator `id` as `rank` of `world` on GPU `device`, with everything the rendezvous path gives: NCCL,
/// and the custom all-reduce kernels set up over `bootstrap` (legacy IPC handles; if they cannot be set up, NCCL
/// still serves every call). For an engine that moves the NCCL id itself (a file, an environment variable, MPI, its
/// own store) and has its own way to exchange bytes: implement [`Bootstrap`] over it, or use the TCP
/// [`Rendezvous`]. Keep the bootstrap for [`Communicator::register_graph_buffers`].
///
/// Collective: every rank calls it with the same `id` and `world`. `bootstrap` must be this rank's view of the
/// same group (its rank and world are checked before any GPU work: a mismatch is [`Error::InvalidArgument`]).
pub fn communicator_with_id(
    id: &UniqueId,
    rank: usize,
    world: usize,
    device: i32,
    bootstrap: &mut dyn Bootstrap,
    selector: Arc<Selector>,
) -> Result<Communicator<CudaComm>> {
    generic::communicator_with_id::<Cuda>(id, rank, world, device, bootstrap, selector)
}

/// [`communicator`] with the configuration read from the environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
/// `LOCAL_RANK`, or Slurm's variables; the rendezvous port `ANYCCL_MASTER_PORT`, else `MASTER_PORT + 1`, since
/// torchrun's agent holds `MASTER_PORT`; and the job's secret `ANYCCL_RENDEZVOUS_KEY` or
/// `ANYCCL_RENDEZVOUS_KEY_FILE`, required unless `MASTER_ADDR` is a loopback address).
pub fn communicator_from_env(selector: Arc<Selector>) -> Result<(Communicator<CudaComm>, Rendezvous)> {
    generic::communicator_from_env::<Cuda>(selector)
}

/// Exchanges legacy IPC handles of `buf` and opens every peer's buffer (index = rank; own = `None`).
pub fn exchange_legacy(
    rdv: &mut dyn Bootstrap,
    ctx: &Arc<DeviceContext>,
    buf: &DeviceBuffer,
) -> Result<Vec<Option<LegacyMapping>>> {
    let mine = crate::ipc::export_legacy(ctx, buf)?;
    let all = anyccl_core::bootstrap::checked_all_gather(rdv, &mine)?;
    all.iter()
        .enumerate()
        .map(|(q, h)| if q == rdv.rank() { Ok(None) } else { LegacyMapping::open(ctx, h, buf.len()).map(Some) })
        .collect()
}

/// Exchanges cuMem allocations as file descriptors over private Unix sockets (peer uid checked) and maps every
/// peer's buffer (index = rank; own = `None`).
pub fn exchange_vmm(
    rdv: &mut dyn Bootstrap,
    ctx: &Arc<DeviceContext>,
    buf: &VmmBuffer,
) -> Result<Vec<Option<VmmBuffer>>> {
    let (rank, world) = (rdv.rank(), rdv.world());
    let server = FdServer::bind()?;
    let path = server.path().to_string_lossy().into_owned();
    let paths = anyccl_core::bootstrap::checked_all_gather(rdv, path.as_bytes())?;
    let fd = buf.export_fd()?;
    let len = buf.view().len();
    // Send first (a Unix-socket connect completes in the listen backlog), then accept from every peer. The
    // sending channels stay open until every peer has received.
    let mut sent = Vec::new();
    for (q, p) in paths.iter().enumerate() {
        if q == rank {
            continue;
        }
        let p = std::path::PathBuf::from(String::from_utf8_lossy(p).into_owned());
        let ch = FdChannel::connect(&p)?;
        let mut payload = (rank as u64).to_le_bytes().to_vec();
        payload.extend_from_slice(&(len as u64).to_le_bytes());
        ch.send(&[fd.as_fd()], &payload)?;
        sent.push(ch);
    }
    // Every peer's message arrives on its own connection; a connection that is foreign, malformed or claims a rank
    // that is not a new peer's is dropped (and logged) while the exchange goes on, until the server's timeout.
    let mut seen = vec![false; world];
    let arrivals = server.gather(world.saturating_sub(1), 1, |a| {
        let (q, qlen) = vmm_message(&a.payload, a.fds.len())?;
        if q >= world || q == rank || seen[q] || qlen != len {
            return Err(format!("rank {q}, {qlen} bytes (expected a new peer rank and {len} bytes)"));
        }
        seen[q] = true;
        Ok(())
    })?;
    let mut out: Vec<Option<VmmBuffer>> = (0..world).map(|_| None).collect();
    for mut a in arrivals {
        let bad = |m: String| Error::PeerFailure(format!("malformed IPC message: {m}"));
        let (q, qlen) = vmm_message(&a.payload, a.fds.len()).map_err(bad)?;
        let fd = a.fds.pop().ok_or_else(|| bad("no descriptor".into()))?;
        let slot = out.get_mut(q).ok_or_else(|| bad(format!("rank {q}")))?;
        *slot = Some(VmmBuffer::import(ctx, fd, qlen)?);
    }
    rdv.barrier()?;
    drop(sent);
    Ok(out)
}

/// The sender's rank and buffer length from a VMM handle message (16 payload bytes and one descriptor).
fn vmm_message(payload: &[u8], fds: usize) -> std::result::Result<(usize, usize), String> {
    if payload.len() != 16 || fds != 1 {
        return Err(format!("{} payload bytes and {fds} descriptors", payload.len()));
    }
    let mut r = [0u8; 8];
    r.copy_from_slice(&payload[..8]);
    let mut l = [0u8; 8];
    l.copy_from_slice(&payload[8..]);
    let q = usize::try_from(u64::from_le_bytes(r)).map_err(|_| "a rank beyond usize".to_string())?;
    let len = usize::try_from(u64::from_le_bytes(l)).map_err(|_| "a length beyond usize".to_string())?;
    Ok((q, len))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use anyccl_core::bootstrap::LocalGroup;

    use super::*;

    /// Bring-your-own-id checks its arguments before loading NCCL or touching a GPU: a world of 0, a rank outside
    /// the world, a negative device, and a bootstrap of another shape are `InvalidArgument`s naming the culprit.
    #[test]
    fn communicator_with_id_refuses_bad_shapes_before_any_gpu_work() {
        let id = UniqueId::from_bytes(&[7u8; 128]).expect("128 bytes");
        let sel = Arc::new(Selector::defaults());
        let group = LocalGroup::new(2, Duration::from_secs(1));
        let mut me = group.member(1);
        let cases: [(usize, usize, i32, &str); 4] = [
            (0, 0, 0, "at least one rank"),
            (2, 2, 0, "this rank 2 is out of range"),
            (1, 2, -1, "device -1"),
            (1, 3, 0, "the bootstrap is rank 1 of 2, but the communicator is rank 1 of 3"),
        ];
        for (rank, world, device, want) in cases {
            let e = communicator_with_id(&id, rank, world, device, &mut me, sel.clone()).err().expect("refused");
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
            assert!(e.to_string().contains(want), "{e} (wanted {want:?})");
        }
    }

    /// The deprecated former path (`anyccl_cuda::bootstrap`) forwards here: the same type, the same refusal.
    #[test]
    #[allow(deprecated)]
    fn the_former_bootstrap_path_forwards_here() {
        let id: crate::bootstrap::UniqueId = UniqueId::from_bytes(&[7u8; 128]).expect("128 bytes");
        let group = LocalGroup::new(1, Duration::from_secs(1));
        let mut me = group.member(0);
        let sel = Arc::new(Selector::defaults());
        let e = crate::bootstrap::communicator_with_id(&id, 0, 1, -1, &mut me, sel).err().expect("refused");
        assert!(matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("device -1"), "{e}");
    }

    /// The unique id travels through any bootstrap: here an in-process group whose rank 0 has no NCCL, so every
    /// rank fails alike (rank 0 with its own error, the others told by the empty broadcast) instead of waiting.
    #[test]
    fn a_rank_0_without_nccl_fails_every_rank_through_the_bootstrap() {
        let group = LocalGroup::new(3, Duration::from_secs(20));
        let errs: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let mut me = group.member(r);
                    s.spawn(move || generic::share_unique_id::<Cuda>(&mut me, None).err().map(|e| e.to_string()))
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank")).collect::<Option<Vec<_>>>().expect("every rank fails")
        });
        assert!(errs[0].contains("rank 0 could not load NCCL"), "{}", errs[0]);
        assert!(errs[1..].iter().all(|e| e.contains("rank 0 could not create an NCCL unique id")), "{errs:?}");
    }
}
