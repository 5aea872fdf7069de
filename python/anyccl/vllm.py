"""A communicator with the shape of vLLM's device communicators (``DeviceCommunicatorBase``): duck-typed, so vLLM
is not a dependency.

    comm = AnycclDeviceCommunicator(cpu_group, device=torch.device("cuda", local_rank))
    if comm.should_custom_ar(x):          # the predicate vLLM's custom all-reduce has
        y = comm.all_reduce(x)            # out of place; None would mean "fall back" (never, here)
    with comm.capture():                  # around torch.cuda.graph captures: registers graph buffers on exit
        ...
    comm.destroy()

``cpu_group`` is a torch ``ProcessGroup`` able to move Python objects (gloo): anyccl bootstraps over it (the NCCL
unique id, the custom kernels' IPC handles, graph buffers). All-reduce goes through the ``anyccl::all_reduce``
custom op, so ``torch.compile`` and CUDA graphs keep working.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, ClassVar, Iterator, List, Optional, Union

import torch  # type: ignore[import-not-found, unused-ignore]
import torch.distributed as dist  # type: ignore[import-not-found, unused-ignore]

from . import Communicator, Error, _canon_algorithm, _op_name
from . import torch_ops

__all__ = ["AnycclDeviceCommunicator", "AnycclCustomAllreduce", "AnycclPyNcclCommunicator"]

logger = logging.getLogger("anyccl.vllm")


class AnycclDeviceCommunicator:
    """vLLM's ``DeviceCommunicatorBase`` methods over an anyccl ``Communicator``."""

    def __init__(
        self,
        cpu_group: Any,
        device: Optional[torch.device] = None,
        device_group: Any = None,
        unique_name: str = "",
        *,
        comm: Optional[Communicator] = None,
        algorithm: Optional[str] = None,
        deterministic: Optional[bool] = None,
    ) -> None:
        """``algorithm``: the all-reduce algorithm every ``all_reduce`` names (None: the selector's choice; e.g.
        ``"two-shot-fp8"`` for the quantized one, lossy); ``deterministic``: deterministic mode (see
        ``anyccl.Communicator.deterministic``; None: ``ANYCCL_DETERMINISTIC``). Both the same on every rank."""
        self.algorithm = _canon_algorithm(algorithm)  # checked before any communicator is made
        self.cpu_group = cpu_group
        self.device_group = device_group
        self.unique_name = unique_name
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.device = device
        if comm is None:
            if device.type == "cuda":
                comm = Communicator.from_process_group(cpu_group, backend="cuda", device=device.index)
            else:
                comm = Communicator.from_process_group(cpu_group, backend="host")
        if deterministic is not None:
            comm.deterministic = deterministic
        self.comm = comm
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.ranks = dist.get_process_group_ranks(cpu_group) if cpu_group is not None else list(range(self.world_size))
        self.rank_in_group = comm.rank
        self._handle = torch_ops.register(comm)
        self.disabled = False

    # ---- the predicate and the all-reduce ----------------------------------------------------------------------

    def should_custom_ar(self, input_: torch.Tensor) -> bool:
        """Whether ``all_reduce`` handles ``input_`` (vLLM's custom all-reduce predicate)."""
        return not self.disabled and self.comm.should_all_reduce(input_, algorithm=self.algorithm)

    should_all_reduce = should_custom_ar

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """The sum over the group, in a new tensor (the custom op: safe under torch.compile and CUDA graphs)."""
        out: torch.Tensor = torch.ops.anyccl.all_reduce(input_, self._handle, "sum", self.algorithm)
        return out

    def custom_all_reduce(self, input_: torch.Tensor) -> Optional[torch.Tensor]:
        """vLLM's custom all-reduce shape: the result, or None to make the caller fall back."""
        if not self.should_custom_ar(input_):
            return None
        return self.all_reduce(input_)

    def all_reduce_rmsnorm(
        self,
        input_: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float = 1e-6,
        fp8_scale: Optional[float] = None,
    ) -> torch.Tensor:
        """The all-reduce, the residual add (``residual`` updated in place) and the RMSNorm in one call: the
        normalised output (the custom op ``anyccl::all_reduce_rmsnorm``: safe under torch.compile and CUDA graphs)."""
        out: torch.Tensor = torch.ops.anyccl.all_reduce_rmsnorm(
            input_, residual, weight, self._handle, eps, None, fp8_scale
        )
        return out

    # ---- the other collectives, with vLLM's layouts -------------------------------------------------------------

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``input_`` concatenated along ``dim``."""
        if dim < 0:
            dim += input_.dim()
        size = input_.size()
        gathered: torch.Tensor = self.comm.all_gather(input_.contiguous())  # 1-D: world × numel, rank order
        out = gathered.reshape((self.world_size,) + tuple(size))
        out = out.movedim(0, dim)
        return out.reshape(size[:dim] + (self.world_size * size[dim],) + size[dim + 1 :])

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """``input_`` summed over the group and split along ``dim``; this rank's part."""
        if dim < 0:
            dim += input_.dim()
        x = input_.movedim(0, dim).contiguous()
        if x.shape[0] % self.world_size:
            raise ValueError(f"reduce_scatter: dimension {dim} ({x.shape[0]}) does not split into {self.world_size}")
        chunk = x.shape[0] // self.world_size
        out = torch.empty((chunk,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        self.comm.reduce_scatter(x, out=out.view(-1))
        return out.movedim(0, dim).contiguous()

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> Optional[torch.Tensor]:
        """``all_gather`` kept on rank ``dst`` only (None elsewhere)."""
        out = self.all_gather(input_, dim)
        return out if self.rank_in_group == dst else None

    def send(self, tensor: torch.Tensor, dst: Optional[int] = None) -> None:
        """Sends ``tensor`` to rank ``dst`` of the group (default: the next rank)."""
        if dst is None:
            dst = (self.rank_in_group + 1) % self.world_size
        self.comm.send(tensor.contiguous(), dst)

    def recv(self, size: torch.Size, dtype: torch.dtype, src: Optional[int] = None) -> torch.Tensor:
        """A new tensor of ``size`` and ``dtype`` received from rank ``src`` (default: the previous rank)."""
        if src is None:
            src = (self.rank_in_group - 1) % self.world_size
        t = torch.empty(size, dtype=dtype, device=self.device)
        self.comm.recv(t, src)
        return t

    # ---- graphs and lifetime ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Around CUDA graph captures: the graph buffers are registered on exit (collective)."""
        with self.comm.capture():
            yield

    def destroy(self) -> None:
        """Closes the communicator (idempotent)."""
        torch_ops.unregister(self._handle)
        self.comm.close()
        self.disabled = True


class AnycclCustomAllreduce:
    """vLLM's ``CustomAllreduce`` (``vllm.distributed.device_communicators.custom_all_reduce``), method for method,
    over anyccl: what vLLM's ``CudaCommunicator`` makes for a tensor-parallel group when anyccl's vLLM plugin is on
    (``anyccl.vllm_plugin``).

    The contract it keeps: made with ``group=`` (a gloo CPU group) and ``device=``; ``disabled`` True when it cannot
    run (then vLLM falls back to pynccl); ``should_custom_ar(inp)`` with vLLM's limits (a multiple of 16 bytes,
    contiguous, fewer than ``max_size`` bytes) and anyccl's (a dtype and device it has, an eligible algorithm);
    ``custom_all_reduce(inp)`` out of place, returning the new tensor or None to make the caller fall back (inside
    ``capture()`` but outside an actual graph capture, an empty tensor of the shape, as vLLM's warm-up expects);
    ``all_reduce(inp, *, out=None, registered=False)``; ``capture()`` a context manager that registers the captured
    inputs on exit (through anyccl's own bootstrap, not pickles over gloo); ``register_graph_buffers()``;
    ``finalize_p2p()`` (nothing left to do: anyccl checks peer access when it is made); ``close()``. vLLM's custom
    all-gather and reduce-scatter (``should_custom_all_gather``, ``custom_all_gather``, ``should_custom_reduce_scatter``,
    ``should_mnnvl_multimem_reduce_scatter``, ``custom_reduce_scatter``) answer False / None: vLLM uses pynccl.
    """

    #: vLLM's class this one replaced, set by the plugin (None when made directly).
    replaced: ClassVar[Any] = None
    _SUPPORTED_WORLD_SIZES: ClassVar[List[int]] = [2, 3, 4, 5, 6, 7, 8]

    def __init__(
        self,
        group: Any,
        device: Union[int, str, torch.device],
        max_size: int = 8192 * 1024,
        max_all_gather_size: int = 2 * 1024 * 1024,
        max_mnnvl_all_gather_size: Optional[int] = None,
        max_reduce_scatter_size: int = 16 * 1024 * 1024,
        max_mnnvl_reduce_scatter_size: int = 16 * 1024 * 1024,
        max_mnnvl_multimem_reduce_scatter_size: int = 64 * 1024 * 1024,
        symm_mem_enabled: bool = False,
        *,
        register_graph_buffers: bool = True,
    ) -> None:
        """vLLM's arguments; the all-gather and reduce-scatter sizes are kept but unused (anyccl leaves those
        collectives to vLLM's pynccl: ``should_custom_all_gather`` and ``should_custom_reduce_scatter`` answer
        False). ``register_graph_buffers=False``: ``capture()`` registers nothing on exit."""
        self._IS_CAPTURING = False
        self.disabled = True
        self.group = group
        self.max_size = int(max_size)
        self.max_all_gather_size = max_all_gather_size
        self.max_mnnvl_all_gather_size = max_mnnvl_all_gather_size
        self.max_reduce_scatter_size = max_reduce_scatter_size
        self.max_mnnvl_reduce_scatter_size = max_mnnvl_reduce_scatter_size
        self.max_mnnvl_multimem_reduce_scatter_size = max_mnnvl_multimem_reduce_scatter_size
        self.symm_mem_enabled = symm_mem_enabled
        self._registers_graph_buffers = bool(register_graph_buffers)
        self.fully_connected = True
        self.comm: Optional[Communicator] = None
        self._handle: Optional[int] = None
        self.rank = dist.get_rank(group=group)
        self.world_size = dist.get_world_size(group=group)
        if isinstance(device, int):
            device = torch.device("cuda", device)
        elif isinstance(device, str):
            device = torch.device(device)
        self.device = device
        if self.world_size == 1:
            return  # as vLLM: nothing to do for one GPU
        if self.world_size not in self._SUPPORTED_WORLD_SIZES:
            logger.warning("anyccl custom all-reduce disabled: world size %d (anyccl's kernels: 2 to 8)", self.world_size)
            return
        try:
            backend = "cuda" if device.type == "cuda" else "host"
            index = device.index if device.type == "cuda" else None
            self.comm = Communicator.from_process_group(group, backend=backend, device=index)
        except Error as e:
            # Collective: every rank fails alike (the bootstrap or the backend), and vLLM falls back to pynccl.
            logger.warning("anyccl custom all-reduce disabled: %s", e)
            return
        self._handle = torch_ops.register(self.comm)
        self.disabled = False

    def finalize_p2p(self) -> None:
        """vLLM's deferred peer-access check: nothing to do (anyccl checked peer access when it was made)."""

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Around vLLM's CUDA graph captures: the captured all-reduces' inputs are registered on exit (collective)."""
        try:
            self._IS_CAPTURING = True
            yield
        finally:
            self._IS_CAPTURING = False
            if not self.disabled and self._registers_graph_buffers:
                self.register_graph_buffers()

    def register_graph_buffers(self) -> None:
        """Registers the inputs of the all-reduces captured so far on every rank (collective)."""
        if self.comm is not None:
            self.comm.register_graph_buffers()

    def should_custom_ar(self, inp: torch.Tensor) -> bool:
        """Whether ``custom_all_reduce`` takes ``inp``: vLLM's limits (bytes a multiple of 16 and fewer than
        ``max_size``, contiguous) and anyccl's (device, dtype, an eligible algorithm)."""
        if self.disabled or self.comm is None:
            return False
        size = inp.numel() * inp.element_size()
        if size % 16 != 0 or size >= self.max_size or not inp.is_contiguous():
            return False
        return self.comm.should_all_reduce(inp)

    def all_reduce(
        self, inp: torch.Tensor, *, out: Optional[torch.Tensor] = None, registered: bool = False
    ) -> torch.Tensor:
        """The sum over the group, out of place into ``out`` (a new tensor when None). ``registered`` is accepted
        for vLLM's signature: anyccl finds captured inputs itself."""
        if self.comm is None or self._handle is None:
            raise RuntimeError("anyccl custom all-reduce is disabled")
        if out is None:
            result: torch.Tensor = torch.ops.anyccl.all_reduce(inp, self._handle, "sum", None)
            return result
        self.comm.all_reduce(inp, out=out)
        return out

    def custom_all_reduce(self, input: torch.Tensor) -> Optional[torch.Tensor]:
        """The all-reduce vLLM calls: the result in a new tensor, or None to make the caller fall back."""
        if self.disabled or not self.should_custom_ar(input):
            return None
        if self._IS_CAPTURING and self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            return torch.empty_like(input)  # vLLM's warm-up inside capture(): the allocation only
        return self.all_reduce(input)

    # vLLM's custom all-gather and reduce-scatter: anyccl does not take them, and vLLM falls back to pynccl, as it
    # does when its own class has no buffers for them.

    def should_custom_all_gather(self, inp: torch.Tensor) -> bool:
        """False: vLLM's all-gather goes to pynccl."""
        return False

    def custom_all_gather(self, inp: torch.Tensor) -> Optional[torch.Tensor]:
        """None: the caller falls back."""
        return None

    def should_custom_reduce_scatter(self, inp: torch.Tensor) -> bool:
        """False: vLLM's reduce-scatter goes to pynccl."""
        return False

    def should_mnnvl_multimem_reduce_scatter(self, inp: torch.Tensor) -> bool:
        """False: no multi-node NVLink multimem reduce-scatter here."""
        return False

    def custom_reduce_scatter(self, inp: torch.Tensor) -> Optional[torch.Tensor]:
        """None: the caller falls back."""
        return None

    def close(self) -> None:
        """Ends the communicator (idempotent)."""
        if self._handle is not None:
            torch_ops.unregister(self._handle)
            self._handle = None
        if self.comm is not None:
            self.comm.close()
            self.comm = None
        self.disabled = True

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to close with
            pass


class _GroupBootstrap:
    """anyccl's bootstrap over vLLM's ``StatelessProcessGroup`` (``rank``, ``world_size``, ``all_gather_obj``): the
    group vLLM's PyNcclCommunicator also accepts."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank: int = int(group.rank)
        self.world: int = int(group.world_size)

    def all_gather(self, mine: bytes) -> List[bytes]:
        return [bytes(b) for b in self.group.all_gather_obj(bytes(mine))]


class AnycclPyNcclCommunicator:
    """vLLM's ``PyNcclCommunicator`` (``vllm.distributed.device_communicators.pynccl``), method for method, over an
    anyccl ``Communicator``: the same constructor (``group``: a torch CPU group or vLLM's ``StatelessProcessGroup``;
    ``device``; ``library_path``, accepted and unused), the same ``available`` / ``disabled`` flags (off for a world
    of 1, or when anyccl cannot make the communicator: then every call returns None and the caller falls back, as
    vLLM's does without NCCL), and the same calling conventions:

    * ``all_reduce(in_tensor, out_tensor=None, op=ReduceOp.SUM, stream=None)`` out of place, returning the output
      (a new tensor when ``out_tensor`` is None); ``op`` a ``torch.distributed.ReduceOp`` (or anyccl's name);
    * ``all_gather(output_tensor, input_tensor)`` and ``reduce_scatter(output_tensor, input_tensor, op)`` output first;
      ``all_gatherv`` / ``reduce_scatterv`` with per-rank row counts ``sizes`` along dimension 0;
    * ``reduce(output_tensor, input_tensor, root, op)``, ``scatter(output_tensor, input_tensor, sizes, root)``;
    * ``send(tensor, dst)``, ``recv(tensor, src)``, ``broadcast(tensor, src)`` in place;
    * ``group_start()`` / ``group_end()``: the calls between them are held and run at ``group_end`` (sends and
      receives among them as one group, which pairs whatever their order on each rank);
    * ``batch_isend_irecv(p2p_ops)`` on ``torch.distributed.P2POp`` lists (``isend`` / ``irecv``; the peer is the
      group rank ``group_peer`` when torch gives one, else ``peer`` mapped through the group's ranks);
    * ``register_comm_window`` / ``register_comm_window_raw`` / ``deregister_comm_window``: None and nothing to do
      (anyccl registers the memory its kernels need itself); ``suspend()`` / ``resume()`` nothing (anyccl keeps its
      buffers); ``destroy()`` closes the communicator;
    * ``from_unique_id_bytes(unique_id_bytes, rank, world_size, device)`` with an anyccl unique id
      (``anyccl.unique_id()``), not NCCL's.

    ``stream=`` is accepted everywhere: CUDA tensors are enqueued on it (default: torch's current stream, as vLLM's
    default); host tensors have no stream. Where vLLM asserts (a tensor on another device), this class asserts with
    the same message; a dtype or op anyccl has no reduction for raises ``ValueError``, as vLLM's NCCL enum mapping
    does.
    """

    #: vLLM's class this one replaced, set by whoever swaps it in (None when made directly).
    replaced: ClassVar[Any] = None
    comm: Optional[Communicator]
    _pending: List[Any]
    _registered_windows: List[Any]
    _ranks: Optional[List[int]]

    def __init__(self, group: Any, device: Union[int, str, torch.device], library_path: Optional[str] = None) -> None:
        """``group``: a torch ``ProcessGroup`` that is not NCCL's (gloo), or vLLM's ``StatelessProcessGroup``;
        ``device``: the CUDA device (an index, ``"cuda:N"``) or ``"cpu"`` for the host backend; ``library_path``
        is vLLM's NCCL path, unused (anyccl finds its libraries itself)."""
        stateless = not isinstance(group, dist.ProcessGroup) and hasattr(group, "all_gather_obj")
        if stateless:
            rank, world_size = int(group.rank), int(group.world_size)
        else:
            assert dist.is_initialized()
            assert dist.get_backend(group) != dist.Backend.NCCL, "PyNcclCommunicator should be attached to a non-NCCL group."
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        self._setup(group, rank, world_size, device, library_path)
        if self.world_size == 1:
            return
        backend, index = self._backend()
        try:
            if stateless:
                self.comm = Communicator.from_bootstrap(_GroupBootstrap(group), backend, index)
            else:
                self.comm = Communicator.from_process_group(group, backend, index)
        except Error as e:
            # Collective: every rank fails alike, and the caller falls back (as vLLM's does without NCCL).
            logger.warning("anyccl PyNcclCommunicator disabled: %s", e)
            return
        self._ranks = None if stateless else dist.get_process_group_ranks(group)
        self.available = True
        self.disabled = False

    @classmethod
    def from_unique_id_bytes(
        cls,
        unique_id_bytes: bytes,
        rank: int,
        world_size: int,
        device: Union[int, str, torch.device],
        library_path: Optional[str] = None,
    ) -> "AnycclPyNcclCommunicator":
        """Joins the group named by ``unique_id_bytes`` as ``rank`` of ``world_size`` with no process group (every
        rank enters together): the id is an anyccl unique id (``anyccl.unique_id()`` on one process, moved to every
        rank by the caller), not NCCL's. No warm-up all-reduce follows (vLLM's issues one for NCCL peers)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self = cls.__new__(cls)
        self._setup(None, rank, world_size, device, library_path)
        if world_size == 1:
            return self
        backend, index = self._backend()
        # Unlike the process-group path, a failure raises: the caller asked to join this group, and the peers wait.
        self.comm = Communicator.from_unique_id(bytes(unique_id_bytes), rank, world_size, backend, index)
        self._ranks = None
        self.available = True
        self.disabled = False
        return self

    def _setup(
        self, group: Any, rank: int, world_size: int, device: Union[int, str, torch.device], library_path: Optional[str]
    ) -> None:
        self.group = group
        self.rank, self.world_size = rank, world_size
        self.library_path = library_path
        self.comm = None
        self._pending = []
        self._group_depth = 0
        self._registered_windows = []
        self._ranks = None
        if isinstance(device, int):
            device = torch.device(f"cuda:{device}")
        elif isinstance(device, str):
            device = torch.device(device)
        self.device = device
        self.available = False
        self.disabled = True

    def _backend(self) -> Any:
        return ("cuda", self.device.index) if self.device.type == "cuda" else ("host", None)

    # ---- helpers ------------------------------------------------------------------------------------------------

    def _check(self, tensor: torch.Tensor, what: str = "input") -> None:
        assert tensor.device == self.device, (
            f"this nccl communicator is created to work on {self.device}, but the {what} tensor is on {tensor.device}"
        )

    def _later(self, run: Any) -> None:
        """Runs ``run`` now, or at ``group_end`` inside a group."""
        if self._group_depth:
            self._pending.append(run)
        else:
            run()

    def _live(self) -> Communicator:
        if self.comm is None:
            raise RuntimeError("anyccl PyNcclCommunicator is destroyed")
        return self.comm

    # ---- collectives --------------------------------------------------------------------------------------------

    def all_reduce(
        self,
        in_tensor: torch.Tensor,
        out_tensor: torch.Tensor = None,  # type: ignore[assignment, unused-ignore]
        op: Any = dist.ReduceOp.SUM,
        stream: Any = None,
    ) -> torch.Tensor:
        """``in_tensor`` reduced over the group with ``op``, out of place into ``out_tensor`` (a new tensor when
        None), which is returned; None when disabled (the caller falls back)."""
        if self.disabled:
            return None  # type: ignore[return-value, unused-ignore]
        self._check(in_tensor)
        name = _op_name(op)
        if out_tensor is None:
            out_tensor = torch.empty_like(in_tensor)
        comm = self._live()
        out = out_tensor
        self._later(lambda: comm.all_reduce(in_tensor, out=out, op=name, stream=stream))
        return out_tensor

    def all_gather(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, stream: Any = None) -> None:
        """Every rank's ``input_tensor`` in rank order into ``output_tensor`` (``world_size`` times its elements)."""
        if self.disabled:
            return
        self._check(input_tensor)
        comm = self._live()
        self._later(lambda: comm.all_gather(input_tensor, out=output_tensor, stream=stream))

    def all_gatherv(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, sizes: List[int], stream: Any = None
    ) -> None:
        """Every rank's ``input_tensor`` (``sizes[rank]`` rows along dimension 0) concatenated along dimension 0
        into ``output_tensor`` (``sum(sizes)`` rows): one broadcast per rank."""
        if self.disabled:
            return
        self._check(input_tensor)
        assert output_tensor.shape[0] == sum(sizes)
        comm, rank = self._live(), self.rank

        def run() -> None:
            offset = 0
            for root, rows in enumerate(sizes):
                dst = output_tensor[offset : offset + rows]
                comm.broadcast(input_tensor if root == rank else dst, root, out=dst, stream=stream)
                offset += rows

        self._later(run)

    def reduce_scatter(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, stream: Any = None
    ) -> None:
        """``input_tensor`` (``world_size`` equal parts) reduced over the group; this rank's part into
        ``output_tensor``."""
        if self.disabled:
            return
        self._check(input_tensor)
        name, comm = _op_name(op), self._live()
        self._later(lambda: comm.reduce_scatter(input_tensor, out=output_tensor, op=name, stream=stream))

    def reduce_scatterv(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        sizes: List[int],
        op: Any = dist.ReduceOp.SUM,
        stream: Any = None,
    ) -> None:
        """``input_tensor`` (``sum(sizes)`` rows along dimension 0) reduced over the group; rank ``r`` gets rows
        ``sizes[:r]`` to ``sizes[:r+1]`` in ``output_tensor``: one reduce per rank."""
        if self.disabled:
            return
        self._check(input_tensor)
        name, comm, rank = _op_name(op), self._live(), self.rank

        def run() -> None:
            offset = 0
            for root, rows in enumerate(sizes):
                chunk = input_tensor[offset : offset + rows]
                # The other ranks' results land in a scratch tensor: the caller's input stays as it was.
                dst = output_tensor if root == rank else torch.empty_like(chunk)
                comm.reduce(chunk, root, out=dst, op=name, stream=stream)
                offset += rows

        self._later(run)

    def reduce(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        root: int,
        op: Any = dist.ReduceOp.SUM,
        stream: Any = None,
    ) -> None:
        """``input_tensor`` reduced over the group into rank ``root``'s ``output_tensor`` (the other ranks'
        ``output_tensor`` is left as it was)."""
        if self.disabled:
            return
        self._check(input_tensor)
        name, comm, rank = _op_name(op), self._live(), self.rank

        def run() -> None:
            dst = output_tensor if rank == root else torch.empty_like(input_tensor)
            comm.reduce(input_tensor, root, out=dst, op=name, stream=stream)

        self._later(run)

    def scatter(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        sizes: List[int],
        root: int = 0,
        stream: Any = None,
    ) -> None:
        """Rank ``root``'s ``input_tensor`` (``sum(sizes)`` rows along dimension 0) split by ``sizes``: rank ``r``
        receives its ``sizes[r]`` rows into ``output_tensor`` (sends and receives as one group)."""
        if self.disabled:
            return
        self._check(output_tensor, "output")
        ops: List[Any] = []
        if self.rank == root:
            offset = 0
            for dst, rows in enumerate(sizes):
                if rows:
                    chunk = input_tensor[offset : offset + rows]
                    if dst == root:
                        self._later(lambda chunk=chunk: output_tensor.copy_(chunk))
                    else:
                        ops.append(("send", chunk.contiguous(), dst))
                offset += rows
        elif sizes[self.rank] > 0:
            ops.append(("recv", output_tensor, root))
        if ops:
            self._p2p(ops, stream)

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        """Rank ``src``'s ``tensor`` into every rank's ``tensor``."""
        if self.disabled:
            return
        self._check(tensor)
        comm = self._live()
        self._later(lambda: comm.broadcast(tensor, src, stream=stream))

    # ---- point to point -----------------------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int, stream: Any = None) -> None:
        """Sends ``tensor`` to group rank ``dst``."""
        if self.disabled:
            return
        self._check(tensor)
        self._p2p([("send", tensor, dst)], stream)

    def recv(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        """Receives into ``tensor`` from group rank ``src``."""
        if self.disabled:
            return
        self._check(tensor)
        self._p2p([("recv", tensor, src)], stream)

    def _p2p(self, ops: List[Any], stream: Any) -> None:
        comm = self._live()
        if self._group_depth:
            # Consecutive sends and receives of a group are one grouped call at group_end.
            if self._pending and isinstance(self._pending[-1], _P2pBatch):
                self._pending[-1].ops.extend(ops)
            else:
                self._pending.append(_P2pBatch(comm, ops, stream))
            return
        _P2pBatch(comm, ops, stream)()

    def batch_isend_irecv(self, p2p_ops: List[Any], stream: Any = None) -> None:
        """``torch.distributed.P2POp``s (``isend`` / ``irecv``) as one group: they pair with the peers' groups
        whatever their order. The peer is the op's ``group_peer`` (a rank of this group) when torch sets it, else
        its ``peer`` (a global rank) mapped through the group's ranks."""
        if self.disabled:
            return
        ops = []
        for p in p2p_ops:
            fn = getattr(p.op, "__name__", str(p.op))
            if fn not in ("isend", "irecv", "send", "recv"):
                raise ValueError(f"batch_isend_irecv: {fn} is not a send or a receive")
            self._check(p.tensor)
            ops.append(("send" if "send" in fn else "recv", p.tensor, self._group_rank(p)))
        self._p2p(ops, stream)

    def _group_rank(self, p: Any) -> int:
        peer = getattr(p, "group_peer", None)
        if peer is not None:
            return int(peer)
        peer = int(p.peer)
        if self._ranks is not None:
            return self._ranks.index(peer)
        return peer

    # ---- groups, windows, lifetime ------------------------------------------------------------------------------

    def group_start(self) -> None:
        """Holds the calls that follow until the matching ``group_end`` (groups nest)."""
        self._group_depth += 1

    def group_end(self) -> None:
        """Runs the calls held since the outermost ``group_start``, in order (consecutive sends and receives as one
        group)."""
        if self._group_depth == 0:
            raise RuntimeError("group_end without group_start")
        self._group_depth -= 1
        if self._group_depth == 0:
            pending, self._pending = self._pending, []
            for run in pending:
                run()

    def register_comm_window(self, tensor: torch.Tensor) -> None:
        """None: anyccl has no window for the caller to register (its kernels register the memory they use)."""
        return None

    def register_comm_window_raw(self, ptr: int, size: int) -> None:
        """None, as ``register_comm_window``."""
        return None

    def deregister_comm_window(self, window: Any) -> None:
        """Nothing to release (``register_comm_window`` made nothing)."""
        return None

    def suspend(self) -> None:
        """Nothing to release: anyccl keeps its buffers (vLLM's does the same when its NCCL cannot suspend)."""

    def resume(self) -> None:
        """Nothing to restore (``suspend`` released nothing)."""

    def destroy(self) -> None:
        """Closes the communicator (idempotent); later calls find it disabled and return None."""
        if self.comm is not None:
            self.comm.close()
            self.comm = None
        self.available = False
        self.disabled = True


class _P2pBatch:
    """Sends and receives run as one ``Communicator.p2p`` group."""

    def __init__(self, comm: Communicator, ops: List[Any], stream: Any) -> None:
        self.comm, self.ops, self.stream = comm, list(ops), stream

    def __call__(self) -> None:
        self.comm.p2p(self.ops, stream=self.stream)
