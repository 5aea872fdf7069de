//! The ROCm communicator: RCCL collectives through the shared CCL rank, symmetric windows where RCCL has them
//! and cuMem is on, and the capture rules.

use std::sync::Arc;

use anyccl_ccl::{CclLibrary, CclRank, CclReduction};
use anyccl_core::comm::{
    AllGatherArgs, AllReduceArgs, AllReduceCall, BroadcastArgs, RecvArgs, ReduceArgs, ReduceScatterArgs, SendArgs,
};
use anyccl_core::{Algorithm, CapabilityReport, CommBackend, DataType, ReduceOp, Result, Teardown, Vendor};

use crate::runtime::{HipBuffer, HipDevice, HipRuntime, HipStream};

/// The all-reduce algorithms of the ROCm backend (the custom ones are listed so tables show why they are off).
pub const ALGORITHMS: [Algorithm; 4] =
    [Algorithm::Ccl, Algorithm::CclSymmetric, Algorithm::OneShot, Algorithm::TwoShot];

/// Why the custom kernels do not run on ROCm in this release.
pub fn custom_kernels_off(arch: &str) -> String {
    match anyccl_kernels_hip::why_not(arch) {
        Some(why) => why,
        None => "the HIP one-shot/two-shot kernels are built for this GPU but not yet wired into the ROCm \
                 communicator (they have not run on AMD hardware)"
            .into(),
    }
}

/// One rank of a ROCm communicator.
pub struct RocmComm {
    ccl: CclRank,
    runtime: HipRuntime,
    arch: String,
    caps: Arc<CapabilityReport>,
    /// Four bytes for barriers, allocated up front so a barrier never allocates (it may run during capture).
    scratch: HipBuffer,
}

impl RocmComm {
    /// One communicator per listed device of this process (`ncclCommInitAll`), index = rank.
    pub fn init_all(
        lib: Arc<CclLibrary>,
        devices: &[Arc<HipDevice>],
        caps: Arc<CapabilityReport>,
    ) -> Result<Vec<Self>> {
        let ordinals: Vec<i32> = devices.iter().map(|d| d.ordinal()).collect();
        let ccls = anyccl_ccl::init_all(&lib, &ordinals)?;
        let world = devices.len();
        ccls.into_iter()
            .zip(devices)
            .enumerate()
            .map(|(rank, (c, dev))| {
                let arch = crate::runtime::arch_of(dev.library(), dev.ordinal())?;
                let scratch = HipBuffer::alloc(dev, 4)?;
                Ok(RocmComm {
                    ccl: CclRank::new(c, rank, world),
                    runtime: HipRuntime::new(dev.clone()),
                    arch,
                    caps: caps.clone(),
                    scratch,
                })
            })
            .collect()
    }

    /// The shared CCL rank.
    pub fn ccl(&self) -> &CclRank {
        &self.ccl
    }

    /// Allocates a symmetric buffer of `bytes` (`ncclMemAlloc` + `ncclCommWindowRegister`). Collective: every rank
    /// calls it with the same size. Refused while `stream` captures, and where windows are off (RCCL without the
    /// window symbols, such as ROCm 7.0, or with `NCCL_CUMEM_ENABLE` unset): the error carries the reason.
    pub fn symmetric_buffer(&self, bytes: usize, stream: &HipStream) -> Result<SymmetricBuffer> {
        self.ccl.symmetric_buffer("rocm", &self.caps, &self.runtime, bytes, stream)
    }
}

/// Device memory from `ncclMemAlloc`, registered as a symmetric window ([`RocmComm::symmetric_buffer`]).
pub type SymmetricBuffer = anyccl_ccl::rank::SymmetricBuffer<HipBuffer>;

impl CommBackend for RocmComm {
    type Reduction = CclReduction;
    type Runtime = HipRuntime;

    fn runtime(&self) -> &HipRuntime {
        &self.runtime
    }

    fn name(&self) -> &'static str {
        "rocm"
    }

    fn rank(&self) -> usize {
        self.ccl.rank()
    }

    fn world_size(&self) -> usize {
        self.ccl.world()
    }

    fn vendor(&self) -> Vendor {
        Vendor::Amd
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
        if let Some(r) = self.ccl.eligible(algorithm, call, &self.caps, "RocmComm::symmetric_buffer") {
            return r;
        }
        match algorithm {
            Algorithm::OneShot | Algorithm::TwoShot => Err(custom_kernels_off(&self.arch)),
            other => Err(format!("{other} is not implemented by the ROCm backend")),
        }
    }

    fn check_reduction(&self, dtype: DataType, op: ReduceOp) -> Result<CclReduction> {
        self.ccl.check_reduction(dtype, op)
    }

    fn all_reduce(&mut self, args: AllReduceArgs<'_, Self>) -> Result<()> {
        // Only ccl and ccl-symmetric are eligible here (the same RCCL call: RCCL picks its symmetric path when the
        // buffers lie in a registered window).
        self.runtime.device().bind()?;
        // SAFETY: `args` was made by this backend's `Communicator` after validating it against this rank.
        unsafe { self.ccl.all_reduce(args) }
    }

    fn all_gather(&mut self, args: AllGatherArgs<'_, Self>) -> Result<()> {
        self.runtime.device().bind()?;
        // SAFETY: as in `all_reduce`.
        unsafe { self.ccl.all_gather(args) }
    }

    fn reduce_scatter(&mut self, args: ReduceScatterArgs<'_, Self>) -> Result<()> {
        self.runtime.device().bind()?;
        // SAFETY: as in `all_reduce`.
        unsafe { self.ccl.reduce_scatter(args) }
    }

    fn broadcast(&mut self, args: BroadcastArgs<'_, Self>) -> Result<()> {
        self.runtime.device().bind()?;
        // SAFETY: as in `all_reduce`.
        unsafe { self.ccl.broadcast(args) }
    }

    fn reduce(&mut self, args: ReduceArgs<'_, Self>) -> Result<()> {
        self.runtime.device().bind()?;
        // SAFETY: as in `all_reduce`.
        unsafe { self.ccl.reduce(args) }
    }

    fn send(&mut self, args: SendArgs<'_, Self>) -> Result<()> {
        self.runtime.device().bind()?;
        // SAFETY: as in `all_reduce`.
        unsafe { self.ccl.send(args) }
    }

    fn recv(&mut self, args: RecvArgs<'_, Self>) -> Result<()> {
        self.runtime.device().bind()?;
        // SAFETY: as in `all_reduce`.
        unsafe { self.ccl.recv(args) }
    }

    fn wait(&mut self, stream: &HipStream, timeout: std::time::Duration) -> Result<()> {
        // The front-end has refused a capturing stream; the query refuses one too, before RCCL is asked anything.
        // Nothing here selects by state a failed wait could change.
        self.ccl.wait_or_abort(timeout, &mut || stream.query(), &mut || {})
    }

    fn query(&mut self, stream: &HipStream) -> Result<bool> {
        // `hipStreamQuery` refuses a capturing stream before RCCL is asked anything.
        self.ccl.query(stream)
    }

    fn close_in_background(self) -> Teardown {
        // RCCL's destroy on a thread of its own; the barrier scratch and the runtime go after it, there.
        let RocmComm { ccl, runtime, arch: _, caps: _, scratch } = self;
        ccl.close_in_background_with((scratch, runtime))
    }

    fn barrier(&mut self, stream: &HipStream) -> Result<()> {
        self.runtime.device().bind()?;
        // SAFETY: a 4-byte buffer of this device; a stream of this device.
        unsafe { self.ccl.barrier(&self.scratch, stream) }
    }
}
