"""Bad input from Python is an exception of anyccl's hierarchy with anyccl's message (and hint), never a crash, and
nothing is written into the caller's buffers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

import anyccl


@pytest.fixture
def comm() -> Iterator[anyccl.Communicator]:
    with anyccl.Communicator.from_unique_id(anyccl.unique_id(), 0, 1, backend="host") as c:
        yield c


def test_the_hierarchy() -> None:
    for cls in (
        anyccl.InvalidArgumentError,
        anyccl.UnsupportedError,
        anyccl.TimeoutError,
        anyccl.BackendError,
        anyccl.PeerFailureError,
        anyccl.ClosedError,
    ):
        assert issubclass(cls, anyccl.Error) and cls is not anyccl.Error
    assert issubclass(anyccl.Error, Exception)


def test_an_unknown_dtype_names_the_accepted_ones(comm: anyccl.Communicator) -> None:
    with pytest.raises(anyccl.InvalidArgumentError, match="dtype='f33'.*bf16"):
        comm.all_reduce(np.zeros(4, dtype=np.float32), dtype="f33")


def test_an_array_of_a_type_anyccl_lacks_is_refused(comm: anyccl.Communicator) -> None:
    x = np.ones(4, dtype=np.complex64)
    with pytest.raises(anyccl.InvalidArgumentError, match="no anyccl data type"):
        comm.all_reduce(x)
    np.testing.assert_array_equal(x, np.ones(4, dtype=np.complex64))


def test_a_dtype_that_contradicts_the_array_is_refused(comm: anyccl.Communicator) -> None:
    with pytest.raises(anyccl.InvalidArgumentError, match="dtype f16 was asked for, but the buffer holds f32"):
        comm.all_reduce(np.zeros(4, dtype=np.float32), dtype="f16")
    with pytest.raises(anyccl.InvalidArgumentError, match="whole number of f32"):
        comm.all_reduce(bytearray(6), dtype="f32")


def test_an_output_too_small_is_anycclS_buffer_too_small_and_touches_nothing(comm: anyccl.Communicator) -> None:
    out = np.full(1, 7.0, dtype=np.float32)
    with pytest.raises(anyccl.InvalidArgumentError) as e:
        comm.all_reduce(np.zeros(4, dtype=np.float32), out=out)
    assert "invalid argument" in e.value.message and "needs 16" in e.value.message, e.value.message
    assert e.value.kind == "invalid-argument"
    assert out[0] == 7.0


def test_send_and_recv_of_different_types_are_refused(comm: anyccl.Communicator) -> None:
    with pytest.raises(anyccl.InvalidArgumentError, match="recv: dtype f32 was asked for, but the buffer holds f64"):
        comm.all_reduce(np.zeros(4, dtype=np.float32), out=np.zeros(4, dtype=np.float64))


def test_a_root_or_peer_out_of_range_is_refused(comm: anyccl.Communicator) -> None:
    with pytest.raises(anyccl.InvalidArgumentError, match="out of range|not a rank|rank 3"):
        comm.broadcast(np.zeros(4, dtype=np.float32), root=3)
    with pytest.raises(anyccl.InvalidArgumentError, match="rank 5|out of range|not a rank"):
        comm.send(np.zeros(4, dtype=np.float32), peer=5)


def test_a_rank_outside_the_world_is_refused_before_any_connection() -> None:
    with pytest.raises(anyccl.InvalidArgumentError, match="rank 2"):
        anyccl.Communicator.from_unique_id(anyccl.unique_id(), 2, 2, backend="host")
    with pytest.raises(anyccl.InvalidArgumentError, match="at least one rank"):
        anyccl.Communicator.from_unique_id(anyccl.unique_id(), 0, 0, backend="host")


def test_a_corrupt_unique_id_is_refused() -> None:
    uid = anyccl.unique_id()
    for bad, says in [(b"", "empty"), (b"\x09" + uid[1:], "version 9"), (uid[:-2], "length mismatch")]:
        with pytest.raises(anyccl.InvalidArgumentError, match=says):
            anyccl.Communicator.from_unique_id(bad, 0, 1, backend="host")


def test_an_unknown_backend_or_op_is_a_parse_error(comm: anyccl.Communicator) -> None:
    with pytest.raises(anyccl.InvalidArgumentError, match="backend.*best, host, cuda or rocm"):
        anyccl.Communicator.from_unique_id(anyccl.unique_id(), 0, 1, backend="metal")
    with pytest.raises(anyccl.InvalidArgumentError, match="'median'"):
        comm.all_reduce(np.zeros(4, dtype=np.float32), op="median")


def test_an_op_that_is_neither_a_name_nor_a_reduce_op_is_a_value_error(comm: anyccl.Communicator) -> None:
    x = np.ones(4, dtype=np.float32)
    with pytest.raises(ValueError, match="op=.*sum, prod, min, max, avg or the torch.distributed.ReduceOp") as e:
        comm.all_reduce(x, op=3)
    assert isinstance(e.value, anyccl.InvalidArgumentError)
    np.testing.assert_array_equal(x, np.ones(4, dtype=np.float32))


def test_avg_on_integers_is_refused_by_anyccl(comm: anyccl.Communicator) -> None:
    with pytest.raises(anyccl.Error, match="avg"):
        comm.all_reduce(np.zeros(4, dtype=np.int32), op="avg")


def test_read_only_and_strided_buffers_are_refused(comm: anyccl.Communicator) -> None:
    ro = np.zeros(4, dtype=np.float32)
    ro.setflags(write=False)
    with pytest.raises(anyccl.InvalidArgumentError, match="read-only"):
        comm.all_reduce(ro)
    comm.all_reduce(ro, out=np.zeros(4, dtype=np.float32))  # read-only input out of place is fine
    with pytest.raises(anyccl.InvalidArgumentError, match="not C-contiguous"):
        comm.all_reduce(np.zeros((4, 4), dtype=np.float32)[:, 0])
    with pytest.raises(anyccl.InvalidArgumentError, match="buffer protocol"):
        comm.all_reduce([1.0, 2.0])  # type: ignore[arg-type]


def test_a_closed_communicator_raises_closed_error_with_a_hint(comm: anyccl.Communicator) -> None:
    comm.close()
    comm.close()  # idempotent
    assert comm.closed
    for call in (
        lambda: comm.all_reduce(np.zeros(4, dtype=np.float32)),
        lambda: comm.barrier(),
        lambda: comm.capabilities(),
        lambda: comm.register_graph_buffers(),
    ):
        with pytest.raises(anyccl.ClosedError) as e:
            call()
        assert e.value.message == "the communicator is closed"
        assert e.value.hint and "new Communicator" in e.value.hint
        assert "hint:" in str(e.value)
    assert not comm.should_all_reduce(np.zeros(4, dtype=np.float32))


def test_the_communicator_cannot_be_made_from_nothing() -> None:
    with pytest.raises(anyccl.InvalidArgumentError, match="from_env"):
        anyccl.Communicator(object())


def test_cuda_asked_for_without_a_gpu_is_unsupported_with_the_reason() -> None:
    reason = anyccl.backends()["cuda"]
    if reason is None:  # a GPU machine: the build must have CUDA in it for backends() to say so
        assert anyccl.CUDA_COMPILED_IN
        return
    with pytest.raises(anyccl.UnsupportedError) as e:
        anyccl.Communicator.from_unique_id(anyccl.unique_id(), 0, 1, backend="cuda")
    assert reason in e.value.message
    assert e.value.hint and "anyccl.backends()" in e.value.hint and "anyccl probe" not in e.value.hint


def test_from_env_without_a_launcher_names_the_variable(tmp_path: Path) -> None:
    code = "import anyccl\ntry:\n    anyccl.Communicator.from_env('host')\nexcept anyccl.Error as e:\n    print(type(e).__name__, e.message)\n"
    env = {"PATH": "/usr/bin:/bin"}
    # Run away from python/ (whose uncompiled anyccl/ would shadow the installed package).
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("InvalidArgumentError "), out.stdout
    assert "not started by a launcher" in out.stdout and "WORLD_SIZE" in out.stdout, out.stdout


def test_from_env_without_a_launcher_says_how_to_launch_in_the_hint(tmp_path: Path) -> None:
    code = "import anyccl\ntry:\n    anyccl.Communicator.from_env()\nexcept anyccl.Error as e:\n    print(e.hint)\n"
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "torchrun --nproc-per-node" in out.stdout and "from_unique_id" in out.stdout, out.stdout


def test_from_env_with_a_launcher_but_no_master_addr_still_names_the_variable(tmp_path: Path) -> None:
    code = "import anyccl\ntry:\n    anyccl.Communicator.from_env('host')\nexcept anyccl.Error as e:\n    print(e.message)\n"
    env = {"PATH": "/usr/bin:/bin", "RANK": "0", "WORLD_SIZE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "MASTER_ADDR" in out.stdout, out.stdout


def test_importing_anyccl_imports_neither_numpy_nor_torch(tmp_path: Path) -> None:
    code = "import sys, anyccl\nprint('numpy' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
