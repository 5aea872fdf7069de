//! The caller's host memory, read and written in place by the host collectives: a buffer-protocol export (NumPy
//! arrays, `bytearray`, `memoryview`, ...) or a DLPack array the Python side took (`_DlpackHost`). No copy through
//! Python `bytes`: a collective uploads from the caller's send buffer and downloads into the caller's receive
//! buffer directly, so a large host all-reduce holds the caller's array and the communicator's one buffer, no more.
//!
//! A plain CPU `torch.Tensor` is read as the CUDA path reads a CUDA tensor: its pointer, element count, dtype and
//! contiguity come from torch's own methods (much cheaper per call than a NumPy view or a DLPack capsule), and the
//! tensor is held for the call.
//!
//! The buffer protocol is reached through `PyObject_GetBuffer` / `PyBuffer_Release`, declared here because the
//! extension is built for the stable ABI of Python 3.9, whose limited API does not declare them (they are in it from
//! 3.11, with this same `Py_buffer` layout, unchanged since Python 3.3, and every CPython 3 exports both).

use std::ffi::{c_char, c_int, c_void};

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};

use anyccl::DataType;

use crate::dlpack::DlpackHost;

/// CPython's `Py_buffer` (`Include/pybuffer.h`, part of the stable ABI since 3.11 with this layout).
#[repr(C)]
struct RawBuffer {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

impl RawBuffer {
    /// A zeroed `Py_buffer` for an exporter to fill.
    fn empty() -> Self {
        RawBuffer {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        }
    }
}

/// anyccl's type of a buffer-protocol element (a `struct` format code in native order, `itemsize` bytes), as the
/// Python side's table reads it; `None` for anything else.
fn dtype_of_format(format: &[u8], itemsize: usize) -> Option<DataType> {
    let code = match format {
        [c] | [b'@' | b'=', c] => *c,
        [b'<', c] if cfg!(target_endian = "little") => *c,
        _ => return None,
    };
    Some(match (code, itemsize) {
        (b'b', 1) => DataType::I8,
        (b'B' | b'c' | b'?', 1) => DataType::U8,
        (b'e', 2) => DataType::F16,
        (b'f', 4) => DataType::F32,
        (b'd', 8) => DataType::F64,
        (b'i' | b'l' | b'q', 4) => DataType::I32,
        (b'i' | b'l' | b'q', 8) => DataType::I64,
        (b'I' | b'L' | b'Q', 4) => DataType::U32,
        (b'I' | b'L' | b'Q', 8) => DataType::U64,
        _ => return None,
    })
}

extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

/// `PyBUF_WRITABLE`.
const PYBUF_WRITABLE: c_int = 0x0001;
/// `PyBUF_FORMAT`.
const PYBUF_FORMAT: c_int = 0x0004;
/// `PyBUF_C_CONTIGUOUS` (`PyBUF_STRIDES | 0x0020`, `PyBUF_STRIDES` being `PyBUF_ND | 0x0010`, `PyBUF_ND` 0x0008).
const PYBUF_C_CONTIGUOUS: c_int = 0x0038;

/// The bytes `[ptr, ptr + len)` of a host buffer, as plain numbers so they can cross into the code that runs with
/// the GIL released. Valid while the [`HostMem`] they came from is alive.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Span {
    pub ptr: usize,
    pub len: usize,
}

impl Span {
    /// The bytes, to read.
    ///
    /// # Safety
    /// The [`HostMem`] this span came from is alive, and no `&mut` of the same memory lives meanwhile.
    pub unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: by the caller's contract the span is the live, exported memory of a `HostMem`.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    /// The bytes, to write.
    ///
    /// # Safety
    /// As [`Span::bytes`], the memory is writable (the `HostMem` was taken with `writable`), and no other reference
    /// to it lives meanwhile.
    pub unsafe fn bytes_mut<'a>(self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: by the caller's contract the span is live, writable and not otherwise referenced.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) }
    }
}

/// torch's tensor classes and dtypes, looked up once torch has been imported by the program (never imported here:
/// a program that has not imported torch passes no tensor).
struct TorchCpu {
    tensor: Py<PyType>,
    parameter: Py<PyType>,
    /// torch.dtype → index of anyccl's type in `DataType::ALL`.
    dtypes: Py<PyDict>,
}

/// torch's dtype objects mapped to their index in `DataType::ALL`: the one table the host fast path and the CUDA
/// path read. Older torch releases lack the unsigned and fp8 types: those are simply not mapped.
pub(crate) fn torch_dtypes<'py>(torch: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
    let dtypes = PyDict::new(torch.py());
    for (name, t) in [
        ("int8", DataType::I8),
        ("uint8", DataType::U8),
        ("int32", DataType::I32),
        ("uint32", DataType::U32),
        ("int64", DataType::I64),
        ("uint64", DataType::U64),
        ("float16", DataType::F16),
        ("bfloat16", DataType::Bf16),
        ("float32", DataType::F32),
        ("float64", DataType::F64),
        ("float8_e4m3fn", DataType::Fp8E4M3),
        ("float8_e5m2", DataType::Fp8E5M2),
    ] {
        if let (Ok(d), Some(index)) = (torch.getattr(name), DataType::ALL.iter().position(|x| *x == t)) {
            dtypes.set_item(d, index)?;
        }
    }
    Ok(dtypes)
}

static TORCH_CPU: PyOnceLock<TorchCpu> = PyOnceLock::new();

/// torch's types, when the program has imported torch (`sys.modules["torch"]`); `None` otherwise.
fn torch_cpu(py: Python<'_>) -> Option<&'static TorchCpu> {
    if let Some(t) = TORCH_CPU.get(py) {
        return Some(t);
    }
    let modules = py.import(intern!(py, "sys")).ok()?.getattr(intern!(py, "modules")).ok()?;
    let torch = modules.cast::<PyDict>().ok()?.get_item(intern!(py, "torch")).ok()??;
    TORCH_CPU
        .get_or_try_init(py, || -> PyResult<TorchCpu> {
            let dtypes = torch_dtypes(&torch)?;
            Ok(TorchCpu {
                tensor: torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind(),
                parameter: torch.getattr("nn")?.getattr("Parameter")?.cast_into::<PyType>()?.unbind(),
                dtypes: dtypes.unbind(),
            })
        })
        .ok()
}

/// A host buffer held for one call: the export is released (or the DLPack holder or the tensor let go) when it is
/// dropped, which happens with the GIL held (the value cannot leave the thread: it holds raw pointers and a `Bound`).
pub(crate) struct HostMem<'py> {
    /// A buffer-protocol export; boxed so its address stays fixed until `PyBuffer_Release`.
    export: Option<Box<RawBuffer>>,
    /// A DLPack array held by the Python object `_DlpackHost` (kept alive by this reference).
    _dlpack: Option<Bound<'py, DlpackHost>>,
    /// A CPU torch tensor whose memory `span` is (kept alive by this reference).
    _tensor: Option<Bound<'py, PyAny>>,
    span: Span,
}

impl<'py> HostMem<'py> {
    /// Takes `obj`'s memory: a `_DlpackHost`, or an object with the buffer protocol exporting C-contiguous memory
    /// (writable when `writable`). `which` names the argument in the errors.
    pub fn take(obj: &Bound<'py, PyAny>, which: &str, writable: bool) -> PyResult<HostMem<'py>> {
        if let Ok(dl) = obj.cast::<DlpackHost>() {
            let (ptr, len, read_only) = dl.get().raw();
            if writable && read_only {
                return Err(PyBufferError::new_err(format!(
                    "{which}: the DLPack array is read-only, and this call writes into it"
                )));
            }
            return Ok(HostMem { export: None, _dlpack: Some(dl.clone()), _tensor: None, span: Span { ptr, len } });
        }
        let mut view = Box::new(RawBuffer::empty());
        let flags = PYBUF_C_CONTIGUOUS | if writable { PYBUF_WRITABLE } else { 0 };
        // SAFETY: `obj` is a live object (the GIL is held: `Bound`), and `view` points at a zeroed `Py_buffer` of
        // CPython's layout that stays at this address until `PyBuffer_Release` (in `Drop`), which is called only
        // after a successful export.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
        if rc != 0 {
            let cause = PyErr::take(obj.py()).map(|e| e.to_string()).unwrap_or_else(|| "no buffer".into());
            return Err(PyBufferError::new_err(format!("{which}: {cause}")));
        }
        let (ptr, len) = (view.buf as usize, view.len);
        // Held from here on, so the export is released on every path below.
        let mut mem = HostMem { export: Some(view), _dlpack: None, _tensor: None, span: Span { ptr, len: 0 } };
        if len < 0 || (len > 0 && ptr == 0) {
            return Err(PyBufferError::new_err(format!("{which}: the exporter gave a malformed buffer")));
        }
        mem.span.len = len as usize; // not negative: checked above
        Ok(mem)
    }

    /// `obj`'s memory and element type when it exports C-contiguous memory (writable when `writable`) whose format
    /// names a type anyccl has, in native byte order; `None` (and no Python error left set) for anything else, so the
    /// caller takes its general path, which explains refusals.
    pub fn take_typed(obj: &Bound<'py, PyAny>, writable: bool) -> Option<(HostMem<'py>, DataType)> {
        let mut view = Box::new(RawBuffer::empty());
        let flags = PYBUF_C_CONTIGUOUS | PYBUF_FORMAT | if writable { PYBUF_WRITABLE } else { 0 };
        // SAFETY: as in `take`: a live object, a zeroed `Py_buffer` at a fixed address, released in `Drop` only after
        // a successful export.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
        if rc != 0 {
            drop(PyErr::take(obj.py()));
            return None;
        }
        let (ptr, len, itemsize) = (view.buf as usize, view.len, view.itemsize);
        let format = if view.format.is_null() {
            b"B".to_vec()
        } else {
            // SAFETY: a non-null `format` of a successful export is a NUL-terminated string that lives as long as
            // the export, which `view` holds.
            unsafe { std::ffi::CStr::from_ptr(view.format) }.to_bytes().to_vec()
        };
        let mut mem = HostMem { export: Some(view), _dlpack: None, _tensor: None, span: Span { ptr, len: 0 } };
        if len < 0 || (len > 0 && ptr == 0) || itemsize <= 0 {
            return None;
        }
        let dtype = dtype_of_format(&format, itemsize as usize)?;
        if !(len as usize).is_multiple_of(dtype.size_bytes()) {
            return None;
        }
        mem.span.len = len as usize; // not negative: checked above
        Some((mem, dtype))
    }

    /// The fast paths' reading of a host array: a plain CPU torch tensor (see [`HostMem::take_torch`]) or an object
    /// with the buffer protocol and a typed format ([`HostMem::take_typed`]); `None` (no Python error left set) for
    /// anything else. A tensor is recognised by its exact class, before any buffer export is tried, once torch's
    /// classes are known: the first tensor passed after torch was imported costs one failed export.
    pub fn take_fast(obj: &Bound<'py, PyAny>, writable: bool) -> Option<(HostMem<'py>, DataType)> {
        let py = obj.py();
        if let Some(t) = TORCH_CPU.get(py) {
            if Self::is_plain_tensor(obj, t) {
                return Self::take_torch(obj, t);
            }
        }
        if let Some(found) = Self::take_typed(obj, writable) {
            return Some(found);
        }
        let t = torch_cpu(py)?;
        if Self::is_plain_tensor(obj, t) {
            return Self::take_torch(obj, t);
        }
        None
    }

    fn is_plain_tensor(obj: &Bound<'py, PyAny>, t: &TorchCpu) -> bool {
        let py = obj.py();
        let ty = obj.get_type();
        // Exactly torch's own classes: a subclass could answer data_ptr()/numel() with anything.
        ty.is(t.tensor.bind(py)) || ty.is(t.parameter.bind(py))
    }

    /// A plain contiguous CPU tensor's memory and element type, read from torch (`is_cpu`, `is_contiguous()`,
    /// `is_neg()`, `dtype`, `numel()`, `data_ptr()`); `None` (no Python error left set) for a tensor on another
    /// device, a non-contiguous or negated view, a sparse tensor, a dtype anyccl lacks, an empty tensor, or any
    /// error from torch. Tensors have no read-only flag to honour; one that requires grad is written in place, as the
    /// general path writes it (through `detach()`).
    fn take_torch(obj: &Bound<'py, PyAny>, t: &TorchCpu) -> Option<(HostMem<'py>, DataType)> {
        let py = obj.py();
        let yes = |name: &Bound<'py, pyo3::types::PyString>, call: bool| -> Option<bool> {
            let v = if call { obj.call_method0(name) } else { obj.getattr(name) };
            v.ok()?.extract::<bool>().ok()
        };
        if !yes(intern!(py, "is_cpu"), false)? || !yes(intern!(py, "is_contiguous"), true)? {
            return None;
        }
        // A negated view (`torch._neg_view`, the imaginary part of a conjugate) holds the values un-negated.
        if yes(intern!(py, "is_neg"), true)? {
            return None;
        }
        let dt = obj.getattr(intern!(py, "dtype")).ok()?;
        let index: usize = t.dtypes.bind(py).get_item(&dt).ok()??.extract().ok()?;
        let dtype = *DataType::ALL.get(index)?;
        let elems: usize = obj.call_method0(intern!(py, "numel")).ok()?.extract().ok()?;
        let len = elems.checked_mul(dtype.size_bytes())?;
        let ptr: usize = obj.call_method0(intern!(py, "data_ptr")).ok()?.extract().ok()?;
        if ptr == 0 || len == 0 {
            return None;
        }
        Some((HostMem { export: None, _dlpack: None, _tensor: Some(obj.clone()), span: Span { ptr, len } }, dtype))
    }

    /// The held bytes.
    pub fn span(&self) -> Span {
        self.span
    }
}

impl Drop for HostMem<'_> {
    fn drop(&mut self) {
        if let Some(v) = self.export.as_mut() {
            // SAFETY: `v` was filled by a successful `PyObject_GetBuffer` and is released exactly once, here; the GIL
            // is held (a `HostMem` is made and dropped only in code holding it, and cannot be sent elsewhere).
            unsafe { PyBuffer_Release(&mut **v) };
        }
    }
}
