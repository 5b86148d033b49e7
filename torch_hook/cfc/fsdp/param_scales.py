"""Per-parameter scales of :mod:`cfc.fsdp`: each parameter's gradient multiplied by a power of
two, the same on every rank, that brings its root mean square over the ranks into [0.5, 1)
before its group is quantized, and divided out of the result after.

Why: FSDP2 reduce-scatters a module's parameters as one group, and a bound that follows the data
(``rms=``, ``rel=``) sets one step for the whole group. Groups mix gradients of very different
sizes: in the byte-level LM of ``examples/``, the root group holds the output head (RMS about
1e-3 to 1e-2) with the token and position embeddings (1e-5 to 4e-4), so at ``rms=0.05`` the
embeddings' step is 1.1-5.3x their own RMS and 94-99.7% of their values round to 0, leaving them to
error feedback alone (``benches/group_scales.py`` prints this per parameter). Scaled, every
parameter's step is ``k`` times its own RMS within a factor of two, whatever the grouping. A
power of two changes no bit of a value (barring subnormals), so the codes still add exactly and
the bound holds for each parameter in its own units.

The scales are agreed through the engine (``Engine.gather``: one float64 per parameter and
rank, over the engine's own links), each call its own (:func:`agree`, which waits on the host
for the group's input). The engine's block scales (``CfcState(block=K)``) need no such wait:
they travel a step ahead in the exchange's rows. float16 groups are sent unscaled (see
:func:`scalable`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Tuple


def row_lengths(param_group: Any) -> Optional[Tuple[int, ...]]:
    """The elements each parameter of an FSDP parameter group takes in one rank's row of the
    reduce-scatter input (its padded shard), in the order FSDP lays them out; None where this
    torch keeps them elsewhere (FSDP's private layout)."""
    try:
        params = param_group.fsdp_params
        order = list(getattr(param_group, "_reduce_scatter_param_indices", None) or range(len(params)))
        return tuple(int(params[i].padded_sharded_param_size.numel()) for i in order)
    except Exception:  # noqa: BLE001 - a private API: without it, the group is scaled whole
        return None


def scalable(dtype: Any) -> bool:
    """Whether scaling values of ``dtype`` by powers of two changes no bit: float32 and
    bfloat16 (float16's narrow exponent range would overflow or lose subnormal bits)."""
    import torch

    return dtype in (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=1024)
def _on_device(lengths: Tuple[int, ...], device: Any) -> Any:
    """``lengths`` as a tensor on ``device``, made once (no copy from the host per call)."""
    import torch

    return torch.tensor(lengths, device=device)


def norms(rows: Any, lengths: Tuple[int, ...]) -> Optional[Any]:
    """Each parameter's float32 norm over ``rows`` (a 2-D view: one row per rank's shard, or one
    row; parameter ``i`` takes ``lengths[i]`` columns), on ``rows``' device; None where
    ``lengths`` does not tile a row (a parameter without a gradient this step: the group is then
    sent unscaled)."""
    import torch

    if sum(lengths) != rows.shape[1] or not lengths:
        return None
    out, at = [], 0
    for n in lengths:
        out.append(torch.linalg.vector_norm(rows[:, at : at + n], dtype=torch.float32))
        at += n
    return torch.stack(out)


def _squares(norms_on_host: Any) -> Any:
    """Norms as float64 sums of squares (squared in float64: a sum of squares of large gradients
    stays finite)."""
    import numpy as np

    return norms_on_host.numpy().astype(np.float64) ** 2


def factors_of(everyone: List[Any], lengths: Tuple[int, ...], rows: int) -> Any:
    """The factors (float32, on the host) from every rank's sums of squares (``everyone``: one
    float64 array per rank, in rank order, each over ``rows`` rows of ``lengths`` columns)."""
    import numpy as np
    import torch

    # (the host's arithmetic in numpy: a few microseconds, where each torch op on the CPU costs
    # more, on the thread that queues the backward pass)
    sq = np.zeros(len(lengths), dtype=np.float64)
    for mine in everyone:  # (in rank order: every rank adds the same numbers in the same order)
        sq += mine
    count = np.asarray(lengths, dtype=np.float64) * (rows * len(everyone))
    with np.errstate(over="ignore", invalid="ignore"):
        rms = np.sqrt(sq / count).astype(np.float32)
    # rms = m * 2**e with m in [0.5, 1): the factor 2**-e brings it to m, made from its bits
    # (frexp and the bits are exact). A zero or non-finite RMS (an overflow) keeps the factor 1.
    _, e = np.frexp(rms)
    e = np.where(np.isfinite(rms) & (rms > 0), e, 0).clip(-64, 64)
    return torch.from_numpy(((127 - e).astype(np.int32) << 23).view(np.float32))


def _split(everyone: List[bytes], what: str) -> List[Any]:
    """Every rank's gathered bytes as float64 arrays; ``ValueError`` (``what``) where their
    sizes differ."""
    import numpy as np

    if any(len(b) != len(everyone[0]) for b in everyone):
        raise ValueError(f"cfc.fsdp: {what} ({sorted({len(b) // 8 for b in everyone})} numbers per rank)")
    return [np.frombuffer(b, dtype=np.float64) for b in everyone]


def agree(rows: Any, lengths: Tuple[int, ...], gather: Callable[[bytes], List[bytes]]) -> Optional[Any]:
    """Each parameter's factor (a float32 tensor on the host, so that callers can tell without
    waiting on the device which factors are 1) for ``rows`` (see :func:`norms`), from its sum of
    squares over every rank, agreed now; None where ``lengths`` does not tile a row.
    :func:`columns` spreads them over a row."""
    n = norms(rows, lengths)
    return None if n is None else agree_norms(n, lengths, rows.shape[0], gather)


def agree_norms(n: Any, lengths: Tuple[int, ...], rows: int, gather: Callable[[bytes], List[bytes]]) -> Any:
    """:func:`agree` from this rank's :func:`norms`.

    ``gather`` is the engine's (``Engine.gather``): every rank's sums, in rank order, through
    the engine's own links, so that a peer that failed ends this wait as it ends the engine's
    (a collective of torch's process group would wait for its timeout, and leave the group
    out of step for every later collective). It waits on the host for this rank's sums."""
    everyone = _split(gather(_squares(n.cpu()).tobytes()), "the ranks' groups hold different numbers of parameters")
    return factors_of(everyone, lengths, rows)


def columns(factors: Any, lengths: Tuple[int, ...], device: Any = None) -> Any:
    """Per-parameter ``factors`` as one per column of a row (parameter ``i`` over
    ``lengths[i]`` columns), on ``device`` (default: the factors'). Host factors go to a GPU
    through pinned memory, queued on the current stream: a plain copy would wait on the host
    for everything queued on that stream (the engine's decoding, for the factors' inverse)."""
    import torch

    device = factors.device if device is None else torch.device(device)
    if factors.device != device:
        pinned = device.type == "cuda" and factors.device.type == "cpu"
        factors = (factors.pin_memory() if pinned else factors).to(device, non_blocking=pinned)
    return factors.repeat_interleave(_on_device(tuple(lengths), device), output_size=sum(lengths))
