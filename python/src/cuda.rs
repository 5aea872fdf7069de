//! CUDA tensors: a plain `torch.Tensor`'s pointer, element count, element size, dtype, device and contiguity are
//! read from torch and checked here, then the memory is viewed (not owned) for one call on the caller's stream.
//!
//! The contract (documented on `anyccl.Communicator`): the tensors stay alive and are not resized or re-pointed
//! (`set_`, `resize_`) by another thread while the call runs. The work is enqueued on the stream, as with every
//! torch collective: the caching allocator's stream rules apply when the tensor is used on another stream.

use std::ffi::c_void;

use anyccl::core::InvalidArgument;
use anyccl::core::P2pOp;
use anyccl::cuda::{CudaComm, CudaStream, DeviceBuffer};
use anyccl::{Algorithm, Communicator, DataType, InOut, ReduceOp};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};

use crate::dlpack::{self, Want};
use crate::{invalid, needs, Call, Coll, Comm, Fail, Last};

/// torch's objects, looked up once.
struct Torch {
    tensor: Py<PyType>,
    parameter: Py<PyType>,
    stream: Py<PyType>,
    /// torch.dtype → anyccl data type index in `DataType::ALL`.
    dtypes: Py<PyDict>,
    /// `torch._C._cuda_getCurrentRawStream(device) -> int`, or `None` (then `torch.cuda.current_stream`).
    raw_stream: Option<Py<PyAny>>,
    current_stream: Py<PyAny>,
}

static TORCH: PyOnceLock<Torch> = PyOnceLock::new();

fn torch(py: Python<'_>) -> PyResult<&Torch> {
    TORCH.get_or_try_init(py, || {
        let torch = py.import("torch")?;
        let dtypes = crate::hostmem::torch_dtypes(torch.as_any())?;
        let c = torch.getattr("_C")?;
        let cuda = torch.getattr("cuda")?;
        Ok(Torch {
            tensor: torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind(),
            parameter: torch.getattr("nn")?.getattr("Parameter")?.cast_into::<PyType>()?.unbind(),
            stream: cuda.getattr("Stream")?.cast_into::<PyType>()?.unbind(),
            dtypes: dtypes.unbind(),
            raw_stream: c.getattr("_cuda_getCurrentRawStream").ok().map(Bound::unbind),
            current_stream: cuda.getattr("current_stream")?.unbind(),
        })
    })
}

/// One tensor's memory, as read from torch and checked.
#[derive(Clone, Copy, Debug)]
struct DevTensor {
    ptr: u64,
    bytes: usize,
    elems: usize,
    dtype: DataType,
}

/// Why a tensor is refused, or `Ok` with its memory. `ordinal` is the communicator's device.
/// `cuda_checked`: the caller already saw `t.is_cuda` true (the hot path asks torch once, not twice).
fn check_tensor(
    py: Python<'_>,
    t: &Bound<'_, PyAny>,
    which: &str,
    ordinal: i32,
    cuda_checked: bool,
) -> PyResult<Result<DevTensor, String>> {
    let torch = torch(py)?;
    let ty = t.get_type();
    // Exactly torch's own classes: a subclass could answer data_ptr()/numel() with anything.
    if !(ty.is(torch.tensor.bind(py)) || ty.is(torch.parameter.bind(py))) {
        return Ok(Err(format!(
            "{which}: expected a plain torch.Tensor on cuda:{ordinal}, got {}",
            ty.name().map(|n| n.to_string()).unwrap_or_else(|_| "an unknown type".into())
        )));
    }
    if !cuda_checked && !t.getattr("is_cuda")?.extract::<bool>()? {
        return Ok(Err(format!(
            "{which}: the tensor is on {} but the communicator is on cuda:{ordinal}",
            t.getattr("device")?.str()?
        )));
    }
    let dev: i64 = t.call_method0("get_device")?.extract()?;
    if dev != i64::from(ordinal) {
        return Ok(Err(format!("{which}: the tensor is on cuda:{dev} but the communicator is on cuda:{ordinal}")));
    }
    if !t.call_method0("is_contiguous")?.extract::<bool>()? {
        return Ok(Err(format!("{which}: the tensor is not contiguous (call .contiguous() first)")));
    }
    let dt = t.getattr("dtype")?;
    let Some(index) = torch.dtypes.bind(py).get_item(&dt)? else {
        return Ok(Err(format!("{which}: dtype {} has no anyccl data type", dt.str()?)));
    };
    let index: usize = index.extract()?;
    let Some(&dtype) = DataType::ALL.get(index) else {
        return Ok(Err(format!("{which}: internal dtype index {index}")));
    };
    let elems: usize = t.call_method0("numel")?.extract()?;
    // torch's element size of each mapped dtype is anyccl's (the map pairs them by name and width).
    let esize = dtype.size_bytes();
    let Some(bytes) = elems.checked_mul(esize) else {
        return Ok(Err(format!("{which}: {elems} elements of {esize} bytes overflow")));
    };
    let ptr: u64 = t.call_method0("data_ptr")?.extract()?;
    if ptr == 0 && bytes > 0 {
        return Ok(Err(format!("{which}: the tensor has no memory (data_ptr() is 0)")));
    }
    Ok(Ok(DevTensor { ptr, bytes, elems, dtype }))
}

fn tensor(py: Python<'_>, t: &Bound<'_, PyAny>, which: &str, ordinal: i32, cuda_checked: bool) -> PyResult<DevTensor> {
    check_tensor(py, t, which, ordinal, cuda_checked)?.map_err(|m| invalid(py, m))
}

/// The raw stream to enqueue on: `stream` (a `torch.cuda.Stream` of the communicator's device) or torch's
/// current stream of the device.
fn raw_stream(py: Python<'_>, stream: Option<&Bound<'_, PyAny>>, ordinal: i32) -> PyResult<usize> {
    let torch = torch(py)?;
    match stream {
        Some(s) => {
            if !s.is_instance(torch.stream.bind(py))? {
                return Err(invalid(py, "stream: expected a torch.cuda.Stream".into()));
            }
            let dev: i64 = s.getattr("device_index")?.extract()?;
            if dev != i64::from(ordinal) {
                return Err(invalid(py, format!("stream: on cuda:{dev}, the communicator is on cuda:{ordinal}")));
            }
            s.getattr("cuda_stream")?.extract()
        }
        None => match &torch.raw_stream {
            Some(f) => f.bind(py).call1((ordinal,))?.extract(),
            None => torch.current_stream.bind(py).call1((ordinal,))?.getattr("cuda_stream")?.extract(),
        },
    }
}

fn typed(comm: &mut anyccl::AnyCommunicator) -> Result<&mut Communicator<CudaComm>, Fail> {
    let backend = comm.backend().name();
    comm.as_any_mut()
        .downcast_mut::<Communicator<CudaComm>>()
        .ok_or(Fail::Anyccl(InvalidArgument::WrongBackend { which: "tensor", found: "cuda", expected: backend }.into()))
}

/// Runs `call` on the tensors' memory on `stream` (GIL released by the caller), and waits for it when `sync`;
/// returns the all-reduce's algorithm.
fn run(
    comm: &mut Communicator<CudaComm>,
    call: Call,
    send: DevTensor,
    recv: Option<DevTensor>,
    stream: usize,
    sync: bool,
) -> Result<Option<Last>, Fail> {
    let last = run_on(comm, call, send, recv, stream)?;
    if sync {
        let ctx = comm.runtime().context().clone();
        // SAFETY: as in `run_on`: the stream the call was enqueued on, alive for the call.
        let s = unsafe { CudaStream::from_raw(stream as *mut c_void, &ctx) };
        s.synchronize()?;
    }
    Ok(last)
}

fn run_on(
    comm: &mut Communicator<CudaComm>,
    call: Call,
    send: DevTensor,
    recv: Option<DevTensor>,
    stream: usize,
) -> Result<Option<Last>, Fail> {
    let ctx = comm.runtime().context().clone();
    let ordinal = ctx.ordinal().unsigned_abs();
    // SAFETY: `stream` is torch's stream of this communicator's device (its current stream, or a torch.cuda.Stream
    // whose device was checked), or 0 (the legacy default stream, for DLPack input without a stream), alive for the
    // call; the wrapper is dropped before returning and destroys nothing.
    let s = unsafe { CudaStream::from_raw(stream as *mut c_void, &ctx) };
    // SAFETY: `[send.ptr, send.ptr + send.bytes)` is the memory of a plain contiguous torch CUDA tensor of this
    // device (pointer, element count and size read from torch and checked by `check_tensor`), which the caller keeps
    // alive and unresized for the call (the documented contract), or of a checked contiguous DLPack tensor of this
    // device whose managed tensor the caller of `run` holds until the call returned; the view frees nothing.
    let mut a = unsafe { DeviceBuffer::from_raw(send.ptr, send.bytes, ordinal) };
    // SAFETY: as above, for the receive tensor.
    let mut b = recv.map(|r| unsafe { DeviceBuffer::from_raw(r.ptr, r.bytes, ordinal) });
    let Call { coll, count, dtype, op, peer, algo } = call;
    match coll {
        Coll::Send => comm.send(&a, count, dtype, peer, &s)?,
        Coll::Recv => comm.recv(&mut a, count, dtype, peer, &s)?,
        _ => {
            let io = match b.as_mut() {
                Some(b) => InOut::Separate { send: &a, recv: b },
                None => InOut::InPlace(&mut a),
            };
            match (coll, algo) {
                (Coll::AllReduce, Some(algo)) => {
                    comm.all_reduce_with(algo, io, count, dtype, op, &s)?;
                    return Ok(Some(Last::Named(algo)));
                }
                (Coll::AllReduce, None) => {
                    return Ok(Some(Last::Selected(comm.all_reduce(io, count, dtype, op, &s)?)));
                }
                (Coll::AllGather, _) => comm.all_gather(io, count, dtype, &s)?,
                (Coll::ReduceScatter, _) => comm.reduce_scatter(io, count, dtype, op, &s)?,
                (Coll::Broadcast, _) => comm.broadcast(io, count, dtype, peer, &s)?,
                _ => comm.reduce(io, count, dtype, op, peer, &s)?,
            }
        }
    }
    Ok(None)
}

/// Whether `x` is a torch CUDA tensor (of any class), so the CUDA path is the one to take; `false` for anything
/// else (a NumPy array, a CPU tensor), and when torch cannot be imported at all.
fn is_cuda_tensor(py: Python<'_>, x: &Bound<'_, PyAny>) -> PyResult<bool> {
    let Ok(torch) = torch(py) else { return Ok(false) };
    if !x.is_instance(torch.tensor.bind(py))? {
        return Ok(false);
    }
    x.getattr("is_cuda")?.extract()
}

/// Runs `coll` on CUDA tensors and returns `true`, or returns `false` without doing anything when `send` is not a
/// CUDA tensor (the caller then takes the host path).
#[allow(clippy::too_many_arguments)]
pub(crate) fn collective(
    comm: &Comm,
    py: Python<'_>,
    coll: Coll,
    send: &Bound<'_, PyAny>,
    recv: Option<&Bound<'_, PyAny>>,
    op: ReduceOp,
    peer: usize,
    stream: Option<&Bound<'_, PyAny>>,
    algo: Option<Algorithm>,
) -> PyResult<bool> {
    let ordinal = comm.device_index;
    if ordinal < 0 {
        return Ok(false);
    }
    let torch_send = is_cuda_tensor(py, send)?;
    if !torch_send && !is_dlpack_cuda(py, send)? {
        return Ok(false);
    }
    // DLPack input (CuPy, JAX, ...): the producer makes its data ready on the stream given (a torch.cuda.Stream;
    // the call is then asynchronous on it, like torch's), or on the legacy default stream, and then the call waits
    // for its work before returning (the producer cannot order its later work after a stream it was not given).
    let torch_recv = match recv {
        Some(r) => is_torch_tensor(py, r)?,
        None => true,
    };
    let dl = !torch_send || !torch_recv;
    let (raw, sync) = match (dl, stream) {
        (true, None) => (0, true),
        _ => (raw_stream(py, stream, ordinal)?, false),
    };
    let mut held = Vec::new();
    let writes_send = recv.is_none() && coll != Coll::Send;
    let send_name = if recv.is_some() { "send" } else { "tensor" };
    let sv = if torch_send {
        tensor(py, send, send_name, ordinal, true)?
    } else {
        from_dlpack(py, send, send_name, ordinal, raw, writes_send, &mut held)?
    };
    let rv = match recv {
        Some(r) if torch_recv => Some(tensor(py, r, "recv", ordinal, false)?),
        Some(r) => Some(from_dlpack(py, r, "recv", ordinal, raw, true, &mut held)?),
        None => None,
    };
    if let Some(rv) = &rv {
        if rv.dtype != sv.dtype {
            return Err(invalid(py, format!("send is {} but recv is {}", sv.dtype, rv.dtype)));
        }
    }
    let world = comm.world_size;
    let count = match (coll, &rv) {
        (Coll::ReduceScatter, Some(rv)) => rv.elems,
        (Coll::ReduceScatter | Coll::AllGather, None) => {
            if sv.elems % world != 0 {
                return Err(invalid(py, format!("tensor: {} elements do not split into {world} parts", sv.elems)));
            }
            sv.elems / world
        }
        _ => sv.elems,
    };
    // The lengths are checked again by anyccl's front-end; this names the tensor in the message first.
    if let (Some(rv), Some((_, need))) = (&rv, needs(coll, count, sv.dtype.size_bytes(), world)) {
        if rv.bytes < need {
            return Err(invalid(py, format!("recv: holds {} bytes, the call needs {need}", rv.bytes)));
        }
    }
    let call = Call { coll, count, dtype: sv.dtype, op, peer, algo };
    let done = comm.with_state(py, move |st| {
        let typed = typed(&mut st.comm)?;
        if let Some(sel) = run(typed, call, sv, rv, raw, sync)? {
            st.last = Some(sel);
        }
        Ok(true)
    });
    // The DLPack tensors are released (their deleters called) after the call, with the GIL held.
    drop(held);
    done
}

/// A group of sends and receives on CUDA tensors (plain `torch.Tensor`s or CUDA DLPack objects of this
/// communicator's device), enqueued as one group on `stream` (`ncclGroupStart`, each `ncclSend` / `ncclRecv`,
/// `ncclGroupEnd`): each rank's group pairs with its peers' whatever the order of the operations in it. `ops` are
/// `(is_send, tensor, peer)`; a receive is written into its tensor. Every tensor is checked before anything is
/// enqueued; streams as in [`collective`] (DLPack objects without a stream: the legacy default stream, waited for).
pub(crate) fn p2p(
    comm: &Comm,
    py: Python<'_>,
    ops: &[(bool, Bound<'_, PyAny>, usize)],
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let ordinal = comm.device_index;
    if ordinal < 0 {
        return Err(invalid(py, "p2p: CUDA tensors need a CUDA communicator".into()));
    }
    let mut torch_flags = Vec::with_capacity(ops.len());
    for (i, (_, x, _)) in ops.iter().enumerate() {
        let t = is_cuda_tensor(py, x)?;
        if !t && !is_dlpack_cuda(py, x)? {
            return Err(invalid(
                py,
                format!(
                    "p2p: operation {i}: expected a CUDA tensor of cuda:{ordinal} (a group is all CUDA or all host)"
                ),
            ));
        }
        torch_flags.push(t);
    }
    let dl = torch_flags.iter().any(|t| !t);
    let (raw, sync) = match (dl, stream) {
        (true, None) => (0, true),
        _ => (raw_stream(py, stream, ordinal)?, false),
    };
    let mut held = Vec::new();
    let mut specs = Vec::with_capacity(ops.len());
    for ((is_send, x, peer), torch_tensor) in ops.iter().zip(torch_flags) {
        let which = if *is_send { "send" } else { "recv" };
        let t = if torch_tensor {
            tensor(py, x, which, ordinal, true)?
        } else {
            from_dlpack(py, x, which, ordinal, raw, !*is_send, &mut held)?
        };
        specs.push((*is_send, t, *peer));
    }
    let done = comm.with_state(py, move |st| {
        let typed = typed(&mut st.comm)?;
        let ctx = typed.runtime().context().clone();
        let dev = ctx.ordinal().unsigned_abs();
        // SAFETY: as in `run_on`: torch's stream of this device (checked by `raw_stream`) or the legacy default
        // stream, alive for the call; the wrapper destroys nothing.
        let s = unsafe { CudaStream::from_raw(raw as *mut c_void, &ctx) };
        let mut bufs: Vec<DeviceBuffer> = specs
            .iter()
            // SAFETY: as in `run_on`: the memory of checked contiguous CUDA tensors of this device, kept alive and
            // unresized by the caller (DLPack tensors held in `held`) for the call; the views free nothing.
            .map(|(_, t, _)| unsafe { DeviceBuffer::from_raw(t.ptr, t.bytes, dev) })
            .collect();
        {
            let mut group: Vec<P2pOp<'_, DeviceBuffer>> = bufs
                .iter_mut()
                .zip(&specs)
                .map(|(b, &(is_send, t, peer))| {
                    if is_send {
                        P2pOp::send(&*b, t.elems, t.dtype, peer)
                    } else {
                        P2pOp::recv(b, t.elems, t.dtype, peer)
                    }
                })
                .collect();
            typed.p2p(&mut group, &s)?;
        }
        if sync {
            s.synchronize()?;
        }
        Ok(())
    });
    // The DLPack tensors are released (their deleters called) after the call, with the GIL held.
    drop(held);
    done
}

/// Whether `x` is a torch tensor (of any class and device); `false` when torch cannot be imported.
fn is_torch_tensor(py: Python<'_>, x: &Bound<'_, PyAny>) -> PyResult<bool> {
    let Ok(torch) = torch(py) else { return Ok(false) };
    x.is_instance(torch.tensor.bind(py))
}

/// Whether `x` is a DLPack object (not a torch tensor) whose `__dlpack_device__` says CUDA.
fn is_dlpack_cuda(py: Python<'_>, x: &Bound<'_, PyAny>) -> PyResult<bool> {
    if is_torch_tensor(py, x)? {
        return Ok(false);
    }
    Ok(dlpack::device_of(x).is_some_and(|d| d.device_type == dlpark::ffi::DLDeviceType::CUDA))
}

/// A CUDA DLPack object's memory on this communicator's device, ready on `stream`; the managed tensor goes into
/// `held`, which the caller keeps until the call returned.
fn from_dlpack(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    which: &str,
    ordinal: i32,
    stream: usize,
    writes: bool,
    held: &mut Vec<dlpack::Imported>,
) -> PyResult<DevTensor> {
    let im = dlpack::import(x, which, Want::Cuda { ordinal, stream })?;
    if writes && im.read_only {
        return Err(invalid(py, format!("{which}: the DLPack array is read-only, and this call writes into it")));
    }
    let t = DevTensor { ptr: im.ptr as u64, bytes: im.bytes, elems: im.elems, dtype: im.dtype };
    held.push(im);
    Ok(t)
}

pub(crate) fn should_all_reduce(
    comm: &Comm,
    py: Python<'_>,
    t: &Bound<'_, PyAny>,
    algo: Option<Algorithm>,
) -> PyResult<bool> {
    let ordinal = comm.device_index;
    if ordinal < 0 {
        return Ok(false);
    }
    let Ok(tv) = check_tensor(py, t, "tensor", ordinal, false)? else { return Ok(false) };
    if tv.elems == 0 {
        return Ok(false);
    }
    let call = anyccl::core::comm::AllReduceCall {
        count: tv.elems,
        dtype: tv.dtype,
        op: ReduceOp::Sum,
        bytes: tv.bytes,
        in_place: false,
        capturing: false,
        bufs: None,
    };
    comm.with_state(py, move |st| {
        Ok(match algo {
            Some(a) => st.comm.check_algorithm(a, &call).is_ok(),
            None => st.comm.select_all_reduce(&call).is_ok(),
        })
    })
}

/// The fused all-reduce + residual add + RMSNorm on CUDA tensors (`input`, `residual`: tokens × hidden; `weight`:
/// hidden; `out`: tokens × hidden of the input's type, or `float8_e4m3fn` with `fp8_scale`) on `stream`; returns
/// `false` without doing anything when `input` is not a CUDA tensor (the caller takes the host path).
#[allow(clippy::too_many_arguments)]
pub(crate) fn rmsnorm(
    comm: &Comm,
    py: Python<'_>,
    input: &Bound<'_, PyAny>,
    residual: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    eps: f32,
    form: Option<&str>,
    fp8_scale: Option<f32>,
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<bool> {
    let ordinal = comm.device_index;
    if ordinal < 0 || !is_cuda_tensor(py, input)? {
        return Ok(false);
    }
    let iv = tensor(py, input, "input", ordinal, true)?;
    let rv = tensor(py, residual, "residual", ordinal, false)?;
    let wv = tensor(py, weight, "weight", ordinal, false)?;
    let ov = tensor(py, out, "out", ordinal, false)?;
    let hidden = wv.elems;
    if hidden == 0 || iv.elems % hidden != 0 {
        return Err(invalid(py, format!("input: {} elements are not rows of weight's {hidden}", iv.elems)));
    }
    let spec = crate::fused::spec(py, iv.dtype, iv.elems / hidden, hidden, eps, form, fp8_scale)?;
    let raw = raw_stream(py, stream, ordinal)?;
    comm.with_state(py, move |st| {
        let typed = typed(&mut st.comm)?;
        let ctx = typed.runtime().context().clone();
        let dev = ctx.ordinal().unsigned_abs();
        // SAFETY: torch's stream of this communicator's device (checked by `raw_stream`), alive for the call; the
        // wrapper destroys nothing.
        let s = unsafe { CudaStream::from_raw(raw as *mut c_void, &ctx) };
        // SAFETY (the four views): the memory of plain contiguous torch CUDA tensors of this device (pointer,
        // element count and size read from torch and checked by `check_tensor`), which the caller keeps alive and
        // unresized for the call; core checks the sizes, alignment and overlaps against the spec; the views free
        // nothing.
        let a = unsafe { DeviceBuffer::from_raw(iv.ptr, iv.bytes, dev) };
        let mut r = unsafe { DeviceBuffer::from_raw(rv.ptr, rv.bytes, dev) };
        let w = unsafe { DeviceBuffer::from_raw(wv.ptr, wv.bytes, dev) };
        let mut o = unsafe { DeviceBuffer::from_raw(ov.ptr, ov.bytes, dev) };
        let sel = typed.all_reduce_rmsnorm(&a, &mut r, &w, &mut o, &spec, &s)?;
        st.last_rmsnorm = Some(sel);
        Ok(true)
    })
}
