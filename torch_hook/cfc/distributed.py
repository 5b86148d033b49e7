"""The compressed all-reduce across processes, over torch.distributed.

:func:`all_reduce` runs cfc's collective algorithm (``cfc::collective`` in the Rust core: an
agreement round, one shared quantization step, an exact reduce-scatter of integer codes, an
all-gather) with :class:`TorchTransport` moving the bytes through an initialised
``torch.distributed`` process group. CPU tensors, any backend (gloo in CI).

Example::

    >>> # xdoctest: +SKIP (needs an initialised process group)
    >>> y, report = cfc.distributed.all_reduce(grad, eps=1e-4, average=True, residual=r)
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from cfc import _native
from cfc.codec import _addr, _check_residual, _tensor_bytes

__all__ = ["TorchTransport", "all_reduce"]


class TorchTransport:
    """Moves cfc's byte messages between the ranks of a torch.distributed group.

    ``all_to_all`` first gathers every rank's message sizes, then posts one non-blocking send
    and one receive per peer, so each rank sends only its own messages.
    """

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)

    def _peer(self, j: int) -> int:
        import torch.distributed as dist

        return j if self.group is dist.group.WORLD else dist.get_global_rank(self.group, j)

    def all_to_all(self, parts: List[bytes]) -> List[bytes]:
        """Sends ``parts[j]`` to rank ``j``; returns what each rank sent here, by sender."""
        import torch
        import torch.distributed as dist

        sizes = torch.tensor([len(p) for p in parts], dtype=torch.int64)
        table = [torch.empty(self.world, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(table, sizes, group=self.group)
        received: List[Any] = [None] * self.world
        requests = []
        for j in range(self.world):
            if j == self.rank:
                received[j] = parts[j]
                continue
            incoming = torch.empty(int(table[j][self.rank]), dtype=torch.uint8)
            received[j] = incoming
            outgoing = torch.frombuffer(bytearray(parts[j]), dtype=torch.uint8)
            requests.append(dist.isend(outgoing, dst=self._peer(j), group=self.group))
            requests.append(dist.irecv(incoming, src=self._peer(j), group=self.group))
        for r in requests:
            r.wait()
        return [r if isinstance(r, bytes) else r.numpy().tobytes() for r in received]


def all_reduce(
    tensor: Any,
    *,
    eps: Optional[float] = None,
    rel: Optional[float] = None,
    average: bool = False,
    residual: Any = None,
    group: Any = None,
    transport: Any = None,
) -> Tuple[Any, Dict[str, float]]:
    """Sum (or average) a CPU tensor over the ranks of a process group, compressed.

    Every rank must call it with the same shape, dtype and options; otherwise every rank gets a
    ``cfc.CfcError`` (no rank hangs on the others).

    Args:
        tensor: a CPU float32, bfloat16 or float16 tensor.
        eps, rel: the bound each rank's contribution is quantized with (exactly one). ``rel`` is
            relative to the largest magnitude over all ranks.
        average: divide the sum by the number of ranks.
        residual: error feedback: a float32 CPU tensor of the same size, zero at the first call,
            updated in place with what this rank's quantization dropped.
        group: the process group (default: the world).
        transport: anything with ``rank``, ``world`` and ``all_to_all`` (default:
            :class:`TorchTransport` over ``group``).

    Returns:
        (tensor, dict): the result, same shape and dtype; and ``eps``, ``bound`` (on
        ``|result - exact|``), ``bytes_sent``, ``bytes_uncompressed`` (a ring all-reduce's).
    """
    import torch

    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        raise ValueError(
            "cfc.distributed.all_reduce takes CPU tensors (the NCCL transport for CUDA tensors "
            "is not in this release)"
        )
    data, name, shape = _tensor_bytes(tensor)
    r = None
    if residual is not None:
        _check_residual(residual, tensor)
        r = residual.detach().reshape(-1).view(torch.uint8).numpy()
    t = transport if transport is not None else TorchTransport(group)
    raw, report = _native.allreduce(
        t,
        _addr(data),
        data.nbytes,
        name,
        eps=eps,
        rel=rel,
        average=average,
        residual_ptr=0 if r is None else _addr(r),
        residual_nbytes=0 if r is None else r.nbytes,
    )
    dtype = getattr(torch, name)
    out = torch.frombuffer(raw, dtype=dtype) if len(raw) else torch.empty(0, dtype=dtype)
    return out.reshape(shape), report
