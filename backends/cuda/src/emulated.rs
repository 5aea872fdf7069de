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
        let mut flags = alloc(FLAG_BYTES)?;
        for f in &mut flags {
            runtime.upload(f, &vec![0u8; FLAG_BYTES], &s0)?;
        }
        let streams = (0..world).map(|_| runtime.stream()).collect::<Result<Vec<_>>>()?;
        Ok(EmulatedRanks { runtime, kernels, streams, inputs, outputs, scratch, flags, bytes, blocks })
    }

    fn ptrs(v: &[DeviceBuffer]) -> Vec<u64> {
        v.iter().map(DeviceBuffer::device_ptr).collect()
    }

    /// Launches every rank's kernel on its own stream (concurrently); does not wait.
    pub fn launch(&self, kind: Kind, dtype: DataType) -> Result<()> {
        let (ins, sc, fl) = (Self::ptrs(&self.inputs), Self::ptrs(&self.scratch), Self::ptrs(&self.flags));
        for (rank, s) in self.streams.iter().enumerate() {
            // SAFETY: every buffer was allocated above with the sizes the kernel needs (cuMemAlloc is 256-byte
            // aligned); blocks × world stays far below the device's resident capacity (checked by the caller's
            // choice of `blocks`), so all ranks' blocks are co-resident.
            unsafe {
                self.kernels.launch(
                    kind,
                    dtype,
                    &ins,
                    &sc,
                    self.outputs[rank].device_ptr(),
                    &fl,
                    rank,
                    self.bytes,
                    self.blocks,
                    s,
                )
            }?;
        }
        Ok(())
    }

    /// Waits for every rank's stream.
    pub fn synchronize(&self) -> Result<()> {
        self.streams.iter().try_for_each(CudaStream::synchronize)
    }

    /// Captures each rank's launch (`calls` back-to-back) into one graph per rank.
    pub fn capture(&self, kind: Kind, dtype: DataType, calls: usize) -> Result<Vec<Graph>> {
        let (ins, sc, fl) = (Self::ptrs(&self.inputs), Self::ptrs(&self.scratch), Self::ptrs(&self.flags));
        let ctx: &Arc<_> = self.runtime.context();
        self.streams
            .iter()
            .enumerate()
            .map(|(rank, s)| {
                Graph::capture(ctx, s, |s| {
                    for _ in 0..calls {
                        // SAFETY: as in `launch`; capturing records the launch for later replay.
                        unsafe {
                            self.kernels.launch(
                                kind,
                                dtype,
                                &ins,
                                &sc,
                                self.outputs[rank].device_ptr(),
                                &fl,
                                rank,
                                self.bytes,
                                self.blocks,
                                s,
                            )
                        }?;
                    }
                    Ok(())
                })
            })
            .collect()
    }
}
