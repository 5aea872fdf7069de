"""Host time per eager all-reduce call through torch.distributed (NCCL), world 1, for comparison with
`anyccl bench --backend cuda --eager`. Usage: python3 scripts/torch_allreduce_host.py [iters]"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

iters = int(sys.argv[1]) if len(sys.argv) > 1 else 200
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29517")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
print(f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
for n in (32, 1024, 4096):
    x = torch.randn(n, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(20):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    host = []
    for _ in range(iters):
        t = time.perf_counter()
        dist.all_reduce(x)
        host.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
    print(f"torch.distributed all_reduce bf16 ({n}, 8192): host {statistics.median(host):.2f} us/call (median of {iters})")
dist.destroy_process_group()
