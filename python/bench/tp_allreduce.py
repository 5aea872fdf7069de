#!/usr/bin/env python3
"""For a multi-GPU machine: anyccl's vLLM-shaped communicator against torch.distributed (NCCL) and, where this
torch has it, PyTorch's symmetric-memory one-shot all-reduce, at TP = the number of processes.

    torchrun --nproc-per-node 2 python/bench/tp_allreduce.py --sizes 4096,262144,4194304

Per size and method: the result checked against torch.distributed's, then the device time per call (CUDA events
around --iters back-to-back calls, median of --reps) and the host time per call (perf_counter around the same
loop). Rank 0 prints the table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from anyccl.vllm import AnycclDeviceCommunicator


def timed(fn: Callable[[], Any], iters: int, reps: int) -> Dict[str, float]:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    dev: List[float] = []
    host: List[float] = []
    for _ in range(reps):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        dev.append(start.elapsed_time(end) * 1000.0 / iters)
        host.append((t1 - t0) * 1e6 / iters)
    return {"device_us": statistics.median(dev), "host_us": statistics.median(host)}


def symm_mem_all_reduce(x: torch.Tensor) -> Optional[Callable[[], Any]]:
    """PyTorch's symmetric-memory one-shot all-reduce on a copy of x, or None where this torch lacks it."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD
        buf = symm_mem.empty(x.numel(), dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(buf, group.group_name)
        buf.copy_(x)
        op = torch.ops.symm_mem.one_shot_all_reduce
        return lambda: op(buf, "sum", group.group_name)
    except Exception as e:  # noqa: BLE001 - reported, and the method skipped
        if dist.get_rank() == 0:
            print(f"symmetric memory not measured: {type(e).__name__}: {e}")
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,65536,262144,1048576,4194304")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    cpu_group = dist.new_group(backend="gloo")
    comm = AnycclDeviceCommunicator(cpu_group, device=torch.device("cuda", local))
    dtype = getattr(torch, args.dtype)
    rows: Dict[str, Any] = {}
    for n in [int(s) for s in args.sizes.split(",")]:
        x = torch.randn(n, device="cuda", dtype=dtype) + dist.get_rank()
        want = x.clone()
        dist.all_reduce(want)
        got = comm.all_reduce(x)
        torch.cuda.synchronize()
        ok = torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        y = x.clone()
        methods: Dict[str, Callable[[], Any]] = {
            "anyccl (vllm all_reduce)": lambda: comm.all_reduce(x),
            "torch.distributed.all_reduce": lambda: dist.all_reduce(y),
        }
        sm = symm_mem_all_reduce(x)
        if sm is not None:
            methods["symm_mem one_shot_all_reduce"] = sm
        row: Dict[str, Any] = {"correct": bool(ok), "selection": comm.comm.last_selection}
        for name, fn in methods.items():
            row[name] = timed(fn, args.iters, args.reps)
        rows[str(n)] = row
        if dist.get_rank() == 0:
            for name in methods:
                r = row[name]
                print(f"{n:>9} {name:<32} device {r['device_us']:8.2f} us  host {r['host_us']:7.2f} us")
            print(f"{n:>9} anyccl correct: {ok}; ran {row['selection']}")
    if dist.get_rank() == 0:
        print("JSON " + json.dumps({"world": dist.get_world_size(), "dtype": args.dtype, "sizes": rows}))
    comm.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
