"""anyccl for Python: one communicator for GPU collectives (NCCL, custom kernels) and host collectives.

``anyccl.Communicator`` is one rank's communicator. Make it

* from the torchrun / srun environment: ``Communicator.from_env()``;
* from a unique id you move to every rank yourself: ``uid = anyccl.unique_id()`` on one process, then
  ``Communicator.from_unique_id(uid, rank, world)`` on each;
* over a torch ``ProcessGroup`` (a gloo CPU group): ``Communicator.from_process_group(group)``;
* over any object with ``rank``, ``world`` and ``all_gather(bytes) -> list[bytes]``: ``Communicator.from_bootstrap``.

Host memory is any C-contiguous object with the buffer protocol (NumPy arrays; NumPy is needed only when anyccl
allocates an output for you), or with ``__dlpack__`` (torch CPU tensors, any DLPack producer); CUDA memory is a plain
contiguous ``torch.Tensor`` on the communicator's device, or any CUDA DLPack object of that device (CuPy, JAX, ...).
Importing anyccl imports neither NumPy nor torch.

All-reduce options: ``algorithm=`` names the algorithm (``ALGORITHMS``; the quantized ``"two-shot-fp8"`` and
``"two-shot-int8"`` run only when named), and deterministic mode (``deterministic=True`` when making the
communicator, or ``comm.deterministic = True``) sums in rank order, bitwise the same run after run.

The GIL is released while a collective runs. Errors are ``anyccl.Error`` subclasses carrying anyccl's ``message``
and ``hint``.

Tensor contract (CUDA): the pointer, length, dtype, device and contiguity of every tensor are read from torch and
checked before the call; the caller keeps the tensors alive, and does not resize them or swap their storage from
another thread, until the call returns. The work is enqueued on the stream given (or torch's current stream), as
with ``torch.distributed``: using the result on another stream needs the usual stream synchronisation.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

try:
    from . import _anyccl
except ImportError as _e:  # the source tree (python/anyccl) imported instead of the installed package
    if "_anyccl" not in str(_e):
        raise
    raise ImportError(
        f"anyccl's compiled extension (anyccl._anyccl) is not next to {os.path.dirname(os.path.abspath(__file__))}: "
        "this is the uncompiled source tree, found first on sys.path (e.g. `python` or `python -m pytest` started in "
        "the repository's python/ directory). Install the package (`pip install ./python` from the repository root, "
        "or `maturin develop -m python/Cargo.toml` in a virtual environment) and run from another directory."
    ) from None
from ._anyccl import (
    CUDA_COMPILED_IN,
    CUDA_KERNELS_NOT_BUILT,
    CUDA_KERNELS_NVCC,
    BackendError,
    ClosedError,
    Error,
    InvalidArgumentError,
    PeerFailureError,
    TimeoutError,
    UnsupportedError,
)

__all__ = [
    "Communicator",
    "ProcessGroupBootstrap",
    "unique_id",
    "backends",
    "Error",
    "InvalidArgumentError",
    "UnsupportedError",
    "TimeoutError",
    "BackendError",
    "PeerFailureError",
    "ClosedError",
    "CUDA_COMPILED_IN",
    "CUDA_KERNELS_NOT_BUILT",
    "CUDA_KERNELS_NVCC",
    "capabilities",
    "DTYPES",
    "REDUCE_OPS",
    "ALGORITHMS",
    "RMSNORM_FORMS",
    "AlgorithmNameError",
]

__version__ = "0.1.0"

#: anyccl's data types by name, with their element sizes in bytes.
DTYPES: Dict[str, int] = dict(_anyccl.dtypes())

#: The reduction operators.
REDUCE_OPS = ("sum", "prod", "min", "max", "avg")

#: anyccl's all-reduce algorithms by name, each with whether it is lossy (quantized: it runs only when named).
ALGORITHMS: Dict[str, bool] = dict(_anyccl.algorithms())


class AlgorithmNameError(InvalidArgumentError, ValueError):
    """``algorithm=`` (or a fused call's ``form=``) named nothing anyccl has (a ``ValueError`` and an
    ``anyccl.InvalidArgumentError``); the message lists the names."""


#: The forms of the fused all-reduce + residual add + RMSNorm (``Communicator.all_reduce_rmsnorm``).
RMSNORM_FORMS: Tuple[str, ...] = tuple(_anyccl.RMSNORM_FORMS)


def _bad_name(what: str, value: Any, names: Any) -> AlgorithmNameError:
    message = f"{what}={value!r}: expected one of {', '.join(names)}"
    err = AlgorithmNameError(message)
    err.message, err.hint, err.kind = message, None, "invalid-argument"
    return err


def _canon_form(form: Optional[str]) -> Optional[str]:
    """The canonical name of a fused form as anyccl's own parser reads it (any case, ``_`` or ``-``; ``one-shot``,
    ``two-shot`` and ``push`` name the fused ones), or ``AlgorithmNameError`` listing the names."""
    if form is None:
        return None
    name = _anyccl.canonical_form(str(form))
    if name is None:
        raise _bad_name("form", form, RMSNORM_FORMS)
    return name


def _canon_algorithm(algorithm: Optional[str]) -> Optional[str]:
    """The canonical name of ``algorithm`` as anyccl's own parser reads it (any case, ``_`` or ``-``), or
    ``AlgorithmNameError`` listing the names."""
    if algorithm is None:
        return None
    name = _anyccl.canonical_algorithm(str(algorithm))
    if name is None:
        raise _bad_name("algorithm", algorithm, ALGORITHMS)
    return name

# Buffer-protocol formats (struct codes, native order) → anyccl data types.
_FORMATS = {
    ("b", 1): "i8",
    ("B", 1): "u8",
    ("c", 1): "u8",
    ("?", 1): "u8",
    ("e", 2): "f16",
    ("f", 4): "f32",
    ("d", 8): "f64",
}
for _code in ("i", "l", "q"):
    _FORMATS[(_code, 4)] = "i32"
    _FORMATS[(_code, 8)] = "i64"
for _code in ("I", "L", "Q"):
    _FORMATS[(_code, 4)] = "u32"
    _FORMATS[(_code, 8)] = "u64"

# NumPy dtype names → anyccl names (for outputs anyccl allocates, and for arrays whose format is exotic).
_NUMPY_NAMES = {
    "int8": "i8",
    "uint8": "u8",
    "int32": "i32",
    "uint32": "u32",
    "int64": "i64",
    "uint64": "u64",
    "float16": "f16",
    "bfloat16": "bf16",
    "float32": "f32",
    "float64": "f64",
    "float8_e4m3fn": "fp8e4m3",
    "float8_e5m2": "fp8e5m2",
}

_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "send", "recv")


def _ensure_nccl_path(backend: str) -> None:
    """Points anyccl at the NCCL that PyTorch's wheels install (``site-packages/nvidia/nccl/lib/libnccl.so.2``,
    the library torch itself uses) when ``ANYCCL_NCCL_PATH`` is not set, so both share one NCCL. Searches
    ``sys.path`` only (absolute directories); anyccl's own search applies when nothing is found."""
    if backend not in ("best", "auto", "cuda") or os.environ.get("ANYCCL_NCCL_PATH"):
        return
    for entry in sys.path:
        if not entry or not os.path.isabs(entry):
            continue
        candidate = os.path.join(entry, "nvidia", "nccl", "lib", "libnccl.so.2")
        if os.path.isfile(candidate):
            os.environ["ANYCCL_NCCL_PATH"] = candidate
            return


def _check_launched() -> None:
    """``from_env`` outside a launcher (neither torchrun's nor srun's variables set): an error that says how to launch,
    rather than the rendezvous' "WORLD_SIZE: not set". There is no silent world of 1: a process of a misconfigured
    job would then compute alone and return wrong results without an error."""
    if any(os.environ.get(v) for v in ("WORLD_SIZE", "SLURM_NTASKS", "RANK", "SLURM_PROCID")):
        return
    message = (
        "Communicator.from_env(): this process was not started by a launcher (neither WORLD_SIZE and RANK, as torchrun "
        "sets them, nor srun's SLURM_NTASKS and SLURM_PROCID are set)"
    )
    hint = (
        "start it with `torchrun --nproc-per-node 2 script.py` (or srun), or set RANK, WORLD_SIZE, MASTER_ADDR and "
        "MASTER_PORT yourself (RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 for one process); "
        "without a launcher use Communicator.from_unique_id(anyccl.unique_id(), rank, world)"
    )
    err = InvalidArgumentError(f"{message}\nhint: {hint}")
    err.message, err.hint, err.kind = message, hint, "config"
    raise err


def _is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_cuda_dlpack(x: Any) -> bool:
    """Whether ``x`` is a DLPack object other than a torch tensor whose ``__dlpack_device__`` says CUDA (kDLCUDA)."""
    if _is_torch_tensor(x):
        return False
    device = getattr(x, "__dlpack_device__", None)
    if device is None:
        return False
    try:
        return int(device()[0]) == 2
    except Exception:
        return False


def _canon_dtype(dtype: Optional[str]) -> Optional[str]:
    if dtype is None:
        return None
    name = str(dtype).lower().replace("torch.", "").replace("numpy.", "")
    name = _NUMPY_NAMES.get(name, name)
    if name not in DTYPES:
        raise InvalidArgumentError(f"dtype={dtype!r}: expected one of {', '.join(sorted(DTYPES))}")
    return name


_TORCH_OP_NAMES = (("SUM", "sum"), ("PRODUCT", "prod"), ("MIN", "min"), ("MAX", "max"), ("AVG", "avg"))


def _op_name(op: Any) -> str:
    """``op`` as anyccl names it: a name ("sum", "prod", "min", "max", "avg") or a ``torch.distributed.ReduceOp``
    of one of them (``ReduceOp.SUM`` ...); anything else raises ``InvalidArgumentError`` (a ``ValueError``)."""
    if isinstance(op, str):
        return op
    torch = sys.modules.get("torch")
    reduce_op = getattr(getattr(torch, "distributed", None), "ReduceOp", None) if torch is not None else None
    if reduce_op is not None:
        for member, name in _TORCH_OP_NAMES:
            try:
                if op == getattr(reduce_op, member):
                    return name
            except Exception:  # an object torch's enum cannot compare with
                break
    message = f"op={op!r}: expected one of {', '.join(REDUCE_OPS)} or the torch.distributed.ReduceOp of one of them"
    err = _OpError(message)
    err.message, err.hint, err.kind = message, None, "invalid-argument"
    raise err


class _OpError(InvalidArgumentError, ValueError):
    """An ``op`` anyccl has no reduction for (a ``ValueError`` and an ``anyccl.InvalidArgumentError``)."""


class _HostBuf:
    """One host buffer, checked: its bytes (a buffer-protocol view, or a DLPack array held by anyccl), anyccl data
    type and element count."""

    __slots__ = ("obj", "view", "dl", "dtype", "elems", "nbytes")
    view: Optional[memoryview]
    dl: Any
    dtype: str
    elems: int
    nbytes: int

    def __init__(self, obj: Any, which: str, dtype: Optional[str], writable: bool) -> None:
        self.dl = None
        if _is_torch_tensor(obj):
            if obj.is_cuda:
                raise InvalidArgumentError(
                    f"{which}: a CUDA tensor ({obj.device}) cannot join host buffers in one call, and needs a CUDA "
                    "communicator"
                )
            obj = obj.detach()
            if hasattr(obj, "__dlpack__"):
                self._init_dlpack(obj, which, dtype, writable)
                return
            name = _NUMPY_NAMES.get(str(obj.dtype).replace("torch.", ""))
            if name in ("bf16", "fp8e4m3", "fp8e5m2"):
                # NumPy has no such type: the same bytes as integers of that size, read as `name` by anyccl.
                import torch  # type: ignore[import-not-found, unused-ignore]

                if dtype is None:
                    dtype = name
                obj = obj.detach().view(torch.int16 if name == "bf16" else torch.uint8)
            obj = obj.detach().numpy()
        try:
            view = memoryview(obj)
        except TypeError as e:
            if hasattr(obj, "__dlpack__"):
                self._init_dlpack(obj, which, dtype, writable)
                return
            raise InvalidArgumentError(
                f"{which}: expected a NumPy array or another object with the buffer protocol or __dlpack__, got "
                f"{type(obj).__name__}"
            ) from e
        if not view.c_contiguous:
            raise InvalidArgumentError(f"{which}: the buffer is not C-contiguous (pass a contiguous array)")
        if writable and view.readonly:
            raise InvalidArgumentError(f"{which}: the buffer is read-only, and this call writes into it")
        fmt = view.format.lstrip("@=<")
        native = _FORMATS.get((fmt, view.itemsize))
        if native is None:
            np_name = getattr(getattr(obj, "dtype", None), "name", None)
            native = _NUMPY_NAMES.get(np_name) if np_name else None
        if dtype is None:
            if native is None:
                raise InvalidArgumentError(
                    f"{which}: element format {view.format!r} ({view.itemsize} bytes) has no anyccl data type; "
                    "pass dtype= (e.g. 'bf16') with a buffer of that element size or of bytes"
                )
            dtype = native
        elif native is not None and native != dtype and view.itemsize != 1:
            raise InvalidArgumentError(f"{which}: dtype {dtype} was asked for, but the buffer holds {native}")
        size = DTYPES[dtype]
        if view.itemsize not in (1, size):
            raise InvalidArgumentError(
                f"{which}: dtype {dtype} has {size}-byte elements but the buffer's are {view.itemsize} bytes"
            )
        if view.nbytes % size:
            raise InvalidArgumentError(f"{which}: {view.nbytes} bytes is not a whole number of {dtype} elements")
        self.obj = obj
        self.view = view.cast("B") if view.ndim != 1 or view.format != "B" else view
        self.dtype = dtype
        self.elems = view.nbytes // size
        self.nbytes = view.nbytes

    def _init_dlpack(self, obj: Any, which: str, dtype: Optional[str], writable: bool) -> None:
        """Through DLPack: anyccl takes and checks the array (TypeError / ValueError when it cannot) and holds it."""
        dl = _anyccl.dlpack_host(obj, which)
        native: str = dl.dtype
        if writable and dl.readonly:
            raise InvalidArgumentError(f"{which}: the array is read-only, and this call writes into it")
        if dtype is None:
            dtype = native
        elif dtype != native and DTYPES[native] != 1:
            raise InvalidArgumentError(f"{which}: dtype {dtype} was asked for, but the array holds {native}")
        size = DTYPES[dtype]
        if dl.nbytes % size:
            raise InvalidArgumentError(f"{which}: {dl.nbytes} bytes is not a whole number of {dtype} elements")
        self.obj, self.view, self.dl = obj, None, dl
        self.dtype = dtype
        self.elems = dl.nbytes // size
        self.nbytes = dl.nbytes

    def mem(self) -> Any:
        """What the extension reads and writes in place: the buffer-protocol view, or the DLPack array."""
        return self.view if self.view is not None else self.dl

    def tobytes(self) -> bytes:
        if self.view is not None:
            return self.view.tobytes()
        return bytes(self.dl.tobytes())

    def write(self, data: bytes) -> None:
        if self.view is None:
            self.dl.write(data)
            return
        n = min(len(data), self.view.nbytes)
        self.view[:n] = memoryview(data)[:n]


def _new_like(x: Any, elems: int) -> Any:
    """A new 1-D array of `elems` elements of `x`'s type: a torch tensor for a tensor, else a NumPy array."""
    if _is_torch_tensor(x):
        import torch  # type: ignore[import-not-found, unused-ignore]

        return torch.empty(elems, dtype=x.dtype, device=x.device)
    try:
        import numpy as np
    except ImportError as e:
        raise InvalidArgumentError(
            "out= is needed: anyccl allocates outputs as NumPy arrays, and NumPy is not installed"
        ) from e
    try:
        memoryview(x)
    except TypeError:
        if hasattr(x, "__dlpack__"):
            return np.empty(elems, dtype=np.from_dlpack(x).dtype)
    return np.empty(elems, dtype=np.asarray(x).dtype)


class Communicator:
    """One rank's communicator.

    Every collective takes host buffers (NumPy arrays, buffer-protocol objects, CPU tensors) or CUDA tensors, and
    runs in place when ``out`` is not given (``all_reduce``, ``broadcast``, ``reduce``: on the buffer; ``all_gather``
    and ``reduce_scatter`` with ``in_place=True``: NCCL's layout, the buffer holds ``world`` parts and this rank's
    part is part ``rank``), or out of place into ``out`` (allocated when ``None`` for all_gather / reduce_scatter).
    Use it as a context manager to close it on exit.
    """

    def __init__(self, _comm: Any, deterministic: Optional[bool] = None) -> None:
        """Internal: use ``from_env``, ``from_unique_id``, ``from_process_group`` or ``from_bootstrap``."""
        if not isinstance(_comm, _anyccl._Comm):
            raise InvalidArgumentError(
                "make a Communicator with Communicator.from_env(), from_unique_id(), from_process_group() or "
                "from_bootstrap()"
            )
        self._comm = _comm
        self.rank: int = _comm.rank
        self.world_size: int = _comm.world_size
        self.backend: str = _comm.backend
        self.device: str = _comm.device
        #: The CUDA device ordinal, or -1 when the communicator is not on CUDA.
        self.device_index: int = _comm.device_index
        #: The backends passed over, each with the reason.
        self.passed_over: List[Dict[str, str]] = json.loads(_comm.passed_over)
        self._cuda = CUDA_COMPILED_IN and self.device_index >= 0
        if deterministic is not None:
            _comm.set_deterministic(bool(deterministic))

    # ---- construction -------------------------------------------------------------------------------------------

    @classmethod
    def from_env(cls, backend: str = "best", *, deterministic: Optional[bool] = None) -> "Communicator":
        """Joins the job started by torchrun or srun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), on
        ``backend``: "best" (CUDA when a GPU and NCCL are present, else host), "cuda" or "host". anyccl's own
        authenticated rendezvous listens on MASTER_PORT + 1 (or ANYCCL_MASTER_PORT); set ANYCCL_RENDEZVOUS_KEY
        unless MASTER_ADDR is a loopback address. ``deterministic``: see ``Communicator.deterministic`` (None: the
        ``ANYCCL_DETERMINISTIC`` setting)."""
        _check_launched()
        _ensure_nccl_path(backend)
        return cls(_anyccl.from_env(backend), deterministic)

    @classmethod
    def from_unique_id(
        cls,
        uid: bytes,
        rank: int,
        world_size: int,
        backend: str = "best",
        device: Optional[int] = None,
        timeout: Optional[float] = None,
        *,
        deterministic: Optional[bool] = None,
    ) -> "Communicator":
        """Joins the group named by ``uid`` (from ``anyccl.unique_id()`` on one process, moved to every rank by
        you) as ``rank`` of ``world_size``. Collective. ``timeout`` (seconds) bounds the wait for the group."""
        _ensure_nccl_path(backend)
        return cls(_anyccl.from_unique_id(bytes(uid), rank, world_size, backend, device, timeout), deterministic)

    @classmethod
    def from_bootstrap(
        cls,
        bootstrap: Any,
        backend: str = "best",
        device: Optional[int] = None,
        *,
        deterministic: Optional[bool] = None,
    ) -> "Communicator":
        """A communicator over ``bootstrap``: any object with ``rank``, ``world`` and ``all_gather(bytes) ->
        list[bytes]`` (one entry per rank, each at most ``anyccl.MAX_BOOTSTRAP_BYTES``). Collective. The bootstrap
        is kept for graph-buffer registration (``capture()``)."""
        _ensure_nccl_path(backend)
        return cls(_anyccl.from_bootstrap(bootstrap, backend, device), deterministic)

    @classmethod
    def from_process_group(
        cls,
        group: Any = None,
        backend: str = "best",
        device: Optional[int] = None,
        *,
        deterministic: Optional[bool] = None,
    ) -> "Communicator":
        """A communicator over a torch ``ProcessGroup`` (a gloo CPU group is best: the bootstrap moves small byte
        strings; ``None`` is the default group). Collective over the group. On CUDA the device defaults to
        ``torch.cuda.current_device()``."""
        if device is None and backend != "host":
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_available():
                device = torch.cuda.current_device()
        return cls.from_bootstrap(ProcessGroupBootstrap(group), backend, device, deterministic=deterministic)

    # ---- lifetime -----------------------------------------------------------------------------------------------

    def close(self, timeout: Optional[float] = None) -> None:
        """Tears the rank down (idempotent); every later call raises ``ClosedError``."""
        self._comm.close(timeout)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return bool(self._comm.closed())

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<anyccl.Communicator rank {self.rank} of {self.world_size} on {self.device} ({self.backend}, {state})>"

    # ---- queries ------------------------------------------------------------------------------------------------

    def capabilities(self) -> Dict[str, Any]:
        """The backend, device, library, algorithms and every capability with the reason it is off, as a dict."""
        caps: Dict[str, Any] = json.loads(self._comm.capabilities_json())
        return caps

    @property
    def last_selection(self) -> Optional[Dict[str, Any]]:
        """The last all-reduce's algorithm and the rule that chose it (``{"algorithm": ..., "why": ...}``)."""
        s = self._comm.last_selection_json()
        return None if s is None else json.loads(s)

    def select_all_reduce(
        self, count: int, dtype: str, op: str = "sum", in_place: bool = True, *, algorithm: Optional[str] = None
    ) -> Dict[str, Any]:
        """The algorithm an all-reduce of this shape would use now, without running it. With ``algorithm``,
        whether that one could run it: the same dict, or ``UnsupportedError`` saying why not."""
        name = _canon_dtype(dtype) or "u8"  # not None: dtype is required
        algo = _canon_algorithm(algorithm)
        sel: Dict[str, Any] = json.loads(self._comm.select_all_reduce(count, name, op, in_place, algo))
        return sel

    @property
    def deterministic(self) -> bool:
        """Deterministic mode: every all-reduce sums in rank order 0..W-1 with one-shot or two-shot, bitwise the
        same run after run and across message sizes; algorithms that cannot promise it (NCCL's, NVLS, ring, the
        quantized ones) are skipped, and a call none can run raises ``UnsupportedError`` with the reasons. Every rank
        must use the same setting. The default is ``ANYCCL_DETERMINISTIC``."""
        return bool(self._comm.deterministic())

    @deterministic.setter
    def deterministic(self, on: bool) -> None:
        self._comm.set_deterministic(bool(on))

    def set_deterministic(self, on: bool = True) -> None:
        """Turns deterministic mode on or off (``Communicator.deterministic``); every rank the same."""
        self._comm.set_deterministic(bool(on))

    def should_all_reduce(self, tensor: Any, *, algorithm: Optional[str] = None) -> bool:
        """Whether ``all_reduce`` takes ``tensor`` here (vLLM's predicate): on CUDA, a plain contiguous tensor on
        this device of a supported dtype with an eligible algorithm (``algorithm``: that one); on the host, a host
        buffer anyccl can read."""
        algo = _canon_algorithm(algorithm)
        if self.device_index >= 0 and CUDA_COMPILED_IN:
            return bool(self._comm.cuda_should_all_reduce(tensor, algo))
        if self.closed:
            return False
        try:
            buf = _HostBuf(tensor, "tensor", None, True)
        except (Error, TypeError, ValueError):
            return False
        if algo is not None:
            try:
                self._comm.select_all_reduce(buf.elems, buf.dtype, "sum", True, algo)
            except Error:
                return False
        return buf.elems > 0

    def barrier(self) -> None:
        """Returns once every rank has called it."""
        self._comm.barrier()

    # ---- collectives --------------------------------------------------------------------------------------------

    def _run(
        self,
        coll: str,
        x: Any,
        out: Any,
        op: Any = "sum",
        peer: int = 0,
        dtype: Optional[str] = None,
        stream: Any = None,
        algorithm: Optional[str] = None,
    ) -> Any:
        op = _op_name(op)
        # The CUDA path first (one call into Rust, which checks the tensors); False: not a CUDA tensor.
        if self._cuda and self._comm.cuda_collective(coll, x, out, op, peer, stream, algorithm):
            return x if out is None else out
        if _is_torch_tensor(x) and x.is_cuda:
            raise InvalidArgumentError(
                f"a CUDA tensor on {x.device} needs a CUDA communicator; this one runs on {self.backend}"
                + ("" if CUDA_COMPILED_IN else " (this wheel was built without the CUDA backend)")
            )
        dtype = _canon_dtype(dtype)
        writes_send = out is None and coll != "send"
        send = _HostBuf(x, "buffer" if out is None else "send", dtype, writes_send)
        recv = None if out is None else _HostBuf(out, "recv", dtype or send.dtype, True)
        if recv is not None and recv.dtype != send.dtype:
            raise InvalidArgumentError(f"send is {send.dtype} but recv is {recv.dtype}")
        world = self.world_size
        if coll == "reduce_scatter":
            if recv is not None:
                count = recv.elems
            else:
                if send.elems % world:
                    raise InvalidArgumentError(f"buffer: {send.elems} elements do not split into {world} parts")
                count = send.elems // world
        elif coll == "all_gather" and recv is None:
            if send.elems % world:
                raise InvalidArgumentError(f"buffer: {send.elems} elements do not split into {world} parts")
            count = send.elems // world
        else:
            count = send.elems
        # The arrays' memory itself (a buffer export or the DLPack array): read and written in place, no copy.
        self._comm.host_collective(
            coll, send.mem(), None if recv is None else recv.mem(), send.dtype, count, op, peer, algorithm
        )
        return x if out is None else out

    def all_reduce(
        self,
        x: Any,
        out: Any = None,
        op: Any = "sum",
        *,
        dtype: Optional[str] = None,
        stream: Any = None,
        algorithm: Optional[str] = None,
    ) -> Any:
        """Reduces ``x`` over every rank with ``op`` ("sum", "prod", "min", "max", "avg", or the
        ``torch.distributed.ReduceOp`` of one of them): into ``x`` (returned)
        when ``out`` is None, else into ``out`` (returned). ``stream``: a ``torch.cuda.Stream`` (default: the
        current stream; a DLPack array that is not a torch tensor is made ready on, and run on, the legacy default
        stream and waited for). ``dtype`` reads a host buffer of bytes as that type (e.g. "bf16").

        ``algorithm`` names the algorithm (a key of ``anyccl.ALGORITHMS``: "one-shot", "two-shot", "ccl",
        "two-shot-fp8", "two-shot-int8", ...) instead of the selector's choice: an unknown name raises
        ``AlgorithmNameError`` (a ``ValueError``) listing the names; one that cannot run this call here (or is not
        deterministic in deterministic mode) raises ``UnsupportedError`` with the reason. The quantized algorithms
        are lossy (fp8 / int8 codes with one scale per 32 elements, summed in f32) and run only when named."""
        algo = None if algorithm is None else _canon_algorithm(algorithm)
        if op.__class__ is not str:
            op = _op_name(op)
        if self._cuda:
            if self._comm.cuda_collective("all_reduce", x, out, op, 0, stream, algo):
                return x if out is None else out
        elif dtype is None:
            # Plain contiguous CPU tensors (read through data_ptr()) and host arrays with the buffer protocol and a
            # type anyccl reads from it (NumPy's): one call, no checks in Python (anything else, or anything wrong,
            # goes the general way below, which says why).
            if self._comm.host_all_reduce_fast(x, out, op, algo):
                return x if out is None else out
        return self._run("all_reduce", x, out, op, 0, dtype, stream, algo)

    def all_gather(
        self, x: Any, out: Any = None, *, in_place: bool = False, dtype: Optional[str] = None, stream: Any = None
    ) -> Any:
        """Every rank's ``x`` concatenated in rank order into ``out`` (allocated, 1-D, when None). With
        ``in_place=True``, ``x`` holds ``world`` parts, this rank's at part ``rank``, and is filled in."""
        if in_place:
            return self._run("all_gather", x, None, "sum", 0, dtype, stream)
        if out is None:
            out = _new_like(x, self._numel(x) * self.world_size)
        return self._run("all_gather", x, out, "sum", 0, dtype, stream)

    def reduce_scatter(
        self,
        x: Any,
        out: Any = None,
        op: Any = "sum",
        *,
        in_place: bool = False,
        dtype: Optional[str] = None,
        stream: Any = None,
    ) -> Any:
        """``x`` (``world`` equal parts) reduced over every rank; this rank gets part ``rank`` in ``out`` (allocated
        when None). With ``in_place=True`` the result is left in part ``rank`` of ``x``."""
        if in_place:
            return self._run("reduce_scatter", x, None, op, 0, dtype, stream)
        if out is None:
            n = self._numel(x)
            if n % self.world_size:
                raise InvalidArgumentError(f"x: {n} elements do not split into {self.world_size} parts")
            out = _new_like(x, n // self.world_size)
        return self._run("reduce_scatter", x, out, op, 0, dtype, stream)

    def broadcast(self, x: Any, root: int = 0, out: Any = None, *, dtype: Optional[str] = None, stream: Any = None) -> Any:
        """``root``'s ``x`` on every rank: into ``x`` (in place) or ``out``."""
        return self._run("broadcast", x, out, "sum", root, dtype, stream)

    def reduce(
        self, x: Any, root: int = 0, out: Any = None, op: Any = "sum", *, dtype: Optional[str] = None, stream: Any = None
    ) -> Any:
        """``x`` reduced over every rank with ``op`` into ``root``'s ``x`` (in place) or ``out``."""
        return self._run("reduce", x, out, op, root, dtype, stream)

    def send(self, x: Any, peer: int, *, dtype: Optional[str] = None, stream: Any = None) -> None:
        """Sends ``x`` to rank ``peer`` (which calls ``recv``)."""
        self._run("send", x, None, "sum", peer, dtype, stream)

    def recv(self, x: Any, peer: int, *, dtype: Optional[str] = None, stream: Any = None) -> Any:
        """Receives into ``x`` from rank ``peer``; returns ``x``."""
        return self._run("recv", x, None, "sum", peer, dtype, stream)

    def p2p(self, ops: Sequence[Tuple[str, Any, int]], *, dtype: Optional[str] = None, stream: Any = None) -> None:
        """A group of sends and receives that completes as one (NCCL's grouped point-to-point): ``ops`` are
        ``("send" | "recv", x, peer)``, receives written into their ``x``. On host memory it is one grouped call: every
        rank's group pairs with its peers' whatever the order of the operations in it. CUDA tensors (or CUDA DLPack
        objects) go to NCCL as one group (``ncclGroupStart``, the sends and receives, ``ncclGroupEnd``) on
        ``stream``, which pairs with the peers' groups in the same way."""
        kinds = []
        for kind, x, peer in ops:
            if kind not in ("send", "recv"):
                raise InvalidArgumentError(f"p2p: operation {kind!r}: expected 'send' or 'recv'")
            kinds.append((kind == "send", x, int(peer)))
        if self._cuda and any(_is_torch_tensor(x) and x.is_cuda or _is_cuda_dlpack(x) for _, x, _ in kinds):
            self._comm.cuda_p2p(kinds, stream)
            return
        canon = _canon_dtype(dtype)
        batch = []
        for is_send, x, peer in kinds:
            buf = _HostBuf(x, "send" if is_send else "recv", canon, not is_send)
            batch.append((is_send, buf.mem(), buf.dtype, buf.elems, peer))
        self._comm.host_p2p(batch)

    # ---- fused all-reduce + residual add + RMSNorm ---------------------------------------------------------------

    def all_reduce_rmsnorm(
        self,
        input: Any,
        residual: Any,
        weight: Any,
        out: Any = None,
        *,
        eps: float = 1e-6,
        form: Optional[str] = None,
        fp8_scale: Optional[float] = None,
        dtype: Optional[str] = None,
        stream: Any = None,
    ) -> Any:
        """The tensor-parallel all-reduce, the residual add and the RMSNorm in one call (collective):
        ``residual <- all_reduce(input) + residual`` (in place; the same on every rank before and after) and
        ``out <- rmsnorm(residual) * weight``, i.e. ``r / sqrt(mean(r**2) + eps) * weight`` per row, in f32.

        ``input`` and ``residual`` hold tokens x hidden elements of f16 or bf16, ``weight`` hidden (a multiple of 8,
        at most 16384); ``out`` (allocated like ``input`` when None, returned) the same shape in the input's type,
        or fp8 e4m3 codes of ``y / fp8_scale`` with ``fp8_scale`` (a ``torch.float8_e4m3fn`` tensor or a uint8
        array). ``form`` forces ``"fused-one-shot"``, ``"fused-two-shot"``, ``"fused-push"`` (CUDA communicators with
        the push one-shot set up; the host refuses it) or ``"unfused"`` (read as anyccl reads them: any case,
        ``_`` or ``-``, and ``"one-shot"``, ``"two-shot"``, ``"push"`` name the fused forms; an unknown name raises
        ``AlgorithmNameError``; one that cannot run the call, ``UnsupportedError``); all forms give the same bits.
        ``last_rmsnorm_selection`` says which form ran and why. CUDA tensors run on ``stream`` (default: torch's
        current stream); host arrays anywhere else. Nothing is written on an error."""
        form = _canon_form(form)
        fp8 = fp8_scale is not None
        if out is None:
            out = self._new_rmsnorm_out(input, fp8)
        scale = None if fp8_scale is None else float(fp8_scale)
        if self._cuda and self._comm.cuda_rmsnorm(input, residual, weight, out, float(eps), form, scale, stream):
            return out
        if _is_torch_tensor(input) and input.is_cuda:
            raise InvalidArgumentError(
                f"a CUDA tensor on {input.device} needs a CUDA communicator; this one runs on {self.backend}"
            )
        dtype = _canon_dtype(dtype)
        inp = _HostBuf(input, "input", dtype, False)
        res = _HostBuf(residual, "residual", inp.dtype, True)
        w = _HostBuf(weight, "weight", inp.dtype, False)
        o = _HostBuf(out, "out", "fp8e4m3" if fp8 else inp.dtype, True)
        hidden = w.elems
        if hidden == 0 or inp.elems % hidden:
            raise InvalidArgumentError(f"input: {inp.elems} elements are not rows of weight's {hidden}")
        tokens = inp.elems // hidden
        need = tokens * hidden * (1 if fp8 else DTYPES[inp.dtype])
        if o.nbytes < need:
            raise InvalidArgumentError(f"out: holds {o.nbytes} bytes, the call needs {need}")
        new_residual, result = self._comm.host_rmsnorm(
            inp.tobytes(), res.tobytes(), w.tobytes(), inp.dtype, tokens, hidden, float(eps), form, scale
        )
        res.write(new_residual)
        o.write(result)
        return out

    @property
    def last_rmsnorm_selection(self) -> Optional[Dict[str, Any]]:
        """The last ``all_reduce_rmsnorm``'s form and the rule that chose it (``{"form": ..., "why": ...}``)."""
        s = self._comm.last_rmsnorm_json()
        return None if s is None else json.loads(s)

    @staticmethod
    def _new_rmsnorm_out(x: Any, fp8: bool) -> Any:
        """An output like ``x`` (its shape; its type, or fp8 e4m3 codes)."""
        if _is_torch_tensor(x):
            import torch  # type: ignore[import-not-found, unused-ignore]

            if fp8:
                return torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
            return torch.empty_like(x, memory_format=torch.contiguous_format)
        try:
            import numpy as np
        except ImportError as e:
            raise InvalidArgumentError(
                "out= is needed: anyccl allocates outputs as NumPy arrays, and NumPy is not installed"
            ) from e
        try:
            memoryview(x)
        except TypeError:
            if hasattr(x, "__dlpack__"):
                x = np.from_dlpack(x)
        a = np.asarray(x)
        return np.empty(a.shape, dtype=np.uint8 if fp8 else a.dtype)

    # ---- CUDA graphs --------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def capture(self) -> Iterator["Communicator"]:
        """Wrap the code that captures CUDA graphs (``torch.cuda.graph``): on a clean exit the inputs of every
        collective captured are registered with the custom kernels on every rank (collective), before the first
        replay. Replays before registration are correct, just slower."""
        yield self
        self.register_graph_buffers()

    def register_graph_buffers(self) -> Dict[str, int]:
        """Registers the captured collectives' inputs now (collective); returns the counts."""
        registered, kept = self._comm.register_graph_buffers()
        return {"registered": registered, "kept_staged": kept}

    @property
    def pending_graph_buffers(self) -> int:
        """Inputs of captured collectives not registered yet."""
        return int(self._comm.pending_graph_buffers())

    @staticmethod
    def _numel(x: Any) -> int:
        if _is_torch_tensor(x):
            return int(x.numel())
        size = getattr(x, "size", None)
        if isinstance(size, int):
            return size
        try:
            view = memoryview(x)
        except TypeError:
            if hasattr(x, "__dlpack__"):
                return int(_anyccl.dlpack_host(x, "x").elems)
            raise
        return view.nbytes // max(view.itemsize, 1)


class ProcessGroupBootstrap:
    """anyccl's bootstrap over a torch ``ProcessGroup``: ``all_gather(bytes)`` as two ``torch.distributed.all_gather``
    calls on CPU tensors, the lengths then the bytes (use a gloo CPU group: it moves a few small byte strings). No
    pickles: ``all_gather_object`` unpickles what peers send, and fails with gloo under ``torch.inference_mode``."""

    def __init__(self, group: Any = None) -> None:
        import torch  # type: ignore[import-not-found, unused-ignore]
        import torch.distributed as dist  # type: ignore[import-not-found, unused-ignore]

        self._torch = torch
        self._dist = dist
        self.group = group
        self.rank: int = dist.get_rank(group)
        self.world: int = dist.get_world_size(group)

    def all_gather(self, mine: bytes) -> List[bytes]:
        """Every rank's ``mine``, by rank."""
        torch, dist = self._torch, self._dist
        mine = bytes(mine)
        with torch.inference_mode(False):
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
            dist.all_gather(sizes, torch.tensor([len(mine)], dtype=torch.int64), group=self.group)
            lengths = [int(t.item()) for t in sizes]
            width = max(max(lengths), 1)
            padded = torch.zeros(width, dtype=torch.uint8)
            if mine:
                padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
            parts = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world)]
            dist.all_gather(parts, padded, group=self.group)
        return [bytes(p[:n].tolist()) for p, n in zip(parts, lengths)]


def unique_id(addr: str = "127.0.0.1", port: int = 0) -> bytes:
    """A fresh unique id: rank 0 will listen at ``addr``:``port`` (0: a free port picked now), and a random secret
    every rank proves it holds. Move it to every rank yourself (a file, an environment variable, your store) and
    call ``Communicator.from_unique_id`` on each. Treat it as a secret."""
    return bytes(_anyccl.unique_id(addr, port))


def capabilities() -> Dict[str, Any]:
    """What this build of the package holds, before any communicator is made: ``cuda_backend`` (the CUDA backend is
    compiled in), ``cuda_kernels`` (anyccl's custom CUDA kernels are built in: nvcc was found when the wheel was
    built), ``cuda_kernels_missing`` (why they are not, else None: without them a CUDA communicator runs NCCL's
    algorithms only), ``nvcc`` (the nvcc that built them), and ``backends`` (``anyccl.backends()``).
    ``Communicator.capabilities()`` reports a communicator's capabilities on its device."""
    return {
        "version": __version__,
        "cuda_backend": bool(CUDA_COMPILED_IN),
        "cuda_kernels": CUDA_KERNELS_NOT_BUILT is None,
        "cuda_kernels_missing": CUDA_KERNELS_NOT_BUILT,
        "nvcc": CUDA_KERNELS_NVCC or None,
        "backends": backends(),
    }


def backends() -> Dict[str, Optional[str]]:
    """Each backend of this build and why it cannot run here (None when it can)."""
    return dict(_anyccl.backends())


MAX_BOOTSTRAP_BYTES: int = _anyccl.MAX_BOOTSTRAP_BYTES
