//! Launch glue for the custom all-reduce kernels of the shared kernel source (`anyccl-kernels-common`), written
//! once for every vendor: one-shot and two-shot (inputs read directly, through staging the kernel copies into, or
//! through an input table in device memory), and the unicast emulations of the NVLS zero-copy, warp-pipeline and
//! block-pipeline variants where the platform has them (CUDA).
//!
//! The kernels read peers' buffers through device pointers: IPC-mapped buffers of other processes, peers' buffers
//! through peer access, or other buffers of the same GPU when ranks are emulated (tests and benchmarks on one
//! GPU). Every rank launches the same sequence of kernels with the same grid; the per-block epoch counters in each
//! rank's flag array keep the barriers in step, also across graph replays. The parameters are packed here once
//! for `cuLaunchKernel` and `hipModuleLaunchKernel` alike (both take one pointer per parameter).

use std::ffi::{CStr, CString};

use anyccl_core::{DataType, Error, Result};
use anyccl_kernels_common as common;

use super::{GpuPlatform, StreamOf};
use crate::launch_args::KernelArgs;

/// Threads per block of every launch.
pub const THREADS: u32 = 512;

/// Which kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Kind {
    /// Every rank reduces the whole message from every peer.
    OneShot,
    /// Reduce-scatter into peer-visible scratch, then all-gather.
    TwoShot,
    /// NVLS zero-copy over the unicast emulation of the switch channel (inputs and outputs of every rank).
    NvlsZeroCopyEmulated,
    /// NVLS block pipeline over the unicast emulation (staging in/out of every rank).
    NvlsBlockPipelineEmulated,
    /// NVLS warp pipeline over the unicast emulation (staging in/out of every rank; copy-in, reduce and copy-out
    /// warps of a block work on consecutive tiles at once).
    NvlsWarpPipelineEmulated,
}

impl Kind {
    /// Every kernel, in table order.
    pub const ALL: [Kind; 5] = [
        Kind::OneShot,
        Kind::TwoShot,
        Kind::NvlsZeroCopyEmulated,
        Kind::NvlsWarpPipelineEmulated,
        Kind::NvlsBlockPipelineEmulated,
    ];

    /// Short name for tables and messages.
    pub fn name(self) -> &'static str {
        match self {
            Kind::OneShot => "one-shot",
            Kind::TwoShot => "two-shot",
            Kind::NvlsZeroCopyEmulated => "nvls-zero-copy (emu)",
            Kind::NvlsWarpPipelineEmulated => "nvls-warp-pipeline (emu)",
            Kind::NvlsBlockPipelineEmulated => "nvls-block-pipeline (emu)",
        }
    }

    /// Whether it is an NVLS variant (launched with [`CustomKernels::launch_nvls_emulated`]).
    pub fn is_nvls(self) -> bool {
        matches!(self, Kind::NvlsZeroCopyEmulated | Kind::NvlsWarpPipelineEmulated | Kind::NvlsBlockPipelineEmulated)
    }
}

/// Where a one-shot or two-shot kernel reads the ranks' inputs (index = rank, as addressable from this rank).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Inputs<'a> {
    /// Every rank's input itself: registered user buffers (mapped from the peers), or emulated ranks' buffers.
    Direct(&'a [u64]),
    /// Every rank's staging buffer (each ≥ the message); the kernel first copies `own`, this rank's input, into
    /// its own staging buffer, so no separate copy is launched.
    Staged {
        /// Every rank's staging buffer.
        staging: &'a [u64],
        /// This rank's input.
        own: u64,
    },
    /// An input table in device memory ([`INPUT_TABLE_BYTES`], see [`input_table`]): either every rank's staging
    /// buffer with `registered` 0 (the kernel then copies `own` in first, as for `Staged`), or every rank's
    /// registered input. Used for inputs first seen during graph capture, whose table is rewritten after capture.
    Table {
        /// Device address of the table.
        table: u64,
        /// This rank's input.
        own: u64,
    },
}

/// Bytes of one input table in device memory: eight rank pointers and a `registered` word (see [`Inputs::Table`]).
pub const INPUT_TABLE_BYTES: usize = (common::MAX_RANKS + 1) * 8;

/// The bytes of an input table: `ptrs` (index = rank), and whether they are the registered inputs themselves
/// (else they are staging buffers the kernel copies its own input into first).
pub fn input_table(ptrs: &[u64], registered: bool) -> [u8; INPUT_TABLE_BYTES] {
    let mut t = [0u8; INPUT_TABLE_BYTES];
    for (slot, p) in t.chunks_exact_mut(8).zip(ptrs.iter().take(common::MAX_RANKS)) {
        slot.copy_from_slice(&p.to_le_bytes());
    }
    t[common::MAX_RANKS * 8..].copy_from_slice(&u64::from(registered).to_le_bytes());
    t
}

/// The round size two-shot uses (0: the whole message in one round). One round: rounds of 1 to 8 MiB were slower
/// at every size with 8 emulated ranks on an H200 (docs/benchmarks.md, 2026-11-29);
/// `anyccl-cuda-emulated-bench --two-shot-rounds` measures them again.
pub const TWO_SHOT_ROUND_BYTES: usize = 0;

/// The element types the custom kernels are built for, in [`function_slot`] order.
pub(crate) const KERNEL_DTYPES: [DataType; 3] = [DataType::F32, DataType::F16, DataType::Bf16];
/// Kernels × input-table or not × element types.
pub(crate) const FUNCTION_SLOTS: usize = Kind::ALL.len() * 2 * KERNEL_DTYPES.len();

/// Where `kind`'s `dtype` kernel (with an input table or not) sits in [`CustomKernels`]' function table; `None`
/// for an element type without kernels.
pub(crate) fn function_slot(kind: Kind, dtype: DataType, table: bool) -> Option<usize> {
    let d = KERNEL_DTYPES.iter().position(|t| *t == dtype)?;
    let k = Kind::ALL.iter().position(|x| *x == kind)?;
    Some((k * 2 + usize::from(table)) * KERNEL_DTYPES.len() + d)
}

/// The kernel's symbol in the module; `None` where there is none (another element type, or an NVLS variant with
/// an input table).
pub fn kernel_name(kind: Kind, dtype: DataType, table: bool) -> Option<String> {
    use common::catalogue::{Family, NvlsVariant};
    let emulated = |variant| Family::Nvls { variant, multicast: false };
    let family = match (kind, table) {
        (Kind::OneShot, table) => Family::OneShot { table },
        (Kind::TwoShot, table) => Family::TwoShot { table },
        (_, true) => return None,
        (Kind::NvlsZeroCopyEmulated, false) => emulated(NvlsVariant::ZeroCopy),
        (Kind::NvlsBlockPipelineEmulated, false) => emulated(NvlsVariant::BlockPipeline),
        (Kind::NvlsWarpPipelineEmulated, false) => emulated(NvlsVariant::WarpPipeline),
    };
    common::catalogue::kernel_name(family, catalogue_dtype(dtype)?)
}

/// `dtype` as the kernel catalogue's element type; `None` for a type without kernels.
pub(crate) fn catalogue_dtype(dtype: DataType) -> Option<common::catalogue::Dtype> {
    use common::catalogue::Dtype;
    match dtype {
        DataType::F32 => Some(Dtype::F32),
        DataType::F16 => Some(Dtype::F16),
        DataType::Bf16 => Some(Dtype::Bf16),
        _ => None,
    }
}

/// Why platform `P`'s custom kernels cannot run `dtype` × `bytes` for `world` ranks, if they cannot.
pub fn ineligible<P: GpuPlatform>(dtype: DataType, bytes: usize, world: usize) -> Option<String> {
    if let Some(why) = unavailable::<P>(world) {
        return Some(why);
    }
    if catalogue_dtype(dtype).is_none() {
        return Some(format!("the custom kernels handle f32, f16 and bf16, not {dtype}"));
    }
    if !bytes.is_multiple_of(common::VECTOR_BYTES) {
        return Some(format!("{bytes} bytes is not a multiple of {} (16-byte vectors)", common::VECTOR_BYTES));
    }
    None
}

/// Why platform `P`'s custom kernels cannot serve a communicator of `world` ranks at all, if they cannot.
pub fn unavailable<P: GpuPlatform>(world: usize) -> Option<String> {
    if let Some(why) = P::kernels_not_built() {
        return Some(why);
    }
    if !(2..=common::MAX_RANKS).contains(&world) {
        return Some(format!("world {world} is outside 2..={}", common::MAX_RANKS));
    }
    None
}

/// The kernels loaded for one device.
pub struct CustomKernels<P: GpuPlatform> {
    /// Every kernel of the module, looked up once at load ([`function_slot`] indexes it); `None` where the module
    /// lacks it (the launch then says so). Declared before the module, so nothing outlives it.
    functions: [Option<P::Function>; FUNCTION_SLOTS],
    /// Unloaded on drop.
    _module: P::Module,
    runtime: P::Runtime,
    /// The device's multiprocessor count.
    sms: usize,
}

/// A table of up to `MAX_RANKS` device pointers passed by value (the kernels' `RankPtrs` / `FlagPtrs`); the
/// launchers of the fused and quantized kernels use it too.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Ptrs([u64; common::MAX_RANKS]);

/// `v`'s pointers in a [`Ptrs`], the unused entries null.
pub(crate) fn ptrs(v: &[u64]) -> Ptrs {
    let mut p = [0u64; common::MAX_RANKS];
    for (d, s) in p.iter_mut().zip(v) {
        *d = *s;
    }
    Ptrs(p)
}

impl<P: GpuPlatform> CustomKernels<P> {
    /// Loads the kernels' image for the runtime's device ([`GpuPlatform::kernel_image`]) and looks every kernel up
    /// once. Not during capture.
    pub fn load(runtime: &P::Runtime) -> Result<Self> {
        if let Some(why) = P::kernels_not_built() {
            return Err(Error::Unsupported {
                capability: "custom-kernels".into(),
                reason: anyccl_core::Reason::NotCompiledIn {
                    what: format!("custom {} kernels", P::LABEL),
                    detail: why,
                },
            });
        }
        let image = P::kernel_image(runtime)?;
        let module = P::load_module(runtime, image)?;
        let sms = P::sm_count(runtime)?;
        let mut functions = [None; FUNCTION_SLOTS];
        for kind in Kind::ALL.into_iter().filter(|k| P::NVLS_EMULATION || !k.is_nvls()) {
            for table in [false, true] {
                for dtype in KERNEL_DTYPES {
                    let (Some(slot), Some(name)) = (function_slot(kind, dtype, table), kernel_name(kind, dtype, table))
                    else {
                        continue;
                    };
                    // Kernel names are fixed ASCII without NUL bytes.
                    let Ok(c) = CString::new(name.clone()) else { continue };
                    match P::function(runtime, &module, &c) {
                        Ok(f) => functions[slot] = Some(f),
                        Err(e) => tracing::debug!(kernel = %name, error = %e, "no such kernel"),
                    }
                }
            }
        }
        Ok(CustomKernels { functions, _module: module, runtime: runtime.clone(), sms })
    }

    /// How many blocks of `kind`'s `dtype` kernel fit on the device at once (every SM's worth). Ranks emulated on
    /// one GPU need all their blocks resident together, or the cross-rank barriers wait forever.
    pub fn resident_blocks(&self, kind: Kind, dtype: DataType) -> Result<usize> {
        let f = self.function(kind, dtype, false)?;
        let per_sm = P::max_active_blocks_per_sm(&self.runtime, f, THREADS)?;
        Ok(per_sm * self.sms)
    }

    /// The device's multiprocessor count.
    pub fn multiprocessors(&self) -> usize {
        self.sms
    }

    /// Another kernel of the loaded module, by symbol (the fused kernels share the module:
    /// [`super::fused::FusedKernels::from_custom`]). Valid while these kernels are.
    pub fn function_named(&self, name: &CStr) -> Result<P::Function> {
        P::function(&self.runtime, &self._module, name)
    }

    /// The runtime the kernels were loaded on.
    pub(crate) fn runtime(&self) -> &P::Runtime {
        &self.runtime
    }

    /// `kind`'s `dtype` kernel (reading its inputs through a table or not), resolved when the module was loaded.
    fn function(&self, kind: Kind, dtype: DataType, table: bool) -> Result<P::Function> {
        let Some(slot) = function_slot(kind, dtype, table) else {
            return Err(Error::AlgorithmNotEligible {
                algorithm: anyccl_core::Algorithm::OneShot,
                why: format!("the custom kernels handle f32, f16 and bf16, not {dtype}"),
            });
        };
        self.functions[slot].ok_or_else(|| {
            Error::backend(
                P::NAME,
                "module function lookup",
                None,
                format!(
                    "the loaded module has no kernel {}",
                    kernel_name(kind, dtype, table).unwrap_or_else(|| format!("{kind:?} with an input table"))
                ),
            )
        })
    }

    /// Launches one rank's all-reduce of `bytes` bytes.
    ///
    /// `inputs` says where the kernel reads every rank's input (see [`Inputs`]), `scratch[r]` is rank r's
    /// peer-visible two-shot scratch (each ≥ `bytes`), `flags[r]` rank r's flag array
    /// ([`anyccl_kernels_common::FLAG_BYTES`], zeroed before first use), `out` this rank's output; index = rank, as
    /// addressable from this rank. Two-shot runs in rounds of `two_shot_round` bytes (a multiple of 16; 0: one
    /// round); every rank passes the same value.
    ///
    /// # Safety
    /// Every pointer is device memory of (or mapped into) this device with the sizes above, 16-byte aligned; every
    /// rank launches the same sequence of kernels with the same `blocks` and the same kind of [`Inputs`]
    /// concurrently (ranks' blocks must be co-resident, or the barriers deadlock). With [`Inputs::Direct`] and an
    /// in-place one-shot, `out` is a peer's input: only two-shot may write over its registered input.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        kind: Kind,
        dtype: DataType,
        inputs: Inputs<'_>,
        scratch: &[u64],
        out: u64,
        flags: &[u64],
        rank: usize,
        bytes: usize,
        blocks: u32,
        two_shot_round: usize,
        stream: &StreamOf<P>,
    ) -> Result<()> {
        let world = flags.len();
        if let Some(why) = ineligible::<P>(dtype, bytes, world) {
            return Err(Error::AlgorithmNotEligible { algorithm: anyccl_core::Algorithm::OneShot, why });
        }
        let bad = |m: String| Error::backend(P::NAME, "custom all-reduce", None, m);
        if kind.is_nvls() {
            return Err(bad(format!("{kind:?} is launched with launch_nvls_emulated")));
        }
        let (peers, own, table) = match inputs {
            Inputs::Direct(p) => (p, 0, 0),
            Inputs::Staged { staging, own } => (staging, own, 0),
            Inputs::Table { table, own } => (&[][..], own, table),
        };
        if (table == 0 && peers.len() != world) || (kind == Kind::TwoShot && scratch.len() != world) || rank >= world {
            return Err(bad(format!(
                "{} inputs, {world} flags, {} scratch buffers, rank {rank}",
                peers.len(),
                scratch.len()
            )));
        }
        if blocks == 0 || blocks as usize > common::MAX_BLOCKS {
            return Err(bad(format!("{blocks} blocks (1..={})", common::MAX_BLOCKS)));
        }
        if peers.iter().chain(scratch).chain([&out, &own]).any(|p| p % 16 != 0) || table % 8 != 0 {
            return Err(bad("every buffer must be 16-byte aligned".into()));
        }
        if !two_shot_round.is_multiple_of(common::VECTOR_BYTES) {
            return Err(bad(format!("a two-shot round of {two_shot_round} bytes is not a multiple of 16")));
        }
        let round_vecs = (two_shot_round / common::VECTOR_BYTES) as u64;
        let two = kind == Kind::TwoShot;
        let head = shot_head(two, table, peers, own, scratch, out, round_vecs);
        let shape = LaunchShape { flags, rank, world, bytes, blocks, table: table != 0 };
        let list = common::allreduce_params_of(!two, table != 0);
        // SAFETY: `head` holds the kernel's leading parameters (RankPtrs are 8 × u64 by value or an InputTable
        // pointer, then this rank's own input or null, two-shot's scratch, `out`, two-shot's round), and the whole
        // list is checked against the kernel's own (`list`); the caller guarantees the buffers and the
        // co-residency.
        unsafe { self.launch_with(kind, dtype, head, Some(list), &shape, stream) }
    }

    /// Takes `kind`'s `dtype` kernel from the table resolved at load and launches it with the parameters `head`
    /// followed by the ones every kernel ends with: the flag pointers, rank, world and vector count; refused
    /// unless the whole list has the sizes of `list`, the kernel's own in `anyccl-kernels-common` (`None` for a
    /// kernel it has none for: the NVLS emulations).
    ///
    /// # Safety
    /// `head` holds the kernel's leading parameters; the caller's contract of [`Self::launch`] holds.
    unsafe fn launch_with(
        &self,
        kind: Kind,
        dtype: DataType,
        head: KernelArgs,
        list: Option<&[common::Param]>,
        shape: &LaunchShape<'_>,
        stream: &StreamOf<P>,
    ) -> Result<()> {
        let f = self.function(kind, dtype, shape.table)?;
        // rank < world <= MAX_RANKS (checked by the callers).
        let n_vec = (shape.bytes / common::VECTOR_BYTES) as u64;
        let mut args = tail(head, shape.flags, shape.rank as i32, shape.world as i32, n_vec);
        let pointers = match list {
            Some(list) => args.pointers_for(list),
            None => args.pointers(),
        };
        let (mut params, n) = pointers.ok_or_else(|| {
            Error::backend(P::NAME, "custom all-reduce", None, format!("{kind:?}: parameters off the kernel's layout"))
        })?;
        let grid = (shape.blocks, 1, 1);
        // SAFETY: the parameter list matches the kernel's signature (the caller's part, then FlagPtrs by value,
        // rank, world, n_vec; checked against the kernel's list where it has one) and points into `args`, which
        // outlives the call; the caller guarantees the buffers and the co-residency.
        unsafe { P::launch(&self.runtime, f, grid, (THREADS, 1, 1), stream, &mut params[..n]) }
    }

    /// Launches one rank of an NVLS variant over the unicast emulation of the switch channel (the multicast
    /// kernels, `_mc`, are never launched by anyccl on machines where multicast is off). Only on a platform with
    /// [`GpuPlatform::NVLS_EMULATION`].
    ///
    /// Zero-copy: `a[r]`/`b[r]` are every rank's input/output. Warp and block pipelines: `a[r]`/`b[r]` are every
    /// rank's staging-in/staging-out buffers (each ≥ `bytes`), and `input`/`output` this rank's own buffers.
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
        stream: &StreamOf<P>,
    ) -> Result<()> {
        let world = a.len();
        let bad = |m: String| Error::backend(P::NAME, "nvls (emulated)", None, m);
        if let Some(why) = ineligible::<P>(dtype, bytes, world) {
            return Err(bad(why));
        }
        if b.len() != world
            || flags.len() != world
            || rank >= world
            || blocks == 0
            || blocks as usize > common::MAX_BLOCKS
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
        let head = match kind {
            Kind::NvlsZeroCopyEmulated => KernelArgs::new().ptrs(a).ptrs(b),
            Kind::NvlsBlockPipelineEmulated | Kind::NvlsWarpPipelineEmulated => {
                KernelArgs::new().u64(input).u64(output).ptrs(a).ptrs(b)
            }
            other => return Err(bad(format!("{other:?} is not an NVLS variant"))),
        };
        let shape = LaunchShape { flags, rank, world, bytes, blocks, table: false };
        // SAFETY: `head` holds the NVLS kernels' leading parameters; the caller guarantees buffers and
        // co-residency.
        unsafe { self.launch_with(kind, dtype, head, None, &shape, stream) }
    }
}

/// The one-shot's or two-shot's (`two`) leading parameters: the input table's pointer (`table`, non-zero) or
/// every rank's input, this rank's own input, two-shot's scratch, `out`, two-shot's round.
fn shot_head(two: bool, table: u64, peers: &[u64], own: u64, scratch: &[u64], out: u64, round_vecs: u64) -> KernelArgs {
    let head = if table != 0 { KernelArgs::new().u64(table) } else { KernelArgs::new().ptrs(peers) }.u64(own);
    if two {
        head.ptrs(scratch).u64(out).u64(round_vecs)
    } else {
        head.u64(out)
    }
}

/// `head` followed by the parameters every all-reduce kernel ends with: every rank's flag array (by value), this
/// rank, the world and the vector count.
fn tail(head: KernelArgs, flags: &[u64], rank: i32, world: i32, n_vec: u64) -> KernelArgs {
    head.ptrs(flags).i32(rank).i32(world).u64(n_vec)
}

/// What every launch of a rank shares: every rank's flag array, this rank, the world, the message size and the
/// block count.
struct LaunchShape<'a> {
    flags: &'a [u64],
    rank: usize,
    world: usize,
    bytes: usize,
    blocks: u32,
    /// Whether the kernel reads its inputs through an [`Inputs::Table`].
    table: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The function table resolved at load: every kernel has its own slot inside the table, types without
    /// kernels have none, and the one-shot and two-shot names are the shared source's kernels.
    #[test]
    fn every_kernel_has_one_slot_and_the_shared_sources_name() {
        let mut seen = std::collections::HashSet::new();
        let mut names = Vec::new();
        for kind in Kind::ALL {
            for table in [false, true] {
                for dtype in KERNEL_DTYPES {
                    let slot = function_slot(kind, dtype, table).expect("a kernel type has a slot");
                    assert!(slot < FUNCTION_SLOTS && seen.insert(slot), "{kind:?} {dtype} {table}: slot {slot}");
                    if !kind.is_nvls() {
                        names.extend(kernel_name(kind, dtype, table));
                    }
                }
                assert_eq!(function_slot(kind, DataType::F64, table), None);
                assert_eq!(kernel_name(kind, DataType::I32, table), None);
            }
        }
        assert_eq!(seen.len(), FUNCTION_SLOTS);
        names.sort();
        let mut shared = common::ALLREDUCE_KERNELS.map(str::to_owned).to_vec();
        shared.sort();
        assert_eq!(names, shared);
        for n in &names {
            assert!(common::allreduce_params(n).is_some(), "{n}");
        }
    }

    /// The element types' order here is the catalogue's, which indexes the function tables.
    #[test]
    fn kernel_dtypes_are_the_catalogues_in_its_order() {
        for (i, dtype) in KERNEL_DTYPES.into_iter().enumerate() {
            assert_eq!(catalogue_dtype(dtype).map(common::catalogue::Dtype::index), Some(i), "{dtype}");
        }
        assert_eq!(catalogue_dtype(DataType::F64), None);
    }

    /// Every kernel a launcher of this crate names is one of the catalogue's, no two launchers name the same one,
    /// and together they name every kernel of the catalogue.
    #[test]
    fn the_launchers_name_every_kernel_of_the_catalogue() {
        use crate::fused::{fused_kernel_name, rmsnorm_kernel_name, FusedForm};
        use anyccl_core::Algorithm;
        let mut named: Vec<String> = Vec::new();
        for dtype in [DataType::F32, DataType::F16, DataType::Bf16, DataType::F64, DataType::I32, DataType::U8] {
            for table in [false, true] {
                for kind in Kind::ALL {
                    named.extend(kernel_name(kind, dtype, table));
                }
                for form in [FusedForm::OneShot, FusedForm::TwoShot] {
                    named.extend(fused_kernel_name(form, dtype, table));
                }
            }
            named.extend(rmsnorm_kernel_name(dtype));
            for format in crate::quant::Format::ALL {
                named.extend(crate::quant::kernel_name(format, dtype));
            }
            for algorithm in [Algorithm::NvlsZeroCopy, Algorithm::NvlsWarpPipeline, Algorithm::NvlsBlockPipeline] {
                named.extend(crate::nvls::kernel_name(algorithm, dtype));
            }
        }
        // The push launchers load their kernels by the lists, which the catalogue's own tests check.
        let push = common::push::PUSH_KERNELS.iter().chain(&common::push::PUSH_TWO_SHOT_KERNELS);
        named.extend(push.chain(&common::fused_push::FUSED_PUSH_KERNELS).map(|k| String::from(*k)));
        let n = named.len();
        named.sort_unstable();
        named.dedup();
        assert_eq!(named.len(), n, "two launchers name the same kernel");
        let mut catalogue: Vec<String> = common::catalogue::kernels().map(common::catalogue::Kernel::name).collect();
        catalogue.sort_unstable();
        assert_eq!(named, catalogue);
    }

    /// The parameters `launch` builds are, in order, the shared source's (sizes as the kernels lay them out).
    #[test]
    fn the_built_parameters_have_the_shared_sources_sizes() {
        for (name, two, table) in [
            ("anyccl_one_shot_f32", false, 0),
            ("anyccl_one_shot_table_f32", false, 0x1000),
            ("anyccl_two_shot_f32", true, 0),
            ("anyccl_two_shot_table_f32", true, 0x1000),
        ] {
            let head = shot_head(two, table, &[16, 32], 16, &[48, 64], 80, 4);
            let built = tail(head, &[96, 112], 0, 2, 256);
            let want = common::allreduce_params(name).expect(name);
            assert!(built.matches(want), "{name}: {:?}", built.sizes());
            // By value: the lists are constants, whose addresses the compiler need not keep unique.
            assert_eq!(want, common::allreduce_params_of(!two, table != 0), "{name}");
        }
    }
}
