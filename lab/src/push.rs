//! The push-mode one-shot all-reduce (`anyccl_push_one_shot_{f32,f16,bf16}`, kernel source
//! `anyccl-kernels-common/include/anyccl/push.h`) on N ranks emulated on one GPU: the communicator's launcher
//! ([`anyccl_gpu::push::PushKernels`], with programmatic dependent launch on sm_90+) on the group's grid, and
//! the ranks' receive buffers.
//!
//! Every rank writes its input into its slot of every peer's receive buffer, then reduces the slots of its own in
//! rank order (the bits of [`Kind::OneShot`](anyccl_cuda::custom::Kind::OneShot)'s result). Completion is flag-free: a
//! receive slot holds the sentinel [`PUSH_SENTINEL`] (every byte `0xFF`) until its data lands, and the reader
//! writes the sentinel back after use; calls alternate between two buffer sets by a call counter in each receive
//! buffer. No barrier round: one write across the links, then the reads of local memory. Messages up to
//! [`PUSH_MAX_BYTES`] (256 KiB; each rank's receive buffer holds [`PUSH_RECV_BYTES`], about 4 MiB). The abort word
//! of each rank's flag array stops a kernel whose peer never writes ([`anyccl_cuda::custom::stop_waiting`]).

use std::sync::Arc;

use anyccl_core::{DataType, Error, MemoryRuntime, Result};
use anyccl_kernels_cuda::push::{PUSH_CTRL_BYTES, PUSH_CTRL_OFFSET};
pub use anyccl_kernels_cuda::push::{PUSH_MAX_BYTES, PUSH_RECV_BYTES, PUSH_SENTINEL};
use cudarc::driver::sys;

use crate::emulated::EmulatedRanks;
use anyccl_cuda::custom::CustomKernels;
use anyccl_cuda::driver::cu_err;
use anyccl_cuda::graph::Graph;
use anyccl_cuda::platform::Cuda;
use anyccl_cuda::runtime::{CudaStream, DeviceBuffer};

/// Why the push one-shot cannot run `dtype` × `bytes` for `world` ranks, if it cannot.
pub fn ineligible(dtype: DataType, bytes: usize, world: usize) -> Option<String> {
    if let Some(why) = anyccl_cuda::custom::ineligible(dtype, bytes, world) {
        return Some(why);
    }
    if bytes > PUSH_MAX_BYTES {
        return Some(format!("{bytes} bytes exceed the push one-shot's receive slots ({PUSH_MAX_BYTES} bytes)"));
    }
    None
}

/// The grid the push one-shot is meant to run with for `bytes` on `world` ranks: one block per 8 KiB, from 4 to
/// `max(8, 64 / world)` blocks. Measured with anyccl-cuda-push-bench on an H200 (8 emulated ranks, bf16, with
/// programmatic dependent launch): 8 blocks beat 4 and 16 from 16 to 256 KiB (64 KiB: 8.2 µs against 11.6 and
/// 10.6), and 4 blocks are best at 4 KiB. The bound keeps every rank's blocks co-resident twice over (programmatic
/// dependent launch) on one GPU: world × blocks × 2 ≤ 128 blocks of 512 threads, 2 per SM.
pub fn push_blocks(bytes: usize, world: usize) -> u32 {
    // The communicator's choice too: one formula.
    anyccl_gpu::push::push_blocks(bytes, world)
}

fn bad(m: String) -> Error {
    Error::backend("cuda", "push one-shot", None, m)
}

/// The push kernels (and the fused push kernels) of a loaded kernel module, launched the way the communicator
/// launches them ([`anyccl_gpu::push::PushKernels`]); valid while the [`CustomKernels`] they were looked up in
/// are.
pub type PushKernels = anyccl_gpu::push::PushKernels<Cuda>;

pub use anyccl_gpu::push::{push_two_shot_blocks, PushGrid, PushShape};

/// Fills a receive buffer of [`PUSH_RECV_BYTES`] with the sentinel and zeroes its control words, in stream order
/// on `stream` (before first use, or to reuse the buffer after an abort left it unusable). Not during capture.
pub fn init_receive_buffer(buf: &DeviceBuffer, stream: &CudaStream) -> Result<()> {
    if buf.len() < PUSH_RECV_BYTES {
        return Err(bad(format!("a receive buffer holds {PUSH_RECV_BYTES} bytes, this one {}", buf.len())));
    }
    stream.refuse_if_capturing("the push receive buffers' initialisation")?;
    stream.context().bind()?;
    let p = buf.device_ptr();
    // SAFETY: both ranges lie inside the live buffer (length checked above); the stream is live.
    unsafe {
        sys::cuMemsetD8Async(p, 0xFF, PUSH_CTRL_OFFSET, stream.raw())
            .result()
            .map_err(|e| cu_err("cuMemsetD8Async", e))?;
        sys::cuMemsetD8Async(p + PUSH_CTRL_OFFSET as u64, 0, PUSH_CTRL_BYTES, stream.raw())
            .result()
            .map_err(|e| cu_err("cuMemsetD8Async", e))?;
    }
    Ok(())
}

/// The push one-shot on a group of emulated ranks: the kernels, every rank's receive buffer, and whether launches
/// use programmatic dependent launch. Reads the group's inputs, writes its outputs, and stops on its flag arrays'
/// abort words.
#[non_exhaustive]
pub struct EmulatedPush {
    /// The kernels: handles into `module` (private: a safe launch relies on them).
    kernels: PushKernels,
    /// The kernel module the push kernels were looked up in: this struct's own load of the all-reduce cubin, so
    /// the handles stay valid whatever becomes of the group.
    module: CustomKernels,
    /// Receive buffers, by rank ([`PUSH_RECV_BYTES`] each).
    pub recv: Vec<DeviceBuffer>,
    /// Whether launches carry the programmatic-stream-serialization attribute (default: where the device has it).
    pub pdl: bool,
    /// Which push kernel the launches run (default: the one-shot); calls of both shapes may follow each other.
    pub shape: PushShape,
}

impl EmulatedPush {
    /// Loads the kernels and allocates and initialises a receive buffer per rank of `g` (waits for that).
    pub fn new(g: &EmulatedRanks) -> Result<Self> {
        if g.bytes > PUSH_MAX_BYTES {
            return Err(bad(format!("the group's {} bytes exceed {PUSH_MAX_BYTES}", g.bytes)));
        }
        let module = CustomKernels::load(&g.runtime)?;
        let kernels = PushKernels::from_custom(&module)?;
        let recv = (0..g.streams.len()).map(|_| g.runtime.alloc(PUSH_RECV_BYTES)).collect::<Result<Vec<_>>>()?;
        let pdl = kernels.dependent_launch().is_ok();
        let p = EmulatedPush { kernels, module, recv, pdl, shape: PushShape::OneShot };
        p.reset(g)?;
        Ok(p)
    }

    /// Whether launches can use programmatic dependent launch (sm_90 and newer, with a driver that has
    /// `cuLaunchKernelEx`).
    pub fn pdl_supported(&self) -> bool {
        self.kernels.dependent_launch().is_ok()
    }

    /// Puts every receive buffer back to its initial state (sentinel, call counter 0) and waits for it.
    pub fn reset(&self, g: &EmulatedRanks) -> Result<()> {
        let s = &g.streams[0];
        g.synchronize()?;
        self.recv.iter().try_for_each(|b| init_receive_buffer(b, s))?;
        s.synchronize()
    }

    /// Launches every rank's kernel on its own stream (concurrently); does not wait.
    pub fn launch(&self, g: &EmulatedRanks, dtype: DataType) -> Result<()> {
        self.check_resident(g, dtype)?;
        g.streams.iter().enumerate().try_for_each(|(rank, s)| self.launch_rank(g, dtype, rank, s))
    }

    /// Refuses a group whose ranks' blocks could not all be resident at once (twice over with programmatic
    /// dependent launch, where a rank's next call may occupy its blocks early): the waits would never end.
    fn check_resident(&self, g: &EmulatedRanks, dtype: DataType) -> Result<()> {
        let fit = self.kernels.blocks_per_sm(&g.runtime, dtype)? * self.module.multiprocessors();
        let need = g.streams.len() * g.blocks as usize * if self.pdl { 2 } else { 1 };
        if need > fit {
            return Err(bad(format!(
                "{} ranks × {} blocks need {need} resident blocks, the device holds {fit}: the waits would deadlock",
                g.streams.len(),
                g.blocks
            )));
        }
        Ok(())
    }

    /// Launches rank `rank`'s kernel alone on `s`; does not wait. Its waits end when the other ranks' kernels
    /// push (what [`Self::launch`] does for every rank), or once the rank's abort word is set.
    pub fn launch_rank(&self, g: &EmulatedRanks, dtype: DataType, rank: usize, s: &CudaStream) -> Result<()> {
        let recv: Vec<u64> = self.recv.iter().map(DeviceBuffer::device_ptr).collect();
        let (Some(input), Some(output), Some(flags)) = (g.inputs.get(rank), g.outputs.get(rank), g.flags.get(rank))
        else {
            return Err(bad(format!("rank {rank} of {}", g.streams.len())));
        };
        // SAFETY: the group's buffers hold `g.bytes` (≤ PUSH_MAX_BYTES, checked in `new`), its flag arrays
        // FLAG_BYTES; the receive buffers were initialised in `new`; every rank launches the same calls; `launch`
        // and `capture` check that every rank's blocks are co-resident.
        unsafe {
            self.kernels.launch(
                self.shape,
                &g.runtime,
                dtype,
                input.device_ptr(),
                output.device_ptr(),
                &recv,
                flags.device_ptr(),
                rank,
                g.bytes,
                PUSH_MAX_BYTES,
                PushGrid { blocks: g.blocks, dependent: self.pdl },
                s,
            )
        }
    }

    /// Captures each rank's launch (`calls` back-to-back) into one graph per rank.
    pub fn capture(&self, g: &EmulatedRanks, dtype: DataType, calls: usize) -> Result<Vec<Graph>> {
        self.check_resident(g, dtype)?;
        let ctx: &Arc<_> = g.runtime.context();
        g.streams
            .iter()
            .enumerate()
            .map(|(rank, s)| {
                Graph::capture(ctx, s, |s| (0..calls).try_for_each(|_| self.launch_rank(g, dtype, rank, s)))
            })
            .collect()
    }

    /// Rank `rank`'s call counter (how many push calls its kernels have completed) and the bytes of its receive
    /// buffer's sets, read back with `s` (for tests: after calls, every slot holds the sentinel again).
    pub fn state(&self, g: &EmulatedRanks, rank: usize, s: &CudaStream) -> Result<(u32, Vec<u8>)> {
        let b = self.recv.get(rank).ok_or_else(|| bad(format!("rank {rank}")))?;
        let mut all = Vec::new();
        all.try_reserve_exact(PUSH_RECV_BYTES).map_err(|e| bad(e.to_string()))?;
        all.resize(PUSH_RECV_BYTES, 0);
        g.runtime.download(b, &mut all, s)?;
        let ctrl = &all[PUSH_CTRL_OFFSET..PUSH_CTRL_OFFSET + 4];
        let epoch = u32::from_le_bytes([ctrl[0], ctrl[1], ctrl[2], ctrl[3]]);
        all.truncate(PUSH_CTRL_OFFSET);
        Ok((epoch, all))
    }
}
