"""cfc.fsdp: FSDP2 (``fully_shard``) with cfc's reduce-scatter, against plain FSDP2 from the same
weights and batches: 2 and 3 processes with gloo on the CPU (in CI), and one GPU per rank over
NCCL (``-m gpu``)."""

import contextlib
import logging
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import cfc
import cfc.fsdp
from cfc import CfcState
from conftest import enough_gpus, spawn_scenario, world_of

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(getattr(fsdp, "FSDPModule", object), "set_custom_reduce_scatter"):
    pytest.skip("this torch has no FSDPModule.set_custom_reduce_scatter", allow_module_level=True)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

DEV = torch.device("cpu")  # set in each worker process


def make(state=None, reduce_dtype=None, register=True, sgd=False, mesh=None, replicas=None, dtype=torch.float32,
         **register_kw):
    """A 3-layer MLP (about 140k parameters; the last layer below cfc's default minimum size),
    each layer and the whole model under fully_shard, and cfc's reduce-scatter installed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)).to(DEV, dtype)
    mp_policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype) if reduce_dtype is not None else MixedPrecisionPolicy()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=mp_policy, mesh=mesh)
    fully_shard(model, mp_policy=mp_policy, mesh=mesh)
    if register:
        state = cfc.fsdp.register(model, state, replicas=replicas, **register_kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.05) if sgd else torch.optim.Adam(model.parameters(), lr=2e-3)
    return model, opt, state


def batch(rank, step, n=32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 64, generator=g)
    w = torch.randn(64, 10, generator=torch.Generator().manual_seed(7))
    return x.to(DEV), (x @ w).argmax(1).to(DEV)


def loss_of(model, rank, step):
    x, y = batch(rank, step)
    dtype = next(model.parameters()).dtype
    return nn.functional.cross_entropy(model(x.to(dtype)).float(), y)


def grads(model):
    """This rank's shards of every gradient."""
    return [p.grad.to_local().detach().clone() for p in model.parameters()]


def train(model, opt, rank, steps, start=0):
    losses = []
    for step in range(start, start + steps):
        loss = loss_of(model, rank, step)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses


# ---- scenarios (run on every rank) ----


def bound(rank, world, out):
    """One backward: every shard of every gradient within eps of plain FSDP2's (the average of
    the ranks' errors, each within eps), with fewer bytes; float32, bfloat16 and float16
    reduce dtypes (FSDP asks for a sum of pre-divided float16 gradients)."""
    eps = 1e-4
    for reduce_dtype in (None, torch.bfloat16, torch.float16):
        plain, _, _ = make(register=False, reduce_dtype=reduce_dtype)
        model, _, state = make(CfcState(eps=eps, warmup_steps=0, min_compress_numel=4000), reduce_dtype=reduce_dtype)
        for m in (plain, model):
            loss_of(m, rank, 0).backward()
        # Each rank's values come back within eps; an average of them within eps, a sum (what
        # FSDP asks of float16, divided before) within world * eps. Plus the dtype's roundings
        # of the result, on either side.
        within = eps * (world if reduce_dtype == torch.float16 else 1)
        slack = {None: 1e-6, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}[reduce_dtype]  # 2 ulps
        for a, b in zip(grads(plain), grads(model)):
            assert (a.float() - b.float()).abs().max().item() <= within + slack * a.float().abs().max().item() + 1e-7
        s = state.stats()
        assert s["compressed_buckets"] == 2 and s["plain_buckets"] == 1, s
        assert s["bytes_sent"] < s["bytes_uncompressed"], s
        # (the frames are part of what was sent; the plain group's bytes are not frames)
        assert 0 < s["frame_bytes"] and s["frame_bytes"] + s["slack_bytes"] < s["bytes_sent"], s
        assert 0 < s["max_error"] <= eps * (1 + 1e-6), s
        state.close()


def every_step_within_bound(rank, world, out):
    """Over ten training steps with error feedback and a bound that follows the data, every
    reduce-scatter's output lies within 2 eps of the exact average of the ranks' inputs (each
    rank's decoded value within eps of its gradient plus residual, each residual within eps):
    what FSDP gets from cfc is the gradient it handed over, step after step, on the streams
    FSDP runs it on."""
    for bound in (dict(eps=1e-4), dict(rms=0.3), dict(rms=0.3, block=256)):
        _within_bound_for_ten_steps(rank, world, bound)


def _within_bound_for_ten_steps(rank, world, bound):
    model, opt, state = make(CfcState(**bound, warmup_steps=0, min_compress_numel=4000))
    checks = []
    real = cfc.fsdp.reduce_scatter

    def checked(st, key, out_, inp, group, op):
        exact = inp.detach().float().clone()
        dist.all_reduce(exact, group=group)  # (queued on FSDP's stream, before cfc reads inp)
        mine = exact.view(world, -1)[dist.get_rank(group)] / world
        real(st, key, out_, inp, group, op)
        # (with block scales every block's bound is at most the coarsest, the state's eps)
        checks.append((st.step, key, (out_.float() - mine).abs().max(), mine.abs().max()))

    cfc.fsdp.reduce_scatter = checked
    try:
        train(model, opt, rank, 10)
    finally:
        cfc.fsdp.reduce_scatter = real
    eps = state.stats()["eps"]  # the largest bound any group used (rms: the groups' differ)
    assert eps > 0 and state.stats()["compressed_buckets"] == 20, state.stats()
    for step, key, err, scale in checks:
        assert err.item() <= 2 * eps * (1 + 1e-5) + 1e-6 * scale.item(), (bound, step, key, err.item(), eps)
    state.close()


@contextlib.contextmanager
def logged(name):
    """The messages logged to logger ``name`` within the block, as a list filled as they come."""
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler, logger = Keep(), logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


class Two(nn.Module):
    """One FSDP group of two parameters whose gradients are this rank's ``a`` and ``b``
    (:meth:`inputs`: ``b`` 1000x smaller than ``a``)."""

    N = 4096

    def __init__(self):
        super().__init__()
        self.big, self.small = nn.Parameter(torch.zeros(self.N)), nn.Parameter(torch.zeros(self.N))

    def forward(self, a, b):
        return (self.big * a).sum() + (self.small * b).sum()

    @classmethod
    def inputs(cls, rank):
        g = torch.Generator().manual_seed(rank)
        return torch.randn(cls.N, generator=g).to(DEV), (1e-3 * torch.randn(cls.N, generator=g)).to(DEV)


def small_gradients(rank, world, out):
    """One group whose two parameters' gradients differ 1000x in size: with block scales (the
    default state's) the small one comes back within a few percent of its own RMS; one step for
    the whole group (``block=0``) rounds it to nothing."""
    a, b = Two.inputs(rank)
    for dtype in (torch.float32, torch.bfloat16):  # (bfloat16: FSDP reduces in the gradients' dtype)
        x, y = a.to(dtype), b.to(dtype)
        exact = torch.stack([x, y]).float()
        dist.all_reduce(exact)
        exact /= world
        errors = {}
        for scaled in (True, False):
            model = Two().to(DEV, dtype)
            fully_shard(model)
            state = cfc.fsdp.register(model, CfcState(rms=0.05, block=256 if scaled else 0, warmup_steps=0,
                                                      min_compress_numel=0))
            model(x, y).backward()
            err = []
            for p, want in zip((model.big, model.small), exact):
                got = p.grad.full_tensor().float()
                err.append(((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item())
            errors[scaled] = err
            assert state.stats()["compressed_buckets"] == 1, state.stats()
            state.close()
        # each within its own k x RMS (bfloat16: plus its rounding of the result, 2**-9 relative)
        assert errors[True][0] < 0.05 and errors[True][1] < 0.05, (dtype, errors)
        assert errors[False][0] < 0.05 and errors[False][1] > 0.5, (dtype, errors)


def block_scales(rank, world, out):
    """With block scales (``CfcState(block=256)``) the engine agrees each block's step over the
    ranks a step ahead, in the exchange's own rows, and the agreed exponents follow a gradient that grows 1024x one step late, exactly
    (10 more for every block of the grown parameter, none for the other's)."""
    n = Two.N
    a, b = Two.inputs(rank)
    model = Two().to(DEV)
    fully_shard(model)
    # (without error feedback the exponents are those of the gradients alone: exact)
    state = cfc.fsdp.register(model, CfcState(rms=0.05, block=256, warmup_steps=0, min_compress_numel=0,
                                              error_feedback=False))
    seen = []
    for small in (b, 1024 * b, 1024 * b):
        model(a, small).backward()
        model.zero_grad()
        (bucket,) = state.state_dict()["engine"]["buckets"]
        seen.append(torch.tensor(list(bucket["exponents"])))
    # each rank's row of the input: its shard of `big` (n / world values), then of `small`
    grown = (seen[1] - seen[0]).view(world, 2, n // world // 256)
    assert bool((grown[:, 0] == 0).all()) and bool((grown[:, 1] == 10).all()), grown
    assert torch.equal(seen[2], seen[1])
    assert state.stats()["compressed_buckets"] == 3, state.stats()
    state.close()


def parity(rank, world, out):
    """Training with cfc's default bound follows plain FSDP2, every rank with the same
    parameters; error feedback carries what each step drops."""
    plain, popt, _ = make(register=False)
    model, opt, state = make()
    base = train(plain, popt, rank, 30)
    got = train(model, opt, rank, 30)
    assert got[-1] < 0.6 * got[0], got  # it learned
    assert abs(got[-1] - base[-1]) <= 0.05 * base[-1], (got[-1], base[-1])
    for p in model.parameters():
        full = p.full_tensor()
        everyone = [torch.empty_like(full) for _ in range(world)]
        dist.all_gather(everyone, full)
        assert all(torch.equal(e, everyone[0]) for e in everyone)
    s = state.stats()
    assert s["ratio"] > 3 and s["step"] == 30, s  # a step is a backward pass


def accumulate(rank, world, out):
    """set_requires_gradient_sync(False) for a micro-batch: no reduce-scatter then, and the
    synced step's gradients are those of both micro-batches, within eps."""
    eps = 1e-4
    plain, _, _ = make(register=False)
    model, _, state = make(CfcState(eps=eps, warmup_steps=0, min_compress_numel=0))
    for m in (plain, model):
        m.set_requires_gradient_sync(False)
        loss_of(m, rank, 0).backward()
        m.set_requires_gradient_sync(True)
        loss_of(m, rank, 1).backward()
    assert state.stats()["compressed_buckets"] == 3
    for a, b in zip(grads(plain), grads(model)):
        assert (a - b).abs().max().item() <= eps * (1 + 1e-5) + 1e-7


def overflow(rank, world, out):
    """A gradient that overflows on one rank comes back non-finite on every rank (what a
    GradScaler looks for), and the next step is finite again (the codec leaves a residual of 0
    where a value was not finite)."""
    model, _, state = make(CfcState(warmup_steps=0, min_compress_numel=0))
    loss = loss_of(model, rank, 0)
    (loss * (float("inf") if rank == 0 else 1.0)).backward()
    assert all(not torch.isfinite(g).all() for g in grads(model))
    model.zero_grad(set_to_none=True)
    loss_of(model, rank, 1).backward()
    assert all(torch.isfinite(g).all() for g in grads(model)), "the step after an overflow is finite"
    assert state.stats()["compressed_buckets"] == 6


def feedback(rank, world, out):
    """Error feedback carries what each step drops into the group's next step: the same
    gradients eight times (no optimizer step) add up to eight times plain FSDP2's within one
    eps, where rounding them alike every time would drift by up to eight. Every group keeps its
    residual from one step to the next, and a checkpoint holds them all."""
    eps, steps = 1e-3, 8
    plain, _, _ = make(register=False)
    model, _, state = make(CfcState(eps=eps, warmup_steps=0, min_compress_numel=0))
    loss_of(plain, rank, 0).backward()
    want = [g * steps for g in grads(plain)]
    total = None
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        loss_of(model, rank, 0).backward()
        total = grads(model) if total is None else [t + g for t, g in zip(total, grads(model))]
        assert len(state._residuals.by_bucket) == 3
    worst = max((t - w).abs().max().item() for t, w in zip(total, want))
    assert worst <= eps * (1 + 1e-3) + 1e-6, worst
    assert len(state.state_dict()["residuals"]) == 3


def packed_feedback(rank, world, out):
    """residual_bits=4: between calls every group keeps its residual as 4-bit codes (half a
    byte per element, no float32 residual left), and error feedback still carries what each
    step drops: eight identical steps add up to eight times plain FSDP2's within 1.6 eps (each
    step loses at most a fourteenth of eps to the codes; without feedback up to 8 eps). With
    block scales too (each block's bound at most the state's eps), the same holds."""
    eps, steps = 1e-3, 8
    plain, _, _ = make(register=False)
    loss_of(plain, rank, 0).backward()
    want = [p.grad.full_tensor() * steps for p in plain.parameters()]
    for bound in (dict(eps=eps), dict(rms=0.3, block=256)):
        model, _, state = make(CfcState(**bound, warmup_steps=0, min_compress_numel=0), residual_bits=4)
        total = None
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            loss_of(model, rank, 0).backward()
            got = [p.grad.full_tensor() for p in model.parameters()]
            total = got if total is None else [t + g for t, g in zip(total, got)]
            assert not state._residuals.by_bucket and len(state._fsdp.packed) == 3, state._residuals.by_bucket
        # each group's reduce-scatter input: its parameters, dim 0 padded to a multiple of world
        sizes = [sum(-(-q.shape[0] // world) * world * (q.numel() // q.shape[0]) for q in (m.weight, m.bias))
                 for m in model if isinstance(m, nn.Linear)]
        packed = sorted(p.codes.numel() for p in state._fsdp.packed.values())
        assert packed == sorted(-(-n // 256) * 128 for n in sizes), (packed, sizes)  # (whole chunks of 256)
        # (block scales: every block's bound is at most the coarsest, which stats() report)
        bound_used = eps if "eps" in bound else state.stats()["eps"]
        worst = max((t - w).abs().max().item() for t, w in zip(total, want))
        assert 0 < worst <= 1.6 * bound_used, (bound, worst, bound_used)
        assert len(state.state_dict()["residuals"]) == 3
        state.close()
    with pytest.raises(ValueError, match="residual_bits"):
        cfc.fsdp.register(plain, residual_bits=8)


def fallback(rank, world, out):
    """Steps are backward passes: one of warm-up (every group plain), then fallback="auto"'s
    trial (each group one way in one pass and the other way in the next), then every group
    keeps the way every rank's timings chose alike, then the engine's step check times a step
    with every group plain and a step with the trial's ways, and keeps the faster on the
    slowest rank (every group plain otherwise). fallback="always" never compresses."""
    model, opt, state = make(CfcState(warmup_steps=1, fallback="auto", trial_steps=2, min_compress_numel=0))
    per_step = []
    for step in range(4):
        before = state.stats()
        train(model, opt, rank, 1, start=step)
        after = state.stats()
        per_step.append(tuple(after[k] - before[k] for k in ("plain_buckets", "compressed_buckets")))
        if step == 2:
            saved = state.state_dict()  # (after the trial's steps, before its choice: see below)
    assert per_step[0] == (3, 0), per_step
    assert per_step[1][0] + per_step[2][0] == 3 and per_step[1][1] + per_step[2][1] == 3, per_step
    assert state.stats()["step"] == 4
    decisions = [(b["key"], b["decision"]) for b in state.state_dict()["engine"]["buckets"]]
    assert len(decisions) == 3 and all(d is not None for _, d in decisions), decisions
    everyone = [None] * world
    dist.all_gather_object(everyone, sorted(decisions))
    assert all(e == everyone[0] for e in everyone), everyone
    # The groups the trial chose plain go through torch's reduce-scatter, not the engine.
    plain = {k for k, d in decisions if d is False}
    assert state._engine.ways()[1] == sorted(plain), (state._engine.ways(), decisions)
    # Then the check (steps 4-5 here, when the trial chose to compress some group), whose
    # verdict every rank takes alike; after it the groups go as it says.
    train(model, opt, rank, 2, start=4)
    verdict = state.state_dict()["engine"]["step_check"]["verdict"]
    everyone = [None] * world
    dist.all_gather_object(everyone, verdict)
    assert all(v == everyone[0] for v in everyone) and (verdict is False or len(plain) < 3), (everyone, plain)
    before, engine_before = state.stats(), state._engine.stats()
    train(model, opt, rank, 1, start=6)
    after, engine_after = state.stats(), state._engine.stats()
    assert engine_after["plain_buckets"] == engine_before["plain_buckets"], (engine_before, engine_after)
    went_plain = 3 if verdict is False else len(plain)
    assert after["plain_buckets"] - before["plain_buckets"] == went_plain, (before, after, plain, verdict)
    assert after["compressed_buckets"] - before["compressed_buckets"] == 3 - went_plain, (before, after)
    # The check after the trial (in steps 4-5; then every group plain unless the trial's ways
    # were faster), with the trial's choice made "compress every group" through the checkpoint
    # of step 3, and steps made slower by a sleep of each way's cost on each rank (x 60 ms,
    # between the steps): every way the same on every rank, whichever rank's steps were slower.
    state.close()
    for e in saved["engine"]["buckets"]:
        e["decision"] = True
    for costs, keeps in (({0: (2, 0), 1: (2, 0)}, True), ({0: (2, 0), 1: (0, 4)}, False),
                         ({0: (0, 4), 1: (0, 4)}, False)):
        model, opt, state = make(CfcState(warmup_steps=1, fallback="auto", trial_steps=2, min_compress_numel=0))
        state.load_state_dict(saved)
        plain_cost, compressed_cost = costs[rank % 2]
        per_step = []
        for step in range(3, 8):
            before = state.stats()
            train(model, opt, rank, 1, start=step)
            after = state.stats()
            per_step.append(tuple(after[k] - before[k] for k in ("plain_buckets", "compressed_buckets")))
            all_plain, _ = state._engine.ways()  # (the next step's)
            time.sleep(0.06 * (plain_cost if all_plain else compressed_cost))
        after_check = (0, 3) if keeps else (3, 0)
        assert per_step == [(0, 3), (3, 0), (0, 3), after_check, after_check], (costs, per_step)
        assert state.state_dict()["engine"]["step_check"]["verdict"] is keeps
        if not keeps:
            assert state._engine.stats()["compressed_buckets"] == 6  # (steps 3 and 5 only)
        state.close()
    # fallback="always" is FSDP's own reduce-scatter, bit for bit, without the engine's thread.
    model, opt, state = make(CfcState(warmup_steps=0, fallback="always", min_compress_numel=0), sgd=True)
    reference, ropt, _ = make(register=False, sgd=True)
    train(model, opt, rank, 2)
    train(reference, ropt, rank, 2)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.to_local(), q.to_local())
    s = state.stats()
    assert s["compressed_buckets"] == 0 and s["plain_buckets"] == 6, s
    assert state._engine.stats()["plain_buckets"] == 0


def mismatch(rank, world, out):
    """Ranks with different options all raise, naming both, before any gradient moves; so do
    ranks that gave cfc.fsdp.register different options of its own."""
    model, _, _ = make(CfcState(rms=0.3 if rank == 0 else 0.1, warmup_steps=0))
    t0 = time.monotonic()
    with pytest.raises(cfc.CfcError, match="rms=3e-1.*rms=1e-1"):
        loss_of(model, rank, 0).backward()
    assert time.monotonic() - t0 < 30
    model, _, state = make(CfcState(warmup_steps=0), residual_bits=4 if rank == 0 else 32)
    assert state.options.fsdp == cfc.ddp.options.FsdpOptions(residual_bits=4 if rank == 0 else 32, step_check=True)
    with pytest.raises(cfc.CfcError, match="4-bit residuals.*32-bit residuals"):
        loss_of(model, rank, 0).backward()


def failures(rank, world, out):
    """A failure on one rank (an exception in cfc's call, a corrupt frame, an allocation, a
    device error) makes backward() raise on every rank within seconds."""
    for kind in ["call", "corrupt", "alloc", "device"]:
        model, opt, state = make(CfcState(warmup_steps=0, min_compress_numel=0, timeout=120))
        train(model, opt, rank, 1)
        culprit = world - 1
        if rank == culprit:
            if kind == "call":
                real = state._residuals.get
                calls = []

                def get(*a, **kw):
                    calls.append(1)
                    if len(calls) == 2:
                        raise RuntimeError("raised in the reduce-scatter")
                    return real(*a, **kw)

                state._residuals.get = get
            else:
                state._engine.inject(kind)
        what = {"call": "raised in the reduce-scatter", "corrupt": "frame", "alloc": "could not allocate",
                "device": "injected device failure"}[kind]
        t0 = time.monotonic()
        with pytest.raises(Exception, match=what) as failed:
            loss_of(model, rank, 1).backward()
        if rank != culprit and kind != "corrupt":
            assert f"rank {culprit}" in str(failed.value), failed.value
        assert time.monotonic() - t0 < 30, "waited for the timeout"
        # The engine refuses any later reduce-scatter at once. (What FSDP itself does in the
        # step after an exception in its backward is FSDP's: it may skip its reduce-scatters.)
        comm = cfc.fsdp.CfcReduceScatter(state, 0)
        x = comm.allocate((4096 * world,), dtype=torch.float32, device=DEV)
        with pytest.raises(cfc.CfcError):
            comm(comm.allocate((4096,), dtype=torch.float32, device=DEV), x.normal_(), state.process_group, dist.ReduceOp.AVG)
        state.close()


class _Calls:
    """An engine whose calls are counted by name (for `orders`)."""

    def __init__(self, engine):
        self._engine, self.calls = engine, {}

    def __getattr__(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1
        return getattr(self._engine, name)


def orders(rank, world, out):
    """A compressed call waits for its own exchange only (an order): no call closes a step
    (the closing round, every rank's decoding status, runs once, at the step's end), and every
    tensor a call gave the engine is let go by the step's end."""
    model, opt, state = make()
    train(model, opt, rank, 1)  # (the engine opens)
    spy = _Calls(state._engine)
    state._engine = spy
    train(model, opt, rank, 2, start=1)
    state._engine = spy._engine
    calls = state.stats()["compressed_buckets"]
    assert calls >= 4, state.stats()
    assert spy.calls.get("order", 0) >= 4 and spy.calls.get("order") == spy.calls.get("submit"), spy.calls
    assert "wait" not in spy.calls and spy.calls.get("end_step") == 2, spy.calls
    assert not state._keep and not state._held


def resume(rank, world, out):
    """A run resumed after step 2 from this rank's model shards and cfc state (SGD: no optimizer
    state) computes the bits of the uninterrupted one; without the cfc state it does not. So
    does one with fallback="auto" resumed after its trial, whose groups chosen plain go
    through torch's reduce-scatter at once. (Its states are let go of without close(), as users
    may: with 4 GPUs, processes that did so crashed at exit, which cfc._engine._settle_at_exit
    is for.)"""
    auto = dict(fallback="auto", trial_steps=2, min_compress_numel=0)
    # (kw, steps before the save, register's options, whether the trial's choice is made
    # "compress every group" through a checkpoint after the trial: then the resumed run's first
    # step, the step check's, sends every group plainly with what its residual held at the save)
    ways = ((dict(), 2, {}, False), (auto, 3, {}, False), (auto, 3, {}, True),
            (dict(), 2, dict(residual_bits=4), False), (dict(block=256), 2, dict(residual_bits=4), False))
    for kw, before, reg, compress_all in ways:
        model, opt, state = make(CfcState(warmup_steps=0, **kw), sgd=True, **reg)
        if compress_all:
            train(model, opt, rank, 2)
            sd = state.state_dict()
            for b in sd["engine"]["buckets"]:
                b["decision"] = True
            state.load_state_dict(sd)
            train(model, opt, rank, before - 2, start=2)
            assert state._residuals.by_bucket and state._engine.ways()[0]
        else:
            train(model, opt, rank, before)
        shards = {k: v.to_local().clone() for k, v in model.state_dict().items()}
        saved = state.state_dict()
        plain_at_save = set(state._engine.ways()[1])
        want = train(model, opt, rank, 2, start=before)
        want_params = [p.to_local().clone() for p in model.parameters()]

        def resumed(load):
            model2, opt2, state2 = make(CfcState(warmup_steps=0, **kw), sgd=True, **reg)
            for k, v in model2.state_dict().items():
                v.to_local().copy_(shards[k])
            if load:
                state2.load_state_dict(saved)
                # the groups the saved trial chose plain go through torch's reduce-scatter from
                # the first step on, as in the uninterrupted run
                chosen = {b["key"] for b in saved["engine"]["buckets"] if b["decision"] is False}
                assert set(state2._engine_for(DEV).ways()[1]) == chosen == plain_at_save, chosen
                # block scales: the compressed groups' exponents for their next calls, agreed
                # before the save
                assert any(b["exponents"] is not None for b in saved["engine"]["buckets"]) == bool(kw.get("block"))
                # fallback="auto": the check over whole steps goes on where it was
                check = saved["engine"]["step_check"]
                assert (check is not None) == (kw.get("fallback") == "auto")
                assert state2.state_dict()["engine"]["step_check"] == check
            got = train(model2, opt2, rank, 2, start=before)
            return got, [p.to_local() for p in model2.parameters()]

        if reg:
            # cfc.fsdp's own options are recorded, and compared, with the others
            _, _, other = make(CfcState(warmup_steps=0, **kw), sgd=True)
            with pytest.raises(ValueError, match="'residual_bits': 4"):
                other.load_state_dict(saved)
            # (a state saved before they were recorded loads)
            older = {**saved, "options": {k: v for k, v in saved["options"].items() if k != "fsdp"}}
            _, _, same = make(CfcState(warmup_steps=0, **kw), sgd=True, **reg)
            same.load_state_dict(older)
            # (nor one saved with per-parameter scales, which block scales replaced: its
            # residuals are in the parameters' own units; a log line says the run goes on
            # without them)
            fsdp = saved["options"]["fsdp"]
            for scaled in (False, True):
                with_scales = {**saved, "options": {**saved["options"], "fsdp": {**fsdp, "per_parameter": scaled}}}
                with logged("cfc") as lines:
                    same.load_state_dict(with_scales)
                assert any("per-parameter scales" in line for line in lines) == scaled, lines
            same.load_state_dict(saved)
        if kw.get("fallback") == "auto":
            # (a checkpoint whose step check was saved beside the engine's part, not in it,
            # loads it into the engine)
            check = saved["engine"]["step_check"]
            beside = {**saved, "step_check": check,
                      "engine": {k: v for k, v in saved["engine"].items() if k != "step_check"}}
            _, _, same = make(CfcState(warmup_steps=0, **kw), sgd=True, **reg)
            same.load_state_dict(beside)
            assert same.state_dict()["engine"]["step_check"] == check
        got, params = resumed(True)
        assert got == want, (kw, reg, compress_all)
        assert all(torch.equal(a, b) for a, b in zip(want_params, params)), (kw, reg, compress_all)
        if not kw:
            got, params = resumed(False)  # residuals lost: other bits
            assert not all(torch.equal(a, b) for a, b in zip(want_params, params))


def replicas(rank, world, out):
    """Two replicas of a model sharded over two ranks each: cfc's reduce-scatter within a
    replica, then cfc's average over the replicas (the all-reduce hook), against native HSDP:
    every shard of every gradient within 2 eps (each of the two averages adds at most eps).
    Each replica on a node of its own (``CFC_NODE``), as the multi-node recipe has it: the shard
    groups' bytes stay inside the nodes, the replicas' all cross them (one rank per node: flat)."""
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["CFC_NODE"] = f"node{rank // 2}"
    eps = 1e-4
    mesh = init_device_mesh(DEV.type, (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    plain, _, _ = make(register=False, mesh=mesh)
    across = CfcState(eps=eps, warmup_steps=0, min_compress_numel=4000, process_group=mesh["replicate"].get_group())
    model, _, state = make(CfcState(eps=eps, warmup_steps=0, min_compress_numel=4000), mesh=mesh["shard"],
                           replicas=across)
    for m in (plain, model):
        loss_of(m, rank, 0).backward()
    for a, b in zip(grads(plain), grads(model)):
        assert (a - b).abs().max().item() <= 2 * eps * (1 + 1e-5) + 1e-7
    # codes add exactly: the replicas hold the same bits
    group = mesh["replicate"].get_group()
    for g in grads(model):
        everyone = [torch.empty_like(g) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, g, group=group)
        assert all(torch.equal(e, everyone[0]) for e in everyone)
    for s in (state, across):
        st = s.stats()
        assert st["compressed_buckets"] == 2 and st["plain_buckets"] == 1, st
        assert s.levels is None
    assert state.stats()["between_nodes"] == 0 and state.stats()["inside_node"] > 0
    assert across.stats()["inside_node"] == 0 and across.stats()["between_nodes"] > 0
    with pytest.raises(ValueError, match="replicate group"):
        cfc.fsdp.register(model, state, replicas=state)


def replica_failure(rank, world, out):
    """With replicas, a failure in one rank's reduce-scatter reaches every rank within seconds,
    those waiting in the replicas' engine included."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(DEV.type, (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    across = CfcState(warmup_steps=0, min_compress_numel=0, timeout=120, process_group=mesh["replicate"].get_group())
    model, opt, state = make(CfcState(warmup_steps=0, min_compress_numel=0, timeout=120), mesh=mesh["shard"],
                             replicas=across)
    train(model, opt, rank, 1)
    if rank == 0:
        real = state._residuals.get

        def get(*a, **kw):
            raise RuntimeError("raised in the reduce-scatter")

        state._residuals.get = get
    t0 = time.monotonic()
    with pytest.raises(Exception, match="raised in the reduce-scatter"):
        loss_of(model, rank, 1).backward()
    assert time.monotonic() - t0 < 30, "waited for the timeout"
    if rank == 0:
        state._residuals.get = real


def plain_paths(rank, world, out):
    """What cfc does not compress goes through torch's own reduce-scatter, with plain FSDP2's
    bits: float64 groups. And a call with async_op gives a Work that is already done."""
    plain, _, _ = make(register=False, dtype=torch.float64)
    model, _, state = make(CfcState(warmup_steps=0, min_compress_numel=0), dtype=torch.float64)
    for m in (plain, model):
        loss_of(m, rank, 0).backward()
    assert all(torch.equal(a, b) for a, b in zip(grads(plain), grads(model)))
    assert state.stats()["compressed_buckets"] == 0
    comm = cfc.fsdp.CfcReduceScatter(state, 99)
    x = comm.allocate((8192 * world,), dtype=torch.float32, device=DEV).normal_()
    y = comm.allocate((8192,), dtype=torch.float32, device=DEV)
    work = comm(y, x, state.process_group, dist.ReduceOp.SUM, async_op=True)
    assert work.wait()
    assert state.stats()["compressed_buckets"] == 1


def refusals(rank, world, out):
    """What register refuses, before anything runs: a state that serves another entry point
    among them (its residuals and steps are that one's)."""
    model, _, _ = make(register=False)
    with pytest.raises(TypeError, match="CfcState"):
        cfc.fsdp.register(model, object())
    with pytest.raises(TypeError, match="no FSDPModule"):
        cfc.fsdp.register(nn.Linear(2, 2))
    reducer = cfc.distributed.AllReducer(CfcState())
    with pytest.raises(ValueError, match="serves AllReducer: give cfc.fsdp a CfcState of its own"):
        cfc.fsdp.register(model, reducer.state)
    assert reducer.state.options.fsdp is None and reducer.state.process_group is None  # (nothing changed)
    state = cfc.fsdp.register(model)
    with pytest.raises(ValueError, match="serves cfc.fsdp: give AllReducer"):
        cfc.distributed.AllReducer(state)
    assert state.state_dict()["serves"] == "cfc.fsdp"
    reducer.close()
    state.close()


SCENARIOS = {f.__name__: f for f in (bound, every_step_within_bound, small_gradients, block_scales, parity, accumulate, overflow, feedback,
                                      packed_feedback, fallback, mismatch, failures, orders,
                                      resume, plain_paths, refusals)}
FOUR_RANKS = {f.__name__: f for f in (replicas, replica_failure)}  # (test_fsdp_replicas)
SCENARIOS.update(FOUR_RANKS)


def spawn(tmp_path, scenario, world=None, device="cpu"):
    return spawn_scenario(tmp_path, "test_fsdp", scenario, world or world_of(device), device)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scenario", sorted(set(SCENARIOS) - set(FOUR_RANKS)))
def test_fsdp(tmp_path, scenario, device):
    enough_gpus(device)
    spawn(tmp_path, scenario, device=device)


@pytest.mark.parametrize("scenario", ["bound", "failures"])
def test_fsdp_three_ranks(tmp_path, scenario):
    spawn(tmp_path, scenario, world=3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scenario", sorted(FOUR_RANKS))
def test_fsdp_replicas(tmp_path, scenario, device):
    enough_gpus(device)
    if device == "cuda" and world_of(device) < 4:
        pytest.skip("needs 4 GPUs")
    spawn(tmp_path, scenario, world=4, device=device)
