"""Type stubs of the extension module ``anyccl._anyccl`` (Rust, PyO3). Use ``anyccl.Communicator``; these are its
building blocks."""

from typing import Any, Dict, List, Optional, Tuple

from typing_extensions import final

__all__: List[str] = [
    "_Comm",
    "from_env",
    "from_bootstrap",
    "from_unique_id",
    "unique_id",
    "backends",
    "dtypes",
    "algorithms",
    "canonical_algorithm",
    "canonical_form",
    "dlpack_host",
    "_DlpackHost",
    "Error",
    "InvalidArgumentError",
    "UnsupportedError",
    "TimeoutError",
    "BackendError",
    "PeerFailureError",
    "ClosedError",
    "CUDA_COMPILED_IN",
    "CUDA_KERNELS_NOT_BUILT",
    "CUDA_KERNELS_NVCC",
    "MAX_BOOTSTRAP_BYTES",
    "RMSNORM_FORMS",
]

CUDA_COMPILED_IN: bool
CUDA_KERNELS_NOT_BUILT: Optional[str]
CUDA_KERNELS_NVCC: str
MAX_BOOTSTRAP_BYTES: int
RMSNORM_FORMS: List[str]

class Error(Exception):
    """Base of every anyccl error."""

    message: str
    hint: Optional[str]
    kind: str

class InvalidArgumentError(Error): ...
class UnsupportedError(Error): ...
class TimeoutError(Error): ...
class BackendError(Error): ...
class PeerFailureError(Error): ...
class ClosedError(Error): ...

@final
class _Comm:
    rank: int
    world_size: int
    backend: str
    device_index: int
    device: str
    passed_over: str
    def host_collective(
        self,
        coll: str,
        send: Any,
        recv: Optional[Any],
        dtype: str,
        count: int,
        op: str = "sum",
        peer: int = 0,
        algorithm: Optional[str] = None,
    ) -> None: ...
    def host_all_reduce_fast(self, x: Any, out: Optional[Any], op: str, algorithm: Optional[str] = None) -> bool: ...
    def host_p2p(self, ops: List[Tuple[bool, Any, str, int, int]]) -> None: ...
    def bare_handle(self) -> int: ...
    def needs(self, coll: str, count: int, dtype: str) -> Tuple[int, int]: ...
    def select_all_reduce(
        self, count: int, dtype: str, op: str = "sum", in_place: bool = True, algorithm: Optional[str] = None
    ) -> str: ...
    def set_deterministic(self, on: bool) -> None: ...
    def deterministic(self) -> bool: ...
    def capabilities_json(self) -> str: ...
    def last_selection_json(self) -> Optional[str]: ...
    def host_rmsnorm(
        self,
        input: bytes,
        residual: bytes,
        weight: bytes,
        dtype: str,
        tokens: int,
        hidden: int,
        eps: float,
        form: Optional[str] = None,
        fp8_scale: Optional[float] = None,
    ) -> Tuple[bytes, bytes]: ...
    def last_rmsnorm_json(self) -> Optional[str]: ...
    def barrier(self) -> None: ...
    def register_graph_buffers(self) -> Tuple[int, int]: ...
    def pending_graph_buffers(self) -> int: ...
    def closed(self) -> bool: ...
    def close(self, timeout: Optional[float] = None) -> None: ...
    def cuda_collective(
        self,
        coll: str,
        send: Any,
        recv: Any = None,
        op: str = "sum",
        peer: int = 0,
        stream: Any = None,
        algorithm: Optional[str] = None,
    ) -> bool: ...
    def cuda_p2p(self, ops: List[Tuple[bool, Any, int]], stream: Any = None) -> None: ...
    def cuda_rmsnorm(
        self,
        input: Any,
        residual: Any,
        weight: Any,
        out: Any,
        eps: float,
        form: Optional[str] = None,
        fp8_scale: Optional[float] = None,
        stream: Any = None,
    ) -> bool: ...
    def cuda_should_all_reduce(self, tensor: Any, algorithm: Optional[str] = None) -> bool: ...

@final
class _DlpackHost:
    @property
    def dtype(self) -> str: ...
    @property
    def elems(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def readonly(self) -> bool: ...
    def tobytes(self) -> bytes: ...
    def write(self, data: bytes) -> None: ...

def from_env(backend: str = "best") -> _Comm: ...
def from_bootstrap(bootstrap: Any, backend: str = "best", device: Optional[int] = None) -> _Comm: ...
def from_unique_id(
    uid: bytes,
    rank: int,
    world: int,
    backend: str = "best",
    device: Optional[int] = None,
    timeout: Optional[float] = None,
) -> _Comm: ...
def unique_id(addr: str = "127.0.0.1", port: int = 0) -> bytes: ...
def backends() -> Dict[str, Optional[str]]: ...
def dtypes() -> Dict[str, int]: ...
def algorithms() -> Dict[str, bool]: ...
def canonical_algorithm(name: str) -> Optional[str]: ...
def canonical_form(name: str) -> Optional[str]: ...
def dlpack_host(obj: Any, which: str) -> _DlpackHost: ...
