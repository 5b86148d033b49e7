"""Compress and decompress tensors: the Python face of the cfc codec.

Torch is imported lazily, so ``import cfc`` works without it (numpy arrays can still be
compressed); :func:`decompress` returns a ``torch.Tensor`` when torch is installed. CUDA
tensors go through :mod:`cfc._gpu`; argument checks live in :mod:`cfc._checks`.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple, Union

import numpy as np

from cfc import _native
from cfc._checks import (
    _DTYPE_NAMES,
    _LOSSLESS_ONLY,
    _addr,
    _check_bits,
    _check_apart,
    _check_dense,
    _check_integer,
    _check_number,
    _check_residual,
    _check_threads,
    _dtype_name,
    _flat_view,
    _span,
    _tensor_bytes,
    _torch,
    _torch_dtype,
    _unsupported,
    _zstd_level,
)
from cfc._gpu import (
    _FETCH_PIECE,
    CudaCompressed,
    PinnedCompressed,
    _compress_cuda,
    _compress_lossless_cuda,
    _cuda_ready,
    _decompress_cuda,
    _device_supported,
    _fetch_lossless,
    _sum_cuda,
    _upload,
    pin,
)

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


def compress(
    x: Any,
    *,
    eps: Optional[float] = None,
    rel: Optional[float] = None,
    bits: Optional[int] = None,
    rms: Optional[float] = None,
    block: Optional[int] = None,
    zstd: Union[bool, int] = False,
    threads: int = 0,
    residual: Any = None,
    lossless: bool = False,
    coder: str = "planes",
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
        rms: block scales: each block of ``block`` elements is bounded by this fraction
            (below 1) of its own RMS, rounded down to a power of two, so small and large
            regions of a tensor keep the same relative precision. The frame records each
            block's step; ``.eps`` is the coarsest block's bound. Written by the CPU codec (a
            CUDA tensor goes through a host copy), and decoded on the host (a CUDA ``device``
            gets a copy); the distributed engine writes and reads them on GPUs.
        block: elements per block of ``rms=``, a power of two from 32 to 2**24 (default 256).
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
        coder: how the codes are written. ``"planes"`` (bit planes of each group's width,
            written and read on the CPU and on GPUs) or ``"rice"`` (Rice codes in blocks of
            1024: 12-39% fewer bytes on gradients, near the codes' entropy; written and read on
            the CPU and on GPUs). Not with ``bits=``.

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
    rms = None if rms is None else _check_number("rms", rms)
    block = None if block is None else _check_integer("block", block)
    threads = _check_threads(threads)
    zstd_level = _zstd_level(zstd)  # (checked before any branch: the same errors on every device)
    if coder not in ("planes", "rice"):
        raise ValueError(f'coder must be "planes" or "rice", not {coder!r}')
    if coder == "rice" and (bits is not None or lossless):
        raise ValueError('coder="rice" writes quantized codes with eps= or rel=; bits= and lossless= '
                         "have layouts of their own")
    if torch is not None and isinstance(x, torch.Tensor):
        _check_dense(x, "compress")
    caller_x = x  # (its memory is what a residual must stay out of)
    if torch is not None and isinstance(x, torch.Tensor) and x.is_neg():
        # A lazily negated view (the imaginary part of a conjugate): its memory holds -x, and
        # both codecs read memory.
        x = x.resolve_neg()
    if lossless:
        if eps is not None or rel is not None or bits is not None or rms is not None:
            raise ValueError("lossless=True takes no bound (eps=, rel=, bits= or rms=)")
        if residual is not None:
            raise ValueError("lossless=True drops nothing: it takes no residual")
        if torch is not None and isinstance(x, torch.Tensor) and not zstd and _cuda_ready(x):
            name = _dtype_name(x.dtype)
            if name not in _DTYPE_NAMES + _LOSSLESS_ONLY:
                raise _unsupported(x.dtype, True)
            return _compress_lossless_cuda(x, name)
        data, name, shape = _tensor_bytes(x, lossless=True)
        frame = _native.compress_lossless(data, name, list(shape), zstd_level=zstd_level, threads=threads)
        return Compressed(frame)
    if (
        torch is not None
        and isinstance(x, torch.Tensor)
        and not zstd
        and (coder == "planes" or bits is None)
        and rms is None  # (block scales: the CPU codec)
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and _cuda_ready(x)
    ):
        if residual is not None:
            _check_residual(residual, x)
            _check_apart(*_span(caller_x), residual.data_ptr(), 4 * residual.numel())
        return _compress_cuda(x, _dtype_name(x.dtype), tuple(x.shape), eps, rel, bits, residual, coder)
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
        data,
        name,
        list(shape),
        eps=eps,
        rel=rel,
        bits=bits,
        rms=rms,
        block=block,
        zstd_level=zstd_level,
        threads=threads,
        coder=coder,
        residual=r,
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
        gpu = not info["zstd"] and not info["block"] and (
            info["codec"] == "lossless" or info["dtype"] in _DTYPE_NAMES
        )
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
            # (raw frames are read by the decoder of the codec their encoder fell back from)
            return _decompress_cuda(c._out, c.numel, c._dtype, c._shape, len(c._shape), after=c._event,
                                    codec=c._codec)
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
        on_gpu = not info["zstd"] and not info["block"] and (
            info["codec"] == "lossless" or info["dtype"] in _DTYPE_NAMES
        )
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


def fixed_rate_size(shape: Iterable[int], bits: int) -> int:
    """Exact size in bytes of a ``bits=`` frame of finite data with this shape."""
    dims = [_check_integer("a dimension", d) for d in shape]
    if any(not 0 <= d < 1 << 64 for d in dims):
        raise ValueError(f"dimensions must be between 0 and 2**64 - 1, got {dims}")
    return _native.fixed_rate_size(dims, _check_bits(bits))
