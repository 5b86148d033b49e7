"""Error-feedback residuals of :mod:`cfc.fsdp` kept in 4 bits per element between calls
(``register(..., residual_bits=4)``): about half a byte per unsharded parameter instead of 4.

A residual is what the decoder did not reproduce: within the step's bound everywhere, and that
bound differs from block to block (block scales). So each chunk of 256 values keeps one number, its
largest magnitude over 7, and a signed code in -7..7 per element keeps each value to within 1/14
of its chunk's largest; the rounding is lost, as the decoder's rounding would be without error
feedback, but it is at most a fourteenth of it. Between its calls a group keeps only the codes
and the chunks' numbers (4 bytes per 256 values); during its call the
residual is a float32 tensor again (one group at a time: FSDP's reduce-scatters run one after
the other).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LEVELS = 7  # codes -7..7, two to a byte
CHUNK = 256  # values per step: one float32 per chunk


@dataclass
class Packed:
    """A residual of ``numel`` float32 values as 4-bit codes times ``step`` (one float32 per
    chunk of :data:`CHUNK` values, on the residual's device)."""

    codes: Any
    step: Any
    numel: int

    def nbytes(self) -> int:
        return self.codes.numel() + self.step.numel() * self.step.element_size()


def pack(r: Any) -> Packed:
    """``r`` (float32, 1-D, finite) as 4-bit codes (see the module docs). (In 8-bit integers throughout: a few passes over ``r``, which a GPU
    run of FSDP2 makes for every group and step.)"""
    import torch

    n = r.numel()
    chunks = -(-n // CHUNK)
    padded = torch.zeros(chunks * CHUNK, dtype=torch.float32, device=r.device)
    padded[:n].copy_(r)
    by_chunk = padded.view(chunks, CHUNK)
    top = by_chunk.abs().amax(dim=1, keepdim=True)
    step = torch.where(top > 0, top / LEVELS, torch.ones_like(top))
    q = by_chunk / step
    q.round_().clamp_(-LEVELS, LEVELS)
    codes = q.to(torch.int8).view(-1)  # (CHUNK is even: whole pairs)
    pairs = codes.view(-1, 2)
    # low nibble: the even element's code; high nibble: the odd one's (two's complement, 4 bits)
    packed = (pairs[:, 0] & 0xF) | (pairs[:, 1] << 4)
    return Packed(packed.view(torch.uint8), step.view(-1), n)


def unpack(p: Packed) -> Any:
    """The float32 residual of ``p``."""
    import torch

    b = p.codes.view(torch.int8)
    out = torch.empty(2 * b.numel(), dtype=torch.float32, device=b.device)
    pairs = out.view(-1, 2)
    # (arithmetic shifts of 8-bit integers bring each nibble back with its sign)
    pairs[:, 0].copy_((b << 4) >> 4)
    pairs[:, 1].copy_(b >> 4)
    out.view(-1, CHUNK).mul_(p.step.view(-1, 1))
    return out[: p.numel]
