"""PyTorch's own all-reduce paths at TP N, for comparison with `anyccl bench --graph --world N`.

Launch one process per GPU: `python3 -m torch.distributed.run --nproc-per-node N scripts/torch_tp_bench.py`.
Keep `NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1` set: the symmetric-memory paths then run over P2P.

Paths, on bf16 tensors (rows, 8192) of the same sizes as anyccl's default GPU sweep:
- `torch.distributed.all_reduce` (NCCL), in place;
- `torch.ops.symm_mem.one_shot_all_reduce` (out of place) and `two_shot_all_reduce_` (in place) on a
  symmetric-memory buffer.
Graph mode, like anyccl's: one CUDA graph of 10 back-to-back calls per size and path, 5 warm-up replays, 20 timed
replays between two events, latency = replay / 10, median; rank 0 prints. Then the host time of one eager
`torch.distributed.all_reduce` call (median of 500, stream synchronised between calls) at two sizes.
"""
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

ROWS = [32, 64, 96, 128, 192, 256, 512, 1024, 2048, 3062, 4096]
CALLS, WARMUP, TIMED = 10, 5, 20

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device)
group = dist.group.WORLD
name = group.group_name


def graph_latency(fn):
    """Median latency of one call of `fn` in seconds, or the error text."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(CALLS):
            fn()
    times = []
    for i in range(WARMUP + TIMED):
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(a.elapsed_time(b) * 1e-3 / CALLS)
    return statistics.median(times)


if rank == 0:
    print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, world {world}, "
          f"{torch.cuda.get_device_name(device)}")
    print(f"{'size':>10} {'rows':>6} {'nccl':>10} {'symm one-shot':>14} {'symm two-shot':>14}")
for rows in ROWS:
    n = rows * 8192
    x = torch.randn(rows, 8192, dtype=torch.bfloat16, device=device)
    cells = []
    try:
        cells.append(graph_latency(lambda: dist.all_reduce(x)))
    except Exception as e:  # noqa: BLE001 - report and go on
        cells.append(f"error: {type(e).__name__}")
    buf = symm_mem.empty(n, dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(buf, name)
    buf.copy_(x.view(-1))
    for op in ("one", "two"):
        try:
            if op == "one":
                cells.append(graph_latency(lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)))
            else:
                cells.append(graph_latency(lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", name)))
        except Exception as e:  # noqa: BLE001 - report and go on
            cells.append(f"error: {type(e).__name__}: {str(e)[:60]}")
    if rank == 0:
        fmt = [f"{c * 1e6:>8.1f} us" if isinstance(c, float) else c for c in cells]
        size = n * 2
        label = f"{size / 2**20:.2f} MiB" if size % 2**20 else f"{size >> 20} MiB"
        if size < 2**20:
            label = f"{size >> 10} KiB"
        print(f"{label:>10} {rows:>6} {fmt[0]:>10} {fmt[1]:>14} {fmt[2]:>14}")
    del buf

for rows in (32, 1024):
    x = torch.randn(rows, 8192, dtype=torch.bfloat16, device=device)
    for _ in range(20):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    host = []
    for _ in range(500):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(x)
        host.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
    if rank == 0:
        print(f"torch.distributed all_reduce bf16 ({rows}, 8192), world {world}: host "
              f"{statistics.median(host):.2f} us/call (median of 500)")
dist.destroy_process_group()
