"""Argument checks and dtype names shared by the codec (:mod:`cfc.codec`), its GPU paths
(:mod:`cfc._gpu`) and the DDP options: every public entry point refuses a bad argument with a
``ValueError`` or ``TypeError`` that names it, before anything native runs."""

from __future__ import annotations

import numbers
import operator
from typing import Any, Optional, Tuple, Union

import numpy as np

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


def _addr(a: np.ndarray) -> int:
    """Address of a contiguous array's first byte (0 for an empty array)."""
    return a.ctypes.data if a.nbytes else 0


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
