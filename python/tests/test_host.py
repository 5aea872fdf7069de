"""The host backend through the Python package: ranks as processes (multiprocessing, a unique id), ranks as threads
(which proves the GIL is released while a collective waits for its peers), and a Python bootstrap object."""

from __future__ import annotations

import multiprocessing as mp
import threading
import traceback
from typing import Any, Callable, Dict, List

import numpy as np
import pytest

import anyccl

DEADLINE_S = 60


def _collectives(comm: anyccl.Communicator) -> Dict[str, Any]:
    """Every collective, in place and out of place, on values that make each rank's contribution visible."""
    r, w = comm.rank, comm.world_size
    out: Dict[str, Any] = {}
    x = np.full(5, r + 1, dtype=np.float32)
    out["all_reduce_in_place"] = comm.all_reduce(x).copy()
    y = np.empty(5, dtype=np.float32)
    comm.all_reduce(np.full(5, r + 1, dtype=np.int64).astype(np.float32), out=y, op="max")
    out["all_reduce_max"] = y.copy()
    out["all_reduce_i64_prod"] = comm.all_reduce(np.full(3, r + 2, dtype=np.int64), op="prod").copy()
    out["all_gather"] = comm.all_gather(np.array([r * 10, r * 10 + 1], dtype=np.int32))
    parts = np.zeros(2 * w, dtype=np.int32)
    parts[2 * r : 2 * r + 2] = [r * 10, r * 10 + 1]
    out["all_gather_in_place"] = comm.all_gather(parts, in_place=True).copy()
    src = np.arange(3 * w, dtype=np.float64) + r
    out["reduce_scatter"] = comm.reduce_scatter(src)
    buf = src.copy()
    comm.reduce_scatter(buf, in_place=True)
    out["reduce_scatter_in_place"] = buf[3 * r : 3 * r + 3].copy()
    b = np.full(4, r, dtype=np.uint8) if r != w - 1 else np.arange(4, dtype=np.uint8) + 7
    out["broadcast"] = comm.broadcast(b, root=w - 1).copy()
    bo = np.zeros(4, dtype=np.uint8)
    comm.broadcast(np.arange(4, dtype=np.uint8) + r, root=0, out=bo)
    out["broadcast_out"] = bo
    red = np.full(2, float(r + 1), dtype=np.float64)
    comm.reduce(red, root=0, op="sum")
    out["reduce_root"] = red.copy() if r == 0 else None
    # A ring of point-to-point messages: even ranks send first, odd ranks receive first.
    nxt, prv = (r + 1) % w, (r - 1) % w
    got = np.zeros(3, dtype=np.int32)
    if w > 1:
        if r % 2 == 0:
            comm.send(np.full(3, r, dtype=np.int32), nxt)
            comm.recv(got, prv)
        else:
            comm.recv(got, prv)
            comm.send(np.full(3, r, dtype=np.int32), nxt)
    out["ring"] = got
    # A grouped exchange: every rank sends 1 MiB to both neighbours before it receives anything; as one group it
    # pairs (the same peer's messages matched in order, as NCCL matches them).
    big = 1 << 18
    from_prev, from_next = np.zeros(big, dtype=np.float32), np.zeros(big, dtype=np.float32)
    if w > 1:
        comm.p2p(
            [
                ("send", np.full(big, r, dtype=np.float32), nxt),
                ("send", np.full(big, r + 100, dtype=np.float32), prv),
                ("recv", from_prev, prv),
                ("recv", from_next, nxt),
            ]
        )
    out["grouped"] = (from_prev[[0, -1]].copy(), from_next[[0, -1]].copy())
    # Plain buffer-protocol objects, read and written in place: a bytearray, and read-only bytes as a send buffer.
    ba = bytearray(np.full(4, r + 1, dtype=np.float32).tobytes())
    comm.all_reduce(ba, dtype="f32")
    out["bytearray"] = np.frombuffer(bytes(ba), dtype=np.float32).copy()
    dst = np.zeros(4, dtype=np.float32)
    comm.all_reduce(np.full(4, r + 1, dtype=np.float32).tobytes(), out=dst, dtype="f32")
    out["read_only_send"] = dst
    out["last_selection"] = comm.last_selection
    comm.barrier()
    return out


def _expect(rank: int, w: int, got: Dict[str, Any]) -> None:
    total = w * (w + 1) / 2
    np.testing.assert_array_equal(got["all_reduce_in_place"], np.full(5, total, dtype=np.float32))
    np.testing.assert_array_equal(got["all_reduce_max"], np.full(5, w, dtype=np.float32))
    prod = 1
    for i in range(w):
        prod *= i + 2
    np.testing.assert_array_equal(got["all_reduce_i64_prod"], np.full(3, prod, dtype=np.int64))
    gathered = np.array([v for i in range(w) for v in (i * 10, i * 10 + 1)], dtype=np.int32)
    np.testing.assert_array_equal(got["all_gather"], gathered)
    np.testing.assert_array_equal(got["all_gather_in_place"], gathered)
    full = sum(np.arange(3 * w, dtype=np.float64) + i for i in range(w))
    np.testing.assert_array_equal(got["reduce_scatter"], full[3 * rank : 3 * rank + 3])
    np.testing.assert_array_equal(got["reduce_scatter_in_place"], full[3 * rank : 3 * rank + 3])
    np.testing.assert_array_equal(got["broadcast"], np.arange(4, dtype=np.uint8) + 7)
    np.testing.assert_array_equal(got["broadcast_out"], np.arange(4, dtype=np.uint8))
    if rank == 0:
        np.testing.assert_array_equal(got["reduce_root"], np.full(2, total))
    np.testing.assert_array_equal(got["bytearray"], np.full(4, total, dtype=np.float32))
    np.testing.assert_array_equal(got["read_only_send"], np.full(4, total, dtype=np.float32))
    if w > 1:
        from_prev, from_next = got["grouped"]
        np.testing.assert_array_equal(from_prev, np.full(2, (rank - 1) % w, dtype=np.float32))
        np.testing.assert_array_equal(from_next, np.full(2, (rank + 1) % w + 100, dtype=np.float32))
    if w > 1:
        np.testing.assert_array_equal(got["ring"], np.full(3, (rank - 1) % w, dtype=np.int32))
    assert got["last_selection"]["algorithm"] in ("one-shot", "two-shot", "ring")
    assert got["last_selection"]["why"]


def _rank_main(uid: bytes, rank: int, world: int, results: Any) -> None:
    try:
        with anyccl.Communicator.from_unique_id(uid, rank, world, backend="host", timeout=30) as comm:
            assert (comm.rank, comm.world_size, comm.backend) == (rank, world, "host")
            results.put((rank, "ok", _collectives(comm)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def _run_processes(world: int, target: Callable[..., None], *args: Any) -> List[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, rank, world, results)) for rank in range(world)]
    for p in procs:
        p.start()
    got: Dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, status, value = results.get(timeout=DEADLINE_S)
            assert status == "ok", f"rank {rank} failed:\n{value}"
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [got[r] for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_across_processes_with_a_unique_id(world: int) -> None:
    uid = anyccl.unique_id()
    for rank, got in enumerate(_run_processes(world, _rank_main, uid)):
        _expect(rank, world, got)


def test_ranks_as_threads_run_only_because_the_gil_is_released() -> None:
    # Both ranks live in this process: rank 0's rendezvous and collectives block until rank 1 arrives, which can
    # only run Python while rank 0 waits with the GIL released.
    uid = anyccl.unique_id()
    outcome: Dict[int, Any] = {}

    def rank_thread(rank: int) -> None:
        try:
            with anyccl.Communicator.from_unique_id(uid, rank, 2, backend="host", timeout=30) as comm:
                outcome[rank] = _collectives(comm)
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome[rank] = e

    threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=DEADLINE_S)
    assert not any(t.is_alive() for t in threads), "a rank thread is still blocked"
    for rank in range(2):
        assert not isinstance(outcome[rank], BaseException), repr(outcome[rank])
        _expect(rank, 2, outcome[rank])


class QueueBootstrap:
    """A Python bootstrap over multiprocessing queues (one inbox per rank), as an engine's own store would be."""

    def __init__(self, rank: int, inboxes: List[Any]) -> None:
        self.rank, self.world, self.inboxes, self.round = rank, len(inboxes), inboxes, 0
        self.early: Dict[Any, bytes] = {}

    def all_gather(self, mine: bytes) -> List[bytes]:
        self.round += 1
        for peer, box in enumerate(self.inboxes):
            if peer != self.rank:
                box.put((self.round, self.rank, bytes(mine)))
        out: List[Any] = [None] * self.world
        out[self.rank] = bytes(mine)
        for (rnd, peer), data in list(self.early.items()):
            if rnd == self.round:
                out[peer] = self.early.pop((rnd, peer))
        while any(v is None for v in out):
            rnd, peer, data = self.inboxes[self.rank].get(timeout=30)
            if rnd == self.round:
                out[peer] = data
            else:
                self.early[(rnd, peer)] = data
        return out


def _bootstrap_rank(inboxes: List[Any], rank: int, world: int, results: Any) -> None:
    try:
        boot = QueueBootstrap(rank, inboxes)
        with anyccl.Communicator.from_bootstrap(boot, backend="host") as comm:
            assert boot.round > 0, "the communicator was set up through the Python bootstrap"
            x = np.full(4, rank + 1, dtype=np.float32)
            comm.all_reduce(x)
            results.put((rank, "ok", x.tolist()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def test_a_python_bootstrap_object_sets_up_the_processes() -> None:
    ctx = mp.get_context("spawn")
    inboxes = [ctx.Queue() for _ in range(2)]
    for got in _run_processes(2, _bootstrap_rank, inboxes):
        assert got == [3.0] * 4


class LyingBootstrap:
    rank, world = 0, 1

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def all_gather(self, mine: bytes) -> Any:
        return self.answer


@pytest.mark.parametrize(
    "answer, says",
    [
        ([b"a", b"b"], "returned 2 entries for 1 ranks"),
        (["text"], "entry of rank 0 is not bytes"),
        ([b"x" * (anyccl.MAX_BOOTSTRAP_BYTES + 1)], "the limit is"),
        (b"not a list", "other than a list"),
    ],
)
def test_a_bootstrap_that_answers_wrongly_is_a_peer_failure_not_a_crash(answer: Any, says: str) -> None:
    with pytest.raises(anyccl.PeerFailureError) as e:
        anyccl.Communicator.from_bootstrap(LyingBootstrap(answer), backend="host")
    assert says in e.value.message


def test_a_bootstrap_that_raises_is_a_peer_failure_naming_the_python_error() -> None:
    class Raising(LyingBootstrap):
        def all_gather(self, mine: bytes) -> Any:
            raise RuntimeError("store unreachable")

    with pytest.raises(anyccl.PeerFailureError, match="store unreachable"):
        anyccl.Communicator.from_bootstrap(Raising(None), backend="host")


def test_one_rank_keeps_its_data_and_reports_itself() -> None:
    with anyccl.Communicator.from_unique_id(anyccl.unique_id(), 0, 1, backend="host") as comm:
        x = np.arange(6, dtype=np.float64).reshape(2, 3)
        assert comm.all_reduce(x) is x
        np.testing.assert_array_equal(x, np.arange(6).reshape(2, 3))
        caps = comm.capabilities()
        assert caps["backend"] == "host" and caps["world_size"] == 1 and caps["library"] is None
        assert caps["capabilities"][0]["name"] == "host-backend" and caps["capabilities"][0]["enabled"]
        assert caps["allreduce_algorithms"] == ["one-shot", "two-shot"]
        sel = comm.select_all_reduce(1024, "bf16")
        assert sel["algorithm"] and sel["why"]
        assert comm.should_all_reduce(np.zeros(4, dtype=np.float32))
        assert not comm.should_all_reduce(np.zeros(4, dtype=np.complex64))
        assert not comm.should_all_reduce(np.zeros((4, 4), dtype=np.float32)[:, 1])
        # bytes read as bf16: 4 elements of 2 bytes, summed over one rank: unchanged.
        raw = bytearray(b"\x80\x3f" * 4)
        comm.all_reduce(raw, dtype="bf16")
        assert bytes(raw) == b"\x80\x3f" * 4
        assert comm.pending_graph_buffers == 0
        assert comm.register_graph_buffers() == {"registered": 0, "kept_staged": 0}
        with comm.capture():
            pass
    assert comm.closed

