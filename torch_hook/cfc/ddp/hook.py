"""``cfc_hook`` and ``register_comm_hook``: DDP's side of the engine.

The hook hands each bucket to the engine with one call and returns a completed future: DDP's
reducer reads the buckets only after the step's last one, and there the hook waits until the
engine has every bucket (of every rank) done, and orders the current stream after the results.
So the autograd thread never waits for the GPU or the wire before the last bucket, and a
failure anywhere (any rank, any bucket) reaches ``backward()`` on every rank at that bucket.
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Any, List, Optional

import cfc
from cfc import _engine
from cfc.ddp.residuals import fingerprint, ordinals
from cfc.ddp.state import CfcState

logger = logging.getLogger("cfc")


def cfc_hook(state, bucket):  # no annotations: DDP checks them against its own types
    """Compressed all-reduce (average) of one DDP gradient bucket: register it with
    ``ddp.register_comm_hook(CfcState(...), cfc_hook)``.

    Returns a ``torch.futures.Future`` holding the averaged bucket, written in place into
    ``bucket.buffer()``.
    """
    return reduce_bucket(state, bucket)


def _compressible(buf: Any) -> bool:
    import torch

    return not buf.is_sparse and buf.dtype in (torch.float32, torch.bfloat16, torch.float16)


def reduce_bucket(state: CfcState, bucket: Any) -> Any:
    """:func:`cfc_hook`'s work, for DDP's reducer."""
    import torch

    last = False
    step = getattr(state, "step", None)  # (a step closed by _end_step is not closed again)
    try:
        if not isinstance(state, CfcState):
            raise TypeError(f"cfc_hook's state must be a cfc.CfcState, got {type(state).__name__}")
        state._serve("cfc_hook")
        # Each of the bucket's methods lets go of Python's lock: each is called once.
        buf, last, index = bucket.buffer(), bucket.is_last(), bucket.index()
        if not _compressible(buf):
            _plain(state, buf)
        else:
            engine = state._engine_for(buf.device)
            residuals = state._residuals
            layout = residuals.layout(bucket, buf)
            parts, scatter = residuals.parts(index, buf, layout)
            stream = _engine.stream_of(buf)
            for i, (key, flat, sub) in enumerate(parts):
                r, fresh = residuals.get(key, sub, flat) if state._feeds(flat) else (None, False)
                residuals.layouts[key] = ordinals(sub)
                state._keep.append((flat, r))
                engine.submit(key, fingerprint(sub, flat), flat, r, None, None, last and i == len(parts) - 1, fresh,
                              stream)
            if scatter is not None:
                state._scatters.append(scatter)
        if last:
            state._end_step(_engine.stream_of(buf))
    except BaseException as e:  # noqa: BLE001 - handed to DDP (backward() raises it) or AllReducer
        _fail(state, e, last and getattr(state, "step", None) == step)
        return _failed_future(e)
    done = torch.futures.Future()
    done.set_result(buf)
    return done


def _fail(state: Any, e: BaseException, last: bool) -> None:
    """A failure in this rank's hook: the peers hear of it (their waits end), and where the
    step's last bucket failed before the step closed (``last``), the step closes here (its
    earlier buckets' memory is let go)."""
    engine = getattr(state, "_engine", None)
    if engine is not None and not isinstance(e, cfc.CfcError):
        engine.fail(f"{type(e).__name__}: {e}")
    if last and isinstance(state, CfcState):
        state._scatters = []
        state._let_go()
        state._residuals.end_step()
        state.step += 1


def _plain(state: CfcState, buf: Any) -> None:
    """A bucket cfc does not compress (sparse gradients, float64): averaged over the process
    group from this thread, once the engine has finished what it was given (so that the two
    never run collectives at once)."""
    import torch.distributed as dist

    kind = f"sparse {buf.dtype}" if buf.is_sparse else str(buf.dtype)
    if kind not in state._plain_kinds:
        state._plain_kinds.add(kind)
        logger.warning("cfc: buckets of %s gradients are all-reduced plainly (cfc compresses dense float32, "
                       "bfloat16 and float16)", kind)
    state._bind()
    if state._engine is not None:
        state._engine.wait(_engine.stream_of_device(state._device))
    dist.all_reduce(buf, group=state.process_group)
    buf.div_(state.world)


def _failed_future(e: BaseException) -> Any:
    """A future that has failed with ``e``, as DDP's reducer sees a failure: backward() raises
    a RuntimeError that names ``e``'s type and message (a callback that raises is what marks a
    future failed where the reducer looks)."""
    import torch

    def fail(_: Any) -> None:
        raise e

    done = torch.futures.Future()
    failed = done.then(fail)
    done.set_result(None)
    return failed


def _group_ranks(group: Any) -> List[int]:
    """The global ranks of ``group`` (None: the world)."""
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def register_comm_hook(ddp: Any, state: Optional[CfcState] = None) -> bool:
    """Register :func:`cfc_hook` on a ``DistributedDataParallel`` model, unless it measurably
    cannot pay on this link. Returns whether it registered the hook.

    Any Python comm hook costs host time on every bucket, even one that only calls NCCL's
    all-reduce: on links fast enough that compression never pays (NVLink), the fastest hook is
    no hook. So with ``state.fallback == "auto"`` and CUDA parameters, this first runs the
    trial on buckets of the size DDP's largest bucket will have (random values of the
    parameters' dtype, the slowest rank's time deciding): if plain all-reduce was faster,
    nothing is registered and DDP keeps its built-in all-reduce; otherwise :func:`cfc_hook` is
    registered and its own trial then decides bucket by bucket. What the probe measured is in
    ``state.probe``. In every other case it registers the hook directly.

    Call it on every rank, after ``init_process_group``. ``state`` defaults to ``CfcState()``;
    its process group defaults to DDP's.

    Example::

        >>> # needs an initialised process group and GPUs: not run as a doctest
        >>> state = cfc.CfcState(fallback="auto")  # doctest: +SKIP
        >>> # over NVLink: False, and DDP's own all-reduce stays
        >>> cfc.register_comm_hook(ddp_model, state)  # doctest: +SKIP
        False
    """
    import torch

    from cfc.distributed import AllReducer

    state = state if state is not None else CfcState()
    if not isinstance(state, CfcState):
        raise TypeError(f"state must be a cfc.CfcState, got {type(state).__name__}")
    ddp = getattr(ddp, "_orig_mod", ddp)  # torch.compile(ddp_model) wraps the DDP model
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register_comm_hook takes a DistributedDataParallel model, got {type(ddp).__name__}")
    state._serve("cfc_hook")
    served = state._model() if state._model is not None else None
    if served is not None and served is not ddp:
        raise ValueError(
            "this CfcState already serves another DDP model: give each model its own (its step "
            "count, residuals and per-bucket choices are that model's)"
        )
    if state.process_group is None and not state.world:
        state.process_group = ddp.process_group
    elif _group_ranks(state.process_group) != _group_ranks(ddp.process_group):
        # The buckets would be averaged over other ranks than DDP's: replicas would drift apart.
        raise ValueError(
            f"the state's process group (ranks {_group_ranks(state.process_group)}) is not the DDP "
            f"model's (ranks {_group_ranks(ddp.process_group)}): give CfcState DDP's group, or none"
        )
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    if state.fallback != "auto" or not params or not params[0].is_cuda or state._engine is not None:
        ddp.register_comm_hook(state, cfc_hook)
        state._model = weakref.ref(ddp)
        return True

    # The probe: an engine of the same options on a bucket of the largest size DDP will make.
    o = state.options
    probe = CfcState(
        state.process_group, **{o.bound_kind: o.bound}, error_feedback=o.error_feedback, warmup_steps=1,
        min_compress_numel=o.min_compress_numel, fallback="auto", trial_steps=max(4, o.trial_steps),
        algorithm=o.algorithm, timeout=o.timeout,
    )
    dev, dtype = params[0].device, params[0].dtype
    cap = max(1, ddp.bucket_bytes_cap // params[0].element_size())
    n = min(sum(p.numel() for p in params), max(cap, max(p.numel() for p in params)))
    gen = torch.Generator(device=dev).manual_seed(1234 + torch.distributed.get_rank())
    values = (torch.randn(n, device=dev, generator=gen) * 1e-3).to(dtype)
    x = torch.empty_like(values)
    reducer = AllReducer(probe, chunk_numel=n)
    try:
        for _ in range(probe.warmup_steps + probe.trial_steps + 1):
            x.copy_(values)  # the same gradient-like values each time (a call averages in place)
            reducer(x).wait()
        buckets = probe._engine.state()["buckets"]
    finally:
        reducer.close()
    b = buckets[0] if buckets else {}
    best = lambda xs: min(xs) if xs else math.nan  # noqa: E731
    register = bool(b.get("decision", False))
    state.probe = {"numel": n, "dtype": str(dtype).replace("torch.", ""), "plain_seconds": best(b.get("trial_plain", [])),
                   "compressed_seconds": best(b.get("trial_compressed", [])), "registered": register}
    logger.info("cfc: probe of %d-element buckets: %s: %s", n, state.probe,
                "cfc_hook registered" if register else "DDP's own all-reduce kept")
    if register:
        ddp.register_comm_hook(state, cfc_hook)
        state._model = weakref.ref(ddp)
    return register
