//! The fused all-reduce + residual add + RMSNorm on the host ([`anyccl_core::fused`]): the all-reduce of the
//! input (rank-order f32 sums, rounded once, like every host all-reduce) into a temporary buffer, then each row's
//! residual add and RMSNorm with core's arithmetic ([`anyccl_core::fused::norm_row`], the GPU kernels' order), so
//! the host's results equal the GPU kernels' bit for bit. On the host the three forms differ only in how the
//! all-reduce is scheduled: fused one-shot and unfused up to 8 KiB reduce with one-shot, fused two-shot and unfused
//! above with two-shot (the threads' backend; the processes' backend has one schedule).

use anyccl_core::fused::{norm_row, RmsNormCall, RmsNormForm};
use anyccl_core::{DataType, Error, InvalidArgument, Result};

use crate::reduce::{cast, cast_mut};
use crate::{try_filled, HostBuffer};

/// The forms the host runs: every one but the fused push one-shot (a GPU kernel's exchange; the host has no
/// receive buffers to push into, and nothing to gain from them).
pub(crate) const FORMS: [RmsNormForm; 3] = [RmsNormForm::FusedOneShot, RmsNormForm::FusedTwoShot, RmsNormForm::Unfused];

/// Whether the threads' backend reduces `call` for `form` with two-shot (else one-shot).
pub(crate) fn two_shot(form: RmsNormForm, call: &RmsNormCall) -> bool {
    match form {
        RmsNormForm::FusedTwoShot => true,
        RmsNormForm::FusedOneShot => false,
        // The host's default all-reduce rule: one-shot below 8 KiB, two-shot from there.
        _ => call.bytes >= 8 << 10,
    }
}

/// A zeroed buffer for the all-reduce's `call.bytes`.
pub(crate) fn reduced_buffer(call: &RmsNormCall) -> Result<HostBuffer> {
    HostBuffer::try_zeroed(call.bytes)
}

/// The element type the host reduces `call` in, or the refusal of a type core's checks would not let through.
pub(crate) fn element(call: &RmsNormCall) -> Result<DataType> {
    match call.dtype {
        d @ (DataType::F16 | DataType::Bf16) => Ok(d),
        dtype => Err(Error::InvalidArgument(InvalidArgument::UnsupportedDataType {
            dtype,
            backend: "host".into(),
            why: "the fused all-reduce + RMSNorm takes f16 and bf16".into(),
        })),
    }
}

/// Every row's residual add and RMSNorm: `reduced` holds the all-reduce's rows, `residual` is overwritten with the
/// new residual, `out` receives the output. The lengths and 16-byte alignment were validated by the front-end.
pub(crate) fn norm_rows(
    call: &RmsNormCall,
    reduced: &[u8],
    residual: &mut [u8],
    weight: &[u8],
    out: &mut [u8],
) -> Result<()> {
    let hidden = call.hidden;
    let reduced = cast::<u16>(&reduced[..call.bytes])?;
    let residual = cast_mut::<u16>(&mut residual[..call.bytes])?;
    let weight = cast::<u16>(&weight[..call.weight_bytes()])?;
    let row_out = hidden * call.output.element_bytes(call.dtype);
    let mut scratch = try_filled(hidden, 0f32, "the RMSNorm row")?;
    let rows = reduced.chunks_exact(hidden).zip(residual.chunks_exact_mut(hidden));
    for ((red, res), o) in rows.zip(out[..call.out_bytes].chunks_exact_mut(row_out)) {
        norm_row(call, red, res, weight, o, &mut scratch);
    }
    Ok(())
}
