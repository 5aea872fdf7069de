"""anyccl's all-reduce as torch custom ops, so ``torch.compile`` graphs and CUDA graphs keep working.

Importing this module imports torch and registers (once per process):

* ``torch.ops.anyccl.all_reduce(x, handle, op, algorithm) -> Tensor`` — out of place (a new tensor);
  compile-friendly;
* ``torch.ops.anyccl.all_reduce_(x, handle, op, algorithm) -> None`` — in place on ``x`` (declared as mutating
  ``x``).

* ``torch.ops.anyccl.all_reduce_rmsnorm(x, residual, weight, handle, eps, form, fp8_scale) -> Tensor`` — the fused
  all-reduce + residual add + RMSNorm (``Communicator.all_reduce_rmsnorm``): ``residual`` is updated in place
  (declared as mutated), the normalised output is a new tensor (``x``'s type, or ``float8_e4m3fn`` with
  ``fp8_scale``).

``op`` defaults to ``"sum"``; ``algorithm`` (default ``None``: the selector's choice) names the algorithm, e.g.
``"two-shot-fp8"`` for the quantized all-reduce (see ``Communicator.all_reduce``).

``handle`` is the integer ``register(comm)`` returns (a custom op takes tensors and plain values, not Python
objects). Both ops have fake (meta) implementations, so tracing needs no communication. Inside ``torch.cuda.graph``
the real implementation runs once, during capture, and enqueues on the capturing stream; wrap the capture in
``comm.capture()`` to register the graph buffers afterwards.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Dict, Optional

import torch  # type: ignore[import-not-found, unused-ignore]

from . import Communicator, InvalidArgumentError

_COMMS: Dict[int, Communicator] = {}
_NEXT = itertools.count(1)
_LOCK = threading.Lock()


def register(comm: Communicator) -> int:
    """The handle the custom ops take for ``comm`` (the same handle for the same communicator)."""
    with _LOCK:
        for h, c in _COMMS.items():
            if c is comm:
                return h
        h = next(_NEXT)
        _COMMS[h] = comm
        return h


def unregister(handle: int) -> None:
    """Forgets a handle (the communicator itself is not closed)."""
    with _LOCK:
        _COMMS.pop(handle, None)


def communicator(handle: int) -> Communicator:
    """The communicator registered as ``handle``."""
    try:
        return _COMMS[handle]
    except KeyError:
        raise InvalidArgumentError(
            f"anyccl custom op: handle {handle} names no communicator (register it with anyccl.torch_ops.register)"
        ) from None


if not hasattr(torch, "library") or not hasattr(torch.library, "register_fake"):
    raise ImportError(f"anyccl.torch_ops needs torch >= 2.4 (torch.library.register_fake); this is torch {torch.__version__}")

# The ops are defined with a schema and a kernel per device type (CPU, CUDA) instead of `torch.library.custom_op`:
# an eager call of a `custom_op` goes through its Python wrapper (autograd and dispatch handling) as well as
# torch's dispatcher, which measured about 13 µs per call on an H200 host (python/bench/host_time.py); a plain
# kernel registration leaves only the dispatcher. No op has an autograd formula (a collective has none).
# torch.library.Library has no annotations: held as Any, so that `mypy --strict` with torch installed accepts the calls.
_Library: Any = torch.library.Library
_LIB = _Library("anyccl", "FRAGMENT")
_LIB.define("all_reduce(Tensor x, int handle, str op='sum', str? algorithm=None) -> Tensor")
_LIB.define("all_reduce_(Tensor(a!) x, int handle, str op='sum', str? algorithm=None) -> ()")


def all_reduce(x: torch.Tensor, handle: int, op: str = "sum", algorithm: Optional[str] = None) -> torch.Tensor:
    """``x`` reduced over every rank, in a new tensor (the kernel of ``torch.ops.anyccl.all_reduce``)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    communicator(handle).all_reduce(x.contiguous(), out=out, op=op, algorithm=algorithm)
    return out


def all_reduce_(x: torch.Tensor, handle: int, op: str = "sum", algorithm: Optional[str] = None) -> None:
    """Reduces ``x`` over every rank, in place (the kernel of ``torch.ops.anyccl.all_reduce_``; ``x`` must be
    contiguous)."""
    communicator(handle).all_reduce(x, op=op, algorithm=algorithm)


def _all_reduce_fake(x: torch.Tensor, handle: int, op: str = "sum", algorithm: Optional[str] = None) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_reduce_inplace_fake(x: torch.Tensor, handle: int, op: str = "sum", algorithm: Optional[str] = None) -> None:
    return None


_LIB.define(
    "all_reduce_rmsnorm(Tensor x, Tensor(a!) residual, Tensor weight, int handle, float eps=1e-06, str? form=None, "
    "float? fp8_scale=None) -> Tensor"
)


def _rmsnorm_out(x: torch.Tensor, fp8_scale: Optional[float]) -> torch.Tensor:
    if fp8_scale is None:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    return torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)


def all_reduce_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    handle: int,
    eps: float = 1e-6,
    form: Optional[str] = None,
    fp8_scale: Optional[float] = None,
) -> torch.Tensor:
    """The kernel of ``torch.ops.anyccl.all_reduce_rmsnorm``: ``residual`` (contiguous) updated in place, the output
    in a new tensor."""
    out = _rmsnorm_out(x, fp8_scale)
    communicator(handle).all_reduce_rmsnorm(
        x.contiguous(), residual, weight.contiguous(), out=out, eps=eps, form=form, fp8_scale=fp8_scale
    )
    return out


def _all_reduce_rmsnorm_fake(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    handle: int,
    eps: float = 1e-6,
    form: Optional[str] = None,
    fp8_scale: Optional[float] = None,
) -> torch.Tensor:
    return _rmsnorm_out(x, fp8_scale)


for _device in ("CPU", "CUDA"):
    _LIB.impl("all_reduce", all_reduce, _device)
    _LIB.impl("all_reduce_", all_reduce_, _device)
    _LIB.impl("all_reduce_rmsnorm", all_reduce_rmsnorm, _device)
torch.library.register_fake("anyccl::all_reduce", _all_reduce_fake, lib=_LIB)
torch.library.register_fake("anyccl::all_reduce_", _all_reduce_inplace_fake, lib=_LIB)
torch.library.register_fake("anyccl::all_reduce_rmsnorm", _all_reduce_rmsnorm_fake, lib=_LIB)
