"""Drop-in replacement for the original ``cuda_float_compress`` package.

Switch with one line::

    import cfc.compat as cuda_float_compress

``cuszplus_compress(tensor, max_error)`` returns the compressed frame as a 1-D uint8 CPU tensor
and ``cuszplus_decompress(blob, device)`` returns a 1-D float32 tensor on ``device``, as the
original did. Unlike the original, the bound is strict (no element ever exceeds
``max_error``), any float32 shape is accepted (it is flattened, as the original required),
and NaN/Inf survive.
"""

from __future__ import annotations

from typing import Any

from cfc.codec import compress, decompress

__all__ = ["cuszplus_compress", "cuszplus_decompress"]


def cuszplus_compress(tensor: Any, max_error: float):
    """Compress a float32 tensor so that every element comes back within ``max_error``.

    Args:
        tensor: a float32 ``torch.Tensor`` on CPU or GPU (flattened to 1-D).
        max_error: the absolute bound (> 0).

    Returns:
        torch.Tensor: the frame, a 1-D ``torch.uint8`` CPU tensor.
    """
    import torch

    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32:
        raise TypeError("cuszplus_compress expects a float32 torch.Tensor")
    frame = bytes(compress(tensor.reshape(-1), eps=float(max_error), zstd=True))
    return torch.frombuffer(bytearray(frame), dtype=torch.uint8)


def cuszplus_decompress(blob: Any, device: Any = "cpu"):
    """Decompress a frame made by :func:`cuszplus_compress` into a 1-D float32 tensor on ``device``."""
    out = decompress(blob, device=device)
    return out.reshape(-1)
