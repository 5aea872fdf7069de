"""The fused all-reduce + residual add + RMSNorm from Python on the host backend: the result against NumPy, every
form giving the same bits, the fp8 output, the errors (nothing written), and ranks as processes."""

from __future__ import annotations

import traceback
from typing import Any, Iterator, Optional

import numpy as np
import pytest

import anyccl
from test_host import _run_processes

EPS = 1e-6


@pytest.fixture
def comm() -> Iterator[anyccl.Communicator]:
    with anyccl.Communicator.from_unique_id(anyccl.unique_id(), 0, 1, backend="host") as c:
        yield c


def _data(tokens: int, hidden: int, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, size=(tokens, hidden)).astype(np.float16)


def _reference(inputs: Any, residual: Any, weight: Any, scale: Optional[float] = None) -> Any:
    """The new residual (f16) and the output (f32 before its final rounding) as the call defines them: the
    all-reduce's result (an f32 sum in rank order, rounded once), plus the residual (in f32, rounded once)."""
    reduced = sum(x.astype(np.float32) for x in inputs).astype(np.float16)
    r16 = (reduced.astype(np.float32) + residual.astype(np.float32)).astype(np.float16)
    rf = r16.astype(np.float32)
    y = rf / np.sqrt(np.mean(rf * rf, axis=-1, keepdims=True) + EPS) * weight.astype(np.float32)
    return r16, (y if scale is None else y / scale)


def _e4m3(codes: Any) -> Any:
    """fp8 e4m3 (fn) codes as f32."""
    c = codes.astype(np.int32)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e, m = (c >> 3) & 0xF, c & 0x7
    normal = (1.0 + m / 8.0) * np.exp2(e.astype(np.float64) - 7)
    sub = (m / 8.0) * 2.0**-6
    return (sign * np.where(e == 0, sub, normal)).astype(np.float32)


def test_every_form_matches_numpy_with_the_same_bits(comm: anyccl.Communicator) -> None:
    tokens, hidden = 3, 64
    x, res0, w = _data(tokens, hidden, 1), _data(tokens, hidden, 2), _data(1, hidden, 3)[0]
    want_res, want_out = _reference([x], res0, w)
    outs = []
    # The fused push one-shot is a GPU form (its receive buffers live on the device): the host refuses it by name,
    # changing nothing; every other form runs.
    res = res0.copy()
    with pytest.raises(anyccl.Error, match="fused-push"):
        comm.all_reduce_rmsnorm(x, res, w, eps=EPS, form="fused-push")
    np.testing.assert_array_equal(res, res0)
    for form in [f for f in anyccl.RMSNORM_FORMS if f != "fused-push"]:
        res = res0.copy()
        out = comm.all_reduce_rmsnorm(x, res, w, eps=EPS, form=form)
        assert out.shape == x.shape and out.dtype == np.float16
        np.testing.assert_array_equal(res, want_res)
        np.testing.assert_allclose(out.astype(np.float32), want_out, rtol=1e-2, atol=1e-2)
        sel = comm.last_rmsnorm_selection
        assert sel is not None and sel["form"] == form and sel["why"], sel
        outs.append(out.tobytes())
    assert len(set(outs)) == 1, "every form gives the same bits"
    res = res0.copy()
    given = np.zeros_like(x)
    assert comm.all_reduce_rmsnorm(x, res, w, given, eps=EPS) is given
    assert given.tobytes() == outs[0]
    sel = comm.last_rmsnorm_selection
    assert sel is not None and sel["form"] in anyccl.RMSNORM_FORMS


def test_the_fp8_output(comm: anyccl.Communicator) -> None:
    tokens, hidden = 2, 32
    x, res, w = _data(tokens, hidden, 4), _data(tokens, hidden, 5), _data(1, hidden, 6)[0]
    _, want = _reference([x], res.copy(), w, scale=0.5)
    out = comm.all_reduce_rmsnorm(x, res, w, eps=EPS, fp8_scale=0.5)
    assert out.dtype == np.uint8 and out.shape == x.shape
    np.testing.assert_allclose(_e4m3(out), np.clip(want, -448, 448), rtol=0.07, atol=0.02)


def test_bad_calls_are_refused_and_write_nothing(comm: anyccl.Communicator) -> None:
    x, w = _data(2, 16, 7), _data(1, 16, 8)[0]
    res = _data(2, 16, 9)
    keep = res.copy()
    out = np.full((2, 16), 7, dtype=np.float16)
    with pytest.raises(ValueError) as e:
        comm.all_reduce_rmsnorm(x, res, w, out, form="three-shot")
    assert isinstance(e.value, anyccl.InvalidArgumentError)
    for name in anyccl.RMSNORM_FORMS:
        assert name in e.value.message
    with pytest.raises(anyccl.InvalidArgumentError, match="hidden is 12, but it must be a multiple of 8"):
        comm.all_reduce_rmsnorm(_data(2, 12, 1), _data(2, 12, 2), _data(1, 12, 3)[0])
    with pytest.raises(anyccl.InvalidArgumentError, match="takes f16 and bf16"):
        f32 = np.ones((2, 16), dtype=np.float32)
        comm.all_reduce_rmsnorm(f32, f32.copy(), np.ones(16, dtype=np.float32))
    with pytest.raises(anyccl.InvalidArgumentError, match="not rows of weight"):
        comm.all_reduce_rmsnorm(x, res, _data(1, 24, 3)[0], out)
    with pytest.raises(anyccl.InvalidArgumentError, match="out: holds 32 bytes, the call needs 64"):
        comm.all_reduce_rmsnorm(x, res, w, np.zeros(16, dtype=np.float16))
    ro = res.copy()
    ro.setflags(write=False)
    with pytest.raises(anyccl.InvalidArgumentError, match="residual.*read-only"):
        comm.all_reduce_rmsnorm(x, ro, w, out)
    with pytest.raises(anyccl.InvalidArgumentError, match="eps is NaN"):
        comm.all_reduce_rmsnorm(x, res, w, out, eps=float("nan"))
    with pytest.raises(anyccl.InvalidArgumentError, match="fp8 scale is 0"):
        comm.all_reduce_rmsnorm(x, res, w, np.zeros((2, 16), dtype=np.uint8), fp8_scale=0.0)
    np.testing.assert_array_equal(res, keep)
    assert np.all(out == 7)
    assert comm.last_rmsnorm_selection is None


def test_form_names_are_read_by_anyccl_s_own_parser(comm: anyccl.Communicator) -> None:
    """``form=`` reads names as anyccl does (ANYCCL_FUSED_RMSNORM, selector tables): ``push`` names the fused push
    form like ``fused-push`` (the host refuses both with the same error, not as an unknown name), the other aliases
    run their forms, and an unknown name still raises ``AlgorithmNameError`` listing the forms."""
    x, res0, w = _data(2, 16, 11), _data(2, 16, 12), _data(1, 16, 13)[0]
    errors = set()
    for name in ("fused-push", "push", "PUSH", "Fused_Push"):
        res = res0.copy()
        with pytest.raises(anyccl.Error) as e:
            comm.all_reduce_rmsnorm(x, res, w, eps=EPS, form=name)
        assert not isinstance(e.value, anyccl.AlgorithmNameError), (name, e.value)
        assert "fused-push" in str(e.value), (name, e.value)
        errors.add((type(e.value), str(e.value)))
        np.testing.assert_array_equal(res, res0)
    assert len(errors) == 1, errors
    for alias, form in (("one-shot", "fused-one-shot"), ("Two_Shot", "fused-two-shot"), (" UNFUSED ", "unfused")):
        comm.all_reduce_rmsnorm(x, res0.copy(), w, eps=EPS, form=alias)
        sel = comm.last_rmsnorm_selection
        assert sel is not None and sel["form"] == form, (alias, sel)
    with pytest.raises(ValueError) as bad:
        comm.all_reduce_rmsnorm(x, res0.copy(), w, eps=EPS, form="pushy")
    assert isinstance(bad.value, anyccl.AlgorithmNameError)
    assert "form='pushy': expected one of" in bad.value.message, bad.value.message
    for name in anyccl.RMSNORM_FORMS:
        assert name in bad.value.message, name


def _rmsnorm_rank(uid: bytes, rank: int, world: int, results: Any) -> None:
    try:
        with anyccl.Communicator.from_unique_id(uid, rank, world, backend="host", timeout=30) as c:
            x = _data(4, 32, 10 + rank)
            res = _data(4, 32, 99)  # the same residual on every rank
            w = _data(1, 32, 98)[0]
            out = c.all_reduce_rmsnorm(x, res, w, eps=EPS)
            results.put((rank, "ok", (res.tobytes(), out.tobytes())))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def test_the_fused_call_across_processes() -> None:
    world = 2
    got = _run_processes(world, _rmsnorm_rank, anyccl.unique_id())
    want_res, want_out = _reference([_data(4, 32, 10 + r) for r in range(world)], _data(4, 32, 99), _data(1, 32, 98)[0])
    for res, out in got:
        np.testing.assert_array_equal(np.frombuffer(res, dtype=np.float16).reshape(4, 32), want_res)
        o = np.frombuffer(out, dtype=np.float16).reshape(4, 32).astype(np.float32)
        np.testing.assert_allclose(o, want_out, rtol=1e-2, atol=1e-2)
    assert got[0] == got[1], "every rank holds the same residual and output"
