"""The codec on CUDA tensors: frames written by the GPU (:class:`CudaCompressed`), frames kept
in pinned host memory for a GPU to fetch (:class:`PinnedCompressed`, :func:`pin`), and the
queued operations behind them (compress, decompress, sums of frames, decoded sums). Nothing here
waits for the GPU unless a docstring says so. :mod:`cfc.codec` is the public face.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import numpy as np

from cfc import _native
from cfc._checks import _ELEMENT_SIZE, _check_apart, _span, _torch_dtype

if TYPE_CHECKING:
    from cfc.codec import Compressed

@functools.lru_cache(maxsize=None)
def _device_supported(index: int) -> bool:
    """Asked at every CUDA compress (a device's compute capability does not change, and the
    probe costs tens of microseconds of driver calls)."""
    return _native.cuda_supported(index)


def _cuda_ready(t) -> bool:
    """Whether tensor ``t`` lives on a CUDA device the native CUDA codec can drive (others,
    including GPUs older than compute capability 8.0, take the CPU codec)."""
    return t.device.type == "cuda" and _device_supported(t.device.index)


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
    ndim = len(info["shape"])
    cur.wait_event(events[0])
    _native.cuda_lossless_offsets(cur, frame_dev, ndim, out, ws)
    for i, ev in enumerate(events):
        cur.wait_event(ev)
        _native.cuda_lossless_chunks(cur, frame_dev, ndim, out, ws, bounds[i], bounds[i + 1])
    return out


def pin(c: Any) -> PinnedCompressed:
    """Check a frame once and copy it into pinned host memory (see :class:`PinnedCompressed`).

    Raises:
        cfc.FormatError: the frame is malformed.
    """
    import torch

    from cfc.codec import _frame_buffer  # the public module, which imports this one

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

    __slots__ = ("_out", "_ws", "_host", "_event", "_dtype", "_shape", "_mode", "_codec")

    def __init__(self, out, ws, dtype: str, shape: Tuple[int, ...], mode: str, stream, codec: str = "quantized"):
        """``stream``: the device's current stream, on which the kernels were queued; ``codec``:
        the decoder the frame needs ("quantized", "lossless" or "rice"; each also reads the raw
        frames its encoder may fall back to)."""
        import torch

        self._out, self._ws = out, ws
        self._dtype, self._shape, self._mode, self._codec = dtype, shape, mode, codec
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
        from cfc.codec import Compressed  # the public module, which imports this one

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


def _compress_cuda(t, name: str, shape, eps, rel, bits, residual=None, coder="planes") -> CudaCompressed:
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
    _native.cuda_compress(stream, t, list(shape), out, ws, eps=eps, rel=rel, bits=bits, residual=residual,
                          coder=coder)
    # Input and residual must outlive the queued kernels even if the caller drops them and they
    # were made on another stream: tell the caching allocator they are used on this one.
    t.record_stream(stream)
    if residual is not None:
        residual.record_stream(stream)
    mode = "abs" if eps is not None else "rel" if rel is not None else "bits"
    return CudaCompressed(out, ws, name, tuple(shape), mode, stream, "rice" if coder == "rice" else "quantized")


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
    _native.cuda_compress_lossless(stream, t, list(shape), out, ws)
    t.record_stream(stream)  # the input must outlive the queued kernels
    return CudaCompressed(out, ws, name, shape, "lossless", stream, "lossless")


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
    _native.cuda_decompress(stream, frame_dev, ndim, out, ws, codec=codec)
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


def _sum_cuda(items) -> CudaCompressed:
    """:func:`sum_compressed` of :class:`CudaCompressed` frames, checked as the host checks."""
    first = items[0]
    for c in items:
        if c._mode == "lossless":
            raise ValueError("lossless frames hold no codes to add on the GPU: sum bytes(c) on the host")
        if c._codec == "rice":
            raise ValueError("rice frames are summed on the host: sum bytes(c)")
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
    _native.cuda_sum(stream, list(frames), dtype, list(shape), out, ws)
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
    if out.numel() != numel:
        raise ValueError(f"the decoded sum of frames of {numel} elements into {out.numel()}")
    ws_len = _native.cuda_decode_sum_workspace_len(numel, len(frames))
    ws = torch.empty(ws_len, dtype=torch.uint8, device=dev)
    if status is None:
        status = torch.zeros(2, dtype=torch.int32, device=dev)
    stream = torch.cuda.current_stream(dev)
    _native.cuda_decode_sum(stream, list(frames), dtype, ndim, scale, out, ws, status)
    return status


def _decode_status_error(status) -> Optional[str]:
    """The failure a :func:`_decode_sum_cuda` status reports (read back: waits for the GPU), or
    None."""
    bits, which = (int(v) & 0xFFFFFFFF for v in status.tolist())
    return _native.decode_status_error(bits | which << 32)
