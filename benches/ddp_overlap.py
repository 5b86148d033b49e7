"""Where a DDP step's communication sits against its computation, from a CUDA trace.

For each hook, a few steps of the 217M LM of ``ddp_step_time.py`` run under ``torch.profiler``;
each step ends with a synchronize, so a step's kernels lie inside its host time range. Per
step, on rank 0's GPU:

- *compute*: the union of kernel time on the stream with the most non-NCCL kernel time
  (forward, backward, optimizer), and when its last kernel ends;
- *nccl*: the union of NCCL kernel time (over the socket transport an NCCL kernel lasts as long
  as its bytes take on the wire); *window*: from the first NCCL kernel's start to the last one's
  end, and *idle*: the time in the window with no NCCL kernel running (the wire waits);
- *codec*: other kernels on other streams (cfc's compress and decode);
- *last hook*: when DDP last called a Python comm hook (cfc_hook, host clock), from the step's
  first kernel: the last bucket is ready then.

All times are from the step's first kernel. The step is host-bound (the GPU idles between
kernels), so *span* is mostly host time.
Run under torchrun like ``ddp_step_time.py``; ``--trace DIR`` keeps each hook's Chrome trace.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_step_time import Runner  # noqa: E402


def union(intervals):
    """Total length of a union of (start, end) intervals, and the merged intervals."""
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return sum(e - s for s, e in merged), merged


def profile(runner, steps):
    """Chrome-trace events of ``steps`` steps, and each step's host time range (trace clock)."""
    from torch.profiler import ProfilerActivity, profile as prof_ctx, record_function

    torch.cuda.synchronize()
    with prof_ctx(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            with record_function(f"cfc_overlap_step_{i}"):
                runner.step()
                torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    os.unlink(path)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return events


def summarize(events, steps):
    marks = {}
    for ev in events:
        name = ev.get("name", "")
        if name.startswith("cfc_overlap_step_") and ev.get("ph") == "X" and ev.get("cat") == "user_annotation":
            marks[int(name.rsplit("_", 1)[1])] = (float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]))
    kernels = [ev for ev in events if ev.get("cat") == "kernel" and ev.get("ph") == "X"]
    rows = []
    for i in range(steps):
        if i not in marks:
            continue
        lo, hi = marks[i]
        ks = [(float(k["ts"]), float(k["ts"]) + float(k["dur"]), k["args"].get("stream"), k["name"])
              for k in kernels if lo <= float(k["ts"]) <= hi]
        if not ks:
            continue
        per_stream = {}
        for s, e, st, n in ks:
            if "nccl" not in n.lower():
                per_stream[st] = per_stream.get(st, 0.0) + (e - s)
        main = max(per_stream, key=per_stream.get)
        start = min(s for s, _, _, _ in ks)
        comp_t, _ = union([(s, e) for s, e, st, _ in ks if st == main])
        nccl_t, nccl = union([(s, e) for s, e, _, n in ks if "nccl" in n.lower()])
        codec_t, _ = union([(s, e) for s, e, st, n in ks if st != main and "nccl" not in n.lower()])
        first = min((s for s, _, _, n in ks if "nccl" in n.lower()), default=None)
        last = max((e for _, e, _, n in ks if "nccl" in n.lower()), default=None)
        hooks = [float(ev["ts"]) for ev in events if ev.get("name") == "cfc_hook_call"
                 and ev.get("cat") == "user_annotation" and lo <= float(ev["ts"]) <= hi]
        rows.append({
            "span": max(e for _, e, _, _ in ks) - start,
            "compute": comp_t,
            "compute_end": max(e for _, e, st, _ in ks if st == main) - start,
            "nccl": nccl_t,
            "window": (last - first) if first is not None else 0.0,
            "idle": (last - first - nccl_t) if first is not None else 0.0,
            "codec": codec_t,
            "first_nccl": (first - start) if first is not None else float("nan"),
            "last_nccl": (last - start) if last is not None else float("nan"),
            "last_hook": (max(hooks) - start) if hooks else float("nan"),
        })
    return rows


def mark_hook_calls():
    """Wrap cfc_hook so each call shows in the trace (``ddp_step_time.register`` looks it up at
    registration)."""
    import cfc
    from torch.profiler import record_function

    hook = cfc.cfc_hook

    def cfc_hook(state, bucket):
        with record_function("cfc_hook_call"):
            return hook(state, bucket)

    cfc.cfc_hook = cfc_hook


def main():
    p = argparse.ArgumentParser()
    p.add_argument("hooks", nargs="*", default=["noop", "allreduce", "cfc"])
    p.add_argument("--steps", type=int, default=5, help="profiled steps per hook")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--label", default=os.environ.get("LABEL", ""))
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    mark_hook_calls()
    table = []
    for name in args.hooks:
        r = Runner(name, rank)
        for _ in range(args.warmup):
            r.step()
        t0 = time.perf_counter()
        events = profile(r, args.steps)
        rows = summarize(events, args.steps) if rank == 0 else []
        if rank == 0:
            med = {k: statistics.median(x[k] for x in rows) / 1e3 for k in rows[0]} if rows else {}
            table.append((name, med, len(rows), time.perf_counter() - t0))
        del r
        torch.cuda.empty_cache()
        dist.barrier()
    if rank == 0:
        print(f"\nDDP step anatomy, {dist.get_world_size()} GPUs, {args.label}: rank 0's GPU, median of "
              f"{args.steps} profiled steps (each ending in a synchronize), ms")
        print("| hook | span | compute | compute end | nccl | first nccl | last nccl | window idle | codec | last hook |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, m, n, _ in table:
            if not m:
                print(f"| {name} | no steps found in the trace |")
                continue
            print(f"| {name} | {m['span']:.1f} | {m['compute']:.1f} | {m['compute_end']:.1f} | {m['nccl']:.1f} | "
                  f"{m['first_nccl']:.1f} | {m['last_nccl']:.1f} | {m['idle']:.1f} | {m['codec']:.2f} | "
                  f"{m['last_hook']:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
