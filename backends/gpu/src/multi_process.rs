//! Multi-process setup for every GPU vendor: ranks find each other through the rendezvous (torchrun / Slurm
//! environment), rank 0 creates the NCCL/RCCL unique id and sends it to the others, and every rank joins the
//! communicator on its GPU. The same rendezvous then exchanges IPC handles.
//!
//! Bring your own bootstrap: an engine that moves the unique id itself ([`new_unique_id`], [`UniqueId::as_bytes`],
//! [`UniqueId::from_bytes`]) joins with [`communicator_with_id`], passing any [`Bootstrap`] (its own byte exchange,
//! or the TCP [`Rendezvous`]) for the custom kernels' and graph buffers' handles. Every function here that needs
//! peers takes `&mut dyn Bootstrap`.

use std::sync::Arc;

use anyccl_core::{Bootstrap, Communicator, Error, InvalidArgument, Result, Selector};
use anyccl_rendezvous::{Rendezvous, RendezvousConfig};

use super::{GpuComm, GpuPlatform};
use anyccl_ccl::{CclLibrary, UniqueId};

/// Joins the communicator described by `cfg` on GPU `device` (default: `LOCAL_RANK`, else rank modulo the GPU
/// count). Returns the communicator and the rendezvous, which stays usable for exchanging handles (it is a
/// [`Bootstrap`]: pass it to [`Communicator::register_graph_buffers`]).
///
/// The rendezvous comes first, so a peer that never arrives fails with [`Error::Timeout`] naming it, before any
/// GPU work. Rank 0 then makes the unique id and sends it to the others ([`broadcast_unique_id`]), and every rank
/// joins through [`communicator_with_id`].
pub fn communicator<P: GpuPlatform>(
    cfg: RendezvousConfig,
    device: Option<i32>,
    selector: Arc<Selector>,
) -> Result<(Communicator<GpuComm<P>>, Rendezvous)> {
    let local_rank = cfg.local_rank;
    // Every variable anyccl reads as text is checked first: a value that is not UTF-8 is an error naming it, before
    // any peer waits for this rank (the readers below then see only text).
    anyccl_core::env::check_process_env()?;
    let mut rdv = Rendezvous::establish(cfg)?;
    let (rank, world) = (rdv.rank(), rdv.world());
    let lib = super::load_ccl::<P>();
    // Every rank reaches the broadcast even if its own load failed, or the others wait for the timeout.
    let id = share_unique_id::<P>(&mut rdv, lib.as_ref().ok());
    let lib = lib?;
    let id = id?;
    let device = super::device_for_rank::<P>(device, local_rank, rank)?;
    let env = anyccl_core::env::CheckedEnv::new();
    let comm = join(lib, &id, rank, world, device, &mut rdv, selector, &|k| env.get(k));
    env.finish()?;
    Ok((comm?, rdv))
}

/// A fresh unique id, made on one rank. Move its bytes ([`UniqueId::as_bytes`]) to the other ranks however the
/// engine does (a file, an environment variable, its own store), rebuild it there with [`UniqueId::from_bytes`],
/// and join with [`communicator_with_id`]; or let [`broadcast_unique_id`] do it through a [`Bootstrap`].
pub fn new_unique_id<P: GpuPlatform>() -> Result<UniqueId> {
    let lib = super::load_ccl::<P>()?;
    UniqueId::new(&lib)
}

/// Rank 0 makes a unique id and sends it to every rank through `bootstrap`. Collective.
pub fn broadcast_unique_id<P: GpuPlatform>(bootstrap: &mut dyn Bootstrap) -> Result<UniqueId> {
    let lib = super::load_ccl::<P>();
    share_unique_id::<P>(bootstrap, lib.as_ref().ok())
}

/// [`broadcast_unique_id`] with the library already loaded (or not: rank 0 then sends nothing, and every rank
/// fails alike instead of waiting).
pub fn share_unique_id<P: GpuPlatform>(
    bootstrap: &mut dyn Bootstrap,
    lib: Option<&Arc<CclLibrary>>,
) -> Result<UniqueId> {
    let library = P::CCL;
    let rank = bootstrap.rank();
    let made = match (lib, rank) {
        (Some(l), 0) => Some(UniqueId::new(l)),
        (None, 0) => Some(Err(Error::PeerFailure(format!("rank 0 could not load {library}")))),
        _ => None,
    };
    let payload = match &made {
        Some(Ok(id)) => id.as_bytes().to_vec(),
        _ => Vec::new(),
    };
    let got = bootstrap.broadcast(0, (rank == 0).then_some(payload.as_slice()))?;
    if let Some(Err(e)) = made {
        return Err(e);
    }
    if got.is_empty() {
        return Err(Error::PeerFailure(format!("rank 0 could not create an {library} unique id")));
    }
    UniqueId::from_bytes(&got)
}

/// Joins communicator `id` as `rank` of `world` on GPU `device`, with everything the rendezvous path gives: the
/// collective library, and the custom all-reduce kernels set up over `bootstrap` (legacy IPC handles; if they
/// cannot be set up, the library still serves every call). For an engine that moves the unique id itself (a file,
/// an environment variable, MPI, its own store) and has its own way to exchange bytes: implement [`Bootstrap`]
/// over it, or use the TCP [`Rendezvous`]. Keep the bootstrap for [`Communicator::register_graph_buffers`].
///
/// Collective: every rank calls it with the same `id` and `world`. `bootstrap` must be this rank's view of the
/// same group (its rank and world are checked before any GPU work: a mismatch is [`Error::InvalidArgument`]).
pub fn communicator_with_id<P: GpuPlatform>(
    id: &UniqueId,
    rank: usize,
    world: usize,
    device: P::DeviceSpec,
    bootstrap: &mut dyn Bootstrap,
    selector: Arc<Selector>,
) -> Result<Communicator<GpuComm<P>>> {
    check_shape(rank, world, P::ordinal(&device))?;
    anyccl_core::comm::check_bootstrap(bootstrap, rank, world)?;
    anyccl_core::env::check_process_env()?;
    let env = anyccl_core::env::CheckedEnv::new();
    let comm = join(super::load_ccl::<P>()?, id, rank, world, device, bootstrap, selector, &|k| env.get(k));
    env.finish()?;
    comm
}

/// Refuses a shape no communicator has: no ranks, a rank outside the world, a negative device.
pub fn check_shape(rank: usize, world: usize, device: i32) -> Result<()> {
    if world == 0 {
        return Err(InvalidArgument::BadWorld("a communicator needs at least one rank".into()).into());
    }
    if rank >= world {
        return Err(InvalidArgument::RankOutOfRange { what: "this", rank, world }.into());
    }
    if device < 0 {
        return Err(InvalidArgument::BadWorld(format!("device {device} is not a device ordinal")).into());
    }
    Ok(())
}

/// The library, then the custom kernels and NVLS multicast over `bootstrap`, with the environment read through `env` (capabilities,
/// custom-kernel settings, this rank's host identity): what [`communicator_with_id`] does once `lib` is loaded.
#[allow(clippy::too_many_arguments)]
pub fn join<P: GpuPlatform>(
    lib: Arc<CclLibrary>,
    id: &UniqueId,
    rank: usize,
    world: usize,
    device: P::DeviceSpec,
    bootstrap: &mut dyn Bootstrap,
    selector: Arc<Selector>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Communicator<GpuComm<P>>> {
    let mut caps = P::capabilities(&device, &lib, env)?;
    if let Some(v) = env("ANYCCL_DISABLE") {
        caps.apply_disable_list("ANYCCL_DISABLE", &v)?;
    }
    let mut comm = GpuComm::<P>::init_rank(lib, device, world, rank, id, Arc::new(caps))?;
    // The custom kernels over IPC; if they cannot be set up, the library still serves every call.
    if world > 1 {
        if let Err(e) = comm.enable_custom_ipc_with_env(bootstrap, env) {
            tracing::info!(error = %e, "custom all-reduce kernels off for this communicator");
        }
        // NVLS multicast, behind its gate (agreed among the ranks; no multicast call where the gate refuses).
        if let Err(e) = comm.enable_nvls_with_env(bootstrap, env) {
            tracing::info!(error = %e, "NVLS multicast off for this communicator");
        }
    }
    Ok(Communicator::new(comm, selector))
}

/// [`communicator`] with the configuration read from the environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
/// `LOCAL_RANK`, or Slurm's variables; the rendezvous port `ANYCCL_MASTER_PORT`, else `MASTER_PORT + 1`, since
/// torchrun's agent holds `MASTER_PORT`; and the job's secret `ANYCCL_RENDEZVOUS_KEY` or
/// `ANYCCL_RENDEZVOUS_KEY_FILE`, required unless `MASTER_ADDR` is a loopback address).
pub fn communicator_from_env<P: GpuPlatform>(
    selector: Arc<Selector>,
) -> Result<(Communicator<GpuComm<P>>, Rendezvous)> {
    communicator::<P>(RendezvousConfig::from_env()?, None, selector)
}
