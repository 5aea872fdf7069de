"""The bare C entry point ``anyccl_py_host_all_reduce`` that ``python/bench/host_overhead.py`` times
``Communicator.all_reduce`` against: called through ctypes it runs the same all-reduce (two ranks as threads of this
process, which works only because ctypes releases the GIL around the call), and refuses arguments it does not take
with 1 and a closed communicator with 2, touching nothing."""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Dict

import numpy as np

import anyccl


def _entry() -> Any:
    fn = ctypes.CDLL(anyccl._anyccl.__file__).anyccl_py_host_all_reduce
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


F32 = list(anyccl._anyccl.dtypes()).index("f32")
I64 = list(anyccl._anyccl.dtypes()).index("i64")


def test_two_ranks_as_threads_reduce_through_the_c_entry() -> None:
    fn = _entry()
    uid = anyccl.unique_id()
    out: Dict[int, Any] = {}

    def rank_thread(rank: int) -> None:
        try:
            with anyccl.Communicator.from_unique_id(uid, rank, 2, backend="host", timeout=30) as comm:
                h = comm._comm.bare_handle()
                x = np.arange(5, dtype=np.float32) * (rank + 1)
                y = np.full(3, rank + 2, dtype=np.int64)
                rc_sum = fn(h, x.ctypes.data, x.nbytes, F32, 0)
                rc_max = fn(h, y.ctypes.data, y.nbytes, I64, 3)
                out[rank] = (rc_sum, x.tolist(), rc_max, y.tolist())
        except BaseException as e:  # noqa: BLE001 - reported below
            out[rank] = e

    threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank thread is still blocked"
    for rank in range(2):
        assert out[rank] == (0, [0.0, 3.0, 6.0, 9.0, 12.0], 0, [3, 3, 3]), out[rank]


def test_the_c_entry_refuses_what_it_does_not_take_and_touches_nothing() -> None:
    fn = _entry()
    x = np.arange(4, dtype=np.float32)
    with anyccl.Communicator.from_unique_id(anyccl.unique_id(), 0, 1, backend="host") as comm:
        h = comm._comm.bare_handle()
        assert fn(h, x.ctypes.data, x.nbytes, F32, 5) == 1  # no op 5
        assert fn(h, x.ctypes.data, x.nbytes, 10_000, 0) == 1  # no such type
        assert fn(h, x.ctypes.data, x.nbytes - 1, F32, 0) == 1  # not whole elements
        assert fn(None, x.ctypes.data, x.nbytes, F32, 0) == 1
        assert fn(h, None, x.nbytes, F32, 0) == 1
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
        assert fn(h, x.ctypes.data, x.nbytes, F32, 0) == 0
        comm.close()
        assert fn(h, x.ctypes.data, x.nbytes, F32, 0) == 2  # closed (the Python object is still alive)
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
