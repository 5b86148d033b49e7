"""Checkpoints of whole models: ``cfc.save(state_dict, path)`` and ``cfc.load(path)``.

A checkpoint file is::

    magic "CFCK" | version u8 (1) | 3 zero bytes | index length u64 | index CRC-32 u32 |
    4 zero bytes (all little-endian) | index: UTF-8 JSON | frames, back to back

The index maps each tensor's name, in the order saved, to the offset and length of its frame
(from the end of the index; each frame starts where the one before ends), the CRC-32 of the
frame's bytes, and its dtype and shape; it also holds the caller's ``metadata`` (strings only).
The index is at most 100 MB, and no key appears twice in any of its objects.
Every tensor is one cfc frame: lossless by default, or within a bound given per tensor.
Loading checks the index's checksum and every entry (the frames back to back and filling the
file, the tensors' total size within ``max_nbytes``) before decoding anything; then each
frame's checksum, the frame against its entry, and the frame itself (a frame that decodes to
more bytes than its entry says is refused). A corrupted or truncated file raises
:class:`cfc.FormatError`, naming the tensor where one is to blame.
"""

from __future__ import annotations

import errno
import json
import numbers
import os
import secrets
import stat
import struct
import zlib
from typing import Any, Callable, Dict, Mapping, Optional, Union

from cfc import _native
from cfc._checks import _DTYPE_NAMES, _LOSSLESS_ONLY, _check_flag, _dtype_name
from cfc.codec import Compressed, compress, decompress

__all__ = ["save", "load"]

MAGIC = b"CFCK"
VERSION = 1
_PREFIX = struct.Struct("<4sB3xQI4x")  # magic, version, reserved, index length, index CRC-32, reserved
# The index of a checkpoint is small (about a hundred bytes per tensor): refuse longer ones
# before parsing them, since the parsed JSON takes many times its bytes in memory.
_MAX_INDEX = 100_000_000

BoundSpec = Optional[Dict[str, float]]


def _naming(e: Exception, name: str) -> Exception:
    """An exception of ``e``'s type with the tensor's name in front of its message (``e``
    itself where that type takes other arguments)."""
    try:
        return type(e)(f"{name!r}: {e}")
    except Exception:
        return e


def _bound_for(bounds, name: str, tensor) -> BoundSpec:
    import torch

    if bounds is None:
        return None
    if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        # Integers, bool and float64 are stored losslessly: a function of bounds is not asked
        # about them (it may be a blanket rule); a dict that names one with a bound is a mistake.
        if not callable(bounds) and bounds.get(name) is not None:
            raise TypeError(
                f"{name!r} is a {_dtype_name(tensor.dtype)} tensor: bounds apply to float32, bfloat16 "
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

    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of names to tensors, got {type(tensors).__name__}")
    if metadata is not None and (
        not isinstance(metadata, Mapping)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise TypeError("metadata must map strings to strings")
    if bounds is not None and not isinstance(bounds, Mapping) and not callable(bounds):
        raise TypeError(f"bounds must be None, a mapping or a function, got {type(bounds).__name__}")
    index: Dict[str, Any] = {"__metadata__": dict(metadata or {})}
    frames = []
    offset = 0
    uncompressed = 0
    for name, t in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"tensor names must be strings other than '__metadata__', got {name!r}")
        if name in index:
            raise ValueError(f"{name!r} is given twice")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
        if t.layout != torch.strided or t.is_nested or t.device.type == "meta":
            raise TypeError(f"{name!r}: cfc stores dense tensors with data, got a {t.layout} tensor on {t.device}")
        bound = _bound_for(bounds, name, t)
        try:
            c = compress(t, zstd=zstd, lossless=True) if bound is None else compress(t, zstd=zstd, **bound)
            frame = bytes(c)
        except (TypeError, ValueError) as e:
            named = _naming(e, name)
            if named is e:
                raise
            raise named from e
        index[name] = {
            "dtype": _dtype_name(t.dtype),
            "shape": list(t.shape),
            "offset": offset,
            "nbytes": len(frame),
            "crc32": zlib.crc32(frame),
        }
        frames.append(frame)
        offset += len(frame)
        uncompressed += t.numel() * t.element_size()
    head = json.dumps(index, separators=(",", ":")).encode()
    if len(head) > _MAX_INDEX:
        raise ValueError(
            f"the names and metadata take {len(head)} bytes of index, more than a checkpoint holds "
            f"({_MAX_INDEX}): keep large data in tensors"
        )
    path = os.fsdecode(path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "a checkpoint is a file, and this is a directory", path)
    # A name no other writer uses, created here or not at all (O_EXCL: never through a link
    # someone left at that name); two saves to one path each write their own file, and the
    # last rename wins whole.
    tmp = f"{path}.{os.getpid()}-{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, VERSION, len(head), zlib.crc32(head)))
            f.write(head)
            for frame in frames:
                f.write(frame)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
        os.replace(tmp, path)
        _sync_directory(os.path.dirname(path) or ".")
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass  # already gone
        raise
    size = _PREFIX.size + len(head) + offset
    return {
        "tensors": len(frames),
        "bytes": size,
        "uncompressed": uncompressed,
        "ratio": uncompressed / size if size else 0.0,
    }


def _sync_directory(directory: str) -> None:
    """Put a rename in ``directory`` on disk too (POSIX; elsewhere a directory cannot be
    opened, and the rename is as durable as the system makes it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not sync directories
    finally:
        os.close(fd)


def _corrupt(path, why: str) -> Exception:
    return _native.FormatError(f"{os.fspath(path)}: {why}")


def _no_duplicates(pairs):
    """``object_pairs_hook`` of the index: a key given twice is refused (readers that keep the
    first and readers that keep the last would see different checkpoints)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k!r} appears twice")
        out[k] = v
    return out


def _read_file(path) -> bytes:
    """The bytes of a regular file: a FIFO, a device or a directory is refused before it is
    read (opened without blocking, and never read past the size it had when opened)."""
    if isinstance(path, bool) or not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"path must be a str, bytes or path-like object, got {type(path).__name__}")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{os.fsdecode(path)}: not a regular file")
        return f.read(st.st_size)


def _target_device(device):
    import torch

    if device is None:
        device = "cpu"
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r}: {e}") from None
    if target.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = target.index if target.index is not None else (torch.cuda.current_device() if count else 0)
        if index >= count:
            raise ValueError(f"device {device!r}: this machine has {count} CUDA device(s)")
    return target


def load(
    path: Union[str, os.PathLike],
    device: Any = "cpu",
    *,
    metadata: bool = False,
    max_nbytes: Optional[int] = None,
):
    """Read a checkpoint written by :func:`save`.

    Args:
        path: the file (``str``, ``bytes`` or path-like; a regular file: a pipe or a device
            is refused, where reading could block or never end).
        device: where the tensors go (``"cpu"`` or None, ``"cuda:0"``, a ``torch.device``). On a CUDA
            device the frames are decoded by the GPU (those with a zstd stage, or all of them
            on a GPU the CUDA codec cannot drive, on the host, then copied).
        metadata: also return the metadata dict.
        max_nbytes: refuse (``ValueError``) a checkpoint whose tensors take more bytes than
            this, before any is decoded. Tensors of zeros compress about a million times (a
            file of a few hundred bytes can hold a 1 GB tensor): set this when checkpoints come
            from untrusted sources.

    Returns:
        dict[str, torch.Tensor] (in the saved order), or ``(tensors, metadata)``.

    Raises:
        cfc.FormatError: not a cfc checkpoint, truncated, a checksum that does not match, or
            a frame that is malformed or disagrees with the index (naming the tensor).
        ValueError: a device that does not exist here, a path that is not a regular file, or
            tensors larger than ``max_nbytes``.
    """
    _check_flag("metadata", metadata)
    if max_nbytes is not None and (isinstance(max_nbytes, bool) or not isinstance(max_nbytes, numbers.Integral)):
        raise TypeError(f"max_nbytes must be an integer, got {type(max_nbytes).__name__}")
    target = _target_device(device)
    data = _read_file(path)
    path = os.fsdecode(path)
    if len(data) < _PREFIX.size:
        raise _corrupt(path, f"{len(data)} bytes, shorter than a checkpoint's {_PREFIX.size}-byte prefix")
    magic, version, head_len, head_crc = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise _corrupt(path, f"not a cfc checkpoint (magic {magic!r})")
    if version != VERSION:
        raise _corrupt(path, f"checkpoint version {version} is not supported (this cfc reads {VERSION})")
    if data[5:8] != b"\0\0\0" or data[20:24] != b"\0\0\0\0":
        raise _corrupt(path, "nonzero reserved bytes")
    if head_len > len(data) - _PREFIX.size:
        raise _corrupt(path, f"index of {head_len} bytes does not fit in the file")
    if head_len > _MAX_INDEX:
        raise _corrupt(path, f"index of {head_len} bytes, more than a checkpoint's {_MAX_INDEX}")
    head = data[_PREFIX.size : _PREFIX.size + head_len]
    if zlib.crc32(head) != head_crc:
        raise _corrupt(path, "index checksum mismatch (the file is corrupted)")
    try:
        index = json.loads(head.decode(), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _corrupt(path, f"unreadable index ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(index, dict):
        raise _corrupt(path, "the index is not a JSON object")
    meta = index.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _corrupt(path, "metadata is not a map of strings")
    import torch

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    base = _PREFIX.size + head_len
    # First the whole index: every entry well formed, the frames back to back within the file,
    # and the tensors' total size within max_nbytes, before anything is decoded.
    entries = []
    end = 0
    total = 0
    for name, e in index.items():
        ok = isinstance(e, dict) and all(is_int(e.get(k)) for k in ("offset", "nbytes", "crc32"))
        ok = ok and isinstance(e.get("dtype"), str) and isinstance(e.get("shape"), list)
        ok = ok and all(is_int(d) for d in e["shape"])
        if not ok:
            raise _corrupt(path, f"{name!r}: malformed index entry")
        off, n, dtype, shape = e["offset"], e["nbytes"], e["dtype"], e["shape"]
        if off != end:
            raise _corrupt(path, f"{name!r}: its frame does not start where the previous one ends")
        if base + off + n > len(data):
            raise _corrupt(path, f"{name!r}: its frame lies outside the file")
        if dtype not in _DTYPE_NAMES + _LOSSLESS_ONLY:
            raise _corrupt(path, f"{name!r}: unknown dtype {dtype[:40]!r}")
        size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        for d in shape:
            size *= d
        total += size
        entries.append((name, off, n, e["crc32"], dtype, shape, size))
        end = off + n
    if base + end != len(data):
        raise _corrupt(path, f"{len(data) - base - end} bytes after the last frame")
    if max_nbytes is not None and total > max_nbytes:
        raise ValueError(f"{path}: its tensors take {total} bytes, more than max_nbytes={max_nbytes}")
    out = {}
    for name, off, n, crc, dtype, shape, size in entries:
        frame = data[base + off : base + off + n]
        if zlib.crc32(frame) != crc:
            raise _corrupt(path, f"{name!r}: checksum mismatch (the file is corrupted)")
        try:
            c = Compressed(frame)
            held = (str(c.info["dtype"]), list(c.shape))
        except _native.FormatError as e:
            raise _corrupt(path, f"{name!r}: {e}") from None
        if held != (dtype, shape):
            raise _corrupt(path, f"{name!r}: frame holds {held[0]} {held[1]}, index says {dtype} {shape}")
        try:
            out[name] = decompress(c, device=target, max_nbytes=size)
        except _native.FormatError as e:
            raise _corrupt(path, f"{name!r}: {e}") from None
    return (out, meta) if metadata else out
