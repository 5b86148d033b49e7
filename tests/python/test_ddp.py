"""cfc_hook in real DistributedDataParallel training: 2 processes, gloo on CPU buckets (in CI);
NCCL on CUDA buckets (``-m gpu``, with 2 GPUs); and 3 processes sharing one GPU over gloo
(``-m gpu``, any GPU). conftest.py says where each kind of run places its ranks."""

import copy
import math
import os
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cfc
from cfc import CfcState, cfc_hook
from conftest import GPUS, close_cfc_states, enough_gpus, place_rank, world_of


class Net(nn.Module):
    """About 85k parameters in several buckets (bucket_cap_mb=0.1), the smallest below cfc's minimum size."""

    def __init__(self, unused=False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU())
        self.head = nn.Linear(256, 10)
        self.unused = nn.Linear(4, 4) if unused else None

    def forward(self, x):
        return self.head(self.body(x))


DEV = torch.device("cpu")  # set in each worker process
NCCL = False  # whether the worker's process group is NCCL's (CUDA: one GPU per rank)


def batch(rank, step, n=64):
    """A fixed teacher task, different data on every rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 64, generator=g)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(64, 10, generator=teacher)
    return x.to(DEV), (x @ w + 0.3 * torch.randn(n, 10, generator=g)).argmax(1).to(DEV)


def make(hook_state=None, dtype=torch.float32, pipeline=None, **ddp_kw):
    """The test model under DDP, with ``hook_state``'s cfc_hook registered. ``pipeline``: whether
    its CUDA steps go through the bucket pipeline (``CfcState._use_pipeline``). A test that
    compares the two ways names its own; otherwise (None) CFC_TEST_PIPELINE=1 turns it on."""
    torch.manual_seed(0)
    model = Net(unused=ddp_kw.get("find_unused_parameters", False)).to(dtype).to(DEV)
    ddp = DDP(model, bucket_cap_mb=0.1, **ddp_kw)
    if hook_state is not None:
        if pipeline is None:
            pipeline = hook_state._use_pipeline or os.environ.get("CFC_TEST_PIPELINE") == "1"
        hook_state._use_pipeline = pipeline
        ddp.register_comm_hook(hook_state, cfc_hook)
    # Adam's default eps underflows in float16, with or without cfc
    opt = torch.optim.Adam(ddp.parameters(), lr=2e-3, eps=1e-8 if dtype == torch.float32 else 1e-4)
    return ddp, opt


def train(ddp, opt, rank, steps, start=0, dtype=torch.float32):
    losses = []
    for step in range(start, start + steps):
        x, y = batch(rank, step)
        loss = nn.functional.cross_entropy(ddp(x.to(dtype)).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses


def same_on_all_ranks(t):
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t.contiguous())
    return all(torch.equal(e, everyone[0]) for e in everyone)


def _worker(rank, world, init_file, scenario, out, device="cpu"):
    global DEV, NCCL
    DEV, backend = place_rank(device, rank)
    NCCL = backend == "nccl"
    if DEV.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the same bits every run
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        SCENARIOS[scenario](rank, world, out)
    finally:
        # A scenario's state may sit in a reference cycle (a method replaced by a closure over
        # it), or be held by its comm thread, and so outlive the scenario with its process
        # groups: let them go while the groups are still registered.
        close_cfc_states()
        dist.destroy_process_group()


def parity(rank, world, out):
    steps = 150
    ddp, opt = make()
    plain = train(ddp, opt, rank, steps)
    state = CfcState()
    ddp, opt = make(state)
    comp = train(ddp, opt, rank, steps)
    s = state.stats()
    tail = lambda xs: sum(xs[-10:]) / 10  # noqa: E731
    if rank == 0:
        out.put({"plain": tail(plain), "cfc": tail(comp), "stats": s, "first": plain[0]})
    for p in ddp.parameters():
        assert same_on_all_ranks(p.detach())


def resume_from(ckpt, kw):
    """A fresh model, DDP, optimizer and CfcState, loaded from a checkpoint of all three."""
    state = CfcState(**kw)
    ddp, opt = make(state)
    ddp.load_state_dict(ckpt["model"])
    opt.load_state_dict(copy.deepcopy(ckpt["opt"]))  # Adam aliases the tensors it loads
    state.load_state_dict(ckpt["cfc"])
    return state, ddp, opt


def resume(rank, world, out, tmp=None):
    _resume_with(dict(eps=2e-4, warmup_steps=1))
    # per_tensor: the scales of each bucket's parameters come from the step before, so they
    # are part of the checkpoint too
    saved = _resume_with(dict(rms=0.3, per_tensor=True, warmup_steps=1))
    assert saved["cfc"]["scales"], saved["cfc"].keys()
    state, ddp, opt = resume_from(saved, dict(rms=0.3, per_tensor=True, warmup_steps=1))
    state._scales.clear()  # a resume that lost them: the run differs
    train(ddp, opt, rank, 4, start=4)
    straight = _straight(dict(rms=0.3, per_tensor=True, warmup_steps=1), rank)
    assert not all(torch.equal(a, b.detach()) for a, b in zip(straight, ddp.parameters()))


def _straight(kw, rank):
    ddp, opt = make(CfcState(**kw))
    train(ddp, opt, rank, 8)
    return [p.detach().clone() for p in ddp.parameters()]


def _resume_with(kw):
    """Train 8 steps straight, and 4 + save + load + 4: the same parameters, bit for bit.
    Returns the checkpoint."""
    rank = dist.get_rank()
    ddp, opt = make(CfcState(**kw))
    train(ddp, opt, rank, 8)
    straight = [p.detach().clone() for p in ddp.parameters()]

    state = CfcState(**kw)
    ddp, opt = make(state)
    train(ddp, opt, rank, 4)
    saved = {
        "model": {k: v.clone() for k, v in ddp.state_dict().items()},
        "opt": opt.state_dict(),
        "cfc": state.state_dict(),
    }
    buffer = __import__("io").BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    assert any(r.abs().max() > 0 for r in saved["cfc"]["residuals"].values())
    state, ddp, opt = resume_from(saved, kw)
    train(ddp, opt, rank, 4, start=4)
    resumed = [p.detach() for p in ddp.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    assert state.stats()["residual_resets"] == 0

    # A checkpoint made one step after a resume (DDP still on its initial bucket, which the
    # hook ran as the saved buckets) records those buckets, and resuming from it is exact too.
    state, ddp, opt = resume_from(saved, kw)
    train(ddp, opt, rank, 1, start=4)
    again = {"model": {k: v.clone() for k, v in ddp.state_dict().items()},
             "opt": copy.deepcopy(opt.state_dict()), "cfc": state.state_dict()}
    assert again["cfc"]["layouts"] == saved["cfc"]["layouts"]
    state, ddp, opt = resume_from(again, kw)
    train(ddp, opt, rank, 3, start=5)
    assert all(torch.equal(a, b.detach()) for a, b in zip(straight, ddp.parameters()))

    # Dropping the residuals on resume (as some libraries do) changes the result: the test
    # above can fail.
    state = CfcState(**kw)
    ddp, opt = make(state)
    ddp.load_state_dict(saved["model"])
    opt.load_state_dict(copy.deepcopy(saved["opt"]))  # Adam aliases what it loads
    state.step = saved["cfc"]["step"]
    train(ddp, opt, rank, 4, start=4)
    assert not all(torch.equal(a, b.detach()) for a, b in zip(straight, ddp.parameters()))

    # Another rank's state, or other options, are refused.
    other = dict(saved["cfc"], rank=(rank + 1) % dist.get_world_size())
    with pytest.raises(ValueError, match="each rank loads its own"):
        CfcState(**kw).load_state_dict(other)
    with pytest.raises(ValueError, match="eps=0.001"):
        CfcState(eps=1e-3, warmup_steps=1).load_state_dict(saved["cfc"])
    # Residuals that are not a saved state's are refused at the load; ones of other sizes (a
    # state of another model) restart at zero, counted.
    with pytest.raises(ValueError, match="1-D float32"):
        CfcState(**kw).load_state_dict(dict(saved["cfc"], residuals={0: [0.0]}))
    short = {o: r[:-1] for o, r in saved["cfc"]["residuals"].items()}
    state, ddp, opt = resume_from(dict(saved, cfc=dict(saved["cfc"], residuals=short)), kw)
    train(ddp, opt, rank, 1, start=4)
    assert state.stats()["residual_resets"] == len(short), state.stats()
    # Ranks that load states of different steps all raise at the next step's first bucket,
    # in the agreement round, not in an exchange that only some of them would join.
    state, ddp, opt = resume_from(saved if rank == 0 else again, kw)
    x, y = batch(rank, 5)
    with pytest.raises(Exception, match="resumed from different cfc_hook states"):
        nn.functional.cross_entropy(ddp(x), y).backward()
    return saved


class TwoScales(nn.Module):
    """Two parameters in one bucket whose gradients differ 100x in scale: the gradient of
    ``a`` is the input ``xa``, that of ``b`` is ``0.01 xb``."""

    def __init__(self, n=20000):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(n))
        self.b = nn.Parameter(torch.zeros(n))

    def forward(self, xa, xb):
        return (self.a * xa).sum() + 0.01 * (self.b * xb).sum()


def per_tensor(rank, world, out):
    """With one bound per bucket, the small parameter's gradient is almost all rounded to zero
    (error feedback sends it later, in bursts); with per_tensor, each step's average of it is
    within a fraction of its own RMS. The exact average is known: the inputs are the gradients.
    They are small (RMS 1e-3 and 1e-5), far from the scaled values' RMS of about 1."""
    found = {}
    for flag in (False, True):
        state = CfcState(rms=0.3, per_tensor=flag, warmup_steps=1)
        ddp = DDP(TwoScales().to(DEV), bucket_cap_mb=25)
        ddp.register_comm_hook(state, cfc_hook)
        zeros, errs, sent = [], [], []
        for step in range(8):
            g = torch.Generator().manual_seed(100 * step + rank)
            xa, xb = 1e-3 * torch.randn(20000, generator=g).to(DEV), 1e-3 * torch.randn(20000, generator=g).to(DEV)
            ddp(xa, xb).backward()
            exact = 0.01 * xb.clone()
            dist.all_reduce(exact)
            exact /= world
            got = ddp.module.b.grad
            if step >= 3:  # after the warm-up and the first compressed step (which sets the scales)
                zeros.append(float((got == 0).float().mean()))
                errs.append(float((got - exact).abs().max() / exact.pow(2).mean().sqrt()))
            for q in ddp.parameters():
                q.grad = None
            sent.append(state.stats()["bytes_sent"] - sum(sent))
        s = state.stats()
        assert s["compressed_buckets"] >= 6 and s["ratio"] > 2, s
        # The first scaled step (step 2) sends no more than the later ones. (CUDA: its bound
        # must come from the scaled values' RMS, not from the step before's RMS of unscaled
        # ones, a thousand times smaller here, which would take about 10 more bits a value.
        # A later step may send its frame twice, when it outgrows its slot: hence min.)
        assert sent[2] < 2 * min(sent[3:]), (flag, sent)
        assert 0 < s["max_error"] <= s["eps"] * (1 + 1e-6), s
        found[flag] = (max(zeros), min(zeros), max(errs))
    assert found[False][1] > 0.9, found  # per bucket: b's average is (almost) all zeros
    assert found[True][0] < 0.5 and found[True][2] < 1.5, found  # (per bucket: 1.0 and 4.3 here)


def overflow(rank, world, out):
    """An inf on one rank reaches every rank, so GradScaler skips the step everywhere."""
    state = CfcState(warmup_steps=0, min_compress_numel=0)
    ddp, opt = make(state)
    ddp._cfc_state = state
    scaler = torch.amp.GradScaler(DEV.type, init_scale=1024.0)
    before = [p.detach().clone() for p in ddp.parameters()]
    x, y = batch(rank, 0)
    loss = nn.functional.cross_entropy(ddp(x), y)
    if rank == 1:
        loss = loss * math.inf
    scaler.scale(loss).backward()
    for p in ddp.parameters():
        assert not torch.isfinite(p.grad).all(), "the overflow did not reach this rank"
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, ddp.parameters()))
    assert state_of(ddp).stats()["compressed_buckets"] > 0
    assert scaler.get_scale() == 512.0
    # and the next, finite, step goes through
    opt.zero_grad()
    x, y = batch(rank, 1)
    scaler.scale(nn.functional.cross_entropy(ddp(x), y)).backward()
    for p in ddp.parameters():
        assert torch.isfinite(p.grad).all()


def state_of(ddp):
    return ddp._cfc_state


def accumulate(rank, world, out):
    """no_sync() accumulation, then one synced step: within eps of plain all-reduce."""
    eps = 1e-4
    grads = []
    for state in (None, CfcState(eps=eps, warmup_steps=0, min_compress_numel=0)):
        ddp, _ = make(state)
        with ddp.no_sync():
            x, y = batch(rank, 0)
            nn.functional.cross_entropy(ddp(x), y).backward()
        x, y = batch(rank, 1)
        nn.functional.cross_entropy(ddp(x), y).backward()
        grads.append([p.grad.clone() for p in ddp.parameters()])
    for plain, comp in zip(*grads):
        err = (plain.double() - comp.double()).abs().max().item()
        assert err <= eps * (1 + 1e-3) + 1e-7 * plain.abs().max().item(), err
        assert err > 0 or plain.abs().max() == 0  # it really was compressed


def variants(rank, world, out):
    """gradient_as_bucket_view, static_graph, find_unused_parameters and bf16 gradients."""
    cases = [
        ({"gradient_as_bucket_view": True}, torch.float32),
        ({"static_graph": True}, torch.float32),
        ({"find_unused_parameters": True}, torch.float32),
        ({}, torch.bfloat16),
        ({}, torch.float16),
    ]
    for kw, dtype in cases:
        state = CfcState(warmup_steps=1, min_compress_numel=0)
        ddp, opt = make(state, dtype=dtype, **kw)
        losses = train(ddp, opt, rank, 6, dtype=dtype)
        assert all(math.isfinite(l) for l in losses), (kw, dtype, losses)
        assert losses[-1] < losses[0], (kw, dtype, losses)
        for p in ddp.parameters():
            assert same_on_all_ranks(p.detach()), (kw, dtype)
        s = state.stats()
        assert s["compressed_buckets"] > 0 and s["ratio"] > 4 / world, (kw, dtype, s)


def mismatch(rank, world, out):
    ddp, _ = make(CfcState(rms=0.3 if rank == 0 else 0.1, warmup_steps=0))
    x, y = batch(rank, 0)
    with pytest.raises(Exception, match="ranks disagree on the cfc_hook options") as failed:
        nn.functional.cross_entropy(ddp(x), y).backward()
    # DDP names the error's type (a future set with set_exception reads "Unable to cast ...").
    assert "Unable to cast" not in str(failed.value) and "CfcError" in str(failed.value), failed.value
    # The private engine settings order or size the collectives: they are agreed on too.
    state = CfcState(warmup_steps=0)
    state._pipeline_depth = 1 + rank
    ddp, _ = make(state)
    with pytest.raises(Exception, match="ranks disagree on cfc's engine settings.*_pipeline_depth=1.*_pipeline_depth=2"):
        nn.functional.cross_entropy(ddp(x), y).backward()


def close(rank, world, out):
    """close() lets the comm thread and the native exchange's communicator go (CUDA); the
    state still reports, and the hook refuses further buckets with a clear error."""
    state = CfcState(warmup_steps=1, min_compress_numel=0)
    ddp, opt = make(state, pipeline=True)
    train(ddp, opt, rank, 3)
    worker, exchange, pipeline = state._worker, state._exchange, state._pipeline
    if DEV.type == "cuda":
        assert worker is not None and worker.thread.is_alive()
    if NCCL and world == 2:
        assert exchange is not None, "2 ranks, an rms bound, NCCL: the native exchange"
        assert pipeline is not None, "the steps after the warm-up: the pipeline"
    state.close()
    assert state._worker is None and state._exchange is None and state._pipeline is None
    if pipeline is not None:
        with pytest.raises(cfc.CfcError, match="BucketPipeline was closed"):
            pipeline.sync()
    if worker is not None:
        assert not worker.thread.is_alive()
    if exchange is not None:
        with pytest.raises(cfc.CfcError, match="BucketExchange was closed"):
            exchange.fence(torch.cuda.current_stream().cuda_stream)
    s = state.stats()
    assert s["step"] == 3 and s["compressed_buckets"] > 0, s
    assert state.state_dict()["step"] == 3
    state.close()  # again: nothing to do
    x, y = batch(rank, 3)
    with pytest.raises(Exception, match="this CfcState was closed") as failed:
        nn.functional.cross_entropy(ddp(x), y).backward()
    assert "Unable to cast" not in str(failed.value) and "CfcError" in str(failed.value), failed.value


def comm_failure(rank, world, out):
    """A failure on the comm thread, after the hook has returned the bucket's future (CUDA),
    reaches backward() as the error it was, not as "Unable to cast ... to Tensor"."""
    import cfc.ddp as hook

    state = CfcState(warmup_steps=1, min_compress_numel=0)
    ddp, opt = make(state, pipeline=False)  # the comm thread (pipeline_failure: the pipeline)
    train(ddp, opt, rank, 2)
    assert state._worker is not None and state._worker.thread.is_alive()

    def launch_fails(*args, **kw):
        assert threading.current_thread() is state._worker.thread  # the future was returned
        raise cfc.CfcError("a launch failed on the comm thread")

    launch, hook._gpu_launch = hook._gpu_launch, launch_fails
    try:
        x, y = batch(rank, 2)
        with pytest.raises(Exception, match="a launch failed on the comm thread") as failed:
            nn.functional.cross_entropy(ddp(x), y).backward()
        assert "Unable to cast" not in str(failed.value) and "CfcError" in str(failed.value), failed.value
    finally:
        hook._gpu_launch = launch
    state.close()


class _CudaBytes:
    """``n`` bytes of device memory at ``ptr``, for ``torch.as_tensor`` (CUDA array interface)."""

    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 2}


class _CorruptFrame:
    """The native exchange of one rank, but its frame of bucket ``key`` gets its magic overwritten
    after it arrived, before it is decoded (``armed`` times)."""

    def __init__(self, exchange, key):
        self.exchange, self.key, self.armed, self.hit, self.recv = exchange, key, 0, 0, None

    def launch(self, key, stream, *args, **kw):
        if key == self.key:
            self.recv = args[11]  # recv_ptr: the rows every rank's frame arrives in
        return self.exchange.launch(key, stream, *args, **kw)

    def finish(self, key, *args):
        if key == self.key and self.armed:
            self.armed -= 1
            self.hit += 1
            torch.cuda.synchronize()  # the all-gather has written the rows
            frame = self.recv + 16  # one rank: its row's 16-byte head, then its frame
            torch.as_tensor(_CudaBytes(frame, 1), device=DEV).fill_(ord("X"))
            torch.cuda.synchronize()
        return self.exchange.finish(key, *args)

    def __getattr__(self, name):
        return getattr(self.exchange, name)


def _bad_last_frame(native, algorithm=None, pipeline=False):
    """A frame of the step's last bucket that fails its check on the GPU (its magic overwritten
    after it arrived) makes that very step's backward() raise a CfcError, so no optimizer step
    runs on the bucket left undecoded (native: the exchange cfc_hook drives by default; else
    the exchange over torch.distributed: the all-gather of frames, or the reduce-scatter,
    whose last exchange is the all-gather of its shards' sums)."""
    import cfc.ddp as hook

    rank = dist.get_rank()
    state = CfcState(eps=1e-4, warmup_steps=1, min_compress_numel=0, algorithm=algorithm)
    state._use_exchange = native
    ddp, opt = make(state, pipeline=pipeline)
    train(ddp, opt, rank, 2)
    shards = any(isinstance(k, tuple) for k in state._slots)  # ("shard", i) and ("sum", i)
    assert shards == (algorithm == "reduce-scatter"), state._slots
    buckets = {k[1] if shards else k for k in state._slots}
    assert (state._exchange is not None) == native and len(buckets) >= 2, state._slots
    last = max(buckets)  # every bucket is compressed: DDP's last is the highest index
    target = ("sum", last) if shards else last  # the exchange whose frames are decoded
    state._slots = {k: 1 << 40 for k in state._slots}  # slots of the frame's capacity: no resend
    finish, hit = hook._FrameExchange.finish, []
    if pipeline:  # the pipeline's thread overwrites rank 0's frame of the last bucket
        assert state._pipeline is not None
        state._pipeline._corrupt_next_received(last)
    elif native:
        state._exchange = corrupt = _CorruptFrame(state._exchange, last)
        corrupt.armed = 1
    else:

        def corrupted(self):
            frames, sent = finish(self)
            if self.index == target and not hit:
                hit.append(True)
                frames[0][0] = ord("X")  # on the comm thread's stream, before the decoding
            return frames, sent

        hook._FrameExchange.finish = corrupted
    try:
        x, y = batch(rank, 2)
        with pytest.raises(Exception, match="received a bad frame") as failed:
            nn.functional.cross_entropy(ddp(x), y).backward()
        assert "CfcError" in str(failed.value) and "Unable to cast" not in str(failed.value), failed.value
        if not pipeline:
            assert (corrupt.hit if native else len(hit)) == 1
    finally:
        hook._FrameExchange.finish = finish
    if pipeline:  # and every later step fails alike, before its optimizer step
        x, y = batch(rank, 3)
        with pytest.raises(Exception, match="received a bad frame"):
            nn.functional.cross_entropy(ddp(x), y).backward()
    state.close()


def bad_frame(rank, world, out):
    for algorithm in ("all-gather", "reduce-scatter"):  # (both run at any world size)
        _bad_last_frame(native=False, algorithm=algorithm)


def bad_frame_native(rank, world, out):
    _bad_last_frame(native=True, algorithm="all-gather")


def bad_frame_pipeline(rank, world, out):
    _bad_last_frame(native=True, algorithm="all-gather", pipeline=True)


def pipeline_failure(rank, world, out):
    """A failure on the pipeline's thread (here: its exchange closed under it, on every rank)
    reaches that step's backward() as the error it was, and every later step's too."""
    state = CfcState(warmup_steps=1, min_compress_numel=0)
    ddp, opt = make(state, pipeline=True)
    train(ddp, opt, rank, 2)
    assert state._pipeline is not None, "the step after the warm-up went through the pipeline"
    state._exchange.close()
    for step in (2, 3):
        x, y = batch(rank, step)
        with pytest.raises(Exception, match="bucket exchange was closed|failed earlier") as failed:
            nn.functional.cross_entropy(ddp(x), y).backward()
        assert "CfcError" in str(failed.value) and "Unable to cast" not in str(failed.value), failed.value
    state.close()


def fallback(rank, world, out):
    state = CfcState(fallback="auto", warmup_steps=1, trial_steps=2, min_compress_numel=0)
    ddp, opt = make(state)
    train(ddp, opt, rank, 5)
    s = state.stats()
    assert state._decisions, "the trial decided nothing"
    decided = torch.tensor([float(state._decisions[k]) for k in sorted(state._decisions)], device=DEV)
    assert same_on_all_ranks(decided)
    assert set(state._decisions) == set(state._layouts)  # every bucket was timed both ways
    assert s["compressed_buckets"] > 0 and s["plain_buckets"] > 0


def plain_after_trial(rank, world, out):
    """Once fallback="auto" has chosen plain all-reduce for every bucket, CUDA steps send
    their buckets from the autograd thread over DDP's process group (after one step that sends
    the trial's residuals along through the comm thread), where that group is NCCL's; CPU
    buckets always run cfc's collective on the autograd thread."""
    state = CfcState(fallback="auto", warmup_steps=1, trial_steps=2, min_compress_numel=0)

    def plain_verdict(group=None, again=False):  # as if plain had been faster for every bucket
        state._decisions.update({i: False for i in state._trial})
        state._trial.clear()

    state._decide = plain_verdict
    ddp, opt = make(state)
    train(ddp, opt, rank, 5)  # warm-up, trial (2 steps), the step that flushes, one more
    state.reset_stats()
    losses = train(ddp, opt, rank, 2, start=5)
    s = state.stats()
    assert all(math.isfinite(l) for l in losses)
    assert s["compressed_buckets"] == 0 and s["plain_buckets"] > 0, s
    assert s["direct_buckets"] == (s["plain_buckets"] if NCCL else 0), s
    for p in ddp.parameters():
        assert same_on_all_ranks(p.detach())


def slots(rank, world, out):
    """CUDA buckets travel in slots sized from earlier frames; a frame that outgrows its slot
    is sent again exactly, and training goes on identically on every rank."""
    state = CfcState(warmup_steps=1, min_compress_numel=0)
    ddp, opt = make(state)
    train(ddp, opt, rank, 3)
    if DEV.type == "cuda":
        assert state._slots, "no slot was sized"
        state._slots = {k: 100 for k in state._slots}  # far too small for the next frames
    losses = train(ddp, opt, rank, 2, start=3)
    assert all(math.isfinite(l) for l in losses)
    if DEV.type == "cuda":
        assert all(v > 100 for v in state._slots.values())
    for p in ddp.parameters():
        assert same_on_all_ranks(p.detach())


def trial_timing(rank, world, out):
    """fallback="auto" times each bucket's exchange alone: a rank that reaches its buckets
    late (rank 1 sleeps 1 s before each one during the trial) does not lengthen the other
    ranks' times, whichever kind of exchange the step tries. (The fastest sample of each kind
    decides; the first compressed one also pays one-off costs such as compiling kernels.)"""
    import time

    state = CfcState(fallback="auto", warmup_steps=1, trial_steps=4, min_compress_numel=0)
    times = {}
    record = state._record_trial

    def spy(index, compressed, seconds, device, layout):
        times.setdefault((index, compressed), []).append(seconds)
        record(index, compressed, seconds, device, layout)

    state._record_trial = spy

    def late_hook(st, bucket):
        if rank == 1 and st._phase() == "trial":
            time.sleep(1.0)
        return cfc_hook(st, bucket)

    ddp, opt = make()
    ddp.register_comm_hook(state, late_hook)
    train(ddp, opt, rank, 6)
    assert times and all(len(v) == 2 for v in times.values()), times
    assert max(min(v) for v in times.values()) < 0.5, times  # (half the sleep: room for a slow machine)


def reduce_scatter(rank, world, out):
    """Both ways a compressed bucket can move train alike: every rank ends with the same
    parameters, the loss falls, and the way asked for is the way that ran."""
    for algorithm in ("reduce-scatter", "all-gather"):
        state = CfcState(warmup_steps=1, min_compress_numel=0, algorithm=algorithm)
        ddp, opt = make(state)
        losses = train(ddp, opt, rank, 5)
        assert all(math.isfinite(l) for l in losses) and losses[-1] < losses[0], (algorithm, losses)
        for p in ddp.parameters():
            assert same_on_all_ranks(p.detach()), algorithm
        s = state.stats()
        assert s["compressed_buckets"] > 0 and 0 < s["max_error"] <= s["eps"] * (1 + 1e-6), s
        if DEV.type == "cuda":
            shards = any(isinstance(k, tuple) and k[0] == "shard" for k in state._slots)
            assert shards == (algorithm == "reduce-scatter"), state._slots


def register(rank, world, out):
    """cfc.register_comm_hook: without fallback="auto", or on CPU buckets, the hook goes on
    directly. With it on CUDA buckets a probe of the largest bucket decides first: this
    model's (64 Ki elements) is far faster plain over any GPU link, so DDP keeps its built-in
    all-reduce and trains bit for bit as with no hook at all. (Over gloo, which carries CUDA
    tensors through host memory, either way may win; every rank takes the same.)"""
    import cfc

    state = CfcState(warmup_steps=1)
    ddp, opt = make()
    assert cfc.register_comm_hook(ddp, state) and state.probe is None
    train(ddp, opt, rank, 3)
    assert state.stats()["compressed_buckets"] > 0

    auto = CfcState(fallback="auto", trial_steps=2)
    ddp, opt = make()
    chosen = cfc.register_comm_hook(ddp, auto)
    if DEV.type == "cpu":
        assert chosen and auto.probe is None
        return
    p = auto.probe
    assert p["numel"] == max(q.numel() for q in ddp.module.parameters()) and p["dtype"] == "float32", p
    assert 0 < p["plain_seconds"] < math.inf and 0 < p["compressed_seconds"] < math.inf, p
    assert chosen == p["registered"] == (p["compressed_seconds"] < p["plain_seconds"]), p
    assert same_on_all_ranks(torch.tensor([float(chosen)], device=DEV))
    if NCCL:
        assert not chosen, f"compression of {p['numel']} elements should not pay over a GPU link: {p}"
    if chosen:
        return
    losses = train(ddp, opt, rank, 3)
    ref, ref_opt = make()
    assert losses == train(ref, ref_opt, rank, 3)


def register_sockets(rank, world, out):
    """Over the socket transport a 64 MB bucket is several times faster compressed: the probe
    registers cfc_hook, and training compresses."""
    import cfc

    torch.manual_seed(0)
    model = nn.Linear(4096, 4096).to(DEV)
    ddp = DDP(model)
    state = CfcState(fallback="auto", trial_steps=2, warmup_steps=1)
    assert cfc.register_comm_hook(ddp, state), state.probe
    p = state.probe
    assert p["numel"] == model.weight.numel() and p["compressed_seconds"] < p["plain_seconds"], p
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(4):  # warm-up, trial (2), one step as the trial chose
        if step == 3:
            state.reset_stats()
        x = torch.randn(32, 4096, device=DEV, generator=torch.Generator(device=DEV).manual_seed(step * 10 + rank))
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    s = state.stats()  # the last step: the weight's bucket compressed, the bias's plain (small)
    assert s["compressed_buckets"] == 1 and s["ratio"] > 3, s
    for q in ddp.parameters():
        assert same_on_all_ranks(q.detach())


def native_exchange(rank, world, out):
    """CUDA buckets go through cfc's native exchange (a communicator of cfc's own, two calls
    per bucket), which gives the bits of the exchange over torch.distributed: the same frames
    and bounds, decoded and added in the same order (only the slots, and so the bytes sent,
    differ a little). Also with a frame that outgrows its slot, bfloat16 gradients and
    per-parameter bounds."""
    configs = [
        (dict(warmup_steps=1, min_compress_numel=0), torch.float32),
        (dict(eps=2e-4, warmup_steps=1), torch.float32),
        (dict(warmup_steps=1, per_tensor=True), torch.float32),
        (dict(warmup_steps=1), torch.bfloat16),
    ]
    for kw, dtype in configs:
        params, stats = [], []
        # the native exchange through the pipeline, through the comm thread (the default), and
        # the exchange over torch.distributed
        for native, pipeline in ((True, True), (True, False), (False, False)):
            state = CfcState(**kw)
            state._use_exchange = native
            ddp, opt = make(state, dtype=dtype, pipeline=pipeline)
            train(ddp, opt, rank, 3, dtype=dtype)
            assert (state._exchange is not None) == native, (kw, native)
            assert (state._pipeline is not None) == (pipeline and not kw.get("per_tensor")), (kw, pipeline)
            if native:  # far too small for the next frames: sent again, whole
                state._slots = {k: 96 for k in state._slots}
            train(ddp, opt, rank, 3, start=3, dtype=dtype)
            params.append([p.detach().clone() for p in ddp.parameters()])
            stats.append(state.stats())
        for other in (1, 2):
            assert all(torch.equal(a, b) for a, b in zip(params[0], params[other])), (kw, other)
            assert stats[0]["compressed_buckets"] == stats[other]["compressed_buckets"] > 0, stats
            assert stats[0]["max_error"] == stats[other]["max_error"] > 0, stats
        assert stats[0]["resends"] >= 1 and stats[1]["resends"] >= 1, stats
        assert stats[0]["bytes_sent"] == stats[1]["bytes_sent"], stats  # the same exchanges
        for p in params[0]:
            assert same_on_all_ranks(p)


def trial_resume(rank, world, out):
    """fallback="auto": a checkpoint taken after the trial's last step, before the choice
    that the next step's first bucket makes from its timings, resumes to the same choice."""
    kw = dict(fallback="auto", warmup_steps=1, trial_steps=2, min_compress_numel=0)
    state = CfcState(**kw)
    ddp, opt = make(state)
    train(ddp, opt, rank, 3)  # warm-up, the trial's two steps
    assert state._trial and not state._decisions
    # plain faster for every bucket, on every rank alike (timings vary)
    state._trial = {i: {"plain": [1.0], "cfc": [2.0]} for i in state._trial}
    saved = {"model": {k: v.clone() for k, v in ddp.state_dict().items()},
             "opt": copy.deepcopy(opt.state_dict()), "cfc": state.state_dict()}
    for st, ddp, opt in ((state, ddp, opt), resume_from(saved, kw)):  # straight on, and resumed
        st.reset_stats()
        train(ddp, opt, rank, 1, start=3)
        assert st._decisions and not any(st._decisions.values()), st._decisions
        assert st.stats()["plain_buckets"] > 0 and st.stats()["compressed_buckets"] == 0, st.stats()


def other_grads(rank, world, out):
    """Buckets cfc does not compress go out plainly, alongside compressed ones: float64
    gradients and sparse ones (``nn.Embedding(sparse=True)``), with DDP's own results."""

    def sgd_steps(ddp, steps, make_input):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(steps):
            ddp(make_input(step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in ddp.parameters()]

    def dense(step):
        return batch(rank, step)[0].double()

    runs = []
    for state in (None, CfcState(warmup_steps=0, min_compress_numel=0)):
        torch.manual_seed(0)
        ddp = DDP(Net().double().to(DEV), bucket_cap_mb=0.1)
        if state is not None:
            ddp.register_comm_hook(state, cfc_hook)
        runs.append(sgd_steps(ddp, 3, dense))
    for plain, hooked in zip(*runs):
        # (DDP divides before its sum, cfc after: the same bits where the world is a power of 2)
        assert torch.allclose(plain, hooked, rtol=1e-13, atol=0), (plain - hooked).abs().max()
    s = state.stats()
    assert s["compressed_buckets"] == 0 and s["plain_buckets"] > 0, s
    if NCCL:
        return  # NCCL takes no sparse tensors: DDP's own all-reduce of them fails there too

    class Rec(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5000, 16, sparse=True)
            self.head = nn.Linear(16, 64)

        def forward(self, idx):
            return self.head(self.emb(idx).mean(1))

    def ids(step):
        return torch.randint(0, 5000, (8, 5), generator=torch.Generator().manual_seed(100 * step + rank)).to(DEV)

    firsts = []
    for warmup in (None, 1, 0):  # DDP alone; the hook from its warm-up (the direct path); compressing
        torch.manual_seed(0)
        ddp = DDP(Rec().to(DEV))
        if warmup is not None:
            state = CfcState(warmup_steps=warmup, min_compress_numel=0)
            ddp.register_comm_hook(state, cfc_hook)
        firsts.append(sgd_steps(ddp, 1, ids)[0])  # the embedding after one step
        if warmup is not None:
            for p in sgd_steps(ddp, 2, lambda step: ids(step + 1)):
                assert same_on_all_ranks(p)
            s = state.stats()
            assert s["compressed_buckets"] > 0 and s["plain_buckets"] > 0, s  # the head's, the embedding's
    for hooked in firsts[1:]:
        assert torch.allclose(hooked, firsts[0], rtol=1e-6, atol=1e-9), (hooked - firsts[0]).abs().max()


def pipeline_other_grads(rank, world, out):
    """With the bucket pipeline asked for (dense float32, bfloat16 and float16 buckets only), a
    model with a float64 layer trains: the warm-up saw its float64 bucket, and the pipeline
    stays off. Without a warm-up, the first step's float64 bucket fails it with a clear error."""

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(64, 256)
            self.head = nn.Linear(256, 10).double()

        def forward(self, x):
            return self.head(self.body(x).relu().double()).float()

    for warmup in (1, 0):
        torch.manual_seed(0)
        ddp = DDP(Mixed().to(DEV))
        state = CfcState(warmup_steps=warmup, min_compress_numel=0)
        state._use_pipeline = True
        ddp.register_comm_hook(state, cfc_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        if warmup:
            train(ddp, opt, rank, 3)
            s = state.stats()
            assert state._pipeline is None and s["compressed_buckets"] > 0 and s["plain_buckets"] > 0, s
        else:
            with pytest.raises(RuntimeError, match="the bucket pipeline takes dense float32"):
                train(ddp, opt, rank, 1)
        state.close()


def groups(rank, world, out):
    """cfc.register_comm_hook gives a state without a process group DDP's, and refuses one
    whose group is not DDP's (the buckets would be averaged over other ranks, silently)."""
    singles = [dist.new_group([r]) for r in range(world)]
    torch.manual_seed(0)
    if world > 1:  # (at one rank the group of one is the world)
        ddp = DDP(Net().to(DEV), bucket_cap_mb=0.1)
        with pytest.raises(ValueError, match="is not the DDP model's"):
            cfc.register_comm_hook(ddp, CfcState(process_group=singles[rank]))
    alone = DDP(Net().to(DEV), bucket_cap_mb=0.1, process_group=singles[rank])
    state = CfcState(warmup_steps=0, min_compress_numel=0)
    assert cfc.register_comm_hook(alone, state)
    opt = torch.optim.SGD(alone.parameters(), lr=0.1)
    train(alone, opt, rank, 2)
    assert state.world == 1 and state.stats()["compressed_buckets"] > 0, state.stats()


def one_bucket_resumed(saved, kw):
    """The test model under DDP with its default bucket size (one bucket for this model, where
    the state ``saved`` came from several) and a CfcState of options ``kw`` that loaded it."""
    state = CfcState(**kw)
    torch.manual_seed(0)
    ddp = DDP(Net().to(DEV))
    state._use_pipeline = os.environ.get("CFC_TEST_PIPELINE") == "1"  # as make() does
    ddp.register_comm_hook(state, cfc_hook)
    state.load_state_dict(saved)
    return state, ddp


def resume_other_buckets(rank, world, out):
    """A state saved with one bucket size and loaded into a DDP model with another: the loaded
    buckets serve the first steps (DDP's initial buckets, then its rebuilt ones), then the
    model's own buckets run whole."""
    kw = dict(warmup_steps=1, min_compress_numel=0)
    state = CfcState(**kw)
    ddp, opt = make(state)
    train(ddp, opt, rank, 3)
    saved = state.state_dict()
    assert len(saved["layouts"]) > 1, saved["layouts"]
    state, ddp = one_bucket_resumed(saved, kw)
    parts, kept = [], []
    cut = state._parts

    def native_buckets():
        """Buckets the native exchange and the pipeline keep something for (CUDA buckets)."""
        return sum(n.buckets() for n in (state._exchange, state._pipeline) if n is not None)

    def counted(*args):
        run = cut(*args)
        parts.append(len(run[0]))
        kept.append(native_buckets())  # (what the steps before this bucket left)
        return run

    state._parts = counted
    train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), rank, 5, start=3)
    assert parts[0] > 1 and parts[2:] == [1, 1, 1], parts
    # and nothing is kept for the loaded layout's other buckets (their residuals' values were
    # carried into the one bucket's)
    assert list(state._residuals) == list(state._layouts) == [0] and state._unflushed <= {0}, (
        list(state._residuals), list(state._layouts), state._unflushed)
    assert all((k[1] if isinstance(k, tuple) else k) == 0 for k in state._slots), state._slots
    assert state.stats()["residual_resets"] == 0
    worker = state._worker
    if worker is not None:  # CUDA buckets: the comm thread's pinned words, the native exchange's entries
        assert set(worker.sums) <= {0}, list(worker.sums)
        assert all((k[1] if isinstance(k, tuple) else k) == 0 for k in worker.sizes), list(worker.sizes)
        natives = [n for n in (state._exchange, state._pipeline) if n is not None]
        if natives:  # each kept the loaded buckets, and keeps the one bucket now
            assert max(kept) > len(natives) and native_buckets() == len(natives), (kept, native_buckets())


def trial_layouts(rank, world, out):
    """fallback="auto" times buckets, not bucket indices: where the buckets change under the
    trial's choices, the trial runs again, and every choice is made for the parameters it timed.
    1. ``static_graph`` with ``warmup_steps=1``: DDP rebuilds its buckets between the trial's
       two steps, so each bucket is timed only one way at first.
    2. A run resumed into a model with another bucket size (one bucket instead of several):
       its bucket is not any that the saved trial timed."""

    def decided_for_what_runs(st):
        assert st._decisions and set(st._decisions) == set(st._layouts), (st._decisions, st._layouts)
        assert all(st._decided[k] == st._layouts[k] for k in st._decisions), (st._decided, st._layouts)
        assert all(math.isfinite(p) and math.isfinite(c) for p, c in st._trial_times.values()), st._trial_times
        decided = torch.tensor([float(st._decisions[k]) for k in sorted(st._decisions)], device=DEV)
        assert same_on_all_ranks(decided)

    kw = dict(fallback="auto", warmup_steps=1, trial_steps=2, min_compress_numel=0)
    state = CfcState(**kw)
    ddp, opt = make(state, static_graph=True)
    train(ddp, opt, rank, 6)  # the trial again from step 3: decided at step 5's first bucket
    decided_for_what_runs(state)

    # With four trial steps each bucket is timed both ways after the rebuild: the choice counts
    # only the times of the parameters the bucket now holds.
    state = CfcState(**dict(kw, trial_steps=4))
    records, at_decision = [], []
    record, decide = state._record_trial, state._decide

    def spy_record(index, compressed, seconds, device, layout):
        records.append((index, compressed, tuple(o for o, _, _ in layout)))
        record(index, compressed, seconds, device, layout)

    def spy_decide(*args, **kw):
        counts = {k: (len(t["plain"]), len(t["cfc"])) for k, t in state._trial.items()}
        at_decision.append((len(records), counts))
        decide(*args, **kw)

    state._record_trial, state._decide = spy_record, spy_decide
    ddp, opt = make(state, static_graph=True)
    train(ddp, opt, rank, 6)
    decided_for_what_runs(state)
    upto, counts = at_decision[0]
    assert len({layout for k, _, layout in records if k == 0}) > 1, records  # bucket 0 changed
    for k, got in counts.items():
        mine = [(c, layout) for i, c, layout in records[:upto] if i == k]
        cut = max((j for j, (_, layout) in enumerate(mine) if layout != state._layouts[k]), default=-1)
        kept = [c for c, _ in mine[cut + 1:]]  # the samples since the bucket last changed
        assert got == (kept.count(False), kept.count(True)), (k, counts, records)

    state = CfcState(**kw)
    ddp, opt = make(state)
    train(ddp, opt, rank, 4)  # decided at step 3's first bucket
    saved = state.state_dict()
    assert len(saved["decisions"]) > 1 and saved["origin"] == 0, saved["decisions"]
    state, ddp = one_bucket_resumed(saved, kw)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    # Steps 4 and 5: the saved buckets serve DDP's initial one, then its rebuilt one; step 6
    # runs the model's own bucket, which the first bucket of step 7 finds undecided for.
    train(ddp, opt, rank, 3, start=4)
    assert state._decisions == saved["decisions"]
    train(ddp, opt, rank, 1, start=7)  # the trial's first step
    assert not state._decisions and state._origin == 6, (state._decisions, state._origin)
    assert state.state_dict()["origin"] == 6  # a checkpoint of the second trial keeps where it began
    train(ddp, opt, rank, 2, start=8)  # its second step, then the choice at step 9's first bucket
    decided_for_what_runs(state)
    assert list(state._decisions) == [0]


SCENARIOS = {
    f.__name__: f
    for f in (parity, resume, overflow, accumulate, variants, mismatch, fallback, slots, reduce_scatter, per_tensor,
              trial_resume,
              trial_timing, plain_after_trial, register, register_sockets, native_exchange, close, comm_failure, bad_frame,
              bad_frame_native, bad_frame_pipeline, pipeline_failure, other_grads, pipeline_other_grads, groups,
              resume_other_buckets, trial_layouts)
}


def spawn(tmp_path, scenario, world=None, device="cpu"):
    world = world or world_of(device)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), scenario, out, device), nprocs=world, join=True)
    return out.get() if not out.empty() else None


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("shared-gpu", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_training_parity_with_8x_fewer_bytes(tmp_path, device):
    enough_gpus(device)
    r = spawn(tmp_path, "parity", device=device)
    s = r["stats"]
    assert r["cfc"] < 0.5 * r["first"], r  # it learned
    assert abs(r["cfc"] - r["plain"]) <= 0.02 * r["plain"], r
    # CPU buckets: the reduce-scatter of codes. CUDA buckets: frames padded to slots, an
    # all-gather for 2 ranks; this small model's buckets send about 7x fewer bytes that way.
    # (the all-gather's ratio against a ring all-reduce falls as 2 / world)
    assert s["ratio"] >= (8 if device == "cpu" else 12 / world_of(device)), s
    assert 0 < s["max_error"] <= s["eps"] * (1 + 1e-6), s


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "scenario",
    ["resume", "overflow", "accumulate", "variants", "mismatch", "fallback", "slots", "reduce_scatter", "per_tensor",
     "trial_timing", "trial_resume", "plain_after_trial", "register", "close", "other_grads", "groups",
     "resume_other_buckets", "trial_layouts"],
)
def test_hook(tmp_path, scenario, device):
    enough_gpus(device)
    spawn(tmp_path, scenario, device=device)


# One GPU is enough for these: one rank on it ("cuda", world size 1), or several over gloo.
ONE_GPU = [pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("shared-gpu", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", ONE_GPU)
def test_a_comm_thread_failure_reaches_backward_as_the_error_it_was(tmp_path, device):
    spawn(tmp_path, "comm_failure", world=1 if device == "cuda" else None, device=device)


@pytest.mark.parametrize("device", ONE_GPU)
def test_a_pipeline_failure_reaches_backward_as_the_error_it_was(tmp_path, device):
    if device == "shared-gpu":
        pytest.skip("the pipeline runs the native exchange, NCCL's, which refuses two ranks on one GPU")
    spawn(tmp_path, "pipeline_failure", world=1, device=device)


@pytest.mark.gpu
def test_the_pipeline_stays_off_for_a_model_with_float64_gradients(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    spawn(tmp_path, "pipeline_other_grads", world=1, device="cuda")


@pytest.mark.parametrize("device", ONE_GPU)
@pytest.mark.parametrize("scenario", ["bad_frame_pipeline", "bad_frame_native", "bad_frame"])
def test_a_bad_frame_in_the_last_bucket_fails_that_steps_backward(tmp_path, scenario, device):
    if scenario in ("bad_frame_native", "bad_frame_pipeline") and device == "shared-gpu":
        pytest.skip("the native exchange is NCCL's, which refuses two ranks on one GPU")
    spawn(tmp_path, scenario, world=1 if device == "cuda" else None, device=device)


@pytest.mark.gpu
def test_native_exchange_gives_the_bits_of_the_exchange_over_torch_distributed(tmp_path):
    enough_gpus("cuda")
    if GPUS > 2:
        pytest.skip("the native exchange takes the all-gather, cfc's choice for 2 ranks")
    spawn(tmp_path, "native_exchange", device="cuda")


@pytest.mark.gpu
def test_the_pipeline_gives_the_bits_of_the_comm_thread_at_one_rank(tmp_path):
    """native_exchange at world size 1 (one GPU is enough): the pipeline, the comm thread over
    the native exchange and the exchange over torch.distributed train to the same bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    spawn(tmp_path, "native_exchange", world=1, device="cuda")


@pytest.mark.gpu
def test_register_comm_hook_finds_compression_pays_over_sockets(tmp_path, monkeypatch):
    enough_gpus("cuda")
    for k, v in {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1",
                 "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo"}.items():
        monkeypatch.setenv(k, v)
    spawn(tmp_path, "register_sockets", device="cuda")


def test_the_native_exchange_is_taken_where_the_options_allow_it():
    """eps or rms bounds with the all-gather, on cfc's own communicator; not a rel bound (read
    from each frame), the reduce-scatter, or register_comm_hook's probe (DDP's own group)."""
    from cfc.ddp import _exchange_fits

    def state(world=2, **kw):
        s = CfcState(**kw)
        s.process_group, s.group, s.world = object(), object(), world
        return s

    assert _exchange_fits(state())
    assert _exchange_fits(state(eps=1e-3))
    assert _exchange_fits(state(per_tensor=True))
    assert _exchange_fits(state(4, algorithm="all-gather"))
    assert not _exchange_fits(state(4))  # the reduce-scatter, cfc's choice for more ranks
    assert not _exchange_fits(state(algorithm="reduce-scatter"))
    assert not _exchange_fits(state(rel=0.01))
    probe = state()
    probe.group = probe.process_group
    assert not _exchange_fits(probe)


def test_state_options_are_checked(tmp_path):
    early = CfcState(eps=1e-3)  # before the process group, as Lightning makes it
    with pytest.raises(RuntimeError, match="initialised"):
        early.state_dict()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        for bad in ({"eps": 0}, {"rms": math.nan}, {"eps": 1e-3, "rel": 1e-2},
                    {"fallback": "sometimes"}, {"fallback": "auto", "trial_steps": 3},
                    {"warmup_steps": -1}, {"timeout": 0}, {"timeout": math.inf},
                    {"algorithm": "ring"}, {"algorithm": "reduce-scatter", "rel": 0.01},
                    {"eps": 1e-320}, {"eps": 1e308},  # eps the codec refuses: every bucket would fail
                    {"rel": 1.0}, {"rel": 5}):  # every element within the bound of zero: nothing sent
            with pytest.raises(ValueError):
                CfcState(**bad)
        for bad in ({"eps": True}, {"rms": "0.3"}, {"error_feedback": "no"}, {"per_tensor": 1},
                    {"warmup_steps": 1.5}, {"min_compress_numel": "0"}):
            with pytest.raises(TypeError):
                CfcState(**bad)
        numpy_bound = CfcState(eps=np.float32(1e-3), error_feedback=np.bool_(False), warmup_steps=np.int64(1))
        assert numpy_bound.bound == float(np.float32(1e-3)) and type(numpy_bound.bound) is float
        assert numpy_bound.error_feedback is False and numpy_bound.warmup_steps == 1
        # a disagreement names values that differ where the bounds do
        shown = [CfcState(eps=e)._describe(CfcState(eps=e)._config()) for e in (1e-3, np.float32(1e-3))]
        assert shown[0] != shown[1] and "eps=0.001," in shown[0], shown
        s = CfcState()
        assert (s.bound_kind, s.bound) == ("rms", 0.3)
        # the algorithm is one of the options all ranks must share
        ag = CfcState(algorithm="all-gather")
        assert ag._config() != s._config() and "algorithm='all-gather'" in ag._describe(ag._config())
        assert early.state_dict()["world"] == 1  # bound to the group once it exists
        assert early.group is not dist.group.WORLD  # a communicator of cfc's own
        shared = CfcState()  # register_comm_hook's probe: over the process group itself
        shared._setup(own_communicator=False)
        assert shared.group is dist.group.WORLD and (shared.rank, shared.world) == (0, 1)
        with pytest.raises(ValueError, match="cfc_hook state"):
            s.load_state_dict({"version": 99})
    finally:
        dist.destroy_process_group()


def test_a_step_never_mixes_the_two_communicators():
    """Which CUDA steps go out from the autograd thread over DDP's group (no bucket
    compressed), decided once per step from what every rank shares; the rest of the steps use
    cfc's communicator for every bucket. (CPU test of the choice; the GPU tests run both.)"""
    from cfc.ddp import _fast_step, _whole_plain

    s = CfcState(fallback="auto", warmup_steps=2, trial_steps=2)
    s._nccl = True
    assert _fast_step(s)  # step 0: the warm-up
    s.step = 2
    assert not _fast_step(s)  # the trial times both ways through the comm thread
    s.step, s._decisions = 4, {0: False, 1: True}
    assert not _fast_step(s)  # one bucket compressed: none goes the other way
    s.step, s._decisions, s._unflushed = 5, {0: False, 1: False}, {1}
    assert not _fast_step(s)  # a residual left by the trial goes out through the comm thread
    s.step = 6
    s._unflushed.clear()
    assert _fast_step(s)
    s._decisions[1] = True
    assert _fast_step(s)  # decided at the step's first bucket, for the whole step
    s.step = 7
    assert not _fast_step(s)
    s.step, s._decisions[1], s._pending = 8, False, {3: torch.zeros(4)}
    assert not _fast_step(s)  # loaded residuals not yet placed
    always = CfcState()  # fallback=False compresses after the warm-up
    always._nccl, always.step = True, 5
    assert not _fast_step(always)
    gloo = CfcState(fallback="auto")
    assert not _fast_step(gloo)  # CPU buckets always run cfc's collective

    # AllReducer's whole-tensor plain path: chunks below min_compress_numel count as plain
    a = CfcState(fallback="auto", warmup_steps=0, trial_steps=2, min_compress_numel=100)
    a.step, a._decisions = 2, {0: False}
    assert _whole_plain(a, [1000, 50])
    assert not _whole_plain(a, [1000, 500])  # chunk 1 was never timed
    a._decisions[1] = True
    assert not _whole_plain(a, [1000, 500])


def test_comm_thread_runs_each_later_stage_after_the_next_launches(monkeypatch, caplog):
    """The comm thread's order of work, without a GPU (its CUDA calls are stubbed out): a
    part's next stage runs only after the next ``depth`` parts' launches (so those buckets are
    on the wire while this thread waits), a stage may return a further stage (the
    reduce-scatter's), a bucket's future is set only after every stage of its parts, after a
    failure every later future gets the error, and stop() ends the thread."""
    import contextlib

    from cfc import CfcError
    from cfc.ddp import _CommThread

    class Stream:
        cuda_stream = 0

        def __init__(self, device=None):
            pass

        def synchronize(self):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    log = []

    def part(name, stages, fail_at=None):
        def stage(i):
            def run():
                if i == fail_at:
                    raise RuntimeError(f"{name} failed")
                log.append(f"{name}{i}")
                return stage(i + 1) if i + 1 < stages else None

            return run

        def launch():
            log.append(f"launch {name}")
            return stage(0) if stages else None

        return launch

    # depth 2: each stage waits for two more launches, and nothing overtakes an earlier stage
    # (A's second stage, queued after C's launch, holds B's back)
    deep = _CommThread(None, "cpu", depth=2)
    done = torch.futures.Future()
    for name, stages in (("A", 2), ("B", 1), ("C", 1), ("D", 1)):
        deep.submit("part", part(name, stages))
    deep.submit("done", lambda: log.append("done") or "ABCD", done)
    deep.submit("flush")
    deep.drain()
    assert log == ["launch A", "launch B", "launch C", "A0", "launch D", "A1", "B0", "C0", "D0", "done"], log
    assert done.value() == "ABCD"
    deep.stop()
    log.clear()

    worker = _CommThread(None, "cpu")  # depth 1, the default: each stage after the next launch
    assert worker.depth == 1
    futs = [torch.futures.Future() for _ in range(3)]
    worker.submit("part", part("A", 1))  # all-gather: one stage after the launch
    worker.submit("part", part("B", 2))  # reduce-scatter: two
    worker.submit("done", lambda: log.append("done AB") or "AB", futs[0])
    worker.submit("part", part("C", 1))
    worker.submit("part", part("D", 1))
    worker.submit("done", lambda: log.append("done CD") or "CD", futs[1])
    worker.submit("flush")
    worker.drain()
    assert log == [
        "launch A", "launch B", "A0", "launch C", "B0", "launch D", "B1", "done AB", "C0", "D0", "done CD"
    ], log
    assert futs[0].value() == "AB" and futs[1].value() == "CD"

    log.clear()
    worker.submit("part", part("E", 2, fail_at=1))
    worker.submit("done", lambda: "E", futs[2])
    worker.submit("flush")
    worker.drain()
    assert log == ["launch E", "E0"], log
    with pytest.raises(CfcError, match="E failed"):  # the bucket's future: cfc's error, with the cause
        futs[2].wait()
    later = torch.futures.Future()
    worker.submit("part", part("F", 1))
    worker.submit("done", lambda: "F", later)
    worker.submit("flush")
    with pytest.raises(CfcError, match="E failed"):
        later.wait()
    # A stage that will not run may hold buffers the GPU still writes (an all-gather in
    # flight): kept until drain() has waited for the device.
    assert len(worker.kept) == 1 and worker.kept[0]() == "F"
    worker.drain()
    assert "launch F" not in log  # nothing more runs once a stage failed
    assert worker.kept == []
    # The first failure is logged with its traceback (backward() shows only its message).
    failures = [r for r in caplog.records if "comm thread failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info[1].args == ("E failed",), failures

    # A bucket's items in one hand-over run as if queued one by one; drain() waits for them.
    log.clear()
    fresh = _CommThread(None, "cpu")
    done = torch.futures.Future()
    fresh.submit_all([("part", part("G", 1), None), ("done", lambda: log.append("done G") or "G", done),
                      ("flush", None, None)])
    fresh.drain()
    assert log == ["launch G", "G0", "done G"] and done.value() == "G", log
    assert fresh.pending == 0
    fresh.stop()
    fresh.drain()  # returns once the thread has ended, though it never handles the marker
    fresh.thread.join(timeout=10)
    assert not fresh.thread.is_alive()

    worker.stop()  # ends the thread after what is queued (register_comm_hook's probe)
    worker.thread.join(timeout=10)
    assert not worker.thread.is_alive()


def test_training_example_reruns_bit_for_bit_and_scores_held_out_bytes(tmp_path):
    """examples/ddp_train.py with --deterministic: two runs of plain all-reduce give the same
    losses bit for bit (so a gap between hooks is the hooks' own); cfc@X sets the bound; the
    held-out loss is scored every --eval-every steps and at the end."""
    import json
    import pathlib
    import subprocess
    import sys

    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "ddp_train.py"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(example),
        "--hook", "allreduce,cfc@0.2,allreduce,cfc@0.05", "--steps", "10", "--d-model", "32", "--layers", "1",
        "--heads", "2", "--batch", "4", "--seq", "32", "--corpus-mb", "1", "--eval-every", "4",
        "--eval-batches", "3", "--deterministic", "--out", str(tmp_path),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    plain, comp, again, finer = json.loads((tmp_path / "losses.json").read_text())["results"]
    assert plain["losses"] == again["losses"] and plain["held_out"] == again["held_out"]
    assert [s for s, _ in plain["held_out"]] == [4, 8, 10]
    assert all(math.isfinite(v) and 0 < v < 6 for _, v in plain["held_out"])
    assert comp["losses"] != plain["losses"] and comp["cfc"]["ratio"] > 3
    assert finer["cfc"]["ratio"] < comp["cfc"]["ratio"]  # a finer bound sends more
    assert "held-out" in r.stdout and "cfc@0.2" in r.stdout


def test_a_state_dict_that_is_not_one_is_refused_and_changes_nothing(tmp_path):
    """load_state_dict checks every field before it changes anything: a malformed field, a
    non-finite or sparse residual, a negative step are a ValueError, and the state goes on as
    it was."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        state = CfcState(eps=1e-3, warmup_steps=1, min_compress_numel=0)
        ddp = DDP(model)
        assert cfc.register_comm_hook(ddp, state)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        saved = state.state_dict()
        assert saved["step"] == 3 and saved["residuals"] and saved["layouts"]
        assert any(r.abs().max() > 0 for r in saved["residuals"].values())
        o, r = next(iter(saved["residuals"].items()))

        def fingerprint(s):
            d = s.state_dict()
            return (d["step"], {k: v.clone() for k, v in d["residuals"].items()}, d["layouts"], d["decisions"])

        def same(a, b):
            return (a[0], a[2], a[3]) == (b[0], b[2], b[3]) and a[1].keys() == b[1].keys() and all(
                torch.equal(a[1][k], b[1][k]) for k in a[1])

        before = fingerprint(state)
        without = lambda key: {k: v for k, v in saved.items() if k != key}  # noqa: E731
        bad = {
            "no layouts": without("layouts"),
            "no residuals": without("residuals"),
            "no world": without("world"),
            "a negative step": dict(saved, step=-1000),
            "a step of a string": dict(saved, step="3"),
            "a step of a bool": dict(saved, step=True),
            "a world of a string": dict(saved, world="1"),
            "an infinite residual": dict(saved, residuals={**saved["residuals"], o: torch.full_like(r, math.inf)}),
            "a NaN residual": dict(saved, residuals={**saved["residuals"], o: torch.full_like(r, math.nan)}),
            "a sparse residual": dict(saved, residuals={**saved["residuals"], o: r.to_sparse()}),
            "a meta residual": dict(saved, residuals={**saved["residuals"], o: torch.empty(r.numel(), device="meta")}),
            "residuals of a list": dict(saved, residuals=[r]),
            "a residual key of a word": dict(saved, residuals={"abc": r}),
            "a short config": dict(saved, config=[1.0]),
            "a config of None": dict(saved, config=None),
            "a layout of a number": dict(saved, layouts={0: 5}),
            "a bucket key of a word": dict(saved, layouts={"x": (0,)}),
            "decisions of a list": dict(saved, decisions=[True]),
            "a decision of a number": dict(saved, decisions={0: 5}),
            "an RMS entry of a string": dict(saved, rms={0: "x"}),
            "scales of a number": dict(saved, scales={0: 5}),
            # a gradient is divided by its scale: 0 or less would make NaN on every rank
            "a zero scale": dict(saved, scales={0: (((0, 0, 4), (1, 4, 4)), [0.0, 1.0])}),
            "a negative scale": dict(saved, scales={0: (((0, 0, 4), (1, 4, 4)), [1.0, -2.0])}),
            "an origin past the step": dict(saved, origin=saved["step"] + 1),
            "an origin of a string": dict(saved, origin="0"),
            "a trial of a number": dict(saved, trial={0: 5}),
        }
        for name, sd in bad.items():
            with pytest.raises(ValueError, match="state|saved|rank|residual"):
                state.load_state_dict(sd)
            assert same(fingerprint(state), before), f"{name}: the failed load changed the state"
        # The state goes on: one more step works.
        ddp(torch.randn(16, 64)).square().mean().backward()
        assert state.stats()["step"] == 4
        state.load_state_dict(saved)
        assert same(fingerprint(state), before)
        # One state, one model (also through torch.compile's wrapper, which is no other model).
        assert cfc.register_comm_hook(torch.compile(DDP(nn.Linear(3, 3))), CfcState())
        with pytest.raises(ValueError, match="another DDP model"):
            cfc.register_comm_hook(DDP(nn.Linear(3, 3)), state)
        with pytest.raises(ValueError, match="another DDP model"):
            cfc.register_comm_hook(torch.compile(DDP(nn.Linear(3, 3))), state)
        with pytest.raises(TypeError, match="DistributedDataParallel"):
            cfc.register_comm_hook(nn.Linear(3, 3), CfcState())
        with pytest.raises(TypeError, match="warmup_steps"):
            CfcState(warmup_steps=True)
        state.close()
        with pytest.raises(cfc.CfcError, match="closed"):
            state.load_state_dict(saved)
    finally:
        state.close()  # CPU buckets: no comm thread; its communicator goes with the group
        dist.destroy_process_group()


def test_cfc_hook_refuses_a_state_that_is_not_a_cfc_state(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        ddp = DDP(nn.Linear(8, 8))
        ddp.register_comm_hook({}, cfc_hook)
        with pytest.raises(RuntimeError, match="must be a cfc.CfcState"):
            ddp(torch.randn(4, 8)).sum().backward()
    finally:
        dist.destroy_process_group()
