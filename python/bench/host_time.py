#!/usr/bin/env python3
"""Host time per all_reduce call from Python, side by side in one run on the same tensor and stream:

* ``anyccl``: ``Communicator.all_reduce(x)`` (in place) and the custom op ``torch.ops.anyccl.all_reduce_``;
* ``torch.distributed.all_reduce(x)`` (the NCCL process group);
* a bare ctypes ``ncclAllReduce`` on the NCCL library torch loads, with its own communicator.

World 1 on GPU 0 (no launcher needed). Each method runs ``--batches`` batches of ``--calls`` calls; the host time
of a batch (perf_counter_ns around the loop, the device drained before each batch) divided by its calls is one
sample; the table gives the median and the minimum per call, in µs, and the ratios that matter. Prints a
JSON line too (``--json PATH`` writes it to a file).

    python python/bench/host_time.py --sizes 4096,1048576 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import socket
import statistics
import sys
import time
from typing import Any, Callable, Dict, List


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_libnccl() -> str:
    """The libnccl.so.2 torch uses (loaded in this process already), else the nvidia-nccl wheel's."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libnccl.so" in path and os.path.isabs(path):
                return path
    for entry in sys.path:
        hits = glob.glob(os.path.join(entry, "nvidia", "nccl", "lib", "libnccl.so*"))
        if hits:
            return hits[0]
    raise SystemExit("no libnccl.so.2 found (set ANYCCL_NCCL_PATH)")


class CtypesNccl:
    """ncclCommInitRank at world 1 and ncclAllReduce through ctypes, argtypes declared (the cheapest ctypes call)."""

    DTYPES = {"float32": 7, "float16": 6, "bfloat16": 9, "int32": 2, "float64": 8}

    def __init__(self, path: str, device: int) -> None:
        lib = ctypes.CDLL(path)
        self.lib = lib

        class UniqueId(ctypes.Structure):
            _fields_ = [("internal", ctypes.c_byte * 128)]

        uid = UniqueId()
        check = self.check
        check(lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        self.comm = ctypes.c_void_p()
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
        check(lib.ncclCommInitRank(ctypes.byref(self.comm), 1, uid, 0), "ncclCommInitRank")
        f = lib.ncclAllReduce
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        f.restype = ctypes.c_int
        self.all_reduce = f

    @staticmethod
    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise SystemExit(f"{what} failed with NCCL status {rc}")

    def close(self) -> None:
        self.lib.ncclCommDestroy(self.comm)


def measure(fn: Callable[[], Any], calls: int, batches: int, sync: Callable[[], None]) -> Dict[str, float]:
    for _ in range(max(calls // 4, 5)):  # warm up
        fn()
    sync()
    samples: List[float] = []
    for _ in range(batches):
        sync()
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter_ns()
        samples.append((t1 - t0) / calls / 1000.0)
    sync()
    return {"median_us": statistics.median(samples), "min_us": min(samples)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4096,262144,4194304", help="elements per call, comma-separated")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    import anyccl
    from anyccl import torch_ops

    torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    try:
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    except TypeError:  # torch before 2.3 has no device_id
        dist.init_process_group("nccl", rank=0, world_size=1)
    dtype = getattr(torch, args.dtype)
    warm = torch.ones(16, device="cuda", dtype=dtype)
    dist.all_reduce(warm)  # makes torch load its NCCL
    torch.cuda.synchronize()
    nccl_path = find_libnccl()
    os.environ.setdefault("ANYCCL_NCCL_PATH", nccl_path)
    comm = anyccl.Communicator.from_unique_id(anyccl.unique_id(), 0, 1, backend="cuda", device=0)
    handle = torch_ops.register(comm)
    bare = CtypesNccl(nccl_path, 0)
    sync = torch.cuda.synchronize
    results: Dict[str, Any] = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "nccl": nccl_path,
        "dtype": args.dtype,
        "calls": args.calls,
        "batches": args.batches,
        "anyccl_library": comm.capabilities().get("library"),
        "sizes": {},
    }
    print(f"{'elements':>10} {'method':<34} {'median us/call':>15} {'min us/call':>12}")
    for n in [int(s) for s in args.sizes.split(",")]:
        x = torch.ones(n, device="cuda", dtype=dtype)
        stream = torch.cuda.current_stream()
        raw = stream.cuda_stream
        ptr, count, dt = x.data_ptr(), x.numel(), CtypesNccl.DTYPES[args.dtype]
        f = bare.all_reduce
        methods = {
            "ctypes ncclAllReduce": lambda: f(ptr, ptr, count, dt, 0, bare.comm, raw),
            "ctypes ncclAllReduce + tensor reads": lambda: f(x.data_ptr(), x.data_ptr(), x.numel(), dt, 0, bare.comm, torch.cuda.current_stream().cuda_stream),
            "anyccl Communicator.all_reduce": lambda: comm.all_reduce(x),
            "anyccl Communicator.all_reduce(stream=)": lambda: comm.all_reduce(x, stream=stream),
            "anyccl torch.ops.anyccl.all_reduce_": lambda: torch.ops.anyccl.all_reduce_(x, handle, "sum"),
            "torch.distributed.all_reduce": lambda: dist.all_reduce(x),
        }
        row: Dict[str, Any] = {}
        for name, fn in methods.items():
            r = measure(fn, args.calls, args.batches, sync)
            row[name] = r
            print(f"{n:>10} {name:<34} {r['median_us']:>15.2f} {r['min_us']:>12.2f}")
        base = row["ctypes ncclAllReduce"]["median_us"]
        ours = row["anyccl Communicator.all_reduce"]["median_us"]
        td = row["torch.distributed.all_reduce"]["median_us"]
        row["anyccl_minus_ctypes_us"] = ours - base
        row["torch_distributed_over_anyccl"] = td / ours if ours > 0 else None
        row["selection"] = comm.last_selection
        print(
            f"{n:>10} anyccl - ctypes = {ours - base:+.2f} us (goal <= 1 us); torch.distributed / anyccl = "
            f"{td / ours:.2f}x (goal >= 3x); anyccl ran {comm.last_selection}"
        )
        results["sizes"][str(n)] = row
    line = json.dumps(results)
    print("JSON " + line)
    if args.json:
        with open(args.json, "w") as out:
            out.write(line + "\n")
    bare.close()
    comm.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
