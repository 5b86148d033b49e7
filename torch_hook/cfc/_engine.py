"""Opening cfc's engine (``cfc::engine`` in the Rust core) for a torch.distributed process group.

Every rank of the group opens its engine at the same point (the first bucket of a
:class:`cfc.CfcState`, the first call of an :class:`cfc.distributed.AllReducer`). The ranks
exchange what they need through the group's store, not through a collective of the group (a
DDP hook must not issue collectives of DDP's own group): each rank's link addresses, and for
CUDA engines over NCCL, rank 0's NCCL id. The engine then joins its own links (TCP: the data of
CPU engines, the failure board of CUDA ones) and its own NCCL communicator; nothing of torch's
is used after that, so the engine never waits for torch's collectives nor they for it.

Which engine: CPU tensors run the CPU backend over TCP; CUDA tensors of a group whose backend
takes them with NCCL run the CUDA backend over NCCL; CUDA tensors of a gloo group (ranks that
share a GPU, where NCCL refuses them) run the CUDA backend over TCP, through host memory.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import logging
import secrets
import socket
import weakref
from typing import Any, Dict, List, Optional, Tuple

from cfc import _native

logger = logging.getLogger("cfc")

# Engines opened so far per group (by its ranks): every rank opens its group's engines in the
# same order, so the n-th engine of a group has the same keys in the store on every rank.
_opened: Dict[Tuple[int, ...], "itertools.count[int]"] = {}

# The engines still open, stopped when the process exits (see _settle_at_exit).
_live: "weakref.WeakSet[Any]" = weakref.WeakSet()

# How long an exiting process waits for engines that were not closed to stop.
EXIT_WAIT_SECONDS = 10.0
_exit_handler_registered = False


def _settle_at_exit() -> None:
    """At exit (registered at the first engine, after torch's own exit handlers, so it runs
    before them): engines not closed (``CfcState.close``) are stopped, and their threads, with
    those of engines let go of earlier, are waited for (at most ``EXIT_WAIT_SECONDS``), so that
    none is still finalizing its NCCL communicator or freeing device memory while the process
    unloads those libraries. (A process with 4 ranks on GPUs that let go of its states without
    closing them crashed at exit; closed, it did not.)"""
    for engine in list(_live):
        engine.stop()
    left = _native.settle_dropped_engines(EXIT_WAIT_SECONDS)
    if left:
        logger.warning("cfc: %d engine thread(s) still stopping after %.0f s at exit", left, EXIT_WAIT_SECONDS)


def _store(group: Any) -> Any:
    """The group's store (a prefix of the default store)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    get = getattr(c10d, "_get_process_group_store", None)
    if get is not None:
        return get(group)
    ranks = ",".join(str(r) for r in dist.get_process_group_ranks(group))  # pragma: no cover
    return dist.PrefixStore(f"cfc-group-{ranks}/", c10d._get_default_store())  # pragma: no cover


def _uses_nccl(group: Any) -> bool:
    """Whether the group moves CUDA tensors with NCCL (alone, or in a mixed backend)."""
    import torch.distributed as dist

    return "nccl" in str(dist.get_backend(group)).lower()


def _wait_for(store: Any, keys: Dict[int, str], timeout: float, rank: int, n: int, what: str) -> None:
    """Waits at most ``timeout`` seconds for every key of ``keys`` (by rank) in the store;
    raises ``cfc.CfcError`` naming the ranks whose keys did not come."""
    try:
        store.wait(list(keys.values()), datetime.timedelta(seconds=timeout))
        return
    except RuntimeError as e:  # torch's stores raise a RuntimeError (DistStoreError) on timeout
        missing = [j for j, k in keys.items() if not store.check([k])]
        if not missing:
            raise _native.CfcError(f"cfc: rank {rank} could not read the store ({what}): {e}") from e
    raise _native.CfcError(
        f"cfc: rank {rank} waited {timeout:g} s for rank(s) {missing} to open cfc's engine (engine {n} "
        f"of this group: {what}), and they did not. Likely causes: cfc's hook is registered (or an "
        "AllReducer or cfc.fsdp called) on some ranks only, the ranks took different paths (a rank "
        "that failed, or one still in an earlier step), or they gave different options. "
        "CfcState(timeout=...) bounds this wait.")


def open_engine(group: Any, device: Any, options: Dict[str, Any], agree_token: int = 0) -> Any:
    """Opens this rank's engine over ``group`` for tensors on ``device`` (a ``torch.device``),
    with ``options`` (the keyword arguments of ``_native.Engine``'s options). A collective of
    the group's ranks, through its store, every wait bounded by ``options["timeout"]``; raises
    ``cfc.CfcError`` on every rank where it fails (ranks that never open theirs, rank 0 could
    not make an NCCL id, a link could not be made, the ranks' options differ).

    Rank 0 makes the engine's secret (32 random bytes from the operating system) and shares it
    through the store: the engine's links admit only peers that prove they hold it (see
    ``src/engine/transport/tcp/handshake.rs``). The ranks' host names decide where the links
    listen: on loopback when every rank runs on this host, else on the interface that reaches
    ``MASTER_ADDR`` (``CFC_LINK_ADDR`` overrides). The ranks' nodes, for the two-level exchange
    (option ``topology``), are their host names, or ``CFC_NODE`` where it is set (nodes emulated
    on one host)."""
    import torch.distributed as dist

    ranks = tuple(dist.get_process_group_ranks(group))
    rank, world = dist.get_rank(group), len(ranks)
    n = next(_opened.setdefault(ranks, itertools.count()))
    prefix = f"cfc/engine/{n}"
    timeout = float(options["timeout"])
    store = _store(group)
    # Round 1: every rank's host, and rank 0's secret (set before rank 0's host: there when it is).
    if rank == 0:
        store.set(f"{prefix}/secret", secrets.token_hex(32))
    host = socket.gethostname()
    store.set(f"{prefix}/host/{rank}", f"{host}\t{_native.env_node() or host}")
    hosts = {j: f"{prefix}/host/{j}" for j in range(world)}
    _wait_for(store, hosts, timeout, rank, n, "their hosts")
    places = [store.get(hosts[j]).decode(errors="replace") for j in range(world)]
    one_host = len({v.split("\t")[0] for v in places}) == 1
    nodes = [v.split("\t")[-1] for v in places]
    secret = bytes.fromhex(store.get(f"{prefix}/secret").decode())
    # Round 2: every rank's link addresses, and for NCCL rank 0's id (set before rank 0's links).
    listener = _native.Listener(one_host)
    cuda = device.type == "cuda"
    nccl = cuda and _uses_nccl(group)
    if nccl and rank == 0:
        try:
            store.set(f"{prefix}/nccl", "id:" + _native.nccl_unique_id())
        except _native.CfcError as e:  # every rank fails alike, none waits for an id
            store.set(f"{prefix}/nccl", f"error:{e}")
    store.set(f"{prefix}/links/{rank}", ",".join(listener.addresses()))
    links = {j: f"{prefix}/links/{j}" for j in range(world)}
    _wait_for(store, links, timeout, rank, n, "their link addresses")
    nccl_id: Optional[str] = None
    if nccl:
        said = store.get(f"{prefix}/nccl").decode()
        if not said.startswith("id:"):
            raise _native.CfcError(f"rank 0 could not make an NCCL id: {said[6:]}")
        nccl_id = said[3:]
    addresses: List[List[str]] = [store.get(links[j]).decode().split(",") for j in range(world)]
    engine = _native.Engine(
        listener, addresses, rank, world, secret, n,
        device=device.index if cuda else None, nccl_id=nccl_id, nodes=nodes, agree_token=agree_token,
        **options,
    )
    global _exit_handler_registered
    if not _exit_handler_registered:
        atexit.register(_settle_at_exit)
        _exit_handler_registered = True
    _live.add(engine)
    return engine


def stream_of(t: Any) -> Any:
    """The calling thread's current CUDA stream on ``t``'s device (None for a CPU tensor), as
    the engine takes it."""
    return stream_of_device(t.device)


def stream_of_device(device: Any) -> Any:
    """The calling thread's current CUDA stream on ``device`` (None for the CPU or none)."""
    if device is None or device.type != "cuda":
        return None
    import torch

    return torch.cuda.current_stream(device)
