"""DDP step time of a 217M-parameter transformer LM with PyTorch's built-in hooks and cfc_hook.

The configuration of ``../shared/docs/ANCHORS.md`` (d=1024, 12 layers, vocab 32000, T=256,
batch 8 per GPU, bf16 autocast, AdamW). ``noop`` (no communication) is the floor; each hook is
reported as its median step time and as a ratio to noop's. ``allreduce`` is DDP's built-in
all-reduce (no hook); ``allreduce-py`` is the same all-reduce as a Python comm hook (PyTorch's
``allreduce_hook``), which shows what running any Python hook costs.

Step times of one machine drift by tens of percent over a minute (the steps of this model are
bound by the host's kernel launches), so by default every hook's model is built first and the
hooks then take turns: ``--rounds`` rounds of ``--block`` steps each, in a new random order
every round. A hook named twice gets two models: an A/A comparison that shows the noise. The table gives each hook's median over rounds, the middle half of its rounds,
and its time over ``--base``'s (default ``allreduce``) in the same round, as a median over
rounds. ``--sequential`` times one hook after the other instead, step by step. Run under
torchrun with one GPU per process::

    torchrun --standalone --nproc_per_node=2 benches/ddp_step_time.py --steps 50

For the socket transport, set NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1
NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo. ``--json FILE`` writes the per-step times.
"""

import argparse
import contextlib
import faulthandler
import functools
import json
import os
import random
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import cfc

D, LAYERS, VOCAB, T, B = 1024, 12, 32000, 256, 8
BATCH = [B]  # --batch: fewer sequences give the GPU less work per step for the same launches


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, 16, 4 * D, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, t):
        return self.head(self.blocks(self.emb(t)))


class _Clock:
    """When DDP last called the registered Python hook, and the time the calling thread (the
    autograd thread) spent in it since ``in_hook`` was last reset (host clock,
    ``time.perf_counter``). With ``calls`` (a :class:`_HookCalls`), also what the hook called.
    ``first`` and ``last`` are the host clock and the calling thread's CPU time
    (``time.thread_time``) at the step's first and last call: a thread that ran the whole time
    between them used as much CPU time as wall time; one that slept while it waited (on a lock,
    say) used less."""

    def __init__(self, calls=None):
        self.last_hook = None
        self.in_hook = 0.0
        self.calls = calls
        self.first = self.last = None

    def wrap(self, hook):
        @functools.wraps(hook)
        def timed(state, bucket):
            t = self.last_hook = time.perf_counter()
            self.last = (t, time.thread_time())
            if self.first is None:
                self.first = self.last
            if self.calls is not None:
                self.calls.stack.clear()  # (setting the profile to None below opens a call never closed)
                sys.setprofile(self.calls)  # this thread only
            try:
                return hook(state, bucket)
            finally:
                if self.calls is not None:
                    sys.setprofile(None)
                self.in_hook += time.perf_counter() - t

        return timed


class _HookCalls:
    """Wall time of every function the hook calls, Python's and C's (torch's bindings, cfc's
    native calls), inclusive, on the thread that calls the hook (``sys.setprofile``): where the
    autograd thread's time in the hook goes. A C call that lets go of the GIL (most of torch's)
    also counts the wait to get it back while another thread (cfc's comm thread) holds it. The
    profile function slows the Python calls; the C calls' own times are what to read."""

    def __init__(self):
        self.total, self.count, self.stack = {}, {}, []

    def reset(self):
        self.total.clear()
        self.count.clear()

    def __call__(self, frame, event, arg):
        if event in ("call", "c_call"):
            self.stack.append(time.perf_counter())
        elif self.stack:  # return, c_return, c_exception
            dt = time.perf_counter() - self.stack.pop()
            if event == "return":
                code = frame.f_code
                name = f"{os.path.basename(code.co_filename)}:{getattr(code, 'co_qualname', code.co_name)}"
            else:
                qual = getattr(arg, "__qualname__", None) or getattr(arg, "__name__", repr(arg))
                if qual.startswith("pybind11_detail"):  # a pybind11 method: its record's type, then the name
                    qual = "pybind11." + qual.rsplit(".", 1)[-1]
                owner = type(getattr(arg, "__self__", None)).__name__
                if "." not in qual and not owner.startswith(("pybind11", "module", "NoneType")):
                    qual = f"{owner}.{qual}"  # a method: name its class
                name = f"[C] {qual}"
            self.total[name] = self.total.get(name, 0.0) + dt
            self.count[name] = self.count.get(name, 0) + 1

    def table(self, steps, top):
        rows = sorted(self.total.items(), key=lambda kv: -kv[1])[:top]
        out = ["| call | calls per step | us per call | ms per step |", "|---|---|---|---|"]
        for name, t in rows:
            n = self.count[name]
            out.append(f"| `{name}` | {n / steps:.1f} | {1e6 * t / n:.1f} | {1e3 * t / steps:.3f} |")
        return "\n".join(out)


def register(ddp, name, clock=None):
    """Register hook ``name`` on ``ddp``; with ``clock`` (a :class:`_Clock`, or anything with its
    ``wrap``), wrapped so that it notes each call."""
    state = None
    if clock is not None:
        ddp = _Wrapping(ddp, clock)
    if name in ("noop", "noop-sync") or name.startswith("noop+spin"):
        # noop-sync: Runner.step waits for the GPU after backward(); noop+spinN: N processes
        # busy-loop on the host during its steps (Runner.timed), as threads that spin would
        ddp.register_comm_hook(None, debugging_hooks.noop_hook)
    elif name.startswith("noop+gpu"):
        # noop+gpuN: noop, and per bucket N copies of the bucket on a stream of its own (each
        # reads and writes the bucket's bytes, as cfc's kernels pass over them), which the
        # step's last bucket waits for: what GPU work beside the backward pass costs the step
        ddp.register_comm_hook(None, _gpu_load_hook(int(name[len("noop+gpu"):] or 1)))
    elif name.startswith(("noop+calls", "noop+queries")):
        # noop+callsN: noop, and per bucket N tiny CUDA calls made by a thread of their own:
        # what another thread's driver calls cost the autograd thread; noop+queriesN: N queries
        # of a stream's state instead (what a thread that polls makes), which submit nothing
        kind = "calls" if name.startswith("noop+calls") else "queries"
        ddp.register_comm_hook(None, _side_calls_hook(int(name[len("noop+") + len(kind):] or 1), kind))
    elif name == "allreduce-py":
        # PyTorch's all-reduce as a Python comm hook: what any Python hook costs, against
        # "allreduce" (DDP's built-in all-reduce, no hook)
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif name == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif name.startswith("powersgd"):
        st = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=int(name[8:]), start_powerSGD_iter=2,
            use_error_feedback=True, warm_start=True,
        )
        ddp.register_comm_hook(st, powerSGD_hook.powerSGD_hook)
    elif name.startswith("cfc"):
        # cfc; cfc-auto: fallback="auto" through cfc.register_comm_hook (which keeps DDP's
        # built-in all-reduce where its probe finds compression does not pay); cfc-auto-hook:
        # fallback="auto" with the hook always registered (its per-bucket choice only);
        # cfc@0.1: rms=0.1 (without @X: rms=0.3, as the step times in docs/performance.md;
        # CfcState's own default is 0.05); cfc-ag / cfc-rs: the all-gather or the reduce-scatter (default:
        # cfc's choice); cfc-...-plain: no bucket compressed (every one NCCL's average through
        # cfc's engine: its thread and collectives without the codec); any hook:capN sets
        # bucket_cap_mb; cfc-flat / cfc-2l: topology "flat" or "two-level" (default "auto");
        # cfc-rice: coder "rice" (default "planes"); cfc-bK: block scales of K values (block=K)
        rms = float(name.split("@")[1].split(":")[0]) if "@" in name else 0.3
        block = next((int(p[1:]) for p in name.split("@")[0].split("-") if p[:1] == "b" and p[1:].isdigit()), 0)
        algorithm = "all-gather" if "-ag" in name else "reduce-scatter" if "-rs" in name else None
        fallback = "always" if "-plain" in name else "auto" if "auto" in name else "never"
        topology = "flat" if "-flat" in name else "two-level" if "-2l" in name else "auto"
        coder = "rice" if "-rice" in name else "planes"
        state = cfc.CfcState(rms=rms, fallback=fallback, algorithm=algorithm, topology=topology, coder=coder,
                             block=block)
        if "auto" in name and "hook" not in name:
            cfc.register_comm_hook(ddp, state)
        else:
            ddp.register_comm_hook(state, cfc.cfc_hook)
    elif name != "allreduce":
        raise SystemExit(f"unknown hook {name}")
    return state


def _gpu_load_hook(passes):
    """noop's future, with ``passes`` copies of each bucket queued on a side stream after it
    (noop+gpuN in :func:`register`); the last bucket's makes the current stream wait for them."""
    side, scratch = torch.cuda.Stream(), {}

    def hook(_, bucket):
        buf, last = bucket.buffer(), bucket.is_last()
        current = torch.cuda.current_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out = scratch.get(buf.numel())
            if out is None:
                out = scratch[buf.numel()] = torch.empty_like(buf)
            for _ in range(passes):
                out.copy_(buf)
        if last:
            current.wait_stream(side)
        return debugging_hooks.noop_hook(None, bucket)

    return hook


def _side_calls_hook(calls, kind="calls"):
    """noop's future, and per bucket ``calls`` asynchronous 4-byte memsets queued on a stream of
    their own by a thread of their own, straight through the CUDA driver (ctypes, which lets go
    of the GIL during each call) (noop+callsN in :func:`register`): what another thread's CUDA
    calls cost the autograd thread, apart from any work the GPU does on them (a 4-byte memset
    is next to none). noop+calls0 is the hand-over to that thread alone. With ``kind``
    "queries", ``cuStreamQuery`` of that stream instead (noop+queriesN): calls that submit
    nothing, as a thread's polls of its work are."""
    import ctypes
    import queue

    driver = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    if driver.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
        raise SystemExit(f"noop+{kind}: no current CUDA context")
    memset, query = driver.cuMemsetD8Async, driver.cuStreamQuery
    memset.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p]
    query.argtypes = [ctypes.c_void_p]
    side = torch.cuda.Stream()
    target = torch.zeros(16, dtype=torch.uint8, device="cuda")
    todo, failed = queue.SimpleQueue(), []

    def serve():
        driver.cuCtxSetCurrent(ctx)
        ptr, stream = target.data_ptr(), ctypes.c_void_p(side.cuda_stream)
        while True:
            todo.get()
            for _ in range(calls):
                rc = memset(ptr, 0, 4, stream) if kind == "calls" else query(stream)
                # (cuStreamQuery: 600, CUDA_ERROR_NOT_READY, while the stream works)
                if rc not in (0, 600) and not failed:
                    failed.append(rc)

    threading.Thread(target=serve, daemon=True, name=f"noop+{kind}").start()

    def hook(_, bucket):
        if failed:
            raise RuntimeError(f"noop+{kind}: the CUDA driver returned {failed[0]}")
        todo.put(None)
        return debugging_hooks.noop_hook(None, bucket)

    return hook


class _Wrapping:
    """A DDP model whose ``register_comm_hook`` wraps the hook with ``clock.wrap`` (what
    ``cfc.register_comm_hook`` registers is wrapped too)."""

    def __init__(self, ddp, clock):
        self._ddp, self._clock = ddp, clock

    def register_comm_hook(self, state, hook):
        self._ddp.register_comm_hook(state, self._clock.wrap(hook))

    def __getattr__(self, name):
        return getattr(self._ddp, name)


class _Pinning:
    """``+pin`` after a hook's name: during its timed rounds the autograd thread (the thread DDP
    calls the hook on) runs alone on one CPU, and every other thread of the process (the main
    thread, cfc's comm thread, NCCL's threads) on the CPUs left when each rank's autograd CPU is
    taken out. It tells whether the hook's threads slow the backward pass by sharing or
    moving the autograd thread's CPU. ``wrap`` notes the autograd thread's id."""

    def __init__(self, rank, inner=None):
        self.inner, self.tid = inner, None
        cpus = sorted(os.sched_getaffinity(0))
        self.full = set(cpus)
        self.own = {cpus[-1 - rank % 2]}  # rank 0: the last CPU, rank 1: the one before
        self.rest = self.full - set(cpus[-2:])
        if not self.rest:
            raise SystemExit(f"+pin needs at least 3 CPUs; this process may use {len(cpus)}")

    def wrap(self, hook):
        inner = self.inner.wrap(hook) if self.inner is not None else hook

        @functools.wraps(hook)
        def noted(state, bucket):
            self.tid = threading.get_native_id()
            return inner(state, bucket)

        return noted

    def _set(self, pinned: bool) -> None:
        for task in os.listdir("/proc/self/task"):
            tid = int(task)
            try:
                os.sched_setaffinity(tid, (self.own if tid == self.tid else self.rest) if pinned else self.full)
            except OSError:  # a thread that has ended since the listing
                pass

    def __enter__(self):
        self._set(True)

    def __exit__(self, *exc):
        self._set(False)


class Runner:
    """One hook's DDP model, optimizer and batches. ``name`` is a hook, optionally with
    ``:capN`` for DDP buckets of N MB (default 25) and ``+pin`` (:class:`_Pinning`). ``wrap``:
    an object whose ``wrap(hook)`` returns the hook to register (``ddp_trace.py`` marks each
    call for the profiler), instead of ``phases``' clock; ``backward_range``: a context around
    ``loss.backward()`` (the same script's profiler range)."""

    def __init__(self, name, rank, phases=False, wrap=None, calls=False):
        hook, _, cap = name.partition(":cap")
        self.name = name
        pin = hook.endswith("+pin")
        hook = hook.removesuffix("+pin")
        torch.manual_seed(0)
        self.model = LM().cuda()
        self.ddp = DDP(self.model, device_ids=[torch.cuda.current_device()], bucket_cap_mb=float(cap) if cap else None)
        self.clock = _Clock(_HookCalls() if calls else None) if phases or calls else None
        self.sync = hook.endswith("-sync")
        # per step with phases: (last hook call, backward() returned, step end, backward() called),
        # s from the step's start, and the time spent in the hook's calls (s)
        self.phases = []
        self.pinning = _Pinning(rank, wrap or self.clock) if pin else None
        self.state = register(self.ddp, hook, self.pinning or wrap or self.clock)
        self.backward_range = contextlib.nullcontext
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=1e-4)
        self.gen = torch.Generator(device="cuda").manual_seed(rank)
        self.spin, self.spinners = None, []
        if hook.startswith("noop+spin"):
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            self.spin = ctx.Event()
            self.spinners = [ctx.Process(target=_spinner, args=(self.spin,), daemon=True)
                             for _ in range(int(hook[len("noop+spin"):] or 1))]
            for q in self.spinners:
                q.start()

    def step(self):
        t0 = time.perf_counter()
        if self.clock is not None:
            self.clock.in_hook = 0.0
            self.clock.first = None
        t = torch.randint(0, VOCAB, (BATCH[0], T), device="cuda", generator=self.gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(self.ddp(t).flatten(0, 1).float(), t.flatten())
        tb = time.perf_counter()
        with self.backward_range():
            loss.backward()  # returns once DDP has every bucket's future (the host waits for cfc's)
        if self.sync:  # as cfc's last frame sizes make the host wait: for the whole backward pass on the GPU
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.clock is not None and self.clock.last_hook is not None:
            (w0, c0), (w1, c1) = self.clock.first, self.clock.last
            self.phases.append((self.clock.last_hook - t0, t1 - t0, time.perf_counter() - t0, tb - t0,
                                self.clock.in_hook, w1 - w0, c1 - c0))

    def timed(self, steps):
        """Seconds per step of ``steps`` steps run back to back (the GPU may work on one step
        while the host queues the next, as in training), from a synchronized start to the
        last step's end."""
        if self.spin is not None:
            self.spin.set()
        pinned = self.pinning if self.pinning is not None and self.pinning.tid is not None else contextlib.nullcontext()
        try:
            with pinned:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(steps):
                    self.step()
                torch.cuda.synchronize()
                return (time.perf_counter() - t0) / steps
        finally:
            if self.spin is not None:
                self.spin.clear()

    def extra(self):
        if self.state is None:
            return {}
        out = {}
        if self.state.probe is not None:
            out["probe"] = self.state.probe
            if not self.state.probe["registered"]:
                return out  # DDP's own all-reduce: the state saw nothing
        s = self.state.stats()
        keys = ("ratio", "max_error", "eps", "compressed_buckets", "plain_buckets", "resends")
        return {**out, **{k: s[k] for k in keys if k in s}}


def _spinner(event):
    """Busy-loops while ``event`` is set (noop+spinN), sleeps in between."""
    while True:
        event.wait()
        while event.is_set():
            pass


def slowest(times):
    """Each time, as the slowest rank's: a step is as slow as its slowest rank."""
    t = torch.tensor(times, device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def sequential(names, rank, args):
    """Each hook in turn: build it, warm it up, time ``--steps`` steps one by one, free it."""
    rows = []
    for name in names:
        r = Runner(name, rank)
        for _ in range(args.warmup):
            r.step()
        if r.state is not None:
            r.state.reset_stats()
        times = slowest([r.timed(1) for _ in range(args.steps)])
        rows.append({"hook": name, "times": times, **r.extra()})
        del r
        torch.cuda.empty_cache()
        if rank == 0:
            print(f"  {args.label} {name}: median {1e3 * statistics.median(times):.1f} ms {rows[-1]}", flush=True)
    return rows


def interleaved(names, rank, args):
    """Every hook's model at once; then ``--rounds`` rounds, each running every hook for
    ``--block`` steps, in a new random order each round. Drift of the machine
    over the run (clocks, other load on the host) then reaches every hook alike, and the
    hooks' times of one round can be compared pairwise."""
    runners = [Runner(n, rank, args.phases, calls=args.hook_calls > 0) for n in names]
    for r in runners:
        for _ in range(args.warmup):
            r.step()
        if r.state is not None:
            r.state.reset_stats()
        r.phases.clear()
        if r.clock is not None and r.clock.calls is not None:
            r.clock.calls.reset()
    blocks = [[0.0] * args.rounds for _ in runners]
    order = random.Random(0)  # the same on every rank
    for k in range(args.rounds):
        for i in order.sample(range(len(runners)), len(runners)):
            blocks[i][k] = runners[i].timed(args.block)
    rows = []
    for r, times in zip(runners, blocks):
        n = sum(row["hook"].split(" ")[0] == r.name for row in rows)
        row = {"hook": r.name if n == 0 else f"{r.name} ({n + 1})", "times": slowest(times), **r.extra()}
        if r.phases:  # this rank's, medians over steps
            row["phases_ms"] = [1e3 * statistics.median(p[i] for p in r.phases) for i in range(7)]
        if r.phases and r.clock.calls is not None:
            row["hook_calls"] = r.clock.calls.table(len(r.phases), args.hook_calls)
        rows.append(row)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("hooks", nargs="*", default=["noop", "allreduce", "fp16", "bf16", "powersgd4", "cfc", "cfc-auto"])
    p.add_argument("--steps", type=int, default=30, help="timed steps per hook (sequential: one at a time)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--sequential", action="store_true",
                   help="one hook after the other, each timed step by step (default: interleaved rounds)")
    p.add_argument("--rounds", type=int, default=0, help="interleaved rounds (default: steps / block)")
    p.add_argument("--block", type=int, default=5, help="steps per hook and round (interleaved)")
    p.add_argument("--base", default="allreduce", help="the hook the last column compares against, round by round")
    p.add_argument("--label", default=os.environ.get("LABEL", ""))
    p.add_argument("--json", default=None)
    p.add_argument("--watchdog", type=float, default=600, help="seconds the whole run may take (0: no limit)")
    p.add_argument("--phases", action="store_true",
                   help="also time, on rank 0's host clock, when each step's last bucket reached the Python hook "
                        "(the backward pass's pace) and when backward() returned (DDP had every bucket's result); "
                        "interleaved mode, hooks registered from Python only")
    p.add_argument("--hook-calls", type=int, default=0, metavar="N",
                   help="also list the N calls inside the hook that take the autograd thread's most time "
                        "(wall time per step, sys.setprofile on that thread; interleaved mode; implies --phases)")
    p.add_argument("--batch", type=int, default=B,
                   help=f"sequences per step (default {B}, ANCHORS.md's): fewer leave the host's launches the same "
                        "and give the GPU less to do, so that the step waits on the host")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for the run, seconds (Python's default: 0.005): how long a "
                        "thread waiting for the GIL waits before it asks the holder to let go")
    args = p.parse_args()
    args.phases = args.phases or args.hook_calls > 0
    BATCH[0] = args.batch
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    args.rounds = args.rounds or max(1, args.steps // args.block)
    rank = int(os.environ.get("RANK", "0"))
    # (LOCAL_RANK: the GPU; emulated nodes on one host put several ranks on one)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank = dist.get_rank()
    if args.watchdog:  # a hook that hangs prints every thread's stack and ends the run
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    rows = sequential(args.hooks, rank, args) if args.sequential else interleaved(args.hooks, rank, args)
    faulthandler.cancel_dump_traceback_later()
    nparams = sum(p.numel() for p in LM().parameters())
    for r in rows:
        r["median_ms"] = 1e3 * statistics.median(r["times"])
    if rank == 0:
        report(rows, nparams, args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"label": args.label, "mode": "sequential" if args.sequential else "interleaved",
                           "block": None if args.sequential else args.block, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


def report(rows, nparams, args):
    # Every noop run ("noop", "noop (2)", ...): the faster one is the floor.
    noop = [r["median_ms"] for r in rows if r["hook"].split(" ")[0] == "noop"]
    floor = min(noop) if noop else None
    base = next((r for r in rows if r["hook"] == args.base), None)
    if args.sequential:
        how = f"median of {args.steps} steps after {args.warmup}, one hook after the other"
    else:
        how = (f"{args.rounds} interleaved rounds of {args.block} steps per hook after {args.warmup}; "
               f"median over rounds; spread = the middle half of the rounds")
    print(f"\nDDP step time, {nparams / 1e6:.0f}M-parameter LM, {dist.get_world_size()} GPUs, {args.label}: {how}")
    pair = f" x {args.base} (paired) |" if base is not None and not args.sequential else ""
    print(f"| hook | median step | spread | x noop |{pair} ratio (bytes) | max error / largest eps |")
    print("|---|---|---|---|" + ("---|" if pair else "") + "---|---|")
    for r in rows:
        q = statistics.quantiles(r["times"], n=4) if len(r["times"]) > 1 else [r["times"][0]] * 3
        spread = f"{1e3 * q[0]:.1f}-{1e3 * q[2]:.1f} ms"
        x = f"{r['median_ms'] / floor:.2f}x" if floor else "-"
        ratio = f"{r['ratio']:.1f}x" if "ratio" in r else "-"
        if r.get("compressed_buckets") and "resends" in r:
            # (buckets whose frames outgrew their slots: a second round for their tails)
            ratio += f", {r['resends'] / r['compressed_buckets']:.2f} resends per bucket"
        if "probe" in r:  # what cfc.register_comm_hook measured, and chose
            p = r["probe"]
            ratio += (f" (probe: plain {1e3 * p['plain_seconds']:.2f} / cfc {1e3 * p['compressed_seconds']:.2f} ms"
                      f" -> {'cfc_hook' if p['registered'] else 'built-in all-reduce'})")
        err = f"{r['max_error'] / r['eps']:.2f}" if r.get("eps") else "-"
        cols = f"| {r['hook']} | {r['median_ms']:.1f} ms | {spread} | {x} |"
        if pair:
            # the hook's time over the base's in the same round, median over rounds: drift
            # between rounds cancels
            ratios = [a / b for a, b in zip(r["times"], base["times"])]
            cols += f" {statistics.median(ratios):.3f}x |"
        print(f"{cols} {ratio} | {err} |")
    timed = [r for r in rows if "phases_ms" in r]
    if timed:
        print("\nPhases of a step on rank 0's host clock, ms from the step's start, median over steps "
              "(the host runs ahead of the GPU: these are when the host got there)")
        print("| hook | backward() called | last bucket to the hook | backward() returned "
              "| its wait after the last bucket | step end | in the hook (autograd thread, sum) "
              "| first to last bucket: wall | autograd thread's CPU time then |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in timed:
            a, b, c, f, h, w, cpu = r["phases_ms"]
            print(f"| {r['hook']} | {f:.1f} | {a:.1f} | {b:.1f} | {b - a:.1f} | {c:.1f} | {h:.2f} | {w:.1f} "
                  f"| {cpu:.1f} |")
    for r in rows:
        if "hook_calls" in r:
            print(f"\nCalls inside {r['hook']}'s hook on the autograd thread (rank 0, wall time, inclusive; "
                  f"slowed by the profile function)\n{r['hook_calls']}")


if __name__ == "__main__":
    main()
