#!/usr/bin/env python3
"""Host time of ``Communicator.all_reduce`` on the host backend against the bare call into the same library, side by
side in one run on the same arrays (no GPU needed).

The host backend has no C entry point of its own (the drop-in ``libnccl`` forwards to NCCL on a GPU), so the bare
call here is the extension module's own entry point, ``comm._comm.host_collective(...)``, made with the arguments
already prepared: the floor every Python call into the library pays (argument parsing, the buffer export, the GIL
released and taken back, the collective itself). The difference is what the ``anyccl.Communicator`` layer adds
(argument checks, dtype and size reading, the dispatch). World 1 (``from_unique_id`` with one rank), NumPy f32 arrays
and torch CPU tensors (when torch is importable), in place. Each method runs ``--batches`` batches of ``--calls``
calls; one batch's time (perf_counter_ns around the loop) divided by its calls is a sample; the table gives the
median and the minimum per call, in µs.

    python python/bench/host_overhead.py --sizes 16,1024,65536
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable, Dict, List

import numpy as np

import anyccl


def measure(fn: Callable[[], Any], calls: int, batches: int) -> Dict[str, float]:
    for _ in range(min(calls, 50)):
        fn()
    samples: List[float] = []
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - t0) / calls / 1000.0)
    return {"median_us": statistics.median(samples), "min_us": min(samples)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,1024,65536", help="f32 elements per call, comma-separated")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--batches", type=int, default=31)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    try:
        import torch  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        torch = None
    rows = []
    with anyccl.Communicator.from_unique_id(anyccl.unique_id(), 0, 1, backend="host") as comm:
        bare = comm._comm.host_collective
        for n in (int(s) for s in args.sizes.split(",")):
            x = np.ones(n, dtype=np.float32)
            view = memoryview(x).cast("B")
            arrays = [("numpy", x, view)]
            if torch is not None:
                t = torch.ones(n, dtype=torch.float32)
                arrays.append(("torch", t, anyccl._anyccl.dlpack_host(t, "x")))
            for kind, arr, mem in arrays:
                # Each in its own closure, so the loop pays one call and nothing else.
                def python_call(arr: Any = arr) -> Any:
                    return comm.all_reduce(arr)

                def bare_call(mem: Any = mem, n: int = n) -> Any:
                    return bare("all_reduce", mem, None, "f32", n, "sum", 0, None)

                py = measure(python_call, args.calls, args.batches)
                raw = measure(bare_call, args.calls, args.batches)
                rows.append(
                    {
                        "elements": n,
                        "array": kind,
                        "communicator_us": py,
                        "bare_us": raw,
                        "added_median_us": py["median_us"] - raw["median_us"],
                        "added_min_us": py["min_us"] - raw["min_us"],
                    }
                )
    print(f"{'elements':>9} {'array':>6} {'Communicator µs (med/min)':>26} {'bare µs (med/min)':>20} {'added µs (med/min)':>20}")
    for r in rows:
        c, b = r["communicator_us"], r["bare_us"]
        print(
            f"{r['elements']:>9} {r['array']:>6} {c['median_us']:>12.2f} / {c['min_us']:<11.2f} "
            f"{b['median_us']:>8.2f} / {b['min_us']:<9.2f} {r['added_median_us']:>8.2f} / {r['added_min_us']:.2f}"
        )
    line = json.dumps({"bench": "host_overhead", "rows": rows})
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
