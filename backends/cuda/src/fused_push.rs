//! The fused push one-shot (`anyccl_fused_push_one_shot_{f16,bf16}`, kernel source
//! `anyccl-kernels-common/include/anyccl/fused_push.h`): the push one-shot's exchange ([`crate::push`]: every rank
//! writes its rows into every peer's receive buffer, Lamport sentinels, no barrier round) and the residual add +
//! RMSNorm of the fused kernels in one kernel, launched with programmatic dependent launch on sm_90+. Its bits are
//! the fused one-shot's; it shares the push one-shot's receive buffers and protocol, so the two may follow each
//! other in any order on the same buffers. Messages up to [`PUSH_MAX_BYTES`].

use std::ffi::{c_void, CString};

use anyccl_ccl::gpu::fused::{fused_ineligible, NormArgs};
use anyccl_ccl::gpu::GpuPlatform;
use anyccl_core::{DataType, Error, Result};
use anyccl_kernels_cuda::fused_push::FUSED_PUSH_KERNELS;

use crate::custom::{CustomKernels, THREADS};
use crate::platform::{Cuda, CudaFunction};
use crate::push::PUSH_MAX_BYTES;
use crate::runtime::{CudaRuntime, CudaStream};

fn bad(m: String) -> Error {
    Error::backend("cuda", "fused push one-shot", None, m)
}

/// Why the fused push one-shot cannot run `tokens` × `hidden` of `dtype` on `world` ranks, if it cannot: the fused
/// kernels' limits (f16/bf16, hidden a multiple of 8 up to 16384, 2–8 ranks) and the receive slots' size.
pub fn ineligible(dtype: DataType, tokens: usize, hidden: usize, world: usize) -> Option<String> {
    if let Some(why) = fused_ineligible(dtype, hidden, world) {
        return Some(why);
    }
    let bytes = tokens.checked_mul(hidden).and_then(|n| n.checked_mul(dtype.size_bytes()));
    match bytes {
        Some(b) if b <= PUSH_MAX_BYTES => None,
        _ => Some(format!(
            "{tokens} × {hidden} elements of {dtype} exceed the push receive slots ({PUSH_MAX_BYTES} bytes)"
        )),
    }
}

/// The grid for `tokens` rows of `bytes` on `world` ranks: a block per row, at least the push one-shot's grid for
/// the same bytes (blocks beyond the rows only push), at most `max(8, 64 / world)` (every rank's blocks resident
/// twice over on one GPU, as for the push one-shot).
pub fn fused_push_blocks(tokens: usize, bytes: usize, world: usize) -> u32 {
    let max = (64 / world.max(1)).max(8);
    (tokens.max(crate::push::push_blocks(bytes, world) as usize)).clamp(1, max) as u32
}

/// Handles of the fused push kernels in a loaded custom-kernel module (looked up once; `None` where the module
/// lacks one). Valid while that module lives: keep both together.
#[derive(Clone, Copy)]
pub struct FusedPushKernels {
    functions: [Option<CudaFunction>; 2],
}

impl FusedPushKernels {
    /// Looks the kernels up in `custom`'s module.
    pub fn from_custom(custom: &CustomKernels) -> Self {
        let mut functions = [None; 2];
        for (f, name) in functions.iter_mut().zip(FUSED_PUSH_KERNELS) {
            // Kernel names are fixed ASCII without NUL bytes.
            let Ok(c) = CString::new(name) else { continue };
            match custom.function_named(&c) {
                Ok(h) => *f = Some(h),
                Err(e) => tracing::debug!(kernel = name, error = %e, "no such kernel"),
            }
        }
        FusedPushKernels { functions }
    }

    fn function(&self, dtype: DataType) -> Result<CudaFunction> {
        let i = match dtype {
            DataType::F16 => 0,
            DataType::Bf16 => 1,
            other => return Err(bad(format!("the fused push one-shot takes f16 and bf16, not {other}"))),
        };
        self.functions[i].ok_or_else(|| {
            bad(format!("the loaded kernel module has no {} (built from an older source?)", FUSED_PUSH_KERNELS[i]))
        })
    }

    /// How many blocks of the `dtype` kernel fit on the device at once.
    pub fn resident_blocks(&self, runtime: &CudaRuntime, dtype: DataType) -> Result<usize> {
        let f = self.function(dtype)?;
        Ok(Cuda::max_active_blocks_per_sm(runtime, f, THREADS)? * Cuda::sm_count(runtime)?)
    }

    /// Launches one rank's fused push call: its `args.tokens` rows of `input` pushed into every peer's receive
    /// buffer, then reduced, added to the residual and normalised (`args`). With `pdl` (sm_90+ only: the caller
    /// checks) the launch carries the programmatic-stream-serialization attribute.
    ///
    /// # Safety
    /// `input` holds the rows (`tokens × hidden` elements, ≤ [`PUSH_MAX_BYTES`]) on this device and `args` points
    /// at live buffers of the sizes the fused kernels need (residual, weight, out; see `NormArgs`), 16-byte
    /// aligned; every `recv[r]` is a live receive buffer of [`crate::push::PUSH_RECV_BYTES`] initialised by
    /// [`crate::push::init_receive_buffer`] and used by this group of ranks only; `my_flags` a live flag array;
    /// every rank launches the same sequence of push calls concurrently (all ranks' blocks co-resident).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        runtime: &CudaRuntime,
        dtype: DataType,
        input: u64,
        args: &NormArgs,
        recv: &[u64],
        my_flags: u64,
        rank: usize,
        blocks: u32,
        pdl: bool,
        stream: &CudaStream,
    ) -> Result<()> {
        let world = recv.len();
        let tokens = usize::try_from(args.tokens).map_err(|e| bad(e.to_string()))?;
        let hidden = args.hidden_vec as usize * 8;
        if let Some(why) = ineligible(dtype, tokens, hidden, world) {
            return Err(bad(why));
        }
        if rank >= world || blocks == 0 || blocks as usize > anyccl_kernels_cuda::MAX_BLOCKS {
            return Err(bad(format!("rank {rank} of {world}, {blocks} blocks")));
        }
        let ptrs = [input, args.residual, args.weight, args.out, my_flags];
        if recv.iter().chain(&ptrs).any(|p| p % 16 != 0) {
            return Err(bad("every buffer must be 16-byte aligned".into()));
        }
        let f = self.function(dtype)?;
        let mut recv_p = [0u64; anyccl_kernels_cuda::MAX_RANKS];
        for (d, s) in recv_p.iter_mut().zip(recv) {
            *d = *s;
        }
        let (mut in_p, mut a, mut flags_p) = (input, *args, my_flags);
        // rank < world <= 8 (checked above and by `ineligible`).
        let (mut rank_i, mut world_i) = (rank as i32, world as i32);
        let mut params: [*mut c_void; 6] = [
            (&mut in_p as *mut u64).cast(),
            (&mut a as *mut NormArgs).cast(),
            (&mut recv_p as *mut [u64; 8]).cast(),
            (&mut flags_p as *mut u64).cast(),
            (&mut rank_i as *mut i32).cast(),
            (&mut world_i as *mut i32).cast(),
        ];
        // SAFETY: `params` matches the kernel's signature (FUSED_PUSH_PARAMS: in, NormArgs by value, RankPtrs by
        // value, my_flags, rank, world) and points to locals that outlive the call; the caller guarantees the
        // buffers and the co-residency.
        unsafe {
            if pdl {
                Cuda::launch_dependent(runtime, f, (blocks, 1, 1), (THREADS, 1, 1), stream, &mut params)
            } else {
                Cuda::launch(runtime, f, (blocks, 1, 1), (THREADS, 1, 1), stream, &mut params)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eligibility_and_grid() {
        assert_eq!(ineligible(DataType::Bf16, 16, 8192, 8), None);
        let big = ineligible(DataType::Bf16, 17, 8192, 8).expect("over 256 KiB");
        assert!(big.contains("receive slots"), "{big}");
        assert!(ineligible(DataType::F32, 1, 8192, 2).is_some());
        assert!(ineligible(DataType::F16, 1, 8192, 1).is_some());
        assert!(ineligible(DataType::F16, usize::MAX, 8192, 2).is_some());
        // A block per row, at least the push grid, at most max(8, 64 / world).
        assert_eq!(fused_push_blocks(1, 16 << 10, 8), 4);
        assert_eq!(fused_push_blocks(6, 96 << 10, 8), 8);
        assert_eq!(fused_push_blocks(16, 256 << 10, 8), 8);
        assert_eq!(fused_push_blocks(16, 256 << 10, 2), 32);
        assert_eq!(fused_push_blocks(1, 16 << 10, 2), 4);
    }
}
