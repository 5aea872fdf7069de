//! Launch glue for the custom all-reduce kernels of `anyccl-kernels-cuda` (one-shot, two-shot).
//!
//! The kernels read peers' buffers through device pointers: IPC-mapped buffers of other processes, or other
//! buffers of the same GPU when ranks are emulated (tests and benchmarks on one GPU). Every rank launches the same
//! sequence of kernels with the same grid; the per-block epoch counters in each rank's flag array keep the
//! barriers in step, also across graph replays.

use std::ffi::{c_void, CString};
use std::sync::Arc;

use anyccl_core::{DataType, Error, Result};
use anyccl_kernels_cuda as kernels;
use cudarc::driver::{result, sys};

use crate::driver::cu_err;
use crate::runtime::{CudaStream, DeviceContext};

/// Threads per block of every launch.
pub const THREADS: u32 = 512;

/// Which kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Every rank reduces the whole message from every peer.
    OneShot,
    /// Reduce-scatter into peer-visible scratch, then all-gather.
    TwoShot,
    /// NVLS zero-copy over the unicast emulation of the switch channel (inputs and outputs of every rank).
    NvlsZeroCopyEmulated,
    /// NVLS block pipeline over the unicast emulation (staging in/out of every rank).
    NvlsBlockPipelineEmulated,
}

fn dtype_suffix(dtype: DataType) -> Option<&'static str> {
    match dtype {
        DataType::F32 => Some("f32"),
        DataType::F16 => Some("f16"),
        DataType::Bf16 => Some("bf16"),
        _ => None,
    }
}

/// Why the custom kernels cannot run `dtype` × `bytes` for `world` ranks, if they cannot.
pub fn ineligible(dtype: DataType, bytes: usize, world: usize) -> Option<String> {
    if let Some(why) = unavailable(world) {
        return Some(why);
    }
    if dtype_suffix(dtype).is_none() {
        return Some(format!("the custom kernels handle f32, f16 and bf16, not {dtype}"));
    }
    if bytes % kernels::VECTOR_BYTES != 0 {
        return Some(format!("{bytes} bytes is not a multiple of {} (16-byte vectors)", kernels::VECTOR_BYTES));
    }
    None
}

/// Why the custom kernels cannot serve a communicator of `world` ranks at all, if they cannot.
pub fn unavailable(world: usize) -> Option<String> {
    if let Some(why) = kernels::NOT_BUILT {
        return Some(format!("custom kernels not compiled in: {why}"));
    }
    if !(2..=kernels::MAX_RANKS).contains(&world) {
        return Some(format!("world {world} is outside 2..={}", kernels::MAX_RANKS));
    }
    None
}

/// The kernels loaded for one device.
pub struct CustomKernels {
    module: sys::CUmodule,
    ctx: Arc<DeviceContext>,
}

// SAFETY: a module and its functions may be used from any thread of the process.
unsafe impl Send for CustomKernels {}
// SAFETY: as above; launching is thread-safe in the driver.
unsafe impl Sync for CustomKernels {}

#[repr(C)]
#[derive(Clone, Copy)]
struct Ptrs([u64; kernels::MAX_RANKS]);

fn ptrs(v: &[u64]) -> Ptrs {
    let mut p = [0u64; kernels::MAX_RANKS];
    for (d, s) in p.iter_mut().zip(v) {
        *d = *s;
    }
    Ptrs(p)
}

impl CustomKernels {
    /// Loads the cubin matching the device's compute capability (`cuModuleLoadData`). Not during capture.
    pub fn load(ctx: &Arc<DeviceContext>) -> Result<Self> {
        if let Some(why) = kernels::NOT_BUILT {
            return Err(Error::Unsupported {
                capability: "custom-kernels".into(),
                reason: anyccl_core::Reason::NotCompiledIn { what: "custom CUDA kernels".into(), detail: why.into() },
            });
        }
        let info = crate::driver::probe()
            .map_err(|reason| Error::Unsupported { capability: "cuda-runtime".into(), reason })?;
        let dev = info.devices.iter().find(|d| d.ordinal == ctx.ordinal());
        let (major, minor) = dev.map_or((0, 0), |d| d.compute_capability);
        let image = kernels::cubin_for("allreduce", major, minor).ok_or_else(|| Error::Unsupported {
            capability: "custom-kernels".into(),
            reason: anyccl_core::Reason::DeviceAttribute {
                device: format!("device {}", ctx.ordinal()),
                attribute: format!("compute capability {major}.{minor} (kernels are built for sm_80, sm_90, sm_100)"),
            },
        })?;
        ctx.bind()?;
        // The driver wants the image at a stable address for the call; copy it into an owned buffer.
        let owned = image.to_vec();
        // SAFETY: `owned` holds a complete cubin; the driver copies what it needs before returning.
        let module =
            unsafe { result::module::load_data(owned.as_ptr().cast()) }.map_err(|e| cu_err("cuModuleLoadData", e))?;
        Ok(CustomKernels { module, ctx: ctx.clone() })
    }

    fn function(&self, kind: Kind, dtype: DataType) -> Result<sys::CUfunction> {
        let suffix = dtype_suffix(dtype).ok_or_else(|| Error::AlgorithmNotEligible {
            algorithm: anyccl_core::Algorithm::OneShot,
            why: format!("the custom kernels handle f32, f16 and bf16, not {dtype}"),
        })?;
        let name = match kind {
            Kind::OneShot => format!("anyccl_one_shot_{suffix}"),
            Kind::TwoShot => format!("anyccl_two_shot_{suffix}"),
            Kind::NvlsZeroCopyEmulated => format!("anyccl_nvls_zero_copy_emu_{suffix}"),
            Kind::NvlsBlockPipelineEmulated => format!("anyccl_nvls_block_pipeline_emu_{suffix}"),
        };
        let c = CString::new(name).map_err(|e| Error::Backend {
            backend: "cuda".into(),
            call: "kernel name".into(),
            code: None,
            message: e.to_string(),
        })?;
        // SAFETY: live module; looking a function up by name only reads the module.
        unsafe { result::module::get_function(self.module, c) }.map_err(|e| cu_err("cuModuleGetFunction", e))
    }

    /// Launches one rank's all-reduce of `bytes` bytes.
    ///
    /// `inputs[r]` is rank r's input as addressable from this rank (`inputs[rank]` is its own), `scratch` the same
    /// for two-shot's peer-visible scratch buffers (each ≥ `bytes`), `flags[r]` rank r's flag array
    /// ([`anyccl_kernels_cuda::FLAG_BYTES`], zeroed before first use), `out` this rank's output.
    ///
    /// # Safety
    /// Every pointer is device memory of (or mapped into) this device with the sizes above, 16-byte aligned; every
    /// rank launches the same sequence of kernels with the same `blocks` concurrently (ranks' blocks must be
    /// co-resident, or the barriers deadlock).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        kind: Kind,
        dtype: DataType,
        inputs: &[u64],
        scratch: &[u64],
        out: u64,
        flags: &[u64],
        rank: usize,
        bytes: usize,
        blocks: u32,
        stream: &CudaStream,
    ) -> Result<()> {
        let world = inputs.len();
        if let Some(why) = ineligible(dtype, bytes, world) {
            return Err(Error::AlgorithmNotEligible { algorithm: anyccl_core::Algorithm::OneShot, why });
        }
        let bad = |m: String| Error::Backend {
            backend: "cuda".into(),
            call: "custom all-reduce".into(),
            code: None,
            message: m,
        };
        if !matches!(kind, Kind::OneShot | Kind::TwoShot) {
            return Err(bad(format!("{kind:?} is launched with launch_nvls_emulated")));
        }
        if flags.len() != world || (kind == Kind::TwoShot && scratch.len() != world) || rank >= world {
            return Err(bad(format!(
                "{world} inputs, {} flags, {} scratch buffers, rank {rank}",
                flags.len(),
                scratch.len()
            )));
        }
        if blocks == 0 || blocks as usize > kernels::MAX_BLOCKS {
            return Err(bad(format!("{blocks} blocks (1..={})", kernels::MAX_BLOCKS)));
        }
        if inputs.iter().chain(scratch).chain(std::iter::once(&out)).any(|p| p % 16 != 0) {
            return Err(bad("every buffer must be 16-byte aligned".into()));
        }
        let (mut in_p, mut sc_p, mut out_p) = (ptrs(inputs), ptrs(scratch), out);
        let head: Vec<*mut c_void> = match kind {
            Kind::OneShot => vec![(&mut in_p as *mut Ptrs).cast(), (&mut out_p as *mut u64).cast()],
            _ => {
                vec![(&mut in_p as *mut Ptrs).cast(), (&mut sc_p as *mut Ptrs).cast(), (&mut out_p as *mut u64).cast()]
            }
        };
        let shape = LaunchShape { flags, rank, world, bytes, blocks };
        // SAFETY: `head` matches the kernel's leading parameters (RankPtrs are 8 × u64 by value, `out` a pointer);
        // the caller guarantees the buffers and the co-residency.
        unsafe { self.launch_with(kind, dtype, head, &shape, stream) }
    }

    /// Looks `kind`'s `dtype` kernel up, binds the context and launches it with the parameters `head` followed by
    /// the ones every kernel ends with: the flag pointers, rank, world and vector count.
    ///
    /// # Safety
    /// `head` points to live values matching the kernel's leading parameters; the caller's contract of
    /// [`Self::launch`] holds.
    unsafe fn launch_with(
        &self,
        kind: Kind,
        dtype: DataType,
        mut params: Vec<*mut c_void>,
        shape: &LaunchShape<'_>,
        stream: &CudaStream,
    ) -> Result<()> {
        let f = self.function(kind, dtype)?;
        self.ctx.bind()?;
        let mut fl_p = ptrs(shape.flags);
        let (mut rank_i, mut world_i) = (shape.rank as i32, shape.world as i32);
        let mut n_vec = (shape.bytes / kernels::VECTOR_BYTES) as u64;
        params.extend([
            (&mut fl_p as *mut Ptrs).cast(),
            (&mut rank_i as *mut i32).cast(),
            (&mut world_i as *mut i32).cast(),
            (&mut n_vec as *mut u64).cast(),
        ]);
        let grid = (shape.blocks, 1, 1);
        // SAFETY: the parameter list matches the kernel's signature (the caller's part, then FlagPtrs by value,
        // rank, world, n_vec); the caller guarantees the buffers and the co-residency.
        unsafe { result::launch_kernel(f, grid, (THREADS, 1, 1), 0, stream.raw(), &mut params) }
            .map_err(|e| cu_err("cuLaunchKernel", e))
    }
}

/// What every launch of a rank shares: every rank's flag array, this rank, the world, the message size and the
/// block count.
struct LaunchShape<'a> {
    flags: &'a [u64],
    rank: usize,
    world: usize,
    bytes: usize,
    blocks: u32,
}

impl CustomKernels {
    /// Launches one rank of an NVLS variant over the unicast emulation of the switch channel (the multicast
    /// kernels, `_mc`, are never launched by anyccl on machines where multicast is off).
    ///
    /// Zero-copy: `a[r]`/`b[r]` are every rank's input/output. Block pipeline: `a[r]`/`b[r]` are every rank's
    /// staging-in/staging-out buffers (each ≥ `bytes`), and `input`/`output` this rank's own buffers.
    ///
    /// # Safety
    /// As for [`Self::launch`]: valid 16-byte aligned device buffers of `bytes`, every rank launching the same
    /// kernels with the same `blocks`, all ranks' blocks co-resident.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch_nvls_emulated(
        &self,
        kind: Kind,
        dtype: DataType,
        a: &[u64],
        b: &[u64],
        input: u64,
        output: u64,
        flags: &[u64],
        rank: usize,
        bytes: usize,
        blocks: u32,
        stream: &CudaStream,
    ) -> Result<()> {
        let world = a.len();
        let bad = |m: String| Error::Backend {
            backend: "cuda".into(),
            call: "nvls (emulated)".into(),
            code: None,
            message: m,
        };
        if let Some(why) = ineligible(dtype, bytes, world) {
            return Err(bad(why));
        }
        if b.len() != world
            || flags.len() != world
            || rank >= world
            || blocks == 0
            || blocks as usize > kernels::MAX_BLOCKS
        {
            return Err(bad(format!(
                "{world} ranks, {} outputs, {} flags, rank {rank}, {blocks} blocks",
                b.len(),
                flags.len()
            )));
        }
        if a.iter().chain(b).chain([&input, &output]).any(|p| p % 16 != 0) {
            return Err(bad("every buffer must be 16-byte aligned".into()));
        }
        let (mut a_p, mut b_p) = (ptrs(a), ptrs(b));
        let (mut in_p, mut out_p) = (input, output);
        let head: Vec<*mut c_void> = match kind {
            Kind::NvlsZeroCopyEmulated => vec![(&mut a_p as *mut Ptrs).cast(), (&mut b_p as *mut Ptrs).cast()],
            Kind::NvlsBlockPipelineEmulated => vec![
                (&mut in_p as *mut u64).cast(),
                (&mut out_p as *mut u64).cast(),
                (&mut a_p as *mut Ptrs).cast(),
                (&mut b_p as *mut Ptrs).cast(),
            ],
            other => return Err(bad(format!("{other:?} is not an NVLS variant"))),
        };
        let shape = LaunchShape { flags, rank, world, bytes, blocks };
        // SAFETY: `head` matches the NVLS kernels' leading parameters; the caller guarantees buffers and
        // co-residency.
        unsafe { self.launch_with(kind, dtype, head, &shape, stream) }
    }
}

impl Drop for CustomKernels {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: loaded in `load`, unloaded once.
        if let Err(e) = unsafe { result::module::unload(self.module) } {
            tracing::warn!(error = %cu_err("cuModuleUnload", e), "unloading the kernels failed");
        }
    }
}
