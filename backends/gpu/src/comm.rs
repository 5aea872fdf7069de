//! The GPU communicator of every vendor: collectives through the NCCL/RCCL rank, algorithm eligibility, symmetric
//! windows, and the custom one-shot / two-shot kernels over peer access (one process, [`GpuComm::init_all`]) or
//! legacy IPC handles (one process per GPU, [`GpuComm::enable_custom_ipc`]), with graph-buffer registration and
//! the abort word.

use std::sync::Arc;

use anyccl_core::comm::{
    AllGatherArgs, AllReduceArgs, AllReduceCall, Bootstrap, BroadcastArgs, GraphRegistration, P2pArgs, RecvArgs,
    ReduceArgs, ReduceScatterArgs, SendArgs,
};
use anyccl_core::{
    Algorithm, Capabilities, CapabilityReport, CommBackend, DataType, Error, MemoryRuntime, ReduceOp, Result, Teardown,
    Vendor,
};
use anyccl_kernels_common as common;

use super::graph_inputs::{GraphInputs, Transport};
use super::kernels::{self, CustomKernels};
use super::push::{self, PushKernels, PushState};
use super::quant::QuantKernels;
use super::{BufferOf, GpuPlatform, StreamOf, LEGACY_HANDLE_BYTES};
use crate::device::GpuRuntime;
use anyccl_ccl::{CclComm, CclLibrary, CclReduction, UniqueId};

pub mod fused_call;
mod plans;

pub use plans::Plan;

/// Largest message the custom kernels take by default (their staging buffers' size); `ANYCCL_CUSTOM_MAX_BYTES`
/// changes it.
pub const DEFAULT_CUSTOM_MAX_BYTES: usize = 8 << 20;

/// Default most blocks per rank of a custom all-reduce; `ANYCCL_CUSTOM_MAX_BLOCKS` changes it (4 to
/// [`anyccl_kernels_common::MAX_BLOCKS`]; every rank must use the same value, which the IPC setup checks). On two
/// H200s (TP2, graph mode) 64 beat 36 by 10–12% from 2 to 8 MiB; 96 and 128 gained nothing more.
pub const DEFAULT_CUSTOM_MAX_BLOCKS: usize = 64;

/// What the custom one-shot / two-shot kernels need on one rank: its kernels, its staging, scratch and flag
/// buffers, and every rank's, as addressable from this device (peer access enabled, or IPC-mapped).
struct CustomState<P: GpuPlatform> {
    /// The push one-shot's kernels and receive buffers, or why it is off on this communicator (the same answer on
    /// every rank: decided from what the ranks exchanged).
    push: std::result::Result<PushState<P>, String>,
    /// The quantized two-shot kernels of `kernels`' module (valid while `kernels` lives).
    quant: QuantKernels<P>,
    kernels: CustomKernels<P>,
    _staging: BufferOf<P>,
    _scratch: BufferOf<P>,
    flags: BufferOf<P>,
    /// A stream of this rank's own for telling stuck kernels to stop ([`CustomState::stop_kernels`]), made up
    /// front so a failing wait creates nothing.
    control: StreamOf<P>,
    /// Peers' buffers opened through IPC (one process per GPU); closed when the state drops.
    _mappings: Vec<P::Mapping>,
    all_staging: Vec<u64>,
    all_scratch: Vec<u64>,
    all_flags: Vec<u64>,
    capacity: usize,
    /// Most blocks per launch ([`custom_max_blocks`]).
    max_blocks: usize,
    /// Input tables of captured calls, and their registration.
    graph: GraphInputs<P>,
}

impl<P: GpuPlatform> CustomState<P> {
    /// Tells this rank's custom kernels to stop waiting for peers (its flag array's abort word, written on the
    /// control stream); a kernel stuck on a dead peer then ends within milliseconds. For good: call it only when
    /// the custom kernels will not run again.
    fn stop_kernels(&self, runtime: &P::Runtime) -> Result<()> {
        super::stop_waiting::<P>(runtime, &self.flags, &self.control, STOP_WRITE_LIMIT)
    }
}

/// How long a failing wait waits for the write that stops the custom kernels.
const STOP_WRITE_LIMIT: std::time::Duration = std::time::Duration::from_millis(500);
/// How long a failing wait then waits for the stream to drain before it gives up on freeing the custom kernels'
/// buffers (freeing under a kernel that still runs would wait for it forever).
const STOP_DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The custom kernels' staging size: `ANYCCL_CUSTOM_MAX_BYTES` or the default, within 16 B..=1 GiB and rounded up
/// to 16 bytes (core's one reader of that variable, [`anyccl_core::env::custom_max_bytes`]).
pub fn custom_capacity(env: &dyn Fn(&str) -> Option<String>) -> Result<usize> {
    anyccl_core::env::custom_max_bytes(env, DEFAULT_CUSTOM_MAX_BYTES)
}

/// `ANYCCL_CUSTOM_MAX_BLOCKS` or the default; a value outside 4..=MAX_BLOCKS is an error.
pub fn custom_max_blocks(env: &dyn Fn(&str) -> Option<String>) -> Result<usize> {
    let Some(v) = env("ANYCCL_CUSTOM_MAX_BLOCKS") else {
        return Ok(DEFAULT_CUSTOM_MAX_BLOCKS);
    };
    let max = common::MAX_BLOCKS;
    v.trim().parse::<usize>().ok().filter(|b| (4..=max).contains(b)).ok_or_else(|| Error::Parse {
        what: "ANYCCL_CUSTOM_MAX_BLOCKS",
        input: v.clone(),
        expected: format!("a block count from 4 to {max}"),
    })
}

/// Blocks per rank for a message: one per 32 KiB, from 4 to `max` (the same on every rank, as the barriers need).
pub fn custom_blocks(bytes: usize, max: usize) -> u32 {
    (bytes / (32 << 10)).clamp(4, max) as u32
}

/// One rank's own custom-kernel resources: the kernels, staging and scratch of `capacity` bytes, and a zeroed
/// flag array.
type OwnBuffers<P> = (CustomKernels<P>, BufferOf<P>, BufferOf<P>, BufferOf<P>);

fn own_custom_buffers<P: GpuPlatform>(rt: &P::Runtime, capacity: usize) -> Result<OwnBuffers<P>> {
    let stream = P::stream(rt)?;
    let staging = rt.alloc(capacity)?;
    let scratch = rt.alloc(capacity)?;
    let mut flags = rt.alloc(common::FLAG_BYTES)?;
    rt.upload(&mut flags, &[0u8; common::FLAG_BYTES], &stream)?;
    let kernels = CustomKernels::load(rt)?;
    Ok((kernels, staging, scratch, flags))
}

/// Bytes of what each rank sends in the custom kernels' IPC setup: the staging, scratch and flag handles, the
/// staging size and block limit, then the push receive buffer's handle and the push limit (0: no push buffer).
const IPC_BLOB_BYTES: usize = 4 * LEGACY_HANDLE_BYTES + 24;

/// This rank's push one-shot part: its kernels (from `kernels`' module) and its initialised receive buffer, or why
/// not (a limit of 0, a platform that does not offer it, or a failure, whose partial buffer is freed).
fn own_push_part<P: GpuPlatform>(
    rt: &P::Runtime,
    kernels: &CustomKernels<P>,
    limit: usize,
) -> std::result::Result<(BufferOf<P>, PushKernels<P>), String> {
    if !P::ALGORITHMS.contains(&Algorithm::OneShotPush) {
        return Err(format!(
            "off: the {} backend does not offer it yet (its kernels are built into the module, but have not run on \
             this vendor's GPUs)",
            P::LABEL
        ));
    }
    if limit == 0 {
        return Err(format!("off: {} is 0", push::ENV_PUSH_MAX_BYTES));
    }
    let k = PushKernels::from_custom(kernels).map_err(|e| format!("off: its kernels: {e}"))?;
    let buf = push::own_receive_buffer::<P>(rt).map_err(|e| format!("off: its receive buffer: {e}"))?;
    Ok((buf, k))
}

/// How long a rank of a single-process communicator waits for the others while registering graph buffers.
const GRAPH_EXCHANGE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// One rank of a GPU communicator of platform `P` (`CudaComm`, `RocmComm`).
pub struct GpuComm<P: GpuPlatform> {
    /// The NCCL/RCCL communicator with this rank's place in it (rank, world) and its windows.
    ccl: CclComm,
    runtime: P::Runtime,
    arch: String,
    caps: Arc<CapabilityReport>,
    /// Four bytes for barriers, allocated up front so a barrier never allocates (it may run during capture).
    scratch: BufferOf<P>,
    /// The custom kernels' state, or why they cannot run on this communicator. Changed only through
    /// [`GpuComm::set_custom`].
    custom: std::result::Result<CustomState<P>, String>,
    /// Bumped by every change of `custom` ([`CommBackend::eligibility_epoch`]).
    custom_generation: u64,
    /// Whether the custom kernels were set up over IPC (one process per GPU): a sub-communicator then sets its
    /// own up the same way ([`CommBackend::split`]).
    custom_via_ipc: bool,
    /// Custom-kernel states turned off while graphs captured with them may still be replayed (a registration that
    /// left the ranks' input tables disagreeing): their buffers and tables live as long as the communicator, so
    /// such a replay never reads freed memory.
    retired: Vec<CustomState<P>>,
    /// The fused all-reduce + RMSNorm kernels ([`CommBackend::all_reduce_rmsnorm`]) of the custom kernels' module,
    /// set with the custom kernels' state by [`GpuComm::set_custom`]; `None` while those are off.
    fused: Option<super::fused::FusedKernels<P>>,
    /// The NVLS multicast plans' kernels and multicast memory, or why they are off ([`crate::nvls`]).
    nvls: crate::nvls::Nvls<P>,
}

impl<P: GpuPlatform> GpuComm<P> {
    /// Joins communicator `id` as `rank` of `world` on `device`.
    pub fn init_rank(
        lib: Arc<CclLibrary>,
        device: P::DeviceSpec,
        world: usize,
        rank: usize,
        id: &UniqueId,
        caps: Arc<CapabilityReport>,
    ) -> Result<Self> {
        let runtime = P::runtime(&device)?;
        runtime.bind()?;
        let ccl = CclComm::init_rank(lib, world, id, rank)?;
        Self::wrap(ccl, runtime, caps)
    }

    /// One communicator per listed device of this process (`ncclCommInitAll`), index = rank, with the custom
    /// kernels set up over peer access where every pair of devices has it.
    pub fn init_all(lib: Arc<CclLibrary>, devices: &[P::DeviceSpec], caps: Arc<CapabilityReport>) -> Result<Vec<Self>> {
        let runtimes: Vec<P::Runtime> = devices.iter().map(P::runtime).collect::<Result<_>>()?;
        let ordinals: Vec<i32> = devices.iter().map(P::ordinal).collect();
        let ccls = CclComm::init_all(&lib, &ordinals)?;
        let mut comms: Vec<Self> =
            ccls.into_iter().zip(runtimes).map(|(c, rt)| Self::wrap(c, rt, caps.clone())).collect::<Result<_>>()?;
        // NVLS multicast, behind its gate (the capability report's multicast); a failure only turns it off.
        let nvls = {
            let rts: Vec<&P::Runtime> = comms.iter().map(|c| &c.runtime).collect();
            crate::nvls::Nvls::setup_all(&rts, &caps, &anyccl_ccl::caps::process_env)
        };
        for (c, n) in comms.iter_mut().zip(nvls) {
            c.nvls = n;
        }
        // The custom kernels: every rank's buffers, peer access between every pair. A failure here only turns
        // them off for this communicator, with the reason.
        match Self::setup_custom(&comms) {
            Ok(states) => {
                let mut p2p = (*caps).clone();
                p2p.enable(Capabilities::P2P_ALL_PAIRS);
                let p2p = Arc::new(p2p);
                for (c, st) in comms.iter_mut().zip(states) {
                    c.set_custom(Ok(st));
                    c.caps = p2p.clone();
                }
            }
            Err(why) => {
                tracing::info!(%why, "custom all-reduce kernels off for this communicator");
                for c in &mut comms {
                    c.set_custom(Err(why.clone()));
                }
            }
        }
        Ok(comms)
    }

    /// Sets the custom kernels up for a communicator with one process per GPU: checks that every rank is on one
    /// host, allocates this rank's staging, scratch and flag buffers, exchanges their legacy IPC handles through
    /// `bootstrap` (the TCP rendezvous or the engine's own; its rank and world must be this communicator's), and
    /// opens every peer's. Collective: every rank calls it. A failure turns the kernels off for this communicator,
    /// with the reason, and is returned too (the communicator stays usable through the collective library).
    /// Settings and the host identity come from the process environment ([`Self::enable_custom_ipc_with_env`]).
    pub fn enable_custom_ipc(&mut self, bootstrap: &mut dyn Bootstrap) -> Result<()> {
        self.enable_custom_ipc_with_env(bootstrap, &anyccl_ccl::caps::process_env)
    }

    /// [`Self::enable_custom_ipc`] with the settings (`ANYCCL_CUSTOM_MAX_BYTES`, `ANYCCL_CUSTOM_MAX_BLOCKS`) and
    /// this rank's host identity override (`ANYCCL_HOST_ID`, [`anyccl_core::topology`]) read through `env`, so
    /// ranks of one process can act as if on different hosts (tests).
    pub fn enable_custom_ipc_with_env(
        &mut self,
        bootstrap: &mut dyn Bootstrap,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<()> {
        let r = self.setup_custom_ipc(bootstrap, env);
        self.finish_custom_ipc(r)
    }

    /// Wraps a collective-library communicator made elsewhere (the drop-in `libnccl` wraps its caller's
    /// `ncclComm_t` through [`CclComm::from_raw_borrowed`]) on `device`, as the rank of the world it knows, with the
    /// custom kernels off until [`Self::enable_custom_ipc_over_ccl`] (or [`Self::enable_custom_ipc`]) sets them up.
    /// Allocates a 4-byte barrier scratch on the device: not during capture.
    pub fn from_ccl(ccl: CclComm, device: &P::DeviceSpec, caps: Arc<CapabilityReport>) -> Result<Self> {
        let runtime = P::runtime(device)?;
        runtime.bind()?;
        Self::wrap(ccl, runtime, caps)
    }

    /// [`Self::enable_custom_ipc_with_env`] with the communicator itself as the bootstrap ([`crate::CclBootstrap`]
    /// on `stream`, a stream of this communicator's device): no port, no rendezvous. Collective: every rank calls
    /// it, outside capture; the outcome is agreed among the ranks (on or off everywhere).
    pub fn enable_custom_ipc_over_ccl(
        &mut self,
        stream: &StreamOf<P>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<()> {
        self.runtime.bind()?;
        let r = self.setup_custom_ipc(&mut crate::CclBootstrap::new(&self.ccl, &self.runtime, stream), env);
        self.finish_custom_ipc(r)
    }

    /// Tells this rank's custom kernels to stop waiting for their peers, for good (the abort word, written on a
    /// stream of the communicator's own and waited for): what an owner does before it aborts the communicator
    /// underneath, so a kernel stuck on a dead peer ends and its buffers can be freed. Nothing to do when the
    /// kernels are off. Not during capture.
    pub fn stop_custom_kernels(&self) -> Result<()> {
        match &self.custom {
            Ok(st) => st.stop_kernels(&self.runtime),
            Err(_) => Ok(()),
        }
    }

    /// The largest message the custom kernels take on this communicator (their staging size), when set up.
    pub fn custom_capacity(&self) -> Option<usize> {
        self.custom.as_ref().ok().map(|st| st.capacity)
    }

    /// Whether the push one-shot ([`Algorithm::OneShotPush`]) is set up on this communicator: `Ok(limit)` with
    /// the largest message it takes, and whether its launches use programmatic dependent launch (`Ok`) or why not;
    /// `Err` says why it is off.
    pub fn push_status(&self) -> std::result::Result<(usize, std::result::Result<(), &str>), &str> {
        let st = self.custom.as_ref().map_err(String::as_str)?;
        let p = st.push.as_ref().map_err(String::as_str)?;
        Ok((p.capacity, p.kernels.dependent_launch()))
    }

    /// Turns the custom kernels on with the state an IPC setup made, or off with its error (also returned).
    fn finish_custom_ipc(&mut self, r: Result<CustomState<P>>) -> Result<()> {
        match r {
            Ok(st) => {
                self.set_custom(Ok(st));
                self.custom_via_ipc = true;
                let mut caps = (*self.caps).clone();
                caps.enable(Capabilities::P2P_ALL_PAIRS);
                self.caps = Arc::new(caps);
                Ok(())
            }
            Err(e) => {
                self.set_custom(Err(e.to_string()));
                Err(e)
            }
        }
    }

    fn setup_custom_ipc(
        &self,
        bootstrap: &mut dyn Bootstrap,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<CustomState<P>> {
        let world = self.ccl.world();
        anyccl_core::comm::check_bootstrap(bootstrap, self.ccl.rank(), world)?;
        let off = |why: String| Error::AlgorithmNotEligible { algorithm: Algorithm::OneShot, why };
        // Legacy IPC handles open only on the host that made them: the ranks check they share one before any
        // handle is exported (the same answer on every rank, from one exchange).
        if let Err(why) = anyccl_core::topology::check_one_host(bootstrap, env)? {
            return Err(off(why));
        }
        // Every rank reaches every exchange below, even after a local failure, so nobody waits for a timeout:
        // failures travel as an empty handle.
        let local = (|| -> Result<_> {
            if let Some(why) = kernels::unavailable::<P>(world) {
                return Err(off(why));
            }
            let capacity = custom_capacity(env)?;
            let max_blocks = custom_max_blocks(env)?;
            let push_capacity = push::push_capacity(env)?;
            let (kernels, staging, scratch, flags) = own_custom_buffers::<P>(&self.runtime, capacity)?;
            let mut handles = Vec::with_capacity(IPC_BLOB_BYTES);
            for b in [&staging, &scratch, &flags] {
                handles.extend_from_slice(&P::ipc_export(&self.runtime, b.device_ptr())?);
            }
            handles.extend_from_slice(&(capacity as u64).to_le_bytes());
            handles.extend_from_slice(&(max_blocks as u64).to_le_bytes());
            // The push one-shot's receive buffer: a failure here turns only the push one-shot off (on every rank,
            // which learn it from the exchange: this rank sends a limit of 0).
            let own_push = own_push_part::<P>(&self.runtime, &kernels, push_capacity).and_then(|(buf, k)| {
                let handle = P::ipc_export(&self.runtime, buf.device_ptr()).map_err(|e| e.to_string())?;
                Ok((buf, k, handle))
            });
            match &own_push {
                Ok((_, _, handle)) => {
                    handles.extend_from_slice(handle);
                    handles.extend_from_slice(&(push_capacity as u64).to_le_bytes());
                }
                Err(_) => handles.extend_from_slice(&[0u8; LEGACY_HANDLE_BYTES + 8]),
            }
            Ok((kernels, staging, scratch, flags, capacity, max_blocks, handles, own_push))
        })();
        let mine: &[u8] = match &local {
            Ok(l) => &l.6,
            Err(_) => &[],
        };
        let all = anyccl_core::bootstrap::checked_all_gather(bootstrap, mine)?;
        let (kernels, staging, scratch, flags, capacity, max_blocks, _, own_push) = local?;
        let h = LEGACY_HANDLE_BYTES;
        if let Some(q) = all.iter().position(|a| a.len() != IPC_BLOB_BYTES) {
            return Err(off(format!("rank {q} could not set up its custom-kernel buffers")));
        }
        if all.iter().any(|a| a[3 * h..3 * h + 8] != (capacity as u64).to_le_bytes()) {
            return Err(off("ranks disagree on ANYCCL_CUSTOM_MAX_BYTES".into()));
        }
        if all.iter().any(|a| a[3 * h + 8..3 * h + 16] != (max_blocks as u64).to_le_bytes()) {
            return Err(off("ranks disagree on ANYCCL_CUSTOM_MAX_BLOCKS".into()));
        }
        // The push one-shot runs where every rank has its receive buffer and the same limit.
        let push_limit = |a: &[u8]| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&a[4 * h + 16..4 * h + 24]);
            u64::from_le_bytes(b)
        };
        let push_agreed: std::result::Result<_, String> = match own_push {
            Err(why) => Err(why),
            Ok(own) => match all.iter().position(|a| push_limit(a) == 0) {
                Some(q) => Err(format!(
                    "off: rank {q} has no push receive buffer ({} is 0 there, or its setup failed)",
                    push::ENV_PUSH_MAX_BYTES
                )),
                None if all.iter().any(|a| push_limit(a) != push_limit(&all[0])) => {
                    Err(format!("off: ranks disagree on {}", push::ENV_PUSH_MAX_BYTES))
                }
                None => Ok(own),
            },
        };
        // Up to here every rank has decided alike (from the same exchange). What follows can fail on one rank
        // alone (opening a peer's handle, a table, a stream): the ranks agree on the outcome before any of them
        // turns the kernels on, or one rank would choose them while another chose the library for the same call.
        let mapped = (|| -> Result<_> {
            let mut mappings = Vec::new();
            let (mut all_staging, mut all_scratch, mut all_flags) = (Vec::new(), Vec::new(), Vec::new());
            for (q, a) in all.iter().enumerate() {
                if q == self.ccl.rank() {
                    all_staging.push(staging.device_ptr());
                    all_scratch.push(scratch.device_ptr());
                    all_flags.push(flags.device_ptr());
                    continue;
                }
                let sizes = [capacity, capacity, common::FLAG_BYTES];
                for (k, size) in sizes.into_iter().enumerate() {
                    let mut handle = [0u8; LEGACY_HANDLE_BYTES];
                    handle.copy_from_slice(&a[k * h..(k + 1) * h]);
                    let m = P::ipc_open(&self.runtime, &handle, size)?;
                    let p = P::mapping_ptr(&m);
                    [&mut all_staging, &mut all_scratch, &mut all_flags][k].push(p);
                    mappings.push(m);
                }
            }
            let graph = GraphInputs::new(&self.runtime, all_staging.clone(), self.ccl.rank(), Transport::Ipc)?;
            let control = P::stream(&self.runtime)?;
            Ok((mappings, all_staging, all_scratch, all_flags, graph, control))
        })();
        // The peers' push receive buffers; a failure turns only the push one-shot off (agreed below).
        let push_mapped = match (&mapped, push_agreed) {
            (Ok(_), Ok((buf, kernels, _))) => {
                let peers = (|| -> Result<_> {
                    let (mut maps, mut all_recv) = (Vec::new(), Vec::new());
                    for (q, a) in all.iter().enumerate() {
                        if q == self.ccl.rank() {
                            all_recv.push(buf.device_ptr());
                            continue;
                        }
                        let mut handle = [0u8; LEGACY_HANDLE_BYTES];
                        handle.copy_from_slice(&a[3 * h + 16..4 * h + 16]);
                        let m = P::ipc_open(&self.runtime, &handle, push::PUSH_RECV_BYTES)?;
                        all_recv.push(P::mapping_ptr(&m));
                        maps.push(m);
                    }
                    Ok((maps, all_recv))
                })();
                // `buf` is dropped (freed) with the error when the peers' buffers could not be opened.
                peers
                    .map(|(maps, all_recv)| PushState {
                        kernels,
                        _recv: buf,
                        _mappings: maps,
                        all_recv,
                        capacity: usize::try_from(push_limit(&all[0])).unwrap_or(0),
                    })
                    .map_err(|e| format!("off: this rank could not map its peers' push receive buffers ({e})"))
            }
            (_, Err(why)) => Err(why),
            (Err(_), Ok(_)) => Err("off: the custom kernels' setup failed".to_owned()),
        };
        // Also the barrier: nobody launches before every rank has mapped everything.
        let agreed = anyccl_core::bootstrap::checked_all_gather(
            bootstrap,
            &[u8::from(mapped.is_ok()), u8::from(push_mapped.is_ok())],
        )?;
        let (mappings, all_staging, all_scratch, all_flags, graph, control) = mapped?;
        if let Some(q) = agreed.iter().position(|a| a.len() != 2 || a[0] != 1) {
            return Err(off(format!("rank {q} could not map its peers' custom-kernel buffers")));
        }
        // Every rank keeps the push one-shot only where every rank mapped its peers' receive buffers.
        let push = match (push_mapped, agreed.iter().position(|a| a[1] != 1)) {
            (Ok(p), None) => Ok(p),
            (Ok(_), Some(q)) => Err(format!("off: rank {q} could not map its peers' push receive buffers")),
            (Err(why), _) => Err(why),
        };
        Ok(CustomState {
            push,
            quant: QuantKernels::new(&kernels),
            kernels,
            _staging: staging,
            _scratch: scratch,
            flags,
            control,
            _mappings: mappings,
            all_staging,
            all_scratch,
            all_flags,
            capacity,
            max_blocks,
            graph,
        })
    }

    fn setup_custom(comms: &[Self]) -> std::result::Result<Vec<CustomState<P>>, String> {
        let world = comms.len();
        if let Some(why) = kernels::unavailable::<P>(world) {
            return Err(why);
        }
        let capacity = custom_capacity(&anyccl_ccl::caps::process_env).map_err(|e| e.to_string())?;
        let max_blocks = custom_max_blocks(&anyccl_ccl::caps::process_env).map_err(|e| e.to_string())?;
        for a in comms {
            for b in comms {
                let (oa, ob) = (a.runtime.ordinal(), b.runtime.ordinal());
                if oa != ob {
                    if !P::can_access_peer(&a.runtime, &b.runtime).map_err(|e| e.to_string())? {
                        return Err(format!("device {oa} cannot access device {ob} (no P2P)"));
                    }
                    P::enable_peer_access(&a.runtime, &b.runtime).map_err(|e| e.to_string())?;
                }
            }
        }
        let push_capacity = push::push_capacity(&anyccl_ccl::caps::process_env).map_err(|e| e.to_string())?;
        let mut parts = Vec::new();
        for c in comms {
            parts.push(own_custom_buffers::<P>(&c.runtime, capacity).map_err(|e| e.to_string())?);
        }
        // The push one-shot's receive buffers: a failure on any rank turns only the push one-shot off (on every
        // rank), and frees what the others made.
        let push_parts = parts
            .iter()
            .zip(comms)
            .map(|(p, c)| own_push_part::<P>(&c.runtime, &p.0, push_capacity))
            .collect::<std::result::Result<Vec<_>, String>>();
        let all_recv: Vec<u64> =
            push_parts.as_ref().map_or_else(|_| Vec::new(), |v| v.iter().map(|(b, _)| b.device_ptr()).collect());
        let mut push_parts: Vec<std::result::Result<_, String>> = match push_parts {
            Ok(v) => v.into_iter().map(Ok).collect(),
            Err(why) => (0..world).map(|_| Err(why.clone())).collect(),
        };
        let all_staging: Vec<u64> = parts.iter().map(|p| p.1.device_ptr()).collect();
        let all_scratch: Vec<u64> = parts.iter().map(|p| p.2.device_ptr()).collect();
        let all_flags: Vec<u64> = parts.iter().map(|p| p.3.device_ptr()).collect();
        let group = anyccl_core::bootstrap::LocalGroup::new(world, GRAPH_EXCHANGE_TIMEOUT);
        parts
            .into_iter()
            .zip(comms)
            .enumerate()
            .map(|(rank, ((kernels, staging, scratch, flags), comm))| {
                let transport = Transport::InProcess(group.member(rank));
                let graph =
                    GraphInputs::new(&comm.runtime, all_staging.clone(), rank, transport).map_err(|e| e.to_string())?;
                let push =
                    std::mem::replace(&mut push_parts[rank], Err(String::new())).map(|(buf, kernels)| PushState {
                        kernels,
                        _recv: buf,
                        _mappings: Vec::new(),
                        all_recv: all_recv.clone(),
                        capacity: push_capacity,
                    });
                Ok(CustomState {
                    push,
                    quant: QuantKernels::new(&kernels),
                    kernels,
                    _staging: staging,
                    _scratch: scratch,
                    flags,
                    control: P::stream(&comm.runtime).map_err(|e| e.to_string())?,
                    _mappings: Vec::new(),
                    all_staging: all_staging.clone(),
                    all_scratch: all_scratch.clone(),
                    all_flags: all_flags.clone(),
                    capacity,
                    max_blocks,
                    graph,
                })
            })
            .collect()
    }

    fn wrap(ccl: CclComm, runtime: P::Runtime, caps: Arc<CapabilityReport>) -> Result<Self> {
        let arch = P::arch(&runtime)?;
        let scratch = runtime.alloc(4)?;
        let custom = Err(format!(
            "the custom kernels need every rank's buffers mapped (set up by {}::init_all, or enable_custom_ipc)",
            P::COMM_NAME
        ));
        Ok(GpuComm {
            ccl,
            runtime,
            arch,
            caps,
            scratch,
            custom,
            custom_generation: 0,
            custom_via_ipc: false,
            retired: Vec::new(),
            fused: None,
            nvls: crate::nvls::Nvls::off(format!(
                "NVLS multicast is set up by {}::init_all (ranks of one process) or enable_nvls (one process per \
                 GPU), neither of which ran for this communicator",
                P::COMM_NAME
            )),
        })
    }

    /// Replaces the custom kernels' state; what the front-end remembered about eligibility is then stale.
    fn set_custom(&mut self, custom: std::result::Result<CustomState<P>, String>) {
        // Handles into the custom kernels' module (no second load); a state replaced here is kept (`retired`) or
        // dropped with its graphs' last use, and `fused` always follows the current one.
        self.fused = custom.as_ref().ok().map(|st| super::fused::FusedKernels::from_custom(&self.runtime, &st.kernels));
        self.custom = custom;
        self.custom_generation = self.custom_generation.wrapping_add(1);
    }

    /// The NCCL/RCCL communicator (rank, world, windows).
    pub fn ccl(&self) -> &CclComm {
        &self.ccl
    }

    /// The NCCL/RCCL communicator: [`Self::ccl`], under its former name.
    #[deprecated(note = "the rank is folded into the communicator: use GpuComm::ccl")]
    pub fn ccl_rank(&self) -> &CclComm {
        &self.ccl
    }

    /// Sets the NVLS multicast plans up for this rank of a communicator of one process per GPU, over `bootstrap`
    /// (the TCP rendezvous or the engine's own; its rank and world must be this communicator's): rank 0 creates the
    /// multicast object and hands it to every other rank as a file descriptor, each adds its device and binds its
    /// staging and flag buffers ([`GpuPlatform::nvls_setup_rank`]). Settings (`ANYCCL_CUSTOM_MAX_BYTES`, the
    /// staging size) are read through `env`. Collective: every rank calls it, outside capture; the outcome is
    /// agreed among the ranks, on everywhere or off everywhere. A refusal (the gate: multicast off in the
    /// capability report, `NCCL_NVLS_ENABLE=0`, `ANYCCL_DISABLE=multicast`, a device without multicast, ranks
    /// sharing a GPU or on two hosts) or a failure turns NVLS off for this communicator, with the reason, which is
    /// returned too ([`Error::AlgorithmNotEligible`]); the communicator stays usable through its other plans.
    pub fn enable_nvls_with_env(
        &mut self,
        bootstrap: &mut dyn Bootstrap,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<()> {
        anyccl_core::comm::check_bootstrap(bootstrap, self.ccl.rank(), self.ccl.world())?;
        self.runtime.bind()?;
        let nvls = crate::nvls::Nvls::setup_rank(&self.runtime, &self.caps, bootstrap, env);
        let r = match nvls.off_reason() {
            None => Ok(()),
            Some(why) => Err(Error::AlgorithmNotEligible { algorithm: Algorithm::NvlsBlockPipeline, why: why.into() }),
        };
        self.nvls = nvls;
        // What the front-end remembered about eligibility is stale now.
        self.custom_generation = self.custom_generation.wrapping_add(1);
        r
    }

    /// [`Self::enable_nvls_with_env`] with the settings read from the process environment.
    pub fn enable_nvls(&mut self, bootstrap: &mut dyn Bootstrap) -> Result<()> {
        self.enable_nvls_with_env(bootstrap, &anyccl_ccl::caps::process_env)
    }

    /// Why the NVLS multicast plans cannot run on this communicator, or `None` when they are set up.
    pub fn nvls_off(&self) -> Option<&str> {
        self.nvls.off_reason()
    }

    /// Why the custom kernels cannot run on this communicator, or `None` when they are set up.
    pub fn custom_kernels_off(&self) -> Option<&str> {
        self.custom.as_ref().err().map(String::as_str)
    }

    /// Allocates a symmetric buffer of `bytes` with `ncclMemAlloc` and registers it as a window
    /// (`NCCL_WIN_COLL_SYMMETRIC`). Collective: every rank calls it with the same size. Refused while `stream`
    /// is being captured (allocation and registration are not capture-safe), and where windows are off (RCCL
    /// without the window symbols, or with `NCCL_CUMEM_ENABLE` unset): the error carries the reason.
    pub fn symmetric_buffer(&self, bytes: usize, stream: &StreamOf<P>) -> Result<SymmetricBuffer<P>> {
        crate::device::symmetric_buffer(&self.ccl, P::NAME, &self.caps, &self.runtime, bytes, stream)
    }

    /// What every custom kernel's launch starts with ([`plans`]): the custom kernels' state (or the refusal,
    /// naming the plan's algorithm), the device made current, and the call's pointers; `None` for an empty
    /// message, which launches nothing (every rank of the collective skips it alike, the same count, so the
    /// kernels' barrier epochs stay in step).
    ///
    /// Eager, the kernels copy this rank's input into its staging buffer, which the peers read; during capture,
    /// the one-shot and two-shot read it through a table in device memory that starts as the same staging copy
    /// and switches to reading every rank's input directly once
    /// [`Communicator::register_graph_buffers`](anyccl_core::Communicator::register_graph_buffers) has run.
    /// Stream-ordered and capture-safe (nothing is allocated).
    fn custom_launch(&mut self, plan: &Plan, args: &AllReduceArgs<'_, Self>) -> Result<Option<CustomLaunch<'_, P>>> {
        let algorithm = plan.algorithm();
        let rank = self.ccl.rank();
        let st = self.custom.as_mut().map_err(|why| Error::AlgorithmNotEligible { algorithm, why: why.clone() })?;
        let bytes = args.bytes();
        if bytes == 0 {
            return Ok(None);
        }
        self.runtime.bind()?;
        let (src, dst) = anyccl_ccl::io_ptrs(args.bufs());
        Ok(Some((LaunchIo { src: src as u64, dst: dst as u64, rank, bytes }, st, &self.runtime)))
    }

    /// Makes the device current where the collective library does not do it itself.
    fn bind_for_ccl(&self) -> Result<()> {
        if P::CCL_BINDS_DEVICE {
            return Ok(());
        }
        self.runtime.bind()
    }
}

/// What a custom kernel's launch works with ([`GpuComm::custom_launch`]): the call's pointers and sizes, the custom
/// kernels' state and the device runtime.
type CustomLaunch<'a, P> = (LaunchIo, &'a mut CustomState<P>, &'a <P as GpuPlatform>::Runtime);

/// A custom kernel launch's own pointers and sizes ([`GpuComm::custom_launch`]).
struct LaunchIo {
    /// This rank's input and output (equal in place).
    src: u64,
    dst: u64,
    rank: usize,
    bytes: usize,
}

/// Device memory from `ncclMemAlloc`, registered as a symmetric window on its communicator
/// ([`GpuComm::symmetric_buffer`]).
pub type SymmetricBuffer<P> = anyccl_ccl::SymmetricBuffer<BufferOf<P>>;

impl<P: GpuPlatform> CommBackend for GpuComm<P> {
    type Reduction = CclReduction;
    type Plan = Plan;
    type Runtime = P::Runtime;

    fn runtime(&self) -> &P::Runtime {
        &self.runtime
    }

    fn name(&self) -> &'static str {
        P::NAME
    }

    fn rank(&self) -> usize {
        self.ccl.rank()
    }

    fn world_size(&self) -> usize {
        self.ccl.world()
    }

    fn vendor(&self) -> Vendor {
        P::VENDOR
    }

    fn arch(&self) -> &str {
        &self.arch
    }

    fn capabilities(&self) -> &CapabilityReport {
        &self.caps
    }

    fn allreduce_algorithms(&self) -> &[Algorithm] {
        P::ALGORITHMS
    }

    fn allreduce_eligible(&self, algorithm: Algorithm, call: &AllReduceCall) -> std::result::Result<Plan, String> {
        // The one place an algorithm is matched after selection: the table gives its family, whose eligibility
        // makes the plan the launch runs.
        plans::registered::<P>(algorithm).eligible(self, algorithm, call)
    }

    fn check_reduction(&self, dtype: DataType, op: ReduceOp) -> Result<CclReduction> {
        self.ccl.check_reduction(dtype, op)
    }

    fn all_reduce(&mut self, args: AllReduceArgs<'_, Self>) -> Result<()> {
        let plan = *args.plan();
        let family = plans::registered::<P>(plan.algorithm());
        // SAFETY: `args` was made by this backend's `Communicator` with the plan this backend's eligibility
        // returned for its call, remembered only while the eligibility epoch is unchanged.
        unsafe { family.launch(self, &plan, args) }.map_err(|e| plans::name_algorithm(plan.algorithm(), e))
    }

    fn all_gather(&mut self, args: AllGatherArgs<'_, Self>) -> Result<()> {
        self.bind_for_ccl()?;
        // SAFETY: as in `all_reduce`.
        unsafe { self.ccl.all_gather(args) }
    }

    fn reduce_scatter(&mut self, args: ReduceScatterArgs<'_, Self>) -> Result<()> {
        self.bind_for_ccl()?;
        // SAFETY: as in `all_reduce`.
        unsafe { self.ccl.reduce_scatter(args) }
    }

    fn broadcast(&mut self, args: BroadcastArgs<'_, Self>) -> Result<()> {
        self.bind_for_ccl()?;
        // SAFETY: as in `all_reduce`.
        unsafe { self.ccl.broadcast(args) }
    }

    fn reduce(&mut self, args: ReduceArgs<'_, Self>) -> Result<()> {
        self.bind_for_ccl()?;
        // SAFETY: as in `all_reduce`.
        unsafe { self.ccl.reduce(args) }
    }

    fn send(&mut self, args: SendArgs<'_, Self>) -> Result<()> {
        self.bind_for_ccl()?;
        // SAFETY: as in `all_reduce`.
        unsafe { self.ccl.send(args) }
    }

    fn recv(&mut self, args: RecvArgs<'_, Self>) -> Result<()> {
        self.bind_for_ccl()?;
        // SAFETY: as in `all_reduce`.
        unsafe { self.ccl.recv(args) }
    }

    /// Registers the inputs of custom all-reduces captured in graphs since the last call, so that replays read
    /// every rank's input directly instead of copying it through staging (through
    /// [`Communicator::register_graph_buffers`](anyccl_core::Communicator::register_graph_buffers)).
    ///
    /// `bootstrap` is how a one-process-per-GPU communicator's ranks reach each other ([`crate::multi_process`]): the
    /// inputs' IPC handles travel through it; communicators of one process ([`GpuComm::init_all`]) exchange
    /// pointers among themselves and take `None`. Inputs that cannot be shared (not `cuMemAlloc`/`hipMalloc`
    /// memory, e.g. cuMem/VMM allocations) stay on staging, still correct; the result lists them with the reason.
    ///
    /// A table write that fails on one rank fails the registration on every rank, with every rank's tables put
    /// back to staging. Where that revert fails somewhere too, the ranks' tables may disagree: the custom kernels
    /// are then turned off on every rank (each learns it from the same exchange), and their buffers are kept for
    /// the communicator's life in case a graph captured with them is replayed anyway.
    fn register_graph_buffers(&mut self, bootstrap: Option<&mut dyn Bootstrap>) -> Result<GraphRegistration> {
        let Ok(st) = &mut self.custom else {
            // The custom kernels are off on every rank alike (their setup is collective): nothing was captured.
            return Ok(GraphRegistration::default());
        };
        let r = st.graph.register(bootstrap);
        if let Some(why) = st.graph.unusable() {
            let why = format!("off: a graph-buffer registration left the input tables unusable ({why})");
            tracing::error!(%why, "custom all-reduce kernels off");
            if let Ok(st) = std::mem::replace(&mut self.custom, Err(why.clone())) {
                self.retired.push(st);
            }
            // Through `set_custom`, so the front-end's remembered decision is dropped too.
            self.set_custom(Err(why));
        }
        r
    }

    fn pending_graph_buffers(&self) -> usize {
        self.custom.as_ref().map_or(0, |st| st.graph.pending())
    }

    fn capture_independent(&self, algorithm: Algorithm) -> bool {
        // No eligibility answer reads `call.capturing`; the library's calls handle capture themselves, while the
        // custom kernels choose their input table by it.
        plans::registered::<P>(algorithm).capture_independent()
    }

    fn eligibility_epoch(&self) -> Option<u64> {
        // Eligibility reads the call, the capabilities (fixed once wrapped), the custom kernels' state and the
        // registered windows: the two generations, both only ever growing, change when either of those does.
        Some(self.custom_generation.wrapping_add(self.ccl.windows_generation()))
    }

    fn wait(&mut self, stream: &StreamOf<P>, timeout: std::time::Duration) -> Result<()> {
        // The front-end has refused a capturing stream, and the query refuses one too, before the library is asked
        // anything. Before the library's abort (which frees device memory and so waits for the device), the custom
        // kernels are told to stop waiting for peers: the library's abort stops its kernels, the abort word ours.
        let (custom, runtime) = (&self.custom, &self.runtime);
        let r = self.ccl.wait_or_abort(timeout, &mut || anyccl_ccl::CclStream::query(stream), &mut || {
            if let Ok(st) = custom {
                if let Err(e) = st.stop_kernels(runtime) {
                    tracing::error!(error = %e, "could not tell the custom all-reduce kernels to stop");
                }
            }
        });
        // The custom kernels go off only with the communicator itself: once aborted, every call on this rank
        // fails, so no call runs here with a selection that differs from the peers'. Any other error (a query
        // that failed) changes nothing: turning them off on this rank alone would make it choose the library where
        // its peers still choose the custom kernels, and both would wait for each other.
        if self.ccl.is_aborted() && self.custom.is_ok() {
            let why = "off: an earlier wait failed (a peer died or timed out)".to_string();
            // Through `set_custom`, so the front-end's remembered decision is dropped too.
            let old = std::mem::replace(&mut self.custom, Err(why.clone()));
            self.set_custom(Err(why));
            if let Ok(st) = old {
                // A query error counts as not drained.
                if matches!(super::done_within(stream, STOP_DRAIN_LIMIT), Ok(true)) {
                    drop(st);
                } else {
                    // Freeing the buffers or unloading the module under a kernel that still runs would wait for it
                    // forever, so they are leaked.
                    std::mem::forget(st);
                    tracing::error!(
                        "the stream had not drained {STOP_DRAIN_LIMIT:?} after the custom kernels were told to \
                         stop; their buffers are leaked"
                    );
                }
            }
        }
        r
    }

    fn query(&mut self, stream: &StreamOf<P>) -> Result<bool> {
        // The stream's query refuses a capturing stream before the library is asked anything.
        self.ccl.query(stream)
    }

    fn close_in_background(self) -> Teardown {
        // The library's destroy on a thread of its own; the barrier scratch, the custom kernels' buffers and
        // module, and last the device runtime are released after it, on that thread (a plain drop also destroys
        // the communicator first).
        let GpuComm {
            ccl,
            runtime,
            arch: _,
            caps: _,
            scratch,
            custom,
            custom_generation: _,
            custom_via_ipc: _,
            retired,
            fused,
            nvls,
        } = self;
        ccl.close_in_background_with((scratch, custom, fused, retired, nvls, runtime))
    }

    fn rmsnorm_forms(&self) -> &[anyccl_core::RmsNormForm] {
        &anyccl_core::RmsNormForm::ALL
    }

    fn rmsnorm_eligible(
        &self,
        form: anyccl_core::RmsNormForm,
        call: &anyccl_core::fused::RmsNormCall,
    ) -> std::result::Result<(), String> {
        self.fused_eligible(form, call)
    }

    fn all_reduce_rmsnorm(&mut self, args: anyccl_core::fused::RmsNormArgs<'_, Self>) -> Result<()> {
        self.run_rmsnorm(args)
    }

    fn p2p(&mut self, args: P2pArgs<'_, '_, Self>) -> Result<()> {
        self.bind_for_ccl()?;
        // SAFETY: `args` was made by this backend's `Communicator` after validating every operation against this
        // rank (each buffer holds its elements on this device; receive buffers overlap nothing else of the group).
        unsafe { self.ccl.p2p(args) }
    }

    /// A sub-communicator over `ncclCommSplit`, with its own custom-kernel state: where this communicator's
    /// kernels run over IPC (one process per GPU), the sub-communicator sets its own up the same way, with the
    /// handles carried by the sub-communicator itself ([`crate::CclBootstrap`]); otherwise (one process, or the
    /// kernels off here) they are off on it with the reason, on every rank of it alike.
    fn split(&mut self, color: Option<u32>, key: u32) -> Result<Option<Self>> {
        self.runtime.bind()?;
        let Some(ccl) = self.ccl.split(&self.caps, color, key)? else { return Ok(None) };
        let mut sub = Self::wrap(ccl, self.runtime.clone(), self.caps.clone())?;
        if !self.custom_via_ipc || sub.ccl.world() < 2 {
            sub.set_custom(Err(format!(
                "off on this sub-communicator: {}",
                if self.custom_via_ipc {
                    "it has one rank".to_owned()
                } else {
                    match &self.custom {
                        Ok(_) => "its parent's kernels run over peer access within one process".to_owned(),
                        Err(why) => format!("they are off on its parent ({why})"),
                    }
                }
            )));
            return Ok(Some(sub));
        }
        // Every rank of the sub-communicator reaches this setup (their parent's kernels all run over IPC: the
        // parent's setup was agreed by every rank), and its outcome is agreed among them.
        let stream = P::stream(&sub.runtime)?;
        let r = sub.setup_custom_ipc(
            &mut crate::CclBootstrap::new(&sub.ccl, &sub.runtime, &stream),
            &anyccl_ccl::caps::process_env,
        );
        if let Err(e) = sub.finish_custom_ipc(r) {
            tracing::info!(error = %e, "custom all-reduce kernels off for this sub-communicator");
        }
        Ok(Some(sub))
    }

    fn barrier(&mut self, stream: &StreamOf<P>) -> Result<()> {
        self.runtime.bind()?;
        // SAFETY: a 4-byte buffer of this device; a stream of this device.
        unsafe { self.ccl.barrier(&self.scratch, stream) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let owned: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| owned.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn custom_kernel_settings_default_parse_and_refuse_bad_values() {
        assert_eq!(custom_capacity(&env(&[])).expect("default"), DEFAULT_CUSTOM_MAX_BYTES);
        assert_eq!(custom_capacity(&env(&[("ANYCCL_CUSTOM_MAX_BYTES", "64MiB")])).expect("64 MiB"), 64 << 20);
        assert_eq!(custom_capacity(&env(&[("ANYCCL_CUSTOM_MAX_BYTES", "1000")])).expect("rounded"), 1008);
        for bad in ["lots", "8", "-1MiB", "2GiB"] {
            let e = custom_capacity(&env(&[("ANYCCL_CUSTOM_MAX_BYTES", bad)])).expect_err("refused");
            assert!(e.to_string().contains("ANYCCL_CUSTOM_MAX_BYTES"), "{e}");
        }
        assert_eq!(custom_max_blocks(&env(&[])).expect("default"), DEFAULT_CUSTOM_MAX_BLOCKS);
        assert_eq!(custom_max_blocks(&env(&[("ANYCCL_CUSTOM_MAX_BLOCKS", "48")])).expect("48"), 48);
        for bad in ["3", "129", "many", ""] {
            let e = custom_max_blocks(&env(&[("ANYCCL_CUSTOM_MAX_BLOCKS", bad)])).expect_err("refused");
            assert!(e.to_string().contains("from 4 to 128"), "{e}");
        }
    }

    #[test]
    fn blocks_grow_with_the_message_within_the_bounds() {
        assert_eq!(custom_blocks(16, 64), 4);
        assert_eq!(custom_blocks(1 << 20, 64), 32);
        assert_eq!(custom_blocks(8 << 20, 64), 64);
        assert_eq!(custom_blocks(8 << 20, 36), 36);
    }
}
