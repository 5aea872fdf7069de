//! anyccl-rocm: the ROCm backend (cargo feature `rocm` of the facade).
//!
//! - [`loader`]: the HIP runtime (`libamdhip64.so`) loaded at run time through `libloading`, every symbol resolved
//!   once (why not a crate: see the module). The backend builds and runs on machines without ROCm and says why it
//!   is off.
//! - [`runtime`]: devices, buffers, streams, graphs; core's [`anyccl_core::MemoryRuntime`] over HIP, with the
//!   capture rules (no allocation, free, synchronous copy or registration while a stream captures).
//! - [`platform`]: the HIP platform of anyccl-gpu's generic GPU communicator (module load and launch of the HIP
//!   kernels of `anyccl-kernels-hip`, HIP IPC handles, peer access, the abort word).
//! - [`comm`]: the communicator ([`RocmComm`] = `GpuComm<Hip>`, written once with the CUDA one): RCCL, symmetric
//!   windows only where RCCL exports the window symbols and `NCCL_CUMEM_ENABLE=1`, and the custom one-shot /
//!   two-shot kernels over peer access (one process) or HIP IPC (one process per GPU, [`multi_process`]; its
//!   former name [`bootstrap`] is deprecated).
#![deny(unsafe_op_in_unsafe_fn)]

pub mod comm;
pub mod loader;
pub mod multi_process;
pub mod platform;
pub mod runtime;
pub mod sys;

use std::sync::Arc;

use anyccl_ccl::CclLibrary;
use anyccl_core::{Capabilities, CapabilityReport, Communicator, Reason, Result, Selector};

/// The HIP kernels' crate: the code objects built in, and why none are ([`kernels::NOT_BUILT`]).
pub use anyccl_kernels_hip as kernels;
pub use comm::{RocmComm, SymmetricBuffer};
pub use loader::{HipLibrary, HipLoadError};
pub use platform::Hip;
pub use runtime::{HipBuffer, HipDevice, HipEvent, HipGraph, HipRuntime, HipStream, HipView, HipViewMut};

/// What the ROCm backend can do with `hip` (the HIP runtime, or why it did not load) and `ccl` (RCCL, if one
/// loaded); `env` reads environment variables.
pub fn capabilities(
    hip: std::result::Result<&HipLibrary, &HipLoadError>,
    ccl: Option<&CclLibrary>,
    env: &dyn Fn(&str) -> Option<String>,
) -> CapabilityReport {
    let runtime = match hip {
        Err(e) => Err(Reason::Unavailable { component: "HIP runtime".into(), detail: e.to_string() }),
        Ok(lib) => match runtime::device_count(lib) {
            Err(e) => Err(Reason::Unavailable { component: lib.describe(), detail: e.to_string() }),
            Ok(0) => Err(Reason::Unavailable { component: lib.describe(), detail: "no HIP devices".into() }),
            Ok(_) => Ok(()),
        },
    };
    let parts = anyccl_ccl::caps::GpuReport {
        label: "ROCm",
        missing_ccl: Reason::Unavailable { component: "RCCL".into(), detail: "no librccl.so.1 could be loaded".into() },
        runtime: (Capabilities::HIP_RUNTIME, runtime),
        dependents: Capabilities::GRAPH_CAPTURE | Capabilities::IPC | Capabilities::P2P_ALL_PAIRS,
        multicast_off: Some(Reason::Unavailable {
            component: "AMD GPUs".into(),
            detail: "no NVLink SHARP multicast on AMD".into(),
        }),
        nvls_env: false,
        // Built in: on (each communicator checks that its devices' targets have code objects, and says why not).
        kernels: ("HIP kernels", anyccl_kernels_hip::NOT_BUILT),
    };
    let mut report = anyccl_ccl::caps::gpu_report(parts, ccl, env);
    report.disable(
        Capabilities::DEPENDENT_LAUNCH,
        Reason::Unavailable {
            component: "programmatic dependent launch".into(),
            detail: "HIP has no programmatic dependent launch (and ROCm does not offer the push one-shot yet)".into(),
        },
    );
    report
}

/// One communicator per listed HIP device of this process (`ncclCommInitAll`), wrapped in the validating
/// front-end, with the capability report of `hip` and `rccl` (and `ANYCCL_DISABLE` applied).
pub fn communicators_single_process(
    hip: Arc<HipLibrary>,
    rccl: Arc<CclLibrary>,
    ordinals: &[i32],
    selector: Arc<Selector>,
) -> Result<Vec<Communicator<RocmComm>>> {
    anyccl_core::env::check_process_env()?;
    let env = anyccl_core::env::CheckedEnv::new();
    let mut caps = capabilities(Ok(&hip), Some(&rccl), &|k| env.get(k));
    env.finish()?;
    caps.apply_env()?;
    let caps = Arc::new(caps);
    let devices: Vec<Arc<HipDevice>> =
        ordinals.iter().map(|o| HipDevice::new(hip.clone(), *o)).collect::<Result<_>>()?;
    Ok(RocmComm::init_all(rccl, &devices, caps)?.into_iter().map(|c| Communicator::new(c, selector.clone())).collect())
}

/// The former name of [`multi_process`], kept so that code written against it still builds; every item warns
/// (`deprecated`) and forwards to its [`multi_process`] namesake.
#[deprecated(note = "renamed by its role: use anyccl_rocm::multi_process")]
pub mod bootstrap {
    use std::sync::Arc;

    use anyccl_core::{Bootstrap, Communicator, Result, Selector};
    use anyccl_rendezvous::{Rendezvous, RendezvousConfig};

    use crate::multi_process as m;
    use crate::{HipDevice, HipLibrary, HipLoadError, RocmComm};

    /// [`m::UniqueId`].
    #[deprecated(note = "use anyccl_rocm::multi_process::UniqueId (or anyccl_ccl::UniqueId)")]
    pub type UniqueId = anyccl_ccl::UniqueId;

    /// [`m::hip_library`].
    #[deprecated(note = "use anyccl_rocm::multi_process::hip_library")]
    pub fn hip_library() -> &'static std::result::Result<Arc<HipLibrary>, HipLoadError> {
        m::hip_library()
    }

    /// [`m::load_rccl`].
    #[deprecated(note = "use anyccl_rocm::multi_process::load_rccl")]
    pub fn load_rccl() -> Result<Arc<anyccl_ccl::CclLibrary>> {
        m::load_rccl()
    }

    /// [`m::communicator`].
    #[deprecated(note = "use anyccl_rocm::multi_process::communicator")]
    pub fn communicator(
        cfg: RendezvousConfig,
        device: Option<i32>,
        selector: Arc<Selector>,
    ) -> Result<(Communicator<RocmComm>, Rendezvous)> {
        m::communicator(cfg, device, selector)
    }

    /// [`m::new_unique_id`].
    #[deprecated(note = "use anyccl_rocm::multi_process::new_unique_id")]
    pub fn new_unique_id() -> Result<m::UniqueId> {
        m::new_unique_id()
    }

    /// [`m::broadcast_unique_id`].
    #[deprecated(note = "use anyccl_rocm::multi_process::broadcast_unique_id")]
    pub fn broadcast_unique_id(bootstrap: &mut dyn Bootstrap) -> Result<m::UniqueId> {
        m::broadcast_unique_id(bootstrap)
    }

    /// [`m::communicator_with_id`].
    #[deprecated(note = "use anyccl_rocm::multi_process::communicator_with_id")]
    pub fn communicator_with_id(
        id: &m::UniqueId,
        rank: usize,
        world: usize,
        device: Arc<HipDevice>,
        bootstrap: &mut dyn Bootstrap,
        selector: Arc<Selector>,
    ) -> Result<Communicator<RocmComm>> {
        m::communicator_with_id(id, rank, world, device, bootstrap, selector)
    }

    /// [`m::communicator_from_env`].
    #[deprecated(note = "use anyccl_rocm::multi_process::communicator_from_env")]
    pub fn communicator_from_env(selector: Arc<Selector>) -> Result<(Communicator<RocmComm>, Rendezvous)> {
        m::communicator_from_env(selector)
    }
}
