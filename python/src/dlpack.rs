//! DLPack input: any Python object with `__dlpack__` (NumPy ≥ 1.22 arrays, torch tensors, CuPy, JAX, ...).
//!
//! The ABI structs, the capsule protocol (the capsule renamed `used_dltensor` / `used_dltensor_versioned` when
//! consumed, so the producer's capsule destructor no longer frees it; the managed tensor's deleter called exactly
//! once when the [`Imported`] value is dropped), the `max_version` / `stream` negotiation and the descriptor's
//! structural checks (rank, shape and strides readable, no negative dimension, element and byte counts without
//! overflow, byte offset applied without overflow) come from the `dlpark` crate. On top, this module accepts only
//! what a collective can take: one lane of a type anyccl has, logically contiguous row-major memory (dimensions of
//! size 1 may carry any stride, as torch's contiguity rule says), the device the caller expects, and nothing else.
//! Every refusal is a Python `TypeError` (not a DLPack object, a type anyccl lacks) or `ValueError` (the wrong
//! device, not contiguous, a malformed descriptor) naming the argument.
//!
//! Only the `[ptr, ptr + bytes)` range the descriptor describes is ever read or written, and only while the
//! managed tensor (which keeps the producer's memory alive) is held.

use anyccl::DataType;
use dlpark::ffi::{DLDataType, DLDataTypeCode, DLDevice, DLDeviceType};
use dlpark::python::{DlpackStream, ImportRequest, ImportedDlpack, StreamArg};
use dlpark::DlpackFlags;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The device a call expects its DLPack input on.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Want {
    /// Host memory (`kDLCPU`), for the host backend.
    Cpu,
    /// CUDA memory of device `ordinal`; the producer makes the data ready on `stream` (a raw `CUstream`; 0: the
    /// legacy default stream, passed as the protocol's sentinel 1).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Cuda { ordinal: i32, stream: usize },
}

/// A DLPack tensor taken from Python and checked: its memory, and the managed tensor that keeps it alive.
pub(crate) struct Imported {
    /// Dropping it calls the producer's deleter (once).
    _held: ImportedDlpack,
    /// The first byte (the data pointer plus the byte offset); dangling when `bytes` is 0.
    pub ptr: usize,
    /// Bytes of the elements: `elems × dtype.size_bytes()`.
    pub bytes: usize,
    /// Number of elements.
    pub elems: usize,
    /// anyccl's type of the elements.
    pub dtype: DataType,
    /// The producer marked the tensor read-only (DLPack ≥ 1.0 flag).
    pub read_only: bool,
}

/// anyccl's data type of a DLPack element type (one lane), or why there is none.
fn dtype_of(t: DLDataType) -> Result<DataType, String> {
    if t.lanes != 1 {
        return Err(format!("{} lanes per element (vector types are not supported)", t.lanes));
    }
    let c = t.code;
    Ok(match (c, t.bits) {
        (DLDataTypeCode::INT, 8) => DataType::I8,
        (DLDataTypeCode::INT, 32) => DataType::I32,
        (DLDataTypeCode::INT, 64) => DataType::I64,
        (DLDataTypeCode::UINT, 8) | (DLDataTypeCode::BOOL, 8) => DataType::U8,
        (DLDataTypeCode::UINT, 32) => DataType::U32,
        (DLDataTypeCode::UINT, 64) => DataType::U64,
        (DLDataTypeCode::FLOAT, 16) => DataType::F16,
        (DLDataTypeCode::FLOAT, 32) => DataType::F32,
        (DLDataTypeCode::FLOAT, 64) => DataType::F64,
        (DLDataTypeCode::BFLOAT, 16) => DataType::Bf16,
        (DLDataTypeCode::FLOAT8_E4M3FN, 8) => DataType::Fp8E4M3,
        (DLDataTypeCode::FLOAT8_E5M2, 8) => DataType::Fp8E5M2,
        _ => return Err(format!("DLPack type code {} with {} bits has no anyccl data type", c.0, t.bits)),
    })
}

/// A device as text: `cpu`, `cuda:1`, `rocm:0`, or the DLPack numbers.
fn device_text(d: DLDevice) -> String {
    match d.device_type {
        DLDeviceType::CPU => "cpu".into(),
        DLDeviceType::CUDA => format!("cuda:{}", d.device_id),
        DLDeviceType::CUDAHOST => "cuda pinned host memory".into(),
        DLDeviceType::CUDAMANAGED => format!("cuda managed memory ({})", d.device_id),
        DLDeviceType::ROCM => format!("rocm:{}", d.device_id),
        other => format!("DLPack device type {} id {}", other.0, d.device_id),
    }
}

/// Why `d` is not the device `want` names, or `None` when it is.
fn wrong_device(d: DLDevice, want: Want) -> Option<String> {
    let ok = match want {
        Want::Cpu => d.device_type == DLDeviceType::CPU,
        Want::Cuda { ordinal, .. } => d.device_type == DLDeviceType::CUDA && d.device_id == ordinal,
    };
    let expected = match want {
        Want::Cpu => {
            "host (cpu) memory is expected here (on a CUDA communicator: a plain torch.Tensor or a DLPack array of its \
             device)"
                .to_owned()
        }
        Want::Cuda { ordinal, .. } => format!("the communicator is on cuda:{ordinal}"),
    };
    (!ok).then(|| format!("the array is on {}, but {expected}", device_text(d)))
}

/// Whether dimensions `shape` with `strides` (in elements; `None`: compact) are row-major contiguous, ignoring the
/// stride of any dimension of size 1 (torch's rule) and of any tensor with no element.
fn contiguous(shape: &[i64], strides: Option<&[i64]>) -> bool {
    let Some(strides) = strides else { return true };
    if strides.len() != shape.len() {
        return false;
    }
    if shape.contains(&0) {
        return true;
    }
    let mut expected: i64 = 1;
    for (&n, &s) in shape.iter().zip(strides).rev() {
        if n != 1 && s != expected {
            return false;
        }
        // No overflow: the product of the shape was already checked by the descriptor's validation.
        expected = expected.saturating_mul(n);
    }
    true
}

/// The consumer stream, as the DLPack protocol passes it for CUDA (`dlpark` encodes 0 as the sentinel 1).
struct CudaStreamArg(usize);

// SAFETY: the stream is a live CUDA stream of the device the producer reported (torch's stream of the
// communicator's device, whose device was checked, or the legacy default stream), for the `__dlpack__` call.
unsafe impl DlpackStream for CudaStreamArg {
    fn as_python_arg(&self, _py: Python<'_>, _device: DLDevice) -> PyResult<StreamArg> {
        Ok(dlpark::python::consumer::stream::cuda(self.0 as *mut std::ffi::c_void))
    }
}

fn type_error(which: &str, what: impl std::fmt::Display) -> PyErr {
    PyTypeError::new_err(format!("{which}: {what}"))
}

fn value_error(which: &str, what: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("{which}: {what}"))
}

/// Whether `obj` offers DLPack at all (`__dlpack__`).
pub(crate) fn offers_dlpack(obj: &Bound<'_, PyAny>) -> bool {
    obj.hasattr("__dlpack__").unwrap_or(false)
}

/// The device `obj` says its data is on (`__dlpack_device__`), or `None` when it has no such method or it fails.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn device_of(obj: &Bound<'_, PyAny>) -> Option<DLDevice> {
    let (t, id): (u32, i32) = obj.call_method0("__dlpack_device__").ok()?.extract().ok()?;
    Some(DLDevice { device_type: DLDeviceType(t), device_id: id })
}

/// Takes `obj`'s data through DLPack and checks it for a collective on `want`'s device.
pub(crate) fn import(obj: &Bound<'_, PyAny>, which: &str, want: Want) -> PyResult<Imported> {
    if !offers_dlpack(obj) {
        let name = obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "an unknown type".into());
        return Err(type_error(which, format!("{name} has neither the buffer protocol nor __dlpack__")));
    }
    let request = ImportRequest::new(obj.as_borrowed())?;
    // The device first (no capsule is made yet), so a wrong one is refused without asking for the data.
    if let Ok(d) = request.device() {
        if let Some(why) = wrong_device(d, want) {
            return Err(value_error(which, why));
        }
    }
    let stream = match want {
        Want::Cpu => None,
        Want::Cuda { stream, .. } => Some(CudaStreamArg(stream)),
    };
    let dyn_stream = stream.as_ref().map(|s| s as &dyn DlpackStream);
    let held = match request.import(dyn_stream, None) {
        Ok(h) => h,
        // A producer older than DLPack 1.0 (NumPy < 2.1, torch < 2.4) refuses `max_version` with a TypeError:
        // ask again as the protocol's first version did, with the stream only, and take the capsule it returns.
        Err(e) if e.is_instance_of::<PyTypeError>(obj.py()) => {
            let capsule = match &stream {
                Some(s) => {
                    let kwargs = pyo3::types::PyDict::new(obj.py());
                    kwargs.set_item("stream", if s.0 == 0 { 1usize } else { s.0 })?;
                    obj.call_method("__dlpack__", (), Some(&kwargs))
                }
                None => obj.call_method0("__dlpack__"),
            }
            .map_err(|e2| type_error(which, format!("__dlpack__ failed: {e}; without max_version: {e2}")))?;
            ImportRequest::new(capsule.as_borrowed())?.import(None, None)?
        }
        Err(e) if e.is_instance_of::<PyValueError>(obj.py()) => {
            return Err(value_error(which, format!("malformed DLPack tensor: {}", e.value(obj.py()))));
        }
        Err(e) => return Err(e),
    };
    check(held, which, want)
}

/// The checks on an imported tensor, and its memory.
fn check(held: ImportedDlpack, which: &str, want: Want) -> PyResult<Imported> {
    let read_only = held.flags().contains(DlpackFlags::READ_ONLY);
    let (ptr, bytes, elems, dtype) = {
        let t = held.validate().map_err(|e| value_error(which, format!("malformed DLPack tensor: {e}")))?;
        if let Some(why) = wrong_device(t.device(), want) {
            return Err(value_error(which, why));
        }
        let dtype = dtype_of(t.dtype()).map_err(|m| type_error(which, m))?;
        if !contiguous(t.shape(), t.strides()) {
            return Err(value_error(
                which,
                format!(
                    "the array is not contiguous (shape {:?}, strides {:?}); pass a contiguous copy",
                    t.shape(),
                    t.strides().unwrap_or_default()
                ),
            ));
        }
        let elems = t.num_elements();
        let bytes = elems
            .checked_mul(dtype.size_bytes())
            .filter(|b| *b == t.num_bytes())
            .ok_or_else(|| value_error(which, format!("{elems} elements of {dtype} do not match the descriptor")))?;
        // SAFETY: the descriptor was validated above (its shape is readable); this only computes the address of
        // the first element (null data and an overflowing byte offset are errors), and reads nothing.
        let first =
            unsafe { t.offset_bytes_ptr() }.map_err(|e| value_error(which, format!("bad data pointer: {e}")))?;
        let addr = first as usize;
        if bytes > 0 && (!addr.is_multiple_of(dtype.size_bytes()) || addr.checked_add(bytes).is_none()) {
            return Err(value_error(which, format!("the data at {addr:#x} is not aligned to {dtype} or overflows")));
        }
        (addr, bytes, elems, dtype)
    };
    Ok(Imported { _held: held, ptr, bytes, elems, dtype, read_only })
}

/// A host array taken through DLPack (the host backend's side of `anyccl.Communicator` for objects without the
/// buffer protocol): its type and size, a copy of its bytes, and a write of a result back into it. Holding it
/// keeps the producer's memory alive; dropping it releases the DLPack tensor.
#[pyclass(module = "anyccl._anyccl", name = "_DlpackHost", frozen)]
pub(crate) struct DlpackHost {
    inner: Imported,
}

impl DlpackHost {
    /// The array's first byte, its length in bytes and whether the producer marked it read-only: valid while this
    /// object is alive.
    pub(crate) fn raw(&self) -> (usize, usize, bool) {
        (self.inner.ptr, self.inner.bytes, self.inner.read_only)
    }
}

#[pymethods]
impl DlpackHost {
    /// anyccl's name of the element type (`f32`, `bf16`, ...).
    #[getter]
    fn dtype(&self) -> String {
        self.inner.dtype.to_string()
    }

    /// Number of elements.
    #[getter]
    fn elems(&self) -> usize {
        self.inner.elems
    }

    /// Number of bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.bytes
    }

    /// Whether the producer marked the array read-only.
    #[getter]
    fn readonly(&self) -> bool {
        self.inner.read_only
    }

    /// A copy of the array's bytes.
    fn tobytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        if self.inner.bytes == 0 {
            return PyBytes::new(py, &[]);
        }
        // SAFETY: `[ptr, ptr + bytes)` is the host memory of a checked, contiguous DLPack tensor whose managed
        // tensor `self` holds (so the producer keeps it allocated); the GIL is held, so no other Python code runs
        // while it is copied (the same contract as the buffer protocol: no native thread writes it meanwhile).
        let data = unsafe { std::slice::from_raw_parts(self.inner.ptr as *const u8, self.inner.bytes) };
        PyBytes::new(py, data)
    }

    /// Copies `data` into the start of the array (at most its size); refused on a read-only array.
    fn write(&self, data: &[u8]) -> PyResult<()> {
        if self.inner.read_only {
            return Err(PyValueError::new_err("the DLPack array is read-only, and this call writes into it"));
        }
        let n = data.len().min(self.inner.bytes);
        if n > 0 {
            // SAFETY: as in `tobytes`, and the destination is writable (not flagged read-only); `n` is at most the
            // array's size, and `data` (a Python `bytes`) cannot overlap memory the array owns exclusively.
            unsafe { std::ptr::copy(data.as_ptr(), self.inner.ptr as *mut u8, n) };
        }
        Ok(())
    }
}

/// Takes a host array through DLPack for the host backend (`TypeError` / `ValueError` when it cannot).
#[pyfunction]
pub(crate) fn dlpack_host(obj: &Bound<'_, PyAny>, which: &str) -> PyResult<DlpackHost> {
    Ok(DlpackHost { inner: import(obj, which, Want::Cpu)? })
}
