//! The push one-shot all-reduce ([`Algorithm::OneShotPush`], kernel source
//! `anyccl-kernels-common/include/anyccl/push.h`) on a communicator, written once for every vendor: its receive
//! buffers' size setting, the kernels of the custom kernels' module, and their launch (with programmatic dependent
//! launch where the platform has it, [`GpuPlatform::launch_dependent`]).
//!
//! Every rank writes its input into its slot of every peer's receive buffer and reduces the slots of its own in
//! rank order 0..W−1 with the one-shot's adds (bitwise the one-shot's result, so it counts as deterministic).
//! Completion is flag-free (a sentinel in every word of an empty slot); calls alternate between two buffer sets by
//! a call counter kept in each receive buffer, on the device: a captured push replays correctly with nothing
//! recorded on the host. The kernel reads this rank's input directly (no staging, no input table), so eager and
//! captured calls launch the same thing. In place is fine: peers never read this rank's input, only their own
//! receive buffers.
//!
//! Each rank's receive buffer holds [`PUSH_RECV_BYTES`] (two sets of eight 256 KiB slots, about 4 MiB), whatever
//! `ANYCCL_PUSH_MAX_BYTES` says: the slots' size is compiled into the kernel. The setting only lowers the largest
//! message the push one-shot takes, or turns it off (`0`: no receive buffer is allocated at all).

use std::ffi::CString;

use anyccl_core::{Algorithm, DataType, Error, MemoryRuntime, Result};
use anyccl_kernels_common as common;
use common::fused_push::FUSED_PUSH_KERNELS;
use common::push::{PUSH_CTRL_OFFSET, PUSH_KERNELS, PUSH_TWO_SHOT_KERNELS};
pub use common::push::{PUSH_MAX_BYTES, PUSH_RECV_BYTES, PUSH_SENTINEL};

use super::fused::NormArgs;
use super::kernels::{CustomKernels, THREADS};
use super::{BufferOf, GpuPlatform, StreamOf};
use crate::launch_args::KernelArgs;

/// The environment variable that bounds (or turns off) the push one-shot.
pub const ENV_PUSH_MAX_BYTES: &str = "ANYCCL_PUSH_MAX_BYTES";

/// Largest message the push one-shot takes by default: the kernel's slot size, 256 KiB. On one H200 with emulated
/// ranks the push one-shot (with programmatic dependent launch) took 0.39–0.46× the one-shot's time at 2 ranks
/// from 4 to 256 KiB, and 0.59–0.67× at 8 ranks up to 64 KiB, but 1.04–1.06× at 256 KiB with 8 ranks: the default
/// selector table uses it only where it won (docs/benchmarks.md).
pub const DEFAULT_PUSH_MAX_BYTES: usize = PUSH_MAX_BYTES;

/// The push one-shot's largest message: `ANYCCL_PUSH_MAX_BYTES` (a size up to 256 KiB, rounded up to 16 bytes;
/// `0` turns the push one-shot off) or [`DEFAULT_PUSH_MAX_BYTES`].
pub fn push_capacity(env: &dyn Fn(&str) -> Option<String>) -> Result<usize> {
    let Some(v) = env(ENV_PUSH_MAX_BYTES) else {
        return Ok(DEFAULT_PUSH_MAX_BYTES);
    };
    let bad = || Error::Parse {
        what: ENV_PUSH_MAX_BYTES,
        input: v.clone(),
        expected: format!("0 (off) or a size up to {PUSH_MAX_BYTES} bytes (256KiB), such as 64KiB"),
    };
    let bytes = anyccl_core::units::parse_bytes(&v).map_err(|_| bad())?;
    let bytes = usize::try_from(bytes).map_err(|_| bad())?;
    if bytes > PUSH_MAX_BYTES {
        return Err(bad());
    }
    bytes.checked_next_multiple_of(common::VECTOR_BYTES).ok_or_else(bad)
}

/// Blocks per rank of a push one-shot of `bytes` on `world` ranks: one per 8 KiB, from 4 to `max(8, 64 / world)`
/// (measured with anyccl-cuda-push-bench on an H200: 8 blocks beat 4 and 16 from 16 to 256 KiB, 4 were best at
/// 4 KiB). Ranks may use different grids (each block of a call reads the call counter itself); every rank uses
/// this one.
pub fn push_blocks(bytes: usize, world: usize) -> u32 {
    // At most 64 blocks: fits a u32.
    (bytes / (8 << 10)).clamp(4, push_blocks_cap(world)) as u32
}

/// The most blocks per rank any push grid rule gives on `world` ranks: `max(8, 64 / world)`, which keeps every
/// rank's blocks resident twice over (programmatic dependent launch) when the ranks are emulated on one GPU.
fn push_blocks_cap(world: usize) -> usize {
    (64 / world.max(1)).max(8)
}

/// Why the push one-shot kernel cannot run `dtype` × `bytes` on `world` ranks with receive slots for `capacity`
/// bytes, if it cannot (the custom kernels' own limits first).
pub fn ineligible<P: GpuPlatform>(dtype: DataType, bytes: usize, world: usize, capacity: usize) -> Option<String> {
    if let Some(why) = super::kernels::ineligible::<P>(dtype, bytes, world) {
        return Some(why);
    }
    if bytes > capacity {
        return Some(format!(
            "{bytes} bytes exceed the push one-shot's limit ({capacity} bytes; {ENV_PUSH_MAX_BYTES}, at most \
             {PUSH_MAX_BYTES})"
        ));
    }
    None
}

/// Why the fused push one-shot (`fused_push.h`: the push exchange, then the residual add + RMSNorm in the same
/// kernel) cannot run `tokens` rows of `hidden` elements of `dtype` on `world` ranks with receive slots for
/// `capacity` bytes, if it cannot: the fused kernels' bounds (f16/bf16, hidden a multiple of 8 up to 16384, 2–8
/// ranks) and the slots.
pub fn fused_push_ineligible(
    dtype: DataType,
    tokens: usize,
    hidden: usize,
    world: usize,
    capacity: usize,
) -> Option<String> {
    if let Some(why) = super::fused::fused_ineligible(dtype, hidden, world) {
        return Some(why);
    }
    let limit = capacity.min(PUSH_MAX_BYTES);
    match tokens.checked_mul(hidden).and_then(|n| n.checked_mul(dtype.size_bytes())) {
        Some(b) if b <= limit => None,
        _ => Some(format!(
            "{tokens} × {hidden} elements of {dtype} exceed the push receive slots' limit ({limit} bytes; \
             {ENV_PUSH_MAX_BYTES}, at most {PUSH_MAX_BYTES})"
        )),
    }
}

/// Blocks per rank of a fused push call of `tokens` rows, `bytes` in all, on `world` ranks: one per row, at least
/// [`push_blocks`] (blocks beyond the rows only push), at most `max(8, 64 / world)` (every rank's blocks resident
/// twice over on one GPU with emulated ranks, as for the push one-shot). Every rank uses the same.
pub fn fused_push_blocks(tokens: usize, bytes: usize, world: usize) -> u32 {
    // At most 64: fits a u32.
    tokens.max(push_blocks(bytes, world) as usize).clamp(1, push_blocks_cap(world)) as u32
}

/// The two shapes of the push protocol (`push.h`), over the same receive buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushShape {
    /// One hop: every rank writes its whole input into every peer's receive buffer ([`Algorithm::OneShotPush`]).
    OneShot,
    /// Two hops: chunk q of every input to rank q, which reduces it and writes the sum to every peer; each rank
    /// moves 2 (W − 1) / W of the message instead of W − 1 times it. The same bits as the one-shot
    /// ([`Algorithm::TwoShotPush`]).
    TwoShot,
}

impl PushShape {
    /// The grid rule of this shape: [`push_blocks`] or [`push_two_shot_blocks`].
    pub fn blocks(self, bytes: usize, world: usize) -> u32 {
        match self {
            PushShape::OneShot => push_blocks(bytes, world),
            PushShape::TwoShot => push_two_shot_blocks(bytes, world),
        }
    }

    fn what(self) -> &'static str {
        match self {
            PushShape::OneShot => "push one-shot",
            PushShape::TwoShot => "push two-shot",
        }
    }
}

/// Blocks per rank of a push two-shot of `bytes` on `world` ranks: one thread per vector of a chunk
/// (`ceil(bytes / 16 / world)` vectors), in blocks of 512 threads, from 2 to `max(8, 64 / world)` (measured on an
/// H200 with emulated ranks: within 3% of the best of 2, 4, 8 and 16 blocks from 4 to 256 KiB on 2, 4 and 8 ranks).
pub fn push_two_shot_blocks(bytes: usize, world: usize) -> u32 {
    let chunk_vecs = (bytes / common::VECTOR_BYTES).div_ceil(world.max(1));
    // At most 64 blocks: fits a u32.
    chunk_vecs.div_ceil(THREADS as usize).clamp(2, push_blocks_cap(world)) as u32
}

/// The push kernels of the custom kernels' module (valid while those kernels are), and whether launches use
/// programmatic dependent launch.
pub struct PushKernels<P: GpuPlatform> {
    /// f32, f16, bf16.
    functions: [P::Function; 3],
    /// The push two-shot for f32, f16, bf16, where the module has it.
    two_shot: [Option<P::Function>; 3],
    /// The fused push one-shot for f16 and bf16, where the module has it.
    fused: [Option<P::Function>; 2],
    /// `Ok`: launches carry programmatic dependent launch; `Err`: why they do not (plain launches, still correct).
    dependent: std::result::Result<(), String>,
}

impl<P: GpuPlatform> PushKernels<P> {
    /// Looks the three push kernels up in `kernels`' module and asks the platform whether launches on its device
    /// can overlap the stream's previous kernel.
    pub fn from_custom(kernels: &CustomKernels<P>) -> Result<Self> {
        let mut functions = Vec::with_capacity(PUSH_KERNELS.len());
        for name in PUSH_KERNELS {
            // Kernel names are fixed ASCII without NUL bytes.
            let c = CString::new(name).map_err(|e| Error::backend(P::NAME, "push kernels", None, e.to_string()))?;
            functions.push(kernels.function_named(&c)?);
        }
        let functions: [P::Function; 3] = functions
            .try_into()
            .map_err(|_| Error::backend(P::NAME, "push kernels", None, "three kernels expected".to_owned()))?;
        let optional = |names: &[&'static str], found: &mut [Option<P::Function>]| {
            for (f, name) in found.iter_mut().zip(names) {
                // Kernel names are fixed ASCII without NUL bytes.
                let Ok(c) = CString::new(*name) else { continue };
                match kernels.function_named(&c) {
                    Ok(h) => *f = Some(h),
                    Err(e) => tracing::debug!(kernel = name, error = %e, "kernel not in the module"),
                }
            }
        };
        let mut fused = [None; 2];
        optional(&FUSED_PUSH_KERNELS, &mut fused);
        let mut two_shot = [None; 3];
        optional(&PUSH_TWO_SHOT_KERNELS, &mut two_shot);
        let dependent = match P::dependent_launch_unavailable(kernels.runtime()) {
            None => Ok(()),
            Some(why) => Err(why),
        };
        Ok(PushKernels { functions, two_shot, fused, dependent })
    }

    fn fused_function(&self, dtype: DataType) -> std::result::Result<P::Function, String> {
        let i = match dtype {
            DataType::F16 => 0,
            DataType::Bf16 => 1,
            other => return Err(format!("the fused push one-shot takes f16 and bf16, not {other}")),
        };
        self.fused[i].ok_or_else(|| {
            format!("the loaded kernel module has no {} (built from an older source?)", FUSED_PUSH_KERNELS[i])
        })
    }

    /// Why the module cannot run the push kernel of `shape` for `dtype`, if it cannot.
    pub fn missing(&self, shape: PushShape, dtype: DataType) -> Option<String> {
        self.function(shape, dtype).err()
    }

    /// Why the module cannot run the fused push one-shot for `dtype`, if it cannot.
    pub fn fused_missing(&self, dtype: DataType) -> Option<String> {
        self.fused_function(dtype).err()
    }

    /// How many blocks of the fused push kernel of `dtype` fit on one multiprocessor at once.
    pub fn fused_blocks_per_sm(&self, runtime: &P::Runtime, dtype: DataType) -> Result<usize> {
        let f = self.fused_function(dtype).map_err(|m| Error::backend(P::NAME, "fused push one-shot", None, m))?;
        P::max_active_blocks_per_sm(runtime, f, THREADS)
    }

    /// Launches one rank's fused push call on [`fused_push_blocks`] blocks: its `args.tokens` rows of `input`
    /// pushed into every peer's receive buffer, then reduced in rank order, added to the residual and normalised
    /// as `args` says (the bits of the fused one-shot). With `dependent` (and the platform's programmatic
    /// dependent launch available: else an error) the launch overlaps the stream's previous kernel.
    ///
    /// # Safety
    /// `input` holds the rows on this device and `args` points at live buffers of this device of the sizes the
    /// fused kernels need (residual and out: `tokens × hidden`, weight: `hidden`); every `recv[r]` is a live
    /// receive buffer of [`PUSH_RECV_BYTES`] initialised by [`init_receive_buffer`] and used by this group only
    /// (push one-shot calls may share it: one protocol); `my_flags` a live flag array; every rank launches the same
    /// sequence of push calls, and their blocks are co-resident.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch_fused(
        &self,
        runtime: &P::Runtime,
        dtype: DataType,
        input: u64,
        args: &NormArgs,
        recv: &[u64],
        my_flags: u64,
        rank: usize,
        capacity: usize,
        dependent: bool,
        stream: &StreamOf<P>,
    ) -> Result<()> {
        let world = recv.len();
        let bad = |m: String| Error::backend(P::NAME, "fused push one-shot", None, m);
        let tokens = usize::try_from(args.tokens).map_err(|e| bad(e.to_string()))?;
        let hidden = args.hidden_vec as usize * 8;
        if let Some(why) = fused_push_ineligible(dtype, tokens, hidden, world, capacity) {
            return Err(bad(why));
        }
        if rank >= world {
            return Err(bad(format!("rank {rank} of {world}")));
        }
        let ptrs_in = [input, args.residual, args.weight, args.out, my_flags];
        if recv.iter().chain(&ptrs_in).any(|p| *p == 0 || p % 16 != 0) {
            return Err(bad("every buffer must be non-null and 16-byte aligned".into()));
        }
        if dependent {
            self.dependent_launch().map_err(|why| bad(why.to_owned()))?;
        }
        let f = self.fused_function(dtype).map_err(bad)?;
        let bytes = tokens * hidden * dtype.size_bytes();
        // rank < world <= MAX_RANKS (checked above and by `fused_push_ineligible`).
        let mut kargs = fused_push_args(input, args, recv, my_flags, rank as i32, world as i32);
        let (mut params, n) = kargs
            .pointers_for(&common::fused_push::FUSED_PUSH_PARAMS)
            .ok_or_else(|| bad("parameters off the kernel's layout".into()))?;
        let params = &mut params[..n];
        let grid = (fused_push_blocks(tokens, bytes, world), 1, 1);
        // SAFETY: `params` matches the kernel's signature (FUSED_PUSH_PARAMS, checked) and points into `kargs`,
        // which outlives the call; the caller guarantees the buffers and that every rank makes the same calls.
        unsafe {
            if dependent {
                P::launch_dependent(runtime, f, grid, (THREADS, 1, 1), stream, params)
            } else {
                P::launch(runtime, f, grid, (THREADS, 1, 1), stream, params)
            }
        }
    }

    /// `Ok` when launches use programmatic dependent launch, else why not.
    pub fn dependent_launch(&self) -> std::result::Result<(), &str> {
        self.dependent.as_ref().map(|_| ()).map_err(String::as_str)
    }

    /// How many blocks of the push kernel of `dtype` fit on one multiprocessor at once.
    pub fn blocks_per_sm(&self, runtime: &P::Runtime, dtype: DataType) -> Result<usize> {
        let f =
            self.function(PushShape::OneShot, dtype).map_err(|m| Error::backend(P::NAME, "push one-shot", None, m))?;
        P::max_active_blocks_per_sm(runtime, f, THREADS)
    }

    /// The kernel of `shape` for `dtype`, or why the module has none.
    fn function(&self, shape: PushShape, dtype: DataType) -> std::result::Result<P::Function, String> {
        let slot = match dtype {
            DataType::F32 => 0,
            DataType::F16 => 1,
            DataType::Bf16 => 2,
            other => return Err(format!("no {} kernel for {other}", shape.what())),
        };
        match shape {
            PushShape::OneShot => Ok(self.functions[slot]),
            PushShape::TwoShot => self.two_shot[slot].ok_or_else(|| {
                format!("the loaded kernel module has no {} (built from an older source?)", PUSH_TWO_SHOT_KERNELS[slot])
            }),
        }
    }

    /// Launches one rank's push all-reduce of `bytes` from `input` into `output` (may equal `input`) with the
    /// kernel of `shape` on `grid` (blocks 1 to 128; [`push_blocks`] or [`push_two_shot_blocks`] for a
    /// communicator; `dependent` needs the platform's programmatic dependent launch, else an error). `recv[r]` is
    /// rank r's receive buffer as addressable here and `my_flags` this rank's flag array (its abort word stops the
    /// kernel's waits); `capacity` bounds `bytes` (at most [`PUSH_MAX_BYTES`]). Every rank of a call must use the
    /// same shape; push calls of both shapes may follow each other on the same receive buffers.
    ///
    /// # Safety
    /// `input`/`output` hold `bytes` of this device; every `recv[r]` is a live receive buffer of
    /// [`PUSH_RECV_BYTES`] initialised by [`init_receive_buffer`] and used by this group only; `my_flags` a live
    /// flag array; every rank launches the same sequence of push calls; ranks run on different devices, or, when
    /// they are emulated on one device, every rank's blocks are resident at once.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        shape: PushShape,
        runtime: &P::Runtime,
        dtype: DataType,
        input: u64,
        output: u64,
        recv: &[u64],
        my_flags: u64,
        rank: usize,
        bytes: usize,
        capacity: usize,
        grid: PushGrid,
        stream: &StreamOf<P>,
    ) -> Result<()> {
        let world = recv.len();
        if let Some(why) = ineligible::<P>(dtype, bytes, world, capacity.min(PUSH_MAX_BYTES)) {
            return Err(match shape {
                PushShape::OneShot => Error::AlgorithmNotEligible { algorithm: Algorithm::OneShotPush, why },
                PushShape::TwoShot => Error::backend(P::NAME, shape.what(), None, why),
            });
        }
        let bad = |m: String| Error::backend(P::NAME, shape.what(), None, m);
        if rank >= world {
            return Err(bad(format!("rank {rank} of {world}")));
        }
        if recv.iter().chain([&input, &output, &my_flags]).any(|p| *p == 0 || p % 16 != 0) {
            return Err(bad("every buffer must be non-null and 16-byte aligned".into()));
        }
        if grid.blocks == 0 || grid.blocks as usize > common::MAX_BLOCKS {
            return Err(bad(format!("{} blocks: 1 to {} are possible", grid.blocks, common::MAX_BLOCKS)));
        }
        if grid.dependent {
            self.dependent_launch().map_err(|why| bad(why.to_owned()))?;
        }
        let f = self.function(shape, dtype).map_err(bad)?;
        // rank < world <= MAX_RANKS (checked above and by `ineligible`).
        let mut kargs = push_args(input, output, recv, my_flags, rank as i32, world as i32, bytes);
        let (mut params, n) = kargs
            .pointers_for(&common::push::PUSH_PARAMS)
            .ok_or_else(|| bad("parameters off the kernel's layout".into()))?;
        let params = &mut params[..n];
        let dims = (grid.blocks, 1, 1);
        // SAFETY: `params` matches the kernel's signature (PUSH_PARAMS, checked) and points into `kargs`, which
        // outlives the call;
        // the caller guarantees the buffers and that every rank makes the same calls.
        unsafe {
            if grid.dependent {
                P::launch_dependent(runtime, f, dims, (THREADS, 1, 1), stream, params)
            } else {
                P::launch(runtime, f, dims, (THREADS, 1, 1), stream, params)
            }
        }
    }
}

/// The push kernels' parameters (both shapes), in the order of `common::push::PUSH_PARAMS`.
fn push_args(input: u64, output: u64, recv: &[u64], my_flags: u64, rank: i32, world: i32, bytes: usize) -> KernelArgs {
    let n_vec = (bytes / common::VECTOR_BYTES) as u64;
    KernelArgs::new().u64(input).u64(output).ptrs(recv).u64(my_flags).i32(rank).i32(world).u64(n_vec)
}

/// The fused push one-shot's parameters, in the order of `common::fused_push::FUSED_PUSH_PARAMS`.
fn fused_push_args(input: u64, args: &NormArgs, recv: &[u64], my_flags: u64, rank: i32, world: i32) -> KernelArgs {
    KernelArgs::new().u64(input).block(args).ptrs(recv).u64(my_flags).i32(rank).i32(world)
}

/// A push launch's grid: blocks per rank, and whether it overlaps the stream's previous kernel (programmatic
/// dependent launch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushGrid {
    /// Blocks per rank (1 to 128).
    pub blocks: u32,
    /// Launch with programmatic dependent launch.
    pub dependent: bool,
}

/// A receive buffer's initial bytes: the sentinel in every slot, the control words (call counter, arrivals) zero.
/// Fallible: 4 MiB of host memory.
fn initial_receive_bytes() -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(PUSH_RECV_BYTES)
        .map_err(|e| Error::backend("anyccl", "push receive buffer", None, e.to_string()))?;
    bytes.resize(PUSH_CTRL_OFFSET, 0xFF);
    bytes.resize(PUSH_RECV_BYTES, 0);
    Ok(bytes)
}

/// Writes the initial state into `buf` (at least [`PUSH_RECV_BYTES`]) on `stream` and waits for it. Not during
/// capture (an upload is not capture-safe).
pub fn init_receive_buffer<P: GpuPlatform>(rt: &P::Runtime, buf: &mut BufferOf<P>, stream: &StreamOf<P>) -> Result<()> {
    if buf.len() < PUSH_RECV_BYTES {
        return Err(Error::backend(
            P::NAME,
            "push receive buffer",
            None,
            format!("a receive buffer holds {PUSH_RECV_BYTES} bytes, this one {}", buf.len()),
        ));
    }
    rt.upload(buf, &initial_receive_bytes()?, stream)
}

/// Allocates and initialises this rank's receive buffer on `rt`.
pub fn own_receive_buffer<P: GpuPlatform>(rt: &P::Runtime) -> Result<BufferOf<P>> {
    let stream = P::stream(rt)?;
    let mut buf = rt.alloc(PUSH_RECV_BYTES)?;
    init_receive_buffer::<P>(rt, &mut buf, &stream)?;
    Ok(buf)
}

/// The push one-shot's part of a rank's custom-kernel state: the kernels, this rank's receive buffer, the peers'
/// (mapped through IPC, closed on drop, or reached through peer access), and the largest message it takes.
pub(crate) struct PushState<P: GpuPlatform> {
    pub(crate) kernels: PushKernels<P>,
    /// This rank's receive buffer (freed on drop, after the mappings of the state it belongs to are closed).
    pub(crate) _recv: BufferOf<P>,
    /// Peers' receive buffers opened through IPC (one process per GPU).
    pub(crate) _mappings: Vec<P::Mapping>,
    /// Every rank's receive buffer as addressable from this device (index = rank).
    pub(crate) all_recv: Vec<u64>,
    /// Largest message ([`push_capacity`], agreed by every rank).
    pub(crate) capacity: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let owned: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| owned.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn the_push_limit_defaults_to_the_slot_size_and_refuses_more() {
        assert_eq!(push_capacity(&env(&[])).expect("default"), 256 << 10);
        assert_eq!(DEFAULT_PUSH_MAX_BYTES, PUSH_MAX_BYTES);
        for (v, want) in [("64KiB", 64 << 10), ("0", 0), ("1000", 1008), ("256KiB", 256 << 10)] {
            assert_eq!(push_capacity(&env(&[(ENV_PUSH_MAX_BYTES, v)])).expect(v), want, "{v}");
        }
        for bad in ["257KiB", "1MiB", "lots", "-1", "18446744073709551615"] {
            let e = push_capacity(&env(&[(ENV_PUSH_MAX_BYTES, bad)])).expect_err(bad);
            assert!(e.to_string().contains(ENV_PUSH_MAX_BYTES) && e.to_string().contains("262144"), "{e}");
        }
    }

    #[test]
    fn push_blocks_stay_within_the_measured_bounds() {
        assert_eq!(push_blocks(4 << 10, 8), 4);
        assert_eq!(push_blocks(64 << 10, 8), 8);
        assert_eq!(push_blocks(256 << 10, 8), 8);
        assert_eq!(push_blocks(256 << 10, 2), 32);
        assert_eq!(push_blocks(16, 2), 4);
        assert!((1..=8).all(|w| push_blocks(PUSH_MAX_BYTES, w) as usize <= common::MAX_BLOCKS));
    }

    #[test]
    fn push_two_shot_blocks_cover_a_chunk_within_the_bounds() {
        // 256 KiB on 8 ranks: chunks of 2048 vectors, 4 blocks of 512 threads.
        assert_eq!(push_two_shot_blocks(256 << 10, 8), 4);
        assert_eq!(push_two_shot_blocks(256 << 10, 2), 16);
        assert_eq!(push_two_shot_blocks(4 << 10, 8), 2);
        assert_eq!(push_two_shot_blocks(16, 2), 2);
        assert!((1..=8).all(|w| push_two_shot_blocks(PUSH_MAX_BYTES, w) as usize <= common::MAX_BLOCKS));
    }

    #[test]
    fn a_fresh_receive_buffer_is_sentinels_then_zeroed_control_words() {
        let b = initial_receive_bytes().expect("4 MiB");
        assert_eq!(b.len(), PUSH_RECV_BYTES);
        assert!(b[..PUSH_CTRL_OFFSET]
            .chunks_exact(4)
            .all(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) == PUSH_SENTINEL));
        assert!(b[PUSH_CTRL_OFFSET..].iter().all(|x| *x == 0));
    }

    #[test]
    fn fused_push_eligibility_and_grid() {
        let cap = PUSH_MAX_BYTES;
        assert_eq!(fused_push_ineligible(DataType::Bf16, 16, 8192, 8, cap), None);
        let big = fused_push_ineligible(DataType::Bf16, 17, 8192, 8, cap).expect("over 256 KiB");
        assert!(big.contains("receive slots") && big.contains(ENV_PUSH_MAX_BYTES), "{big}");
        assert!(fused_push_ineligible(DataType::Bf16, 8, 8192, 8, 64 << 10).is_some(), "over the setting");
        assert!(fused_push_ineligible(DataType::F32, 1, 8192, 2, cap).is_some());
        assert!(fused_push_ineligible(DataType::F16, 1, 8192, 1, cap).is_some());
        assert!(fused_push_ineligible(DataType::F16, 1, 1020, 2, cap).is_some());
        assert!(fused_push_ineligible(DataType::F16, usize::MAX, 8192, 2, cap).is_some());
        // A block per row, at least the push grid, at most max(8, 64 / world).
        assert_eq!(fused_push_blocks(1, 16 << 10, 8), 4);
        assert_eq!(fused_push_blocks(6, 96 << 10, 8), 8);
        assert_eq!(fused_push_blocks(16, 256 << 10, 8), 8);
        assert_eq!(fused_push_blocks(16, 256 << 10, 2), 32);
        assert_eq!(fused_push_blocks(1, 16 << 10, 2), 4);
        // The parameters the launcher builds: in, NormArgs, RankPtrs, my_flags, rank, world.
        let built = fused_push_args(16, &NormArgs::default(), &[32, 48], 64, 0, 2);
        assert!(built.matches(&common::fused_push::FUSED_PUSH_PARAMS), "{:?}", built.sizes());
    }

    #[test]
    fn the_packed_parameters_are_the_push_kernels() {
        let built = push_args(16, 32, &[48, 64], 80, 1, 2, 4096);
        assert!(built.matches(&common::push::PUSH_PARAMS), "{:?}", built.sizes());
    }
}
