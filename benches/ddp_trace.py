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
per thread show that. The profiler makes every step slower. By default the hooks are traced one
after the other, so the host's drift between them (tens of percent over a minute on the GPU
machine) enters any comparison of two hooks' figures; ``--interleave`` takes their steps in
turn within one profile, so that the drift reaches each alike. ``--ops N`` adds the N kinds of
autograd operation that take the most time, with their median duration per hook. The Chrome traces
hold the timeline itself (the comm thread's calls, the codec's kernels, NCCL's all-gathers).
Run under torchrun, one GPU per process::

    torchrun --standalone --nproc_per_node=2 benches/ddp_trace.py noop cfc --out /tmp/traces

``--out`` keeps the Chrome traces (gzipped; one per hook, or one for all with ``--interleave``);
``python benches/ddp_trace.py --summarize FILE...`` prints the summary of traces written
earlier, without a GPU (a column per hook of an interleaved trace).
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


_BACKWARD = "cfc_trace_backward"  # the range around loss.backward(): "cfc_trace_backward:<hook>"


def _spans(trace: dict) -> list:
    """The trace's complete events (``"ph": "X"``, with a duration): ranges, operations, kernels."""
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def _backward_ranges(events, hook=None):
    """The host's ``backward`` ranges of ``hook`` (None: of any hook)."""
    return [e for e in events if e.get("cat") == "user_annotation"
            and (e.get("name") == f"{_BACKWARD}:{hook}" if hook else str(e.get("name", "")).split(":")[0] == _BACKWARD)]


def hooks_in(trace: dict) -> list:
    """The hooks whose steps a trace holds, in the order of their first step."""
    out = []
    for e in _backward_ranges(_spans(trace)):
        name = str(e["name"]).partition(":")[2]
        if name not in out:
            out.append(name)
    return out


def summarize(trace: dict, label: str, hook=None) -> dict:
    """Per-step medians of what the trace shows during each ``backward`` range of ``hook``
    (None: every range; see the module's docstring)."""
    events = _spans(trace)
    ranges = _backward_ranges(events, hook)
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in ranges)
    hooks = [e for e in events if e.get("name") == "cfc_trace_hook" and e.get("cat") == "user_annotation"]
    api = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    evals = defaultdict(int)
    for e in events:
        if e.get("cat") == "cpu_op" and str(e.get("name", "")).startswith("autograd::engine::evaluate_function"):
            evals[e["tid"]] += 1
    autograd_tid = max(evals, key=evals.get) if evals else None
    main_tid = ranges[0]["tid"] if ranges else None

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


_EVAL = "autograd::engine::evaluate_function: "


def op_times(trace: dict, hook=None) -> dict:
    """Per kind of autograd operation (``MmBackward0``, ``AccumulateGrad``...) run during the
    ``backward`` ranges: ``(calls per step, median duration in us, total ms per step)``. A kind
    that takes longer in one trace than in another, though it makes no CUDA call (``ViewBackward0``),
    shows the autograd thread itself running slower."""
    events = _spans(trace)
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in _backward_ranges(events, hook)]
    per = defaultdict(list)
    for e in events:
        name = str(e.get("name", ""))
        if e.get("cat") == "cpu_op" and name.startswith(_EVAL) and any(a <= e["ts"] <= b for a, b in steps):
            per[name[len(_EVAL):].removeprefix("torch::autograd::")].append(e["dur"])
    n = max(len(steps), 1)
    return {k: (len(v) / n, statistics.median(v), sum(v) / n / 1e3) for k, v in per.items()}


def print_ops(times, labels, top: int) -> None:
    """The ``top`` kinds of operation by time in the first of ``times`` (:func:`op_times`):
    median us in each, and each one's median over the first's."""
    kinds = sorted(times[0], key=lambda k: -times[0][k][2])[:top]
    print("\nAutograd operations, median us per call (calls per step in the first trace):")
    header = ["operation", "calls", *labels, *(f"{x} / {labels[0]}" for x in labels[1:])]
    print("| " + " | ".join(header) + " |")
    print("|---|---|" + "---|" * (2 * len(labels) - 1))
    for k in kinds:
        med = [t.get(k, (0, None, 0))[1] for t in times]
        cells = ["-" if m is None else f"{m:.1f}" for m in med]
        ratios = ["-" if m is None else f"{m / med[0]:.2f}" for m in med[1:]]
        print(f"| {k} | {times[0][k][0]:.0f} | " + " | ".join(cells + ratios) + " |")


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


def _trace(names, rank, args):
    """The models of hooks ``names`` (``ddp_step_time.Runner``), each warmed up, then
    ``--steps`` rounds of one step of each, in turn (the order rotates by one every round),
    in one profile on rank 0, whose trace this returns (None on the other ranks). Several
    names interleave their steps, so that the host's drift reaches each hook alike."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import ddp_step_time as st

    runners = []
    for name in names:
        runner = st.Runner(name, rank, wrap=_Marker())
        runner.backward_range = functools.partial(record_function, f"{_BACKWARD}:{name}")
        for _ in range(args.warmup):
            runner.step()
        runners.append(runner)
    torch.cuda.synchronize()

    def steps():
        for k in range(args.steps):
            for i in range(len(runners)):
                runners[(k + i) % len(runners)].step()
        torch.cuda.synchronize()

    if rank != 0:
        steps()
        return None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps()
    path = os.path.join(args.out or "/tmp", f"trace_{'+'.join(names)}.json")
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
    summaries, ops = [], []
    for names in [args.hooks] if args.interleave else [[h] for h in args.hooks]:
        trace = _trace(names, rank, args)
        if trace is not None:
            summaries += [summarize(trace, h, hook=h) for h in names]
            ops += [op_times(trace, hook=h) for h in names] if args.ops else []
        del trace
        dist.barrier()
        torch.cuda.empty_cache()
    if rank == 0:
        how = "interleaved, one profile" if args.interleave else "one hook after the other"
        print(f"\nBackward pass of the 217M LM, rank 0, per step (median of {args.steps} profiled steps; {how}):")
        print_table(summaries)
        if args.ops:
            print_ops(ops, list(args.hooks), args.ops)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hooks", nargs="*", default=["noop", "cfc"], help="ddp_step_time.py's hook names")
    p.add_argument("--steps", type=int, default=5, help="profiled steps per hook")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default=None, help="folder for the gzipped Chrome traces")
    p.add_argument("--summarize", nargs="+", default=None, metavar="TRACE",
                   help="print the summary of traces written before (no GPU needed)")
    p.add_argument("--ops", type=int, default=0, metavar="N",
                   help="also the N kinds of autograd operation that take the most time, per hook")
    p.add_argument("--interleave", action="store_true",
                   help="every hook's steps in turn, in one profile (default: one profile per hook)")
    args = p.parse_args()
    if args.interleave and len(set(args.hooks)) != len(args.hooks):
        p.error("--interleave names each hook once (its steps are told apart by its name)")
    if args.summarize:
        columns = []  # (trace, label, hook): a column per hook of a trace that holds several
        for f in args.summarize:
            trace = _load(f)
            hooks = hooks_in(trace)
            if len(hooks) > 1:
                columns += [(trace, h, h) for h in hooks]
            else:
                columns.append((trace, Path(f).name.split(".")[0], None))
        print_table([summarize(t, x, hook=h) for t, x, h in columns])
        if args.ops:
            print_ops([op_times(t, hook=h) for t, _, h in columns], [x for _, x, _ in columns], args.ops)
        return
    run(args)


if __name__ == "__main__":
    main()
