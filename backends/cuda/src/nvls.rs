//! The CUDA side of the NVLS plans ([`anyccl_gpu::nvls`]): one multicast object for the ranks of one process
//! ([`setup`]) or for one process per GPU ([`setup_rank`]), its gate, and its teardown.
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
//!
//! Across processes ([`setup_rank`], one rank per process, over the communicator's [`Bootstrap`]) the same order
//! holds, each step agreed among the ranks ([`anyccl_gpu::nvls::agree`]) so that all of them go on or all stop:
//! every rank passes the gate (same host, each on its own GPU, told apart by PCI address); rank 0 creates the
//! object, exports it as a POSIX file descriptor (`cuMemExportToShareableHandle`) and releases its local handle;
//! every other rank opens a private Unix socket ([`FdServer`], peer uid checked), whose path travels through the
//! bootstrap; rank 0 sends the descriptor to each over it ([`FdChannel`], `SCM_RIGHTS`); each rank imports it
//! (`cuMemImportFromShareableHandle`), closes the received descriptor and adds its device; once every rank has
//! added its device (agreed), rank 0 closes its export and every rank binds and maps its buffers.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, IntoRawFd};
use std::sync::Arc;

use anyccl_core::{Bootstrap, Capabilities, CapabilityReport, Reason};
use anyccl_gpu::nvls::{agree, NvlsMemory};
use anyccl_rendezvous::{FdChannel, FdServer};

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
    let config = MulticastConfig::for_buffers(world, &buffer_sizes(capacity));
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
        out.push(bind_buffers(group, rt, capacity)?);
    }
    Ok(out)
}

/// The sizes of the buffers bound to the object, in binding order: staging-in, staging-out, flags.
fn buffer_sizes(capacity: usize) -> [usize; 3] {
    [capacity, capacity, anyccl_kernels_cuda::FLAG_BYTES]
}

/// One rank's buffers (staging-in, staging-out, flags) allocated, bound to `group` at the same offsets on every
/// rank and mapped, the flags zeroed. On a failure everything is torn down (the group first).
fn bind_buffers(
    group: MulticastGroup<CudaMulticastDriver>,
    rt: &CudaRuntime,
    capacity: usize,
) -> anyccl_core::Result<NvlsMemory> {
    rt.context().bind()?;
    let mut res = RankResources { group: Some(group), buffers: Vec::new(), runtime: rt.clone() };
    let mut unicast = [0u64; 3];
    let mut multicast = [0u64; 3];
    for (k, &size) in buffer_sizes(capacity).iter().enumerate() {
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
    Ok(NvlsMemory {
        stage_in: unicast[0],
        stage_out: unicast[1],
        flags: unicast[2],
        stage_in_mc: multicast[0],
        stage_out_mc: multicast[1],
        flags_mc: multicast[2],
        capacity,
        resources: Box::new(res),
    })
}

/// The first bytes of the descriptor's message from rank 0 (then the object's size, 8 bytes little-endian).
const HANDLE_MAGIC: &[u8; 8] = b"anyNVLS1";

/// The PCI address of device `ordinal` (`domain:bus:device`), which tells GPUs apart across processes whatever
/// `CUDA_VISIBLE_DEVICES` each process has.
fn pci_address(ordinal: i32) -> Result<String, String> {
    use cudarc::driver::sys::{self, CUdevice_attribute as A};
    let mut dev: sys::CUdevice = 0;
    // SAFETY: writes one device handle.
    unsafe { sys::cuDeviceGet(&mut dev, ordinal) }.result().map_err(|e| format!("cuDeviceGet: {e}"))?;
    let read = |attr: A| -> Result<i32, String> {
        let mut v = 0;
        // SAFETY: a valid device; writes one int.
        unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) }
            .result()
            .map_err(|e| format!("cuDeviceGetAttribute: {e}"))?;
        Ok(v)
    };
    let domain = read(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?;
    let bus = read(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?;
    let device = read(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?;
    Ok(format!("{domain:04x}:{bus:02x}:{device:02x}"))
}

/// This rank's side of the gate across processes: the environment first (no driver call when it refuses), then
/// the driver and the device; `Ok` with this rank's host identity and GPU (PCI address), `host\nPCI`.
fn local_gate(runtime: &CudaRuntime, world: usize, env: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    if let Some(reason) = env_gate(env) {
        return Err(format!("multicast is off: {reason}"));
    }
    if world < 2 {
        return Err(format!("multicast is off: NVLS needs two or more GPUs (this communicator has {world})"));
    }
    let host = anyccl_core::topology::local_host_id(env).map_err(|e| format!("multicast is off: {e}"))?;
    crate::driver::probe().map_err(|r| format!("multicast is off: {r}"))?;
    let ordinal = runtime.context().ordinal();
    multicast_eligibility(&CudaMulticastDriver, ordinal, env).map_err(|r| format!("multicast is off: {r}"))?;
    let pci = pci_address(ordinal).map_err(|e| format!("multicast is off: device {ordinal}: {e}"))?;
    Ok(format!("{host}\n{pci}"))
}

/// Sets this rank's part of the multicast object up, one process per GPU, over `bootstrap` (see the module's
/// documentation for the order). Collective: every rank reaches every exchange, even after a local failure, and
/// all ranks return `Ok` or all return `Err` with the first failing rank's reason. No multicast call is made
/// anywhere unless every rank's gate passed. On a failure everything this rank made is torn down.
pub fn setup_rank(
    runtime: &CudaRuntime,
    bootstrap: &mut dyn Bootstrap,
    capacity: usize,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<NvlsMemory, String> {
    let (rank, world) = (bootstrap.rank(), bootstrap.world());
    let off = |why: String| format!("off on every rank: {why}");
    // 1. The gate, on every rank, and where each rank runs.
    let gate = local_gate(runtime, world, env);
    let places = agree(bootstrap, gate.map(String::into_bytes), "the multicast gate").map_err(off)?;
    let places: Vec<(String, String)> = places
        .iter()
        .map(|p| {
            // Split before sanitising (which escapes the newline); each part is a peer's text.
            let cut = p.iter().position(|&b| b == b'\n').unwrap_or(p.len());
            let (host, pci) = p.split_at(cut);
            let pci = pci.get(1..).unwrap_or_default();
            (anyccl_core::text::sanitize_bytes(host, 300), anyccl_core::text::sanitize_bytes(pci, 100))
        })
        .collect();
    if let Some(q) = places.iter().position(|(host, _)| *host != places[0].0) {
        return Err(off(format!("multicast is off: rank {q} is on another host than rank 0 (NVLS is one host's)")));
    }
    for (q, (_, pci)) in places.iter().enumerate() {
        if let Some(p) = places[..q].iter().position(|(_, other)| other == pci) {
            return Err(off(format!(
                "multicast is off: ranks {p} and {q} share GPU {pci}; NVLS needs each rank on its own GPU"
            )));
        }
    }
    // 2. Rank 0 creates and exports the object; every other rank opens a socket for the descriptor.
    let device = runtime.context().ordinal();
    let driver = Arc::new(CudaMulticastDriver);
    let config = MulticastConfig::for_buffers(world, &buffer_sizes(capacity));
    let mut group: Option<MulticastGroup<CudaMulticastDriver>> = None;
    let mut server: Option<FdServer> = None;
    let made = (|| -> Result<Vec<u8>, String> {
        runtime.context().bind().map_err(|e| e.to_string())?;
        if rank == 0 {
            let g = MulticastGroup::create(Arc::clone(&driver), device, &config, env).map_err(|e| e.to_string())?;
            let size = (g.size() as u64).to_le_bytes().to_vec();
            group = Some(g);
            Ok(size)
        } else {
            let s = FdServer::bind().map_err(|e| e.to_string())?;
            let path = s.path().to_string_lossy().into_owned().into_bytes();
            server = Some(s);
            Ok(path)
        }
    })();
    let made = agree(bootstrap, made, "the multicast object").map_err(off)?;
    // 3. The descriptor to every peer; each imports it and adds its device.
    let mut sent: Vec<FdChannel> = Vec::new();
    let joined = (|| -> Result<MulticastGroup<CudaMulticastDriver>, String> {
        if rank == 0 {
            let g = group.take().ok_or("the multicast object is missing")?;
            let fd = match g.shareable() {
                Some(crate::multicast::Shareable::PosixFd(fd)) => *fd,
                _ => return Err("the multicast object was exported as no descriptor".into()),
            };
            let mut payload = HANDLE_MAGIC.to_vec();
            payload.extend_from_slice(&(g.size() as u64).to_le_bytes());
            for (q, path) in made.iter().enumerate().skip(1) {
                let path = std::path::PathBuf::from(String::from_utf8_lossy(path).into_owned());
                // SAFETY: `fd` is the export `g` owns, open until `g` closes it, after this loop.
                let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
                let ch = FdChannel::connect(&path).map_err(|e| format!("sending the descriptor to rank {q}: {e}"))?;
                ch.send(&[borrowed.as_fd()], &payload)
                    .map_err(|e| format!("sending the descriptor to rank {q}: {e}"))?;
                sent.push(ch);
            }
            Ok(g)
        } else {
            let s = server.take().ok_or("no socket for the descriptor")?;
            let size = made.first().filter(|m| m.len() == 8).ok_or("rank 0 sent no object size")?;
            let want: Vec<u8> = [&HANDLE_MAGIC[..], &size[..]].concat();
            let mut arrivals = s
                .gather(1, 1, |a| {
                    if a.payload == want && a.fds.len() == 1 {
                        Ok(())
                    } else {
                        Err(format!("{} payload bytes and {} descriptors", a.payload.len(), a.fds.len()))
                    }
                })
                .map_err(|e| format!("receiving the descriptor from rank 0: {e}"))?;
            let fd = arrivals.pop().and_then(|mut a| a.fds.pop()).ok_or("rank 0 sent no descriptor")?;
            let received = crate::multicast::Shareable::PosixFd(fd.into_raw_fd());
            // `import` closes the received descriptor whatever happens, then adds this rank's device.
            MulticastGroup::import(Arc::clone(&driver), device, &config, received, env).map_err(|e| e.to_string())
        }
    })();
    let joined_ok = joined.as_ref().map(|_| Vec::new()).map_err(Clone::clone);
    agree(bootstrap, joined_ok, "the multicast object's import").map_err(off)?;
    drop(sent);
    let mut group = joined.map_err(off)?;
    // Every rank has imported and added its device: the owner's descriptor can go, and memory can be bound.
    if rank == 0 {
        if let Err(e) = group.close_shareable() {
            tracing::warn!(error = %e, "closing the exported multicast descriptor");
        }
    }
    // 4. Every rank binds and maps its buffers; the ranks agree before any kernel may use them.
    let memory = bind_buffers(group, runtime, capacity).map_err(|e| format!("the multicast setup failed ({e})"));
    let bound = memory.as_ref().map(|_| Vec::new()).map_err(Clone::clone);
    agree(bootstrap, bound, "the multicast bindings").map_err(off)?;
    memory.map_err(off)
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
