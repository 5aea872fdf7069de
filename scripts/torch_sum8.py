"""PyTorch summing 8 bf16 inputs (what one rank of a one-shot all-reduce computes), for comparison with
anyccl-cuda-emulated-bench. Bytes counted: 9 x input (8 reads + 1 write). Median of 50 after 10 warm-ups."""
import torch

x = None
print(f"{'size':>8} {'torch.sum(8)':>14} {'GB/s':>8}")
for i in range(7):
    n = (1 << 20) << i
    xs = torch.randn(8, n // 2, dtype=torch.bfloat16, device="cuda")
    for _ in range(10):
        x = xs.sum(0)
    torch.cuda.synchronize()
    times = []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        x = xs.sum(0)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    times.sort()
    t = times[len(times) // 2]
    print(f"{n >> 20:>5} MiB {t * 1e6:>11.1f} us {9 * n / t / 1e9:>8.0f}")
