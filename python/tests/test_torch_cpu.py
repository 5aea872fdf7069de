"""With torch on CPU (``-m torch``; no GPU, no vLLM): the process-group bootstrap over gloo (bytes as tensors, no
pickles, also under ``torch.inference_mode``) and ``anyccl.vllm.AnycclCustomAllreduce`` on the host backend with 2
processes: vLLM's predicate limits, the out-of-place result, capture() and close(); ``AnycclPyNcclCommunicator``
(vLLM's PyNcclCommunicator conventions) on CPU tensors: out-of-place all-reduce with ``ReduceOp``, output-first
all-gather and reduce-scatter, the v-variants, broadcast, send/recv, groups, ``batch_isend_irecv`` and destroy();
``Communicator`` on CPU tensors of every dtype torch and anyccl share, against gloo's results."""

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


PYNCCL_CODE = textwrap.dedent(
    """
    import sys
    import torch, torch.distributed as dist
    from torch.distributed import ReduceOp
    import anyccl
    from anyccl.vllm import AnycclPyNcclCommunicator

    rank, world = int(sys.argv[2]), 2
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=world)
    pc = AnycclPyNcclCommunicator(dist.group.WORLD, "cpu")
    assert pc.available and not pc.disabled and pc.rank == rank and pc.world_size == world

    # all_reduce: out of place, a new tensor (or the one given), ReduceOp and anyccl's names.
    x = torch.arange(8, dtype=torch.float32) + rank
    y = pc.all_reduce(x)
    assert y is not None and y.data_ptr() != x.data_ptr()
    assert torch.equal(y, torch.arange(8, dtype=torch.float32) * 2 + 1) and torch.equal(x, torch.arange(8.0) + rank)
    given = torch.empty(8)
    assert pc.all_reduce(x, given, ReduceOp.MAX) is given and torch.equal(given, torch.arange(8.0) + 1)
    assert torch.equal(pc.all_reduce(x, op=ReduceOp.MIN), torch.arange(8.0))
    assert torch.equal(pc.all_reduce(x, op="prod"), torch.arange(8.0) * (torch.arange(8.0) + 1))
    try:
        pc.all_reduce(x, op=ReduceOp.BAND)
        raise SystemExit("ReduceOp.BAND was taken")
    except ValueError as e:
        assert "op=" in str(e), e
    try:
        pc.all_reduce(torch.ones(2, device="meta"))
        raise SystemExit("a tensor on another device was taken")
    except AssertionError as e:
        assert "created to work on cpu" in str(e), e

    # Output first: all_gather and reduce_scatter; bf16 and int64 too.
    out = torch.empty(2, 3, dtype=torch.bfloat16)
    pc.all_gather(out, torch.full((3,), float(rank + 1), dtype=torch.bfloat16))
    assert out.tolist() == [[1.0] * 3, [2.0] * 3], out
    rs_in = torch.arange(6, dtype=torch.int64) * (rank + 1)
    rs_out = torch.empty(3, dtype=torch.int64)
    pc.reduce_scatter(rs_out, rs_in)
    assert rs_out.tolist() == [3 * v for v in range(3 * rank, 3 * rank + 3)], rs_out

    # The v-variants: rank 0 has 1 row, rank 1 has 3 (rows of 2).
    sizes = [1, 3]
    mine = torch.full((sizes[rank], 2), float(rank + 1))
    gv = torch.empty(4, 2)
    pc.all_gatherv(gv, mine, sizes)
    assert gv.tolist() == [[1.0, 1.0]] + [[2.0, 2.0]] * 3, gv
    src = torch.arange(8, dtype=torch.float32).reshape(4, 2) * (rank + 1)
    before = src.clone()
    rv = torch.empty(sizes[rank], 2)
    pc.reduce_scatterv(rv, src, sizes)
    full = torch.arange(8, dtype=torch.float32).reshape(4, 2) * 3
    assert torch.equal(rv, full[:1] if rank == 0 else full[1:]), rv
    assert torch.equal(src, before)  # the input is left as it was

    # reduce to one root (the other rank's output left as it was) and scatter from one root.
    red_out = torch.full((3,), -1.0)
    pc.reduce(red_out, torch.full((3,), float(rank + 1)), 1, ReduceOp.SUM)
    assert red_out.tolist() == ([-1.0] * 3 if rank == 0 else [3.0] * 3), red_out
    sc_out = torch.zeros(sizes[rank], 2)
    pc.scatter(sc_out, torch.arange(8, dtype=torch.float32).reshape(4, 2), sizes, root=0)
    assert torch.equal(sc_out, torch.arange(8, dtype=torch.float32).reshape(4, 2)[:1] if rank == 0
                       else torch.arange(8, dtype=torch.float32).reshape(4, 2)[1:]), sc_out

    # broadcast in place, send / recv.
    b = torch.full((5,), float(rank))
    pc.broadcast(b, 1)
    assert torch.equal(b, torch.ones(5))
    if rank == 0:
        pc.send(torch.arange(4, dtype=torch.float32), 1)
    else:
        r = torch.zeros(4)
        pc.recv(r, 0)
        assert torch.equal(r, torch.arange(4.0))

    # A group: both ranks send first, then receive (pairs only because the group runs as one).
    peer = 1 - rank
    inbox = torch.zeros(1000)
    pc.group_start()
    pc.send(torch.full((1000,), float(rank + 10)), peer)
    pc.recv(inbox, peer)
    held = pc.all_reduce(torch.ones(4))
    assert torch.equal(inbox, torch.zeros(1000))  # held until group_end
    pc.group_end()
    assert torch.equal(inbox, torch.full((1000,), float(peer + 10))) and torch.equal(held, torch.full((4,), 2.0))

    # batch_isend_irecv with torch's P2POp, receives listed first on one rank and last on the other.
    a_in, a_out = torch.zeros(64), torch.full((64,), float(rank))
    ops = [dist.P2POp(dist.isend, a_out, peer), dist.P2POp(dist.irecv, a_in, peer)]
    pc.batch_isend_irecv(ops if rank == 0 else ops[::-1])
    assert torch.equal(a_in, torch.full((64,), float(peer)))

    assert pc.register_comm_window(x) is None and pc.deregister_comm_window(None) is None
    pc.suspend()
    pc.resume()
    pc.destroy()
    pc.destroy()
    assert pc.disabled and pc.all_reduce(x) is None

    # from_unique_id_bytes: an anyccl unique id moved over the gloo group, no process group in the communicator.
    box = [anyccl.unique_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    pu = AnycclPyNcclCommunicator.from_unique_id_bytes(box[0], rank, world, "cpu")
    assert pu.group is None and pu.available and torch.equal(pu.all_reduce(torch.ones(3)), torch.full((3,), 2.0))
    pu.destroy()
    print(f"RESULT ok {rank}")
    """
)


def run_two(tmp_path: Path, code: str) -> None:
    script = tmp_path / "rank.py"
    script.write_text(code, encoding="utf-8")
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


def test_the_vllm_class_and_the_bootstrap_on_two_cpu_processes(tmp_path: Path) -> None:
    run_two(tmp_path, RANK_CODE)


def test_the_pynccl_shaped_class_on_two_cpu_processes(tmp_path: Path) -> None:
    run_two(tmp_path, PYNCCL_CODE)
