//! Launch glue for the quantized two-shot all-reduce of the shared kernel source
//! (`anyccl-kernels-common/include/anyccl/quant.h`): the ranks exchange fp8 (e4m3) or int8 codes with one f32 scale
//! per 32 elements and accumulate in f32 ([`anyccl_kernels_common::quant`] mirrors the arithmetic on the host and
//! states the error bound). Lossy, so it runs only when asked for by name (`two-shot-fp8`, `two-shot-int8`), never
//! by the default selection, and never in deterministic mode.
//!
//! Each rank needs a peer-visible staging buffer and a scratch buffer of
//! [`staging_bytes`] each (its quantized input, and the re-quantized sum of the chunk it owns); the communicator
//! uses the custom kernels' staging and scratch, which a quantized message always fits when the full-precision one
//! does (≤ 36 bytes per 32 elements, plus one block). The kernel reads only this rank's own input and every rank's
//! staging and scratch, so it is the same eager and inside a graph (no input tables).

use crate::launch_args::KernelArgs;
use std::ffi::CString;

use anyccl_core::{DataType, Error, Result};
use anyccl_kernels_common as common;
/// The host side of the quantized kernels: layout, the model of their arithmetic, the error bound.
pub use common::quant as model;
pub use common::quant::Format;

use super::kernels::{CustomKernels, THREADS};
use super::{GpuPlatform, StreamOf};

/// Bytes of staging (and of scratch) every rank needs for a quantized all-reduce of `bytes` bytes of `dtype`;
/// `None` for a type without kernels or on overflow.
pub fn staging_bytes(dtype: DataType, bytes: usize) -> Option<usize> {
    super::kernels::KERNEL_DTYPES.contains(&dtype).then_some(())?;
    common::quant::staging_bytes(bytes / dtype.size_bytes().max(1))
}

/// The kernel's symbol.
pub fn kernel_name(format: Format, dtype: DataType) -> Option<String> {
    let family = common::catalogue::Family::QuantTwoShot(format);
    common::catalogue::kernel_name(family, super::kernels::catalogue_dtype(dtype)?)
}

const SLOTS: usize = 2 * 3;

fn slot(format: Format, dtype: DataType) -> Option<usize> {
    let d = super::kernels::KERNEL_DTYPES.iter().position(|t| *t == dtype)?;
    let f = Format::ALL.iter().position(|x| *x == format)?;
    Some(f * 3 + d)
}

/// The quantized kernels of one device's loaded module (looked up once; `None` where the module lacks one).
#[derive(Clone, Copy)]
pub struct QuantKernels<P: GpuPlatform> {
    functions: [Option<P::Function>; SLOTS],
}

impl<P: GpuPlatform> QuantKernels<P> {
    /// Looks the quantized kernels up in `kernels`' module. The handles are valid while `kernels` lives: keep both
    /// together and launch only through [`Self::launch`] with the same `kernels`.
    pub fn new(kernels: &CustomKernels<P>) -> Self {
        let mut functions = [None; SLOTS];
        for format in Format::ALL {
            for dtype in super::kernels::KERNEL_DTYPES {
                let (Some(i), Some(name)) = (slot(format, dtype), kernel_name(format, dtype)) else { continue };
                // Kernel names are fixed ASCII without NUL bytes.
                let Ok(c) = CString::new(name.clone()) else { continue };
                match kernels.function_named(&c) {
                    Ok(f) => functions[i] = Some(f),
                    Err(e) => tracing::debug!(kernel = %name, error = %e, "no such kernel"),
                }
            }
        }
        QuantKernels { functions }
    }

    /// Why the module has no quantized kernel for `format` × `dtype`, if it has none.
    pub fn missing(&self, format: Format, dtype: DataType) -> Option<String> {
        match slot(format, dtype) {
            None => Some(format!("the quantized kernels take f32, f16 and bf16, not {dtype}")),
            Some(i) if self.functions[i].is_none() => Some(format!(
                "the loaded kernel module has no {} (built from an older source?)",
                kernel_name(format, dtype).unwrap_or_default()
            )),
            Some(_) => None,
        }
    }

    /// Launches one rank's quantized all-reduce of `bytes` bytes of `dtype` from `input` into `out` (may be equal).
    ///
    /// `stage[r]`/`scratch[r]` are rank r's peer-visible buffers (each ≥ [`staging_bytes`]), `flags[r]` its flag
    /// array (shared with the other custom kernels: every rank launches the same sequence), index = rank as
    /// addressable from this rank.
    ///
    /// # Safety
    /// `kernels` is the module these handles came from; every pointer is device memory of (or mapped into) this
    /// device with the sizes above, 16-byte aligned; every rank launches the same sequence of kernels with the same
    /// `blocks` concurrently, and their blocks are co-resident.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        kernels: &CustomKernels<P>,
        format: Format,
        dtype: DataType,
        input: u64,
        stage: &[u64],
        scratch: &[u64],
        out: u64,
        flags: &[u64],
        rank: usize,
        bytes: usize,
        blocks: u32,
        stream: &StreamOf<P>,
    ) -> Result<()> {
        let world = flags.len();
        let bad = |m: String| Error::backend(P::NAME, "quantized all-reduce", None, m);
        if let Some(why) = super::kernels::ineligible::<P>(dtype, bytes, world) {
            return Err(bad(why));
        }
        if let Some(why) = self.missing(format, dtype) {
            return Err(bad(why));
        }
        let f = slot(format, dtype).and_then(|i| self.functions[i]).ok_or_else(|| bad("no kernel".into()))?;
        if stage.len() != world || scratch.len() != world || rank >= world {
            return Err(bad(format!(
                "{} staging, {} scratch buffers, {world} flags, rank {rank}",
                stage.len(),
                scratch.len()
            )));
        }
        if blocks == 0 || blocks as usize > common::MAX_BLOCKS {
            return Err(bad(format!("{blocks} blocks (1..={})", common::MAX_BLOCKS)));
        }
        if stage.iter().chain(scratch).chain([&input, &out]).any(|p| p % 16 != 0) {
            return Err(bad("every buffer must be 16-byte aligned".into()));
        }
        let mut kargs = quant_args(input, stage, scratch, out, flags, rank as i32, bytes);
        let (mut params, n) = kargs
            .pointers_for(&common::QUANT_PARAMS)
            .ok_or_else(|| bad("parameters off the kernel's layout".into()))?;
        // SAFETY: the parameter list matches the kernel's signature (common::QUANT_PARAMS, checked: in, stage,
        // scratch, out, flags, rank, world, n_vec), every pointer points into `kargs`, which outlives the call; the
        // caller guarantees the buffers, the module and the co-residency.
        unsafe { P::launch(kernels.runtime(), f, (blocks, 1, 1), (THREADS, 1, 1), stream, &mut params[..n]) }
    }
}

/// The quantized kernels' parameters, in the order of `common::QUANT_PARAMS` (the world is `flags.len()`, at most
/// `MAX_RANKS`: checked by the launcher).
fn quant_args(
    input: u64,
    stage: &[u64],
    scratch: &[u64],
    out: u64,
    flags: &[u64],
    rank: i32,
    bytes: usize,
) -> KernelArgs {
    let n_vec = (bytes / common::VECTOR_BYTES) as u64;
    let world = flags.len() as i32;
    KernelArgs::new().u64(input).ptrs(stage).ptrs(scratch).u64(out).ptrs(flags).i32(rank).i32(world).u64(n_vec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_slots_and_sizes() {
        let mut names = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for format in Format::ALL {
            for dtype in [DataType::F32, DataType::F16, DataType::Bf16] {
                assert!(seen.insert(slot(format, dtype).expect("slot")));
                names.extend(kernel_name(format, dtype));
            }
            assert_eq!(kernel_name(format, DataType::F64), None);
            assert_eq!(slot(format, DataType::I32), None);
        }
        names.sort();
        let mut listed = common::QUANT_KERNELS.map(str::to_owned).to_vec();
        listed.sort();
        assert_eq!(names, listed);
        // The parameters the launcher builds: the sizes the shared table lists.
        let built = quant_args(16, &[32, 48], &[64, 80], 96, &[112, 128], 0, 4096);
        assert!(built.matches(&common::QUANT_PARAMS), "{:?}", built.sizes());
        // A quantized message fits the staging its full-precision message fits, from one block up.
        for dtype in [DataType::F32, DataType::F16, DataType::Bf16] {
            for bytes in [64usize << 10, 8 << 20, 64 << 20] {
                assert!(staging_bytes(dtype, bytes).expect("size") <= bytes, "{dtype} {bytes}");
            }
        }
        assert_eq!(staging_bytes(DataType::Bf16, 16), Some(36));
        assert_eq!(staging_bytes(DataType::I32, 1024), None);
    }
}
