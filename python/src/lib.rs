//! `anyccl._anyccl`, the extension module under the `anyccl` Python package (python/anyccl): one rank's
//! communicator ([`Comm`]) over anyccl's type-erased communicator ([`anyccl::dynamic`]), made from the torchrun
//! environment, from a unique id the caller moves itself, or over a Python object that exchanges bytes (a torch
//! `ProcessGroup` through `anyccl.ProcessGroupBootstrap`).
//!
//! Host memory (NumPy arrays, any C-contiguous object with the buffer protocol, DLPack arrays) is held for the call
//! (a buffer export, or the DLPack array) and copied straight from the caller's send buffer into the communicator's
//! own buffer and back into the caller's receive buffer with the GIL released (`hostmem`): no copy through Python
//! `bytes`; the caller does not resize the arrays or write them from another thread until the call returns. CUDA tensors (the `cuda` feature) are passed by pointer: the pointer, element count, element
//! size, dtype, device and contiguity are read from a plain `torch.Tensor` here and checked before the call; the
//! caller keeps the tensor alive and unresized for the call (the same contract as every torch extension that
//! enqueues work on a stream). The GIL is released while a collective runs. Every failure is a Python exception of
//! the `anyccl.Error` hierarchy carrying anyccl's message and hint; nothing here panics.

use std::sync::{Arc, Mutex};

use anyccl::core::P2pOp;
use anyccl::core::{Bootstrap, InvalidArgument};
use anyccl::dynamic::{AnyBuffer, AnyCommunicator, AnyStream, BackendChoice, BackendKind};
use anyccl::{Algorithm, DataType, InOut, ReduceOp, Selector};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

mod errors {
    pyo3::create_exception!(
        anyccl,
        Error,
        pyo3::exceptions::PyException,
        "Base of every anyccl error; `message` is anyccl's text, `hint` what to do (or None)."
    );
    pyo3::create_exception!(anyccl, InvalidArgumentError, Error, "Bad input: nothing was sent, no buffer touched.");
    pyo3::create_exception!(anyccl, UnsupportedError, Error, "A capability the call needs is off here (the reason).");
    pyo3::create_exception!(anyccl, TimeoutError, Error, "A wait for a peer or the device exceeded its limit.");
    pyo3::create_exception!(anyccl, BackendError, Error, "A vendor library or runtime call failed.");
    pyo3::create_exception!(anyccl, PeerFailureError, Error, "Another rank failed or left.");
    pyo3::create_exception!(anyccl, ClosedError, Error, "The communicator was closed.");
}
use errors::*;

/// The largest byte string one rank may contribute to a Python bootstrap's all-gather, and the largest it accepts
/// from a peer (the rendezvous' own default limit).
const MAX_BOOTSTRAP_BYTES: usize = 1 << 20;

/// Why a call failed on the Rust side, before it becomes a Python exception.
enum Fail {
    Anyccl(anyccl::Error),
    Closed,
    Poisoned,
}

impl From<anyccl::Error> for Fail {
    fn from(e: anyccl::Error) -> Self {
        Fail::Anyccl(e)
    }
}

impl From<InvalidArgument> for Fail {
    fn from(e: InvalidArgument) -> Self {
        Fail::Anyccl(e.into())
    }
}

/// An exception of class `T` with `message`, `hint` and `kind` attributes.
fn exception<T: pyo3::PyTypeInfo>(py: Python<'_>, message: String, hint: Option<String>, kind: &str) -> PyErr {
    let text = match &hint {
        Some(h) => format!("{message}\nhint: {h}"),
        None => message.clone(),
    };
    let err = PyErr::new::<T, _>(text);
    let value = err.value(py);
    // Setting attributes on a fresh exception instance cannot fail short of memory exhaustion; if it does, the
    // exception still carries the text.
    let _ = value.setattr("message", message);
    let _ = value.setattr("hint", hint);
    let _ = value.setattr("kind", kind);
    err
}

/// anyccl's error as the matching Python exception.
fn to_py(py: Python<'_>, e: &anyccl::Error) -> PyErr {
    use anyccl::Error as E;
    let (message, hint) = (python_message(&e.to_string()), python_hint(e));
    match e {
        E::InvalidArgument(_) => exception::<InvalidArgumentError>(py, message, hint, "invalid-argument"),
        E::Parse { .. } | E::Config { .. } => exception::<InvalidArgumentError>(py, message, hint, "config"),
        E::Unsupported { .. } | E::AlgorithmNotEligible { .. } | E::NoEligibleAlgorithm { .. } => {
            exception::<UnsupportedError>(py, message, hint, "unsupported")
        }
        E::Timeout { .. } => exception::<TimeoutError>(py, message, hint, "timeout"),
        E::PeerFailure(_) => exception::<PeerFailureError>(py, message, hint, "peer-failure"),
        E::Backend { .. } | E::OutOfMemory { .. } => exception::<BackendError>(py, message, hint, "backend"),
        _ => exception::<Error>(py, message, hint, "other"),
    }
}

/// `message` for a Python caller: deterministic mode named by its keyword (`deterministic=True`, which sets it on the
/// communicator) rather than by the environment variable anyccl's core names, which is still named when it is set.
fn python_message(message: &str) -> String {
    use anyccl::core::selector::ENV_DETERMINISTIC;
    let core_says = format!("({ENV_DETERMINISTIC})");
    if !message.contains(&core_says) {
        return message.to_owned();
    }
    let python_says = if std::env::var_os(ENV_DETERMINISTIC).is_some() {
        format!("(deterministic=True, or {ENV_DETERMINISTIC} as set in the environment)")
    } else {
        "(deterministic=True)".to_owned()
    };
    message.replace(&core_says, &python_says)
}

/// The hint of `e` for a Python caller: the keyword and the Python calls rather than the CLI (`anyccl probe`) and the
/// environment variable, which a Python user reaches last (the variable is still named when it is set).
fn python_hint(e: &anyccl::Error) -> Option<String> {
    use anyccl::Error as E;
    let forced = std::env::var_os(anyccl::core::selector::ENV_FORCE_ALGO).is_some();
    let env_note = if forced {
        format!(
            " ({} is set in the environment and forces an algorithm when algorithm= is not given)",
            anyccl::core::selector::ENV_FORCE_ALGO
        )
    } else {
        String::new()
    };
    match e {
        E::AlgorithmNotEligible { .. } => Some(format!(
            "pass algorithm=None to let anyccl pick, or another name of anyccl.ALGORITHMS; \
             comm.select_all_reduce(count, dtype, algorithm=...) says whether one can run a call{env_note}"
        )),
        E::NoEligibleAlgorithm { .. } => {
            Some(format!("comm.capabilities() lists the algorithms and why each capability is off{env_note}"))
        }
        E::Unsupported { .. } => {
            Some("anyccl.backends() and comm.capabilities() show every backend and capability and why it is off".into())
        }
        _ => e.hint(),
    }
}

fn fail_to_py(py: Python<'_>, f: Fail) -> PyErr {
    match f {
        Fail::Anyccl(e) => to_py(py, &e),
        Fail::Closed => exception::<ClosedError>(
            py,
            "the communicator is closed".into(),
            Some("make a new Communicator; close() ends this one for good".into()),
            "closed",
        ),
        Fail::Poisoned => exception::<Error>(
            py,
            "the communicator failed in an earlier call on another thread and can no longer be used".into(),
            Some("close it and make a new Communicator".into()),
            "poisoned",
        ),
    }
}

fn invalid(py: Python<'_>, message: String) -> PyErr {
    exception::<InvalidArgumentError>(py, message, None, "invalid-argument")
}

/// A [`Bootstrap`] over a Python object with `rank`, `world` and `all_gather(bytes) -> list[bytes]` (such as
/// `anyccl.ProcessGroupBootstrap` over a torch gloo group). Called with the GIL taken for the call only; every
/// answer is checked: one entry per rank, each `bytes` of at most [`MAX_BOOTSTRAP_BYTES`].
struct PyBootstrap {
    obj: Py<PyAny>,
    rank: usize,
    world: usize,
}

impl PyBootstrap {
    fn new(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = obj.py();
        let rank: usize = obj.getattr("rank")?.extract()?;
        let world: usize = obj.getattr("world")?.extract()?;
        if world == 0 || rank >= world {
            return Err(invalid(py, format!("bootstrap: rank {rank} of world {world} is not a rank of its group")));
        }
        Ok(PyBootstrap { obj: obj.clone().unbind(), rank, world })
    }

    fn gather(&self, py: Python<'_>, mine: &[u8]) -> anyccl::Result<Vec<Vec<u8>>> {
        let peer = |e: PyErr| anyccl::Error::PeerFailure(format!("the Python bootstrap's all_gather failed: {e}"));
        let out = self.obj.bind(py).call_method1("all_gather", (PyBytes::new(py, mine),)).map_err(peer)?;
        let list = out.cast::<PyList>().map_err(|_| {
            anyccl::Error::PeerFailure("the Python bootstrap's all_gather returned something other than a list".into())
        })?;
        if list.len() != self.world {
            return Err(anyccl::Error::PeerFailure(format!(
                "the Python bootstrap's all_gather returned {} entries for {} ranks",
                list.len(),
                self.world
            )));
        }
        let mut all = Vec::new();
        all.try_reserve_exact(self.world)
            .map_err(|_| anyccl::Error::OutOfMemory { what: "bootstrap entries".into(), bytes: self.world as u64 })?;
        for (i, item) in list.iter().enumerate() {
            let b = item.cast::<PyBytes>().map_err(|_| {
                anyccl::Error::PeerFailure(format!("the Python bootstrap's entry of rank {i} is not bytes"))
            })?;
            let bytes = b.as_bytes();
            if bytes.len() > MAX_BOOTSTRAP_BYTES {
                return Err(anyccl::Error::PeerFailure(format!(
                    "rank {i} sent {} bytes through the Python bootstrap; the limit is {MAX_BOOTSTRAP_BYTES}",
                    bytes.len()
                )));
            }
            all.push(bytes.to_vec());
        }
        Ok(all)
    }
}

impl Bootstrap for PyBootstrap {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn all_gather(&mut self, mine: &[u8]) -> anyccl::Result<Vec<Vec<u8>>> {
        if mine.len() > MAX_BOOTSTRAP_BYTES {
            return Err(anyccl::Error::PeerFailure(format!(
                "a bootstrap message of {} bytes (the Python bootstrap carries at most {MAX_BOOTSTRAP_BYTES})",
                mine.len()
            )));
        }
        Python::attach(|py| self.gather(py, mine))
    }
}

/// One rank's state behind the lock: the communicator, the bootstrap kept for graph-buffer registration, the
/// stream host data is staged on, and the last all-reduce's selection.
struct State {
    comm: AnyCommunicator,
    boot: Option<Box<dyn Bootstrap + Send>>,
    stream: AnyStream,
    last: Option<Last>,
    /// The last fused all-reduce + RMSNorm's form and rule.
    last_rmsnorm: Option<anyccl::core::fused::RmsNormSelection>,
}

/// The last all-reduce's algorithm: the selector's choice (with its rule), or the one the caller named.
enum Last {
    Selected(anyccl::core::Selection),
    Named(Algorithm),
}

impl Last {
    fn json(&self) -> String {
        match self {
            Last::Selected(s) => serde_json::to_string(s).unwrap_or_default(),
            Last::Named(a) => serde_json::json!({
                "algorithm": a.name(),
                "why": format!("named by the caller (algorithm={:?})", a.name()),
            })
            .to_string(),
        }
    }
}

/// One rank's communicator (the extension side of `anyccl.Communicator`).
#[pyclass(module = "anyccl._anyccl", name = "_Comm", frozen)]
struct Comm {
    state: Mutex<Option<State>>,
    #[pyo3(get)]
    rank: usize,
    #[pyo3(get)]
    world_size: usize,
    #[pyo3(get)]
    backend: &'static str,
    /// The CUDA device ordinal, or -1 off CUDA.
    #[pyo3(get)]
    device_index: i32,
    #[pyo3(get)]
    device: String,
    /// The backends passed over, as JSON.
    #[pyo3(get)]
    passed_over: String,
}

/// The collectives, numbered as the Python side passes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Coll {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Reduce,
    Send,
    Recv,
}

impl Coll {
    fn from_name(s: &str) -> Option<Coll> {
        Some(match s {
            "all_reduce" => Coll::AllReduce,
            "all_gather" => Coll::AllGather,
            "reduce_scatter" => Coll::ReduceScatter,
            "broadcast" => Coll::Broadcast,
            "reduce" => Coll::Reduce,
            "send" => Coll::Send,
            "recv" => Coll::Recv,
            _ => return None,
        })
    }
}

/// One call's arguments after the Python values were checked.
#[derive(Clone, Copy, Debug)]
struct Call {
    coll: Coll,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    /// Root of broadcast/reduce, peer of send/recv.
    peer: usize,
    /// The all-reduce algorithm the caller named (`None`: the selector picks).
    algo: Option<Algorithm>,
}

fn parse_dtype(py: Python<'_>, s: &str) -> PyResult<DataType> {
    s.parse::<DataType>().map_err(|e| to_py(py, &e))
}

/// The algorithm named `s` (`None`: the selector picks). The Python side checks the name first and raises
/// `ValueError` listing the names; this is the same check for direct callers of the extension module.
fn parse_algorithm(py: Python<'_>, s: Option<&str>) -> PyResult<Option<Algorithm>> {
    s.map(|s| s.parse::<Algorithm>().map_err(|e| to_py(py, &e))).transpose()
}

fn parse_op(py: Python<'_>, s: &str) -> PyResult<ReduceOp> {
    // The exact names first: no allocation on the hot path.
    match s {
        "sum" => Ok(ReduceOp::Sum),
        "max" => Ok(ReduceOp::Max),
        "min" => Ok(ReduceOp::Min),
        "prod" => Ok(ReduceOp::Prod),
        "avg" => Ok(ReduceOp::Avg),
        _ => s.parse::<ReduceOp>().map_err(|e| to_py(py, &e)),
    }
}

/// `n` zero bytes of host memory, allocated fallibly (`what` names them in the out-of-memory error).
fn zeroed(n: usize, what: &str) -> Result<Vec<u8>, Fail> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| anyccl::Error::OutOfMemory { what: what.into(), bytes: n as u64 })?;
    v.resize(n, 0);
    Ok(v)
}

/// A buffer of the communicator's holding `bytes`, uploaded on `stream`.
fn uploaded(comm: &dyn anyccl::DynComm, bytes: &[u8], stream: &AnyStream) -> Result<AnyBuffer, Fail> {
    let mut b = comm.alloc(bytes.len())?;
    comm.upload(&mut b, bytes, stream)?;
    Ok(b)
}

/// Runs one collective on the caller's host memory through the communicator's own buffers: upload from `send`,
/// call, download into `recv` (`None`: back into `send`, in place). All-reduce, broadcast and reduce run in place on
/// one buffer even when the caller's are separate, so the communicator holds one buffer of the payload's size; a
/// receive allocates its buffer without uploading.
///
/// # Safety
/// `send` and `recv` are the spans of [`HostMem`]s held for the whole call; `send` was taken writable when `recv` is
/// `None` (unless the call is a send), `recv` writable; no Rust reference to either lives meanwhile.
unsafe fn staged(st: &mut State, call: Call, send: Span, recv: Option<Span>) -> Result<(), Fail> {
    let State { comm, stream, last, .. } = st;
    let Call { coll, count, dtype, op, peer, algo } = call;
    let mut a = if coll == Coll::Recv {
        comm.alloc(send.len)?
    } else {
        // SAFETY: the caller's contract; the shared slice ends with the upload.
        uploaded(&**comm, unsafe { send.bytes() }, stream)?
    };
    let one_buffer = matches!(coll, Coll::AllReduce | Coll::Broadcast | Coll::Reduce);
    // A receive buffer shorter than the send buffer goes the two-buffer way, where the communicator refuses it with
    // its own error.
    let mut b = match recv {
        Some(r) if !one_buffer || r.len < send.len => Some(comm.alloc(r.len)?),
        _ => None,
    };
    match coll {
        Coll::Send => comm.send(&a, count, dtype, peer, stream)?,
        Coll::Recv => comm.recv(&mut a, count, dtype, peer, stream)?,
        _ => {
            let io = match b.as_mut() {
                Some(b) => InOut::Separate { send: &a, recv: b },
                None => InOut::InPlace(&mut a),
            };
            match (coll, algo) {
                (Coll::AllReduce, Some(algo)) => {
                    comm.all_reduce_with(algo, io, count, dtype, op, stream)?;
                    *last = Some(Last::Named(algo));
                }
                (Coll::AllReduce, None) => *last = Some(Last::Selected(comm.all_reduce(io, count, dtype, op, stream)?)),
                (Coll::AllGather, _) => comm.all_gather(io, count, dtype, stream)?,
                (Coll::ReduceScatter, _) => comm.reduce_scatter(io, count, dtype, op, stream)?,
                (Coll::Broadcast, _) => comm.broadcast(io, count, dtype, peer, stream)?,
                _ => comm.reduce(io, count, dtype, op, peer, stream)?,
            }
        }
    }
    if coll != Coll::Send {
        let out_buf = b.as_ref().unwrap_or(&a);
        let mut dst = recv.unwrap_or(send);
        dst.len = dst.len.min(out_buf.len());
        // SAFETY: the caller's contract (the destination was taken writable); the upload's slice is gone.
        comm.download(out_buf, unsafe { dst.bytes_mut() }, stream)?;
    }
    comm.synchronize(stream)?;
    Ok(())
}

/// One operation of [`grouped_p2p`]: `(is_send, memory, dtype, count, peer)`.
type P2pSpec = (bool, Span, DataType, usize, usize);

/// Runs a group of sends and receives on the caller's host memory through the communicator's own buffers.
///
/// # Safety
/// As [`staged`]: every span is held for the call, receives writable, no Rust reference to them lives meanwhile.
unsafe fn grouped_p2p(st: &mut State, specs: &[P2pSpec]) -> Result<(), Fail> {
    let State { comm, stream, .. } = st;
    let mut bufs = Vec::new();
    bufs.try_reserve_exact(specs.len()).map_err(|_| anyccl::Error::OutOfMemory {
        what: "the buffers of a grouped send/receive".into(),
        bytes: specs.len() as u64,
    })?;
    for &(is_send, span, ..) in specs {
        bufs.push(if is_send {
            // SAFETY: the caller's contract; the shared slice ends with the upload.
            uploaded(&**comm, unsafe { span.bytes() }, stream)?
        } else {
            comm.alloc(span.len)?
        });
    }
    {
        let mut ops: Vec<P2pOp<'_, AnyBuffer>> = bufs
            .iter_mut()
            .zip(specs)
            .map(
                |(b, &(is_send, _, dtype, count, peer))| {
                    if is_send {
                        P2pOp::send(&*b, count, dtype, peer)
                    } else {
                        P2pOp::recv(b, count, dtype, peer)
                    }
                },
            )
            .collect();
        comm.p2p(&mut ops, stream)?;
    }
    for (b, &(is_send, span, ..)) in bufs.iter().zip(specs) {
        if !is_send {
            let mut dst = span;
            dst.len = dst.len.min(b.len());
            // SAFETY: the caller's contract (receives were taken writable); no other slice of it lives now.
            comm.download(b, unsafe { dst.bytes_mut() }, stream)?;
        }
    }
    comm.synchronize(stream)?;
    Ok(())
}

fn choice_of(py: Python<'_>, backend: &str) -> PyResult<BackendChoice> {
    backend.parse::<BackendChoice>().map_err(|e| to_py(py, &e))
}

fn selector(py: Python<'_>) -> PyResult<Arc<Selector>> {
    Selector::from_env().map(Arc::new).map_err(|e| to_py(py, &e))
}

fn passed_over_json(p: &[anyccl::dynamic::PassedOver]) -> String {
    serde_json::to_string(p).unwrap_or_else(|_| "[]".into())
}

impl Comm {
    fn new(
        comm: AnyCommunicator,
        boot: Option<Box<dyn Bootstrap + Send>>,
        passed_over: String,
    ) -> anyccl::Result<Comm> {
        let stream = comm.stream()?;
        let device_index = cuda_ordinal(&*comm);
        Ok(Comm {
            rank: comm.rank(),
            world_size: comm.world_size(),
            backend: comm.backend().name(),
            device: comm.device(),
            device_index,
            passed_over,
            state: Mutex::new(Some(State { comm, boot, stream, last: None, last_rmsnorm: None })),
        })
    }

    /// Runs `f` on the live state with the GIL released.
    fn with_state<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut State) -> Result<R, Fail> + Send) -> PyResult<R> {
        py.detach(|| {
            let mut guard = self.state.lock().map_err(|_| Fail::Poisoned)?;
            let st = guard.as_mut().ok_or(Fail::Closed)?;
            f(st)
        })
        .map_err(|f| fail_to_py(py, f))
    }

    /// Reads the state with the GIL held (no collective runs: quick queries only).
    fn peek<R>(&self, py: Python<'_>, f: impl FnOnce(&State) -> R + Send) -> PyResult<R>
    where
        R: Send,
    {
        self.with_state(py, |st| Ok(f(st)))
    }
}

#[cfg(feature = "cuda")]
fn cuda_ordinal(comm: &dyn anyccl::DynComm) -> i32 {
    comm.as_any()
        .downcast_ref::<anyccl::Communicator<anyccl::cuda::CudaComm>>()
        .map_or(-1, |c| c.runtime().context().ordinal())
}

#[cfg(not(feature = "cuda"))]
fn cuda_ordinal(_: &dyn anyccl::DynComm) -> i32 {
    -1
}

/// The byte lengths a collective of `count` elements of `elem` bytes needs in its send and receive buffers, at
/// `world` ranks (`None`: the call takes no such buffer).
fn needs(coll: Coll, count: usize, elem: usize, world: usize) -> Option<(usize, usize)> {
    let one = count.checked_mul(elem)?;
    let all = one.checked_mul(world)?;
    Some(match coll {
        Coll::AllReduce | Coll::Broadcast | Coll::Reduce | Coll::Send | Coll::Recv => (one, one),
        Coll::AllGather => (one, all),
        Coll::ReduceScatter => (all, one),
    })
}

#[pymethods]
impl Comm {
    /// A collective on host memory, read and written in place: `send` is the send (or in-place) buffer, `recv` the
    /// receive buffer (`None`: in place), each an object with the buffer protocol (C-contiguous) or a `_DlpackHost`.
    /// `count` is anyccl's element count (per rank for all_gather and reduce_scatter). The result is written into
    /// `recv` (or `send`); nothing is copied through Python `bytes`. The Python side (`anyccl.Communicator`) checks
    /// the arrays' types and sizes first. `algorithm` names the all-reduce algorithm (`None`: the selector picks).
    #[pyo3(signature = (coll, send, recv, dtype, count, op="sum", peer=0, algorithm=None))]
    #[allow(clippy::too_many_arguments)]
    fn host_collective(
        &self,
        py: Python<'_>,
        coll: &str,
        send: &Bound<'_, PyAny>,
        recv: Option<&Bound<'_, PyAny>>,
        dtype: &str,
        count: usize,
        op: &str,
        peer: usize,
        algorithm: Option<&str>,
    ) -> PyResult<()> {
        let coll = Coll::from_name(coll).ok_or_else(|| invalid(py, format!("unknown collective {coll:?}")))?;
        let op = parse_op(py, op)?;
        let dtype = parse_dtype(py, dtype)?;
        let algo = parse_algorithm(py, algorithm)?;
        let call = Call { coll, count, dtype, op, peer, algo };
        let send_mem = HostMem::take(send, "send", recv.is_none() && coll != Coll::Send)?;
        let recv_mem = recv.map(|r| HostMem::take(r, "recv", true)).transpose()?;
        let (send_span, recv_span) = (send_mem.span(), recv_mem.as_ref().map(HostMem::span));
        // SAFETY: both memories are held (exported, or their DLPack arrays held) until after the call returns, and
        // were taken writable where written; the caller does not resize them or write them from another thread
        // while the call runs with the GIL released (the documented contract, as for every buffer handed to a
        // native call that releases the GIL).
        self.with_state(py, move |st| unsafe { staged(st, call, send_span, recv_span) })?;
        drop(recv_mem);
        drop(send_mem);
        Ok(())
    }

    /// The all-reduce fast path for host arrays: `x` (and `out`, when given) a plain contiguous CPU `torch.Tensor` of
    /// a type anyccl has (read through torch's `data_ptr()`), or an object exporting C-contiguous memory of a type
    /// anyccl reads from its buffer format (NumPy arrays of its types, typed memoryviews), reduced in place (or into
    /// `out`) with `op` (one of anyccl's names). Returns False, having done nothing, for anything else (a DLPack-only
    /// object, another format, a read-only `x` or `out`, types or sizes that differ, a name it does not know), so the
    /// caller takes its general path, which explains every refusal.
    #[pyo3(signature = (x, out, op, algorithm=None))]
    fn host_all_reduce_fast(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        op: &str,
        algorithm: Option<&str>,
    ) -> PyResult<bool> {
        let op = match op {
            "sum" => ReduceOp::Sum,
            "max" => ReduceOp::Max,
            "min" => ReduceOp::Min,
            "prod" => ReduceOp::Prod,
            "avg" => ReduceOp::Avg,
            _ => return Ok(false),
        };
        let algo = parse_algorithm(py, algorithm)?;
        let Some((send_mem, dtype)) = HostMem::take_fast(x, out.is_none()) else {
            return Ok(false);
        };
        let recv_mem = match out {
            None => None,
            Some(o) => match HostMem::take_fast(o, true) {
                Some((m, d)) if d == dtype && m.span().len == send_mem.span().len => Some(m),
                _ => return Ok(false),
            },
        };
        let count = send_mem.span().len / dtype.size_bytes();
        let call = Call { coll: Coll::AllReduce, count, dtype, op, peer: 0, algo };
        let (send_span, recv_span) = (send_mem.span(), recv_mem.as_ref().map(HostMem::span));
        // SAFETY: as in `host_collective`: both memories are held until after the call, taken writable where
        // written, and not resized or written from another thread while the call runs (the documented contract).
        self.with_state(py, move |st| unsafe { staged(st, call, send_span, recv_span) })?;
        drop(recv_mem);
        drop(send_mem);
        Ok(true)
    }

    /// This communicator's address, for `anyccl_py_host_all_reduce` (the bare C entry point that
    /// `python/bench/host_overhead.py` calls through ctypes). Valid while this object is alive.
    fn bare_handle(&self) -> usize {
        self as *const Comm as usize
    }

    /// A group of sends and receives on host memory that completes as one (NCCL's grouped point-to-point, as
    /// `torch.distributed.batch_isend_irecv` issues it): `ops` are `(is_send, memory, dtype, count, peer)` with
    /// memory as `host_collective` takes it (receives written in place). Every rank's group pairs with its peers'
    /// however the sends and receives are ordered.
    fn host_p2p(&self, py: Python<'_>, ops: Vec<(bool, Bound<'_, PyAny>, String, usize, usize)>) -> PyResult<()> {
        let mut mems = Vec::with_capacity(ops.len());
        let mut specs = Vec::with_capacity(ops.len());
        for (is_send, obj, dtype, count, peer) in &ops {
            let mem = HostMem::take(obj, if *is_send { "send" } else { "recv" }, !*is_send)?;
            specs.push((*is_send, mem.span(), parse_dtype(py, dtype)?, *count, *peer));
            mems.push(mem);
        }
        // SAFETY: every span's memory is held in `mems` until after the call returns; receives were taken writable;
        // the spans of one group do not overlap in ways the caller did not ask for (a buffer both sent and received
        // into is read by the upload before any download writes it); the caller does not resize or write them from
        // another thread meanwhile.
        self.with_state(py, move |st| unsafe { grouped_p2p(st, &specs) })?;
        drop(mems);
        Ok(())
    }

    /// The byte lengths (send, recv) a collective needs; for the Python side's allocation of outputs.
    fn needs(&self, py: Python<'_>, coll: &str, count: usize, dtype: &str) -> PyResult<(usize, usize)> {
        let coll = Coll::from_name(coll).ok_or_else(|| invalid(py, format!("unknown collective {coll:?}")))?;
        let d = parse_dtype(py, dtype)?;
        needs(coll, count, d.size_bytes(), self.world_size)
            .ok_or_else(|| invalid(py, format!("{count} elements of {d} at {} ranks overflow", self.world_size)))
    }

    /// The algorithm an all-reduce of `count` elements of `dtype` would use now, as JSON, without running it (an
    /// error when none can). With `algorithm`, whether that one could run it (the same JSON, or the error saying
    /// why not).
    #[pyo3(signature = (count, dtype, op="sum", in_place=true, algorithm=None))]
    fn select_all_reduce(
        &self,
        py: Python<'_>,
        count: usize,
        dtype: &str,
        op: &str,
        in_place: bool,
        algorithm: Option<&str>,
    ) -> PyResult<String> {
        let dtype = parse_dtype(py, dtype)?;
        let op = parse_op(py, op)?;
        let algo = parse_algorithm(py, algorithm)?;
        let bytes = count
            .checked_mul(dtype.size_bytes())
            .ok_or_else(|| invalid(py, format!("{count} elements of {dtype} overflow")))?;
        let call =
            anyccl::core::comm::AllReduceCall { count, dtype, op, bytes, in_place, capturing: false, bufs: None };
        self.with_state(py, move |st| match algo {
            Some(a) => {
                st.comm.check_algorithm(a, &call)?;
                Ok(Last::Named(a).json())
            }
            None => Ok(Last::Selected(st.comm.select_all_reduce(&call)?).json()),
        })
    }

    /// Turns deterministic mode on or off for this rank (every rank must use the same setting): all-reduce then
    /// sums in rank order with one-shot or two-shot, bitwise the same run after run, or fails saying why.
    fn set_deterministic(&self, py: Python<'_>, on: bool) -> PyResult<()> {
        self.with_state(py, move |st| {
            st.comm.set_deterministic(on);
            Ok(())
        })
    }

    /// Whether deterministic mode is on.
    fn deterministic(&self, py: Python<'_>) -> PyResult<bool> {
        self.peek(py, |st| st.comm.deterministic())
    }

    /// The capability report as JSON.
    fn capabilities_json(&self, py: Python<'_>) -> PyResult<String> {
        self.peek(py, |st| {
            let report = serde_json::to_value(st.comm.capabilities()).unwrap_or_default();
            let info = serde_json::json!({
                "backend": st.comm.backend(),
                "vendor": format!("{:?}", st.comm.vendor()),
                "arch": st.comm.arch(),
                "device": st.comm.device(),
                "library": st.comm.library(),
                "rank": st.comm.rank(),
                "world_size": st.comm.world_size(),
                "allreduce_algorithms": st.comm.allreduce_algorithms(),
                "deterministic": st.comm.deterministic(),
                "capabilities": report,
            });
            info.to_string()
        })
    }

    /// The last all-reduce's selection as JSON, or `None` before the first.
    fn last_selection_json(&self, py: Python<'_>) -> PyResult<Option<String>> {
        self.peek(py, |st| st.last.as_ref().map(Last::json))
    }

    /// The fused all-reduce + residual add + RMSNorm on host bytes: `input`, `residual` (tokens × hidden of
    /// `dtype`) and `weight` (hidden); returns the new residual's bytes and the output's (tokens × hidden of `dtype`,
    /// or fp8 e4m3 bytes with `fp8_scale`). `form` forces "fused-one-shot", "fused-two-shot" or "unfused"
    /// ("fused-push" is a GPU form: the host refuses it).
    #[pyo3(signature = (input, residual, weight, dtype, tokens, hidden, eps, form=None, fp8_scale=None))]
    #[allow(clippy::too_many_arguments)]
    fn host_rmsnorm<'py>(
        &self,
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
        fused::host(self, py, input, residual, weight, dtype, tokens, hidden, eps, form, fp8_scale)
    }

    /// The last fused call's form and the rule that chose it, as JSON, or `None` before the first.
    fn last_rmsnorm_json(&self, py: Python<'_>) -> PyResult<Option<String>> {
        self.peek(py, |st| st.last_rmsnorm.as_ref().map(fused::json))
    }

    /// Waits until every rank reaches the barrier.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        self.with_state(py, |st| Ok(st.comm.barrier(&st.stream)?))
    }

    /// Registers the inputs of collectives captured into graphs since the last registration (collective: every
    /// rank calls it). Returns (registered, kept_staged).
    fn register_graph_buffers(&self, py: Python<'_>) -> PyResult<(usize, usize)> {
        self.with_state(py, |st| {
            let boot: Option<&mut dyn Bootstrap> = match st.boot.as_mut() {
                Some(b) => Some(&mut **b),
                None => None,
            };
            let r = st.comm.register_graph_buffers(boot)?;
            Ok((r.registered, r.kept_staged.len()))
        })
    }

    /// Inputs of captured collectives not registered yet.
    fn pending_graph_buffers(&self, py: Python<'_>) -> PyResult<usize> {
        self.peek(py, |st| st.comm.pending_graph_buffers())
    }

    /// Whether the communicator is closed.
    fn closed(&self, py: Python<'_>) -> bool {
        py.detach(|| self.state.lock().map(|g| g.is_none()).unwrap_or(true))
    }

    /// Tears the rank down and waits for it, at most `timeout` seconds (None: without a limit). Idempotent.
    #[pyo3(signature = (timeout=None))]
    fn close(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let limit = match timeout {
            None => None,
            Some(t) if (0.0..=86_400.0).contains(&t) => Some(std::time::Duration::from_secs_f64(t)),
            Some(t) => return Err(invalid(py, format!("timeout={t}: expected seconds between 0 and 86400"))),
        };
        let r: Result<(), Fail> = py.detach(|| {
            let taken = match self.state.lock() {
                Ok(mut g) => g.take(),
                Err(p) => p.into_inner().take(),
            };
            let Some(st) = taken else { return Ok(()) };
            // The staging stream goes last, after the teardown was waited for.
            let State { comm, boot, stream: _stream, .. } = st;
            let teardown = comm.close_in_background();
            let done = match limit {
                None => Some(teardown.wait()),
                Some(l) => teardown.wait_timeout(l),
            };
            drop(boot);
            match done {
                None => Err(Fail::Anyccl(anyccl::Error::Timeout {
                    what: "the communicator's teardown".into(),
                    after: limit.unwrap_or_default(),
                })),
                Some(r) => Ok(r?),
            }
        });
        r.map_err(|f| fail_to_py(py, f))
    }

    /// A collective on CUDA tensors (plain `torch.Tensor`s on this communicator's device), on `stream` (a
    /// `torch.cuda.Stream`, or the current stream). `recv=None` runs in place. Returns `False` without doing
    /// anything when `send` is not a CUDA tensor or this communicator is not on CUDA (take the host path then).
    /// `algorithm` names the all-reduce algorithm (`None`: the selector picks).
    #[cfg(feature = "cuda")]
    #[pyo3(signature = (coll, send, recv=None, op="sum", peer=0, stream=None, algorithm=None))]
    #[allow(clippy::too_many_arguments)]
    fn cuda_collective(
        &self,
        py: Python<'_>,
        coll: &str,
        send: &Bound<'_, PyAny>,
        recv: Option<&Bound<'_, PyAny>>,
        op: &str,
        peer: usize,
        stream: Option<&Bound<'_, PyAny>>,
        algorithm: Option<&str>,
    ) -> PyResult<bool> {
        let coll = Coll::from_name(coll).ok_or_else(|| invalid(py, format!("unknown collective {coll:?}")))?;
        let op = parse_op(py, op)?;
        let algo = parse_algorithm(py, algorithm)?;
        cuda::collective(self, py, coll, send, recv, op, peer, stream, algo)
    }

    /// A group of sends and receives on CUDA tensors that completes as one NCCL group (`ncclGroupStart`, the
    /// sends and receives, `ncclGroupEnd`), so each rank's group pairs with its peers' whatever the order of the
    /// operations: `ops` are `(is_send, tensor, peer)`, each tensor a plain `torch.Tensor` or a CUDA DLPack object on
    /// this communicator's device, enqueued on `stream` (a `torch.cuda.Stream`, or the current stream).
    #[cfg(feature = "cuda")]
    #[pyo3(signature = (ops, stream=None))]
    fn cuda_p2p(
        &self,
        py: Python<'_>,
        ops: Vec<(bool, Bound<'_, PyAny>, usize)>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        cuda::p2p(self, py, &ops, stream)
    }

    /// The fused all-reduce + residual add + RMSNorm on CUDA tensors (see `host_rmsnorm`); `False` when `input`
    /// is not a CUDA tensor.
    #[cfg(feature = "cuda")]
    #[pyo3(signature = (input, residual, weight, out, eps, form=None, fp8_scale=None, stream=None))]
    #[allow(clippy::too_many_arguments)]
    fn cuda_rmsnorm(
        &self,
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
        cuda::rmsnorm(self, py, input, residual, weight, out, eps, form, fp8_scale, stream)
    }

    /// Whether `tensor` is one this communicator's `all_reduce` takes: a plain contiguous CUDA tensor on its
    /// device, of a supported dtype, with an all-reduce algorithm eligible for it now.
    /// With `algorithm`, whether that algorithm could run it.
    #[cfg(feature = "cuda")]
    #[pyo3(signature = (tensor, algorithm=None))]
    fn cuda_should_all_reduce(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        algorithm: Option<&str>,
    ) -> PyResult<bool> {
        let algo = parse_algorithm(py, algorithm)?;
        cuda::should_all_reduce(self, py, tensor, algo)
    }
}

/// The bare C entry point of a host all-reduce, for measuring what the Python layer adds: the same work as
/// `Communicator.all_reduce(x)` on a host communicator (the same staging through the communicator's buffer, the same
/// lock) with no Python object read. `python/bench/host_overhead.py` calls it through ctypes, which releases the GIL
/// around the call as the extension does. In place on `bytes` bytes at `buf`, of the type at index `dtype` of
/// `anyccl.dtypes()`' order (`DataType::ALL`), with `op` 0 sum, 1 prod, 2 min, 3 max, 4 avg. Returns 0 on success, 1
/// for an argument it does not take (a null pointer, an unknown type or op, a size that is not whole elements), 2
/// when the collective failed or the communicator is closed.
///
/// # Safety
/// `comm` is `_Comm.bare_handle()` of a communicator whose Python object outlives the call; `buf` points at `bytes`
/// writable bytes that nothing else reads or writes until the call returns.
#[no_mangle]
pub unsafe extern "C" fn anyccl_py_host_all_reduce(
    comm: *const std::ffi::c_void,
    buf: *mut std::ffi::c_void,
    bytes: usize,
    dtype: std::ffi::c_int,
    op: std::ffi::c_int,
) -> std::ffi::c_int {
    let op = match op {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Prod,
        2 => ReduceOp::Min,
        3 => ReduceOp::Max,
        4 => ReduceOp::Avg,
        _ => return 1,
    };
    let Some(&dtype) = usize::try_from(dtype).ok().and_then(|i| DataType::ALL.get(i)) else { return 1 };
    if comm.is_null() || (buf.is_null() && bytes > 0) || !bytes.is_multiple_of(dtype.size_bytes()) {
        return 1;
    }
    // SAFETY: the caller's contract: `comm` is the address of a live `Comm` (a frozen pyclass, only read here).
    let comm = unsafe { &*(comm as *const Comm) };
    let call = Call { coll: Coll::AllReduce, count: bytes / dtype.size_bytes(), dtype, op, peer: 0, algo: None };
    let span = Span { ptr: buf as usize, len: bytes };
    let Ok(mut guard) = comm.state.lock() else { return 2 };
    let Some(st) = guard.as_mut() else { return 2 };
    // SAFETY: the caller's contract: `bytes` writable bytes at `buf`, nothing else touching them during the call.
    match unsafe { staged(st, call, span, None) } {
        Ok(()) => 0,
        Err(_) => 2,
    }
}

#[cfg(feature = "cuda")]
mod cuda;
mod dlpack;
mod fused;
mod hostmem;
use hostmem::{HostMem, Span};

/// Joins the job this process was started into by torchrun or srun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
/// `MASTER_ADDR`, `MASTER_PORT`; anyccl's rendezvous on `MASTER_PORT + 1` or `ANYCCL_MASTER_PORT`) on `backend`
/// (`best`, `host`, `cuda`): cuda takes GPU `LOCAL_RANK`.
#[pyfunction]
#[pyo3(signature = (backend="best"))]
fn from_env(py: Python<'_>, backend: &str) -> PyResult<Comm> {
    let choice = choice_of(py, backend)?;
    let sel = selector(py)?;
    let r = py.detach(move || -> anyccl::Result<Comm> {
        let (kind, passed) = pick(choice)?;
        let (comm, boot): (AnyCommunicator, Option<Box<dyn Bootstrap + Send>>) = match kind {
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => {
                let (c, rdv) = anyccl::cuda::multi_process::communicator_from_env(sel)?;
                (Box::new(c), Some(Box::new(rdv)))
            }
            _ => {
                let options = anyccl::host::HostOptions { selector: sel, ..Default::default() };
                (Box::new(anyccl::host::from_env(options)?), None)
            }
        };
        Comm::new(comm, boot, passed_over_json(&passed))
    });
    r.map_err(|e| to_py(py, &e))
}

/// The backend `choice` picks for one rank in this process, or the error listing why none can run.
fn pick(choice: BackendChoice) -> anyccl::Result<(BackendKind, Vec<anyccl::dynamic::PassedOver>)> {
    let disabled = anyccl::dynamic::disabled_by_env()?;
    let order: &[BackendKind] = match choice {
        BackendChoice::Best => &[BackendKind::Cuda, BackendKind::Host],
        BackendChoice::Host => &[BackendKind::Host],
        BackendChoice::Cuda => &[BackendKind::Cuda],
        BackendChoice::Rocm => &[BackendKind::Rocm],
    };
    let mut passed = Vec::new();
    for &kind in order {
        let why = match kind {
            BackendKind::Rocm => Some(ROCM_WHY.to_owned()),
            _ => anyccl::dynamic::unavailable(kind, 1, disabled),
        };
        match why {
            None => return Ok((kind, passed)),
            Some(why) => passed.push(anyccl::dynamic::PassedOver { backend: kind, why }),
        }
    }
    let detail = passed.iter().map(|p| format!("{}: {}", p.backend, p.why)).collect::<Vec<_>>().join("; ");
    Err(anyccl::Error::Unsupported {
        capability: "backend".into(),
        reason: anyccl::core::Reason::Unavailable { component: "anyccl".into(), detail },
    })
}

/// A communicator over `boot` on `kind` (collective: every rank of the bootstrap calls it).
#[allow(unused_variables)]
fn over_bootstrap(
    boot: Box<dyn Bootstrap + Send>,
    kind: BackendKind,
    device: Option<i32>,
    sel: Arc<Selector>,
) -> anyccl::Result<(AnyCommunicator, Option<Box<dyn Bootstrap + Send>>)> {
    match kind {
        BackendKind::Host => {
            let options = anyccl::host::HostOptions { selector: sel, ..Default::default() };
            Ok((Box::new(anyccl::host::communicator_over(boot, options)?), None))
        }
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            let mut boot = boot;
            let (rank, world) = (boot.rank(), boot.world());
            let id = anyccl::cuda::multi_process::broadcast_unique_id(&mut *boot)?;
            let device = match device {
                Some(d) => d,
                None => {
                    let n = anyccl::dynamic::device_count(BackendKind::Cuda).unwrap_or(1).max(1);
                    i32::try_from(rank % n).unwrap_or(0)
                }
            };
            let comm = anyccl::cuda::multi_process::communicator_with_id(&id, rank, world, device, &mut *boot, sel)?;
            Ok((Box::new(comm), Some(boot)))
        }
        other => Err(anyccl::Error::Unsupported {
            capability: other.capability().name().unwrap_or("backend").into(),
            reason: anyccl::core::Reason::NotCompiledIn {
                what: format!("the {other} backend in the Python package"),
                detail: format!("cargo feature `{other}` of anyccl-python"),
            },
        }),
    }
}

/// A communicator over a Python bootstrap object (`rank`, `world`, `all_gather(bytes) -> list[bytes]`), such as
/// `anyccl.ProcessGroupBootstrap(group)`. Collective.
#[pyfunction]
#[pyo3(signature = (bootstrap, backend="best", device=None))]
fn from_bootstrap(py: Python<'_>, bootstrap: &Bound<'_, PyAny>, backend: &str, device: Option<i32>) -> PyResult<Comm> {
    let choice = choice_of(py, backend)?;
    let sel = selector(py)?;
    let boot = PyBootstrap::new(bootstrap)?;
    let r = py.detach(move || -> anyccl::Result<Comm> {
        let (kind, passed) = pick(choice)?;
        let (comm, boot) = over_bootstrap(Box::new(boot), kind, device, sel)?;
        Comm::new(comm, boot, passed_over_json(&passed))
    });
    r.map_err(|e| to_py(py, &e))
}

/// Length of a unique id: a version byte, the 32-byte secret, the port (2 bytes), the address length, the address.
const UID_SECRET: usize = 32;
const UID_VERSION: u8 = 1;

/// A fresh unique id: where rank 0 will listen (`addr`, `port`; 0 picks a free port now) and a random secret.
/// Move its bytes to every rank yourself, then call `from_unique_id` on each.
#[pyfunction]
#[pyo3(signature = (addr="127.0.0.1", port=0))]
fn unique_id<'py>(py: Python<'py>, addr: &str, port: u16) -> PyResult<Bound<'py, PyBytes>> {
    let ip: std::net::IpAddr =
        addr.parse().map_err(|_| invalid(py, format!("addr={addr:?}: expected an IP address")))?;
    let port = if port == 0 {
        let l = std::net::TcpListener::bind((ip, 0)).map_err(|e| {
            exception::<BackendError>(py, format!("cannot bind {ip}:0 to pick a port: {e}"), None, "backend")
        })?;
        l.local_addr().map(|a| a.port()).map_err(|e| exception::<BackendError>(py, e.to_string(), None, "backend"))?
    } else {
        port
    };
    let mut secret = [0u8; UID_SECRET];
    getrandom::fill(&mut secret)
        .map_err(|e| exception::<BackendError>(py, format!("no randomness for a unique id: {e}"), None, "backend"))?;
    let text = ip.to_string();
    let mut out = vec![UID_VERSION];
    out.extend_from_slice(&secret);
    out.extend_from_slice(&port.to_be_bytes());
    out.push(text.len() as u8); // an IP address's text is at most 45 bytes
    out.extend_from_slice(text.as_bytes());
    Ok(PyBytes::new(py, &out))
}

/// The rendezvous configuration a unique id describes for `rank` of `world`.
fn parse_uid(uid: &[u8], rank: usize, world: usize) -> Result<anyccl_rendezvous::RendezvousConfig, String> {
    let bad = |what: &str| format!("unique id: {what} (expected the bytes anyccl.unique_id() returned)");
    let (&version, rest) = uid.split_first().ok_or_else(|| bad("empty"))?;
    if version != UID_VERSION {
        return Err(bad(&format!("version {version}")));
    }
    if rest.len() < UID_SECRET + 3 {
        return Err(bad(&format!("{} bytes is too short", uid.len())));
    }
    let (secret, rest) = rest.split_at(UID_SECRET);
    let port = u16::from_be_bytes([rest[0], rest[1]]);
    let len = usize::from(rest[2]);
    let text = rest.get(3..).filter(|t| t.len() == len).ok_or_else(|| bad("address length mismatch"))?;
    let ip: std::net::IpAddr = std::str::from_utf8(text)
        .ok()
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| bad("the address is not an IP address"))?;
    Ok(anyccl_rendezvous::RendezvousConfig::new(rank, world, std::net::SocketAddr::new(ip, port))
        .with_key(anyccl_rendezvous::JobKey::from_secret(secret)))
}

/// Joins the group a unique id names as `rank` of `world` (collective: every rank calls it with the same id;
/// rank 0 listens at the id's address). `timeout` bounds the wait for the group, in seconds.
#[pyfunction]
#[pyo3(signature = (uid, rank, world, backend="best", device=None, timeout=None))]
fn from_unique_id(
    py: Python<'_>,
    uid: &[u8],
    rank: usize,
    world: usize,
    backend: &str,
    device: Option<i32>,
    timeout: Option<f64>,
) -> PyResult<Comm> {
    let choice = choice_of(py, backend)?;
    let sel = selector(py)?;
    if world == 0 || rank >= world {
        let e: anyccl::Error = if world == 0 {
            InvalidArgument::BadWorld("a communicator needs at least one rank".into()).into()
        } else {
            InvalidArgument::RankOutOfRange { what: "this", rank, world }.into()
        };
        return Err(to_py(py, &e));
    }
    let mut cfg = parse_uid(uid, rank, world).map_err(|m| invalid(py, m))?;
    if let Some(t) = timeout {
        if !(t.is_finite() && t > 0.0 && t <= 86_400.0) {
            return Err(invalid(py, format!("timeout={t}: expected seconds between 0 and 86400")));
        }
        cfg = cfg.with_timeout(std::time::Duration::from_secs_f64(t));
    }
    let r = py.detach(move || -> anyccl::Result<Comm> {
        let (kind, passed) = pick(choice)?;
        let rdv = anyccl_rendezvous::Rendezvous::establish(cfg)?;
        let (comm, boot) = over_bootstrap(Box::new(rdv), kind, device, sel)?;
        Comm::new(comm, boot, passed_over_json(&passed))
    });
    r.map_err(|e| to_py(py, &e))
}

/// Why this build has no custom CUDA kernels (`None`: they are built in): nvcc absent when the wheel was built, or
/// the CUDA backend left out.
fn cuda_kernels_not_built() -> Option<&'static str> {
    #[cfg(feature = "cuda")]
    {
        anyccl_kernels_cuda::NOT_BUILT
    }
    #[cfg(not(feature = "cuda"))]
    {
        Some("the CUDA backend is not compiled into this build (cargo feature `cuda` of anyccl-python)")
    }
}

/// The nvcc version that built the custom CUDA kernels (empty when none are built in).
fn cuda_kernels_nvcc() -> &'static str {
    #[cfg(feature = "cuda")]
    {
        anyccl_kernels_cuda::NVCC_VERSION
    }
    #[cfg(not(feature = "cuda"))]
    {
        ""
    }
}

/// Why the Python package cannot run the ROCm backend (in `backends()` and in the error of `backend="rocm"`).
const ROCM_WHY: &str = "not in the Python package yet: its wheel is built without anyccl's `rocm` feature, and its \
    device-tensor path takes CUDA memory only (torch CUDA tensors by pointer, DLPack kDLCUDA arrays; a ROCm tensor \
    is kDLROCM and needs the HIP runtime's stream and buffer types); on AMD GPUs use anyccl's Rust API or the \
    `anyccl` command (both run ROCm), or backend=\"host\" here";

/// The backends this package knows, and for each why it cannot run here (None when it can).
#[pyfunction]
fn backends(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    let disabled = anyccl::dynamic::disabled_by_env().map_err(|e| to_py(py, &e))?;
    for kind in [BackendKind::Host, BackendKind::Cuda] {
        d.set_item(kind.name(), anyccl::dynamic::unavailable(kind, 1, disabled))?;
    }
    d.set_item(BackendKind::Rocm.name(), ROCM_WHY)?;
    Ok(d)
}

/// The data types anyccl knows, by name, with their element sizes.
#[pyfunction]
fn dtypes(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for t in DataType::ALL {
        d.set_item(t.to_string(), t.size_bytes())?;
    }
    Ok(d)
}

/// The name of the all-reduce algorithm `name` names, read by core's parser (any case, `_` or `-`), or `None` when
/// it names none (the Python side then raises `AlgorithmNameError` listing the names).
#[pyfunction]
fn canonical_algorithm(name: &str) -> Option<&'static str> {
    name.parse::<Algorithm>().ok().map(Algorithm::name)
}

/// Every all-reduce algorithm's name (anyccl's `Algorithm` names), and whether it is lossy (quantized: runs
/// only when named).
#[pyfunction]
fn algorithms(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for a in Algorithm::ALL {
        d.set_item(a.name(), a.is_lossy())?;
    }
    Ok(d)
}

#[pymodule]
fn _anyccl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Comm>()?;
    m.add_function(wrap_pyfunction!(from_env, m)?)?;
    m.add_function(wrap_pyfunction!(from_bootstrap, m)?)?;
    m.add_function(wrap_pyfunction!(from_unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(backends, m)?)?;
    m.add_function(wrap_pyfunction!(dtypes, m)?)?;
    m.add_function(wrap_pyfunction!(algorithms, m)?)?;
    m.add_function(wrap_pyfunction!(canonical_algorithm, m)?)?;
    m.add_function(wrap_pyfunction!(fused::canonical_form, m)?)?;
    m.add("RMSNORM_FORMS", fused::form_names())?;
    m.add_class::<dlpack::DlpackHost>()?;
    m.add_function(wrap_pyfunction!(dlpack::dlpack_host, m)?)?;
    m.add("Error", py.get_type::<Error>())?;
    m.add("InvalidArgumentError", py.get_type::<InvalidArgumentError>())?;
    m.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    m.add("TimeoutError", py.get_type::<TimeoutError>())?;
    m.add("BackendError", py.get_type::<BackendError>())?;
    m.add("PeerFailureError", py.get_type::<PeerFailureError>())?;
    m.add("ClosedError", py.get_type::<ClosedError>())?;
    m.add("CUDA_COMPILED_IN", cfg!(feature = "cuda"))?;
    m.add("CUDA_KERNELS_NOT_BUILT", cuda_kernels_not_built())?;
    m.add("CUDA_KERNELS_NVCC", cuda_kernels_nvcc())?;
    m.add("MAX_BOOTSTRAP_BYTES", MAX_BOOTSTRAP_BYTES)?;
    Ok(())
}
