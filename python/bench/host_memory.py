#!/usr/bin/env python3
"""Peak memory of a large host all-reduce: ``--ranks`` processes (default 2) on the host backend, each all-reducing
one f32 NumPy array of ``--mib`` MiB (default 1024) in place, then out of place. Each rank reports its resident set
before the array exists, with the array filled, and its peak (``ru_maxrss``) after each call; the table gives the
peak over the baseline in multiples of the payload (the array's size). Run on a machine with room for
``ranks × 3 × payload``.

    python python/bench/host_memory.py --mib 1024 --ranks 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
from typing import Any, Dict


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def rank_main(uid: bytes, rank: int, world: int, mib: int, out: Any) -> None:
    import numpy as np

    import anyccl

    comm = anyccl.Communicator.from_unique_id(uid, rank, world, backend="host", timeout=120)
    n = mib * 2**20 // 4
    comm.all_reduce(np.ones(1024, dtype=np.float32))  # warm up the group's staging
    base = rss_mib()
    x = np.full(n, float(rank + 1), dtype=np.float32)
    filled = rss_mib()
    comm.all_reduce(x)
    peak_in_place = peak_mib()
    ok = bool(x[0] == world * (world + 1) / 2 and x[-1] == x[0])
    y = np.empty_like(x)
    with_out = rss_mib()
    comm.all_reduce(x, out=y)
    peak_out = peak_mib()
    ok = ok and bool(y[-1] == x[-1] * world)
    comm.close()
    out.put({"rank": rank, "base": base, "filled": filled, "peak_in_place": peak_in_place, "with_out": with_out,
             "peak_out_of_place": peak_out, "ok": ok})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    import anyccl

    uid = anyccl.unique_id()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(uid, r, args.ranks, args.mib, q)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    got: Dict[int, Dict[str, Any]] = {}
    for _ in procs:
        r = q.get(timeout=600)
        got[r["rank"]] = r
    for p in procs:
        p.join()
    pay = float(args.mib)
    print(f"payload {args.mib} MiB per rank, {args.ranks} ranks (peak resident memory over the baseline)")
    print(f"{'rank':>4} {'in place':>10} {'out of place (2 arrays)':>24} {'correct':>8}")
    for r in sorted(got):
        g = got[r]
        print(f"{r:>4} {(g['peak_in_place'] - g['base']) / pay:>9.2f}x {(g['peak_out_of_place'] - g['base']) / pay:>23.2f}x "
              f"{str(g['ok']):>8}")
    print(json.dumps({"bench": "host_memory", "mib": args.mib, "ranks": args.ranks, "rows": [got[r] for r in sorted(got)]}))
    return 0 if all(g["ok"] for g in got.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
