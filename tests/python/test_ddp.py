"""cfc_hook in real DistributedDataParallel training, through cfc's engine: 2 processes with
gloo on CPU buckets (in CI); NCCL on CUDA buckets (``-m gpu``, one GPU per rank); and 3
processes sharing one GPU over gloo (``-m gpu``, any GPU). conftest.py says where each kind of
run places its ranks."""

import copy
import io
import math
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cfc
from cfc import CfcState, cfc_hook
from conftest import close_cfc_states, enough_gpus, run_scenario, spawn_scenario, world_of


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


def batch(rank, step, n=64):
    """A fixed teacher task, different data on every rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 64, generator=g)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(64, 10, generator=teacher)
    return x.to(DEV), (x @ w + 0.3 * torch.randn(n, 10, generator=g)).argmax(1).to(DEV)


def make(hook_state=None, dtype=torch.float32, **ddp_kw):
    """The test model under DDP, with ``hook_state``'s cfc_hook registered."""
    torch.manual_seed(0)
    model = Net(unused=ddp_kw.get("find_unused_parameters", False)).to(dtype).to(DEV)
    ddp = DDP(model, bucket_cap_mb=0.1, **ddp_kw)
    if hook_state is not None:
        ddp.register_comm_hook(hook_state, cfc_hook)
    # Adam's default eps underflows in float16, with or without cfc
    opt = torch.optim.Adam(ddp.parameters(), lr=2e-3, eps=1e-8 if dtype == torch.float32 else 1e-4)
    return ddp, opt


def step_loss(ddp, rank, step, dtype=torch.float32):
    x, y = batch(rank, step)
    return nn.functional.cross_entropy(ddp(x.to(dtype)).float(), y)


def train(ddp, opt, rank, steps, start=0, dtype=torch.float32):
    losses = []
    for step in range(start, start + steps):
        loss = step_loss(ddp, rank, step, dtype)
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


def resume(rank, world, out):
    """Train 8 steps straight, and 4 + save + load + 4: the same parameters, bit for bit; with
    an rms bound (its statistics are in the checkpoint), with block scales (their exponents are)
    and with eps."""
    for kw in (dict(rms=0.3, warmup_steps=1), dict(rms=0.5, block=64, warmup_steps=1),
               dict(eps=2e-4, warmup_steps=1)):
        ddp, opt = make(CfcState(**kw))
        train(ddp, opt, rank, 8)
        straight = [p.detach().clone() for p in ddp.parameters()]

        state = CfcState(**kw)
        ddp, opt = make(state)
        train(ddp, opt, rank, 4)
        saved = {"model": {k: v.clone() for k, v in ddp.state_dict().items()}, "opt": opt.state_dict(),
                 "cfc": state.state_dict()}
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=False)
        assert any(r.abs().max() > 0 for r in saved["cfc"]["residuals"].values())
        state, ddp, opt = resume_from(saved, kw)
        train(ddp, opt, rank, 4, start=4)
        assert all(torch.equal(a, b.detach()) for a, b in zip(straight, ddp.parameters())), kw
        assert state.stats()["residual_resets"] == 0

        # A checkpoint one step after a resume (DDP still on its initial buckets, which the hook
        # ran as the saved ones) records those buckets, and resuming from it is exact too.
        state, ddp, opt = resume_from(saved, kw)
        train(ddp, opt, rank, 1, start=4)
        again = {"model": {k: v.clone() for k, v in ddp.state_dict().items()},
                 "opt": copy.deepcopy(opt.state_dict()), "cfc": state.state_dict()}
        assert again["cfc"]["layouts"] == saved["cfc"]["layouts"]
        state, ddp, opt = resume_from(again, kw)
        train(ddp, opt, rank, 3, start=5)
        assert all(torch.equal(a, b.detach()) for a, b in zip(straight, ddp.parameters())), kw

    # Dropping the residuals and statistics on resume (as some libraries do) changes the
    # result: the test above can fail.
    state = CfcState(**kw)
    ddp, opt = make(state)
    ddp.load_state_dict(saved["model"])
    opt.load_state_dict(copy.deepcopy(saved["opt"]))
    state.step = saved["cfc"]["step"]
    train(ddp, opt, rank, 4, start=4)
    assert not all(torch.equal(a, b.detach()) for a, b in zip(straight, ddp.parameters()))

    # Another rank's state, or other options, are refused; so are residuals that are not a
    # saved state's; ones of other sizes (another model's) restart at zero, counted.
    other = dict(saved["cfc"], rank=(rank + 1) % world)
    with pytest.raises(ValueError, match="each rank loads its own"):
        CfcState(**kw).load_state_dict(other)
    with pytest.raises(ValueError, match="'bound': 0.001"):
        CfcState(eps=1e-3, warmup_steps=1).load_state_dict(saved["cfc"])
    with pytest.raises(ValueError, match="1-D float32"):
        CfcState(**kw).load_state_dict(dict(saved["cfc"], residuals={0: [0.0]}))
    short = {o: r[:-1] for o, r in saved["cfc"]["residuals"].items()}
    state, ddp, opt = resume_from(dict(saved, cfc=dict(saved["cfc"], residuals=short)), kw)
    train(ddp, opt, rank, 1, start=4)
    assert state.stats()["residual_resets"] == len(short), state.stats()
    # Ranks that load states of different steps all raise at the next step's first bucket.
    state, ddp, opt = resume_from(saved if rank == 0 else again, kw)
    with pytest.raises(Exception, match="token") as failed:
        step_loss(ddp, rank, 5).backward()
    assert "CfcError" in str(failed.value), failed.value


def overflow(rank, world, out):
    """An inf on one rank reaches every rank, so GradScaler skips the step everywhere."""
    state = CfcState(warmup_steps=0, min_compress_numel=0)
    ddp, opt = make(state)
    scaler = torch.amp.GradScaler(DEV.type, init_scale=1024.0)
    before = [p.detach().clone() for p in ddp.parameters()]
    loss = step_loss(ddp, rank, 0)
    if rank == 1:
        loss = loss * math.inf
    scaler.scale(loss).backward()
    for p in ddp.parameters():
        assert not torch.isfinite(p.grad).all(), "the overflow did not reach this rank"
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, ddp.parameters()))
    assert state.stats()["compressed_buckets"] > 0
    assert scaler.get_scale() == 512.0
    opt.zero_grad()
    scaler.scale(step_loss(ddp, rank, 1)).backward()  # the next, finite, step goes through
    for p in ddp.parameters():
        assert torch.isfinite(p.grad).all()


def accumulate(rank, world, out):
    """no_sync() accumulation, then one synced step: within eps of plain all-reduce."""
    eps = 1e-4
    grads = []
    for state in (None, CfcState(eps=eps, warmup_steps=0, min_compress_numel=0)):
        ddp, _ = make(state)
        with ddp.no_sync():
            step_loss(ddp, rank, 0).backward()
        step_loss(ddp, rank, 1).backward()
        grads.append([p.grad.clone() for p in ddp.parameters()])
    for plain, comp in zip(*grads):
        err = (plain.double() - comp.double()).abs().max().item()
        assert err <= eps * (1 + 1e-3) + 1e-7 * plain.abs().max().item(), err
        assert err > 0 or plain.abs().max() == 0  # it really was compressed


def variants(rank, world, out):
    """gradient_as_bucket_view, static_graph, find_unused_parameters, bf16 and fp16 gradients,
    and both algorithms."""
    cases = [
        ({"gradient_as_bucket_view": True}, torch.float32, None),
        ({"static_graph": True}, torch.float32, None),
        ({"find_unused_parameters": True}, torch.float32, None),
        ({}, torch.bfloat16, None),
        ({}, torch.float16, None),
        ({}, torch.float32, "all-gather"),
        ({}, torch.float32, "reduce-scatter"),
    ]
    for kw, dtype, algorithm in cases:
        state = CfcState(warmup_steps=1, min_compress_numel=0, algorithm=algorithm)
        ddp, opt = make(state, dtype=dtype, **kw)
        losses = train(ddp, opt, rank, 6, dtype=dtype)
        assert all(math.isfinite(l) for l in losses), (kw, dtype, losses)
        assert losses[-1] < losses[0], (kw, dtype, losses)
        for p in ddp.parameters():
            assert same_on_all_ranks(p.detach()), (kw, dtype)
        s = state.stats()
        # (bfloat16 and float16 buckets start from half the bytes, and at the default bound
        # (rms=0.05) some of their values, where the dtype's spacing is coarser than the bound,
        # travel as exceptions: up to 1.3% on the real gradient slices, benches/code_entropy.py)
        least = 4 / world if dtype == torch.float32 else 3 / world
        assert s["compressed_buckets"] > 0 and s["ratio"] > least, (kw, dtype, s)
        # (in bf16/fp16 the error sent includes rounding the compensated value to the dtype,
        # relative to the value, not to eps)
        slack = 1 + 1e-6 if dtype == torch.float32 else 2
        assert 0 < s["max_error"] <= s["eps"] * slack, (kw, dtype, s)


def mismatch(rank, world, out):
    """Ranks with different options all raise, naming both, before any bucket moves."""
    ddp, _ = make(CfcState(rms=0.3 if rank == 0 else 0.1, warmup_steps=0))
    t0 = time.monotonic()
    with pytest.raises(Exception, match="rms=3e-1.*rms=1e-1") as failed:
        step_loss(ddp, rank, 0).backward()
    # DDP names the error's type (a future set with set_exception reads "Unable to cast ...").
    assert "Unable to cast" not in str(failed.value) and "CfcError" in str(failed.value), failed.value
    assert time.monotonic() - t0 < 30


def close(rank, world, out):
    """close() lets the engine go; the state still reports, and the hook refuses further
    buckets with a clear error."""
    state = CfcState(warmup_steps=1, min_compress_numel=0)
    ddp, opt = make(state)
    train(ddp, opt, rank, 3)
    assert state._engine is not None
    state.close()
    assert state._engine is None
    s = state.stats()
    assert s["step"] == 3 and s["compressed_buckets"] > 0, s
    assert state.state_dict()["step"] == 3
    state.close()  # again: nothing to do
    with pytest.raises(Exception, match="this CfcState was closed") as failed:
        step_loss(ddp, rank, 3).backward()
    assert "Unable to cast" not in str(failed.value) and "CfcError" in str(failed.value), failed.value


def _fails_everywhere(ddp, rank, step, culprit, what):
    """backward() raises on every rank, naming the rank where the failure began (the rank
    itself raises its own error), at once."""
    t0 = time.monotonic()
    with pytest.raises(Exception) as failed:
        step_loss(ddp, rank, step).backward()
    message = str(failed.value)
    assert what in message, message
    if culprit is not None and rank != culprit:
        assert f"rank {culprit}" in message, message
    assert "Unable to cast" not in message
    assert time.monotonic() - t0 < 20, "a rank waited for a timeout"


def failures(rank, world, out):
    """A failure on one rank, of each kind, at a step in the middle of training: every rank's
    backward() raises within seconds, naming that rank; the next step raises at once."""
    kinds = ["hook", "corrupt", "alloc", "device"]
    for kind in kinds:
        state = CfcState(warmup_steps=1, min_compress_numel=0, timeout=120)
        ddp, opt = make(state)
        train(ddp, opt, rank, 2)
        culprit = world - 1
        if rank == culprit:
            if kind == "hook":
                real = state._residuals.get
                calls = []

                def get(*a, **kw):
                    calls.append(1)
                    if len(calls) == 2:
                        raise RuntimeError("raised in the hook")
                    return real(*a, **kw)

                state._residuals.get = get
            else:
                state._engine.inject(kind)
        what = {"hook": "raised in the hook", "corrupt": "frame", "alloc": "could not allocate",
                "device": "injected device failure"}[kind]
        # (a corrupt frame is found by the ranks that decode it: each reports what it received)
        _fails_everywhere(ddp, rank, 2, culprit if kind != "corrupt" else None, what)
        t0 = time.monotonic()
        with pytest.raises(Exception, match="CfcError"):
            step_loss(ddp, rank, 3).backward()
        assert time.monotonic() - t0 < 5
        state.close()  # (the failure was raised already: closing does not raise it again)


def rank_dies(rank, world, out):
    """A rank whose process ends in the middle of a step (no close, no goodbye): the others'
    backward() raises within seconds, naming it, over every transport."""
    state = CfcState(warmup_steps=1, min_compress_numel=0, timeout=300)
    ddp, opt = make(state)
    train(ddp, opt, rank, 2)
    if rank == world - 1:

        def die(*a, **kw):
            os._exit(0)  # the process is gone, its links close without a goodbye

        state._residuals.get = die
        step_loss(ddp, rank, 2).backward()
    t0 = time.monotonic()
    with pytest.raises(Exception, match=f"rank {world - 1}"):
        step_loss(ddp, rank, 2).backward()
    assert time.monotonic() - t0 < 30, "waited for the timeout"
    out.put({"rank": rank, "seconds": time.monotonic() - t0})
    out.close()
    out.join_thread()
    os._exit(0)  # (the process group lost a rank: skip its teardown)


def fallback(rank, world, out):
    """fallback="auto": plain in the warm-up, the trial alternates, then every rank keeps the
    way its slowest rank found faster, the same on every rank; fallback="always" never
    compresses (and trains like plain all-reduce)."""
    state = CfcState(warmup_steps=1, min_compress_numel=0, fallback="auto", trial_steps=2)
    ddp, opt = make(state)
    plan = []
    for step in range(5):
        before = state.stats()
        train(ddp, opt, rank, 1, start=step)
        after = state.stats()
        plan.append((after["compressed_buckets"] - before["compressed_buckets"],
                     after["plain_buckets"] - before["plain_buckets"]))
    n = sum(plan[1])  # (DDP's first step runs its initial buckets, then rebuilds them)
    assert plan[0][0] == 0 and plan[1] == (0, n) and plan[2] == (n, 0), plan
    assert all(sum(p) == n for p in plan[3:]), plan
    decisions = [b["decision"] for b in state._engine.state()["buckets"]]
    assert all(d is not None for d in decisions), decisions
    everyone = [None] * world
    dist.all_gather_object(everyone, decisions)
    assert all(d == decisions for d in everyone)

    state = CfcState(fallback="always", warmup_steps=0, min_compress_numel=0)
    ddp, opt = make(state)
    train(ddp, opt, rank, 3)
    s = state.stats()
    assert s["compressed_buckets"] == 0 and s["plain_buckets"] > 0 and s["ratio"] == 1.0, s


def register(rank, world, out):
    """register_comm_hook: DDP's group by default; another group is refused; with "auto" on
    CPU parameters the hook is registered directly (its own trial decides per bucket)."""
    state = CfcState(warmup_steps=0, min_compress_numel=0)
    torch.manual_seed(0)
    ddp = DDP(Net().to(DEV), bucket_cap_mb=0.1)
    assert cfc.register_comm_hook(ddp, state) is True
    assert state.process_group is ddp.process_group
    with pytest.raises(ValueError, match="already serves another DDP model"):
        cfc.register_comm_hook(DDP(Net().to(DEV)), state)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    train(ddp, opt, rank, 2)
    assert state.stats()["compressed_buckets"] > 0
    if DEV.type == "cuda" and dist.get_backend() == "nccl":
        # over NVLink or PCIe between the ranks' GPUs the probe finds plain faster or not:
        # either way it says what it measured
        probe_state = CfcState(fallback="auto")
        registered = cfc.register_comm_hook(DDP(Net().to(DEV)), probe_state)
        assert probe_state.probe["registered"] == registered
        assert probe_state.probe["plain_seconds"] > 0 and probe_state.probe["compressed_seconds"] > 0


def other_grads(rank, world, out):
    """float64 buckets and sparse gradients (gloo) are all-reduced plainly beside compressed
    ones, and the model trains alike on every rank."""
    torch.manual_seed(0)

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = nn.Linear(64, 512)
            self.f64 = nn.Linear(512, 10).double()
            self.emb = nn.Embedding(100, 8, sparse=dist.get_backend() == "gloo")

        def forward(self, x, ids):
            return self.f64(self.dense(x).double()).float().sum(1) + self.emb(ids).sum(1)

    model = Mixed().to(DEV)
    ddp = DDP(model, bucket_cap_mb=0.05)
    state = CfcState(warmup_steps=0, min_compress_numel=0)
    ddp.register_comm_hook(state, cfc_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(3):
        x, _ = batch(rank, step)
        ids = (torch.arange(64, device=DEV) + rank) % 100
        ddp(x, ids).sum().backward()
        opt.step()
        opt.zero_grad()
    for p in ddp.parameters():
        assert same_on_all_ranks(p.detach())
    s = state.stats()
    assert s["compressed_buckets"] > 0, s


SCENARIOS = {
    f.__name__: f
    for f in (parity, resume, overflow, accumulate, variants, mismatch, close, failures, rank_dies, fallback,
              register, other_grads)
}


def spawn(tmp_path, scenario, world=None, device="cpu"):
    return spawn_scenario(tmp_path, "test_ddp", scenario, world or world_of(device), device)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("shared-gpu", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_training_parity_with_fewer_bytes(tmp_path, device):
    enough_gpus(device)
    r = spawn(tmp_path, "parity", device=device)
    s = r["stats"]
    assert r["cfc"] < 0.5 * r["first"], r  # it learned
    assert abs(r["cfc"] - r["plain"]) <= 0.02 * r["plain"], r
    # the reduce-scatter from 3 ranks sends about 2 compressed buckets per rank; the all-gather
    # of 2 ranks one; a ring all-reduce 2 (n - 1) / n plain ones. At the default bound
    # (rms=0.05) this model's buckets compress about 4.6x.
    assert s["ratio"] >= 4, s
    assert 0 < s["max_error"] <= s["eps"] * (1 + 1e-6), s


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "scenario",
    ["resume", "overflow", "accumulate", "variants", "mismatch", "close", "failures", "fallback", "register",
     "other_grads"],
)
def test_hook(tmp_path, scenario, device):
    enough_gpus(device)
    spawn(tmp_path, scenario, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_three_ranks_take_the_reduce_scatter(tmp_path, device):
    enough_gpus(device)
    if device == "cuda" and world_of(device) < 3:
        pytest.skip("needs 3 GPUs")
    for scenario in ("variants", "failures"):
        (tmp_path / scenario).mkdir()
        spawn(tmp_path / scenario, scenario, world=3, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_a_rank_that_dies_fails_the_others_within_seconds(tmp_path, device):
    enough_gpus(device)
    world = world_of(device)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=run_scenario, args=(r, world, str(tmp_path / "init"), "test_ddp", "rank_dies", out,
                                                    device))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0, p.exitcode
    seen = [out.get(timeout=5) for _ in range(world - 1)]
    assert all(s["seconds"] < 30 for s in seen), seen


def test_a_script_that_never_closes_its_state_exits_at_once(tmp_path):
    """torchrun of a script that trains with cfc_hook and returns without close(): both
    processes exit with 0, quickly (no abort at interpreter exit, no wait for a timeout)."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, torch.distributed as dist, torch.nn as nn\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "import cfc\n"
        "dist.init_process_group('gloo')\n"
        "torch.manual_seed(0)\n"
        "ddp = DDP(nn.Linear(256, 256))\n"
        "ddp.register_comm_hook(cfc.CfcState(warmup_steps=0, min_compress_numel=0), cfc.cfc_hook)\n"
        "for _ in range(3):\n"
        "    ddp(torch.randn(8, 256)).sum().backward()\n"
        "print('trained', flush=True)\n"
    )
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("trained") == 2
    assert "terminate called" not in r.stderr and "Aborted" not in r.stderr, r.stderr[-3000:]
    assert time.monotonic() - t0 < 60


def test_tensors_stay_alive_while_the_engine_may_still_use_them():
    """After a wait that ran out of time the engine may still be at work on the step's tensors:
    the state keeps them until a later wait finds the engine settled."""

    class Engine:
        busy = True

        def settled(self):
            return not self.busy

    state = CfcState()
    state._engine = Engine()
    first = [torch.zeros(4)]
    state._keep = list(first)
    state._let_go()
    assert state._keep == [] and state._held == first  # still in use: kept
    second = [torch.ones(4)]
    state._keep = list(second)
    state._let_go()
    assert state._held == first + second
    state._engine.busy = False
    state._let_go()
    assert state._held == [] and state._keep == []  # settled: let go
    state._engine = None


def test_state_options_are_checked():
    early = CfcState(eps=1e-3)  # before the process group, as Lightning makes it
    assert early.bound_kind == "eps" and early.bound == 1e-3 and early.rank == -1
    assert CfcState().options.bound_kind == "rms" and CfcState().bound == 0.05
    for bad, match in [
        (dict(eps=1e-3, rms=0.3), "at most one"),
        (dict(rel=1.0), "below 1"),
        (dict(eps=-1.0), "positive"),
        (dict(eps=1e-320), "between"),
        (dict(warmup_steps=-1), ">= 0"),
        (dict(fallback="sometimes"), "fallback"),
        (dict(fallback="auto", trial_steps=3), "even"),
        (dict(algorithm="ring"), "algorithm"),
        (dict(timeout=0), "positive"),
        (dict(eps=1e-3, block=256), "rms= below 1"),
        (dict(rms=0.3, block=100), "power of two"),
        (dict(rms=0.3, block=16), "power of two"),
    ]:
        with pytest.raises(ValueError, match=match):
            CfcState(**bad)
    # the limits are the core's: the largest eps a state takes, the codec takes, and no more
    import math

    from cfc.ddp.options import BLOCK_RANGE, EPS_MAX, EPS_MIN

    x = torch.randn(100)
    for eps in (EPS_MIN, EPS_MAX):
        CfcState(eps=eps)
        cfc.compress(x, eps=eps)
    for eps in (EPS_MIN / 2, math.nextafter(EPS_MAX, math.inf)):
        with pytest.raises(ValueError, match="between"):
            CfcState(eps=eps)
        with pytest.raises(Exception, match="usable range"):
            cfc.compress(x, eps=eps)
    assert BLOCK_RANGE == (32, 1 << 24) and CfcState(rms=0.3, block=1 << 24).block == 1 << 24
    assert CfcState(rms=0.3, block=256).block == 256 and "block=256" in repr(CfcState(rms=0.3, block=256))
    # block scales change the values: a checkpoint records them
    assert CfcState(rms=0.3, block=256).options.saved()["block"] == 256
    with pytest.raises(TypeError):
        CfcState(error_feedback="yes")
    assert CfcState(fallback=False).fallback == "never"
    # The options pickle; the engine and the process group do not.
    import pickle

    again = pickle.loads(pickle.dumps(CfcState(eps=1e-3, fallback="auto")))
    assert again.options == CfcState(eps=1e-3, fallback="auto").options and again._engine is None


def test_cfc_hook_refuses_a_state_that_is_not_a_cfc_state(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        ddp = DDP(nn.Linear(4, 4))
        ddp.register_comm_hook({"not": "a state"}, cfc_hook)
        with pytest.raises(Exception, match="cfc.CfcState"):
            ddp(torch.randn(2, 4)).sum().backward()
    finally:
        dist.destroy_process_group()


def test_a_state_dict_that_is_not_one_is_refused_and_changes_nothing(tmp_path):
    """load_state_dict checks every field before it changes anything."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        state = CfcState(eps=1e-3, warmup_steps=1, min_compress_numel=0)
        ddp = DDP(model)
        assert cfc.register_comm_hook(ddp, state)
        for _ in range(3):
            ddp(torch.randn(8, 64)).sum().backward()
        good = state.state_dict()
        before = (state.step, {k: v.clone() for k, v in good["residuals"].items()})
        bad = [
            ({}, "another version"),
            (dict(good, version=3), "another version"),
            (dict(good, step=-1), "step"),
            (dict(good, serves="nonsense"), "serves 'nonsense'"),
            (dict(good, residuals={0: torch.tensor([math.nan])}), "NaN"),
            (dict(good, residuals={0: torch.zeros(4).to_sparse()}), "dense"),
            (dict(good, layouts={"a": [1]}), "bucket index"),
            (dict(good, engine={"step": 1, "origin": 0, "buckets": [{"key": 0}]}), "fingerprint"),
            (dict(good, engine=dict(good["engine"], origin=good["engine"]["step"] + 1)), "past its step"),
            (dict(good, engine=dict(good["engine"], buckets=[dict(b, decision="yes") for b in good["engine"]["buckets"]]
                                    or [{"key": 0, "fingerprint": 1, "numel": 1, "decision": "yes"}])), "decision"),
            # the engine's part, read by the core (python/src/engine_state.rs)
            (dict(good, engine={"step": 1, "origin": 0}), "no buckets"),
            (dict(good, engine={"step": 1, "origin": 0, "buckets": [{"key": True, "fingerprint": 1, "numel": 1}]}),
             "bucket key"),
            (dict(good, engine={"step": 1, "origin": 0, "buckets": [{"key": 0, "fingerprint": 1, "numel": 1,
                                                                     "exponents": b"\x03\xff"}]}), "exponents"),
            (dict(good, engine={"step": 1, "origin": 0, "buckets": [{"key": 0, "fingerprint": 1, "numel": 1,
                                                                     "stats": [1.0]}]}), "statistics"),
            (dict(good, engine={"step": 1, "origin": 0, "buckets": [{"key": 0, "fingerprint": 1, "numel": 1,
                                                                     "trial_plain": ["0.1"]}]}), "trial time"),
            (dict(good, engine={"step": 1, "origin": 0, "buckets": [], "levels": [2, 2, 2]}), "levels"),
            (dict(good, engine=[1, 2]), "engine"),
        ]
        for sd, match in bad:
            with pytest.raises(ValueError, match=match):
                state.load_state_dict(sd)
        assert state.step == before[0]
        after = state.state_dict()
        assert all(torch.equal(after["residuals"][k], v) for k, v in before[1].items())
        state.load_state_dict(good)  # and the good one loads
        # A state says which entry point it serves, and serves only that one: a checkpoint of
        # cfc_hook's state is refused by AllReducer's, and a state that loaded it serves cfc_hook.
        assert good["serves"] == "cfc_hook"
        reducer = cfc.distributed.AllReducer(CfcState(eps=1e-3, warmup_steps=1, min_compress_numel=0))
        with pytest.raises(ValueError, match="served cfc_hook; this CfcState serves AllReducer"):
            reducer.state.load_state_dict(good)
        fresh = CfcState(eps=1e-3, warmup_steps=1, min_compress_numel=0)
        fresh.load_state_dict(good)
        with pytest.raises(ValueError, match="serves cfc_hook: give AllReducer a CfcState of its own"):
            cfc.distributed.AllReducer(fresh)
        with pytest.raises(ValueError, match="serves cfc_hook: give AllReducer"):
            cfc.distributed.AllReducer(state)
        fresh.load_state_dict({k: v for k, v in good.items() if k != "serves"})  # (saved before it was recorded)
        reducer.close()
        fresh.close()
        # a state saved before block scales existed (no "block" among its options) loads too,
        # and one saved with other block scales does not
        older = dict(good, options={k: v for k, v in good["options"].items() if k != "block"})
        state.load_state_dict(older)
        # as does one with a "scales" field (per-parameter factors agreed a step ahead, which
        # cfc.fsdp does not keep: the engine's block scales serve that purpose): it is ignored
        state.load_state_dict(dict(good, scales={0: [2, [3, 4], [0.5, 2.0]]}))
        with pytest.raises(ValueError, match="saved with"):
            state.load_state_dict(dict(good, options=dict(good["options"], block=256)))
    finally:
        close_cfc_states()
        dist.destroy_process_group()


def test_training_example_reruns_bit_for_bit_and_scores_held_out_bytes(tmp_path):
    """examples/ddp_train.py with --deterministic: two runs of plain all-reduce give the same
    losses bit for bit (so a gap between hooks is the hooks' own); cfc@X sets the bound; the
    held-out loss is scored every --eval-every steps and at the end."""
    import json

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


def test_a_state_says_its_options_and_log_every_shows_without_logging_setup(capsys, caplog, monkeypatch):
    import logging

    state = CfcState(rms=0.1, log_every=5)
    assert repr(state).startswith("CfcState(rms=0.1, error_feedback=True, warmup_steps=2"), repr(state)
    assert "not bound to a group yet" in repr(state)
    counters = {"ratio": 5.0, "bytes_sent": 2e6, "bytes_uncompressed": 1e7, "compressed_buckets": 8,
                "plain_buckets": 2, "max_error": 0.01, "eps": 0.02}
    monkeypatch.setattr(state, "stats", lambda: counters)
    state.rank, state.world, state.step = 0, 2, 5
    cfc_logger = logging.getLogger("cfc")
    monkeypatch.setattr(cfc_logger, "hasHandlers", lambda: False)  # (pytest's own capture handler)
    state._log_stats()
    line = capsys.readouterr().err
    assert line.startswith("cfc step 5: 5.00x fewer bytes") and "2.0 MB sent" in line, line
    state.rank = 1  # other ranks stay quiet without logging set up
    state._log_stats()
    assert capsys.readouterr().err == ""
    monkeypatch.undo()
    monkeypatch.setattr(state, "stats", lambda: counters)
    with caplog.at_level(logging.INFO, logger="cfc"):
        state._log_stats()
    assert "cfc step 5" in caplog.text and capsys.readouterr().err == ""
