"""Error-feedback residuals of :mod:`cfc.fsdp` kept in 4 bits per element between calls
(``register(..., residual_bits=4)``): half a byte per unsharded parameter instead of 4.

A residual is what the decoder did not reproduce: within the group's step ``eps`` everywhere
(in the units the group was quantized in: with per-parameter scales, every parameter's residual
lies within the same scaled ``eps``). So one number per group, the largest magnitude over 7,
and a signed code in -7..7 per element keep it to within 1/14 of that largest magnitude; the
rounding is lost, as the decoder's rounding would be without error feedback, but it is at most
a fourteenth of it. Between its calls a group keeps only the codes, the number and its
per-parameter factors; during its call the residual is a float32 tensor again (one group at a
time: FSDP's reduce-scatters run one after the other).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

LEVELS = 7  # codes -7..7, two to a byte


@dataclass
class Packed:
    """A residual of ``numel`` float32 values as 4-bit codes times ``step`` (a 0-d float32
    tensor on the residual's device), in the units of ``factors`` (the per-parameter factors
    of the call that left it, parameter ``i`` over ``lengths[i]`` columns of each of its
    ``rows``; or None)."""

    codes: Any
    step: Any
    numel: int
    factors: Optional[Any] = None
    rows: int = 1
    lengths: Optional[Tuple[int, ...]] = None

    def nbytes(self) -> int:
        f = 0 if self.factors is None else self.factors.numel() * self.factors.element_size()
        return self.codes.numel() + self.step.element_size() + f


def pack(r: Any, factors: Optional[Any] = None, rows: int = 1, lengths: Optional[Tuple[int, ...]] = None) -> Packed:
    """``r`` (float32, 1-D, finite) as 4-bit codes (see the module docs), with the factors of
    the units it is in. (In 8-bit integers throughout: a few passes over ``r``, which a GPU
    run of FSDP2 makes for every group and step.)"""
    import torch

    top = torch.linalg.vector_norm(r, float("inf"))
    step = torch.where(top > 0, top / LEVELS, torch.ones_like(top))
    q = r / step
    q.round_().clamp_(-LEVELS, LEVELS)
    n = r.numel()
    codes = torch.zeros(n + n % 2, dtype=torch.int8, device=r.device)
    codes[:n].copy_(q)
    pairs = codes.view(-1, 2)
    # low nibble: the even element's code; high nibble: the odd one's (two's complement, 4 bits)
    packed = (pairs[:, 0] & 0xF) | (pairs[:, 1] << 4)
    return Packed(packed.view(torch.uint8), step, n, factors, rows, lengths)


def unpack(p: Packed) -> Any:
    """The float32 residual of ``p``, in the units it was packed in."""
    import torch

    b = p.codes.view(torch.int8)
    out = torch.empty(2 * b.numel(), dtype=torch.float32, device=b.device)
    pairs = out.view(-1, 2)
    # (arithmetic shifts of 8-bit integers bring each nibble back with its sign)
    torch.mul((b << 4) >> 4, p.step, out=pairs[:, 0])
    torch.mul(b >> 4, p.step, out=pairs[:, 1])
    return out[: p.numel]
