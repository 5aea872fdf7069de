//! Launch glue for the custom all-reduce kernels of `anyccl-kernels-cuda`: one-shot and two-shot (inputs read
//! directly, through staging the kernel copies into, or through an input table in device memory), and the unicast
//! emulations of the NVLS zero-copy, warp-pipeline and block-pipeline variants.
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
pub const INPUT_TABLE_BYTES: usize = (kernels::MAX_RANKS + 1) * 8;

/// The bytes of an input table: `ptrs` (index = rank), and whether they are the registered inputs themselves
/// (else they are staging buffers the kernel copies its own input into first).
pub fn input_table(ptrs: &[u64], registered: bool) -> [u8; INPUT_TABLE_BYTES] {
    let mut t = [0u8; INPUT_TABLE_BYTES];
    for (slot, p) in t.chunks_exact_mut(8).zip(ptrs.iter().take(kernels::MAX_RANKS)) {
        slot.copy_from_slice(&p.to_le_bytes());
    }
    t[kernels::MAX_RANKS * 8..].copy_from_slice(&u64::from(registered).to_le_bytes());
    t
}

/// The round size two-shot uses (0: the whole message in one round). One round: rounds of 1 to 8 MiB were slower
/// at every size with 8 emulated ranks on an H200 (docs/benchmarks.md, session 3);
/// `anyccl-cuda-emulated-bench --two-shot-rounds` measures them again.
pub const TWO_SHOT_ROUND_BYTES: usize = 0;

/// The element types the custom kernels are built for, in [`function_slot`] order.
const KERNEL_DTYPES: [DataType; 3] = [DataType::F32, DataType::F16, DataType::Bf16];
/// Kernels × input-table or not × element types.
const FUNCTION_SLOTS: usize = Kind::ALL.len() * 2 * KERNEL_DTYPES.len();

/// Where `kind`'s `dtype` kernel (with an input table or not) sits in [`CustomKernels`]' function table; `None`
/// for an element type without kernels.
fn function_slot(kind: Kind, dtype: DataType, table: bool) -> Option<usize> {
    let d = KERNEL_DTYPES.iter().position(|t| *t == dtype)?;
    let k = Kind::ALL.iter().position(|x| *x == kind)?;
    Some((k * 2 + usize::from(table)) * KERNEL_DTYPES.len() + d)
}

/// The kernel's symbol in the module; `None` where there is none (another element type, or an NVLS variant with
/// an input table).
fn kernel_name(kind: Kind, dtype: DataType, table: bool) -> Option<String> {
    let suffix = dtype_suffix(dtype)?;
    let t = if table { "table_" } else { "" };
    Some(match (kind, table) {
        (Kind::OneShot, _) => format!("anyccl_one_shot_{t}{suffix}"),
        (Kind::TwoShot, _) => format!("anyccl_two_shot_{t}{suffix}"),
        (_, true) => return None,
        (Kind::NvlsZeroCopyEmulated, false) => format!("anyccl_nvls_zero_copy_emu_{suffix}"),
        (Kind::NvlsBlockPipelineEmulated, false) => format!("anyccl_nvls_block_pipeline_emu_{suffix}"),
        (Kind::NvlsWarpPipelineEmulated, false) => format!("anyccl_nvls_warp_pipeline_emu_{suffix}"),
    })
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
    if !bytes.is_multiple_of(kernels::VECTOR_BYTES) {
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

/// Tells every custom kernel of the rank whose flag array is `flags` to stop waiting for its peers: sets the abort
/// word ([`anyccl_kernels_cuda::ABORT_WORD_OFFSET`]) with `cuStreamWriteValue32` on `stream`, which must not be the
/// stream the kernels are stuck on, and waits for that write (at most `limit`). Kernels launched after it stop at
/// their first barrier that waits long, so the rank's custom kernels are finished with for good: use it once a wait
/// has given up on a peer. Not during capture.
pub fn stop_waiting(
    flags: &crate::runtime::DeviceBuffer,
    stream: &CudaStream,
    limit: std::time::Duration,
) -> Result<()> {
    if flags.len() < kernels::FLAG_BYTES {
        return Err(Error::backend(
            "cuda",
            "stop the custom kernels",
            None,
            format!("a flag array holds {} bytes, this one {}", kernels::FLAG_BYTES, flags.len()),
        ));
    }
    stream.refuse_if_capturing("cuStreamWriteValue32")?;
    let word = flags.device_ptr() + kernels::ABORT_WORD_OFFSET as u64;
    // SAFETY: a live stream; `word` is a 4-byte-aligned word inside the live flag array (length checked above).
    let st = unsafe {
        sys::cuStreamWriteValue32_v2(
            stream.raw(),
            word,
            1,
            sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
        )
    };
    if st != sys::CUresult::CUDA_SUCCESS {
        return Err(cu_err("cuStreamWriteValue32", cudarc::driver::DriverError(st)));
    }
    if !stream.done_within(limit)? {
        return Err(Error::Timeout { what: "the abort word's write".into(), after: limit });
    }
    Ok(())
}

/// The kernels loaded for one device.
pub struct CustomKernels {
    module: sys::CUmodule,
    /// Every kernel of the module, looked up once at load ([`function_slot`] indexes it); `None` where the module
    /// lacks it (the launch then says so).
    functions: [Option<sys::CUfunction>; FUNCTION_SLOTS],
    ctx: Arc<DeviceContext>,
    /// The device's multiprocessor count.
    sms: usize,
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
        let sms = result::device::get(ctx.ordinal())
            .and_then(|d| {
                // SAFETY: a valid device handle; reading an attribute has no side effects.
                unsafe {
                    result::device::get_attribute(d, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                }
            })
            .map_err(|e| cu_err("cuDeviceGetAttribute", e))?;
        let mut functions = [None; FUNCTION_SLOTS];
        for kind in Kind::ALL {
            for table in [false, true] {
                for dtype in KERNEL_DTYPES {
                    let (Some(slot), Some(name)) = (function_slot(kind, dtype, table), kernel_name(kind, dtype, table))
                    else {
                        continue;
                    };
                    // Kernel names are fixed ASCII without NUL bytes.
                    let Ok(c) = CString::new(name.clone()) else { continue };
                    // SAFETY: live module; looking a function up by name only reads the module.
                    match unsafe { result::module::get_function(module, c) } {
                        Ok(f) => functions[slot] = Some(f),
                        Err(e) => {
                            tracing::debug!(kernel = %name, error = %cu_err("cuModuleGetFunction", e), "no such kernel")
                        }
                    }
                }
            }
        }
        Ok(CustomKernels { module, functions, ctx: ctx.clone(), sms: sms.max(0) as usize })
    }

    /// How many blocks of `kind`'s `dtype` kernel fit on the device at once (every SM's worth). Ranks emulated on
    /// one GPU need all their blocks resident together, or the cross-rank barriers wait forever.
    pub fn resident_blocks(&self, kind: Kind, dtype: DataType) -> Result<usize> {
        let f = self.function(kind, dtype, false)?;
        self.ctx.bind()?;
        // SAFETY: a function of the loaded module; the query has no side effects.
        let per_sm = unsafe { result::occupancy::max_active_block_per_multiprocessor(f, THREADS as i32, 0) }
            .map_err(|e| cu_err("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))?;
        Ok(per_sm.max(0) as usize * self.sms)
    }

    /// `kind`'s `dtype` kernel (reading its inputs through a table or not), resolved when the module was loaded.
    fn function(&self, kind: Kind, dtype: DataType, table: bool) -> Result<sys::CUfunction> {
        let Some(slot) = function_slot(kind, dtype, table) else {
            return Err(Error::AlgorithmNotEligible {
                algorithm: anyccl_core::Algorithm::OneShot,
                why: format!("the custom kernels handle f32, f16 and bf16, not {dtype}"),
            });
        };
        self.functions[slot].ok_or_else(|| {
            Error::backend(
                "cuda",
                "cuModuleGetFunction",
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
    /// ([`anyccl_kernels_cuda::FLAG_BYTES`], zeroed before first use), `out` this rank's output; index = rank, as
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
        stream: &CudaStream,
    ) -> Result<()> {
        let world = flags.len();
        if let Some(why) = ineligible(dtype, bytes, world) {
            return Err(Error::AlgorithmNotEligible { algorithm: anyccl_core::Algorithm::OneShot, why });
        }
        let bad = |m: String| Error::backend("cuda", "custom all-reduce", None, m);
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
        if blocks == 0 || blocks as usize > kernels::MAX_BLOCKS {
            return Err(bad(format!("{blocks} blocks (1..={})", kernels::MAX_BLOCKS)));
        }
        if peers.iter().chain(scratch).chain([&out, &own]).any(|p| p % 16 != 0) || table % 8 != 0 {
            return Err(bad("every buffer must be 16-byte aligned".into()));
        }
        if !two_shot_round.is_multiple_of(kernels::VECTOR_BYTES) {
            return Err(bad(format!("a two-shot round of {two_shot_round} bytes is not a multiple of 16")));
        }
        let (mut in_p, mut sc_p, mut out_p, mut own_p, mut table_p) = (ptrs(peers), ptrs(scratch), out, own, table);
        let mut round_vecs = (two_shot_round / kernels::VECTOR_BYTES) as u64;
        let mut head: Vec<*mut c_void> = Vec::with_capacity(9);
        if table != 0 {
            head.push((&mut table_p as *mut u64).cast());
        } else {
            head.push((&mut in_p as *mut Ptrs).cast());
        }
        head.push((&mut own_p as *mut u64).cast());
        if kind == Kind::TwoShot {
            head.push((&mut sc_p as *mut Ptrs).cast());
        }
        head.push((&mut out_p as *mut u64).cast());
        if kind == Kind::TwoShot {
            head.push((&mut round_vecs as *mut u64).cast());
        }
        let shape = LaunchShape { flags, rank, world, bytes, blocks, table: table != 0 };
        // SAFETY: `head` matches the kernel's leading parameters (RankPtrs are 8 × u64 by value or an InputTable
        // pointer, then this rank's own input or null, two-shot's scratch, `out`, two-shot's round); the caller
        // guarantees the buffers and the co-residency.
        unsafe { self.launch_with(kind, dtype, head, &shape, stream) }
    }

    /// Takes `kind`'s `dtype` kernel from the table resolved at load, binds the context and launches it with the
    /// parameters `head` followed by the ones every kernel ends with: the flag pointers, rank, world and vector
    /// count.
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
        let f = self.function(kind, dtype, shape.table)?;
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
    /// Whether the kernel reads its inputs through an [`Inputs::Table`].
    table: bool,
}

impl CustomKernels {
    /// Launches one rank of an NVLS variant over the unicast emulation of the switch channel (the multicast
    /// kernels, `_mc`, are never launched by anyccl on machines where multicast is off).
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
        stream: &CudaStream,
    ) -> Result<()> {
        let world = a.len();
        let bad = |m: String| Error::backend("cuda", "nvls (emulated)", None, m);
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
            Kind::NvlsBlockPipelineEmulated | Kind::NvlsWarpPipelineEmulated => vec![
                (&mut in_p as *mut u64).cast(),
                (&mut out_p as *mut u64).cast(),
                (&mut a_p as *mut Ptrs).cast(),
                (&mut b_p as *mut Ptrs).cast(),
            ],
            other => return Err(bad(format!("{other:?} is not an NVLS variant"))),
        };
        let shape = LaunchShape { flags, rank, world, bytes, blocks, table: false };
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The function table resolved at load: every kernel has its own slot inside the table, types without
    /// kernels have none, and every name looked up at load is a symbol of every all-reduce cubin built.
    #[test]
    fn every_kernel_has_one_slot_and_a_name_the_cubins_define() {
        let mut seen = std::collections::HashSet::new();
        let mut names = Vec::new();
        for kind in Kind::ALL {
            for table in [false, true] {
                for dtype in KERNEL_DTYPES {
                    let slot = function_slot(kind, dtype, table).expect("a kernel type has a slot");
                    assert!(slot < FUNCTION_SLOTS && seen.insert(slot), "{kind:?} {dtype} {table}: slot {slot}");
                    names.extend(kernel_name(kind, dtype, table));
                }
                assert_eq!(function_slot(kind, DataType::F64, table), None);
                assert_eq!(kernel_name(kind, DataType::I32, table), None);
            }
        }
        assert_eq!(seen.len(), FUNCTION_SLOTS);
        // One-shot and two-shot with and without a table, the three NVLS emulations without: 7 per type.
        assert_eq!(names.len(), 7 * KERNEL_DTYPES.len());
        assert_eq!(kernel_name(Kind::TwoShot, DataType::Bf16, true).as_deref(), Some("anyccl_two_shot_table_bf16"));

        let required = std::env::var_os("ANYCCL_REQUIRE_KERNELS").is_some();
        if let Some(why) = kernels::NOT_BUILT {
            assert!(!required, "kernels missing in a run that requires them: {why}");
            eprintln!("NOT CHECKED against the cubins: {why} (CI builds them)");
            return;
        }
        let cubins: Vec<_> = kernels::CUBINS.iter().filter(|(src, _, _)| *src == "allreduce").collect();
        assert!(!cubins.is_empty());
        for (_, arch, bytes) in cubins {
            for name in &names {
                let sym = format!("{name}\0");
                assert!(bytes.windows(sym.len()).any(|w| w == sym.as_bytes()), "{arch}: no symbol {name}");
            }
        }
    }
}
