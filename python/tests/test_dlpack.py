"""DLPack input on the host backend: objects with ``__dlpack__`` only (no buffer protocol) are read and written
through the capsule; everything the capsule describes is checked (device, rank, shape, strides, element type and
lanes, byte offset, alignment, the read-only flag) and anything else refused with a TypeError / ValueError naming the
argument, the array untouched; the capsule is renamed when consumed and its deleter called exactly once."""

from __future__ import annotations

import ctypes
import gc
import traceback
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import pytest

import anyccl
from test_host import _run_processes


class DLOnly:
    """An array reachable through DLPack only (as a CuPy or JAX array is to anyccl): no buffer protocol."""

    def __init__(self, a: Any) -> None:
        self.a = a
        self.calls: List[Dict[str, Any]] = []

    def __dlpack__(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self.a.__dlpack_device__()


class OldProducer:
    """A producer from before DLPack 1.0 (NumPy < 2.1, torch < 2.4): ``__dlpack__`` takes ``stream`` only."""

    def __init__(self, a: Any) -> None:
        self.a = a

    def __dlpack__(self, stream: Any = None) -> Any:
        return self.a.__dlpack__()


@pytest.fixture
def comm() -> Iterator[anyccl.Communicator]:
    with anyccl.Communicator.from_unique_id(anyccl.unique_id(), 0, 1, backend="host") as c:
        yield c


def test_a_dlpack_only_array_is_read_and_written_in_place_and_out_of_place(comm: anyccl.Communicator) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = DLOnly(a)
    assert comm.all_reduce(x) is x
    np.testing.assert_array_equal(a, np.arange(6, dtype=np.float32).reshape(2, 3))
    assert x.calls and "stream" not in x.calls[0], "a host array is asked for without a stream"
    out = np.zeros(6, dtype=np.int64)
    src = DLOnly(np.arange(6, dtype=np.int64) * 7)
    comm.all_reduce(src, out=DLOnly(out), op="max")
    np.testing.assert_array_equal(out, np.arange(6) * 7)
    assert comm.should_all_reduce(DLOnly(np.zeros(3, dtype=np.float16)))
    # all_gather allocates its output from the DLPack array's type.
    g = comm.all_gather(DLOnly(np.array([5, 6], dtype=np.int32)))
    np.testing.assert_array_equal(g, np.array([5, 6], dtype=np.int32))


def test_a_producer_older_than_dlpack_1_is_asked_again_without_max_version(comm: anyccl.Communicator) -> None:
    a = np.full(4, 9, dtype=np.uint8)
    out = np.zeros(4, dtype=np.uint8)
    comm.all_reduce(OldProducer(a), out=out)
    np.testing.assert_array_equal(out, a)


def test_non_contiguous_wrong_type_and_wrong_device_are_refused_untouched(comm: anyccl.Communicator) -> None:
    strided = np.arange(16, dtype=np.float32).reshape(4, 4)
    with pytest.raises(ValueError, match=r"buffer: the array is not contiguous \(shape \[4\], strides \[4\]\)"):
        comm.all_reduce(DLOnly(strided[:, 1]))
    np.testing.assert_array_equal(strided, np.arange(16, dtype=np.float32).reshape(4, 4))
    with pytest.raises(TypeError, match="no anyccl data type"):
        comm.all_reduce(DLOnly(np.ones(4, dtype=np.complex64)))
    with pytest.raises(TypeError, match="no anyccl data type"):
        comm.all_reduce(DLOnly(np.ones(4, dtype=np.int16)))

    class OnGpu(DLOnly):
        def __dlpack_device__(self) -> Any:
            return (2, 0)

    gpu = OnGpu(np.zeros(4, dtype=np.float32))
    with pytest.raises(ValueError, match="the array is on cuda:0, but host \\(cpu\\) memory is expected here"):
        comm.all_reduce(gpu)
    assert gpu.calls == [], "refused from __dlpack_device__ alone, before any capsule was made"
    assert not comm.should_all_reduce(gpu)
    with pytest.raises(anyccl.InvalidArgumentError, match="buffer protocol or __dlpack__"):
        comm.all_reduce(object())


def test_a_read_only_array_is_refused_as_an_output_and_read_as_an_input(comm: anyccl.Communicator) -> None:
    ro = np.arange(4, dtype=np.float64)
    ro.setflags(write=False)
    with pytest.raises(anyccl.InvalidArgumentError, match="read-only"):
        comm.all_reduce(DLOnly(ro))
    out = np.zeros(4, dtype=np.float64)
    comm.all_reduce(DLOnly(ro), out=out)
    np.testing.assert_array_equal(out, ro)


def test_a_dtype_contradicting_the_array_is_refused(comm: anyccl.Communicator) -> None:
    with pytest.raises(anyccl.InvalidArgumentError, match="dtype f16 was asked for, but the array holds f32"):
        comm.all_reduce(DLOnly(np.zeros(4, dtype=np.float32)), dtype="f16")
    # Bytes may be read as another type, as with the buffer protocol.
    raw = np.frombuffer(b"\x80\x3f" * 4, dtype=np.uint8).copy()
    out = np.zeros(8, dtype=np.uint8)
    comm.all_reduce(DLOnly(raw), out=DLOnly(out), dtype="bf16")
    assert out.tobytes() == b"\x80\x3f" * 4


# ---- hand-made capsules: what a malformed or hostile producer can hand over ---------------------------------------


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_valid.restype = ctypes.c_int
_capsule_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


class HandMade:
    """A producer handing out one legacy capsule over `data` as described; records the deleter's calls."""

    def __init__(
        self,
        data: Any,
        shape: List[int],
        strides: Optional[List[int]] = None,
        code: int = 2,
        bits: int = 32,
        lanes: int = 1,
        byte_offset: int = 0,
        ndim: Optional[int] = None,
        null_data: bool = False,
    ) -> None:
        self.data = data  # kept alive: the capsule points into it
        self.shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self.strides = None if strides is None else (ctypes.c_int64 * max(len(strides), 1))(*strides)
        self.deleted = 0

        def deleter(_: Any) -> None:
            self.deleted += 1

        self.deleter = DELETER(deleter)
        self.managed = DLManagedTensor()
        t = self.managed.dl_tensor
        t.data = None if null_data else data.ctypes.data
        t.device = DLDevice(1, 0)
        t.ndim = len(shape) if ndim is None else ndim
        t.dtype = DLDataType(code, bits, lanes)
        t.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64))
        if self.strides is not None:
            t.strides = ctypes.cast(self.strides, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = byte_offset
        self.managed.deleter = self.deleter
        self.capsule = _capsule_new(ctypes.addressof(self.managed), b"dltensor", None)

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.capsule

    def __dlpack_device__(self) -> Any:
        return (1, 0)

    def consumed(self) -> bool:
        return bool(_capsule_valid(self.capsule, b"used_dltensor"))


def test_a_good_capsule_with_a_byte_offset_is_read_exactly_and_released_once(comm: anyccl.Communicator) -> None:
    data = np.arange(8, dtype=np.float32)
    p = HandMade(data, [4], [1], byte_offset=16)  # elements 4..7 only
    out = np.zeros(4, dtype=np.float32)
    comm.all_reduce(p, out=out)
    np.testing.assert_array_equal(out, [4.0, 5.0, 6.0, 7.0])
    gc.collect()
    assert p.consumed(), "the capsule is renamed used_dltensor when consumed"
    assert p.deleted == 1, "the deleter is called exactly once, after the call"
    # In place: the result goes back to exactly the described bytes.
    q = HandMade(data, [2, 2], None, byte_offset=8)  # no strides: compact, elements 2..5
    comm.all_reduce(q, op="sum")
    np.testing.assert_array_equal(data, np.arange(8, dtype=np.float32))
    gc.collect()
    assert q.deleted == 1


@pytest.mark.parametrize(
    "kwargs, error, says",
    [
        ({"shape": [4], "ndim": -1}, ValueError, "ndim is negative"),
        ({"shape": [4, -2]}, ValueError, "negative"),
        ({"shape": [4], "lanes": 2}, TypeError, "2 lanes"),
        ({"shape": [4], "bits": 0}, ValueError, "bit width"),
        ({"shape": [4], "code": 5, "bits": 64}, TypeError, "type code 5"),
        ({"shape": [2, 2], "strides": [1, 2]}, ValueError, "not contiguous"),
        ({"shape": [4], "strides": [2]}, ValueError, "not contiguous"),
        ({"shape": [4], "byte_offset": 2}, ValueError, "not aligned"),
        ({"shape": [4], "null_data": True}, ValueError, "null"),
    ],
)
def test_a_malformed_capsule_is_refused_and_still_released(
    comm: anyccl.Communicator, kwargs: Dict[str, Any], error: type, says: str
) -> None:
    data = np.full(8, 5.0, dtype=np.float32)
    p = HandMade(data, **kwargs)
    with pytest.raises(error, match=says):
        comm.all_reduce(p)
    np.testing.assert_array_equal(data, np.full(8, 5.0, dtype=np.float32))
    gc.collect()
    assert p.consumed() and p.deleted == 1
    # A consumed capsule is never read again.
    with pytest.raises(ValueError, match="already been consumed"):
        comm.all_reduce(p)
    assert p.deleted == 1


def _dlpack_rank(uid: bytes, rank: int, world: int, results: Any) -> None:
    try:
        with anyccl.Communicator.from_unique_id(uid, rank, world, backend="host", timeout=30) as c:
            a = np.full(4, float(rank + 1), dtype=np.float64)
            c.all_reduce(DLOnly(a))
            out = np.zeros(2 * world, dtype=np.int32)
            c.all_gather(DLOnly(np.array([rank, 10 * rank], dtype=np.int32)), out=DLOnly(out))
            results.put((rank, "ok", (a.tolist(), out.tolist())))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def test_dlpack_arrays_across_processes() -> None:
    world = 2
    for summed, gathered in _run_processes(world, _dlpack_rank, anyccl.unique_id()):
        assert summed == [3.0] * 4
        assert gathered == [0, 0, 1, 10]
