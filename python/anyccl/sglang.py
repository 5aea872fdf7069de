"""anyccl in SGLang's custom all-reduce slot: ``AnycclSglangCustomAllreduce`` has the shape of SGLang's
``CustomAllreduce`` (``sglang.srt.distributed.device_communicators.custom_all_reduce``), which SGLang's
``GroupCoordinator`` makes for a tensor-parallel group through ``dispatch_custom_allreduce(group=, device=)``.

The contract it keeps: made with ``group=`` (a gloo CPU group), ``device=`` and ``max_size=`` (8 MiB, SGLang's
default on CUDA); ``disabled`` True when it cannot run (SGLang then uses NCCL); ``should_custom_ar(inp)`` with SGLang's
limits (bytes a multiple of 16, contiguous, at most ``max_size``) and anyccl's (a dtype and device it has, an eligible
algorithm); ``custom_all_reduce(input)`` out of place, returning the new tensor or None to make the caller fall back
(inside ``capture()`` but outside an actual graph capture, zeros of the shape, as SGLang's warm-up expects);
``capture()`` a context manager registering the captured inputs on exit (through anyccl's own bootstrap);
``register_buffer(inp)`` (nothing to do: anyccl stages inputs it has not registered); ``register_graph_buffers()``;
``close()``. SGLang's fused and ROCm-only extras (``fused_allreduce_rmsnorm``, ``custom_fused_ar_rms``,
``all_gather_unreg``, ``reduce_scatter``) are absent, and SGLang checks for them with ``hasattr`` and takes its
other paths.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Union

import torch  # type: ignore[import-not-found, unused-ignore]

from .vllm import AnycclCustomAllreduce

__all__ = ["AnycclSglangCustomAllreduce"]


class AnycclSglangCustomAllreduce(AnycclCustomAllreduce):
    """SGLang's ``CustomAllreduce`` over anyccl (see the module's documentation)."""

    #: SGLang's class this one stands in for, set by the plugin (None when made directly).
    replaced: ClassVar[Any] = None

    def __init__(self, group: Any, device: Union[int, str, torch.device], max_size: int = 8192 * 1024) -> None:
        """SGLang's arguments: ``group`` a gloo CPU group, ``device`` the CUDA device (or ``"cpu"`` for the host
        backend), ``max_size`` the largest message in bytes."""
        super().__init__(group, device, max_size)
        self.original_disabled = self.disabled  # SGLang's piecewise graph runner toggles `disabled` and restores it

    def should_custom_ar(self, inp: torch.Tensor) -> bool:
        """Whether ``custom_all_reduce`` takes ``inp``: SGLang's limits (bytes a multiple of 16, at most
        ``max_size``, contiguous) and anyccl's."""
        if self.disabled or self.comm is None:
            return False
        size = inp.numel() * inp.element_size()
        if size % 16 != 0 or size > self.max_size or not inp.is_contiguous():
            return False
        return self.comm.should_all_reduce(inp)

    def custom_all_reduce(self, input: torch.Tensor) -> Optional[torch.Tensor]:
        """The all-reduce SGLang calls: the result in a new tensor, or None to make the caller fall back."""
        if self.disabled or not self.should_custom_ar(input):
            return None
        if self._IS_CAPTURING and self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            return torch.zeros_like(input)  # SGLang's warm-up inside capture(): the allocation pattern only
        return self.all_reduce(input)

    def register_buffer(self, inp: torch.Tensor) -> None:
        """Nothing to do: anyccl stages an input it has not registered, and registers captured ones itself."""
