"""torch on a CUDA GPU: world 1 eager, torch.cuda.graph capture + replay, torch.compile, the custom ops, the
ProcessGroup bootstrap, the vLLM-shaped communicator (also at TP2 on CPU tensors over gloo).

Selected only with ``-m gpu`` (pytest.ini deselects the marker otherwise, so a plain run reports these as
deselected, never as passed). Selected, the tests FAIL, not skip, when torch or a CUDA GPU is missing.

    python -m pytest -m gpu python/tests/test_torch_gpu.py
"""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Any, Iterator

import pytest

import anyccl

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def torch() -> Any:
    try:
        import torch
    except ImportError as e:  # selected with -m gpu: a missing torch is a failure
        pytest.fail(f"the gpu tests need torch: {e}")
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA GPU (torch.cuda.is_available() is False)")
    assert anyccl.CUDA_COMPILED_IN, "this anyccl wheel was built without the cuda feature"
    return torch


@pytest.fixture(scope="module")
def comm(torch: Any) -> Iterator[anyccl.Communicator]:
    torch.cuda.set_device(0)
    with anyccl.Communicator.from_unique_id(anyccl.unique_id(), 0, 1, backend="cuda", device=0) as c:
        assert c.backend == "cuda" and c.device_index == 0, c
        yield c


@pytest.fixture(scope="module")
def ops(torch: Any, comm: anyccl.Communicator) -> int:
    from anyccl import torch_ops

    return torch_ops.register(comm)


DTYPES = ["float32", "bfloat16", "float16", "int32", "float64"]


@pytest.mark.parametrize("name", DTYPES)
def test_eager_collectives_at_world_one(torch: Any, comm: anyccl.Communicator, name: str) -> None:
    dtype = getattr(torch, name)
    x = (torch.arange(4096, device="cuda") % 97).to(dtype)
    ref = x.clone()
    assert comm.all_reduce(x) is x
    torch.cuda.synchronize()
    assert torch.equal(x, ref)
    out = torch.empty_like(x)
    comm.all_reduce(x, out=out, op="max")
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    assert comm.last_selection is not None and comm.last_selection["algorithm"]
    g = comm.all_gather(x)
    rs = comm.reduce_scatter(x)
    comm.broadcast(x, root=0)
    comm.reduce(x, root=0)
    torch.cuda.synchronize()
    assert torch.equal(g, ref) and torch.equal(rs, ref) and torch.equal(x, ref)


def test_the_stream_given_is_the_stream_used(torch: Any, comm: anyccl.Communicator) -> None:
    s = torch.cuda.Stream()
    x = torch.ones(1 << 20, device="cuda")
    with torch.cuda.stream(s):
        comm.all_reduce(x)  # on s, torch's current stream here
    comm.all_reduce(x, stream=s)
    s.synchronize()
    assert torch.all(x == 1)


def test_tensors_are_checked_before_the_call(torch: Any, comm: anyccl.Communicator) -> None:
    x = torch.ones(64, 64, device="cuda")
    with pytest.raises(anyccl.InvalidArgumentError, match="not contiguous"):
        comm.all_reduce(x.t())
    with pytest.raises(anyccl.InvalidArgumentError, match="no anyccl data type"):
        comm.all_reduce(torch.ones(4, device="cuda", dtype=torch.complex64))
    with pytest.raises(anyccl.InvalidArgumentError, match="holds .* bytes|needs"):
        comm.all_reduce(torch.ones(8, device="cuda"), out=torch.empty(4, device="cuda"))
    with pytest.raises(anyccl.InvalidArgumentError, match="send is f32 but recv is bf16"):
        comm.all_reduce(torch.ones(8, device="cuda"), out=torch.empty(8, device="cuda", dtype=torch.bfloat16))

    class Sub(torch.Tensor):
        pass

    with pytest.raises(anyccl.InvalidArgumentError, match="plain torch.Tensor"):
        comm.all_reduce(torch.ones(4, device="cuda").as_subclass(Sub))
    with pytest.raises(anyccl.InvalidArgumentError, match="torch.cuda.Stream"):
        comm.all_reduce(torch.ones(4, device="cuda"), stream=12345)
    assert comm.should_all_reduce(torch.ones(1024, device="cuda", dtype=torch.bfloat16))
    assert not comm.should_all_reduce(x.t())
    assert not comm.should_all_reduce(torch.ones(4, device="cuda", dtype=torch.complex64))
    assert not comm.should_all_reduce(torch.ones(4))
    if torch.cuda.device_count() > 1:
        with pytest.raises(anyccl.InvalidArgumentError, match="cuda:1"):
            comm.all_reduce(torch.ones(4, device="cuda:1"))


def test_host_arrays_on_a_cuda_communicator_are_staged(torch: Any, comm: anyccl.Communicator) -> None:
    import numpy as np

    a = np.arange(10, dtype=np.float32)
    comm.all_reduce(a)
    np.testing.assert_array_equal(a, np.arange(10, dtype=np.float32))
    t = torch.arange(6, dtype=torch.float64)  # a CPU tensor goes through NumPy
    comm.all_reduce(t)
    assert torch.equal(t, torch.arange(6, dtype=torch.float64))


def test_capabilities_are_a_plain_dict(comm: anyccl.Communicator) -> None:
    caps = comm.capabilities()
    assert caps["backend"] == "cuda" and caps["world_size"] == 1
    assert "NCCL" in (caps["library"] or "")
    assert caps["arch"].startswith("sm_")


def test_custom_ops_eager(torch: Any, ops: int) -> None:
    x = torch.randn(1000, device="cuda")
    y = torch.ops.anyccl.all_reduce(x, ops, "sum")
    torch.ops.anyccl.all_reduce_(x, ops, "sum")
    torch.cuda.synchronize()
    assert torch.equal(x, y) and y.data_ptr() != x.data_ptr()


def test_cuda_graph_capture_and_replay(torch: Any, comm: anyccl.Communicator, ops: int) -> None:
    x = torch.zeros(1 << 16, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up outside capture, as torch asks
        for _ in range(2):
            torch.ops.anyccl.all_reduce(x, ops, "sum")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with comm.capture():
        with torch.cuda.graph(graph):
            y = torch.ops.anyccl.all_reduce(x * 2, ops, "sum")
            comm.all_reduce(x)  # in place, the method itself
    assert comm.pending_graph_buffers == 0
    for value in (1.0, 3.0, -2.0):
        x.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.all(y == 2 * value), (value, y[:4])
        assert torch.all(x == value)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_torch_compile(torch: Any, ops: int, mode: Any) -> None:
    def f(x: Any) -> Any:
        return torch.ops.anyccl.all_reduce(x * 2, ops, "sum") + 1

    compiled = torch.compile(f, fullgraph=True, mode=mode)
    for _ in range(3):
        x = torch.randn(4096, device="cuda")
        assert torch.allclose(compiled(x), x * 2 + 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_process_group_bootstrap_and_the_vllm_communicator(torch: Any) -> None:
    import torch.distributed as dist

    from anyccl.vllm import AnycclDeviceCommunicator

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            vc = AnycclDeviceCommunicator(dist.group.WORLD, device=torch.device("cuda", 0))
            assert vc.comm.backend == "cuda"
            x = torch.randn(8, 6, device="cuda", dtype=torch.bfloat16)
            assert vc.should_custom_ar(x)
            assert torch.equal(vc.all_reduce(x), x)
            assert torch.equal(vc.custom_all_reduce(x), x)
            assert torch.equal(vc.all_gather(x, dim=1), x)
            assert torch.equal(vc.reduce_scatter(x, dim=0), x)
            compiled = torch.compile(lambda t: vc.all_reduce(t) * 3, fullgraph=True)
            assert torch.equal(compiled(x), x * 3)
            vc.destroy()
            vc.destroy()
            assert vc.comm.closed and not vc.should_custom_ar(x)
        finally:
            dist.destroy_process_group()


def test_from_env_at_world_one(torch: Any, tmp_path: Any) -> None:
    import subprocess
    import sys

    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    code = (
        "import torch, anyccl\n"
        "c = anyccl.Communicator.from_env()\n"
        "x = torch.ones(16, device='cuda')\n"
        "c.all_reduce(x); torch.cuda.synchronize()\n"
        "print('RESULT', c.backend, c.rank, c.world_size, float(x.sum()))\n"
        "c.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "RESULT cuda 0 1 16.0" in out.stdout, out.stdout + out.stderr


def _tp2_rank(rank: int, world: int, store_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from anyccl.vllm import AnycclDeviceCommunicator

    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world)
    try:
        vc = AnycclDeviceCommunicator(dist.group.WORLD, device=torch.device("cpu"))
        assert vc.comm.backend == "host"
        x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 100 * rank
        ref_ar = sum(torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 100 * r for r in range(world))
        assert torch.equal(vc.all_reduce(x), ref_ar)
        parts = [torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 100 * r for r in range(world)]
        for dim in (0, 1, -1):
            assert torch.equal(vc.all_gather(x, dim=dim), torch.cat(parts, dim=dim)), dim
        y = torch.arange(2 * 4 * world, dtype=torch.float32).reshape(2, 4 * world) * (rank + 1)
        full = sum(torch.arange(2 * 4 * world, dtype=torch.float32).reshape(2, 4 * world) * (r + 1) for r in range(world))
        assert torch.equal(vc.reduce_scatter(y, dim=-1), full.chunk(world, dim=-1)[rank])
        if rank == 0:
            vc.send(torch.full((3,), 7.0))
        else:
            assert torch.equal(vc.recv(torch.Size([3]), torch.float32), torch.full((3,), 7.0))
        vc.destroy()
    finally:
        dist.destroy_process_group()


def test_vllm_communicator_at_tp2_over_gloo_on_cpu_tensors(torch: Any) -> None:
    import torch.multiprocessing as tmp

    with tempfile.TemporaryDirectory() as d:
        tmp.spawn(_tp2_rank, args=(2, d), nprocs=2, join=True)


# ---- all-reduce options and DLPack input ----------------------------------------------------------------------------


def test_a_named_algorithm_on_cuda(torch: Any, comm: anyccl.Communicator, ops: int) -> None:
    x = (torch.arange(8192, device="cuda") % 31).to(torch.bfloat16)
    ref = x.clone()
    comm.all_reduce(x, algorithm="ccl")
    torch.cuda.synchronize()
    assert torch.equal(x, ref)
    assert comm.last_selection == {"algorithm": "ccl", "why": 'named by the caller (algorithm="ccl")'}
    with pytest.raises(ValueError, match="two-shot-fp8"):  # the list of names
        comm.all_reduce(x, algorithm="fp8")
    # The quantized all-reduce: eligible here or refused with the reason, never silently something else.
    try:
        comm.select_all_reduce(x.numel(), "bf16", algorithm="two-shot-fp8")
        eligible = True
    except anyccl.UnsupportedError as e:
        eligible, why = False, e.message
    out = torch.empty_like(x)
    if eligible:
        comm.all_reduce(x, out=out, algorithm="two-shot-fp8")
        torch.cuda.synchronize()
        assert comm.last_selection is not None and comm.last_selection["algorithm"] == "two-shot-fp8"
        assert torch.allclose(out.float(), ref.float(), rtol=0.07, atol=0.07)
    else:
        assert "two-shot-fp8" in why
        with pytest.raises(anyccl.UnsupportedError, match="two-shot-fp8"):
            comm.all_reduce(x, out=out, algorithm="two-shot-fp8")
        assert not comm.should_all_reduce(x, algorithm="two-shot-fp8")
    # The custom op carries the name too (eager and compiled).
    y = torch.ops.anyccl.all_reduce(x, ops, "sum", "ccl")
    compiled = torch.compile(lambda t: torch.ops.anyccl.all_reduce(t, ops, "sum", "ccl") + 1, fullgraph=True)
    torch.cuda.synchronize()
    assert torch.equal(y, ref) and torch.equal(compiled(x), ref + 1)


def test_deterministic_mode_on_cuda(torch: Any, comm: anyccl.Communicator) -> None:
    x = torch.ones(4096, device="cuda")
    comm.deterministic = True
    try:
        assert comm.capabilities()["deterministic"] is True
        with pytest.raises(anyccl.UnsupportedError, match="not deterministic"):
            comm.all_reduce(x, algorithm="ccl")
        try:
            comm.all_reduce(x)
            torch.cuda.synchronize()
            sel = comm.last_selection
            assert sel is not None and sel["algorithm"] in ("one-shot", "two-shot", "one-shot-push"), sel
            assert torch.all(x == 1)
        except anyccl.UnsupportedError as e:  # no deterministic algorithm at world 1 here: the reasons say so
            assert "not deterministic" in e.message, e.message
    finally:
        comm.deterministic = False
    assert comm.deterministic is False


class _DLOnly:
    """A CUDA array reachable through DLPack only (as CuPy's or JAX's are)."""

    def __init__(self, t: Any) -> None:
        self.t = t
        self.calls: list = []

    def __dlpack__(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        return self.t.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self.t.__dlpack_device__()


def test_dlpack_cuda_arrays(torch: Any, comm: anyccl.Communicator) -> None:
    x = torch.arange(1 << 16, device="cuda", dtype=torch.float32)
    ref = x.clone()
    d = _DLOnly(x)
    assert comm.all_reduce(d) is d  # no stream: the legacy default stream (sentinel 1), waited for
    assert d.calls and d.calls[0].get("stream") == 1, d.calls
    assert torch.equal(x, ref)
    out = torch.zeros_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    e = _DLOnly(x)
    comm.all_reduce(e, out=out, stream=s)  # a stream given: made ready on it and run on it
    assert e.calls[0].get("stream") == s.cuda_stream, e.calls
    s.synchronize()
    assert torch.equal(out, ref)
    out2 = _DLOnly(torch.zeros_like(x))
    comm.all_reduce(_DLOnly(x), out=out2, op="max")
    assert torch.equal(out2.t, ref)
    with pytest.raises(ValueError, match="not contiguous"):
        comm.all_reduce(_DLOnly(torch.ones(64, 64, device="cuda").t()))
    with pytest.raises(TypeError, match="no anyccl data type"):
        comm.all_reduce(_DLOnly(torch.ones(4, device="cuda", dtype=torch.int16)))
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="cuda:1"):
            comm.all_reduce(_DLOnly(torch.ones(4, device="cuda:1")))


# ---- the fused all-reduce + residual add + RMSNorm -----------------------------------------------------------------


def _rmsnorm_reference(torch: Any, x: Any, res: Any, w: Any, eps: float) -> Any:
    r = (x.float() + res.float()).to(x.dtype).float()
    return r.to(x.dtype), (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * w.float())


def test_fused_rmsnorm_on_cuda(torch: Any, comm: anyccl.Communicator, ops: int) -> None:
    tokens, hidden, eps = 16, 4096, 1e-6
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    res0 = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(hidden, device="cuda", generator=g).to(torch.bfloat16)
    want_res, want_out = _rmsnorm_reference(torch, x, res0, w, eps)
    if comm.world_size == 1:
        # The GPU forms need 2..=8 ranks (the custom kernels, off at world 1): at world 1 every form is refused,
        # through the method and the custom op alike, and nothing is written.
        res = res0.clone()
        with pytest.raises(anyccl.Error, match="no form of all_reduce_rmsnorm can run this call"):
            comm.all_reduce_rmsnorm(x, res, w, eps=eps)
        with pytest.raises(Exception, match="no form of all_reduce_rmsnorm can run this call"):
            torch.ops.anyccl.all_reduce_rmsnorm(x, res, w, ops, eps)
        torch.cuda.synchronize()
        assert torch.equal(res, res0)
        return
    res = res0.clone()
    out = comm.all_reduce_rmsnorm(x, res, w, eps=eps)
    torch.cuda.synchronize()
    sel = comm.last_rmsnorm_selection
    assert sel is not None and sel["form"] in anyccl.RMSNORM_FORMS and sel["why"], sel
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.equal(res, want_res)
    assert torch.allclose(out.float(), want_out, rtol=2e-2, atol=2e-2)
    ran = {}
    for form in anyccl.RMSNORM_FORMS:  # each form runs with the same bits, or is refused with the reason
        r = res0.clone()
        try:
            o = comm.all_reduce_rmsnorm(x, r, w, eps=eps, form=form)
        except anyccl.UnsupportedError as e:
            assert form in e.message or "fused" in e.message, e.message
            continue
        torch.cuda.synchronize()
        assert comm.last_rmsnorm_selection["form"] == form
        ran[form] = o
        assert torch.equal(o, out) and torch.equal(r, want_res), form
    assert ran, "no form ran"
    # fp8 output
    r = res0.clone()
    o8 = comm.all_reduce_rmsnorm(x, r, w, eps=eps, fp8_scale=0.25)
    torch.cuda.synchronize()
    assert o8.dtype == torch.float8_e4m3fn
    assert torch.allclose(o8.float(), (want_out / 0.25).clamp(-448, 448), rtol=0.07, atol=0.05)
    # The custom op: eager, compiled, and captured into a CUDA graph.
    r = res0.clone()
    y = torch.ops.anyccl.all_reduce_rmsnorm(x, r, w, ops, eps)
    torch.cuda.synchronize()
    assert torch.equal(y, out) and torch.equal(r, want_res)

    def f(a: Any, b: Any) -> Any:
        return torch.ops.anyccl.all_reduce_rmsnorm(a, b, w, ops, eps) * 1

    r = res0.clone()
    assert torch.equal(torch.compile(f, fullgraph=True)(x, r), out) and torch.equal(r, want_res)
    r = res0.clone()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.anyccl.all_reduce_rmsnorm(x, r.clone(), w, ops, eps)  # warm up outside capture
    torch.cuda.current_stream().wait_stream(s)
    with comm.capture():
        with torch.cuda.graph(graph):
            yg = torch.ops.anyccl.all_reduce_rmsnorm(x, r, w, ops, eps)
    r.copy_(res0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, out) and torch.equal(r, want_res)
    with pytest.raises(ValueError, match="fused-one-shot"):
        comm.all_reduce_rmsnorm(x, res0.clone(), w, form="three-shot")


def test_the_vllm_communicator_fused_call(torch: Any) -> None:
    import torch.distributed as dist

    from anyccl.vllm import AnycclDeviceCommunicator

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            vc = AnycclDeviceCommunicator(dist.group.WORLD, device=torch.device("cuda", 0), deterministic=True)
            assert vc.comm.deterministic
            x = torch.randn(4, 1024, device="cuda", dtype=torch.float16)
            res = torch.randn(4, 1024, device="cuda", dtype=torch.float16)
            w = torch.ones(1024, device="cuda", dtype=torch.float16)
            # World 1: the GPU forms need the custom kernels (2..=8 ranks); the call is refused and writes nothing.
            res0 = res.clone()
            with pytest.raises(Exception, match="no form of all_reduce_rmsnorm can run this call"):
                vc.all_reduce_rmsnorm(x, res, w, 1e-6)
            torch.cuda.synchronize()
            assert torch.equal(res, res0)
            vc.destroy()
        finally:
            dist.destroy_process_group()
