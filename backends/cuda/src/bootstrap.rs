//! Multi-process setup: ranks find each other through the rendezvous (torchrun / Slurm environment), rank 0
//! creates the NCCL unique id and sends it to the others, and every rank joins the communicator on its GPU. The
//! same rendezvous then exchanges IPC handles.

use std::os::fd::AsFd;
use std::sync::Arc;

use anyccl_ccl::{CclVendor, UniqueId};
use anyccl_core::{Communicator, Error, Reason, Result, Selector};
use anyccl_rendezvous::{FdChannel, FdServer, Rendezvous, RendezvousConfig};

use crate::comm::CudaComm;
use crate::ipc::{LegacyMapping, VmmBuffer};
use crate::runtime::{DeviceBuffer, DeviceContext};

/// Joins the communicator described by `cfg` on GPU `device` (default: `LOCAL_RANK`, else rank modulo the GPU
/// count). Returns the communicator and the rendezvous, which stays usable for exchanging handles.
///
/// The rendezvous comes first, so a peer that never arrives fails with [`Error::Timeout`] naming it, before any
/// GPU work.
pub fn communicator(
    cfg: RendezvousConfig,
    device: Option<i32>,
    selector: Arc<Selector>,
) -> Result<(Communicator<CudaComm>, Rendezvous)> {
    let local_rank = cfg.local_rank;
    let mut rdv = Rendezvous::establish(cfg)?;
    let (rank, world) = (rdv.rank(), rdv.world());
    let lib = anyccl_ccl::load(CclVendor::Nccl).map_err(|e| Error::Unsupported {
        capability: "ccl".into(),
        reason: Reason::Unavailable { component: "NCCL".into(), detail: e.to_string() },
    });
    // Every rank must reach the broadcast even if its own load failed, or the others wait for the timeout.
    let id = match (&lib, rank) {
        (Ok(l), 0) => UniqueId::new(l).map(|id| id.as_bytes().to_vec()),
        _ => Ok(Vec::new()),
    };
    let payload = match &id {
        Ok(b) => b.clone(),
        Err(_) => Vec::new(),
    };
    let got = rdv.broadcast(0, (rank == 0).then_some(payload.as_slice()))?;
    id?;
    let lib = lib?;
    if got.is_empty() {
        return Err(Error::PeerFailure("rank 0 could not create an NCCL unique id".into()));
    }
    let id = UniqueId::from_bytes(&got)?;
    let info =
        crate::driver::probe().map_err(|reason| Error::Unsupported { capability: "cuda-runtime".into(), reason })?;
    let count = i32::try_from(info.devices.len()).unwrap_or(i32::MAX).max(1);
    let ordinal = device.unwrap_or_else(|| local_rank.map_or(rank as i32 % count, |l| l as i32 % count));
    let mut caps = crate::capabilities(Some(&lib), &|k| std::env::var(k).ok());
    caps.apply_env()?;
    let mut comm = CudaComm::init_rank(lib, ordinal, world, rank, &id, Arc::new(caps))?;
    // The custom kernels over IPC; if they cannot be set up, NCCL still serves every call.
    if world > 1 {
        if let Err(e) = comm.enable_custom_ipc(&mut rdv) {
            tracing::info!(error = %e, "custom all-reduce kernels off for this communicator");
        }
    }
    Ok((Communicator::new(comm, selector), rdv))
}

/// [`communicator`] with the configuration read from the environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
/// `LOCAL_RANK`, or Slurm's variables; the rendezvous port `ANYCCL_MASTER_PORT`, else `MASTER_PORT + 1`, since
/// torchrun's agent holds `MASTER_PORT`; and the job's secret `ANYCCL_RENDEZVOUS_KEY` or
/// `ANYCCL_RENDEZVOUS_KEY_FILE`, required unless `MASTER_ADDR` is a loopback address).
pub fn communicator_from_env(selector: Arc<Selector>) -> Result<(Communicator<CudaComm>, Rendezvous)> {
    communicator(RendezvousConfig::from_env()?, None, selector)
}

/// Exchanges legacy IPC handles of `buf` and opens every peer's buffer (index = rank; own = `None`).
pub fn exchange_legacy(
    rdv: &mut Rendezvous,
    ctx: &Arc<DeviceContext>,
    buf: &DeviceBuffer,
) -> Result<Vec<Option<LegacyMapping>>> {
    let mine = crate::ipc::export_legacy(ctx, buf)?;
    let all = rdv.all_gather(&mine)?;
    all.iter()
        .enumerate()
        .map(|(q, h)| if q == rdv.rank() { Ok(None) } else { LegacyMapping::open(ctx, h, buf.len()).map(Some) })
        .collect()
}

/// Exchanges cuMem allocations as file descriptors over private Unix sockets (peer uid checked) and maps every
/// peer's buffer (index = rank; own = `None`).
pub fn exchange_vmm(rdv: &mut Rendezvous, ctx: &Arc<DeviceContext>, buf: &VmmBuffer) -> Result<Vec<Option<VmmBuffer>>> {
    let (rank, world) = (rdv.rank(), rdv.world());
    let server = FdServer::bind()?;
    let path = server.path().to_string_lossy().into_owned();
    let paths = rdv.all_gather(path.as_bytes())?;
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
