"""All-reduce options from Python: ``algorithm=`` (core's algorithm names; a bad name is a ValueError listing them,
an ineligible one anyccl's UnsupportedError with the reason and hint, the buffer untouched) and deterministic mode
(at construction, as a property, in the capability report, and what it refuses)."""

from __future__ import annotations

import traceback
from typing import Any, Dict, Iterator

import numpy as np
import pytest

import anyccl
from test_host import _run_processes


@pytest.fixture
def comm() -> Iterator[anyccl.Communicator]:
    with anyccl.Communicator.from_unique_id(anyccl.unique_id(), 0, 1, backend="host") as c:
        yield c


def test_the_algorithm_names_are_cores_with_the_lossy_ones_marked() -> None:
    for name in ("ccl", "one-shot", "two-shot", "ring", "one-shot-push", "two-shot-push", "two-shot-fp8", "two-shot-int8"):
        assert name in anyccl.ALGORITHMS, name
    assert anyccl.ALGORITHMS["two-shot-fp8"] and anyccl.ALGORITHMS["two-shot-int8"]
    assert not anyccl.ALGORITHMS["one-shot"] and not anyccl.ALGORITHMS["ccl"]


def test_an_unknown_algorithm_is_a_value_error_listing_the_names(comm: anyccl.Communicator) -> None:
    x = np.full(4, 2.0, dtype=np.float32)
    with pytest.raises(ValueError) as e:
        comm.all_reduce(x, out=np.zeros(4, dtype=np.float32), algorithm="three-shot")
    assert isinstance(e.value, anyccl.InvalidArgumentError) and isinstance(e.value, anyccl.AlgorithmNameError)
    assert "algorithm='three-shot'" in e.value.message
    for name in anyccl.ALGORITHMS:
        assert name in e.value.message, name
    with pytest.raises(ValueError, match="three-shot"):
        comm.select_all_reduce(16, "f32", algorithm="three-shot")
    with pytest.raises(ValueError, match="three-shot"):
        comm.should_all_reduce(x, algorithm="three-shot")
    np.testing.assert_array_equal(x, np.full(4, 2.0, dtype=np.float32))


def test_algorithm_names_are_read_by_anyccl_s_own_parser(comm: anyccl.Communicator) -> None:
    """``algorithm=`` reads names as anyccl's parser does (any case, ``_`` or ``-``): every spelling of a name is the
    same algorithm, so it gives the same answer; ``push`` is not an algorithm's name there (only the fused form's
    parser takes it: see test_rmsnorm), so it is refused as unknown, listing the names."""
    for name in anyccl.ALGORITHMS:
        want = _answer(comm, name)
        for spelling in (name.upper(), name.replace("-", "_"), f" {name} "):
            assert _answer(comm, spelling) == want, (name, spelling)
    with pytest.raises(ValueError) as e:
        comm.select_all_reduce(16, "f32", algorithm="push")
    assert isinstance(e.value, anyccl.AlgorithmNameError)
    assert "algorithm='push': expected one of" in e.value.message and "one-shot-push" in e.value.message


def _answer(comm: anyccl.Communicator, algorithm: str) -> Any:
    """What ``select_all_reduce`` says for ``algorithm`` on 16 f32: the selection, or the error's type and text."""
    try:
        return comm.select_all_reduce(16, "f32", algorithm=algorithm)
    except anyccl.Error as e:
        return (type(e), str(e))


def test_a_named_algorithm_runs_and_is_reported_as_named(comm: anyccl.Communicator) -> None:
    x = np.arange(6, dtype=np.float64)
    out = np.zeros(6, dtype=np.float64)
    assert comm.all_reduce(x, out=out, algorithm="ONE_SHOT") is out  # case and '_' as anyccl reads them
    np.testing.assert_array_equal(out, np.arange(6, dtype=np.float64))
    sel = comm.last_selection
    assert sel == {"algorithm": "one-shot", "why": 'named by the caller (algorithm="one-shot")'}
    assert comm.select_all_reduce(6, "f64", algorithm="one-shot")["algorithm"] == "one-shot"
    assert comm.should_all_reduce(x, algorithm="one-shot")
    # The selector's choice again when no algorithm is named.
    comm.all_reduce(x)
    sel = comm.last_selection
    assert sel is not None and sel["algorithm"] == "one-shot" and "named by the caller" not in sel["why"]


@pytest.mark.parametrize("name", ["two-shot-fp8", "two-shot-int8", "ccl", "ring"])
def test_an_ineligible_algorithm_is_unsupported_with_the_reason_and_touches_nothing(
    comm: anyccl.Communicator, name: str
) -> None:
    x = np.full(64, 3.0, dtype=np.float32)
    with pytest.raises(anyccl.UnsupportedError) as e:
        comm.all_reduce(x, algorithm=name)
    assert name in e.value.message and "not implemented by the host backend" in e.value.message, e.value.message
    # The hint speaks Python: the keyword and the calls, not the CLI or the environment variable (not set here).
    assert e.value.hint and "algorithm=" in e.value.hint and "select_all_reduce" in e.value.hint, e.value.hint
    assert "ANYCCL_ALLREDUCE_ALGO" not in e.value.hint and "anyccl probe" not in e.value.hint, e.value.hint
    assert e.value.kind == "unsupported"
    np.testing.assert_array_equal(x, np.full(64, 3.0, dtype=np.float32))
    with pytest.raises(anyccl.UnsupportedError, match="not implemented by the host backend"):
        comm.select_all_reduce(64, "f32", algorithm=name)
    assert not comm.should_all_reduce(x, algorithm=name)
    assert comm.last_selection is None  # nothing ran


def test_deterministic_mode_is_set_read_reported_and_refuses_what_it_cannot_promise(
    comm: anyccl.Communicator,
) -> None:
    assert comm.deterministic is False  # ANYCCL_DETERMINISTIC is not set in the tests
    assert comm.capabilities()["deterministic"] is False
    x = np.ones(8, dtype=np.float32)
    with pytest.raises(anyccl.UnsupportedError, match="not implemented by the host backend"):
        comm.all_reduce(x, algorithm="ring")
    comm.deterministic = True
    assert comm.deterministic is True and comm.capabilities()["deterministic"] is True
    # Now the ring is refused first for what deterministic mode needs.
    with pytest.raises(anyccl.UnsupportedError) as e:
        comm.all_reduce(x, algorithm="ring")
    # Named as a Python caller set it (the keyword), not by the environment variable it did not use.
    assert "not deterministic (deterministic=True)" in e.value.message, e.value.message
    assert "ANYCCL_DETERMINISTIC" not in str(e.value), str(e.value)
    comm.all_reduce(x)
    sel = comm.last_selection
    assert sel is not None and sel["algorithm"] in ("one-shot", "two-shot")
    comm.set_deterministic(False)
    assert comm.deterministic is False
    with anyccl.Communicator.from_unique_id(anyccl.unique_id(), 0, 1, backend="host", deterministic=True) as d:
        assert d.deterministic is True


def _options_rank(uid: bytes, rank: int, world: int, results: Any) -> None:
    try:
        with anyccl.Communicator.from_unique_id(uid, rank, world, backend="host", timeout=30, deterministic=True) as c:
            got: Dict[str, Any] = {"deterministic": c.deterministic}
            x = np.full(5, float(rank + 1), dtype=np.float32)
            c.all_reduce(x, algorithm="one-shot")
            got["named"] = x.tolist()
            got["named_selection"] = c.last_selection
            try:
                c.all_reduce(np.ones(5, dtype=np.float32), algorithm="two-shot-int8")
                got["int8"] = "ran"
            except anyccl.UnsupportedError as e:
                got["int8"] = e.message
            y = np.full(5, float(rank + 1), dtype=np.float32)
            c.all_reduce(y)  # every rank still in step after the refusal (nothing was sent)
            got["after"] = y.tolist()
            results.put((rank, "ok", got))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def test_named_algorithms_and_deterministic_mode_across_processes() -> None:
    world = 2
    for got in _run_processes(world, _options_rank, anyccl.unique_id()):
        assert got["deterministic"] is True
        assert got["named"] == [3.0] * 5
        assert got["named_selection"]["algorithm"] == "one-shot" and "named" in got["named_selection"]["why"]
        assert "two-shot-int8" in got["int8"] and "not deterministic" in got["int8"], got["int8"]
        assert got["after"] == [3.0] * 5


def test_rocm_from_python_says_why_it_is_not_there() -> None:
    reason = anyccl.backends()["rocm"]
    assert reason is not None and "not in the Python package" in reason and "kDLROCM" in reason
    with pytest.raises(anyccl.UnsupportedError) as e:
        anyccl.Communicator.from_unique_id(anyccl.unique_id(), 0, 1, backend="rocm")
    assert reason in e.value.message
