#!/usr/bin/env python3
"""An all-reduce captured into a CUDA graph and replayed, through the torch custom op (works in torch.compile too).

    python examples/python/torch_cuda_graph.py
    torchrun --nproc-per-node 8 examples/python/torch_cuda_graph.py
"""

from __future__ import annotations

import os

import torch

import anyccl
from anyccl import torch_ops


def main() -> None:
    if "RANK" in os.environ:
        comm = anyccl.Communicator.from_env(backend="cuda")
    else:
        comm = anyccl.Communicator.from_unique_id(anyccl.unique_id(), 0, 1, backend="cuda", device=0)
    torch.cuda.set_device(comm.device_index)
    handle = torch_ops.register(comm)
    x = torch.zeros(256 * 8192, device="cuda", dtype=torch.bfloat16)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture
        torch.ops.anyccl.all_reduce(x, handle, "sum")
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with comm.capture():  # on exit: the graph buffers are registered on every rank, before the first replay
        with torch.cuda.graph(graph):
            y = torch.ops.anyccl.all_reduce(x, handle, "sum")
    for step in range(3):
        x.fill_(float(step + comm.rank))
        graph.replay()
    torch.cuda.synchronize()
    want = sum(2.0 + r for r in range(comm.world_size))
    print(f"RESULT rank {comm.rank}: {float(y[0]):g} (expected {want:g}); ran {comm.last_selection}")
    comm.close()


if __name__ == "__main__":
    main()
