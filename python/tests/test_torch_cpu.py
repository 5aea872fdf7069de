"""With torch on CPU (``-m torch``; no GPU, no vLLM): the process-group bootstrap over gloo (bytes as tensors, no
pickles, also under ``torch.inference_mode``) and ``anyccl.vllm.AnycclCustomAllreduce`` on the host backend with 2
processes: vLLM's predicate limits, the out-of-place result, capture() and close()."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch

RANK_CODE = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    import anyccl
    from anyccl.vllm import AnycclCustomAllreduce

    rank, world = int(sys.argv[2]), 2
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=world)
    boot = anyccl.ProcessGroupBootstrap()
    assert boot.all_gather(bytes([rank]) * (rank + 3)) == [b"\\0" * 3, b"\\1" * 4]
    with torch.inference_mode():
        assert boot.all_gather(b"") == [b"", b""]
    ca = AnycclCustomAllreduce(group=dist.group.WORLD, device="cpu")
    assert not ca.disabled and ca.max_size == 8192 * 1024
    t = torch.full((64,), float(rank + 1))
    assert ca.should_custom_ar(t)
    assert not ca.should_custom_ar(torch.ones(3))  # 12 bytes: not a multiple of 16
    assert not ca.should_custom_ar(torch.ones(2 << 20))  # 8 MiB: not below max_size
    assert not ca.should_custom_ar(torch.ones(64, 2).t())  # not contiguous
    out = ca.custom_all_reduce(t)
    assert out is not None and out.data_ptr() != t.data_ptr() and (out == 3).all() and (t == rank + 1).all()
    assert ca.custom_all_reduce(torch.ones(3)) is None  # the caller falls back
    given = torch.empty_like(t)
    assert ca.all_reduce(t, out=given) is given and (given == 3).all()
    assert not ca.should_custom_all_gather(t) and ca.custom_all_gather(t) is None
    assert not ca.should_custom_reduce_scatter(t) and ca.custom_reduce_scatter(t) is None
    with ca.capture():
        assert ca._IS_CAPTURING
    assert not ca._IS_CAPTURING
    ca.close()
    ca.close()
    assert ca.disabled and ca.custom_all_reduce(t) is None
    print(f"RESULT ok {rank}")
    """
)


def test_the_vllm_class_and_the_bootstrap_on_two_cpu_processes(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_CODE, encoding="utf-8")
    store = tmp_path / "store"
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(store), str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
        )
        for rank in range(2)
    ]
    outs = []
    for p in ranks:
        try:
            outs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            for q in ranks:
                q.kill()
            raise
    for rank, (p, out) in enumerate(zip(ranks, outs)):
        assert p.returncode == 0 and f"RESULT ok {rank}" in out, out
