#!/usr/bin/env python3
"""Host time of ``Communicator.all_reduce`` on the host backend against a bare ctypes call into the same library,
side by side in one run on the same arrays (no GPU needed).

The bare call is ``anyccl_py_host_all_reduce``, a C entry point of the extension module itself
(``anyccl/_anyccl.abi3.so``, opened again with ``ctypes.CDLL``: the dynamic loader hands back the copy already
loaded). It takes the communicator's address (``_Comm.bare_handle()``), the array's pointer and byte length, the
type's index and the op's number, all prepared before the timing, and runs the same work as the Python call: the
same staging through the communicator's buffer under the same lock, with the GIL released around it (ctypes
releases it for a ``CDLL`` call, as the extension does). What the Python call costs on top of it is the
``anyccl.Communicator`` layer and the extension's argument handling: reading the array (the buffer protocol for
NumPy, ``data_ptr()`` and friends for a CPU tensor), the op and algorithm arguments, the dispatch.

A third column times the extension's general entry, ``comm._comm.host_collective(...)``, with its arguments
prepared (a memoryview, or a DLPack holder made beforehand for torch): the floor of a call through PyO3.

World 1 (``from_unique_id`` with one rank), NumPy f32 arrays and torch CPU tensors (when torch is importable), in
place. Each method runs ``--batches`` batches of ``--calls`` calls, the methods interleaved batch by batch; one
batch's time (perf_counter_ns around the loop) divided by its calls is a sample; the table gives the median and the
minimum per call, in µs.

    python python/bench/host_overhead.py --sizes 16,1024,65536
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from typing import Any, Callable, Dict, List

import numpy as np

import anyccl


def measure(fns: Dict[str, Callable[[], Any]], calls: int, batches: int) -> Dict[str, Dict[str, float]]:
    """Each function's median and minimum µs per call; the functions take turns, one batch each, so a change of the
    machine's load falls on all of them alike."""
    for fn in fns.values():
        for _ in range(min(calls, 200)):
            fn()
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(batches):
        for name, fn in fns.items():
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter_ns() - t0) / calls / 1000.0)
    return {n: {"median_us": statistics.median(s), "min_us": min(s)} for n, s in samples.items()}


def bare_entry() -> Any:
    lib = ctypes.CDLL(anyccl._anyccl.__file__)
    fn = lib.anyccl_py_host_all_reduce
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,1024,65536", help="f32 elements per call, comma-separated")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--batches", type=int, default=31)
    ap.add_argument("--no-torch", action="store_true", help="NumPy arrays only, even where torch is importable")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    torch: Any = None
    if not args.no_torch:
        try:
            import torch  # type: ignore[import-not-found, no-redef, unused-ignore]
        except ImportError:
            torch = None
    c_all_reduce = bare_entry()
    f32 = list(anyccl._anyccl.dtypes()).index("f32")
    rows = []
    with anyccl.Communicator.from_unique_id(anyccl.unique_id(), 0, 1, backend="host") as comm:
        handle = comm._comm.bare_handle()
        pyo3_entry = comm._comm.host_collective
        for n in (int(s) for s in args.sizes.split(",")):
            x = np.ones(n, dtype=np.float32)
            arrays = [("numpy", x, x.ctypes.data, memoryview(x).cast("B"))]
            if torch is not None:
                t = torch.ones(n, dtype=torch.float32)
                arrays.append(("torch", t, t.data_ptr(), anyccl._anyccl.dlpack_host(t, "x")))
            for kind, arr, ptr, mem in arrays:
                nbytes = n * 4
                if c_all_reduce(handle, ptr, nbytes, f32, 0) != 0:
                    raise SystemExit("anyccl_py_host_all_reduce failed")

                # Each in its own closure, so the loop pays one call and nothing else.
                def python_call(arr: Any = arr) -> Any:
                    return comm.all_reduce(arr)

                def ctypes_call(ptr: int = ptr, nbytes: int = nbytes) -> Any:
                    return c_all_reduce(handle, ptr, nbytes, f32, 0)

                def pyo3_call(mem: Any = mem, n: int = n) -> Any:
                    return pyo3_entry("all_reduce", mem, None, "f32", n, "sum", 0, None)

                r = measure(
                    {"communicator": python_call, "ctypes": ctypes_call, "pyo3_entry": pyo3_call},
                    args.calls,
                    args.batches,
                )
                if not bool((np.asarray(arr) == 1).all()):
                    raise SystemExit(f"{kind}: world 1 changed the array")
                c, b = r["communicator"], r["ctypes"]
                rows.append(
                    {
                        "elements": n,
                        "array": kind,
                        "communicator_us": c,
                        "ctypes_us": b,
                        "pyo3_entry_us": r["pyo3_entry"],
                        "added_median_us": c["median_us"] - b["median_us"],
                        "added_min_us": c["min_us"] - b["min_us"],
                    }
                )
    print(
        f"{'elements':>9} {'array':>6} {'Communicator µs (med/min)':>26} {'ctypes µs (med/min)':>20} "
        f"{'added µs (med/min)':>20} {'pyo3 entry µs (med/min)':>24}"
    )
    for r in rows:
        c, b, p = r["communicator_us"], r["ctypes_us"], r["pyo3_entry_us"]
        print(
            f"{r['elements']:>9} {r['array']:>6} {c['median_us']:>12.2f} / {c['min_us']:<11.2f} "
            f"{b['median_us']:>8.2f} / {b['min_us']:<9.2f} {r['added_median_us']:>8.2f} / {r['added_min_us']:<9.2f} "
            f"{p['median_us']:>10.2f} / {p['min_us']:.2f}"
        )
    line = json.dumps({"bench": "host_overhead", "rows": rows})
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
