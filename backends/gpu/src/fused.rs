//! Fused all-reduce + residual add + RMSNorm (`anyccl-kernels-common`'s `fused.h`), written once for every vendor:
//! the kernels of a device ([`FusedKernels`]), their arguments ([`NormArgs`]), what the fused kernels accept
//! ([`fused_ineligible`]), and the host reference of the math ([`reference`]), which the kernels match bit for bit.
//! The call's description, checks and choice of form are vendor-neutral and live in `anyccl-core`
//! ([`anyccl_core::fused`], [`anyccl_core::selector::default_rmsnorm_forms`]); the communicator's part is
//! `comm/fused_call.rs`.
//!
//! `out = rmsnorm(allreduce(x) + residual) * weight`, the new residual `allreduce(x) + residual` written back into
//! `residual`, for f16 and bf16 rows of `hidden` elements (a multiple of 8, at most
//! [`common::MAX_HIDDEN`]), f32 arithmetic; optionally fp8 e4m3 output `e4m3(y / scale)` (round to nearest even,
//! saturating to ±448, NaN kept). See fused.h for the exact order of every operation.

use crate::launch_args::KernelArgs;
use std::ffi::CString;

use anyccl_core::{DataType, Error, Result};
use anyccl_kernels_common as common;

use super::kernels::{CustomKernels, Inputs};
use super::{GpuPlatform, StreamOf};

/// Which fused kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FusedForm {
    /// Every rank reduces every row from every peer, then adds its residual and normalises.
    OneShot,
    /// Each rank reduces and normalises 1/N of the rows into its peer-visible scratch, then every rank gathers the
    /// output and new-residual rows.
    TwoShot,
}

impl FusedForm {
    /// Both forms.
    pub const ALL: [FusedForm; 2] = [FusedForm::OneShot, FusedForm::TwoShot];

    /// Short name for tables and messages.
    pub fn name(self) -> &'static str {
        match self {
            FusedForm::OneShot => "fused one-shot",
            FusedForm::TwoShot => "fused two-shot",
        }
    }
}

/// The kernels' `NormArgs` (by value in every fused kernel's parameters; [`common::NORM_ARGS_BYTES`]).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct NormArgs {
    /// `[tokens][hidden]` of the element type: read, then overwritten with the new residual.
    pub residual: u64,
    /// `[hidden]` of the element type.
    pub weight: u64,
    /// `[tokens][hidden]` of the element type, or of e4m3 bytes when `out_fp8` is non-zero.
    pub out: u64,
    /// Added to the mean square.
    pub eps: f32,
    /// fp8 output only: the output is `e4m3(y / scale)`.
    pub scale: f32,
    /// Non-zero: fp8 e4m3 output.
    pub out_fp8: i32,
    /// Vectors of 8 elements per row (`hidden / 8`).
    pub hidden_vec: u32,
    /// Rows.
    pub tokens: u64,
}

const _: () = assert!(std::mem::size_of::<NormArgs>() == common::NORM_ARGS_BYTES);
// The bound core's validation checks and the order core's host arithmetic follows are the kernels'.
const _: () = assert!(common::MAX_HIDDEN == anyccl_core::fused::MAX_HIDDEN);
const _: () = assert!(common::NORM_THREADS as usize == anyccl_core::fused::NORM_THREADS);

/// The output type of a fused call (core's [`anyccl_core::fused::RmsNormOutput`]).
pub use anyccl_core::fused::RmsNormOutput as FusedOutput;

impl NormArgs {
    /// The arguments of a call over `tokens` rows of `hidden` elements; sizes bounded by [`fused_ineligible`]
    /// first (`hidden` a multiple of 8 up to [`common::MAX_HIDDEN`]).
    pub fn new(
        residual: u64,
        weight: u64,
        out: u64,
        tokens: usize,
        hidden: usize,
        eps: f32,
        output: FusedOutput,
    ) -> Self {
        let (out_fp8, scale) = match output {
            FusedOutput::Fp8E4M3 { scale } => (1, scale),
            // The element type, and any output type newer than this crate (refused first by `rmsnorm_ineligible`).
            _ => (0, 1.0),
        };
        NormArgs {
            residual,
            weight,
            out,
            eps,
            scale,
            out_fp8,
            // hidden ≤ MAX_HIDDEN (checked by the callers' validation), so it fits.
            hidden_vec: u32::try_from(hidden / 8).unwrap_or(u32::MAX),
            tokens: tokens as u64,
        }
    }
}

/// Why the fused kernels cannot take `dtype` rows of `hidden` elements for `world` ranks, if they cannot.
pub fn fused_ineligible(dtype: DataType, hidden: usize, world: usize) -> Option<String> {
    if !matches!(dtype, DataType::F16 | DataType::Bf16) {
        return Some(format!("the fused all-reduce + RMSNorm kernels handle f16 and bf16, not {dtype}"));
    }
    if hidden == 0 || !hidden.is_multiple_of(8) || hidden > common::MAX_HIDDEN {
        return Some(format!("hidden {hidden} must be a non-zero multiple of 8 of at most {}", common::MAX_HIDDEN));
    }
    if !(2..=common::MAX_RANKS).contains(&world) {
        return Some(format!("world {world} is outside 2..={}", common::MAX_RANKS));
    }
    None
}

/// Bytes of two-shot scratch one rank needs: the new residual rows, then the output rows.
pub fn two_shot_scratch_bytes(dtype: DataType, tokens: usize, hidden: usize, output: FusedOutput) -> Option<usize> {
    let rows = tokens.checked_mul(hidden)?;
    rows.checked_mul(dtype.size_bytes())?.checked_add(rows.checked_mul(output.element_bytes(dtype))?)
}

/// The symbol of a fused kernel (`None`: no fused kernel for `dtype`).
pub fn fused_kernel_name(form: FusedForm, dtype: DataType, table: bool) -> Option<String> {
    use common::catalogue::Family;
    let family = match form {
        FusedForm::OneShot => Family::FusedOneShot { table },
        FusedForm::TwoShot => Family::FusedTwoShot { table },
    };
    common::catalogue::kernel_name(family, super::kernels::catalogue_dtype(dtype)?)
}

/// The symbol of the separate RMSNorm kernel (`None`: none for `dtype`).
pub fn rmsnorm_kernel_name(dtype: DataType) -> Option<String> {
    common::catalogue::kernel_name(common::catalogue::Family::RmsNorm, super::kernels::catalogue_dtype(dtype)?)
}

/// The fused kernels and the separate RMSNorm kernel: handles into the module of a [`CustomKernels`] (one module
/// holds every kernel of the shared source), which must outlive every launch.
pub struct FusedKernels<P: GpuPlatform> {
    /// In [`common::FUSED_KERNELS`] order.
    functions: [Option<P::Function>; common::FUSED_KERNELS.len()],
    runtime: P::Runtime,
    sms: usize,
}

impl<P: GpuPlatform> FusedKernels<P> {
    /// The fused kernels of the module `custom` already loaded (no second load). They are handles into that
    /// module: launch them only while `custom` (or whatever keeps its module loaded) lives.
    pub fn from_custom(runtime: &P::Runtime, custom: &CustomKernels<P>) -> Self {
        let mut functions = [None; common::FUSED_KERNELS.len()];
        for (slot, name) in functions.iter_mut().zip(common::FUSED_KERNELS) {
            // Kernel names are fixed ASCII without NUL bytes.
            let Ok(c) = CString::new(name) else { continue };
            match custom.function_named(&c) {
                Ok(f) => *slot = Some(f),
                Err(e) => tracing::debug!(kernel = %name, error = %e, "no such kernel"),
            }
        }
        FusedKernels { functions, runtime: runtime.clone(), sms: custom.multiprocessors() }
    }

    fn function(&self, name: Option<String>, dtype: DataType) -> Result<P::Function> {
        let Some(name) = name else {
            return Err(Error::InvalidArgument(anyccl_core::InvalidArgument::UnsupportedDataType {
                dtype,
                backend: P::NAME.into(),
                why: "the fused all-reduce + RMSNorm kernels handle f16 and bf16".into(),
            }));
        };
        common::FUSED_KERNELS.iter().position(|k| *k == name).and_then(|i| self.functions[i]).ok_or_else(|| {
            Error::backend(P::NAME, "module function lookup", None, format!("the loaded module has no kernel {name}"))
        })
    }

    /// How many blocks of the fused `form` kernel for `dtype` fit on the device at once.
    pub fn resident_blocks(&self, form: FusedForm, dtype: DataType) -> Result<usize> {
        let f = self.function(fused_kernel_name(form, dtype, false), dtype)?;
        Ok(P::max_active_blocks_per_sm(&self.runtime, f, common::NORM_THREADS)? * self.sms)
    }

    /// The device's multiprocessor count.
    pub fn multiprocessors(&self) -> usize {
        self.sms
    }

    /// Launches one rank's fused all-reduce + residual add + RMSNorm of `args.tokens` rows.
    ///
    /// `inputs` as for the plain all-reduce ([`Inputs`]); `scratch[r]` is rank r's peer-visible two-shot scratch
    /// (at least [`two_shot_scratch_bytes`]; unused by one-shot, may be empty then); `flags[r]` rank r's flag array.
    ///
    /// # Safety
    /// Every pointer is device memory of (or mapped into) this device with the sizes the arguments imply, 16-byte
    /// aligned; `args.out` does not overlap any input; every rank launches the same sequence of kernels with the
    /// same `blocks`, the same `args` shape and the same kind of [`Inputs`] concurrently (co-resident blocks); the
    /// residual is the same on every rank for two-shot (a row's new residual is its owner's).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch_fused(
        &self,
        form: FusedForm,
        dtype: DataType,
        inputs: Inputs<'_>,
        scratch: &[u64],
        args: &NormArgs,
        flags: &[u64],
        rank: usize,
        blocks: u32,
        stream: &StreamOf<P>,
    ) -> Result<()> {
        let world = flags.len();
        let bad = |m: String| Error::backend(P::NAME, "fused all-reduce + RMSNorm", None, m);
        let hidden = args.hidden_vec as usize * 8;
        if let Some(why) = fused_ineligible(dtype, hidden, world) {
            return Err(bad(why));
        }
        let (peers, own, table) = match inputs {
            Inputs::Direct(p) => (p, 0, 0),
            Inputs::Staged { staging, own } => (staging, own, 0),
            Inputs::Table { table, own } => (&[][..], own, table),
        };
        if (table == 0 && peers.len() != world)
            || (form == FusedForm::TwoShot && scratch.len() != world)
            || rank >= world
        {
            return Err(bad(format!(
                "{} inputs, {world} flags, {} scratch buffers, rank {rank}",
                peers.len(),
                scratch.len()
            )));
        }
        if blocks == 0 || blocks as usize > common::MAX_BLOCKS {
            return Err(bad(format!("{blocks} blocks (1..={})", common::MAX_BLOCKS)));
        }
        if args.out_fp8 != 0 && !(args.scale.is_finite() && args.scale > 0.0) {
            return Err(bad(format!("fp8 scale {} must be finite and positive", args.scale)));
        }
        let mut all = peers.iter().chain(scratch).chain([&own, &args.residual, &args.weight, &args.out]);
        if all.any(|p| p % 16 != 0) || table % 8 != 0 {
            return Err(bad("every buffer must be 16-byte aligned".into()));
        }
        let name = fused_kernel_name(form, dtype, table != 0);
        let list = name.as_deref().and_then(common::fused_params);
        let f = self.function(name, dtype)?;
        let scratch = (form == FusedForm::TwoShot).then_some(scratch);
        let mut kargs = fused_args(table, peers, own, scratch, args, flags, rank as i32);
        let (mut params, n) = list
            .and_then(|list| kargs.pointers_for(list))
            .ok_or_else(|| bad("parameters off the kernel's layout".into()))?;
        // SAFETY: the parameters match the kernel's signature (common::fused_params, checked: RankPtrs or an
        // InputTable pointer, own input or null, two-shot's scratch, NormArgs, FlagPtrs, rank, world) and point
        // into `kargs`, which outlives the launch; the caller guarantees buffers and co-residency.
        unsafe { P::launch(&self.runtime, f, (blocks, 1, 1), (common::NORM_THREADS, 1, 1), stream, &mut params[..n]) }
    }

    /// Launches the separate RMSNorm kernel (the unfused baseline's second kernel): the same residual add and
    /// RMSNorm of `input` (an all-reduce's output, `args.tokens` × hidden), with `blocks` blocks.
    ///
    /// # Safety
    /// Every pointer is device memory of this device with the sizes the arguments imply, 16-byte aligned;
    /// `args.out` does not overlap `input` when the output is fp8.
    pub unsafe fn launch_rmsnorm(
        &self,
        dtype: DataType,
        input: u64,
        args: &NormArgs,
        blocks: u32,
        stream: &StreamOf<P>,
    ) -> Result<()> {
        let bad = |m: String| Error::backend(P::NAME, "RMSNorm", None, m);
        if let Some(why) = fused_ineligible(dtype, args.hidden_vec as usize * 8, 2) {
            return Err(bad(why));
        }
        if blocks == 0 {
            return Err(bad("0 blocks".into()));
        }
        if args.out_fp8 != 0 && !(args.scale.is_finite() && args.scale > 0.0) {
            return Err(bad(format!("fp8 scale {} must be finite and positive", args.scale)));
        }
        if [input, args.residual, args.weight, args.out].iter().any(|p| p % 16 != 0) {
            return Err(bad("every buffer must be 16-byte aligned".into()));
        }
        let name = rmsnorm_kernel_name(dtype);
        let list = name.as_deref().and_then(common::fused_params);
        let f = self.function(name, dtype)?;
        let mut kargs = KernelArgs::new().u64(input).block(args);
        let (mut params, n) = list
            .and_then(|list| kargs.pointers_for(list))
            .ok_or_else(|| bad("parameters off the kernel's layout".into()))?;
        // SAFETY: (const void* in, NormArgs args), checked against common::fused_params, pointing into `kargs`,
        // which outlives the launch; the caller guarantees the buffers.
        unsafe { P::launch(&self.runtime, f, (blocks, 1, 1), (common::NORM_THREADS, 1, 1), stream, &mut params[..n]) }
    }
}

/// The fused one-shot's or two-shot's parameters, in the order of `common::fused_params`: the input table's
/// pointer (`table`, non-zero) or every rank's input, this rank's own input, the scratch (`Some` for two-shot),
/// the `NormArgs`, every rank's flags, rank, world (`flags.len()`, at most `MAX_RANKS`: checked by the launcher).
fn fused_args(
    table: u64,
    peers: &[u64],
    own: u64,
    scratch: Option<&[u64]>,
    args: &NormArgs,
    flags: &[u64],
    rank: i32,
) -> KernelArgs {
    let head = if table != 0 { KernelArgs::new().u64(table) } else { KernelArgs::new().ptrs(peers) }.u64(own);
    let head = match scratch {
        Some(scratch) => head.ptrs(scratch),
        None => head,
    };
    head.block(args).ptrs(flags).i32(rank).i32(flags.len() as i32)
}

/// The host reference of the fused kernels' math, operation for operation (fused.h): its results equal the
/// kernels' bit for bit.
pub mod reference {
    use anyccl_core::DataType;

    use super::common;

    /// The element conversions (exact to f32; rounded to nearest even from it): core's.
    pub use anyccl_core::fused::{from_f32, to_f32};

    /// f32 to fp8 e4m3 bits as the kernels convert: round to nearest even, saturating to ±448, NaN to 0x7f | sign,
    /// |v| ≤ 2^-10 to ±0 (CUDA's `__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)`).
    pub fn f32_to_e4m3(v: f32) -> u8 {
        let u = v.to_bits();
        let sign = ((u >> 24) & 0x80) as u8;
        let a = u & 0x7fff_ffff;
        let res: u32 = if a <= 0x3a80_0000 {
            0
        } else if a > 0x7f80_0000 {
            0x7f
        } else if a > 0x43e8_0000 {
            0x7e
        } else if a >= 0x3c80_0000 {
            let exp = (a >> 23) + 7 - 127;
            let man = (a >> 20) & 7;
            let rest = a & 0xf_ffff;
            let r = (exp << 3) | man;
            if rest > 0x8_0000 || (rest == 0x8_0000 && man & 1 == 1) {
                r + 1
            } else {
                r
            }
        } else {
            let shift = 1 - ((a >> 23) as i32 - 127 + 7);
            let man = ((a >> 20) & 7) | 8;
            let r = man >> shift;
            let half = 0x8_0000u32 << shift;
            let rest = (a | 0x80_0000) & ((0x8_0000u32 << (shift + 1)) - 1);
            if rest > half || (rest == half && r & 1 == 1) {
                r + 1
            } else {
                r
            }
        };
        res as u8 | sign
    }

    /// The all-reduce of element `i`: f32 sum in rank order starting from rank 0's value, rounded to the type.
    pub fn all_reduce(dtype: DataType, inputs: &[&[u16]], i: usize) -> u16 {
        let mut acc = to_f32(dtype, inputs[0][i]);
        for x in &inputs[1..] {
            acc += to_f32(dtype, x[i]);
        }
        from_f32(dtype, acc)
    }

    /// One row's results.
    #[derive(Debug, Clone, PartialEq)]
    pub struct Row {
        /// The new residual (element bits).
        pub residual: Vec<u16>,
        /// The normalised, weighted values before the final rounding (`(r * inv) * weight`, f32).
        pub y: Vec<f32>,
        /// `y` rounded to the element type (bits).
        pub out: Vec<u16>,
    }

    impl Row {
        /// The fp8 output of the row with `scale`.
        pub fn fp8(&self, scale: f32) -> Vec<u8> {
            self.y.iter().map(|y| f32_to_e4m3(y / scale)).collect()
        }
    }

    /// The add + RMSNorm of one row: `reduced` (the all-reduce's output row) + `residual`, normalised, times
    /// `weight`, with the kernels' order of operations (blocks of [`common::NORM_THREADS`] threads).
    pub fn norm_row(dtype: DataType, reduced: &[u16], residual: &[u16], weight: &[u16], eps: f32) -> Row {
        let hidden = reduced.len();
        let new_res: Vec<u16> =
            reduced.iter().zip(residual).map(|(s, r)| from_f32(dtype, to_f32(dtype, *s) + to_f32(dtype, *r))).collect();
        let threads = common::NORM_THREADS as usize;
        let hv = hidden / 8;
        let mut part = vec![0f32; threads];
        for (t, p) in part.iter_mut().enumerate() {
            let mut acc = 0f32;
            for j in (t..hv).step_by(threads) {
                for e in &new_res[j * 8..j * 8 + 8] {
                    let x = to_f32(dtype, *e);
                    acc = x.mul_add(x, acc);
                }
            }
            *p = acc;
        }
        let tree = |v: &mut [f32]| {
            let mut o = v.len() / 2;
            while o > 0 {
                for i in 0..o {
                    v[i] += v[i + o];
                }
                o /= 2;
            }
            v[0]
        };
        let mut warps: Vec<f32> = part.chunks_mut(32).map(tree).collect();
        let total = tree(&mut warps);
        let mean = total / hidden as f32;
        let inv = 1.0f32 / (mean + eps).sqrt();
        let y: Vec<f32> =
            new_res.iter().zip(weight).map(|(r, w)| to_f32(dtype, *r) * inv * to_f32(dtype, *w)).collect();
        let out = y.iter().map(|v| from_f32(dtype, *v)).collect();
        Row { residual: new_res, y, out }
    }

    /// Every row of the fused call: `inputs[r]` is rank r's `[tokens][hidden]` input, `residual` the residual
    /// (the same on every rank), `weight` `[hidden]`. Rows in order.
    pub fn fused(dtype: DataType, inputs: &[&[u16]], residual: &[u16], weight: &[u16], eps: f32) -> Vec<Row> {
        let hidden = weight.len();
        let tokens = residual.len().checked_div(hidden).unwrap_or(0);
        (0..tokens)
            .map(|row| {
                let range = row * hidden..(row + 1) * hidden;
                let reduced: Vec<u16> = range.clone().map(|i| all_reduce(dtype, inputs, i)).collect();
                norm_row(dtype, &reduced, &residual[range], weight, eps)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::reference::*;
    use super::*;

    #[test]
    fn kernel_names_are_the_shared_sources() {
        let mut names = Vec::new();
        for dtype in [DataType::F16, DataType::Bf16] {
            for form in FusedForm::ALL {
                for table in [false, true] {
                    names.extend(fused_kernel_name(form, dtype, table));
                }
            }
            names.extend(rmsnorm_kernel_name(dtype));
        }
        names.sort();
        let mut shared = common::FUSED_KERNELS.map(str::to_owned).to_vec();
        shared.sort();
        assert_eq!(names, shared);
        // The parameters the launchers build are, in order, the shared source's.
        for form in FusedForm::ALL {
            for table in [0, 0x1000] {
                let name = fused_kernel_name(form, DataType::Bf16, table != 0).expect("bf16");
                let scratch = (form == FusedForm::TwoShot).then_some(&[48u64, 64][..]);
                let built = fused_args(table, &[16, 32], 16, scratch, &NormArgs::default(), &[80, 96], 0);
                let want = common::fused_params(&name).expect("listed");
                assert!(built.matches(want), "{name}: {:?}", built.sizes());
            }
        }
        let rms = KernelArgs::new().u64(16).block(&NormArgs::default());
        let want = common::fused_params("anyccl_rmsnorm_bf16").expect("listed");
        assert!(rms.matches(want), "{:?}", rms.sizes());
        assert_eq!(fused_kernel_name(FusedForm::OneShot, DataType::F32, false), None);
        assert_eq!(rmsnorm_kernel_name(DataType::I32), None);
        for n in &names {
            assert!(common::fused_params(n).is_some(), "{n}");
        }
    }

    #[test]
    fn norm_args_are_laid_out_as_the_kernels_expect() {
        let a = NormArgs::new(16, 32, 48, 3, 8192, 1e-6, FusedOutput::Fp8E4M3 { scale: 0.5 });
        assert_eq!(std::mem::size_of::<NormArgs>(), 48);
        assert_eq!((a.hidden_vec, a.tokens, a.out_fp8, a.scale), (1024, 3, 1, 0.5));
        let b = NormArgs::new(16, 32, 48, 3, 8, 1e-6, FusedOutput::Same);
        assert_eq!((b.hidden_vec, b.out_fp8), (1, 0));
        // Field offsets: what fused.h's struct has (pointers, then f32, f32, i32, u32, u64).
        let base = &a as *const NormArgs as usize;
        let off = |p: *const u8| p as usize - base;
        assert_eq!(off((&a.eps as *const f32).cast()), 24);
        assert_eq!(off((&a.scale as *const f32).cast()), 28);
        assert_eq!(off((&a.out_fp8 as *const i32).cast()), 32);
        assert_eq!(off((&a.hidden_vec as *const u32).cast()), 36);
        assert_eq!(off((&a.tokens as *const u64).cast()), 40);
    }

    #[test]
    fn eligibility_bounds_dtype_hidden_and_world() {
        assert!(fused_ineligible(DataType::Bf16, 8192, 8).is_none());
        assert!(fused_ineligible(DataType::F16, 16384, 2).is_none());
        assert!(fused_ineligible(DataType::F16, 8, 2).is_none());
        assert!(fused_ineligible(DataType::F32, 8192, 8).is_some_and(|w| w.contains("f32")));
        for h in [0, 4, 12, 16392, usize::MAX] {
            assert!(fused_ineligible(DataType::Bf16, h, 4).is_some_and(|w| w.contains("hidden")), "{h}");
        }
        for w in [0, 1, 9] {
            assert!(fused_ineligible(DataType::Bf16, 8192, w).is_some_and(|m| m.contains("world")), "{w}");
        }
    }

    /// Core's host arithmetic (what the host backend runs, `anyccl_core::fused::norm_row`) equals this reference
    /// bit for bit: random rows of every length class (one vector, fewer vectors than threads, several per
    /// thread, the largest), random magnitudes, both types, both outputs, several `eps`.
    #[test]
    fn core_host_arithmetic_equals_the_kernels_reference() {
        let mut s = 0x5eed_1234_u64;
        let mut rnd = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for case in 0..48u64 {
            let dtype = if case % 2 == 0 { DataType::F16 } else { DataType::Bf16 };
            let hidden = [8usize, 8 * 37, 8 * 512, 8 * 1537, common::MAX_HIDDEN][(case % 5) as usize];
            let scale = [1e-3f64, 1.0, 100.0][(case % 3) as usize];
            let mut val = || from_f32(dtype, (((rnd() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale) as f32);
            let reduced: Vec<u16> = (0..hidden).map(|_| val()).collect();
            let residual: Vec<u16> = (0..hidden).map(|_| val()).collect();
            let weight: Vec<u16> = (0..hidden).map(|_| val()).collect();
            let eps = [0.0f32, 1e-6, 1e-2][(case % 3) as usize];
            let want = norm_row(dtype, &reduced, &residual, &weight, eps);
            for fp8 in [None, Some(0.03f32)] {
                let mut spec = anyccl_core::fused::RmsNormSpec::new(dtype, 1, hidden, eps);
                if let Some(sc) = fp8 {
                    spec = spec.fp8_output(sc);
                }
                let call = spec.call().expect("valid");
                let mut res = residual.clone();
                let mut out = vec![0u8; call.out_bytes];
                let mut scratch = vec![0f32; hidden];
                anyccl_core::fused::norm_row(&call, &reduced, &mut res, &weight, &mut out, &mut scratch);
                assert_eq!(res, want.residual, "case {case}: residual");
                let want_out: Vec<u8> = match fp8 {
                    Some(sc) => want.fp8(sc),
                    None => want.out.iter().flat_map(|b| b.to_ne_bytes()).collect(),
                };
                assert!(out == want_out, "case {case} {dtype} hidden {hidden} fp8 {fp8:?}: output differs");
            }
        }
    }

    #[test]
    fn scratch_is_residual_rows_then_output_rows() {
        let bf = DataType::Bf16;
        assert_eq!(two_shot_scratch_bytes(bf, 4, 8, FusedOutput::Same), Some(4 * 8 * 4));
        assert_eq!(two_shot_scratch_bytes(bf, 4, 8, FusedOutput::Fp8E4M3 { scale: 1.0 }), Some(4 * 8 * 3));
        assert_eq!(two_shot_scratch_bytes(bf, usize::MAX, 8, FusedOutput::Same), None);
    }

    /// The hand-written e4m3 conversion (the kernels' twin) equals the float8 crate's saturating conversion on
    /// every f32 class: zero, subnormal ranges, ties, the saturation threshold, infinities and NaN.
    #[test]
    fn e4m3_conversion_matches_the_float8_crate() {
        let mut vals: Vec<f32> = vec![
            0.0,
            -0.0,
            448.0,
            464.0,
            464.0001,
            480.0,
            1e9,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            2f32.powi(-10),
            2f32.powi(-9),
            1.5 * 2f32.powi(-9),
            2.5 * 2f32.powi(-9),
            2f32.powi(-6),
            f32::MIN_POSITIVE,
        ];
        let mut s = 0x1234_5678_9abc_def0u64;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // Random bits over every exponent, and values concentrated in e4m3's range.
            vals.push(f32::from_bits(s as u32));
            vals.push(((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1000.0 * 2f32.powi(-((s & 15) as i32)));
        }
        for v in vals {
            let want = float8::F8E4M3::from_f32(v).to_bits();
            assert_eq!(f32_to_e4m3(v), want, "{v:e} ({:#010x})", v.to_bits());
        }
    }

    /// The reference is the math it claims, within rounding: against f64 arithmetic on the same rounded inputs.
    #[test]
    fn reference_is_rmsnorm_of_the_sum_plus_residual() {
        for dtype in [DataType::F16, DataType::Bf16] {
            for (tokens, hidden) in [(1usize, 8usize), (3, 4104), (2, 16384)] {
                let mut s = 99u64 + hidden as u64;
                let mut next = || {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    from_f32(dtype, ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32)
                };
                let inputs: Vec<Vec<u16>> = (0..3).map(|_| (0..tokens * hidden).map(|_| next()).collect()).collect();
                let residual: Vec<u16> = (0..tokens * hidden).map(|_| next()).collect();
                let weight: Vec<u16> = (0..hidden).map(|_| next()).collect();
                let refs: Vec<&[u16]> = inputs.iter().map(Vec::as_slice).collect();
                let rows = fused(dtype, &refs, &residual, &weight, 1e-5);
                assert_eq!(rows.len(), tokens);
                for (row, r) in rows.iter().enumerate() {
                    let base = row * hidden;
                    let res64: Vec<f64> = r.residual.iter().map(|b| f64::from(to_f32(dtype, *b))).collect();
                    for (i, v) in res64.iter().enumerate() {
                        let sum: f64 = inputs.iter().map(|x| f64::from(to_f32(dtype, x[base + i]))).sum::<f64>()
                            + f64::from(to_f32(dtype, residual[base + i]));
                        assert!((v - sum).abs() <= 0.02 * (sum.abs() + 1.0), "{dtype} residual {i}: {v} vs {sum}");
                    }
                    let ms = res64.iter().map(|v| v * v).sum::<f64>() / hidden as f64;
                    let inv = 1.0 / (ms + 1e-5).sqrt();
                    for i in 0..hidden {
                        let want = res64[i] * inv * f64::from(to_f32(dtype, weight[i]));
                        let got = f64::from(r.y[i]);
                        assert!((got - want).abs() <= 1e-5 * (want.abs() + 1.0), "{dtype} y {i}: {got} vs {want}");
                        assert_eq!(r.out[i], from_f32(dtype, r.y[i]));
                    }
                }
            }
        }
    }
}
