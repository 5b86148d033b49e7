"""cfc for FSDP2: a compressed reduce-scatter of ``fully_shard``'s gradients.

:func:`register` installs a :class:`CfcReduceScatter` on every ``FSDPModule`` of a model
(through ``FSDPModule.set_custom_reduce_scatter``, torch 2.9 and later). FSDP hands each call a
flat, padded, rank-major input (one shard per rank, in ``reduce_dtype``) and an output for this
rank's shard; cfc's engine (the one behind :func:`cfc.cfc_hook`) quantizes the whole input once,
with a step every rank shares and with error feedback, sums every rank's codes for each shard
exactly as integers, and writes this rank's averaged (or summed, as FSDP asks) shard.

The call returns once its result is queued on the current stream (FSDP's reduce-scatter
stream), as FSDP requires: unlike the DDP hook, each compressed group's exchange is waited for
on the host (``Engine.order``) before the next group's backward is queued. The wait ends when
the exchange is done and the decoding queued; whether every call of a step succeeded on every
rank (a frame some rank could not decode, a peer that failed) is checked once, when the
backward pass ends, where the step's end raises any failure before the optimizer runs. A group
sent plainly (every group with ``fallback="always"``; with ``"auto"``, those whose trial chose
plain) goes through torch's own reduce-scatter on that stream instead, with no wait on the host.
Because of the wait, the trial's per-group choice is then checked over whole steps by the
engine (``src/engine/step_check.rs``): every group goes plain unless the trial's ways make the
step faster.

Why the host waits: FSDP needs the result on its stream when the call returns, and the engine
learns the frames' sizes on the host mid-exchange, so its work for a call is not all queued at
once. A wait on the device instead (the stream held at a value in memory that the engine's
thread raises after queuing the decoding, ``cuStreamWaitValue64``) deadlocks as soon as that
thread, or NCCL under it, makes a driver call that waits for the whole device while the
stream is held: freeing device memory does (measured on an H200), NCCL's abort frees memory,
and CUDA's lazy loading may load a kernel on its first use that way.

Scales within a group: FSDP groups parameters by module, so one group can hold gradients of
very different sizes (an LM's output head with its embeddings), and one step for the whole
group leaves the small ones to error feedback alone. Block scales (``CfcState(rms=k,
block=K)``; the state :func:`register` makes when given none has ``rms=0.1, block=256``) give
each block of ``K`` values a step that follows the block's own RMS, agreed over the ranks a
step ahead in the exchange's own rows, so a call hands its job to the engine at once. A state
without them (``block=0``) quantizes each group with one step, and :func:`register` says so
in a log line.

Replicas (HSDP): shard the model over one dimension of a (replicate, shard) mesh with
``fully_shard(model, mesh=mesh["shard"])`` and give ``register`` a second state bound to the
replicate group (``replicas=cfc.CfcState(process_group=mesh["replicate"].get_group())``): each
reduce-scatter's output is then averaged over the replicas by cfc as well, through FSDP's
all-reduce hook, in place of native HSDP's uncompressed all-reduce.

Memory: with error feedback, each rank keeps a residual per element of each group's
reduce-scatter input: float32, 4 bytes per unsharded parameter, or with ``residual_bits=4``
half a byte between the group's calls (plus 4 bytes per 256 values), and a float32 residual
for the group being reduced (``error_feedback=False`` keeps none).

Example::

    >>> # needs an initialised process group: not run as a doctest
    >>> for layer in model.layers:  # doctest: +SKIP
    ...     fully_shard(layer)
    >>> fully_shard(model)  # doctest: +SKIP
    >>> state = cfc.fsdp.register(model)  # doctest: +SKIP
    >>> loss.backward()  # every group's gradients reduce-scattered by cfc  # doctest: +SKIP
    >>> state.stats()["ratio"]  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, List, Optional

from cfc import _engine
from cfc.fsdp import packed_residuals
from cfc.fsdp.state import FsdpState
from cfc.ddp.hook import _compressible, _fail
from cfc.ddp.options import FsdpOptions
from cfc.ddp.residuals import fingerprint
from cfc.ddp.state import CfcState

logger = logging.getLogger("cfc")

__all__ = ["CfcReduceScatter", "average_replicas", "default_state", "register"]

try:  # the interface FSDP2 takes (a private module of torch: its path may move)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter
except ImportError:  # pragma: no cover - torch without FSDP2's custom reduce-scatter
    _ReduceScatter = object  # type: ignore[assignment,misc]


class CfcReduceScatter(_ReduceScatter):  # type: ignore[misc,valid-type]
    """FSDP2's reduce-scatter through cfc's engine, for one ``FSDPModule`` (made by
    :func:`register`, which gives each module its own ``key``: its error-feedback residual and
    its slots are kept under it).

    Args:
        state: the options and per-rank state (:class:`cfc.CfcState`), shared by the model's
            modules; its process group is the one FSDP reduce-scatters over.
        key: this module's identity in the state, the same on every rank.
    """

    def __init__(self, state: CfcState, key: int):
        self.state, self.key = state, key

    def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
        import torch

        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False) -> Any:
        reduce_scatter(self.state, self.key, output_tensor, input_tensor, group, op)
        if not async_op:
            return None
        import torch

        done = torch.futures.Future()
        done.set_result([output_tensor])
        return torch._C._distributed_c10d._create_work_from_future(done)


def register(model: Any, state: Optional[CfcState] = None, *, replicas: Optional[CfcState] = None,
             residual_bits: int = 32) -> CfcState:
    """Install cfc's reduce-scatter on every ``FSDPModule`` of ``model`` (``fully_shard``
    applied first), on every rank, and return the state it runs on.

    Args:
        model: a module on which ``fully_shard`` was called (it, or modules inside it).
        state: the options (:class:`cfc.CfcState`, not used elsewhere); default
            :func:`default_state`: block scales, each block of 256 values within 0.1 x its
            RMS (why: ``docs/performance.md``, "FSDP2: block scales"). A *step* is a
            backward pass that reduce-scatters (``warmup_steps`` and ``trial_steps`` count
            those; with ``fallback="auto"`` each group keeps the faster way, plain or
            compressed, as its trial found, and then ``trial_steps`` more steps time the whole
            step with those ways and with every group plain, alternately: every group goes
            plain from then on unless the trial's ways were faster on the slowest rank). Its
            process group, when not given, is FSDP's shard group. A state without block
            scales (``block=0``) quantizes each FSDP group with one step, so a group's small
            gradients are left to error feedback (measured 1.2-5.8% worse on an LM:
            ``docs/performance.md``, "FSDP2: block scales"); ``register`` logs a line saying so.
        replicas: for replicas of the sharded model (see the module docs), a second state,
            whose process group is the replicate group: the average over the replicas of each
            reduce-scatter's output, compressed, through ``FSDPModule.set_all_reduce_hook``.
        residual_bits: 32 keeps each group's error-feedback residual as float32 (4 bytes per
            unsharded parameter); 4 keeps it, between the group's calls, as 4-bit codes and one
            number per 256 values (about half a byte per parameter; the float32 residual of
            one group lives during its call), losing at most a fourteenth of each 256 values'
            largest per step (see ``cfc.fsdp.packed_residuals``).

    ``residual_bits`` joins the state's options (``state.options.fsdp``): the ranks agree it
    when the engine opens and checkpoints record it, like the others.

    Reduce-scatters cfc does not compress go through torch's own, uncompressed, after a log
    line: groups of a dtype other than float32, bfloat16 and float16, and the pre-multiplied
    sums FSDP asks for after ``set_gradient_divide_factor`` with a factor other than the
    shard group's size.

    Raises:
        TypeError: a state is not a ``cfc.CfcState``; ``model`` holds no ``FSDPModule``.
        ValueError: ``replicas`` without a process group of its own, or
            with a model sharded over a 2-D mesh (native HSDP already averages its replicas);
            ``residual_bits`` other than 32 or 4.
        RuntimeError: this torch has no ``FSDPModule.set_custom_reduce_scatter``.
    """
    from torch.distributed.fsdp import FSDPModule

    state = state if state is not None else default_state()
    for s in (state, replicas):
        if s is not None and not isinstance(s, CfcState):
            raise TypeError(f"states must be cfc.CfcState, got {type(s).__name__}")
    if residual_bits not in (32, 4):
        raise ValueError(f"residual_bits must be 32 or 4, got {residual_bits!r}")
    if replicas is not None and (replicas is state or replicas.process_group is None):
        raise ValueError("replicas must be a CfcState of its own, made with the replicate group "
                         "(process_group=mesh['replicate'].get_group())")
    state._check_serve("cfc.fsdp")
    if replicas is not None:
        replicas._check_serve("cfc.fsdp replicas")
    if _ReduceScatter is object or not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise RuntimeError("cfc.fsdp needs FSDPModule.set_custom_reduce_scatter (torch 2.9 or later)")
    modules: List[Any] = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise TypeError("the model holds no FSDPModule: call fully_shard on it (or on its layers) first")
    groups = [g for g in (_param_group(m) for m in modules) if g is not None]
    if replicas is not None and any(getattr(g, "_is_hsdp", False) for g in groups):
        raise ValueError("the model is sharded over a 2-D mesh (native HSDP), which averages the replicas "
                         "itself: shard it over mesh['shard'] to have cfc average them")
    if state.process_group is None and groups:
        # FSDP's shard group, known now: a checkpoint loaded before the first backward binds to it.
        state.process_group = getattr(getattr(groups[0], "mesh_info", None), "shard_process_group", None)
    if state.options.bound_kind != "eps" and not state.options.block:
        logger.warning("cfc.fsdp: this state has no block scales (block=0): each FSDP group is quantized with "
                       "one step, leaving its small gradients to error feedback; CfcState(rms=..., block=256) "
                       "gives each block of 256 values its own")
    fsdp = FsdpOptions(residual_bits=residual_bits)
    for s in (state, replicas):
        if s is not None:
            _make_part(s, dataclasses.replace(fsdp, step_check=s is state),
                       "cfc.fsdp" if s is state else "cfc.fsdp replicas")
            s._residuals.keep_unseen = True  # one group per step: every residual lives on
            s._residuals.held_elsewhere = functools.partial(_saved_packed, s)
    for key, m in enumerate(modules):
        m.set_custom_reduce_scatter(CfcReduceScatter(state, key))
        if replicas is not None:
            m.set_all_reduce_hook(functools.partial(average_replicas, replicas, key, state))
    state._fsdp.replicas = replicas
    return state


def default_state() -> CfcState:
    """The state :func:`register` makes when given none: ``CfcState(rms=0.1, block=256,
    warmup_steps=0)``. Block scales give each block of 256 values a step of at most 0.1 times
    its RMS (the largest rank's, rounded down to a power of two, a step late), agreed in the
    exchange's own rows, so no call waits on the host for them (measured in
    ``docs/performance.md``, "FSDP2: block scales")."""
    return CfcState(rms=0.1, block=256, warmup_steps=0)


def _param_group(module: Any) -> Any:
    """FSDP's parameter group of ``module`` (None for one without parameters, or where this
    torch keeps it elsewhere: FSDP's private layout)."""
    try:
        st = module._get_fsdp_state()
        groups = getattr(st, "_fsdp_param_groups", None)
        if groups is None:
            g = getattr(st, "_fsdp_param_group", None)
            groups = [g] if g is not None else []
        return groups[0] if groups else None
    except Exception:  # noqa: BLE001 - a private API: without it, the group binds at the first call
        return None


def _part(state: CfcState) -> FsdpState:
    """The state's FSDP part: made by :func:`register`, or here for a state used by a
    :class:`CfcReduceScatter` made without it (float32 residuals, the step check of its
    options)."""
    if state._fsdp is None:
        _make_part(state, FsdpOptions(step_check=True), "cfc.fsdp")
    return state._fsdp


def _make_part(state: CfcState, fsdp: FsdpOptions, entry: str) -> None:
    """Gives ``state`` its FSDP part, and its options cfc.fsdp's (agreed between the ranks
    when the engine opens, and recorded in checkpoints); it serves ``entry`` (the
    reduce-scatters, or the replicas' averages)."""
    state._serve(entry)
    if state._engine is not None and state.options.fsdp != fsdp:
        raise ValueError("this CfcState's engine is already open without these cfc.fsdp options: "
                         "give cfc.fsdp.register a state not used elsewhere")
    state.options = dataclasses.replace(state.options, fsdp=fsdp)
    state._fsdp = FsdpState(state.options)


def _scale_of(op: Any) -> Any:
    """The engine's scale for FSDP's reduce op: None for an average, 1.0 for a sum, and
    ``False`` for any other op (a pre-multiplied sum), which goes to torch's own reduce-scatter."""
    import torch.distributed as dist

    if op == dist.ReduceOp.AVG:
        return None
    if op == dist.ReduceOp.SUM:
        return 1.0
    return False


def _bind_group(state: CfcState, group: Any) -> None:
    """The state reduces over FSDP's group: the first call binds it, later ones must agree."""
    import torch.distributed as dist

    if state.process_group is None and not state.world:
        state.process_group = group
    bound = state.process_group if state.process_group is not None else dist.group.WORLD
    if bound is not group and dist.get_process_group_ranks(bound) != dist.get_process_group_ranks(group):
        raise ValueError("one CfcState serves one process group: FSDP reduce-scatters over ranks "
                         f"{dist.get_process_group_ranks(group)}, the state over "
                         f"{dist.get_process_group_ranks(bound)}")
    state._bind()


def _submit(state: CfcState, key: int, data: Any, out: Any, scale: Any) -> None:
    """One job of the engine: ``data`` reduced in place (``out`` None) or into ``out`` (a
    reduce-scatter, ``data`` one row per rank), queued on the current stream when this returns
    (``Engine.order``: a wait on the host for the exchange, without the closing round of a
    step). The step (what the warm-up and the trial count) ends with the backward pass
    (:func:`_end_step`), whose wait reports the outcome of every call of the step."""
    engine = state._engine_for(data.device)
    in_backward = _open_step(state)
    # The whole input as one "parameter" of ordinal `key`: its residual is saved in checkpoints.
    layout = ((key, 0, data.numel()),)
    packed = state._fsdp.packed.pop(key, None)
    if packed is not None and state._feeds(data):  # (its float32 form, for this call)
        if packed.numel == data.numel() and packed.codes.device == data.device:
            state._residuals.put(key, layout, data, packed_residuals.unpack(packed))
        else:  # (FSDP changed the group's size: counted, as any residual restarted)
            logger.warning("cfc.fsdp: group %d's input changed size; its residual restarts at zero", key)
            state._residuals.resets += 1
    r, fresh = state._residuals.get(key, layout, data) if state._feeds(data) else (None, False)
    held = (data, out, r)
    state._keep.append(held)
    stream = _engine.stream_of(data)
    engine.submit(key, fingerprint(None, data), data, r, out, scale, False, fresh, stream)
    engine.order(stream)
    # (the engine's work on them is queued, and the stream comes after it)
    state._keep = [k for k in state._keep if k is not held]
    if r is not None and state._fsdp.residual_bits == 4:
        # Kept as codes; the float32 tensor goes once the engine has settled (state._let_go).
        state._fsdp.packed[key] = packed_residuals.pack(r)
        state._residuals.drop(key, layout)
    if not in_backward:
        _end_step(state)


def _direct(state: CfcState, key: int, out: Any, inp: Any, op: Any) -> None:
    """A group sent plainly (``fallback="always"``, or the trial of ``"auto"`` chose so for
    it): torch's own reduce-scatter, queued on the current stream, without the engine's thread
    and without waiting on the host, so that such a group costs what FSDP's own reduce-scatter
    does. The step still opens and ends with the engine (which counts steps alike on every
    rank, and may run the trial again), and what the group's residual still holds from its
    compressed steps goes out with its first plain one."""
    in_backward = _open_step(state)
    packed = state._fsdp.packed.pop(key, None)
    if packed is not None:
        inp.view(-1).add_(packed_residuals.unpack(packed).to(inp.dtype))
    if key not in state._fsdp.folded:
        # (the residual it holds, whether an exchange placed it or a checkpoint loaded it)
        held = state._residuals.held(key, ((key, 0, inp.numel()),), inp.view(-1))
        if held is not None:
            inp.view(-1).add_(held.to(inp.dtype))
            held.zero_()
    state._fsdp.folded.add(key)
    _torch_reduce_scatter(out, inp, op, state.process_group)
    state._fsdp.direct["plain_buckets"] += 1
    w = state.world
    state._fsdp.direct["bytes_sent"] += (w - 1) * -(-inp.numel() * inp.element_size() // w)
    if not in_backward:
        _end_step(state)


def _saved_packed(state: CfcState) -> dict:
    """The packed residuals as a checkpoint keeps every residual: float32 on the CPU, in
    their own units, by key."""
    return {key: packed_residuals.unpack(p).cpu() for key, p in state._fsdp.packed.items()}


def _open_step(state: CfcState) -> bool:
    """At the first group of a backward pass: the step ends when the pass does (a callback of
    autograd's, after FSDP's own). Returns False outside a backward pass (a reduce-scatter
    called directly), where the step is the call."""
    if state._fsdp.step_open:
        return True
    from torch.autograd import Variable

    try:
        Variable._execution_engine.queue_callback(functools.partial(_end_step, state))
    except RuntimeError:  # "Final callbacks can only be installed during backward pass"
        return False
    state._fsdp.step_open = True
    return True


def _end_step(state: CfcState) -> None:
    """The end of a step: the engine closes it (alike on every rank: each rank's backward
    pass ends after the same groups; with ``fallback="auto"`` it runs the step check there),
    and the state counts it."""
    state._fsdp.step_open = False
    state._fsdp.ways = None  # (the next step's, read at its first call)
    try:
        if state._engine is not None:
            # (where the step ends on this thread's stream: the step check waits for it there)
            state._engine.end_step(_engine.stream_of_device(state._device))
    finally:
        state._let_go()
        state._residuals.end_step()
        state.step += 1
    if state.options.log_every and state.step % state.options.log_every == 0:
        logger.info("cfc.fsdp step %d: %s", state.step, state.stats())


def _goes_plain(state: CfcState, key: int) -> bool:
    """Whether group ``key`` goes through torch's own reduce-scatter this step: every group
    with ``fallback="always"``; with ``"auto"``, as the engine says at the step's first call
    (alike on every rank: the trial's choice and the step check's, decided from every rank's
    times)."""
    if state.options.fallback == "always":
        return True
    if state.options.fallback != "auto":
        return False
    if state._fsdp.ways is None:
        all_plain, keys = state._engine.ways()
        state._fsdp.ways = (all_plain, set(keys))
    all_plain, keys = state._fsdp.ways
    return all_plain or key in keys


def _failed(state: CfcState, e: BaseException, linked: Optional[CfcState]) -> None:
    """A failure here: the state's peers hear of it (and the peers of ``linked``, the other
    state of a model with replicas, whose ranks may be waiting in its engine). The backward
    pass raises, so its step does not end: the next pass opens one again."""
    _fail(state, e, last=False)
    state._fsdp.step_open = False
    engine = getattr(linked, "_engine", None)
    if engine is not None:
        engine.fail(f"{type(e).__name__}: {e}")


def reduce_scatter(state: CfcState, key: int, out: Any, inp: Any, group: Any, op: Any) -> None:
    """One FSDP reduce-scatter: ``inp`` (``world`` shards, rank-major) reduced over ``group``
    into ``out`` (this rank's shard), queued on the current stream before this returns. Once
    the engine runs, a failure here or on any other rank raises on every rank (``cfc.CfcError``
    naming the rank where it began, or this rank's own error); a refusal before it (a group or
    tensor that does not fit) raises here, as it does on every rank that makes the same call."""
    try:
        if not isinstance(state, CfcState):
            raise TypeError(f"the state must be a cfc.CfcState, got {type(state).__name__}")
        _part(state)
        _bind_group(state, group)
        scale = _scale_of(op)
        if out.dtype != inp.dtype or out.device != inp.device:
            raise ValueError(f"reduce-scatter of {inp.dtype} on {inp.device} into {out.dtype} on {out.device}")
        if not (inp.is_contiguous() and out.is_contiguous()):
            raise ValueError("FSDP's reduce-scatter tensors must be contiguous")
        if inp.numel() != out.numel() * state.world:
            raise ValueError(f"a reduce-scatter of {inp.numel()} elements over {state.world} ranks "
                             f"cannot fill a shard of {out.numel()}")
        if scale is False or not _compressible(inp):
            _plain(state, f"reduce-scatters of {inp.dtype} with {op}",
                   lambda: _torch_reduce_scatter(out, inp, op, state.process_group))
            return
        state._engine_for(inp.device)  # (opened, and the ranks' options agreed, in any case)
        if _goes_plain(state, key):
            _direct(state, key, out, inp, op)
            return
        state._fsdp.folded.discard(key)
        _submit(state, key, inp.view(-1), out.view(-1), scale)
    except BaseException as e:  # noqa: BLE001 - re-raised: FSDP's backward() raises it
        if isinstance(state, CfcState):
            _failed(state, e, state._fsdp.replicas)
        raise


def average_replicas(state: CfcState, key: int, sharded: Optional[CfcState], shard: Any) -> None:
    """FSDP's all-reduce hook for replicas: ``shard`` (a reduce-scatter's output) averaged in
    place over ``state``'s process group (the replicate group), queued on the current stream
    before this returns. ``sharded``: the state of the reduce-scatters, told of a failure here."""
    try:
        if not isinstance(state, CfcState):
            raise TypeError(f"the state must be a cfc.CfcState, got {type(state).__name__}")
        _part(state)
        state._bind()
        if not shard.is_contiguous():
            raise ValueError("FSDP's reduce-scatter output must be contiguous")
        if not _compressible(shard):
            _plain(state, f"replica averages of {shard.dtype}",
                   lambda: _torch_average(shard, state.process_group))
            return
        _submit(state, key, shard.view(-1), None, None)
    except BaseException as e:  # noqa: BLE001 - re-raised: FSDP's backward() raises it
        if isinstance(state, CfcState):
            _failed(state, e, sharded)
        raise


def _torch_reduce_scatter(out: Any, inp: Any, op: Any, group: Any) -> None:
    import torch.distributed as dist

    dist.reduce_scatter_tensor(out, inp, op=op, group=group)


def _torch_average(t: Any, group: Any) -> None:
    import torch.distributed as dist

    dist.all_reduce(t, group=group)
    t.div_(dist.get_world_size(group))


def _plain(state: CfcState, kind: str, run: Any) -> None:
    """What cfc does not compress (a dtype it does not quantize, a pre-multiplied sum): torch's
    own collective, once the engine has finished what it was given."""
    if kind not in state._plain_kinds:
        state._plain_kinds.add(kind)
        logger.warning("cfc.fsdp: %s go through torch.distributed uncompressed", kind)
    if state._engine is not None:
        state._engine.wait(_engine.stream_of_device(state._device))
    run()
