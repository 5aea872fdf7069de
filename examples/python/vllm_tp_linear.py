#!/usr/bin/env python3
"""A vLLM-style tensor-parallel linear layer (row-parallel: each rank holds a slice of the input features and the
matching weight rows; the partial products are all-reduced) on anyccl's vLLM-shaped communicator, compiled.

    torchrun --nproc-per-node 2 examples/python/vllm_tp_linear.py      # GPUs: NCCL / custom kernels
    ANYCCL_EXAMPLE_CPU=1 torchrun --nproc-per-node 2 examples/python/vllm_tp_linear.py   # no GPU: host backend
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from anyccl.vllm import AnycclDeviceCommunicator


class RowParallelLinear(torch.nn.Module):
    """y = x W^T with W's input dimension split over the ranks, then one all-reduce (as vLLM's RowParallelLinear)."""

    def __init__(self, full_in: int, out: int, comm: AnycclDeviceCommunicator, device: torch.device) -> None:
        super().__init__()
        assert full_in % comm.world_size == 0
        self.comm = comm
        self.part = full_in // comm.world_size
        torch.manual_seed(0)  # every rank makes the same full weight and keeps its slice
        full = torch.randn(out, full_in)
        lo = comm.rank_in_group * self.part
        self.weight = torch.nn.Parameter(full[:, lo : lo + self.part].contiguous().to(device), requires_grad=False)

    def forward(self, x_part: torch.Tensor) -> torch.Tensor:
        partial = torch.nn.functional.linear(x_part, self.weight)
        return self.comm.all_reduce(partial)  # the anyccl::all_reduce custom op: fine inside torch.compile


def main() -> None:
    cpu = os.environ.get("ANYCCL_EXAMPLE_CPU") == "1" or not torch.cuda.is_available()
    dist.init_process_group("gloo")  # the CPU group anyccl bootstraps over (torchrun's environment)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if not cpu:
        torch.cuda.set_device(device)
    comm = AnycclDeviceCommunicator(dist.group.WORLD, device=device)
    layer = RowParallelLinear(1024, 256, comm, device)
    torch.manual_seed(1)
    x = torch.randn(8, 1024)
    x_part = x[:, rank * layer.part : (rank + 1) * layer.part].contiguous().to(device)
    y = torch.compile(layer, fullgraph=True)(x_part)
    torch.manual_seed(0)
    want = torch.nn.functional.linear(x, torch.randn(256, 1024))
    err = (y.cpu() - want).abs().max().item()
    print(f"RESULT rank {rank} of {world}: max |y - reference| = {err:.2e} on {comm.comm.backend}")
    comm.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
