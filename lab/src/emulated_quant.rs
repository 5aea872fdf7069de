//! The quantized two-shot all-reduce ([`anyccl_gpu::quant`]) with N ranks emulated on one GPU: the
//! [`EmulatedRanks`] of the other custom kernels (inputs, outputs, flag arrays, streams, the loaded module) plus
//! every rank's quantized staging and scratch. For the quantized kernels' GPU tests and
//! `anyccl-cuda-quant-bench`; the full-precision kernels of the same group run through [`QuantRanks::ranks`]
//! (they share the flag arrays: every rank launches the same sequence of kernels).

use std::sync::Arc;

use anyccl_core::{DataType, Error, MemoryRuntime, Result};
use anyccl_gpu::quant::{self, QuantKernels};

pub use anyccl_gpu::quant::Format;

use crate::emulated::EmulatedRanks;
use anyccl_cuda::custom::Kind;
use anyccl_cuda::graph::Graph;
use anyccl_cuda::platform::Cuda;
use anyccl_cuda::runtime::{CudaStream, DeviceBuffer};

/// N emulated ranks of `bytes`-byte all-reduces, full precision and quantized.
#[non_exhaustive]
pub struct QuantRanks {
    /// The quantized kernels of `ranks.kernels`' module (valid while `ranks` lives).
    quant: QuantKernels<Cuda>,
    /// The full-precision group: inputs, outputs, flags, streams, kernels.
    pub ranks: EmulatedRanks,
    /// Quantized staging, by rank (each rank's quantized input).
    pub stage: Vec<DeviceBuffer>,
    /// Quantized scratch, by rank (the re-quantized sum of each rank's chunk).
    pub qscratch: Vec<DeviceBuffer>,
}

impl QuantRanks {
    /// Allocates everything for `world` ranks on device `ordinal` (the staging sized for the element type with
    /// the most elements per byte, so every type fits).
    pub fn new(ordinal: i32, world: usize, bytes: usize, blocks: u32) -> Result<Self> {
        let ranks = EmulatedRanks::new(ordinal, world, bytes, blocks)?;
        let quant = QuantKernels::new(&ranks.kernels);
        let need = quant::staging_bytes(DataType::Bf16, bytes)
            .and_then(|n| n.checked_next_multiple_of(16))
            .ok_or_else(|| Error::backend("cuda", "emulated quantized ranks", None, format!("{bytes} bytes")))?;
        let alloc = |n: usize| -> Result<Vec<DeviceBuffer>> { (0..world).map(|_| ranks.runtime.alloc(n)).collect() };
        let stage = alloc(need)?;
        let qscratch = alloc(need)?;
        Ok(QuantRanks { quant, ranks, stage, qscratch })
    }

    fn ptrs(v: &[DeviceBuffer]) -> Vec<u64> {
        v.iter().map(DeviceBuffer::device_ptr).collect()
    }

    /// Launches every rank's quantized all-reduce of its input into its output on its own stream; does not wait.
    pub fn launch(&self, format: Format, dtype: DataType) -> Result<()> {
        self.ranks.streams.iter().enumerate().try_for_each(|(rank, s)| self.launch_rank(format, dtype, rank, s))
    }

    /// Launches rank `rank`'s quantized all-reduce alone on `s`; does not wait.
    pub fn launch_rank(&self, format: Format, dtype: DataType, rank: usize, s: &CudaStream) -> Result<()> {
        let g = &self.ranks;
        if rank == 0 {
            // The quantized kernels are built like the two-shot (512 threads, two blocks per SM, ≤ 64 registers),
            // so the two-shot's occupancy is theirs.
            let fit = g.kernels.resident_blocks(Kind::TwoShot, dtype)?;
            let need = g.streams.len() * g.blocks as usize;
            if need > fit {
                return Err(Error::backend(
                    "cuda",
                    "emulated quantized ranks",
                    None,
                    format!("{need} resident blocks needed, the device holds {fit}: the barriers would deadlock"),
                ));
            }
        }
        let (st, sc, fl) = (Self::ptrs(&self.stage), Self::ptrs(&self.qscratch), Self::ptrs(&g.flags));
        // SAFETY: every buffer was allocated in `new` with the sizes the kernel needs (staging and scratch of
        // `staging_bytes` for the most elements a message of `bytes` can have; cuMemAlloc is 256-byte aligned);
        // `quant` came from `g.kernels`; the block count keeps every rank's blocks co-resident (checked above).
        unsafe {
            self.quant.launch(
                &g.kernels,
                format,
                dtype,
                g.inputs[rank].device_ptr(),
                &st,
                &sc,
                g.outputs[rank].device_ptr(),
                &fl,
                rank,
                g.bytes,
                g.blocks,
                s,
            )
        }
    }

    /// Captures each rank's quantized launch (`calls` back-to-back) into one graph per rank.
    pub fn capture(&self, format: Format, dtype: DataType, calls: usize) -> Result<Vec<Graph>> {
        let ctx: &Arc<_> = self.ranks.runtime.context();
        self.ranks
            .streams
            .iter()
            .enumerate()
            .map(|(rank, s)| {
                Graph::capture(ctx, s, |s| (0..calls).try_for_each(|_| self.launch_rank(format, dtype, rank, s)))
            })
            .collect()
    }
}
