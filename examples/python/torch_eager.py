#!/usr/bin/env python3
"""torch CUDA tensors, eagerly: in place, out of place, the predicate, the capability report.

    python examples/python/torch_eager.py            # world 1 on GPU 0
    torchrun --nproc-per-node 8 examples/python/torch_eager.py
"""

from __future__ import annotations

import os

import torch

import anyccl


def main() -> None:
    if "RANK" in os.environ:
        comm = anyccl.Communicator.from_env(backend="cuda")  # GPU LOCAL_RANK
    else:
        comm = anyccl.Communicator.from_unique_id(anyccl.unique_id(), 0, 1, backend="cuda", device=0)
    with comm:
        torch.cuda.set_device(comm.device_index)
        x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
        if comm.should_all_reduce(x):
            y = comm.all_reduce(x, out=torch.empty_like(x))  # on torch's current stream
            comm.all_reduce(x)  # in place
            torch.cuda.synchronize()
            assert torch.equal(x, y)
        print("ran", comm.last_selection)
        print("library", comm.capabilities()["library"])
        for cap in comm.capabilities()["capabilities"]:  # a list of plain dicts
            print(f"  {cap['name']:<28} {'on' if cap['enabled'] else 'off: ' + str(cap['reason'])}")


if __name__ == "__main__":
    main()
