#!/usr/bin/env python3
"""anyccl's host backend against ``torch.distributed`` with gloo on CPU tensors, side by side in one run on the same
machine: ``--ranks`` processes (default 2), each with one gloo process group and one anyccl communicator made over it
(``Communicator.from_process_group``), all-reducing the same torch CPU f32 tensor in place (sum). Per size and
method: barrier, then ``--iters`` timed calls each followed by nothing else (both calls return when the result is
in the tensor); the median and the minimum of the per-call times on rank 0, in µs. Results are checked every call
(``#wrong`` counts mismatches).

    python python/bench/torch_cpu_gloo.py --sizes 4096,65536,1048576,16777216
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any, Dict, List


def rank_main(store: str, rank: int, world: int, sizes: List[int], iters: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    import anyccl

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    comm = anyccl.Communicator.from_process_group(dist.group.WORLD, backend="host")
    rows = []
    for nbytes in sizes:
        n = nbytes // 4
        x = torch.empty(n, dtype=torch.float32)
        want = float(sum(range(1, world + 1)))
        res: Dict[str, Any] = {"bytes": nbytes}
        for name in ("gloo", "anyccl"):
            call = (lambda t: dist.all_reduce(t)) if name == "gloo" else (lambda t: comm.all_reduce(t))
            times, wrong = [], 0
            for i in range(iters + 5):
                x.fill_(float(rank + 1))
                dist.barrier()
                t0 = time.perf_counter_ns()
                call(x)
                dt = (time.perf_counter_ns() - t0) / 1000.0
                if i >= 5:
                    times.append(dt)
                if x[0].item() != want or x[-1].item() != want:
                    wrong += 1
            res[name] = {"median_us": statistics.median(times), "min_us": min(times), "wrong": wrong}
        rows.append(res)
    comm.close()
    dist.destroy_process_group()
    if rank == 0:
        out.put(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4096,65536,1048576,16777216", help="bytes per call, comma-separated")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(store, r, args.ranks, sizes, args.iters, q)) for r in range(args.ranks)]
        for p in procs:
            p.start()
        rows = q.get(timeout=1800)
        for p in procs:
            p.join()
    print(f"world {args.ranks}, f32 sum in place, torch CPU tensors, median (min) µs per call on rank 0, {args.iters} calls")
    print(f"{'size':>10} {'gloo':>18} {'anyccl':>18} {'anyccl/gloo':>12} {'#wrong':>7}")
    for r in rows:
        g, a = r["gloo"], r["anyccl"]
        print(f"{r['bytes']:>10} {g['median_us']:>9.1f} ({g['min_us']:>6.1f}) {a['median_us']:>9.1f} ({a['min_us']:>6.1f}) "
              f"{a['median_us'] / g['median_us']:>12.2f} {g['wrong'] + a['wrong']:>7}")
    print(json.dumps({"bench": "torch_cpu_gloo", "ranks": args.ranks, "rows": rows}))
    return 0 if all(r["gloo"]["wrong"] + r["anyccl"]["wrong"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
