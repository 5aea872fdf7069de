//! The fused all-reduce + residual add + RMSNorm with N ranks emulated on one GPU (N buffer sets, N streams), and
//! its unfused baseline (the custom all-reduce kernel, then the separate RMSNorm kernel), for the fused kernels'
//! tests and `anyccl-cuda-fused-bench`.

use std::sync::Arc;

use anyccl_core::{DataType, Error, MemoryRuntime, Result};
use anyccl_gpu::fused::{fused_ineligible, two_shot_scratch_bytes, FusedForm, FusedOutput, NormArgs};
use anyccl_kernels_cuda::FLAG_BYTES;

use crate::emulated::InputMode;
use crate::push::{
    init_receive_buffer, push_blocks, PushGrid, PushKernels, PushShape, PUSH_MAX_BYTES, PUSH_RECV_BYTES,
};
use anyccl_cuda::custom::{input_table, CustomKernels, Inputs, Kind, INPUT_TABLE_BYTES, TWO_SHOT_ROUND_BYTES};
use anyccl_cuda::graph::Graph;
use anyccl_cuda::platform::Cuda;
use anyccl_cuda::runtime::{CudaRuntime, CudaStream, DeviceBuffer};
use anyccl_gpu::push::{fused_push_blocks, fused_push_ineligible};

/// The fused kernels loaded for one CUDA device.
pub type FusedKernels = anyccl_gpu::fused::FusedKernels<Cuda>;

/// How a call is carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FusedPath {
    /// One fused kernel.
    Fused(FusedForm),
    /// The custom all-reduce kernel of this kind (one-shot or two-shot) into `allreduced`, then the separate
    /// RMSNorm kernel.
    Unfused(Kind),
    /// The fused push one-shot (`fused_push.h`; needs [`EmulatedFused::enable_push`]).
    FusedPush,
    /// The push one-shot all-reduce into `allreduced`, then the separate RMSNorm kernel (needs
    /// [`EmulatedFused::enable_push`]).
    UnfusedPush,
}

impl FusedPath {
    /// The four paths the tests and the bench compare.
    pub const ALL: [FusedPath; 4] = [
        FusedPath::Fused(FusedForm::OneShot),
        FusedPath::Fused(FusedForm::TwoShot),
        FusedPath::Unfused(Kind::OneShot),
        FusedPath::Unfused(Kind::TwoShot),
    ];

    /// The two push paths (messages up to the push receive slots' size; [`EmulatedFused::enable_push`]).
    pub const PUSH: [FusedPath; 2] = [FusedPath::FusedPush, FusedPath::UnfusedPush];

    /// Short name for tables and messages.
    pub fn name(self) -> String {
        match self {
            FusedPath::Fused(f) => f.name().to_string(),
            FusedPath::Unfused(k) => format!("{} + rmsnorm", k.name()),
            FusedPath::FusedPush => "fused push".to_string(),
            FusedPath::UnfusedPush => "push + rmsnorm".to_string(),
        }
    }
}

/// What the push paths need: the push one-shot and fused push kernels (handles into `kernels`' module of the
/// [`EmulatedFused`], launched the way the communicator launches them), a receive buffer per rank shared by both
/// (one protocol), the grids, and whether launches use programmatic dependent launch.
#[non_exhaustive]
pub struct PushPaths {
    /// The push one-shot and fused push kernels.
    pub kernels: PushKernels,
    /// Receive buffers, by rank ([`crate::push::PUSH_RECV_BYTES`] each).
    pub recv: Vec<DeviceBuffer>,
    /// Whether launches carry the programmatic-stream-serialization attribute (default: where the device has it).
    pub pdl: bool,
    /// Blocks per rank of the fused push kernel ([`fused_push_blocks`]).
    pub fused_blocks: u32,
    /// Blocks per rank of the push one-shot ([`push_blocks`]).
    pub push_blocks: u32,
}

/// N emulated ranks of a fused all-reduce + residual add + RMSNorm of `tokens` × `hidden` elements.
#[non_exhaustive]
pub struct EmulatedFused {
    /// The device runtime.
    pub runtime: CudaRuntime,
    /// The all-reduce kernels (the unfused baseline's first kernel).
    pub kernels: CustomKernels,
    /// The fused kernels and the separate RMSNorm kernel.
    pub fused: FusedKernels,
    /// One stream per rank.
    pub streams: Vec<CudaStream>,
    /// Inputs `x`, by rank.
    pub inputs: Vec<DeviceBuffer>,
    /// Residuals (read and overwritten by every call), by rank.
    pub residual: Vec<DeviceBuffer>,
    /// The RMSNorm weight (`hidden` elements), shared by the ranks.
    pub weight: DeviceBuffer,
    /// Outputs, by rank (the message size; fp8 output uses its first `tokens × hidden` bytes).
    pub out: Vec<DeviceBuffer>,
    /// The unfused path's all-reduce output, by rank.
    pub allreduced: Vec<DeviceBuffer>,
    /// Two-shot scratch (fused: residual rows then output rows; plain two-shot: the reduced chunks), by rank.
    pub scratch: Vec<DeviceBuffer>,
    /// Staging buffers ([`InputMode::Staged`], and unregistered input tables), by rank.
    pub staging: Vec<DeviceBuffer>,
    /// Flag arrays, by rank (zeroed at creation; shared by every kernel, in the same order on every rank).
    pub flags: Vec<DeviceBuffer>,
    /// Input tables, by rank ([`InputMode::Table`]).
    pub tables: Vec<DeviceBuffer>,
    /// Element type (f16 or bf16).
    pub dtype: DataType,
    /// Rows.
    pub tokens: usize,
    /// Elements per row.
    pub hidden: usize,
    /// Bytes of one rank's input.
    pub bytes: usize,
    /// Blocks per rank of the fused kernels and of the unfused path's all-reduce kernel.
    pub blocks: u32,
    /// Blocks of the separate RMSNorm kernel.
    pub norm_blocks: u32,
    /// RMSNorm's epsilon.
    pub eps: f32,
    /// Output type.
    pub output: FusedOutput,
    /// Where the kernels read the inputs.
    pub input_mode: InputMode,
    /// The push paths, once [`Self::enable_push`] set them up.
    pub push: Option<PushPaths>,
}

impl EmulatedFused {
    /// Allocates everything for `world` ranks of `tokens` × `hidden` elements of `dtype` on device `ordinal`;
    /// flag arrays zeroed, every other buffer uninitialised.
    pub fn new(ordinal: i32, world: usize, dtype: DataType, tokens: usize, hidden: usize, blocks: u32) -> Result<Self> {
        if let Some(why) = fused_ineligible(dtype, hidden, world) {
            return Err(Error::backend("cuda", "emulated fused ranks", None, why));
        }
        let too_large =
            || Error::backend("cuda", "emulated fused ranks", None, format!("{tokens} × {hidden}: too large"));
        let bytes = tokens.checked_mul(hidden).and_then(|n| n.checked_mul(dtype.size_bytes())).ok_or_else(too_large)?;
        if tokens == 0 {
            return Err(Error::backend("cuda", "emulated fused ranks", None, "0 tokens".to_string()));
        }
        let scratch_bytes =
            two_shot_scratch_bytes(dtype, tokens, hidden, FusedOutput::Same).ok_or_else(too_large)?.max(bytes);
        let runtime = CudaRuntime::new(ordinal)?;
        let kernels = CustomKernels::load(&runtime)?;
        // Handles into `kernels`' module (one load), which this struct keeps alive.
        let fused = FusedKernels::from_custom(&runtime, &kernels);
        let s0 = runtime.stream()?;
        let alloc = |n: usize| -> Result<Vec<DeviceBuffer>> { (0..world).map(|_| runtime.alloc(n)).collect() };
        let mut flags = alloc(FLAG_BYTES)?;
        for f in &mut flags {
            runtime.upload(f, &vec![0u8; FLAG_BYTES], &s0)?;
        }
        s0.synchronize()?;
        let mut g = EmulatedFused {
            inputs: alloc(bytes)?,
            residual: alloc(bytes)?,
            weight: runtime.alloc(hidden * dtype.size_bytes())?,
            out: alloc(bytes)?,
            allreduced: alloc(bytes)?,
            scratch: alloc(scratch_bytes)?,
            staging: alloc(bytes)?,
            tables: alloc(INPUT_TABLE_BYTES)?,
            streams: (0..world).map(|_| runtime.stream()).collect::<Result<Vec<_>>>()?,
            flags,
            runtime,
            kernels,
            fused,
            dtype,
            tokens,
            hidden,
            bytes,
            blocks,
            norm_blocks: blocks,
            eps: 1e-6,
            output: FusedOutput::Same,
            input_mode: InputMode::Direct,
            push: None,
        };
        g.set_tables(false)?;
        Ok(g)
    }

    /// Sets up the push paths: loads the push kernels, allocates a receive buffer per rank and initialises it (waits
    /// for that). Refuses a message larger than the receive slots. Not during capture.
    pub fn enable_push(&mut self) -> Result<()> {
        let world = self.streams.len();
        if let Some(why) = fused_push_ineligible(self.dtype, self.tokens, self.hidden, world, PUSH_MAX_BYTES) {
            return Err(Error::backend("cuda", "emulated fused ranks", None, why));
        }
        // Handles into `self.kernels`' module (loaded once), which this struct keeps alive.
        let kernels = PushKernels::from_custom(&self.kernels)?;
        if let Some(why) = kernels.fused_missing(self.dtype) {
            return Err(Error::backend("cuda", "emulated fused ranks", None, why));
        }
        let recv = (0..world).map(|_| self.runtime.alloc(PUSH_RECV_BYTES)).collect::<Result<Vec<_>>>()?;
        let s = &self.streams[0];
        recv.iter().try_for_each(|b| init_receive_buffer(b, s))?;
        s.synchronize()?;
        let pdl = kernels.dependent_launch().is_ok();
        self.push = Some(PushPaths {
            kernels,
            recv,
            pdl,
            fused_blocks: fused_push_blocks(self.tokens, self.bytes, world),
            push_blocks: push_blocks(self.bytes, world),
        });
        Ok(())
    }

    fn push_paths(&self, path: FusedPath) -> Result<&PushPaths> {
        self.push.as_ref().ok_or_else(|| {
            Error::backend("cuda", "emulated fused ranks", None, format!("{}: call enable_push first", path.name()))
        })
    }

    fn ptrs(v: &[DeviceBuffer]) -> Vec<u64> {
        v.iter().map(DeviceBuffer::device_ptr).collect()
    }

    /// Writes every rank's input table: the inputs themselves (`registered`), or the staging buffers. Not during
    /// capture.
    pub fn set_tables(&mut self, registered: bool) -> Result<()> {
        let ptrs = if registered { Self::ptrs(&self.inputs) } else { Self::ptrs(&self.staging) };
        let t = input_table(&ptrs, registered);
        let s = &self.streams[0];
        for b in &mut self.tables {
            self.runtime.upload(b, &t, s)?;
        }
        s.synchronize()
    }

    /// The arguments of rank `rank`'s add + RMSNorm.
    pub fn args(&self, rank: usize) -> NormArgs {
        NormArgs::new(
            self.residual[rank].device_ptr(),
            self.weight.device_ptr(),
            self.out[rank].device_ptr(),
            self.tokens,
            self.hidden,
            self.eps,
            self.output,
        )
    }

    /// Refuses a launch whose ranks' blocks could not all be resident at once.
    fn check_resident(&self, path: FusedPath) -> Result<()> {
        let (fit, blocks) = match path {
            FusedPath::Fused(form) => (self.fused.resident_blocks(form, self.dtype)?, self.blocks),
            FusedPath::Unfused(kind) => (self.kernels.resident_blocks(kind, self.dtype)?, self.blocks),
            FusedPath::FusedPush | FusedPath::UnfusedPush => {
                let p = self.push_paths(path)?;
                // With programmatic dependent launch a rank's next call may hold its blocks early: twice over.
                let twice = if p.pdl { 2 } else { 1 };
                if path == FusedPath::FusedPush {
                    let fit =
                        p.kernels.fused_blocks_per_sm(&self.runtime, self.dtype)? * self.kernels.multiprocessors();
                    (fit / twice, p.fused_blocks)
                } else {
                    let fit = p.kernels.blocks_per_sm(&self.runtime, self.dtype)? * self.kernels.multiprocessors();
                    (fit / twice, p.push_blocks)
                }
            }
        };
        let need = self.streams.len() * blocks as usize;
        if need > fit {
            return Err(Error::backend(
                "cuda",
                "emulated fused ranks",
                None,
                format!(
                    "{} ranks × {} blocks of {} need {need} resident blocks, the device holds {fit}",
                    self.streams.len(),
                    blocks,
                    path.name()
                ),
            ));
        }
        Ok(())
    }

    /// Launches every rank's kernels on its own stream (concurrently); does not wait.
    pub fn launch(&self, path: FusedPath) -> Result<()> {
        self.check_resident(path)?;
        self.streams.iter().enumerate().try_for_each(|(rank, s)| self.launch_rank(path, rank, s))
    }

    /// Launches rank `rank`'s kernels alone on `s`; does not wait (the barriers wait for the other ranks').
    pub fn launch_rank(&self, path: FusedPath, rank: usize, s: &CudaStream) -> Result<()> {
        let ins = Self::ptrs(&self.inputs);
        let staged = Self::ptrs(&self.staging);
        let (sc, fl) = (Self::ptrs(&self.scratch), Self::ptrs(&self.flags));
        let own = self.inputs[rank].device_ptr();
        let inputs = match self.input_mode {
            InputMode::Direct => Inputs::Direct(&ins),
            InputMode::Staged => Inputs::Staged { staging: &staged, own },
            InputMode::Table => Inputs::Table { table: self.tables[rank].device_ptr(), own },
        };
        let args = self.args(rank);
        // SAFETY: every buffer was allocated in `new` with the sizes the kernels need for `tokens` × `hidden`
        // (scratch: residual rows then output rows; cuMemAlloc is 256-byte aligned); `out` overlaps no input;
        // every rank's residual is uploaded by the caller; `launch` checked co-residency.
        unsafe {
            match path {
                FusedPath::Fused(form) => {
                    self.fused.launch_fused(form, self.dtype, inputs, &sc, &args, &fl, rank, self.blocks, s)
                }
                FusedPath::Unfused(kind) => {
                    let ar = self.allreduced[rank].device_ptr();
                    self.kernels.launch(
                        kind,
                        self.dtype,
                        inputs,
                        &sc,
                        ar,
                        &fl,
                        rank,
                        self.bytes,
                        self.blocks,
                        TWO_SHOT_ROUND_BYTES,
                        s,
                    )?;
                    self.fused.launch_rmsnorm(self.dtype, ar, &args, self.norm_blocks, s)
                }
                FusedPath::FusedPush => {
                    let p = self.push_paths(path)?;
                    let recv = Self::ptrs(&p.recv);
                    let (dtype, rt) = (self.dtype, &self.runtime);
                    p.kernels.launch_fused(rt, dtype, own, &args, &recv, fl[rank], rank, PUSH_MAX_BYTES, p.pdl, s)
                }
                FusedPath::UnfusedPush => {
                    let p = self.push_paths(path)?;
                    let recv = Self::ptrs(&p.recv);
                    let ar = self.allreduced[rank].device_ptr();
                    p.kernels.launch(
                        PushShape::OneShot,
                        &self.runtime,
                        self.dtype,
                        own,
                        ar,
                        &recv,
                        fl[rank],
                        rank,
                        self.bytes,
                        PUSH_MAX_BYTES,
                        PushGrid { blocks: p.push_blocks, dependent: p.pdl },
                        s,
                    )?;
                    self.fused.launch_rmsnorm(self.dtype, ar, &args, self.norm_blocks, s)
                }
            }
        }
    }

    /// Waits for every rank's stream.
    pub fn synchronize(&self) -> Result<()> {
        self.streams.iter().try_for_each(CudaStream::synchronize)
    }

    /// Captures each rank's `calls` back-to-back calls into one graph per rank.
    pub fn capture(&self, path: FusedPath, calls: usize) -> Result<Vec<Graph>> {
        self.check_resident(path)?;
        let ctx: &Arc<_> = self.runtime.context();
        self.streams
            .iter()
            .enumerate()
            .map(|(rank, s)| Graph::capture(ctx, s, |s| (0..calls).try_for_each(|_| self.launch_rank(path, rank, s))))
            .collect()
    }
}
