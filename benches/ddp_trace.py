"""What the host threads and the GPU do during the backward pass of ``ddp_step_time.py``'s 217M
LM, per hook: a PyTorch profiler trace (CPU and CUDA activities) of a few steps on rank 0, and
a summary of it per step:

- *backward*: the host's time in ``loss.backward()``; *last hook*: when DDP called the step's
  last bucket's hook, from the start of ``backward()``;
- the time the comm hook took on the autograd thread, and that thread's other work (its
  outermost operations, less its CUDA calls and the hook);
- per host thread (the autograd thread and the main thread by name; the others, such as cfc's
  comm thread and NCCL's launch thread, by id), the number of CUDA API calls and the time spent
  in them;
- the GPU: how busy PyTorch's default stream (which CUPTI numbers 7) and the other streams
  were during the backward pass, and how long NCCL's kernels ran (over a network transport,
  about the time the bytes spent on the wire).

A backward pass bound by the host's kernel launches (as this model's is) gets slower when each
launch takes longer, e.g. because another thread contends for the CUDA driver; the launch times
per thread show that. The profiler makes every step slower, and the hooks are traced one after
the other, not interleaved, so the host's drift between them (tens of percent over a minute on
the GPU machine) enters any comparison of two hooks' figures: compare within a trace (one
thread against another, the wire against the hooks), or over several runs. The Chrome traces
hold the timeline itself (the comm thread's calls, the codec's kernels, NCCL's all-gathers).
Run under torchrun, one GPU per process::

    torchrun --standalone --nproc_per_node=2 benches/ddp_trace.py noop cfc --out /tmp/traces

``--out`` keeps each hook's Chrome trace (gzipped); ``python benches/ddp_trace.py --summarize
FILE...`` prints the summary of traces written earlier, without a GPU.
"""

import argparse
import functools
import gzip
import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def _intervals_union(spans):
    """Total length covered by (start, end) spans."""
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def summarize(trace: dict, label: str) -> dict:
    """Per-step medians of what the trace shows during each ``backward`` range (see the
    module's docstring)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("name") == "cfc_trace_backward" and e.get("cat") == "user_annotation")
    hooks = [e for e in events if e.get("name") == "cfc_trace_hook" and e.get("cat") == "user_annotation"]
    api = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    evals = defaultdict(int)
    for e in events:
        if e.get("cat") == "cpu_op" and str(e.get("name", "")).startswith("autograd::engine::evaluate_function"):
            evals[e["tid"]] += 1
    autograd_tid = max(evals, key=evals.get) if evals else None
    main_tid = next((e["tid"] for e in events
                   if e.get("name") == "cfc_trace_backward" and e.get("cat") == "user_annotation"), None)

    def role(tid):
        if tid == autograd_tid:
            return "autograd"
        if tid == main_tid:
            return "main"
        return f"thread {tid}"

    rows = defaultdict(list)
    for a, b in steps:
        span = b - a
        rows["backward ms"].append(span / 1e3)
        mine = [h for h in hooks if a <= h["ts"] <= b]
        if mine:
            rows["last hook ms"].append((max(h["ts"] for h in mine) - a) / 1e3)
            rows["hook calls"].append(len(mine))
            rows["hook us, total"].append(sum(h["dur"] for h in mine))
        # The autograd thread's own work: its outermost operations, less its CUDA calls and the
        # hook (both counted apart); a slower host shows here as well as in the launches.
        outer, end = [], -1.0
        for e in sorted((e for e in events if e.get("tid") == autograd_tid and e.get("cat") == "cpu_op"
                         and a <= e["ts"] <= b), key=lambda e: e["ts"]):
            if e["ts"] >= end:
                outer.append((e["ts"], e["ts"] + e["dur"]))
                end = e["ts"] + e["dur"]

        def inside(e, spans):
            return any(x <= e["ts"] and e["ts"] + e["dur"] <= y for x, y in spans)

        hooked = [(h["ts"], h["ts"] + h["dur"]) for h in mine if inside(h, outer)]
        own_api = sum(e["dur"] for e in api if e["tid"] == autograd_tid and inside(e, outer) and not inside(e, hooked))
        other = sum(y - x for x, y in outer) - own_api - sum(y - x for x, y in hooked)
        rows["autograd: other work ms"].append(other / 1e3)
        per = defaultdict(lambda: [0, 0.0])
        launches = defaultdict(lambda: [0, 0.0])
        for e in api:
            if a <= e["ts"] <= b:
                r = role(e["tid"])
                per[r][0] += 1
                per[r][1] += e["dur"]
                if "LaunchKernel" in e["name"]:
                    launches[r][0] += 1
                    launches[r][1] += e["dur"]
        for r, (n, t) in per.items():
            rows[f"{r}: CUDA calls"].append(n)
            rows[f"{r}: CUDA call us"].append(t)
        for r, (n, t) in launches.items():
            if n:
                rows[f"{r}: launch us, mean"].append(t / n)
        by_stream = defaultdict(list)
        for k in kernels:
            s, e = max(k["ts"], a), min(k["ts"] + k["dur"], b)
            if e > s:
                by_stream[k.get("args", {}).get("stream", k.get("tid"))].append((s, e))
        nccl = [(max(k["ts"], a), min(k["ts"] + k["dur"], b)) for k in kernels
                if "nccl" in str(k.get("name", "")).lower() and k["ts"] < b and k["ts"] + k["dur"] > a]
        if nccl:  # the wire's share: NCCL's kernels run while their bytes move
            rows["GPU NCCL kernels, count"].append(len(nccl))
            rows["GPU NCCL kernels busy ms"].append(_intervals_union(nccl) / 1e3)
        compute = by_stream.pop(7, [])
        rows["GPU stream 7 busy %"].append(100 * _intervals_union(compute) / span)
        rows["GPU other streams busy %"].append(100 * _intervals_union([x for v in by_stream.values() for x in v]) / span)
    out = {"label": label, "steps": len(steps)}
    for k, v in rows.items():
        out[k] = statistics.median(v)
    return out


def print_table(summaries) -> None:
    keys = []
    for s in summaries:
        for k in s:
            if k not in ("label",) and k not in keys:
                keys.append(k)
    print("| | " + " | ".join(s["label"] for s in summaries) + " |")
    print("|---|" + "---|" * len(summaries))
    for k in keys:
        cells = []
        for s in summaries:
            v = s.get(k)
            cells.append("-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v))
        print(f"| {k} | " + " | ".join(cells) + " |")


def _load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


class _Marker:
    """Wraps each hook call in a profiler range (``ddp_step_time.Runner``'s ``wrap``)."""

    def wrap(self, hook):
        from torch.profiler import record_function

        @functools.wraps(hook)
        def marked(state, bucket):
            with record_function("cfc_trace_hook"):
                return hook(state, bucket)

        return marked


def _trace_one(name, rank, args):
    """Hook ``name``'s model (``ddp_step_time.Runner``), warmed up, then ``--steps`` steps
    (profiled on rank 0, whose trace this returns; None on the other ranks)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import ddp_step_time as st

    runner = st.Runner(name, rank, wrap=_Marker())
    runner.backward_range = lambda: record_function("cfc_trace_backward")
    for _ in range(args.warmup):
        runner.step()
    torch.cuda.synchronize()
    if rank != 0:
        for _ in range(args.steps):
            runner.step()
        torch.cuda.synchronize()
        return None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            runner.step()
        torch.cuda.synchronize()
    path = os.path.join(args.out or "/tmp", f"trace_{name}.json")
    prof.export_chrome_trace(path)
    trace = _load(path)
    if args.out:
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
            g.write(f.read())
    os.remove(path)
    return trace


def run(args) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    summaries = []
    for name in args.hooks:
        trace = _trace_one(name, rank, args)
        if trace is not None:
            summaries.append(summarize(trace, name))
        dist.barrier()
        torch.cuda.empty_cache()
    if rank == 0:
        print(f"\nBackward pass of the 217M LM, rank 0, per step (median of {args.steps} profiled steps):")
        print_table(summaries)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hooks", nargs="*", default=["noop", "cfc"], help="ddp_step_time.py's hook names")
    p.add_argument("--steps", type=int, default=5, help="profiled steps per hook")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default=None, help="folder for the gzipped Chrome traces")
    p.add_argument("--summarize", nargs="+", default=None, metavar="TRACE",
                   help="print the summary of traces written before (no GPU needed)")
    args = p.parse_args()
    if args.summarize:
        print_table([summarize(_load(f), Path(f).name.split(".")[0]) for f in args.summarize])
        return
    run(args)


if __name__ == "__main__":
    main()
