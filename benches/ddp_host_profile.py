"""Where cfc_hook's host time goes in a DDP step of the 217M LM (``ddp_step_time.py``'s
model): each stage of the comm thread (and the hook itself, on the autograd thread) timed per
thread, summed over a step, and divided by the step's compressed buckets. "waits" are CUDA
event and stream synchronizations (the thread idle until the GPU or the wire got there). Run
under torchrun, one GPU per process, for each bucket size asked for::

    torchrun --standalone --nproc_per_node=2 benches/ddp_host_profile.py --caps 25,10

The timers cost a few microseconds per call, so the step times printed here are a little
slower than ``ddp_step_time.py``'s; they are printed to show what the stages add up to.
``--cprofile N`` also runs cProfile over the comm thread's stages (much slower) and prints the
N functions with the most time of their own, per compressed bucket. (From Python 3.12 cProfile
sees every thread while enabled, so the autograd thread's calls may show up in it too.)
The native exchange's two calls are timed on their own (see ``allreduce_host_profile.py``;
the pipeline, off by default, is not run here). ``--hook-parts`` also times the hook's own
steps on the autograd thread (each timer adds a few microseconds to the hook's time).
"""

import argparse
import cProfile
import functools
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import allreduce_host_profile as hp  # noqa: E402
import ddp_step_time as st  # noqa: E402

import cfc.ddp as ddp  # noqa: E402


def _profiled(prof, fn):
    """``fn`` run under ``prof`` (enabled once, however deep the calls nest)."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        if _depth[0]:
            return fn(*a, **kw)
        _depth[0] += 1
        prof.enable()
        try:
            return fn(*a, **kw)
        finally:
            prof.disable()
            _depth[0] -= 1

    return wrapper


_depth = [0]  # only the comm thread enters _profiled


def _timed_hook_parts():
    """Timers on the steps of cfc_hook's CUDA path, on the autograd thread (``--hook-parts``)."""
    for name in ("_ordinals", "_parts", "_residual", "_end_of_bucket", "_compress_this", "_feeds", "_phase"):
        setattr(ddp.CfcState, name, hp._timed(f"  hook: CfcState.{name}", getattr(ddp.CfcState, name)))
    for name in ("caller_stream", "submit_all"):
        setattr(ddp._CommThread, name, hp._timed(f"  hook: _CommThread.{name}", getattr(ddp._CommThread, name)))
    for name in ("_fast_step", "_pipeline_step", "_gpu_submit"):
        setattr(ddp, name, hp._timed(f"  hook: {name}", getattr(ddp, name)))
    torch.cuda.Event.record = hp._timed("  hook: torch.cuda.Event.record", torch.cuda.Event.record)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--caps", default="25", help="DDP bucket sizes in MB, comma-separated")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--cprofile", type=int, default=0, help="print this many functions of a cProfile run")
    p.add_argument("--hook-parts", action="store_true", help="also time the hook's steps on the autograd thread")
    p.add_argument("--graphs", action="store_true", help="the native exchange submits CUDA graphs (set_graphs)")
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    hp._instrument()
    if args.hook_parts:
        _timed_hook_parts()
    st.cfc.cfc_hook = hp._timed("cfc_hook (autograd thread)", ddp.cfc_hook)  # what Runner registers
    profs = {}
    if args.cprofile:
        profs = {"cfc-comm": cProfile.Profile()}
        ddp._gpu_launch = _profiled(profs["cfc-comm"], ddp._gpu_launch)
        ddp._CommThread._run_deferred = _profiled(profs["cfc-comm"], ddp._CommThread._run_deferred)
    for cap in args.caps.split(","):
        runner = st.Runner(f"cfc{'-graphs' if args.graphs else ''}:cap{cap}", rank)
        for _ in range(args.warmup):
            runner.step()
        runner.state.reset_stats()
        steps = []
        with hp._lock:
            hp._times.clear()
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner.step()
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - t0)
        s = runner.state.stats()
        buckets = s["compressed_buckets"] / args.steps
        if rank == 0:
            print(f"\ncfc{' with graphs' if args.graphs else ''}, {cap} MB buckets, {dist.get_world_size()} GPUs, {os.environ.get('LABEL', '')}: "
                  f"{buckets:.0f} compressed buckets per step, step {1e3 * statistics.median(steps):.1f} ms "
                  f"(median of {args.steps}, timers on), {s['ratio']:.1f}x fewer bytes, "
                  f"{s.get('resends', 0):.0f} frames sent again"
                  + (f", {runner.state._exchange.graphs_instantiated()} graphs made, "
                     f"{runner.state._exchange.graphs_reused()} launched without recording"
                     if args.graphs and runner.state._exchange is not None else ""))
            print("| thread | stage | ms per step | us per bucket |\n|---|---|---|---|")
            with hp._lock:
                rows = sorted(hp._times.items())
            for (thread, label), total in rows:
                per_step = total / args.steps
                print(f"| {thread} | {label} | {1e3 * per_step:.2f} | {1e6 * per_step / max(buckets, 1):.0f} |")
            for name, prof in profs.items():
                # (the warm-up's calls are in it too: divided by every compressed bucket so far)
                total = s["compressed_buckets"] + args.warmup * buckets
                print(f"\ncProfile, {name}, us of own time per compressed bucket (warm-up included):")
                stats = pstats.Stats(prof)
                rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[: args.cprofile]
                for (file, line, func), (cc, nc, tt, ct, _) in rows:
                    print(f"  {1e6 * tt / total:7.1f} own {1e6 * ct / total:8.1f} cum  {nc / total:5.1f} calls  "
                          f"{func} ({Path(file).name}:{line})")
        del runner
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
