"""Checkpoints of whole models: ``cfc.save(state_dict, path)`` and ``cfc.load(path)``.

A checkpoint file is::

    magic "CFCK" | version u8 (1) | 3 zero bytes | index length u64 | index CRC-32 u32 |
    4 zero bytes (all little-endian) | index: UTF-8 JSON | frames, back to back

The index maps each tensor's name, in the order saved, to the offset and length of its frame
(from the end of the index; each frame starts where the one before ends), the CRC-32 of the
frame's bytes, and its dtype and shape; it also holds the caller's ``metadata`` (strings only).
Every tensor is one cfc frame: lossless by default, or within a bound given per tensor.
Loading checks the index's checksum, then each frame's before decoding it (and refuses a frame
that decodes to more bytes than its index entry says), then the frame against the entry; a
corrupted or truncated file raises :class:`cfc.FormatError`, naming the tensor where one is to
blame.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from typing import Any, Callable, Dict, Mapping, Optional, Union

from cfc import _native
from cfc.codec import Compressed, compress, decompress

__all__ = ["save", "load"]

MAGIC = b"CFCK"
VERSION = 1
_PREFIX = struct.Struct("<4sB3xQI4x")  # magic, version, reserved, index length, index CRC-32, reserved
# The index of a checkpoint is small (a few hundred bytes per tensor): refuse absurd lengths
# before reading them.
_MAX_INDEX = 1 << 30

BoundSpec = Optional[Dict[str, float]]


def _bound_for(bounds, name: str, tensor) -> BoundSpec:
    import torch

    if bounds is None:
        return None
    if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        # Integers, bool and float64 are stored losslessly: a function of bounds is not asked
        # about them (it may be a blanket rule); a dict that names one with a bound is a mistake.
        if not callable(bounds) and bounds.get(name) is not None:
            raise TypeError(
                f"{name!r} is a {str(tensor.dtype)[6:]} tensor: bounds apply to float32, bfloat16 "
                "and float16 tensors only (give it None, or leave it out, to store it losslessly)"
            )
        return None
    spec = bounds(name, tensor) if callable(bounds) else bounds.get(name)
    if spec is None:
        return None
    if not isinstance(spec, Mapping) or len(spec) != 1 or next(iter(spec)) not in ("eps", "rel", "bits"):
        raise ValueError(
            f"the bound of {name!r} must be None (lossless) or one of {{'eps': x}}, {{'rel': x}}, "
            f"{{'bits': n}}, got {spec!r}"
        )
    return dict(spec)


def save(
    tensors: Mapping[str, Any],
    path: Union[str, os.PathLike],
    *,
    bounds: Union[None, Mapping[str, BoundSpec], Callable[[str, Any], BoundSpec]] = None,
    zstd: Union[bool, int] = False,
    metadata: Optional[Mapping[str, str]] = None,
) -> Dict[str, Any]:
    """Write a checkpoint of named tensors (a model's ``state_dict()``, for one).

    Args:
        tensors: name -> ``torch.Tensor`` (any device, any dtype cfc knows: float32, bfloat16,
            float16, float64, uint8, int8, int16, int32, int64, bool).
        path: the file to write (``str``, ``bytes`` or path-like; replaced atomically:
            written beside it, then renamed; nothing is left behind when writing fails).
        bounds: ``None`` stores every tensor losslessly. A dict from name to a bound
            (``{"eps": 1e-4}``, ``{"rel": 1e-3}`` or ``{"bits": 8}``; a missing name or
            ``None`` means lossless), or a function ``(name, tensor) -> bound or None``.
            Bounds apply to float32, bfloat16 and float16 tensors only: the function is
            called for those alone (the others are stored losslessly), and a dict that gives
            another tensor a bound is a ``TypeError``.
        zstd: add the zstd stage to every frame (``True`` for level 1, or a level up to 22).
        metadata: strings to keep with the checkpoint (read back by ``load(..., metadata=True)``).

    Returns:
        dict: ``tensors``, ``bytes`` (the file's size), ``uncompressed`` (bytes of the tensors)
        and ``ratio``.
    """
    import torch

    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("metadata must map strings to strings")
    index: Dict[str, Any] = {"__metadata__": dict(metadata or {})}
    frames = []
    offset = 0
    uncompressed = 0
    for name, t in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"tensor names must be strings other than '__metadata__', got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
        bound = _bound_for(bounds, name, t)
        c = compress(t, zstd=zstd, lossless=True) if bound is None else compress(t, zstd=zstd, **bound)
        frame = bytes(c)
        index[name] = {
            "dtype": str(t.dtype).replace("torch.", ""),
            "shape": list(t.shape),
            "offset": offset,
            "nbytes": len(frame),
            "crc32": zlib.crc32(frame),
        }
        frames.append(frame)
        offset += len(frame)
        uncompressed += t.numel() * t.element_size()
    head = json.dumps(index, separators=(",", ":")).encode()
    path = os.fsdecode(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, VERSION, len(head), zlib.crc32(head)))
            f.write(head)
            for frame in frames:
                f.write(frame)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass  # never made, or already gone
        raise
    size = _PREFIX.size + len(head) + offset
    return {
        "tensors": len(frames),
        "bytes": size,
        "uncompressed": uncompressed,
        "ratio": uncompressed / size if size else 0.0,
    }


def _corrupt(path, why: str) -> Exception:
    return _native.FormatError(f"{os.fspath(path)}: {why}")


def load(
    path: Union[str, os.PathLike],
    device: Any = "cpu",
    *,
    metadata: bool = False,
):
    """Read a checkpoint written by :func:`save`.

    Args:
        path: the file.
        device: where the tensors go (``"cpu"``, ``"cuda:0"``, a ``torch.device``). On a CUDA
            device the frames are decoded by the GPU (those with a zstd stage, or all of them
            on a GPU the CUDA codec cannot drive, on the host, then copied).
        metadata: also return the metadata dict.

    Returns:
        dict[str, torch.Tensor] (in the saved order), or ``(tensors, metadata)``.

    Raises:
        cfc.FormatError: not a cfc checkpoint, truncated, a checksum that does not match, or
            a frame that disagrees with the index.
    """
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < _PREFIX.size:
        raise _corrupt(path, f"{len(data)} bytes, shorter than a checkpoint's {_PREFIX.size}-byte prefix")
    magic, version, head_len, head_crc = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise _corrupt(path, f"not a cfc checkpoint (magic {magic!r})")
    if version != VERSION:
        raise _corrupt(path, f"checkpoint version {version} is not supported (this cfc reads {VERSION})")
    if data[5:8] != b"\0\0\0" or data[20:24] != b"\0\0\0\0":
        raise _corrupt(path, "nonzero reserved bytes")
    if head_len > min(_MAX_INDEX, len(data) - _PREFIX.size):
        raise _corrupt(path, f"index of {head_len} bytes does not fit in the file")
    head = data[_PREFIX.size : _PREFIX.size + head_len]
    if zlib.crc32(head) != head_crc:
        raise _corrupt(path, "index checksum mismatch (the file is corrupted)")
    try:
        index = json.loads(head.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _corrupt(path, f"unreadable index ({type(e).__name__})") from None
    if not isinstance(index, dict):
        raise _corrupt(path, "the index is not a JSON object")
    meta = index.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _corrupt(path, "metadata is not a map of strings")
    import torch

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    base = _PREFIX.size + head_len
    end = 0
    out = {}
    for name, e in index.items():
        ok = isinstance(e, dict) and all(is_int(e.get(k)) for k in ("offset", "nbytes", "crc32"))
        ok = ok and isinstance(e.get("dtype"), str) and isinstance(e.get("shape"), list)
        ok = ok and all(is_int(d) for d in e["shape"])
        if not ok:
            raise _corrupt(path, f"{name!r}: malformed index entry")
        off, n, dtype, shape = e["offset"], e["nbytes"], e["dtype"], e["shape"]
        if off != end:
            raise _corrupt(path, f"{name!r}: frame at {off}, where the previous one ends at {end}")
        if base + off + n > len(data):
            raise _corrupt(path, f"{name!r}: frame at {off}+{n} lies outside the file")
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise _corrupt(path, f"{name!r}: unknown dtype {dtype!r}")
        frame = data[base + off : base + off + n]
        if zlib.crc32(frame) != e["crc32"]:
            raise _corrupt(path, f"{name!r}: checksum mismatch (the file is corrupted)")
        c = Compressed(frame)
        if str(c.info["dtype"]) != dtype or list(c.shape) != shape:
            raise _corrupt(path, f"{name!r}: frame holds {c.info['dtype']} {list(c.shape)}, index says {dtype} {shape}")
        size = torch.empty((), dtype=torch_dtype).element_size()
        for d in shape:
            size *= d
        out[name] = decompress(c, device=device, max_nbytes=size)
        end = off + n
    if base + end != len(data):
        raise _corrupt(path, f"{len(data) - base - end} bytes after the last frame")
    return (out, meta) if metadata else out
