"""The torch paths reachable without torch or a GPU, through a stand-in `torch` module: a CUDA tensor given to a
host communicator is refused with the reason (not read as host memory), CPU tensors go through NumPy (bf16 read
as its bytes), and the predicate says no to what it cannot take."""

from __future__ import annotations

import sys
import types
from typing import Any, Iterator

import numpy as np
import pytest

import anyccl


class FakeDtype:
    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


class FakeTensor:
    """Enough of torch.Tensor for the host path: CPU tensors are views of a NumPy array."""

    def __init__(self, array: Any, dtype: str, cuda: bool = False) -> None:
        self.array, self.dtype, self.is_cuda = array, FakeDtype(dtype), cuda
        self.device = "cuda:0" if cuda else "cpu"

    def detach(self) -> "FakeTensor":
        return self

    def view(self, dtype: FakeDtype) -> "FakeTensor":
        return FakeTensor(self.array.view({"int16": np.int16, "uint8": np.uint8}[dtype.name]), dtype.name)

    def numpy(self) -> Any:
        if self.dtype.name == "bfloat16":
            raise TypeError("Got unsupported ScalarType BFloat16")  # as torch does
        return self.array


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    mod = types.ModuleType("torch")
    mod.Tensor = FakeTensor  # type: ignore[attr-defined]
    mod.int16, mod.uint8 = FakeDtype("int16"), FakeDtype("uint8")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", mod)
    yield mod


@pytest.fixture
def comm() -> Iterator[anyccl.Communicator]:
    with anyccl.Communicator.from_unique_id(anyccl.unique_id(), 0, 1, backend="host") as c:
        yield c


def test_a_cuda_tensor_on_a_host_communicator_is_refused(fake_torch: Any, comm: anyccl.Communicator) -> None:
    t = FakeTensor(np.zeros(4, dtype=np.float32), "float32", cuda=True)
    with pytest.raises(anyccl.InvalidArgumentError, match="needs a CUDA communicator; this one runs on host"):
        comm.all_reduce(t)
    with pytest.raises(anyccl.InvalidArgumentError, match="cannot join host buffers"):
        comm.all_reduce(np.zeros(4, dtype=np.float32), out=t)
    assert not comm.should_all_reduce(t)


def test_cpu_tensors_go_through_numpy_and_bf16_as_its_bytes(fake_torch: Any, comm: anyccl.Communicator) -> None:
    a = np.arange(4, dtype=np.float32)
    t = FakeTensor(a, "float32")
    assert comm.all_reduce(t) is t
    np.testing.assert_array_equal(a, np.arange(4, dtype=np.float32))
    raw = np.array([0x3F80, 0x4000], dtype=np.int16)  # bf16 1.0 and 2.0
    b = FakeTensor(raw.view(np.int16), "bfloat16")
    out = np.zeros(2, dtype=np.int16)
    comm.all_reduce(b, out=out, op="max")  # dtype bf16 from the tensor; out read as bf16 bytes too
    np.testing.assert_array_equal(out, raw)
    sel = comm.last_selection
    assert sel is not None and sel["algorithm"] == "one-shot"
