//! N ranks emulated on one GPU: N buffer sets and N streams, for testing and measuring the custom kernels where
//! only one GPU is available. Peers' "mapped" buffers are simply the other sets' device pointers.

use std::sync::Arc;

use anyccl_core::{DataType, MemoryRuntime, Result};
use anyccl_kernels_cuda::FLAG_BYTES;

use crate::custom::{CustomKernels, Kind};
use crate::graph::Graph;
use crate::runtime::{CudaRuntime, CudaStream, DeviceBuffer};

/// N emulated ranks of `bytes`-byte all-reduces on one device.
pub struct EmulatedRanks {
    /// The device runtime.
    pub runtime: CudaRuntime,
    /// The kernels.
    pub kernels: CustomKernels,
    /// One stream per rank.
    pub streams: Vec<CudaStream>,
    /// Inputs, by rank.
    pub inputs: Vec<DeviceBuffer>,
    /// Outputs, by rank.
    pub outputs: Vec<DeviceBuffer>,
    /// Two-shot scratch, by rank.
    pub scratch: Vec<DeviceBuffer>,
    /// Flag arrays, by rank (zeroed at creation).
    pub flags: Vec<DeviceBuffer>,
    /// Output staging of the NVLS block pipeline, by rank (its input staging is `scratch`).
    pub stage_out: Vec<DeviceBuffer>,
    /// Message size.
    pub bytes: usize,
    /// Blocks per rank.
    pub blocks: u32,
}

impl EmulatedRanks {
    /// Allocates everything for `world` ranks on device `ordinal`; flag arrays zeroed.
    pub fn new(ordinal: i32, world: usize, bytes: usize, blocks: u32) -> Result<Self> {
        let runtime = CudaRuntime::new(ordinal)?;
        let kernels = CustomKernels::load(runtime.context())?;
        let s0 = runtime.stream()?;
        let alloc = |n: usize| -> Result<Vec<DeviceBuffer>> { (0..world).map(|_| runtime.alloc(n)).collect() };
        let inputs = alloc(bytes)?;
        let outputs = alloc(bytes)?;
        let scratch = alloc(bytes)?;
        let stage_out = alloc(bytes)?;
        let mut flags = alloc(FLAG_BYTES)?;
        for f in &mut flags {
            runtime.upload(f, &vec![0u8; FLAG_BYTES], &s0)?;
        }
        let streams = (0..world).map(|_| runtime.stream()).collect::<Result<Vec<_>>>()?;
        Ok(EmulatedRanks { runtime, kernels, streams, inputs, outputs, scratch, flags, stage_out, bytes, blocks })
    }

    fn ptrs(v: &[DeviceBuffer]) -> Vec<u64> {
        v.iter().map(DeviceBuffer::device_ptr).collect()
    }

    /// Launches every rank's kernel on its own stream (concurrently); does not wait.
    pub fn launch(&self, kind: Kind, dtype: DataType) -> Result<()> {
        self.streams.iter().enumerate().try_for_each(|(rank, s)| self.launch_rank(kind, dtype, rank, s))
    }

    fn launch_rank(&self, kind: Kind, dtype: DataType, rank: usize, s: &CudaStream) -> Result<()> {
        let (ins, sc, fl) = (Self::ptrs(&self.inputs), Self::ptrs(&self.scratch), Self::ptrs(&self.flags));
        let out = self.outputs[rank].device_ptr();
        // SAFETY: every buffer was allocated in `new` with the sizes the kernels need (cuMemAlloc is 256-byte
        // aligned); the caller's `blocks` keeps all ranks' blocks co-resident.
        unsafe {
            match kind {
                Kind::OneShot | Kind::TwoShot => {
                    self.kernels.launch(kind, dtype, &ins, &sc, out, &fl, rank, self.bytes, self.blocks, s)
                }
                Kind::NvlsZeroCopyEmulated => {
                    let outs = Self::ptrs(&self.outputs);
                    self.kernels.launch_nvls_emulated(
                        kind,
                        dtype,
                        &ins,
                        &outs,
                        0,
                        0,
                        &fl,
                        rank,
                        self.bytes,
                        self.blocks,
                        s,
                    )
                }
                Kind::NvlsBlockPipelineEmulated => {
                    let so = Self::ptrs(&self.stage_out);
                    let input = self.inputs[rank].device_ptr();
                    self.kernels.launch_nvls_emulated(
                        kind,
                        dtype,
                        &sc,
                        &so,
                        input,
                        out,
                        &fl,
                        rank,
                        self.bytes,
                        self.blocks,
                        s,
                    )
                }
            }
        }
    }

    /// Waits for every rank's stream.
    pub fn synchronize(&self) -> Result<()> {
        self.streams.iter().try_for_each(CudaStream::synchronize)
    }

    /// Captures each rank's launch (`calls` back-to-back) into one graph per rank.
    pub fn capture(&self, kind: Kind, dtype: DataType, calls: usize) -> Result<Vec<Graph>> {
        let ctx: &Arc<_> = self.runtime.context();
        self.streams
            .iter()
            .enumerate()
            .map(|(rank, s)| {
                Graph::capture(ctx, s, |s| (0..calls).try_for_each(|_| self.launch_rank(kind, dtype, rank, s)))
            })
            .collect()
    }
}
