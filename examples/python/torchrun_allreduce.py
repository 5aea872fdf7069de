#!/usr/bin/env python3
"""One rank of a job started by torchrun (or srun): CUDA when this process has a GPU and NCCL, else the host
backend over shared memory, with NumPy arrays. No torch needed for the host backend.

    torchrun --nproc-per-node 2 examples/python/torchrun_allreduce.py
    # anyccl's rendezvous uses MASTER_PORT + 1 (torchrun's agent holds MASTER_PORT); off loopback set
    # ANYCCL_RENDEZVOUS_KEY to a secret shared by the job.
"""

from __future__ import annotations

import sys

import anyccl


def main() -> int:
    with anyccl.Communicator.from_env() as comm:
        for p in comm.passed_over:
            print(f"rank {comm.rank}: {p['backend']} not used: {p['why']}", file=sys.stderr)
        if comm.backend == "cuda":
            import torch  # type: ignore[import-not-found, unused-ignore]

            x = torch.full((1 << 20,), float(comm.rank + 1), device=f"cuda:{comm.device_index}")
            comm.all_reduce(x)
            torch.cuda.synchronize()
            total = float(x[0])
        else:
            import numpy as np

            a = np.full(1 << 16, comm.rank + 1, dtype=np.float32)
            comm.all_reduce(a)
            total = float(a[0])
        print(f"RESULT rank {comm.rank} of {comm.world_size}: {total:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
