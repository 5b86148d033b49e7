"""Compress and decompress tensors: the Python face of the cfc codec.

Torch is imported lazily, so ``import cfc`` works without it (numpy arrays can still be
compressed); :func:`decompress` returns a ``torch.Tensor`` when torch is installed.
"""

from __future__ import annotations

import functools
import numbers
import operator
from typing import Any, Dict, Iterable, Optional, Tuple, Union

import numpy as np

from cfc import _native

__all__ = [
    "Compressed",
    "CudaCompressed",
    "PinnedCompressed",
    "pin",
    "compress",
    "decompress",
    "fixed_rate_size",
    "frame_info",
    "sum_compressed",
]

_DTYPE_NAMES = ("float32", "bfloat16", "float16")
# Dtypes only the lossless codec takes (besides the three above).
_LOSSLESS_ONLY = ("float64", "uint8", "int8", "int16", "int32", "int64", "bool")


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


@functools.lru_cache(maxsize=None)
def _device_supported(index: int) -> bool:
    """Asked at every CUDA compress (a device's compute capability does not change, and the
    probe costs tens of microseconds of driver calls)."""
    return _native.cuda_supported(index)


def _cuda_ready(t) -> bool:
    """Whether tensor ``t`` lives on a CUDA device the native CUDA codec can drive (others,
    including GPUs older than compute capability 8.0, take the CPU codec)."""
    return t.device.type == "cuda" and _device_supported(t.device.index)


def _dtype_name(dtype: Any) -> str:
    """A torch dtype's name as cfc's native module and frames spell it: "float32" for
    ``torch.float32`` (a name already without the prefix comes back as it is)."""
    return str(dtype).replace("torch.", "")


def _unsupported(dtype, lossless: bool) -> TypeError:
    if lossless:
        names = ", ".join(_DTYPE_NAMES + _LOSSLESS_ONLY)
        return TypeError(f"cfc compresses {names} losslessly, got {dtype}")
    hint = " (compress it with lossless=True)" if _dtype_name(dtype) in _LOSSLESS_ONLY else ""
    return TypeError(f"cfc compresses float32, bfloat16 and float16 with a bound, got {dtype}{hint}")


def _flat_view(t):
    """A 1-D view with stride 1 of ``t``'s elements (copied first if ``t`` is not contiguous).
    A tensor of one element is contiguous whatever its stride, and viewing it as bytes needs
    stride 1; a view, not a copy, so that a residual is still updated in place."""
    t = t.contiguous()
    return t.as_strided((t.numel(),), (1,))


def _tensor_bytes(x: Any, lossless: bool = False) -> Tuple[np.ndarray, str, Tuple[int, ...]]:
    """A uint8 view of ``x``'s elements (no copy when already contiguous), its dtype name and shape."""
    allowed = _DTYPE_NAMES + _LOSSLESS_ONLY if lossless else _DTYPE_NAMES
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        name = _dtype_name(x.dtype)
        if name not in allowed:
            raise _unsupported(x.dtype, lossless)
        t = x.detach().resolve_neg()  # a lazily negated view's memory holds -x (a no-op otherwise)
        if t.device.type != "cpu":
            t = t.cpu()  # a device the CUDA codec cannot drive, or a CPU-only stage (zstd)
        shape = tuple(t.shape)
        return _flat_view(t).view(torch.uint8).numpy(), name, shape
    if isinstance(x, np.ndarray):
        name = x.dtype.name  # "bfloat16" comes from ml_dtypes
        if name not in allowed:
            raise _unsupported(x.dtype, lossless)
        shape = tuple(x.shape)
        flat = np.ascontiguousarray(x).reshape(-1)
        if not flat.dtype.isnative:
            raise TypeError("cfc reads native-endian arrays; byte-swap the array first")
        return flat.view(np.uint8), name, shape
    raise TypeError(
        f"expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}"
    )


def _frame_buffer(c: Any) -> bytes:
    """The frame's bytes, from any accepted frame holder (a :class:`CudaCompressed`'s: after
    waiting for its GPU)."""
    if isinstance(c, Compressed):
        return c._frame
    if isinstance(c, (CudaCompressed, PinnedCompressed)):
        return bytes(c)
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
        "expected a cfc.Compressed, cfc.CudaCompressed, cfc.PinnedCompressed, bytes, bytearray, "
        f"memoryview or uint8 array/tensor, got {type(c).__name__}"
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
        """Quantization step (``2 * eps`` unless the frame is fixed-rate, a sum, or lossless:
        step 1, eps 0)."""
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
        """How the bound was set: ``abs``, ``rel``, ``bits``, ``sum``, or ``lossless``."""
        return self._info["mode"]

    @property
    def info(self) -> Dict[str, Any]:
        """Every header field, as a dict (see :func:`frame_info`)."""
        return dict(self._info)


class PinnedCompressed:
    """A checked frame kept in pinned host memory, ready to be fetched by a GPU: made by
    :func:`pin`.

    :func:`decompress` to a CUDA device copies the frame (smaller than the tensor) to the GPU
    and decodes it there, both queued on the current stream without waiting, and without
    checking the frame again: it was checked once, when pinned. That is how a tensor offloaded
    to host memory comes back sooner than by a plain copy, when it compresses.
    """

    __slots__ = ("_tensor", "_info", "_chunk_ends")

    def __init__(self, tensor, info: Dict[str, Any]):
        # Private: the GPU trusts these bytes because they were checked when pinned; they must
        # not change afterwards.
        self._tensor = tensor
        self._info = info
        # Lossless frames: where each chunk's bytes end in the frame, so that a fetch can copy
        # the frame in pieces and decode each piece as soon as it has arrived.
        self._chunk_ends = None
        if info["codec"] == "lossless" and not info["zstd"] and info["numel"]:
            header = 64 + 8 * len(info["shape"])
            chunks = -(-info["numel"] // _LOSSLESS_CHUNK)
            table = np.frombuffer(tensor.numpy(), dtype="<u4", count=chunks, offset=header) & 0x0FFFFFFF
            self._chunk_ends = header + 4 * chunks + np.cumsum(table, dtype=np.int64)

    @property
    def nbytes(self) -> int:
        """Size of the frame in bytes."""
        return self._tensor.numel()

    @property
    def ratio(self) -> float:
        """Uncompressed bytes over compressed bytes."""
        return self._info["decoded_nbytes"] / max(1, self.nbytes)

    @property
    def shape(self) -> Tuple[int, ...]:
        """The original shape."""
        return tuple(self._info["shape"])

    @property
    def info(self) -> Dict[str, Any]:
        """Every header field, as a dict (see :func:`frame_info`)."""
        return dict(self._info)

    def __bytes__(self) -> bytes:
        return self._tensor.numpy().tobytes()

    def __repr__(self) -> str:
        return f"cfc.PinnedCompressed(shape={self.shape}, dtype={self._info['dtype']}, nbytes={self.nbytes})"


# Elements per chunk of a lossless frame (src/codec/lossless.rs, CHUNK).
_LOSSLESS_CHUNK = 4096
# A fetch copies a lossless frame in pieces of about this many bytes (at most 6 pieces), so
# that decoding each piece overlaps the copy of the next. Smaller pieces cost more host time
# per byte than they save (measured on an H200 with 4 MB pieces: a 31 MB frame fetched 1.53x
# faster than a plain copy in 8 pieces, 1.84x in one).
_FETCH_PIECE = 12 << 20
_COPY_STREAMS: Dict[int, Any] = {}


def _copy_stream(device):
    """A side stream per device for copies that must not wait behind the caller's stream."""
    import torch

    side = _COPY_STREAMS.get(device.index)
    if side is None:
        side = _COPY_STREAMS.setdefault(device.index, torch.cuda.Stream(device))
    return side


def _fetch_lossless(c: "PinnedCompressed", target):
    """Copy a pinned lossless frame to ``target`` in pieces on a side stream, and decode each
    piece on the current stream once it has arrived (the first piece carries the header and
    chunk table, from which the chunks' offsets are computed)."""
    import torch

    info, ends = c._info, c._chunk_ends
    chunks = len(ends)
    pieces = int(min(6, max(2, c.nbytes // _FETCH_PIECE), chunks))
    bounds = [round(i * chunks / pieces) for i in range(pieces + 1)]
    cuts = [0] + [int(ends[b - 1]) for b in bounds[1:]]
    cur = torch.cuda.current_stream(target)
    side = _copy_stream(target)
    frame_dev = torch.empty(c.nbytes, dtype=torch.uint8, device=target)
    out = torch.empty(tuple(info["shape"]), dtype=getattr(torch, info["dtype"]), device=target)
    ws = torch.empty(_native.cuda_workspace_len(info["numel"]), dtype=torch.uint8, device=target)
    side.wait_stream(cur)  # frame_dev was allocated on the current stream
    frame_dev.record_stream(side)  # and is written there: not reused before those copies end
    events = []
    with torch.cuda.stream(side):
        for a, b in zip(cuts, cuts[1:]):
            frame_dev[a:b].copy_(c._tensor[a:b], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(side)
            events.append(ev)
    common = (target.index, cur.cuda_stream, frame_dev.data_ptr(), info["numel"], info["dtype"],
              len(info["shape"]))
    cur.wait_event(events[0])
    _native.cuda_lossless_offsets(*common, ws.data_ptr(), ws.numel())
    for i, ev in enumerate(events):
        cur.wait_event(ev)
        _native.cuda_lossless_chunks(*common, out.data_ptr(), ws.data_ptr(), ws.numel(), bounds[i], bounds[i + 1])
    return out


def pin(c: Any) -> PinnedCompressed:
    """Check a frame once and copy it into pinned host memory (see :class:`PinnedCompressed`).

    Raises:
        cfc.FormatError: the frame is malformed.
    """
    import torch

    buf = _frame_buffer(c)
    _native.validate(buf)
    info = _native.frame_info(buf)
    t = torch.empty(len(buf), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    t.numpy()[:] = np.frombuffer(buf, dtype=np.uint8)
    return PinnedCompressed(t, info)


# Bytes of a GPU frame's workspace copied to the host: the error word through the frame's size.
_HOST_SPAN = _native.CUDA_FRAME_SIZE_OFFSET + 8 - _native.CUDA_BOUND_ERROR_OFFSET


class CudaCompressed:
    """A frame being written by the GPU: returned by :func:`compress` for CUDA tensors.

    Compression was only queued on the tensor's current stream; nothing has waited for the GPU.
    The frame's size stays on the device (:attr:`size_tensor`); :attr:`nbytes`, ``bytes(c)`` and
    :meth:`to_host` wait for the kernels and copy it to the host then, and :func:`decompress`
    decodes on the GPU without waiting (except for a ``rel`` bound or a sum: their bound and
    steps are checked first, which waits once).
    """

    __slots__ = ("_out", "_ws", "_host", "_event", "_dtype", "_shape", "_mode")

    def __init__(self, out, ws, dtype: str, shape: Tuple[int, ...], mode: str, stream):
        """``stream``: the device's current stream, on which the kernels were queued."""
        import torch

        self._out, self._ws = out, ws
        self._dtype, self._shape, self._mode = dtype, shape, mode
        # The size is copied to the host only when asked for: a copy queued behind every frame
        # cost each call a device-to-host transfer and the gaps around it (about 10 of the 22 us
        # of GPU time a 1 MB call took on an H200) and the host time to queue it, and the
        # all-reduce reads the sizes on the device.
        self._host = None
        self._event = torch.cuda.Event()
        self._event.record(stream)

    def _host_word(self, offset: int, nbytes: int) -> int:
        """The workspace's little-endian word at ``offset``, once the kernels are done (the
        error word through the frame's size are copied together, the first time)."""
        if self._host is None:
            import torch

            host = torch.empty(_HOST_SPAN, dtype=torch.uint8, pin_memory=True)
            side = _copy_stream(self._ws.device)  # not the caller's stream: wait for this frame only
            side.wait_event(self._event)
            off = _native.CUDA_BOUND_ERROR_OFFSET
            with torch.cuda.stream(side):
                host.copy_(self._ws[off : off + _HOST_SPAN], non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(side)
            copied.synchronize()
            self._host = host
        at = offset - _native.CUDA_BOUND_ERROR_OFFSET
        return int.from_bytes(self._host.numpy()[at : at + nbytes].tobytes(), "little")

    @property
    def size_tensor(self):
        """The frame's size in bytes, as a 0-d int64 tensor on the device (no wait)."""
        import torch

        off = _native.CUDA_FRAME_SIZE_OFFSET
        return self._ws[off : off + 8].view(torch.int64)[0]

    @property
    def device(self):
        """The device holding the frame."""
        return self._out.device

    @property
    def shape(self) -> Tuple[int, ...]:
        """The original shape."""
        return self._shape

    @property
    def dtype(self):
        """The original dtype."""
        return _torch_dtype(self._dtype)

    def synchronize(self) -> None:
        """Wait until the frame is written; raise if its bound turned out unusable (``rel``) or
        its frames could not be added (:func:`sum_compressed`)."""
        self._event.synchronize()
        # failures known on the device only (other modes' workspaces hold no error word)
        err = self._host_word(_native.CUDA_BOUND_ERROR_OFFSET, 4) if self._mode in ("rel", "sum") else 0
        if err == 0:
            return
        if self._mode != "sum":
            raise ValueError("invalid rel: rel x max|x| is outside the usable range of f64")
        if err & _native.CUDA_SUM_BAD_FRAME:
            which = self._host_word(_native.CUDA_BOUND_ERROR_OFFSET + 4, 4)
            raise _native.CfcError(
                f"frame {which - 1 if which else '?'} of the sum is not a frame of {self._shape} {self._dtype} "
                "elements laid out as its header says within its size (checked on the GPU): nothing was added"
            )
        if err & _native.CUDA_SUM_STEPS_DIFFER:
            raise _native.CfcError("the frames have different steps: only frames compressed with the same eps add")
        if err & _native.CUDA_SUM_EPS_OVERFLOW:
            raise _native.CfcError("the sum's bound, the parts' eps added, is past the largest float64")
        raise _native.CfcError("a sum of codes leaves the 64-bit range")

    @property
    def nbytes(self) -> int:
        """Size of the frame in bytes (waits for the GPU)."""
        self.synchronize()
        return self._host_word(_native.CUDA_FRAME_SIZE_OFFSET, 8)

    @property
    def frame(self):
        """The frame as a uint8 CUDA tensor of exactly :attr:`nbytes` bytes (waits for the size)."""
        return self._out[: self.nbytes]

    def __bytes__(self) -> bytes:
        return self.frame.cpu().numpy().tobytes()

    def to_host(self) -> "Compressed":
        """The frame as a host :class:`Compressed` (waits, then copies)."""
        return Compressed(bytes(self))

    @property
    def numel(self) -> int:
        """Number of elements (known without waiting)."""
        return int(np.prod(self._shape, dtype=np.int64))

    @property
    def decoded_nbytes(self) -> int:
        """Bytes the frame decodes to (known without waiting)."""
        return self.numel * _ELEMENT_SIZE[self._dtype]

    @property
    def ratio(self) -> float:
        """Uncompressed bytes over compressed bytes (waits for the GPU)."""
        return self.decoded_nbytes / self.nbytes

    @property
    def eps(self) -> float:
        """The frame's bound (waits, then reads it from the header: offset 32, f64)."""
        self.synchronize()
        return float(np.frombuffer(self._out[32:40].cpu().numpy().tobytes(), dtype="<f8")[0])

    def __repr__(self) -> str:
        return f"cfc.CudaCompressed(shape={self._shape}, dtype={self._dtype}, mode={self._mode}, device={self.device})"


_ELEMENT_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "uint8": 1, "int8": 1,
                 "int16": 2, "int32": 4, "int64": 8, "bool": 1}


def _is_scalar(value: Any) -> bool:
    """A 0-d torch tensor or numpy array of a number type (not bool): ``float()`` reads it."""
    return getattr(value, "ndim", None) == 0 and _dtype_name(getattr(value, "dtype", "bool")) != "bool"


def _check_number(name: str, value: Any) -> float:
    """A bound or other real option: any real number (numpy's too, or a 0-d tensor or array
    of one), not a bool or a string. Returns it as a float."""
    if isinstance(value, (bool, np.bool_)) or not (isinstance(value, numbers.Real) or _is_scalar(value)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def _check_integer(name: str, value: Any) -> int:
    """A count or width option: any integer (numpy's too, or a 0-d tensor or array of one), not
    a bool, a float or a string. Returns it as an int."""
    try:
        if isinstance(value, (bool, np.bool_)) or not (isinstance(value, numbers.Integral) or _is_scalar(value)):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def _check_threads(threads: Any) -> int:
    """The ``threads=`` option: 0 (automatic) or a positive count. The codec never uses more
    threads than the data has pieces, so a count past any machine's is cut to 2**16 (the
    native argument is an unsigned machine word)."""
    threads = _check_integer("threads", threads)
    if threads < 0:
        raise ValueError(f"threads must be 0 (automatic) or a positive count, got {threads}")
    return min(threads, 1 << 16)


def _check_bits(bits: Any) -> int:
    """The ``bits=`` bound as an integer; the codec checks its range (2 to 32), here only that
    it fits the native argument, with the codec's message."""
    bits = _check_integer("bits", bits)
    if not -(1 << 63) <= bits < 1 << 63:
        raise ValueError(f"invalid bits: {bits} is not between 2 and 32")
    return bits


def _check_flag(name: str, value: Any) -> None:
    """An on/off option: True or False (numpy's bools too), not a number or a string."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _check_dense(t, what: str) -> None:
    """cfc's codecs read a tensor's memory: a dense tensor with data, not a sparse, nested,
    meta or mkldnn one (whose memory is not its elements in order)."""
    if t.layout != _torch().strided or t.is_nested or t.device.type == "meta":
        raise TypeError(f"{what} takes dense tensors with data, got a {t.layout} tensor on {t.device}")


def _check_apart(x_addr: int, x_nbytes: int, r_addr: int, r_nbytes: int) -> None:
    """The residual is updated in place while the input is read: they must not share memory."""
    if x_nbytes and r_nbytes and x_addr < r_addr + r_nbytes and r_addr < x_addr + x_nbytes:
        raise ValueError("residual shares memory with the tensor: give it memory of its own")


def _span(x) -> Tuple[int, int]:
    """(first byte, length) of the memory from a tensor's or array's first element to its last,
    strided or not: a residual must stay out of it even where the codec reads a copy of x, or
    the residual's update could rewrite the caller's input. (Conservative: for a strided x it
    also covers the bytes between its elements.)"""
    if isinstance(x, np.ndarray):
        if not x.size:
            return 0, 0
        utils = getattr(np.lib, "array_utils", np)  # numpy 2 moved it; numpy 1 has np.byte_bounds
        lo, hi = utils.byte_bounds(x)
        return lo, hi - lo
    if not x.numel():
        return 0, 0
    size = x.element_size()
    low = sum((n - 1) * st for n, st in zip(x.shape, x.stride()) if st < 0)
    high = sum((n - 1) * st for n, st in zip(x.shape, x.stride()) if st > 0)
    return x.data_ptr() + low * size, (high - low + 1) * size


def _check_residual(residual, x) -> None:
    """A residual must be a contiguous float32 tensor/array of x's size, where x lives."""
    torch = _torch()
    x_device = x.device if torch is not None and isinstance(x, torch.Tensor) else None
    if torch is not None and isinstance(residual, torch.Tensor):
        if residual.dtype != torch.float32:
            raise TypeError(f"residual must be float32, got {residual.dtype}")
        if x_device is not None and residual.device != x_device:
            raise ValueError(f"residual is on {residual.device}, the tensor on {x_device}")
        if residual.is_neg():
            raise ValueError("residual is a negated view (its memory holds -residual): it is updated in place")
    elif isinstance(residual, np.ndarray):
        if residual.dtype != np.float32:
            raise TypeError(f"residual must be float32, got {residual.dtype}")
        if x_device is not None and x_device.type != "cpu":
            raise TypeError(f"the tensor is on {x_device}: its residual must be a tensor there too")
        if not residual.flags.writeable:
            raise ValueError("residual is a read-only array: it is updated in place")
        if not residual.flags.aligned:
            raise ValueError("residual is not aligned to its 4-byte elements")
    else:
        raise TypeError(f"residual must be a float32 tensor or array, got {type(residual).__name__}")
    numel = x.numel() if hasattr(x, "numel") and callable(x.numel) else int(np.prod(np.shape(x)))
    r_numel = residual.numel() if hasattr(residual, "numel") and callable(residual.numel) else residual.size
    if r_numel != numel:
        raise ValueError(f"residual holds {r_numel} values, the tensor {numel}")
    contiguous = residual.is_contiguous() if hasattr(residual, "is_contiguous") else residual.flags.c_contiguous
    if not contiguous:
        raise ValueError("residual must be contiguous (it is updated in place)")


def _compress_cuda(t, name: str, shape, eps, rel, bits, residual=None) -> CudaCompressed:
    import torch

    t = t.detach().contiguous()
    dev = t.device
    n = t.numel()
    if residual is not None:
        _check_apart(*_span(t), residual.data_ptr(), 4 * residual.numel())
    cap = _native.cuda_compress_capacity(n, name, len(shape), eps=eps, rel=rel, bits=bits)
    out = torch.empty(cap, dtype=torch.uint8, device=dev)
    ws = torch.empty(_native.cuda_workspace_len(n, compress=True, feedback=residual is not None),
                     dtype=torch.uint8, device=dev)
    stream = torch.cuda.current_stream(dev)
    _native.cuda_compress(
        dev.index, stream.cuda_stream, t.data_ptr(), n, name, list(shape),
        out.data_ptr(), cap, ws.data_ptr(), ws.numel(), eps=eps, rel=rel, bits=bits,
        residual_ptr=0 if residual is None or n == 0 else residual.data_ptr(),
    )
    # Input and residual must outlive the queued kernels even if the caller drops them and they
    # were made on another stream: tell the caching allocator they are used on this one.
    t.record_stream(stream)
    if residual is not None:
        residual.record_stream(stream)
    mode = "abs" if eps is not None else "rel" if rel is not None else "bits"
    return CudaCompressed(out, ws, name, tuple(shape), mode, stream)


def _compress_lossless_cuda(t, name: str) -> CudaCompressed:
    import torch

    t = t.detach().contiguous()
    if name == "bool":
        # The device encoder copies bytes as they are; a bool byte other than 0/1 (made by a
        # view of uint8 data) is refused here as the host encoder refuses it. One wait, for
        # bool tensors only.
        flat = t.reshape(-1).view(torch.uint8)
        bad = flat > 1
        if bool(bad.any()):
            i = int(bad.view(torch.uint8).argmax())  # the first: argmax gives the first maximum
            raise ValueError(f"element {i} of the bool tensor is the byte {int(flat[i])}; a bool must be 0 or 1")
    dev = t.device
    shape = tuple(t.shape)
    cap, ws_len = _native.cuda_lossless_sizes(t.numel(), name, len(shape))
    out = torch.empty(cap, dtype=torch.uint8, device=dev)
    ws = torch.empty(ws_len, dtype=torch.uint8, device=dev)
    stream = torch.cuda.current_stream(dev)
    _native.cuda_compress_lossless(
        dev.index, stream.cuda_stream, t.data_ptr(), t.numel(), name, list(shape),
        out.data_ptr(), cap, ws.data_ptr(), ws_len,
    )
    t.record_stream(stream)  # the input must outlive the queued kernels
    return CudaCompressed(out, ws, name, shape, "lossless", stream)


def _decompress_cuda(frame_dev, numel: int, dtype: str, shape, ndim: int, after=None, codec="quantized"):
    """Decode a device-resident frame (checked on the host, or made by the GPU codec) on the
    device's current stream, after the event ``after`` (the frame's compression) if given."""
    import torch

    dev = frame_dev.device
    out = torch.empty(shape, dtype=getattr(torch, dtype), device=dev)
    ws = torch.empty(_native.cuda_workspace_len(numel), dtype=torch.uint8, device=dev)
    stream = torch.cuda.current_stream(dev)
    if after is not None:
        stream.wait_event(after)  # compressed on another stream: wait for it on the GPU
        frame_dev.record_stream(stream)
    _native.cuda_decompress(
        dev.index, stream.cuda_stream, frame_dev.data_ptr(), numel, dtype, ndim,
        out.data_ptr(), ws.data_ptr(), ws.numel(), codec=codec,
    )
    return out


def compress(
    x: Any,
    *,
    eps: Optional[float] = None,
    rel: Optional[float] = None,
    bits: Optional[int] = None,
    zstd: Union[bool, int] = False,
    threads: int = 0,
    residual: Any = None,
    lossless: bool = False,
) -> Compressed:
    """Compress a float tensor with a strict error bound, or any tensor without loss.

    Give exactly one bound: every finite element ``v`` comes back as ``v'`` with
    ``|v' - v| <= eps`` (checked in float64); NaN and infinities come back bit-exactly. Or
    give ``lossless=True`` and no bound: every bit comes back.

    Args:
        x: a ``torch.Tensor`` (CPU or CUDA) or ``numpy.ndarray`` of float32, bfloat16 or
            float16, any shape.
        eps: absolute bound.
        rel: bound relative to the largest finite magnitude (``eps = rel * max|x|``).
        bits: fixed rate, 2 to 32 bits per value; the size is known in advance
            (:func:`fixed_rate_size`) and the bound achieved is reported as ``.eps``.
        zstd: add a lossless zstd stage (``True`` for level 1, or a level up to 22).
        threads: CPU threads to use, 0 for one per core on large tensors.
        residual: error feedback. A float32 tensor (or array) with as many values as ``x``, on
            the same device, updated in place: ``x + residual`` is compressed and the residual
            becomes what the frame will not give back (0 where that is not finite). Start with
            zeros; pass the same residual at every step. (Where a CUDA ``x`` goes through the
            CPU codec, with ``zstd`` or on a GPU the CUDA codec cannot drive, its residual
            goes through a host copy.)
        lossless: store every bit (no bound). Each chunk of 4096 elements is stored by
            invariant bit packing (the bits shared by its elements once, the others packed
            back to back), zero-value compression (a bitmask and the nonzero elements), both, or
            as it is, whichever is smallest. Takes float32, bfloat16, float16, float64,
            uint8, int8, int16, int32, int64 and bool (whose bytes must be 0 or 1: checked,
            with one wait for a CUDA tensor). A CUDA tensor is compressed on its GPU
            (a :class:`CudaCompressed`, the same bytes as the CPU's); :func:`decompress` decodes
            on a GPU when asked to.

    Returns:
        Compressed: ``bytes(result)`` is the self-describing frame. For a CUDA tensor (and no
        zstd stage) a :class:`CudaCompressed` whose frame, byte for byte the same, is still
        being written on the GPU.

    Raises:
        ValueError: no bound, several bounds, or an unusable one (<= 0, NaN, infinite); a
            bool element that is neither 0 nor 1 (a view of other bytes as bool).
        TypeError: an unsupported dtype or object.

    Example::

        >>> import numpy as np, cfc
        >>> c = cfc.compress(np.linspace(-1, 1, 4096, dtype=np.float32), eps=1e-3)
        >>> c.shape, c.ratio > 3
        ((4096,), True)
    """
    torch = _torch()
    eps = None if eps is None else _check_number("eps", eps)
    rel = None if rel is None else _check_number("rel", rel)
    bits = None if bits is None else _check_bits(bits)
    threads = _check_threads(threads)
    zstd_level = _zstd_level(zstd)  # (checked before any branch: the same errors on every device)
    if torch is not None and isinstance(x, torch.Tensor):
        _check_dense(x, "compress")
    caller_x = x  # (its memory is what a residual must stay out of)
    if torch is not None and isinstance(x, torch.Tensor) and x.is_neg():
        # A lazily negated view (the imaginary part of a conjugate): its memory holds -x, and
        # both codecs read memory.
        x = x.resolve_neg()
    if lossless:
        if eps is not None or rel is not None or bits is not None:
            raise ValueError("lossless=True takes no bound (eps=, rel= or bits=)")
        if residual is not None:
            raise ValueError("lossless=True drops nothing: it takes no residual")
        if torch is not None and isinstance(x, torch.Tensor) and not zstd and _cuda_ready(x):
            name = _dtype_name(x.dtype)
            if name not in _DTYPE_NAMES + _LOSSLESS_ONLY:
                raise _unsupported(x.dtype, True)
            return _compress_lossless_cuda(x, name)
        data, name, shape = _tensor_bytes(x, lossless=True)
        frame = _native.compress_lossless(
            _addr(data), data.nbytes, name, list(shape), zstd_level=zstd_level, threads=threads
        )
        return Compressed(frame)
    if (
        torch is not None
        and isinstance(x, torch.Tensor)
        and not zstd
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and _cuda_ready(x)
    ):
        if residual is not None:
            _check_residual(residual, x)
            _check_apart(*_span(caller_x), residual.data_ptr(), 4 * residual.numel())
        return _compress_cuda(x, _dtype_name(x.dtype), tuple(x.shape), eps, rel, bits, residual)
    if residual is not None and torch is not None and isinstance(x, torch.Tensor) \
            and isinstance(residual, torch.Tensor) and residual.device == x.device:
        # (here too where both go through host copies, as the other paths refuse it; and for
        # a strided or negated x, whose copy alone the native call would see)
        _check_apart(*_span(caller_x), residual.data_ptr(), 4 * residual.numel())
    data, name, shape = _tensor_bytes(x)
    r = None
    host_residual = None  # a CUDA residual's copy, for a CUDA x that the CPU codec compresses
    if residual is not None:
        _check_residual(residual, x)
        if torch is not None and isinstance(residual, torch.Tensor):
            if residual.device.type != "cpu":
                # zstd=True, or a GPU the CUDA codec cannot drive: x was copied to the host
                # too, and the residual goes back where it lives once the frame is written
                host_residual = residual.detach().cpu()
            held = residual.detach() if host_residual is None else host_residual
            r = _flat_view(held).view(torch.uint8).numpy()
        else:
            r = residual.reshape(-1).view(np.uint8)
        _check_apart(_addr(data), data.nbytes, _addr(r), r.nbytes)
        if host_residual is None and (isinstance(x, np.ndarray) or x.device.type == "cpu"):
            _check_apart(*_span(caller_x), _addr(r), r.nbytes)  # a strided x: `data` is its copy
    # `data` and `r` stay referenced until the call returns, so their memory stays valid.
    frame = _native.compress(
        _addr(data),
        data.nbytes,
        name,
        list(shape),
        eps=eps,
        rel=rel,
        bits=bits,
        zstd_level=zstd_level,
        threads=threads,
        residual_ptr=0 if r is None else _addr(r),
        residual_nbytes=0 if r is None else r.nbytes,
    )
    if host_residual is not None:
        residual.detach().copy_(host_residual)  # (as the other paths: no autograd on a residual)
    return Compressed(frame)


def decompress(c: Any, device: Any = None, *, threads: int = 0, max_nbytes: Optional[int] = None):
    """Decompress a frame into a tensor of its original dtype and shape.

    Args:
        c: a :class:`Compressed`, :class:`CudaCompressed` or :class:`PinnedCompressed`, or the
            frame as bytes, bytearray, memoryview, or a uint8 numpy array or torch tensor.
        device: where to put the result (``"cpu"``, ``"cuda:0"``, a ``torch.device``). A
            CUDA device decodes on that GPU (after checking the frame on the host; a frame
            with a zstd stage, or a GPU the CUDA codec cannot drive, is decoded on the host and
            copied); a :class:`CudaCompressed` decodes on its own GPU by default, without
            waiting (a ``rel`` bound or a sum is checked first, with one wait).
        threads: CPU threads to use, 0 for automatic.
        max_nbytes: refuse (``ValueError``) a frame that decodes to more bytes than this,
            before anything is inflated or allocated. A valid frame of zeros can be tiny and
            describe a huge tensor: set this when frames come from untrusted sources.

    Returns:
        torch.Tensor: the decoded tensor (a numpy array when torch is not installed; bfloat16
        then needs torch).

    Raises:
        cfc.FormatError: the buffer is malformed (truncated, corrupted, crafted, newer format).
        TypeError: the object is not a frame holder.
    """
    torch = _torch()
    _check_max_nbytes(c, max_nbytes)
    threads = _check_threads(threads)
    if isinstance(c, PinnedCompressed):
        info = c._info
        target = None if device is None else torch.device(device)
        if target is not None and target.type == "cuda" and target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        gpu = not info["zstd"] and (info["codec"] == "lossless" or info["dtype"] in _DTYPE_NAMES)
        if target is not None and target.type == "cuda" and gpu and _device_supported(target.index):
            if c._chunk_ends is not None and c.nbytes >= 2 * _FETCH_PIECE:
                return _fetch_lossless(c, target)
            frame_dev = torch.empty(c.nbytes, dtype=torch.uint8, device=target)
            frame_dev.copy_(c._tensor, non_blocking=True)
            return _decompress_cuda(
                frame_dev, info["numel"], info["dtype"], tuple(info["shape"]), len(info["shape"]),
                codec=info["codec"],
            )
        c = bytes(c)
    if isinstance(c, CudaCompressed):
        target = c.device if device is None else torch.device(device)
        if target.type == "cuda" and target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        if target == c.device:
            if c._mode in ("rel", "sum"):
                c.synchronize()  # reports an unusable rel bound or a failed sum instead of decoding garbage
            codec = "lossless" if c._mode == "lossless" else "quantized"  # raw frames: read on the GPU
            return _decompress_cuda(c._out, c.numel, c._dtype, c._shape, len(c._shape), after=c._event, codec=codec)
        c = c.to_host()
    if torch is None and device is not None and str(device).split(":")[0] != "cpu":
        raise ValueError(f"decoding to {device!r} needs torch, which is not installed")
    target = None if device is None or torch is None else torch.device(device)
    if target is not None and target.type == "cuda":
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
    if target is not None and target.type == "cuda" and _device_supported(target.index):
        buf = _frame_buffer(c)
        _native.validate(buf)  # the whole frame, on the host, before the GPU reads it
        info = _native.frame_info(buf)
        # The GPU decodes quantized frames, raw frames of the float types, and lossless frames
        # of every dtype; the zstd stage and raw frames of other dtypes stay on the host.
        on_gpu = not info["zstd"] and (info["codec"] == "lossless" or info["dtype"] in _DTYPE_NAMES)
        if on_gpu:
            frame_dev = _upload(buf, target)
            return _decompress_cuda(
                frame_dev, info["numel"], info["dtype"], tuple(info["shape"]), len(info["shape"]),
                codec=info["codec"],
            )
    buf = _frame_buffer(c)
    # The native side checks the whole frame before allocating the output.
    raw = _native.decompress(buf, threads=threads)
    info = _native.frame_info(buf)
    shape = tuple(info["shape"])
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


def _upload(buf: bytes, target):
    """The frame's bytes on device ``target``, through pinned host memory: the copy runs at
    full PCIe speed, and a compressed frame is that much less to move than the tensor."""
    import torch

    host = torch.empty(len(buf), dtype=torch.uint8, pin_memory=True)
    host.numpy()[:] = np.frombuffer(buf, dtype=np.uint8)
    dev = torch.empty(len(buf), dtype=torch.uint8, device=target)
    # torch's pinned-memory allocator keeps `host` from reuse until the copy is done.
    dev.copy_(host, non_blocking=True)
    return dev


def _check_max_nbytes(c: Any, max_nbytes: Optional[int]) -> None:
    """Refuse (``ValueError``) a frame whose header says it decodes to more than ``max_nbytes``
    bytes, from the header alone: nothing is inflated or allocated first."""
    if max_nbytes is None:
        return
    if isinstance(c, CudaCompressed):
        decoded = c.decoded_nbytes
    elif isinstance(c, PinnedCompressed):
        decoded = c._info["decoded_nbytes"]
    else:
        decoded = frame_info(c)["decoded_nbytes"]
    if decoded > max_nbytes:
        raise ValueError(f"the frame decodes to {decoded} bytes, more than max_nbytes={max_nbytes}")


def frame_info(c: Any) -> Dict[str, Any]:
    """Read a frame's header: dtype, shape, numel, eps, step, mode, bits, codec, zstd,
    exceptions, nbytes, decoded_nbytes and version.

    Raises:
        cfc.FormatError: the header is malformed.
    """
    return _native.frame_info(_frame_buffer(c))


def sum_compressed(
    items: Iterable[Any], *, zstd: Union[bool, int] = False, max_nbytes: Optional[int] = None
) -> Union[Compressed, CudaCompressed]:
    """Element-wise sum of frames quantized with the same step, adding integer codes exactly.

    Frames compressed with the same absolute ``eps`` share a step. The result decodes to the
    sum of the originals within the sum of the bounds (plus one rounding to the dtype); NaN
    and infinities propagate.

    :class:`CudaCompressed` frames (all on one GPU) are added on that GPU: the codes go into an
    integer accumulator and the sum is packed there, with the bytes the host would write, and
    nothing waits for the GPU. The result is then a :class:`CudaCompressed` whose steps and
    overflow are checked when it is first waited for (``nbytes``, ``bytes()``, ``decompress``).

    ``max_nbytes``, as in :func:`decompress`, refuses (``ValueError``) frames that decode to
    more bytes than this, from their headers, before anything is inflated or allocated (the sum
    holds 8 bytes per element while it adds). Set it when frames come from untrusted sources.

    Raises:
        TypeError: the frames have different dtypes, or mix CUDA and host frames.
        ValueError: CUDA frames with ``zstd``, on different devices, or lossless ones.
        cfc.CfcError: different shapes or steps, or codes that overflow 64 bits.
    """
    items = list(items)
    zstd_level = _zstd_level(zstd)
    for c in items:
        _check_max_nbytes(c, max_nbytes)
    cuda = [isinstance(c, CudaCompressed) for c in items]
    if any(cuda):
        if not all(cuda):
            raise TypeError("sum_compressed takes CUDA frames or host frames, not both")
        if zstd:
            raise ValueError("the zstd stage is not available on the GPU: sum the frames on the host")
        return _sum_cuda(items)
    frames = [_frame_buffer(c) for c in items]
    return Compressed(_native.sum_frames(frames, zstd_level=zstd_level))


def _sum_cuda(items) -> CudaCompressed:
    """:func:`sum_compressed` of :class:`CudaCompressed` frames, checked as the host checks."""
    first = items[0]
    for c in items:
        if c._mode == "lossless":
            raise ValueError("lossless frames hold no codes to add on the GPU: sum bytes(c) on the host")
        if c.device != first.device:
            raise ValueError(f"frames on {first.device} and {c.device}: move them to one GPU first")
        if c._dtype != first._dtype:
            raise TypeError(f"frames of {first._dtype} and {c._dtype} cannot be added")
        if c._shape != first._shape:
            raise _native.CfcError(f"frames of shapes {first._shape} and {c._shape} cannot be added")
    return _sum_frames_cuda([c._out for c in items], first._dtype, first._shape, after=[c._event for c in items])


def _sum_frames_cuda(frames, dtype: str, shape, after=(), capacity: int = 0) -> CudaCompressed:
    """Sum device-resident frames of ``dtype`` and ``shape`` (quantized or raw, written by the
    GPU codec or checked on the host) on the current stream, after the events ``after``; the
    output holds at least ``capacity`` bytes."""
    import torch

    dev = frames[0].device
    n = int(np.prod(shape, dtype=np.int64))
    cap, ws_len = _native.cuda_sum_sizes(n, dtype, len(shape), len(frames))
    out = torch.empty(max(cap, capacity), dtype=torch.uint8, device=dev)
    ws = torch.empty(ws_len, dtype=torch.uint8, device=dev)
    stream = torch.cuda.current_stream(dev)
    for e in after:
        stream.wait_event(e)  # made on another stream: wait for it on the GPU
    for f in frames:
        f.record_stream(stream)
    _native.cuda_sum(
        dev.index, stream.cuda_stream, [f.data_ptr() for f in frames], [f.numel() for f in frames], n, dtype,
        list(shape), out.data_ptr(), out.numel(), ws.data_ptr(), ws_len,
    )
    return CudaCompressed(out, ws, dtype, tuple(shape), "sum", stream)


def _decode_sum_cuda(frames, numel: int, dtype: str, out, scale: float = 1.0, ndim: int = 1, status=None):
    """Write ``scale`` times the sum of the frames' decoded values into ``out`` (a contiguous
    CUDA tensor of ``numel`` float32, bfloat16 or float16 elements), on the current stream, in
    one pass that reads only the frames: ``ndim``-dimensional frames of ``numel`` elements of
    ``dtype`` (quantized or raw: uint8 tensors, each checked on the GPU to lie within its own
    bytes), each with its own step. Each frame's value is what :func:`decompress` gives, widened
    to float32; they are added in float32 in order and multiplied by ``scale`` (a float32;
    skipped when it is 1).

    ``status``: two int32 on the device, zero before their first use (a new pair if None),
    returned. A frame that fails its check sets them (see :func:`_decode_status_error`), and
    while they are not zero nothing is written into ``out``."""
    import torch

    dev = out.device
    ws_len = _native.cuda_decode_sum_workspace_len(numel, len(frames))
    ws = torch.empty(ws_len, dtype=torch.uint8, device=dev)
    if status is None:
        status = torch.zeros(2, dtype=torch.int32, device=dev)
    stream = torch.cuda.current_stream(dev)
    _native.cuda_decode_sum(
        dev.index, stream.cuda_stream, [f.data_ptr() for f in frames], [f.numel() for f in frames], numel, dtype,
        ndim, scale, out.data_ptr(), _dtype_name(out.dtype), ws.data_ptr(), ws_len, status.data_ptr(),
    )
    return status


def _decode_status_error(status) -> Optional[str]:
    """The failure a :func:`_decode_sum_cuda` status reports (read back: waits for the GPU), or
    None."""
    bits, which = (int(v) for v in status.tolist())
    if bits == 0:
        return None
    frame = f"frame {which - 1}" if which else "a frame"
    return (f"{frame} is not a frame of the elements decoded, laid out as its header says within its size "
            "(checked on the GPU): nothing was decoded from then on")


def fixed_rate_size(shape: Iterable[int], bits: int) -> int:
    """Exact size in bytes of a ``bits=`` frame of finite data with this shape."""
    dims = [_check_integer("a dimension", d) for d in shape]
    if any(not 0 <= d < 1 << 64 for d in dims):
        raise ValueError(f"dimensions must be between 0 and 2**64 - 1, got {dims}")
    return _native.fixed_rate_size(dims, _check_bits(bits))
