#!/usr/bin/env python3
"""The host backend with NumPy: ranks as processes that meet through a unique id the parent moves to them.

    python examples/python/host_numpy.py [WORLD]
"""

from __future__ import annotations

import multiprocessing as mp
import sys

import numpy as np

import anyccl


def rank_main(uid: bytes, rank: int, world: int) -> None:
    with anyccl.Communicator.from_unique_id(uid, rank, world, backend="host") as comm:
        x = np.full(1024, rank + 1, dtype=np.float32)
        comm.all_reduce(x)  # in place: the sum over the ranks
        everyone = comm.all_gather(np.array([rank], dtype=np.int64))  # a new array, rank order
        mine = comm.reduce_scatter(np.ones(4 * world, dtype=np.float64))  # this rank's part of the sum
        selection = comm.last_selection or {}
        print(
            f"RESULT rank {rank} of {world}: sum {x[0]:.0f}, gathered {everyone.tolist()}, "
            f"reduce_scatter {mine.tolist()}, algorithm {selection.get('algorithm')}"
        )


def main() -> int:
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    uid = anyccl.unique_id()  # made once, moved to every rank by us (here: a process argument)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(uid, r, world)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
