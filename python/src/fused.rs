//! The fused all-reduce + residual add + RMSNorm from Python: `residual ← allreduce(input) + residual` (in place),
//! `out ← rmsnorm(residual) * weight` (or fp8 e4m3 of it), one call on every backend
//! (`anyccl::dynamic::DynComm::all_reduce_rmsnorm`; the CUDA tensors' path in `cuda.rs`).

use anyccl::core::fused::{RmsNormForm, RmsNormSelection, RmsNormSpec};
use anyccl::DataType;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::{invalid, parse_dtype, to_py, uploaded, zeroed, Comm, Fail, State};

/// The spec of one call, from the Python values (every value checked by core's validation when the call runs).
pub(crate) fn spec(
    py: Python<'_>,
    dtype: DataType,
    tokens: usize,
    hidden: usize,
    eps: f32,
    form: Option<&str>,
    fp8_scale: Option<f32>,
) -> PyResult<RmsNormSpec> {
    let mut spec = RmsNormSpec::new(dtype, tokens, hidden, eps);
    if let Some(scale) = fp8_scale {
        spec = spec.fp8_output(scale);
    }
    if let Some(name) = form {
        spec = spec.with_form(parse_form(name).map_err(|e| to_py(py, &e))?);
    }
    Ok(spec)
}

/// The form `name` names: core's parser (any case; `one-shot`, `two-shot` and `push` name the fused forms), with
/// `_` read as `-` as for the algorithm names.
fn parse_form(name: &str) -> anyccl::Result<RmsNormForm> {
    name.replace('_', "-").parse::<RmsNormForm>()
}

/// The name of the form `name` names ([`parse_form`]), or `None` when it names none (the Python side then raises
/// `AlgorithmNameError` listing the forms).
#[pyfunction]
pub(crate) fn canonical_form(name: &str) -> Option<&'static str> {
    parse_form(name).ok().map(RmsNormForm::name)
}

/// The selection as JSON (`{"form": ..., "why": ...}`).
pub(crate) fn json(s: &RmsNormSelection) -> String {
    serde_json::json!({ "form": s.form.name(), "why": &*s.why }).to_string()
}

/// Every form's name.
pub(crate) fn form_names() -> Vec<&'static str> {
    RmsNormForm::ALL.iter().map(|f| f.name()).collect()
}

/// Bytes of the output for `spec` (`None`: overflow).
pub(crate) fn out_bytes(spec: &RmsNormSpec) -> Option<usize> {
    spec.tokens.checked_mul(spec.hidden)?.checked_mul(spec.output.element_bytes(spec.dtype))
}

/// Host bytes through the communicator's own buffers: uploads, the call, downloads of the residual and output.
fn staged(
    st: &mut State,
    spec: &RmsNormSpec,
    input: &[u8],
    residual: &[u8],
    weight: &[u8],
    out_len: usize,
) -> Result<(Vec<u8>, Vec<u8>, RmsNormSelection), Fail> {
    let State { comm, stream, .. } = st;
    let a = uploaded(&**comm, input, stream)?;
    let mut r = uploaded(&**comm, residual, stream)?;
    let w = uploaded(&**comm, weight, stream)?;
    let mut o = comm.alloc(out_len)?;
    let sel = comm.all_reduce_rmsnorm(&a, &mut r, &w, &mut o, spec, stream)?;
    let mut new_residual = zeroed(residual.len(), "the residual after the fused call")?;
    comm.download(&r, &mut new_residual, stream)?;
    let mut out = zeroed(out_len, "the output of the fused call")?;
    comm.download(&o, &mut out, stream)?;
    comm.synchronize(stream)?;
    Ok((new_residual, out, sel))
}

/// The fused call on host bytes (`Comm.host_rmsnorm`): the new residual's bytes and the output's.
#[allow(clippy::too_many_arguments)]
pub(crate) fn host<'py>(
    comm: &Comm,
    py: Python<'py>,
    input: &[u8],
    residual: &[u8],
    weight: &[u8],
    dtype: &str,
    tokens: usize,
    hidden: usize,
    eps: f32,
    form: Option<&str>,
    fp8_scale: Option<f32>,
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
    let dtype = parse_dtype(py, dtype)?;
    let spec = spec(py, dtype, tokens, hidden, eps, form, fp8_scale)?;
    let out_len =
        out_bytes(&spec).ok_or_else(|| invalid(py, format!("{tokens} × {hidden} elements of {dtype} overflow")))?;
    // The byte strings are immutable `bytes` objects the caller holds: valid while the GIL is released.
    let (res, out) = comm.with_state(py, move |st| {
        let (res, out, sel) = staged(st, &spec, input, residual, weight, out_len)?;
        st.last_rmsnorm = Some(sel);
        Ok((res, out))
    })?;
    Ok((PyBytes::new(py, &res), PyBytes::new(py, &out)))
}
