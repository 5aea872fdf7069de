//! The CUDA side of the NVLS plans ([`anyccl_gpu::nvls`]): one multicast object for the ranks of one process, its
//! gate, and its teardown.
//!
//! The gate comes first and makes no multicast call when it refuses ([`gate`]): `NCCL_NVLS_ENABLE=0`, an
//! `ANYCCL_DISABLE` that names `multicast`, then, per device, the driver version and
//! `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED` ([`multicast_eligibility`]). The engine asks only where the capability
//! report has multicast on, which the same three conditions decide; [`CudaMulticastDriver`] refuses
//! `cuMulticastCreate` under `NCCL_NVLS_ENABLE=0` once more.
//!
//! The life of the object (the order of MSCCL++'s leak fix): rank 0 creates it, exports it as a file descriptor and
//! releases its local allocation handle right after the export; every rank imports the descriptor (a duplicate of
//! the owner's within one process) and adds its device; the owner's descriptor is closed once all have imported;
//! every rank then allocates its staging-in, staging-out and flag buffers (`cuMemCreate`, mapped and zeroed), binds
//! them at the same offsets and maps each binding from offset 0 of the object. Teardown, per rank, reverses it: the
//! multicast mappings are unmapped and their address ranges freed, the buffers unbound, the imported handle
//! released; then the buffers themselves are unmapped and released.

use std::os::fd::{AsRawFd, BorrowedFd, IntoRawFd};
use std::sync::Arc;

use anyccl_core::{Capabilities, CapabilityReport, Reason};
use anyccl_gpu::nvls::NvlsMemory;

use crate::ipc::VmmBuffer;
use crate::multicast::{multicast_eligibility, MulticastConfig, MulticastGroup, Shareable};
use crate::multicast_driver::CudaMulticastDriver;
use crate::runtime::CudaRuntime;

/// Why NVLS may not be used in this environment (`NCCL_NVLS_ENABLE=0`, or `ANYCCL_DISABLE` naming `multicast`
/// or holding an invalid list), read through `env`; `None` when the environment allows it. No driver call.
pub fn env_gate(env: &dyn Fn(&str) -> Option<String>) -> Option<Reason> {
    if let Some(reason) = anyccl_core::caps::nvls_off_by_env(env) {
        return Some(reason);
    }
    let value = env("ANYCCL_DISABLE")?;
    let mut r = CapabilityReport::all_disabled(|_| Reason::NotApplicable { detail: String::new() });
    r.enable(Capabilities::MULTICAST);
    if let Err(e) = r.apply_disable_list("ANYCCL_DISABLE", &value) {
        return Some(Reason::Unavailable { component: "ANYCCL_DISABLE".into(), detail: e.to_string() });
    }
    match r.require(Capabilities::MULTICAST) {
        Ok(()) => None,
        Err(_) => Some(Reason::EnvVar { var: "ANYCCL_DISABLE".into(), value }),
    }
}

/// The whole gate for `ordinals`: [`env_gate`], two or more distinct devices, the driver's probe, then [`multicast_eligibility`] of every device (driver version and
/// `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED`). `Ok` only when multicast may be created; no multicast call is made.
pub fn gate(ordinals: &[i32], env: &dyn Fn(&str) -> Option<String>) -> Result<(), String> {
    if let Some(reason) = env_gate(env) {
        return Err(format!("multicast is off: {reason}"));
    }
    // The ranks' devices next, still before any driver call: an all-reduce over multicast needs two or more GPUs,
    // each rank on its own (ranks emulated on one GPU, or a world of one, never reach the driver).
    if ordinals.len() < 2 {
        return Err(format!(
            "multicast is off: NVLS needs two or more GPUs (this communicator has {})",
            ordinals.len()
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    if let Some(d) = ordinals.iter().find(|&&d| !seen.insert(d)) {
        return Err(format!("multicast is off: two ranks share GPU {d}; NVLS needs each rank on its own GPU"));
    }
    // The driver is probed safely first (a machine without libcuda answers here, before any driver call).
    crate::driver::probe().map_err(|r| format!("multicast is off: {r}"))?;
    for &d in ordinals {
        multicast_eligibility(&CudaMulticastDriver, d, env).map_err(|r| format!("multicast is off: {r}"))?;
    }
    Ok(())
}

/// One rank's multicast resources, torn down on drop: the group first (unmap and free the multicast ranges,
/// unbind, release the imported handle), then the bound buffers (unmap, free, release).
struct RankResources {
    group: Option<MulticastGroup<CudaMulticastDriver>>,
    buffers: Vec<VmmBuffer>,
    runtime: CudaRuntime,
}

impl Drop for RankResources {
    fn drop(&mut self) {
        let _ = self.runtime.context().bind();
        if let Some(group) = self.group.take() {
            if let Err(e) = group.close() {
                tracing::warn!(error = %e, "tearing the multicast object down");
            }
        }
        // The buffers are unbound now; each unmaps and releases itself, in allocation order.
        self.buffers.clear();
    }
}

/// Sets the multicast object up for `runtimes` (rank = index), each rank's staging buffers of `capacity` bytes and
/// flag array bound to it (see the module's documentation for the order). Refused by [`gate`] before any
/// multicast call. On a failure everything made so far is torn down and the reason returned.
pub fn setup(
    runtimes: &[&CudaRuntime],
    capacity: usize,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<NvlsMemory>, String> {
    let ordinals: Vec<i32> = runtimes.iter().map(|r| r.context().ordinal()).collect();
    gate(&ordinals, env)?;
    setup_gated(runtimes, capacity, env).map_err(|e| format!("off: the multicast setup failed ({e})"))
}

fn setup_gated(
    runtimes: &[&CudaRuntime],
    capacity: usize,
    env: &dyn Fn(&str) -> Option<String>,
) -> anyccl_core::Result<Vec<NvlsMemory>> {
    let world = runtimes.len();
    let sizes = [capacity, capacity, anyccl_kernels_cuda::FLAG_BYTES];
    let config = MulticastConfig::for_buffers(world, &sizes);
    let driver = Arc::new(CudaMulticastDriver);
    let mut groups: Vec<MulticastGroup<CudaMulticastDriver>> = Vec::with_capacity(world);
    for (rank, rt) in runtimes.iter().enumerate() {
        rt.context().bind()?;
        let device = rt.context().ordinal();
        let group = if rank == 0 {
            MulticastGroup::create(Arc::clone(&driver), device, &config, env)?
        } else {
            let fd = match groups.first().and_then(|g| g.shareable()) {
                Some(Shareable::PosixFd(fd)) => *fd,
                _ => return Err(anyccl_core::Error::backend("cuda", "nvls", None, "the owner exported no descriptor")),
            };
            // SAFETY: `fd` is the owner's open descriptor, owned by its group, which outlives this borrow.
            let dup = unsafe { BorrowedFd::borrow_raw(fd) }
                .try_clone_to_owned()
                .map_err(|e| anyccl_core::Error::backend("cuda", "dup", None, e.to_string()))?;
            debug_assert_ne!(dup.as_raw_fd(), fd);
            MulticastGroup::import(Arc::clone(&driver), device, &config, Shareable::PosixFd(dup.into_raw_fd()), env)?
        };
        groups.push(group);
    }
    // Every rank has imported: the owner's descriptor can go.
    if let Some(owner) = groups.first_mut() {
        owner.close_shareable()?;
    }
    let mut out = Vec::with_capacity(world);
    for (group, rt) in groups.into_iter().zip(runtimes) {
        let mut res = RankResources { group: Some(group), buffers: Vec::new(), runtime: (*rt).clone() };
        let mut unicast = [0u64; 3];
        let mut multicast = [0u64; 3];
        for (k, &size) in sizes.iter().enumerate() {
            let g = res.group.as_mut().ok_or_else(|| anyccl_core::Error::backend("cuda", "nvls", None, "no group"))?;
            // Large enough for the binding (the size rounded up to the multicast granularity).
            let bound = size.div_ceil(g.granularity()) * g.granularity();
            let buf = VmmBuffer::alloc(rt.context(), bound)?;
            let (handle, ptr) = (buf.handle(), buf.device_ptr());
            // Kept by `res` before it is bound: a failure from here on unbinds it (the group) before releasing it.
            res.buffers.push(buf);
            let g = res.group.as_mut().ok_or_else(|| anyccl_core::Error::backend("cuda", "nvls", None, "no group"))?;
            let binding = g.bind(crate::multicast::MemHandle(handle), size)?;
            multicast[k] = g.map(&binding)?;
            unicast[k] = ptr;
        }
        // The flag array starts zeroed (cuMem memory is not).
        zero(rt, unicast[2], anyccl_kernels_cuda::FLAG_BYTES)?;
        out.push(NvlsMemory {
            stage_in: unicast[0],
            stage_out: unicast[1],
            flags: unicast[2],
            stage_in_mc: multicast[0],
            stage_out_mc: multicast[1],
            flags_mc: multicast[2],
            capacity,
            resources: Box::new(res),
        });
    }
    Ok(out)
}

fn zero(rt: &CudaRuntime, ptr: u64, len: usize) -> anyccl_core::Result<()> {
    rt.context().bind()?;
    // SAFETY: `[ptr, ptr + len)` is mapped read-write memory of this device (a flag buffer just allocated).
    unsafe { cudarc::driver::sys::cuMemsetD8_v2(ptr, 0, len) }
        .result()
        .map_err(|e| crate::driver::cu_err("cuMemsetD8", e))?;
    // SAFETY: a plain synchronisation of the current context.
    unsafe { cudarc::driver::sys::cuCtxSynchronize() }
        .result()
        .map_err(|e| crate::driver::cu_err("cuCtxSynchronize", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| (*v).to_owned())
    }

    #[test]
    fn the_environment_gate_refuses_before_any_driver_call() {
        let r = env_gate(&env(&[("NCCL_NVLS_ENABLE", "0")])).expect("NCCL_NVLS_ENABLE=0 refuses");
        assert!(r.to_string().contains("NCCL_NVLS_ENABLE"), "{r}");
        let r = env_gate(&env(&[("ANYCCL_DISABLE", "symmetric-windows, multicast")])).expect("named");
        assert!(r.to_string().contains("ANYCCL_DISABLE"), "{r}");
        let r = env_gate(&env(&[("ANYCCL_DISABLE", "multicats")])).expect("an invalid list refuses too");
        assert!(r.to_string().contains("unknown capability"), "{r}");
        assert_eq!(env_gate(&env(&[("ANYCCL_DISABLE", "symmetric-windows")])), None);
        assert_eq!(env_gate(&env(&[("NCCL_NVLS_ENABLE", "1")])), None);
        // The whole gate: the environment answers first, so no driver is needed (this machine has none).
        let e = gate(&[0, 1], &env(&[("NCCL_NVLS_ENABLE", "0")])).expect_err("refused");
        assert!(e.contains("NCCL_NVLS_ENABLE"), "{e}");
    }

    #[test]
    fn on_this_machine_the_gate_refuses_with_a_reason() {
        // No GPU here (or one without multicast): whatever the environment, the gate refuses, and `setup` returns
        // that refusal without creating anything.
        let e = gate(&[0, 1], &|_| None).expect_err("no multicast on the machines this project is tested on");
        assert!(e.starts_with("multicast is off"), "{e}");
        // One GPU, or two ranks on one GPU: refused before the driver is asked anything.
        let e = gate(&[0], &|_| None).expect_err("a world of one");
        assert!(e.contains("two or more GPUs"), "{e}");
        let e = gate(&[0, 0], &|_| None).expect_err("ranks sharing a GPU");
        assert!(e.contains("share GPU 0"), "{e}");
        let e = setup(&[], 1 << 20, &env(&[("NCCL_NVLS_ENABLE", "0")])).expect_err("refused");
        assert!(e.contains("NCCL_NVLS_ENABLE"), "{e}");
    }
}
