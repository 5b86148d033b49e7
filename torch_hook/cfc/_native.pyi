# Type stubs of the native module `cfc._native` (python/src/lib.rs). Keep in step with it:
# tests/python/test_native_stubs.py checks that every name here exists and vice versa.
from typing import Any, Dict, List, Optional, Sequence, Tuple


__version__: str
FORMAT_VERSION: int
CUDA_FRAME_SIZE_OFFSET: int
CUDA_BOUND_ERROR_OFFSET: int
CUDA_SUM_STEPS_DIFFER: int
CUDA_SUM_OVERFLOW: int
CUDA_SUM_BAD_FRAME: int
CUDA_SUM_EPS_OVERFLOW: int
CUDA_DECODE_BAD_FRAME: int
CUDA_SUM_SQUARES_WORKSPACE: int

class CfcError(Exception): ...
class FormatError(CfcError): ...

def compress(
    data_ptr: int,
    nbytes: int,
    dtype: str,
    shape: Sequence[int],
    *,
    eps: Optional[float] = None,
    rel: Optional[float] = None,
    bits: Optional[int] = None,
    zstd_level: Optional[int] = None,
    threads: int = 0,
    residual_ptr: int = 0,
    residual_nbytes: int = 0,
) -> bytes: ...
def compress_lossless(
    data_ptr: int,
    nbytes: int,
    dtype: str,
    shape: Sequence[int],
    *,
    zstd_level: Optional[int] = None,
    threads: int = 0,
) -> bytes: ...
def zstd_compress(data_ptr: int, nbytes: int, level: int = 3) -> bytes: ...
def decompress(frame: bytes, *, threads: int = 0) -> bytearray: ...
def frame_info(frame: bytes) -> Dict[str, Any]: ...
def validate(frame: bytes) -> None: ...
def sum_frames(frames: List[bytes], *, zstd_level: Optional[int] = None) -> bytes: ...
def fixed_rate_size(shape: Sequence[int], bits: int) -> int: ...
def allreduce(
    transport: Any,
    data_ptr: int,
    nbytes: int,
    dtype: str,
    *,
    eps: Optional[float] = None,
    rel: Optional[float] = None,
    average: bool = False,
    zstd_level: Optional[int] = None,
    residual_ptr: int = 0,
    residual_nbytes: int = 0,
    algorithm: Optional[str] = None,
) -> Tuple[bytearray, Dict[str, Any]]: ...
def allreduce_refuse(transport: Any, reason: str) -> None: ...
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
    device: int,
    stream: int,
    input_ptr: int,
    numel: int,
    dtype: str,
    shape: Sequence[int],
    out_ptr: int,
    out_len: int,
    ws_ptr: int,
    ws_len: int,
    *,
    eps: Optional[float] = None,
    rel: Optional[float] = None,
    bits: Optional[int] = None,
    residual_ptr: int = 0,
    size_ptr: int = 0,
    max_error_ptr: int = 0,
    bound_ptr: int = 0,
) -> None: ...
def cuda_decompress(
    device: int,
    stream: int,
    frame_ptr: int,
    numel: int,
    dtype: str,
    ndim: int,
    out_ptr: int,
    ws_ptr: int,
    ws_len: int,
    codec: str = "quantized",
) -> None: ...
def cuda_sum_sizes(numel: int, dtype: str, ndim: int, parts: int) -> Tuple[int, int]: ...
def cuda_sum(
    device: int,
    stream: int,
    frame_ptrs: Sequence[int],
    frame_lens: Sequence[int],
    numel: int,
    dtype: str,
    shape: Sequence[int],
    out_ptr: int,
    out_len: int,
    ws_ptr: int,
    ws_len: int,
) -> None: ...
def cuda_decode_sum_workspace_len(numel: int, parts: int) -> int: ...
def cuda_decode_sum(
    device: int,
    stream: int,
    frame_ptrs: Sequence[int],
    frame_lens: Sequence[int],
    numel: int,
    dtype: str,
    ndim: int,
    scale: float,
    out_ptr: int,
    out_dtype: str,
    ws_ptr: int,
    ws_len: int,
    status_ptr: int,
    *,
    lens_before: int = 0,
) -> None: ...
def cuda_copy_rows(
    device: int, stream: int, src: int, src_pitch: int, dst: int, dst_pitch: int, width: int, rows: int
) -> None: ...
def cuda_sum_squares(
    device: int, stream: int, data_ptr: int, numel: int, dtype: str, residual_ptr: int, workspace_ptr: int,
    out_ptr: int
) -> None: ...
def cuda_running_max_abs(device: int, stream: int, residual_ptr: int, numel: int, target_ptr: int) -> None: ...
def cuda_lossless_sizes(numel: int, dtype: str, ndim: int) -> Tuple[int, int]: ...
def nccl_unique_id() -> str: ...
def nccl_version() -> Tuple[int, int, int]: ...

class NcclAllReducer:
    def __init__(
        self, device: int, unique_id: str, rank: int, world: int, *, timeout: Optional[float] = None
    ) -> None: ...
    def allreduce(
        self,
        stream: int,
        data_ptr: int,
        numel: int,
        dtype: str,
        *,
        eps: float,
        average: bool = True,
        feedback: bool = True,
        chunk_numel: int = 1 << 26,
        fallback: str = "never",
        trials: int = 3,
    ) -> Dict[str, Any]: ...
    def compressing(self) -> Optional[bool]: ...
    def check(self) -> None: ...
    def wait(self) -> None: ...
    def close(self) -> None: ...

class BucketExchange:
    def __init__(
        self, device: int, unique_id: str, rank: int, world: int, *, timeout: Optional[float] = None
    ) -> None: ...
    @staticmethod
    def scratch_layout(numel: int, dtype: str, eps: float, feedback: bool, slot: int, world: int) -> Dict[str, int]: ...
    def launch(
        self,
        key: int,
        stream: int,
        data_ptr: int,
        numel: int,
        dtype: str,
        residual_ptr: int,
        row_ptr: int,
        capacity: int,
        ws_ptr: int,
        ws_len: int,
        sum_ws_ptr: int,
        sum_out_ptr: int,
        slot: int,
        recv_ptr: int,
        max_error_ptr: int,
        *,
        eps: Optional[float] = None,
        rel: Optional[float] = None,
    ) -> None: ...
    def finish(
        self,
        key: int,
        stream: int,
        scale: float,
        ws_ptr: int,
        ws_len: int,
        resend_recv_ptr: int = 0,
    ) -> Tuple[int, int, int]: ...
    def check(self) -> None: ...
    def fence(self, stream: int) -> None: ...
    def set_polling(self, spin_us: int, nap_us: int) -> None: ...
    def set_graphs(self, on: bool) -> None: ...
    def graphs_instantiated(self) -> int: ...
    def graphs_reused(self) -> int: ...
    def buckets(self) -> int: ...
    def forget(self, keys: List[int]) -> int: ...
    def close(self) -> None: ...

class BucketPipeline:
    def __init__(self, exchange: BucketExchange, scale: float) -> None: ...
    def submit(
        self,
        key: int,
        stream: int,
        data_ptr: int,
        numel: int,
        dtype: str,
        residual_ptr: int,
        *,
        compress: bool,
        eps: Optional[float] = None,
        rms: Optional[float] = None,
        sum_out_ptr: int = 0,
        slot: int = 0,
        max_error_ptr: int = 0,
    ) -> None: ...
    def end_step(self) -> Dict[str, Any]: ...
    def _corrupt_next_received(self, key: int) -> None: ...
    def sync(self) -> None: ...
    def buckets(self) -> int: ...
    def forget(self, keys: List[int]) -> int: ...
    def close(self) -> None: ...

def cuda_compress_lossless(
    device: int,
    stream: int,
    data_ptr: int,
    numel: int,
    dtype: str,
    shape: Sequence[int],
    out_ptr: int,
    out_len: int,
    ws_ptr: int,
    ws_len: int,
) -> None: ...
def cuda_lossless_offsets(
    device: int, stream: int, frame_ptr: int, numel: int, dtype: str, ndim: int, ws_ptr: int, ws_len: int
) -> None: ...
def cuda_lossless_chunks(
    device: int,
    stream: int,
    frame_ptr: int,
    numel: int,
    dtype: str,
    ndim: int,
    out_ptr: int,
    ws_ptr: int,
    ws_len: int,
    first: int,
    last: int,
) -> None: ...
