//! anyccl-cuda: the CUDA backend (cargo feature `cuda` of the facade).
//!
//! - [`driver`]: the CUDA driver through cudarc, probed first so a machine without `libcuda.so.1` reports
//!   "CUDA backend unavailable" instead of crashing;
//! - [`runtime`]: core's memory runtime over the driver (device buffers, streams, capture status);
//! - [`platform`]: the CUDA platform of anyccl-gpu's generic GPU communicator (module load and launch, IPC,
//!   peer access, the abort word);
//! - [`comm`]: the communicator ([`CudaComm`] = `GpuComm<Cuda>`): NCCL through anyccl-ccl's table, symmetric
//!   windows, the custom kernels;
//! - `multicast` (feature `multicast`): the NVLS multicast object manager, written over a driver trait and tested
//!   with a fake driver; `nvls`: the multicast object of the engine's NVLS plans, behind its gate;
//! - [`custom`], [`graph_inputs`], [`ipc`], [`graph`], [`multi_process`]: the CUDA names of the engine's custom
//!   kernels, graph inputs and one-process-per-GPU join, legacy and VMM IPC handles, and CUDA graphs and events
//!   ([`bootstrap`] is the deprecated former name of [`multi_process`]).
//!
//! N ranks emulated on one GPU and the tool binaries (`anyccl-cuda-*-bench`, `anyccl-cuda-ipc-check`) live in the
//! unpublished workspace member `anyccl-lab`.
//!
//! Graph capture: every path asks the driver whether the stream is capturing first; allocation, registration and
//! synchronous copies are refused during capture with [`anyccl_core::InvalidArgument::DuringCapture`] before the
//! driver sees them, so the capture stays valid (the rules are written once, in [`anyccl_core::capture`]).
#![deny(unsafe_op_in_unsafe_fn)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod comm;
#[cfg(feature = "cudarc")]
pub mod cudarc_interop;
pub mod custom;
pub mod driver;
pub mod graph;
pub mod graph_inputs;
pub mod ipc;
pub mod multi_process;
#[cfg(feature = "multicast")]
#[cfg_attr(docsrs, doc(cfg(feature = "multicast")))]
pub mod multicast;
#[cfg(feature = "multicast")]
#[cfg_attr(docsrs, doc(cfg(feature = "multicast")))]
pub mod multicast_driver;
#[cfg(feature = "multicast")]
#[cfg_attr(docsrs, doc(cfg(feature = "multicast")))]
pub mod nvls;
pub mod platform;
pub mod runtime;

use std::sync::Arc;

use anyccl_ccl::CclLibrary;
use anyccl_core::{Capabilities, CapabilityReport, Communicator, Reason, Result, Selector};

pub use comm::{CudaComm, SymmetricBuffer};
/// cudarc itself (feature `cudarc`), the version the typed API takes.
#[cfg(feature = "cudarc")]
pub use cudarc;
#[cfg(feature = "cudarc")]
pub use cudarc_interop::CudarcAllReduce;
pub use platform::Cuda;
pub use runtime::{CudaRuntime, CudaStream, DeviceBuffer, DeviceContext, DeviceView, DeviceViewMut};

/// The capability report of the CUDA backend on this machine: the driver and devices, and the collective
/// library's capabilities when one is loaded.
pub fn capabilities(lib: Option<&CclLibrary>, env: &dyn Fn(&str) -> Option<String>) -> CapabilityReport {
    let probed = driver::probe();
    // Where the driver runs: off because a device lacks multicast (or the driver is older than 12.1), or because
    // this build lacks the `multicast` feature; on otherwise (NCCL_NVLS_ENABLE=0 and ANYCCL_DISABLE still apply).
    let multicast_off = probed.as_ref().ok().and_then(|info| {
        if let Some(d) = info.devices.iter().find(|d| !d.multicast_supported) {
            return Some(Reason::DeviceAttribute {
                device: format!("device {} ({})", d.ordinal, d.name),
                attribute: "CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0".into(),
            });
        }
        if info.version < MULTICAST_DRIVER {
            return Some(Reason::VersionTooOld {
                component: "CUDA driver".into(),
                found: info.version_string(),
                required: "12.1".into(),
            });
        }
        if !cfg!(feature = "multicast") {
            return Some(Reason::NotCompiledIn {
                what: "NVLS multicast".into(),
                detail: "anyccl-cuda was built without its `multicast` feature".into(),
            });
        }
        None
    });
    let multicast_on = probed.is_ok() && multicast_off.is_none();
    let parts = anyccl_ccl::caps::GpuReport {
        label: "CUDA",
        missing_ccl: Reason::Unavailable { component: "NCCL".into(), detail: "no libnccl.so.2 could be loaded".into() },
        runtime: (Capabilities::CUDA_RUNTIME, probed.clone().map(|_| ())),
        dependents: Capabilities::P2P_ALL_PAIRS
            | Capabilities::IPC
            | Capabilities::MULTICAST
            | Capabilities::GRAPH_CAPTURE
            | Capabilities::DEPENDENT_LAUNCH,
        multicast_off,
        nvls_env: true,
        kernels: ("custom CUDA kernels", anyccl_kernels_cuda::NOT_BUILT),
    };
    let mut report = anyccl_ccl::caps::gpu_report(parts, lib, env);
    if multicast_on {
        // Every device reports multicast: on, unless NCCL_NVLS_ENABLE=0 turns it off (applied again after it).
        report.enable(Capabilities::MULTICAST);
        report.apply_nvls_env(env);
    }
    // Programmatic dependent launch: on where every device has it (the push one-shot asks per device too).
    if let Ok(info) = &probed {
        let why = info.devices.iter().find_map(|d| platform::dependent_launch_unavailable(d.ordinal));
        match why {
            None => report.enable(Capabilities::DEPENDENT_LAUNCH),
            Some(detail) => report.disable(
                Capabilities::DEPENDENT_LAUNCH,
                Reason::Unavailable { component: "programmatic dependent launch".into(), detail },
            ),
        }
    }
    report
}

/// The oldest driver with multicast objects (CUDA 12.1).
const MULTICAST_DRIVER: i32 = 12010;

/// Whether the backend can run here; `Err` says why not.
pub fn available() -> std::result::Result<&'static driver::DriverInfo, Reason> {
    driver::probe()
}

/// One communicator per listed device of this process (`ncclCommInitAll`), wrapped in the validating front-end.
pub fn communicators_single_process(
    lib: Arc<CclLibrary>,
    ordinals: &[i32],
    selector: Arc<Selector>,
) -> Result<Vec<Communicator<CudaComm>>> {
    anyccl_core::env::check_process_env()?;
    let env = anyccl_core::env::CheckedEnv::new();
    let mut caps = capabilities(Some(&lib), &|k| env.get(k));
    env.finish()?;
    caps.apply_env()?;
    let caps = Arc::new(caps);
    Ok(CudaComm::init_all(lib, ordinals, caps)?.into_iter().map(|c| Communicator::new(c, selector.clone())).collect())
}

/// The former name of [`multi_process`], kept so that code written against it still builds; every item warns
/// (`deprecated`) and forwards to its [`multi_process`] namesake.
#[deprecated(note = "renamed by its role: use anyccl_cuda::multi_process")]
pub mod bootstrap {
    use std::sync::Arc;

    use anyccl_core::{Bootstrap, Communicator, Result, Selector};
    use anyccl_rendezvous::{Rendezvous, RendezvousConfig};

    use crate::ipc::{LegacyMapping, VmmBuffer};
    use crate::multi_process as m;
    use crate::runtime::{DeviceBuffer, DeviceContext};
    use crate::CudaComm;

    /// [`m::UniqueId`].
    #[deprecated(note = "use anyccl_cuda::multi_process::UniqueId (or anyccl_ccl::UniqueId)")]
    pub type UniqueId = anyccl_ccl::UniqueId;

    /// [`m::load_nccl`].
    #[deprecated(note = "use anyccl_cuda::multi_process::load_nccl")]
    pub fn load_nccl() -> Result<Arc<anyccl_ccl::CclLibrary>> {
        m::load_nccl()
    }

    /// [`m::communicator`].
    #[deprecated(note = "use anyccl_cuda::multi_process::communicator")]
    pub fn communicator(
        cfg: RendezvousConfig,
        device: Option<i32>,
        selector: Arc<Selector>,
    ) -> Result<(Communicator<CudaComm>, Rendezvous)> {
        m::communicator(cfg, device, selector)
    }

    /// [`m::new_unique_id`].
    #[deprecated(note = "use anyccl_cuda::multi_process::new_unique_id")]
    pub fn new_unique_id() -> Result<m::UniqueId> {
        m::new_unique_id()
    }

    /// [`m::broadcast_unique_id`].
    #[deprecated(note = "use anyccl_cuda::multi_process::broadcast_unique_id")]
    pub fn broadcast_unique_id(bootstrap: &mut dyn Bootstrap) -> Result<m::UniqueId> {
        m::broadcast_unique_id(bootstrap)
    }

    /// [`m::communicator_with_id`].
    #[deprecated(note = "use anyccl_cuda::multi_process::communicator_with_id")]
    pub fn communicator_with_id(
        id: &m::UniqueId,
        rank: usize,
        world: usize,
        device: i32,
        bootstrap: &mut dyn Bootstrap,
        selector: Arc<Selector>,
    ) -> Result<Communicator<CudaComm>> {
        m::communicator_with_id(id, rank, world, device, bootstrap, selector)
    }

    /// [`m::communicator_from_env`].
    #[deprecated(note = "use anyccl_cuda::multi_process::communicator_from_env")]
    pub fn communicator_from_env(selector: Arc<Selector>) -> Result<(Communicator<CudaComm>, Rendezvous)> {
        m::communicator_from_env(selector)
    }

    /// [`m::exchange_legacy`].
    #[deprecated(note = "use anyccl_cuda::multi_process::exchange_legacy")]
    pub fn exchange_legacy(
        rdv: &mut dyn Bootstrap,
        ctx: &Arc<DeviceContext>,
        buf: &DeviceBuffer,
    ) -> Result<Vec<Option<LegacyMapping>>> {
        m::exchange_legacy(rdv, ctx, buf)
    }

    /// [`m::exchange_vmm`].
    #[deprecated(note = "use anyccl_cuda::multi_process::exchange_vmm")]
    pub fn exchange_vmm(
        rdv: &mut dyn Bootstrap,
        ctx: &Arc<DeviceContext>,
        buf: &VmmBuffer,
    ) -> Result<Vec<Option<VmmBuffer>>> {
        m::exchange_vmm(rdv, ctx, buf)
    }
}
