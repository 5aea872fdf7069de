//! The CUDA communicator: NCCL collectives through the loader's table, algorithm eligibility, symmetric windows.

use std::sync::Arc;

use anyccl_ccl::{CclComm, CclLibrary, CclRank, CclReduction, UniqueId};
use anyccl_core::comm::{
    AllGatherArgs, AllReduceArgs, AllReduceCall, Bootstrap, BroadcastArgs, GraphRegistration, RecvArgs, ReduceArgs,
    ReduceScatterArgs, SendArgs,
};
use anyccl_core::{
    Algorithm, Capabilities, CapabilityReport, CommBackend, DataType, Error, MemoryRuntime, ReduceOp, Result, Teardown,
    Vendor,
};

use crate::runtime::{CudaRuntime, CudaStream, DeviceBuffer};

/// The all-reduce algorithms of the CUDA backend. The NVLS ones are listed so that selection and the bench say
/// why they cannot run (multicast off, or not wired yet); they are never eligible today.
pub const ALGORITHMS: [Algorithm; 7] = [
    Algorithm::Ccl,
    Algorithm::CclSymmetric,
    Algorithm::OneShot,
    Algorithm::TwoShot,
    Algorithm::NvlsZeroCopy,
    Algorithm::NvlsWarpPipeline,
    Algorithm::NvlsBlockPipeline,
];

/// Largest message the custom kernels take by default (their staging buffers' size); `ANYCCL_CUSTOM_MAX_BYTES`
/// changes it.
pub const DEFAULT_CUSTOM_MAX_BYTES: usize = 8 << 20;

/// What the custom one-shot / two-shot kernels need on one rank: its kernels, its staging, scratch and flag
/// buffers, and every rank's, as addressable from this device (peer access enabled).
struct CustomState {
    kernels: crate::custom::CustomKernels,
    _staging: DeviceBuffer,
    _scratch: DeviceBuffer,
    flags: DeviceBuffer,
    /// A stream of this rank's own for telling stuck kernels to stop ([`CustomState::stop_kernels`]), made up
    /// front so a failing wait creates nothing.
    control: CudaStream,
    /// Peers' buffers opened through IPC (one process per GPU); closed when the state drops.
    _mappings: Vec<crate::ipc::LegacyMapping>,
    all_staging: Vec<u64>,
    all_scratch: Vec<u64>,
    all_flags: Vec<u64>,
    capacity: usize,
    /// Most blocks per launch ([`custom_max_blocks`]).
    max_blocks: usize,
    /// Input tables of captured calls, and their registration.
    graph: crate::graph_inputs::GraphInputs,
}

impl CustomState {
    /// Tells this rank's custom kernels to stop waiting for peers (its flag array's abort word, written on the
    /// control stream); a kernel stuck on a dead peer then ends within milliseconds. For good: call it only when
    /// the custom kernels will not run again.
    fn stop_kernels(&self) -> Result<()> {
        crate::custom::stop_waiting(&self.flags, &self.control, STOP_WRITE_LIMIT)
    }
}

/// How long a failing wait waits for the write that stops the custom kernels.
const STOP_WRITE_LIMIT: std::time::Duration = std::time::Duration::from_millis(500);
/// How long a failing wait then waits for the stream to drain before it gives up on freeing the custom kernels'
/// buffers (freeing under a kernel that still runs would wait for it forever).
const STOP_DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The custom kernels' staging size: `ANYCCL_CUSTOM_MAX_BYTES` or the default, rounded up to 16 bytes.
fn custom_capacity(env: &dyn Fn(&str) -> Option<String>) -> Result<usize> {
    let Some(v) = env("ANYCCL_CUSTOM_MAX_BYTES") else {
        return Ok(DEFAULT_CUSTOM_MAX_BYTES);
    };
    let bad = || Error::Parse {
        what: "ANYCCL_CUSTOM_MAX_BYTES",
        input: v.clone(),
        expected: "a size of at least 16 bytes, such as 8MiB or 67108864".into(),
    };
    let bytes = anyccl_core::units::parse_bytes(&v).map_err(|_| bad())?;
    let bytes = usize::try_from(bytes).map_err(|_| bad())?;
    if bytes < 16 {
        return Err(bad());
    }
    Ok(bytes.div_ceil(16) * 16)
}

/// One rank's own custom-kernel resources: the kernels, staging and scratch of `capacity` bytes, and a zeroed
/// flag array.
fn own_custom_buffers(
    rt: &CudaRuntime,
    capacity: usize,
) -> Result<(crate::custom::CustomKernels, DeviceBuffer, DeviceBuffer, DeviceBuffer)> {
    let stream = rt.stream()?;
    let staging = rt.alloc(capacity)?;
    let scratch = rt.alloc(capacity)?;
    let mut flags = rt.alloc(anyccl_kernels_cuda::FLAG_BYTES)?;
    rt.upload(&mut flags, &[0u8; anyccl_kernels_cuda::FLAG_BYTES], &stream)?;
    let kernels = crate::custom::CustomKernels::load(rt.context())?;
    Ok((kernels, staging, scratch, flags))
}

/// How long a rank of a single-process communicator waits for the others while registering graph buffers.
const GRAPH_EXCHANGE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// Default most blocks per rank of a custom all-reduce; `ANYCCL_CUSTOM_MAX_BLOCKS` changes it (4 to
/// [`anyccl_kernels_cuda::MAX_BLOCKS`]; every rank must use the same value, which the IPC setup checks). On two
/// H200s (TP2, graph mode) 64 beat 36 by 10–12% from 2 to 8 MiB; 96 and 128 gained nothing more.
pub const DEFAULT_CUSTOM_MAX_BLOCKS: usize = 64;

/// `ANYCCL_CUSTOM_MAX_BLOCKS` or the default; a value outside 4..=MAX_BLOCKS is an error.
fn custom_max_blocks(env: &dyn Fn(&str) -> Option<String>) -> Result<usize> {
    let Some(v) = env("ANYCCL_CUSTOM_MAX_BLOCKS") else {
        return Ok(DEFAULT_CUSTOM_MAX_BLOCKS);
    };
    let max = anyccl_kernels_cuda::MAX_BLOCKS;
    v.trim().parse::<usize>().ok().filter(|b| (4..=max).contains(b)).ok_or_else(|| Error::Parse {
        what: "ANYCCL_CUSTOM_MAX_BLOCKS",
        input: v.clone(),
        expected: format!("a block count from 4 to {max}"),
    })
}

/// Blocks per rank for a message: one per 32 KiB, from 4 to `max` (the same on every rank, as the barriers need).
fn custom_blocks(bytes: usize, max: usize) -> u32 {
    (bytes / (32 << 10)).clamp(4, max) as u32
}

/// One rank of a CUDA communicator.
pub struct CudaComm {
    /// The NCCL communicator with this rank's place in it (rank, world) and its windows.
    ccl: CclRank,
    runtime: CudaRuntime,
    arch: String,
    caps: Arc<CapabilityReport>,
    /// Four bytes for barriers, allocated up front so a barrier never allocates (it may run during capture).
    scratch: DeviceBuffer,
    /// The custom kernels' state, or why they cannot run on this communicator. Changed only through
    /// [`CudaComm::set_custom`].
    custom: std::result::Result<CustomState, String>,
    /// Bumped by every change of `custom` ([`CommBackend::eligibility_epoch`]).
    custom_generation: u64,
}

impl CudaComm {
    /// Joins communicator `id` as `rank` of `world` on device `ordinal`.
    pub fn init_rank(
        lib: Arc<CclLibrary>,
        ordinal: i32,
        world: usize,
        rank: usize,
        id: &UniqueId,
        caps: Arc<CapabilityReport>,
    ) -> Result<Self> {
        let runtime = CudaRuntime::new(ordinal)?;
        runtime.context().bind()?;
        let ccl = CclComm::init_rank(lib, world, id, rank)?;
        Self::wrap(ccl, runtime, rank, world, ordinal, caps)
    }

    /// One communicator per listed device of this process (`ncclCommInitAll`), index = rank.
    pub fn init_all(lib: Arc<CclLibrary>, ordinals: &[i32], caps: Arc<CapabilityReport>) -> Result<Vec<Self>> {
        let runtimes: Vec<CudaRuntime> = ordinals.iter().map(|o| CudaRuntime::new(*o)).collect::<Result<_>>()?;
        let ccls = anyccl_ccl::init_all(&lib, ordinals)?;
        let world = ordinals.len();
        let mut comms: Vec<Self> = ccls
            .into_iter()
            .zip(runtimes)
            .zip(ordinals)
            .enumerate()
            .map(|(rank, ((c, rt), o))| Self::wrap(c, rt, rank, world, *o, caps.clone()))
            .collect::<Result<_>>()?;
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

    /// Sets the custom kernels up for a communicator with one process per GPU: allocates this rank's staging,
    /// scratch and flag buffers, exchanges their legacy IPC handles through `bootstrap` (the TCP rendezvous or the
    /// engine's own; its rank and world must be this communicator's), and opens every peer's. Collective: every
    /// rank calls it. A failure turns the kernels off for this communicator, with the reason, and is returned too
    /// (the communicator stays usable through NCCL).
    pub fn enable_custom_ipc(&mut self, bootstrap: &mut dyn Bootstrap) -> Result<()> {
        let r = self.setup_custom_ipc(bootstrap);
        match r {
            Ok(st) => {
                self.set_custom(Ok(st));
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

    fn setup_custom_ipc(&self, bootstrap: &mut dyn Bootstrap) -> Result<CustomState> {
        let world = self.ccl.world();
        anyccl_core::comm::check_bootstrap(bootstrap, self.ccl.rank(), world)?;
        let off = |why: String| Error::AlgorithmNotEligible { algorithm: Algorithm::OneShot, why };
        // Every rank reaches every exchange below, even after a local failure, so nobody waits for a timeout:
        // failures travel as an empty handle.
        let local = (|| -> Result<_> {
            if let Some(why) = crate::custom::unavailable(world) {
                return Err(off(why));
            }
            let capacity = custom_capacity(&anyccl_ccl::caps::process_env)?;
            let max_blocks = custom_max_blocks(&anyccl_ccl::caps::process_env)?;
            let (kernels, staging, scratch, flags) = own_custom_buffers(&self.runtime, capacity)?;
            let ctx = self.runtime.context();
            let mut handles = Vec::with_capacity(3 * crate::ipc::LEGACY_HANDLE_BYTES + 16);
            for b in [&staging, &scratch, &flags] {
                handles.extend_from_slice(&crate::ipc::export_legacy(ctx, b)?);
            }
            handles.extend_from_slice(&(capacity as u64).to_le_bytes());
            handles.extend_from_slice(&(max_blocks as u64).to_le_bytes());
            Ok((kernels, staging, scratch, flags, capacity, max_blocks, handles))
        })();
        let mine: &[u8] = match &local {
            Ok(l) => &l.6,
            Err(_) => &[],
        };
        let all = anyccl_core::bootstrap::checked_all_gather(bootstrap, mine)?;
        let (kernels, staging, scratch, flags, capacity, max_blocks, _) = local?;
        let h = crate::ipc::LEGACY_HANDLE_BYTES;
        if let Some(q) = all.iter().position(|a| a.len() != 3 * h + 16) {
            return Err(off(format!("rank {q} could not set up its custom-kernel buffers")));
        }
        if all.iter().any(|a| a[3 * h..3 * h + 8] != (capacity as u64).to_le_bytes()) {
            return Err(off("ranks disagree on ANYCCL_CUSTOM_MAX_BYTES".into()));
        }
        if all.iter().any(|a| a[3 * h + 8..] != (max_blocks as u64).to_le_bytes()) {
            return Err(off("ranks disagree on ANYCCL_CUSTOM_MAX_BLOCKS".into()));
        }
        // Up to here every rank has decided alike (from the same exchange). What follows can fail on one rank
        // alone (opening a peer's handle, a table, a stream): the ranks agree on the outcome before any of them
        // turns the kernels on, or one rank would choose them while another chose NCCL for the same call.
        let ctx = self.runtime.context();
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
                let sizes = [capacity, capacity, anyccl_kernels_cuda::FLAG_BYTES];
                for (k, size) in sizes.into_iter().enumerate() {
                    let m = crate::ipc::LegacyMapping::open(ctx, &a[k * h..(k + 1) * h], size)?;
                    let p = m.view().device_ptr();
                    [&mut all_staging, &mut all_scratch, &mut all_flags][k].push(p);
                    mappings.push(m);
                }
            }
            let graph = crate::graph_inputs::GraphInputs::new(
                ctx,
                all_staging.clone(),
                self.ccl.rank(),
                crate::graph_inputs::Transport::Ipc,
            )?;
            let control = self.runtime.stream()?;
            Ok((mappings, all_staging, all_scratch, all_flags, graph, control))
        })();
        // Also the barrier: nobody launches before every rank has mapped everything.
        let agreed = anyccl_core::bootstrap::checked_all_gather(bootstrap, &[u8::from(mapped.is_ok())])?;
        let (mappings, all_staging, all_scratch, all_flags, graph, control) = mapped?;
        if let Some(q) = agreed.iter().position(|a| a.as_slice() != [1]) {
            return Err(off(format!("rank {q} could not map its peers' custom-kernel buffers")));
        }
        Ok(CustomState {
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

    fn setup_custom(comms: &[Self]) -> std::result::Result<Vec<CustomState>, String> {
        let world = comms.len();
        if let Some(why) = crate::custom::unavailable(world) {
            return Err(why);
        }
        let capacity = custom_capacity(&anyccl_ccl::caps::process_env).map_err(|e| e.to_string())?;
        let max_blocks = custom_max_blocks(&anyccl_ccl::caps::process_env).map_err(|e| e.to_string())?;
        let ctxs: Vec<_> = comms.iter().map(|c| c.runtime.context().clone()).collect();
        for a in &ctxs {
            for b in &ctxs {
                if a.ordinal() != b.ordinal() {
                    if !a.can_access_peer(b).map_err(|e| e.to_string())? {
                        return Err(format!("device {} cannot access device {} (no P2P)", a.ordinal(), b.ordinal()));
                    }
                    a.enable_peer_access(b).map_err(|e| e.to_string())?;
                }
            }
        }
        let mut parts = Vec::new();
        for c in comms {
            parts.push(own_custom_buffers(&c.runtime, capacity).map_err(|e| e.to_string())?);
        }
        let all_staging: Vec<u64> = parts.iter().map(|p| p.1.device_ptr()).collect();
        let all_scratch: Vec<u64> = parts.iter().map(|p| p.2.device_ptr()).collect();
        let all_flags: Vec<u64> = parts.iter().map(|p| p.3.device_ptr()).collect();
        let group = anyccl_core::bootstrap::LocalGroup::new(world, GRAPH_EXCHANGE_TIMEOUT);
        parts
            .into_iter()
            .zip(comms)
            .enumerate()
            .map(|(rank, ((kernels, staging, scratch, flags), comm))| {
                let transport = crate::graph_inputs::Transport::InProcess(group.member(rank));
                let ctx = comm.runtime.context();
                let graph = crate::graph_inputs::GraphInputs::new(ctx, all_staging.clone(), rank, transport)
                    .map_err(|e| e.to_string())?;
                Ok(CustomState {
                    kernels,
                    _staging: staging,
                    _scratch: scratch,
                    flags,
                    control: comm.runtime.stream().map_err(|e| e.to_string())?,
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

    fn wrap(
        ccl: CclComm,
        runtime: CudaRuntime,
        rank: usize,
        world: usize,
        ordinal: i32,
        caps: Arc<CapabilityReport>,
    ) -> Result<Self> {
        let info = crate::driver::probe()
            .map_err(|reason| Error::Unsupported { capability: "cuda-runtime".into(), reason })?;
        let arch =
            info.devices.iter().find(|d| d.ordinal == ordinal).map(|d| d.arch()).unwrap_or_else(|| "unknown".into());
        let scratch = DeviceBuffer::alloc(runtime.context(), 4)?;
        let custom = Err("the custom kernels need every rank's buffers mapped (set up by CudaComm::init_all)".into());
        Ok(CudaComm { ccl: CclRank::new(ccl, rank, world), runtime, arch, caps, scratch, custom, custom_generation: 0 })
    }

    /// Replaces the custom kernels' state; what the front-end remembered about eligibility is then stale.
    fn set_custom(&mut self, custom: std::result::Result<CustomState, String>) {
        self.custom = custom;
        self.custom_generation = self.custom_generation.wrapping_add(1);
    }

    /// The NCCL communicator.
    pub fn ccl(&self) -> &CclComm {
        self.ccl.ccl()
    }

    fn bind(&self) -> Result<()> {
        self.runtime.context().bind()
    }

    /// Allocates a symmetric buffer of `bytes` with `ncclMemAlloc` and registers it as a window
    /// (`NCCL_WIN_COLL_SYMMETRIC`). Collective: every rank calls it with the same size. Refused while `stream`
    /// is being captured (allocation and registration are not capture-safe).
    pub fn symmetric_buffer(&self, bytes: usize, stream: &CudaStream) -> Result<SymmetricBuffer> {
        self.ccl.symmetric_buffer("cuda", &self.caps, &self.runtime, bytes, stream)
    }
}

/// Device memory from `ncclMemAlloc`, registered as a symmetric window on its communicator
/// ([`CudaComm::symmetric_buffer`]).
pub type SymmetricBuffer = anyccl_ccl::rank::SymmetricBuffer<DeviceBuffer>;

impl CudaComm {
    /// Launches a custom all-reduce. Eager: the kernel copies this rank's input into its staging buffer, which the
    /// peers read. During capture: the kernel reads the input through a table in device memory that starts as the
    /// same staging copy and switches to reading every rank's input directly once
    /// [`Communicator::register_graph_buffers`](anyccl_core::Communicator::register_graph_buffers) has run (not for in-place one-shot, where a rank would overwrite its
    /// input while peers still read it). Stream-ordered and capture-safe (nothing is allocated).
    fn custom_all_reduce(&mut self, args: AllReduceArgs<'_, Self>) -> Result<()> {
        let (algorithm, bytes, dtype, stream) = (args.algorithm(), args.bytes(), args.dtype(), args.stream());
        // Queried once, by the front-end, on this stream.
        let capturing = args.capturing();
        let rank = self.ccl.rank();
        let st = self.custom.as_mut().map_err(|why| Error::AlgorithmNotEligible { algorithm, why: why.clone() })?;
        self.runtime.context().bind()?;
        let (src, dst) = anyccl_ccl::rank::io_ptrs(args.bufs());
        let (src, dst) = (src as u64, dst as u64);
        let table =
            if capturing && !(algorithm == Algorithm::OneShot && src == dst) { st.graph.table_for(src) } else { None };
        let inputs = match table {
            Some(table) => crate::custom::Inputs::Table { table, own: src },
            None => crate::custom::Inputs::Staged { staging: &st.all_staging, own: src },
        };
        let kind =
            if algorithm == Algorithm::OneShot { crate::custom::Kind::OneShot } else { crate::custom::Kind::TwoShot };
        // SAFETY: every rank's staging/scratch/flags were allocated with `capacity >= bytes` (eligibility) by the
        // setup and are reachable through peer access or IPC; the tables hold staging or registered inputs of
        // every rank; every rank of this communicator makes the same calls in the same order (a collective), with
        // the same block count (a function of `bytes`); ranks run on different GPUs.
        unsafe {
            st.kernels.launch(
                kind,
                dtype,
                inputs,
                &st.all_scratch,
                dst,
                &st.all_flags,
                rank,
                bytes,
                custom_blocks(bytes, st.max_blocks),
                crate::custom::TWO_SHOT_ROUND_BYTES,
                stream,
            )
        }
    }

    /// Why the NVLS algorithms cannot run on this communicator.
    fn nvls_unavailable(&self) -> String {
        match self.caps.require(Capabilities::MULTICAST) {
            Err(e) => e.to_string(),
            Ok(()) => "the multicast kernels are built (sm_90+) but not yet wired to multicast objects; their \
                       unicast emulation runs only in tests and anyccl-cuda-emulated-bench"
                .into(),
        }
    }
}

impl CommBackend for CudaComm {
    type Reduction = CclReduction;
    type Runtime = CudaRuntime;

    fn runtime(&self) -> &CudaRuntime {
        &self.runtime
    }

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn rank(&self) -> usize {
        self.ccl.rank()
    }

    fn world_size(&self) -> usize {
        self.ccl.world()
    }

    fn vendor(&self) -> Vendor {
        Vendor::Nvidia
    }

    fn arch(&self) -> &str {
        &self.arch
    }

    fn capabilities(&self) -> &CapabilityReport {
        &self.caps
    }

    fn allreduce_algorithms(&self) -> &[Algorithm] {
        &ALGORITHMS
    }

    fn allreduce_eligible(&self, algorithm: Algorithm, call: &AllReduceCall) -> std::result::Result<(), String> {
        if let Some(r) = self.ccl.eligible(algorithm, call, &self.caps, "CudaComm::symmetric_buffer") {
            return r;
        }
        match algorithm {
            Algorithm::OneShot | Algorithm::TwoShot => {
                let st = self.custom.as_ref().map_err(Clone::clone)?;
                if call.op != ReduceOp::Sum {
                    return Err(format!("the custom kernels implement sum, not {}", call.op));
                }
                if let Some(why) = crate::custom::ineligible(call.dtype, call.bytes, self.ccl.world()) {
                    return Err(why);
                }
                if call.bytes > st.capacity {
                    return Err(format!(
                        "{} bytes exceed the custom kernels' staging buffers ({} bytes; ANYCCL_CUSTOM_MAX_BYTES)",
                        call.bytes, st.capacity
                    ));
                }
                Ok(())
            }
            Algorithm::NvlsZeroCopy | Algorithm::NvlsWarpPipeline | Algorithm::NvlsBlockPipeline => {
                Err(self.nvls_unavailable())
            }
            other => Err(format!("{other} is not implemented by the CUDA backend yet")),
        }
    }

    fn check_reduction(&self, dtype: DataType, op: ReduceOp) -> Result<CclReduction> {
        self.ccl.check_reduction(dtype, op)
    }

    fn all_reduce(&mut self, args: AllReduceArgs<'_, Self>) -> Result<()> {
        let algorithm = args.algorithm();
        if matches!(algorithm, Algorithm::OneShot | Algorithm::TwoShot) {
            return self.custom_all_reduce(args);
        }
        if !matches!(algorithm, Algorithm::Ccl | Algorithm::CclSymmetric) {
            // The NVLS algorithms: listed, never eligible (see `nvls_unavailable`).
            return Err(Error::AlgorithmNotEligible { algorithm, why: self.nvls_unavailable() });
        }
        // ccl and ccl-symmetric are the same call: NCCL picks its symmetric kernels when the buffers lie in a
        // registered window, which eligibility has checked. No context is bound first: NCCL makes the
        // communicator's device current itself before it prepares and launches a collective (what lets one thread
        // drive several GPUs in a group), so binding here only cost a driver call per collective.
        // SAFETY: `args` was made by this backend's `Communicator` after validating it against this rank: both
        // buffers hold `count` elements of this device and do not overlap unless in place; the stream is live
        // (borrowed for the call).
        unsafe { self.ccl.all_reduce(args) }
    }

    fn all_gather(&mut self, args: AllGatherArgs<'_, Self>) -> Result<()> {
        // SAFETY: as in `all_reduce`.
        unsafe { self.ccl.all_gather(args) }
    }

    fn reduce_scatter(&mut self, args: ReduceScatterArgs<'_, Self>) -> Result<()> {
        // SAFETY: as in `all_reduce`.
        unsafe { self.ccl.reduce_scatter(args) }
    }

    fn broadcast(&mut self, args: BroadcastArgs<'_, Self>) -> Result<()> {
        // SAFETY: as in `all_reduce`.
        unsafe { self.ccl.broadcast(args) }
    }

    fn reduce(&mut self, args: ReduceArgs<'_, Self>) -> Result<()> {
        // SAFETY: as in `all_reduce`.
        unsafe { self.ccl.reduce(args) }
    }

    fn send(&mut self, args: SendArgs<'_, Self>) -> Result<()> {
        // SAFETY: as in `all_reduce`.
        unsafe { self.ccl.send(args) }
    }

    fn recv(&mut self, args: RecvArgs<'_, Self>) -> Result<()> {
        // SAFETY: as in `all_reduce`.
        unsafe { self.ccl.recv(args) }
    }

    /// Registers the inputs of custom all-reduces captured in CUDA graphs since the last call, so that replays
    /// read every rank's input directly instead of copying it through staging (through
    /// [`Communicator::register_graph_buffers`](anyccl_core::Communicator::register_graph_buffers)).
    ///
    /// `bootstrap` is how a one-process-per-GPU communicator's ranks reach each other ([`crate::bootstrap`]):
    /// the inputs' IPC handles travel through it; communicators of one process
    /// ([`crate::communicators_single_process`]) exchange pointers among themselves and take `None`. Inputs that
    /// cannot be shared (not `cuMemAlloc` memory, e.g. cuMem/VMM allocations) stay on staging, still correct;
    /// the result lists them with the reason.
    fn register_graph_buffers(&mut self, bootstrap: Option<&mut dyn Bootstrap>) -> Result<GraphRegistration> {
        match &mut self.custom {
            // The custom kernels are off on every rank alike (their setup is collective): nothing was captured.
            Err(_) => Ok(GraphRegistration::default()),
            Ok(st) => st.graph.register(bootstrap),
        }
    }

    fn pending_graph_buffers(&self) -> usize {
        self.custom.as_ref().map_or(0, |st| st.graph.pending())
    }

    fn capture_independent(&self, algorithm: Algorithm) -> bool {
        // No eligibility answer above reads `call.capturing`; NCCL's calls handle capture themselves, while the
        // custom kernels choose their input table by it.
        matches!(algorithm, Algorithm::Ccl | Algorithm::CclSymmetric)
    }

    fn eligibility_epoch(&self) -> Option<u64> {
        // Eligibility reads the call, the capabilities (fixed once wrapped), the custom kernels' state and the
        // registered windows: the two generations, both only ever growing, change when either of those does.
        Some(self.custom_generation.wrapping_add(self.ccl.windows_generation()))
    }

    fn wait(&mut self, stream: &CudaStream, timeout: std::time::Duration) -> Result<()> {
        // The front-end has refused a capturing stream, and the query refuses one too, before NCCL is asked
        // anything. Before NCCL's abort (which frees device memory and so waits for the device), the custom kernels
        // are told to stop waiting for peers: NCCL's abort stops NCCL's kernels, the abort word stops ours.
        let custom = &self.custom;
        let r = self.ccl.wait_or_abort(timeout, &mut || stream.query(), &mut || {
            if let Ok(st) = custom {
                if let Err(e) = st.stop_kernels() {
                    tracing::error!(error = %e, "could not tell the custom all-reduce kernels to stop");
                }
            }
        });
        // The custom kernels go off only with the communicator itself: once aborted, every call on this rank
        // fails, so no call runs here with a selection that differs from the peers'. Any other error (a query
        // that failed) changes nothing: turning them off on this rank alone would make it choose NCCL where its
        // peers still choose the custom kernels, and both would wait for each other.
        if self.ccl.ccl().is_aborted() && self.custom.is_ok() {
            let why = "off: an earlier wait failed (a peer died or timed out)".to_string();
            // Through `set_custom`, so the front-end's remembered decision is dropped too.
            let old = std::mem::replace(&mut self.custom, Err(why.clone()));
            self.set_custom(Err(why));
            if let Ok(st) = old {
                // A query error counts as not drained.
                if matches!(stream.done_within(STOP_DRAIN_LIMIT), Ok(true)) {
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

    fn query(&mut self, stream: &CudaStream) -> Result<bool> {
        // `cuStreamQuery` refuses a capturing stream before NCCL is asked anything.
        self.ccl.query(stream)
    }

    fn close_in_background(self) -> Teardown {
        // NCCL's destroy on a thread of its own; the barrier scratch, the custom kernels' buffers and module, and
        // last the device context are released after it, on that thread (a plain drop also destroys NCCL first).
        let CudaComm { ccl, runtime, arch: _, caps: _, scratch, custom, custom_generation: _ } = self;
        ccl.close_in_background_with((scratch, custom, runtime))
    }

    fn barrier(&mut self, stream: &CudaStream) -> Result<()> {
        self.bind()?;
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
        for bad in ["lots", "8", "-1MiB"] {
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
