# Type stubs of the native module `cfc._native` (python/src/lib.rs). Keep in step with it:
# tests/python/test_native_stubs.py checks that every name here exists and vice versa.
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple


__version__: str
FORMAT_VERSION: int
CUDA_FRAME_SIZE_OFFSET: int
CUDA_BOUND_ERROR_OFFSET: int
CUDA_SUM_STEPS_DIFFER: int
CUDA_SUM_OVERFLOW: int
CUDA_SUM_BAD_FRAME: int
CUDA_SUM_EPS_OVERFLOW: int
CUDA_DECODE_BAD_FRAME: int

class CfcError(Exception): ...
class FormatError(CfcError): ...

def compress(
    data: Any,
    dtype: str,
    shape: Sequence[int],
    *,
    eps: Optional[float] = None,
    rel: Optional[float] = None,
    bits: Optional[int] = None,
    rms: Optional[float] = None,
    block: Optional[int] = None,
    zstd_level: Optional[int] = None,
    threads: int = 0,
    coder: str = "planes",
    residual: Optional[Any] = None,
) -> bytes: ...
def compress_lossless(
    data: Any,
    dtype: str,
    shape: Sequence[int],
    *,
    zstd_level: Optional[int] = None,
    threads: int = 0,
) -> bytes: ...
def zstd_compress(data: Any, level: int = 3) -> bytes: ...
def decompress(frame: bytes, *, threads: int = 0) -> bytearray: ...
def frame_info(frame: bytes) -> Dict[str, Any]: ...
def validate(frame: bytes) -> None: ...
def sum_frames(frames: List[bytes], *, zstd_level: Optional[int] = None) -> bytes: ...
def fixed_rate_size(shape: Sequence[int], bits: int) -> int: ...
def cuda_available() -> bool: ...
def cuda_supported(device: int) -> bool: ...
def cuda_workspace_len(numel: int, *, compress: bool = False, feedback: bool = False) -> int: ...
def cuda_compress_capacity(
    numel: int,
    dtype: str,
    ndim: int,
    *,
    eps: Optional[float] = None,
    rel: Optional[float] = None,
    bits: Optional[int] = None,
) -> int: ...
def cuda_compress(
    stream: Any,
    data: Any,
    shape: Sequence[int],
    out: Any,
    workspace: Any,
    *,
    eps: Optional[float] = None,
    rel: Optional[float] = None,
    bits: Optional[int] = None,
    residual: Optional[Any] = None,
    coder: str = "planes",
    size: Optional[Any] = None,
    max_error: Optional[Any] = None,
) -> None: ...
def cuda_decompress(
    stream: Any, frame: Any, ndim: int, out: Any, workspace: Any, codec: str = "quantized"
) -> None: ...
def cuda_sum_sizes(numel: int, dtype: str, ndim: int, parts: int) -> Tuple[int, int]: ...
def cuda_sum(stream: Any, frames: Sequence[Any], dtype: str, shape: Sequence[int], out: Any, workspace: Any) -> None: ...
def decode_status_error(status: int) -> Optional[str]: ...
def cuda_decode_sum_workspace_len(numel: int, parts: int) -> int: ...
def cuda_decode_sum(
    stream: Any,
    frames: Sequence[Any],
    dtype: str,
    ndim: int,
    scale: float,
    out: Any,
    workspace: Any,
    status: Any,
    *,
    lens_before: int = 0,
) -> None: ...
def cuda_lossless_sizes(numel: int, dtype: str, ndim: int) -> Tuple[int, int]: ...
def nccl_unique_id() -> str: ...
def nccl_version() -> Tuple[int, int, int]: ...

def cuda_compress_lossless(stream: Any, data: Any, shape: Sequence[int], out: Any, workspace: Any) -> None: ...
def cuda_lossless_offsets(stream: Any, frame: Any, ndim: int, out: Any, workspace: Any) -> None: ...
def cuda_lossless_chunks(
    stream: Any, frame: Any, ndim: int, out: Any, workspace: Any, first: int, last: int
) -> None: ...

TIMEOUT_RANGE: Tuple[float, float]
EPS_RANGE: Tuple[float, float]
BLOCK_RANGE: Tuple[int, int]

class Listener:
    def __init__(self, one_host: bool) -> None: ...
    def addresses(self) -> List[str]: ...

class Engine:
    def __init__(
        self,
        listener: Listener,
        addresses: List[List[str]],
        rank: int,
        world: int,
        secret: bytes,
        engine: int,
        *,
        device: Optional[int] = None,
        nccl_id: Optional[str] = None,
        bound_kind: str,
        bound: float,
        error_feedback: bool,
        algorithm: Optional[str],
        fallback: str,
        trial_steps: int,
        warmup_steps: int,
        min_compress_numel: int,
        timeout: float,
        topology: str = "auto",
        coder: str = "planes",
        block: int = 0,
        fsdp: Optional[Tuple[int, bool]] = None,
        nodes: Optional[List[str]] = None,
        agree_token: int = 0,
    ) -> None: ...
    @property
    def levels(self) -> Optional[Tuple[int, int, int, int]]: ...
    @property
    def rank(self) -> int: ...
    @property
    def world(self) -> int: ...
    def submit(
        self,
        key: int,
        fingerprint: int,
        data: Any,
        residual: Optional[Any],
        out: Optional[Any],
        scale: Optional[float],
        last: bool,
        fresh: bool,
        stream: Optional[Any],
    ) -> None: ...
    def wait(self, stream: Optional[Any] = None) -> None: ...
    def order(self, stream: Optional[Any] = None) -> None: ...
    def end_step(self, stream: Optional[Any] = None) -> None: ...
    def fail(self, reason: str) -> None: ...
    def settled(self) -> bool: ...
    def agree(self, token: int) -> None: ...
    def gather(self, mine: bytes) -> List[bytes]: ...
    def stats(self) -> Dict[str, float]: ...
    def reset(self) -> None: ...
    def ways(self) -> Tuple[bool, List[int]]: ...
    def state(self) -> Dict[str, Any]: ...
    def load_state(self, state: Mapping[str, Any]) -> None: ...
    def inject(self, fault: str) -> None: ...
    def close(self) -> None: ...
    def stop(self) -> None: ...

def parse_engine_state(state: Mapping[str, Any]) -> Dict[str, Any]: ...
def settle_dropped_engines(seconds: float) -> int: ...
def env_timeout() -> Optional[float]: ...
def env_node() -> Optional[str]: ...
