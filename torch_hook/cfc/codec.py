"""Compress and decompress tensors: the Python face of the cfc codec.

Torch is imported lazily, so ``import cfc`` works without it (numpy arrays can still be
compressed); :func:`decompress` returns a ``torch.Tensor`` when torch is installed.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple, Union

import numpy as np

from cfc import _native

__all__ = [
    "Compressed",
    "compress",
    "decompress",
    "fixed_rate_size",
    "frame_info",
    "sum_compressed",
]

_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - exercised only without torch
        return None
    return torch


def _torch_dtype(name: str):
    torch = _torch()
    return None if torch is None else getattr(torch, name)


def _zstd_level(zstd: Union[bool, int]) -> Optional[int]:
    if zstd is True:
        return 1
    if zstd is False or zstd is None:
        return None
    if isinstance(zstd, int) and 1 <= zstd <= 22:
        return zstd
    raise ValueError(f"zstd must be a bool or a level from 1 to 22, got {zstd!r}")


def _tensor_bytes(x: Any) -> Tuple[np.ndarray, str, Tuple[int, ...]]:
    """A uint8 view of ``x``'s elements (no copy when already contiguous), its dtype name and shape."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        name = str(x.dtype).replace("torch.", "")
        if name not in _DTYPE_NAMES:
            raise TypeError(
                f"cfc compresses float32, bfloat16 and float16 tensors, got {x.dtype}"
            )
        t = x.detach()
        if t.device.type != "cpu":
            # The CUDA codec is not in this build: CUDA tensors take the CPU codec (same bytes).
            t = t.cpu()
        shape = tuple(t.shape)
        flat = t.contiguous().reshape(-1)
        return flat.view(torch.uint8).numpy(), name, shape
    if isinstance(x, np.ndarray):
        if x.dtype == np.float32:
            name = "float32"
        elif x.dtype == np.float16:
            name = "float16"
        elif x.dtype.name == "bfloat16":  # ml_dtypes
            name = "bfloat16"
        else:
            raise TypeError(
                f"cfc compresses float32, bfloat16 and float16 arrays, got {x.dtype}"
            )
        shape = tuple(x.shape)
        flat = np.ascontiguousarray(x).reshape(-1)
        if not flat.dtype.isnative:
            raise TypeError("cfc reads native-endian arrays; byte-swap the array first")
        return flat.view(np.uint8), name, shape
    raise TypeError(
        f"expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}"
    )


def _frame_buffer(c: Any) -> bytes:
    """The frame's bytes, from any accepted frame holder."""
    if isinstance(c, Compressed):
        return c._frame
    if isinstance(c, bytes):
        return c
    if isinstance(c, (bytearray, memoryview)):
        return bytes(c)
    if isinstance(c, np.ndarray):
        if c.dtype != np.uint8:
            raise TypeError(f"a frame array must have dtype uint8, got {c.dtype}")
        return c.tobytes()
    torch = _torch()
    if torch is not None and isinstance(c, torch.Tensor):
        if c.dtype != torch.uint8:
            raise TypeError(f"a frame tensor must have dtype torch.uint8, got {c.dtype}")
        return c.detach().cpu().contiguous().reshape(-1).numpy().tobytes()
    raise TypeError(
        "expected a cfc.Compressed, bytes, bytearray, memoryview or uint8 array/tensor, "
        f"got {type(c).__name__}"
    )


def _addr(a: np.ndarray) -> int:
    """Address of a contiguous array's first byte (0 for an empty array)."""
    return a.ctypes.data if a.nbytes else 0


class Compressed:
    """A compressed tensor: one self-describing cfc frame and what its header says.

    ``bytes(c)`` is the frame; it is all :func:`decompress` needs. Objects pickle as their bytes.
    """

    __slots__ = ("_frame", "_info")

    def __init__(self, frame: Union[bytes, bytearray, memoryview]):
        self._frame = bytes(frame)
        self._info = _native.frame_info(self._frame)

    def __bytes__(self) -> bytes:
        return self._frame

    def __len__(self) -> int:
        return len(self._frame)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Compressed) and other._frame == self._frame

    def __hash__(self) -> int:
        return hash(self._frame)

    def __getstate__(self) -> bytes:
        return self._frame

    def __setstate__(self, frame: bytes) -> None:
        self._frame = frame
        self._info = _native.frame_info(frame)

    def __repr__(self) -> str:
        return (
            f"cfc.Compressed(shape={self.shape}, dtype={self._info['dtype']}, "
            f"eps={self.eps:.3g}, mode={self.mode}, nbytes={self.nbytes}, ratio={self.ratio:.2f})"
        )

    @property
    def nbytes(self) -> int:
        """Size of the frame in bytes."""
        return len(self._frame)

    @property
    def ratio(self) -> float:
        """Uncompressed bytes over compressed bytes."""
        return self._info["decoded_nbytes"] / len(self._frame)

    @property
    def eps(self) -> float:
        """Guaranteed bound on ``|decompressed - original|`` for every finite element."""
        return self._info["eps"]

    @property
    def step(self) -> float:
        """Quantization step (``2 * eps`` unless the frame is fixed-rate or a sum)."""
        return self._info["step"]

    @property
    def dtype(self):
        """The original dtype: a ``torch.dtype`` when torch is installed, else its name."""
        name = self._info["dtype"]
        return _torch_dtype(name) or name

    @property
    def shape(self) -> Tuple[int, ...]:
        """The original shape."""
        return tuple(self._info["shape"])

    @property
    def numel(self) -> int:
        """Number of elements."""
        return self._info["numel"]

    @property
    def mode(self) -> str:
        """How the bound was set: ``abs``, ``rel``, ``bits`` or ``sum``."""
        return self._info["mode"]

    @property
    def info(self) -> Dict[str, Any]:
        """Every header field, as a dict (see :func:`frame_info`)."""
        return dict(self._info)


def compress(
    x: Any,
    *,
    eps: Optional[float] = None,
    rel: Optional[float] = None,
    bits: Optional[int] = None,
    zstd: Union[bool, int] = False,
    threads: int = 0,
) -> Compressed:
    """Compress a float tensor with a strict error bound.

    Give exactly one bound: every finite element ``v`` comes back as ``v'`` with
    ``|v' - v| <= eps`` (checked in float64); NaN and infinities come back bit-exactly.

    Args:
        x: a ``torch.Tensor`` or ``numpy.ndarray`` of float32, bfloat16 or float16, any shape.
            CUDA tensors are copied to the host first in this build.
        eps: absolute bound.
        rel: bound relative to the largest finite magnitude (``eps = rel * max|x|``).
        bits: fixed rate, 2 to 32 bits per value; the size is known in advance
            (:func:`fixed_rate_size`) and the bound achieved is reported as ``.eps``.
        zstd: add a lossless zstd stage (``True`` for level 1, or a level up to 22).
        threads: CPU threads to use, 0 for one per core on large tensors.

    Returns:
        Compressed: ``bytes(result)`` is the self-describing frame.

    Raises:
        ValueError: no bound, several bounds, or an unusable one (<= 0, NaN, infinite).
        TypeError: an unsupported dtype or object.

    Example::

        >>> import numpy as np, cfc
        >>> c = cfc.compress(np.linspace(-1, 1, 4096, dtype=np.float32), eps=1e-3)
        >>> c.shape, c.ratio > 3
        ((4096,), True)
    """
    data, name, shape = _tensor_bytes(x)
    # `data` stays referenced until the call returns, so its memory stays valid.
    frame = _native.compress(
        _addr(data),
        data.nbytes,
        name,
        list(shape),
        eps=eps,
        rel=rel,
        bits=bits,
        zstd_level=_zstd_level(zstd),
        threads=threads,
    )
    return Compressed(frame)


def decompress(c: Any, device: Any = None, *, threads: int = 0):
    """Decompress a frame into a tensor of its original dtype and shape.

    Args:
        c: a :class:`Compressed`, or the frame as bytes, bytearray, memoryview, or a uint8
            numpy array or torch tensor.
        device: where to put the result (``"cpu"``, ``"cuda:0"``, a ``torch.device``);
            decoding runs on the CPU in this build, then the tensor is moved.
        threads: CPU threads to use, 0 for automatic.

    Returns:
        torch.Tensor: the decoded tensor (a numpy array when torch is not installed; bfloat16
        then needs torch).

    Raises:
        cfc.FormatError: the buffer is malformed (truncated, corrupted, crafted, newer format).
        TypeError: the object is not a frame holder.
    """
    buf = _frame_buffer(c)
    # The native side checks the whole frame before allocating the output.
    raw = _native.decompress(buf, threads=threads)
    info = _native.frame_info(buf)
    shape = tuple(info["shape"])
    torch = _torch()
    if torch is None:
        if info["dtype"] == "bfloat16":
            raise TypeError("decoding a bfloat16 frame needs torch")
        return np.frombuffer(raw, dtype=np.dtype(info["dtype"])).reshape(shape)
    dtype = getattr(torch, info["dtype"])
    if info["numel"] == 0:
        out = torch.empty(shape, dtype=dtype)
    else:
        # Shares the bytearray's memory: no copy.
        out = torch.frombuffer(raw, dtype=dtype).reshape(shape)
    if device is not None:
        out = out.to(device)
    return out


def frame_info(c: Any) -> Dict[str, Any]:
    """Read a frame's header: dtype, shape, numel, eps, step, mode, bits, codec, zstd,
    exceptions, nbytes, decoded_nbytes and version.

    Raises:
        cfc.FormatError: the header is malformed.
    """
    return _native.frame_info(_frame_buffer(c))


def sum_compressed(items: Iterable[Any], *, zstd: Union[bool, int] = False) -> Compressed:
    """Element-wise sum of frames quantized with the same step, adding integer codes exactly.

    Frames compressed with the same absolute ``eps`` share a step. The result decodes to the
    sum of the originals within the sum of the bounds (plus one rounding to the dtype); NaN
    and infinities propagate.

    Raises:
        TypeError: the frames have different dtypes.
        cfc.CfcError: different shapes or steps, or codes that overflow 64 bits.
    """
    frames = [_frame_buffer(c) for c in items]
    return Compressed(_native.sum_frames(frames, zstd_level=_zstd_level(zstd)))


def fixed_rate_size(shape: Iterable[int], bits: int) -> int:
    """Exact size in bytes of a ``bits=`` frame of finite data with this shape."""
    return _native.fixed_rate_size(list(shape), bits)
