//! The push-mode one-shot all-reduce (`anyccl_push_one_shot_{f32,f16,bf16}`, kernel source
//! `anyccl-kernels-common/include/anyccl/push.h`) on N ranks emulated on one GPU: its kernels, their launch (with
//! programmatic dependent launch on sm_90+, through `cuLaunchKernelEx`), and the ranks' receive buffers.
//!
//! Every rank writes its input into its slot of every peer's receive buffer, then reduces the slots of its own in
//! rank order (the bits of [`Kind::OneShot`](crate::custom::Kind::OneShot)'s result). Completion is flag-free: a
//! receive slot holds the sentinel [`PUSH_SENTINEL`] (every byte `0xFF`) until its data lands, and the reader
//! writes the sentinel back after use; calls alternate between two buffer sets by a call counter in each receive
//! buffer. No barrier round: one write across the links, then the reads of local memory. Messages up to
//! [`PUSH_MAX_BYTES`] (256 KiB; each rank's receive buffer holds [`PUSH_RECV_BYTES`], about 4 MiB). The abort word
//! of each rank's flag array stops a kernel whose peer never writes ([`crate::custom::stop_waiting`]).

use std::ffi::{c_void, CString};
use std::sync::Arc;

use anyccl_core::{DataType, Error, MemoryRuntime, Result};
use anyccl_kernels_cuda::push::{PUSH_CTRL_BYTES, PUSH_CTRL_OFFSET, PUSH_KERNELS};
pub use anyccl_kernels_cuda::push::{PUSH_MAX_BYTES, PUSH_RECV_BYTES, PUSH_SENTINEL};
use cudarc::driver::{result, sys};

use crate::custom::THREADS;
use crate::driver::cu_err;
use crate::emulated::EmulatedRanks;
use crate::graph::Graph;
use crate::runtime::{CudaRuntime, CudaStream, DeviceBuffer, DeviceContext};

/// Why the push one-shot cannot run `dtype` × `bytes` for `world` ranks, if it cannot.
pub fn ineligible(dtype: DataType, bytes: usize, world: usize) -> Option<String> {
    if let Some(why) = crate::custom::ineligible(dtype, bytes, world) {
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
    anyccl_ccl::gpu::push::push_blocks(bytes, world)
}

fn slot(dtype: DataType) -> Option<usize> {
    [DataType::F32, DataType::F16, DataType::Bf16].iter().position(|d| *d == dtype)
}

fn bad(m: String) -> Error {
    Error::backend("cuda", "push one-shot", None, m)
}

/// The push one-shot kernels loaded for one device (their own module of the all-reduce cubin).
pub struct PushKernels {
    functions: [sys::CUfunction; 3],
    module: sys::CUmodule,
    ctx: Arc<DeviceContext>,
    /// Whether the device runs programmatic dependent launch (compute capability 9.0 or newer).
    pdl: bool,
    sms: usize,
}

// SAFETY: a module and its functions may be used from any thread of the process; launching is thread-safe.
unsafe impl Send for PushKernels {}
// SAFETY: as above; every method takes `&self` and only passes the handles to thread-safe driver calls.
unsafe impl Sync for PushKernels {}

impl Drop for PushKernels {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: loaded in `load`, unloaded once; the functions die with it.
        if let Err(e) = unsafe { result::module::unload(self.module) } {
            tracing::warn!(error = %cu_err("cuModuleUnload", e), "unloading the push kernels failed");
        }
    }
}

impl PushKernels {
    /// Loads the all-reduce cubin of the runtime's device and looks the three push kernels up. Not during capture.
    pub fn load(runtime: &CudaRuntime) -> Result<Self> {
        use anyccl_ccl::gpu::GpuPlatform;
        if let Some(why) = crate::platform::Cuda::kernels_not_built() {
            return Err(bad(why));
        }
        runtime.refuse_during_capture("cuModuleLoadData")?;
        let image = crate::platform::Cuda::kernel_image(runtime)?;
        let sms = crate::platform::Cuda::sm_count(runtime)?;
        let ctx = runtime.context().clone();
        let info = crate::driver::probe()
            .map_err(|reason| Error::Unsupported { capability: "cuda-runtime".into(), reason })?;
        let major = info.devices.iter().find(|d| d.ordinal == ctx.ordinal()).map_or(0, |d| d.compute_capability.0);
        ctx.bind()?;
        let owned = image.to_vec();
        // SAFETY: `owned` holds a complete cubin; the driver copies what it needs before returning.
        let module =
            unsafe { result::module::load_data(owned.as_ptr().cast()) }.map_err(|e| cu_err("cuModuleLoadData", e))?;
        let mut functions = [std::ptr::null_mut(); 3];
        for (f, name) in functions.iter_mut().zip(PUSH_KERNELS) {
            // Kernel names are fixed ASCII without NUL bytes.
            let c = CString::new(name).map_err(|e| bad(e.to_string()))?;
            // SAFETY: live module; looking a function up by name only reads the module.
            match unsafe { result::module::get_function(module, c) } {
                Ok(h) => *f = h,
                Err(e) => {
                    // SAFETY: loaded above, unloaded once.
                    let _ = unsafe { result::module::unload(module) };
                    return Err(cu_err("cuModuleGetFunction", e));
                }
            }
        }
        Ok(PushKernels { functions, module, ctx, pdl: major >= 9, sms })
    }

    /// Whether launches can use programmatic dependent launch (sm_90 and newer).
    pub fn pdl_supported(&self) -> bool {
        self.pdl
    }

    /// How many blocks of the `dtype` kernel fit on the device at once.
    pub fn resident_blocks(&self, dtype: DataType) -> Result<usize> {
        let f = self.functions[slot(dtype).ok_or_else(|| bad(format!("no push kernel for {dtype}")))?];
        self.ctx.bind()?;
        // SAFETY: a function of the loaded module; the query has no side effects.
        let per_sm = unsafe { result::occupancy::max_active_block_per_multiprocessor(f, THREADS as i32, 0) }
            .map_err(|e| cu_err("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))?;
        Ok(per_sm.max(0) as usize * self.sms)
    }

    /// Launches one rank's push all-reduce of `bytes` bytes from `input` into `output` (may be `input`: in place is
    /// fine), with `recv[r]` rank r's receive buffer as addressable here and `my_flags` this rank's flag array (its
    /// abort word stops the kernel's waits). With `pdl` (sm_90+ only) the launch carries the
    /// programmatic-stream-serialization attribute, so it overlaps the end of the stream's previous kernel.
    ///
    /// # Safety
    /// `input`/`output` hold `bytes` of this device, 16-byte aligned; every `recv[r]` is a live receive buffer of
    /// [`PUSH_RECV_BYTES`] initialised by [`init_receive_buffer`] and used by no other group; `my_flags` a live flag
    /// array; every rank launches the same sequence of push calls, concurrently (all ranks' blocks co-resident).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        dtype: DataType,
        input: u64,
        output: u64,
        recv: &[u64],
        my_flags: u64,
        rank: usize,
        bytes: usize,
        blocks: u32,
        pdl: bool,
        stream: &CudaStream,
    ) -> Result<()> {
        let world = recv.len();
        if let Some(why) = ineligible(dtype, bytes, world) {
            return Err(Error::AlgorithmNotEligible { algorithm: anyccl_core::Algorithm::OneShotPush, why });
        }
        if rank >= world || blocks == 0 || blocks as usize > anyccl_kernels_cuda::MAX_BLOCKS {
            return Err(bad(format!("rank {rank} of {world}, {blocks} blocks")));
        }
        if pdl && !self.pdl {
            return Err(bad("programmatic dependent launch needs compute capability 9.0 or newer".into()));
        }
        if recv.iter().chain([&input, &output, &my_flags]).any(|p| p % 16 != 0) {
            return Err(bad("every buffer must be 16-byte aligned".into()));
        }
        let f = self.functions[slot(dtype).ok_or_else(|| bad(format!("no push kernel for {dtype}")))?];
        let mut recv_p = [0u64; anyccl_kernels_cuda::MAX_RANKS];
        for (d, s) in recv_p.iter_mut().zip(recv) {
            *d = *s;
        }
        let (mut in_p, mut out_p, mut flags_p) = (input, output, my_flags);
        // rank < world <= 8 (checked above and by `ineligible`).
        let (mut rank_i, mut world_i) = (rank as i32, world as i32);
        let mut n_vec = (bytes / anyccl_kernels_cuda::VECTOR_BYTES) as u64;
        let mut params: [*mut c_void; 7] = [
            (&mut in_p as *mut u64).cast(),
            (&mut out_p as *mut u64).cast(),
            (&mut recv_p as *mut [u64; 8]).cast(),
            (&mut flags_p as *mut u64).cast(),
            (&mut rank_i as *mut i32).cast(),
            (&mut world_i as *mut i32).cast(),
            (&mut n_vec as *mut u64).cast(),
        ];
        // SAFETY: an all-zero launch attribute is valid plain data (id 0 is CU_LAUNCH_ATTRIBUTE_IGNORE).
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: blocks,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: THREADS,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: stream.raw(),
            attrs: if pdl { &mut attr } else { std::ptr::null_mut() },
            numAttrs: u32::from(pdl),
        };
        self.ctx.bind()?;
        // SAFETY: `params` matches the kernel's signature (in, out, RankPtrs by value, my_flags, rank, world, n_vec:
        // PUSH_PARAMS) and points to locals that outlive the call; the caller guarantees the buffers and the
        // co-residency.
        unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(|e| cu_err("cuLaunchKernelEx", e))
    }
}

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
    /// The kernels.
    pub kernels: PushKernels,
    /// Receive buffers, by rank ([`PUSH_RECV_BYTES`] each).
    pub recv: Vec<DeviceBuffer>,
    /// Whether launches carry the programmatic-stream-serialization attribute (default: where the device has it).
    pub pdl: bool,
}

impl EmulatedPush {
    /// Loads the kernels and allocates and initialises a receive buffer per rank of `g` (waits for that).
    pub fn new(g: &EmulatedRanks) -> Result<Self> {
        if g.bytes > PUSH_MAX_BYTES {
            return Err(bad(format!("the group's {} bytes exceed {PUSH_MAX_BYTES}", g.bytes)));
        }
        let kernels = PushKernels::load(&g.runtime)?;
        let recv = (0..g.streams.len()).map(|_| g.runtime.alloc(PUSH_RECV_BYTES)).collect::<Result<Vec<_>>>()?;
        let pdl = kernels.pdl_supported();
        let p = EmulatedPush { kernels, recv, pdl };
        p.reset(g)?;
        Ok(p)
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
        let fit = self.kernels.resident_blocks(dtype)?;
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
        // FLAG_BYTES; the receive buffers were initialised in `new`; every rank launches the same calls.
        unsafe {
            self.kernels.launch(
                dtype,
                input.device_ptr(),
                output.device_ptr(),
                &recv,
                flags.device_ptr(),
                rank,
                g.bytes,
                g.blocks,
                self.pdl,
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
