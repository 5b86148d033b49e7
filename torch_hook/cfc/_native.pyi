# Type stubs of the native module `cfc._native` (python/src/lib.rs). Keep in step with it:
# tests/python/test_native_stubs.py checks that every name here exists and vice versa.
from typing import Any, Dict, List, Optional, Sequence


__version__: str
FORMAT_VERSION: int

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
) -> bytes: ...
def decompress(frame: bytes, *, threads: int = 0) -> bytearray: ...
def frame_info(frame: bytes) -> Dict[str, Any]: ...
def validate(frame: bytes) -> None: ...
def sum_frames(frames: List[bytes], *, zstd_level: Optional[int] = None) -> bytes: ...
def fixed_rate_size(shape: Sequence[int], bits: int) -> int: ...
