"""``Communicator.p2p`` on a CUDA communicator hands the whole list to the extension in one call, which runs it as
one NCCL group (``ncclGroupStart``, the sends and receives, ``ncclGroupEnd``: ``cuda_p2p``). Checked without a
GPU: the extension's communicator is replaced by a recorder, and the buffers are objects that report a CUDA device
through ``__dlpack_device__`` (kDLCUDA), as CuPy or JAX arrays do."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np

import anyccl


class _CudaArray:
    """Stands for a CUDA DLPack object (never read: the recorder takes it)."""

    def __dlpack_device__(self) -> Tuple[int, int]:
        return (2, 0)


class _Recorder:
    def __init__(self) -> None:
        self.calls: List[Tuple[str, Any, Any]] = []

    def cuda_p2p(self, ops: List[Tuple[bool, Any, int]], stream: Any = None) -> None:
        self.calls.append(("cuda_p2p", list(ops), stream))

    def cuda_collective(self, coll: str, *args: Any) -> bool:
        self.calls.append(("cuda_collective", coll, args))
        return True

    def host_p2p(self, ops: List[Tuple[bool, Any, str, int, int]]) -> None:
        self.calls.append(("host_p2p", [(s, d, n, p) for s, _, d, n, p in ops], None))


def _cuda_communicator(rec: _Recorder) -> anyccl.Communicator:
    comm = object.__new__(anyccl.Communicator)
    comm._comm = rec
    comm._cuda = True
    comm.rank, comm.world_size, comm.backend, comm.device_index = 0, 2, "cuda", 0
    return comm


def test_cuda_sends_and_receives_reach_the_extension_as_one_group_in_the_order_given() -> None:
    rec = _Recorder()
    comm = _cuda_communicator(rec)
    a, b, c = _CudaArray(), _CudaArray(), _CudaArray()
    stream: Optional[object] = object()
    comm.p2p([("recv", a, 1), ("send", b, 1), ("recv", c, 1)], stream=stream)
    assert rec.calls == [("cuda_p2p", [(False, a, 1), (True, b, 1), (False, c, 1)], stream)]


def test_host_arrays_on_a_cuda_communicator_stay_one_host_group() -> None:
    rec = _Recorder()
    comm = _cuda_communicator(rec)
    x, y = np.zeros(4, dtype=np.float32), np.zeros(8, dtype=np.int64)
    comm.p2p([("send", x, 1), ("recv", y, 1)])
    assert rec.calls == [("host_p2p", [(True, "f32", 4, 1), (False, "i64", 8, 1)], None)]
