//! One process per GPU on ROCm: ranks find each other through the rendezvous (torchrun / Slurm environment), rank
//! 0 creates the RCCL unique id and sends it to the others, every rank joins the communicator on its GPU, and the
//! same bootstrap then exchanges the HIP IPC handles of the custom kernels' buffers and of graph buffers. Written
//! once for both vendors ([`anyccl_gpu::multi_process`]); these are its ROCm names.
//!
//! Bring your own bootstrap: an engine that moves the RCCL id itself ([`new_unique_id`], [`UniqueId::as_bytes`],
//! [`UniqueId::from_bytes`]) joins with [`communicator_with_id`], passing any [`Bootstrap`].

use std::sync::Arc;

pub use anyccl_ccl::UniqueId;
use anyccl_core::{Bootstrap, Communicator, Result, Selector};
use anyccl_gpu::multi_process as generic;
use anyccl_rendezvous::{Rendezvous, RendezvousConfig};

use crate::comm::RocmComm;
use crate::platform::Hip;
use crate::runtime::HipDevice;

pub use crate::platform::{hip_library, load_rccl};

/// Joins the communicator described by `cfg` on HIP device `device` of the process's HIP runtime (default:
/// `LOCAL_RANK`, else rank modulo the device count). Returns the communicator and the rendezvous, which stays
/// usable for exchanging handles (pass it to [`Communicator::register_graph_buffers`]).
pub fn communicator(
    cfg: RendezvousConfig,
    device: Option<i32>,
    selector: Arc<Selector>,
) -> Result<(Communicator<RocmComm>, Rendezvous)> {
    generic::communicator::<Hip>(cfg, device, selector)
}

/// A fresh RCCL unique id, made on one rank (move its bytes to the others and join with [`communicator_with_id`]).
pub fn new_unique_id() -> Result<UniqueId> {
    generic::new_unique_id::<Hip>()
}

/// Rank 0 makes an RCCL unique id and sends it to every rank through `bootstrap`. Collective.
pub fn broadcast_unique_id(bootstrap: &mut dyn Bootstrap) -> Result<UniqueId> {
    generic::broadcast_unique_id::<Hip>(bootstrap)
}

/// Joins communicator `id` as `rank` of `world` on `device`, with RCCL and the custom all-reduce kernels set up over
/// `bootstrap` (HIP IPC handles; if they cannot be set up, RCCL still serves every call). Collective; `bootstrap`
/// must be this rank's view of the same group (checked before any GPU work).
pub fn communicator_with_id(
    id: &UniqueId,
    rank: usize,
    world: usize,
    device: Arc<HipDevice>,
    bootstrap: &mut dyn Bootstrap,
    selector: Arc<Selector>,
) -> Result<Communicator<RocmComm>> {
    generic::communicator_with_id::<Hip>(id, rank, world, device, bootstrap, selector)
}

/// [`communicator`] with the configuration read from the environment (as `anyccl_cuda::multi_process` reads it).
pub fn communicator_from_env(selector: Arc<Selector>) -> Result<(Communicator<RocmComm>, Rendezvous)> {
    generic::communicator_from_env::<Hip>(selector)
}
