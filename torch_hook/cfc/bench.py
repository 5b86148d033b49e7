"""``python -m cfc.bench``: plain all-reduce and cfc's compressed all-reduce, side by side.

Run it under torchrun, one process per GPU; it uses whatever transport NCCL picks (NVLink,
shared memory, sockets, InfiniBand), or gloo on CPU tensors where there is no GPU (``--cpu``)::

    torchrun --standalone --nproc_per_node=2 -m cfc.bench --grads ../shared/data/grads
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_NET=Socket \\
        NCCL_SOCKET_IFNAME=lo torchrun --standalone --nproc_per_node=2 -m cfc.bench --label socket

For each size it times, on the same data in the same process group:

* ``fp32``: ``dist.all_reduce`` of the float32 tensor (average);
* ``bf16``: the same on a bfloat16 copy (the cast is not timed);
* ``cfc@B``: :class:`cfc.distributed.AllReducer` with ``eps = B x RMS`` of the data and error
  feedback: chunks compressed on the GPU, exchanged, decoded and averaged, pipelined;
* ``cfc-ag@B`` / ``cfc-rs@B`` (``--algorithms all-gather,reduce-scatter``): the same with the
  all-gather or the reduce-scatter of :class:`cfc.CfcState`'s ``algorithm`` (default: its
  automatic choice, named ``cfc@B``);
* ``cfc-auto@B`` (``--auto``): the same with ``fallback="auto"``: each chunk is timed both ways
  during the warm-up calls and then takes the faster (plain NCCL where compressing does not
  pay, e.g. over NVLink);
* ``cfc-flat@B`` / ``cfc-2l@B`` (``--topologies flat,two-level``): the flat or the two-level
  exchange of :class:`cfc.CfcState`'s ``topology`` (default: its automatic choice). Nodes are
  the ranks' host names or ``CFC_NODE``; ``scripts/emulate_nodes.sh`` runs the ranks as
  emulated nodes on one host;
* ``...-rice@B`` (``--coders planes,rice``): the same with :class:`cfc.CfcState`'s ``coder``
  (Rice-coded frames in the all-gather; default: bit planes, no suffix);
* ``...-bK@B`` (``--blocks K``): the same with block scales, :class:`cfc.CfcState`'s
  ``rms=B, block=K`` (each block of K values within B times its own RMS) instead of
  ``eps = B x RMS`` of the whole data; its error column is then empty;
* ``fp32-again`` (``--aa``): a second copy of ``fp32``, whose difference from the first is the
  run's noise.

With ``--rounds R``, every method runs ``R`` times per size, the methods taking turns, and each
figure is the median over the rounds (of each round's median).

Each iteration starts from the same input, after a tiny all-reduce that lines the ranks up;
its time runs until the result is on the device, and the slowest rank's counts. The table
gives medians: time, algbw (float32 bytes / time), busbw (algbw x 2(n-1)/n, the figure
nccl-tests prints for all-reduce), the speed-up over ``fp32``, the ratio of the bytes a ring
all-reduce of float32 sends to the bytes cfc sent, the bytes that leave each node per call
(counted by cfc's engine; for NCCL's rings the ring's ``2 (n - 1) / n`` of the tensor, 0 on one
node), how soon the call returned to Python, and
the largest error of a first call (zero residuals) over the bound (for ``cfc-auto`` that call
is the trial's first, plain one). ``--json`` and ``--png`` keep the figures.

``python -m cfc.bench --plot FILE.json --png FILE.png`` draws the PNG of a JSON written
earlier, by this benchmark or by the Rust one (``cfc-bench --json``; ``cfc-bench --png``
calls this), with no process group.

The input: the gradient vectors in ``--grads`` (``.npy`` float32), each scaled to their median
RMS (so one bound suits them all, as in a bucket of similar layers), concatenated and tiled;
each rank starts at another offset. Without ``--grads``, heavy-tailed random numbers.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import cfc

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"64M"`` -> 67108864 bytes (K, M, G are powers of 1024)."""
    t = text.strip().upper().rstrip("B")
    scale = _UNITS.get(t[-1:], 1)
    value = int(float(t[:-1] if t[-1:] in _UNITS else t) * scale)
    if value < 4:
        raise argparse.ArgumentTypeError(f"size {text!r} holds no float32")
    return value


def _label(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}B"
    return f"{nbytes}B"


def gradient_data(folder: Optional[str]):
    """(float32 CPU tensor, its RMS): the vectors in ``folder`` at one scale, or random."""
    import numpy as np
    import torch

    files = sorted(glob.glob(os.path.join(folder, "*.npy"))) if folder else []
    if folder and not files:
        raise SystemExit(f"no .npy files in {folder}")
    if not files:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1 << 22, generator=g) * torch.rand(1 << 22, generator=g).pow(4) * 1e-4
        return x, float(x.double().pow(2).mean().sqrt())
    vectors = [torch.from_numpy(np.load(f).astype(np.float32).reshape(-1)) for f in files]
    rms = [float(v.double().pow(2).mean().sqrt()) for v in vectors]
    target = statistics.median(rms)
    x = torch.cat([v * (target / r) if r > 0 else v for v, r in zip(vectors, rms)])
    return x, target


def rank_input(base, rank: int, numel: int):
    """``numel`` values of ``base``, tiled, starting at a rank's own offset."""
    import torch

    start = (rank * 1_000_003) % base.numel()
    rolled = torch.cat([base[start:], base[:start]])
    reps = -(-numel // rolled.numel())
    return rolled.repeat(reps)[:numel].clone()


class _Progress:
    """A one-line progress bar on stderr, where stderr is a terminal (logs get the table only)."""

    def __init__(self, total: int, show: bool):
        self.total, self.done = total, 0
        self.show = show and total > 0 and sys.stderr.isatty()

    def step(self, text: str) -> None:
        self.done += 1
        if self.show:
            filled = 30 * self.done // self.total
            bar = "#" * filled + "." * (30 - filled)
            sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {text:<24}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def _measure(run, setup, sync, align, iters: int, warmup: int, slowest, before=None) -> Dict[str, float]:
    """Median over ``iters`` of (seconds to the result on the device, seconds until the call
    returned); each iteration's times are the slowest rank's. ``before`` runs after the warm-up."""
    for _ in range(warmup):
        setup()
        pending = run()
        if pending is not None:
            pending.wait()
        sync()
    if before is not None:
        before()
    total, call = [], []
    for _ in range(iters):
        setup()
        align()
        sync()
        t0 = time.perf_counter()
        pending = run()
        t1 = time.perf_counter()
        if pending is not None:
            pending.wait()
        sync()
        t2 = time.perf_counter()
        total.append(t2 - t0)
        call.append(t1 - t0)
    total, call = slowest(total), slowest(call)
    return {"seconds": statistics.median(total), "call_seconds": statistics.median(call)}


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m cfc.bench", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=None, help="comma list (default 1M..1G on GPU, 1M..16M on CPU)")
    p.add_argument("--bounds", default="0.3,0.1", help="cfc bounds as multiples of the data's RMS")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 20 GPU, 5 CPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--chunk-numel", type=int, default=1 << 24, help="elements per cfc chunk (AllReducer's chunk_numel)")
    p.add_argument("--auto", action="store_true", help='also cfc with fallback="auto" at the first bound')
    p.add_argument("--algorithms", default="", help="comma list of all-gather, reduce-scatter (default: cfc's choice)")
    p.add_argument("--topologies", default="", help="comma list of flat, two-level (default: cfc's choice)")
    p.add_argument("--coders", default="planes", help="comma list of planes, rice (default: planes)")
    p.add_argument("--blocks", default="", help="comma list of block sizes: also cfc with rms=B, block=K")
    p.add_argument("--rounds", type=int, default=1, help="rounds in which the methods take turns (medians over them)")
    p.add_argument("--aa", action="store_true", help="also a second copy of fp32 (fp32-again): the noise")
    p.add_argument("--grads", default=None, help="folder of .npy gradient vectors")
    p.add_argument("--cpu", action="store_true", help="CPU tensors over gloo, even with GPUs")
    p.add_argument("--label", default=None, help="transport name for the table (default: guessed)")
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--plot", default=None, metavar="JSON", help="only draw --png from this JSON (of either benchmark)")
    args = p.parse_args(argv)
    if args.plot:
        if not args.png:
            p.error("--plot needs --png")
        with open(args.plot) as f:
            result = _normalise(json.load(f))
        _plot(result, args.png)
        return result

    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun, one process per GPU: torchrun --nproc_per_node=2 -m cfc.bench")
    use_cuda = torch.cuda.is_available() and not args.cpu
    if use_cuda:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        return _run(args, dev, rank, world)
    finally:
        dist.destroy_process_group()


def _run(args, dev, rank: int, world: int) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    cuda = dev.type == "cuda"
    sizes = [parse_size(s) for s in (args.sizes or ("1M,4M,16M,64M,256M,1G" if cuda else "1M,4M,16M")).split(",")]
    bounds = [float(b) for b in args.bounds.split(",") if b.strip()]
    iters = args.iters if args.iters is not None else (20 if cuda else 5)
    label = args.label or _guess_transport(cuda)
    base, rms = gradient_data(args.grads)
    chunk = max(1, args.chunk_numel)
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()] or [None]
    short = {None: "cfc", "all-gather": "cfc-ag", "reduce-scatter": "cfc-rs"}
    if any(a not in short for a in algorithms):
        raise SystemExit(f"--algorithms takes all-gather and reduce-scatter, got {args.algorithms!r}")
    topologies = [t.strip() for t in args.topologies.split(",") if t.strip()] or ["auto"]
    suffix = {"auto": "", "flat": "-flat", "two-level": "-2l"}
    if any(t not in suffix for t in topologies):
        raise SystemExit(f"--topologies takes flat and two-level, got {args.topologies!r}")
    coders = [c.strip() for c in args.coders.split(",") if c.strip()] or ["planes"]
    if any(c not in ("planes", "rice") for c in coders):
        raise SystemExit(f"--coders takes planes and rice, got {args.coders!r}")
    blocks = [int(k) for k in args.blocks.split(",") if k.strip()]
    reducers = {
        f"{short[a]}{suffix[t]}{'' if c == 'planes' else '-' + c}{'' if not k else f'-b{k}'}@{b:g}":
        cfc.distributed.AllReducer(
            cfc.CfcState(**({"eps": b * rms} if not k else {"rms": b, "block": k}), warmup_steps=0,
                         min_compress_numel=0, algorithm=a, topology=t, coder=c),
            chunk_numel=chunk,
        )
        for b in bounds
        for a in algorithms
        for t in topologies
        for c in coders
        for k in [0] + blocks
    }
    node_names: List[Any] = [None] * world
    dist.all_gather_object(node_names, cfc._native.env_node() or socket.gethostname())
    nodes = len(set(node_names))
    if args.auto and bounds:
        trial = cfc.CfcState(eps=bounds[0] * rms, warmup_steps=0, min_compress_numel=0, fallback="auto")
        reducers[f"cfc-auto@{bounds[0]:g}"] = cfc.distributed.AllReducer(trial, chunk_numel=chunk)
    avg = dist.ReduceOp.AVG if cuda else None

    def all_reduce_avg(t):
        if avg is not None:
            dist.all_reduce(t, op=avg)
        else:
            dist.all_reduce(t)
            t.div_(world)

    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    flag = torch.zeros(1, device=dev)

    def align():
        dist.all_reduce(flag)

    def slowest(times: List[float]) -> List[float]:
        t = torch.tensor(times, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    methods = ["fp32", "bf16"] + (["fp32-again"] if args.aa else []) + list(reducers)
    rounds = max(1, args.rounds)
    progress = _Progress(len(sizes) * len(methods) * rounds, rank == 0)
    rows: List[Dict[str, Any]] = []

    def one(m: str, nbytes: int, x: Any, exact: Any, ring: float, first: bool) -> Dict[str, Any]:
        """One method's medians at one size (one round; the error is of the first round's first
        call, whose residuals are zero)."""
        row: Dict[str, Any] = {"size": nbytes, "method": m}
        if m in ("fp32", "bf16", "fp32-again"):
            src = x if m != "bf16" else x.bfloat16()
            buf = src.clone()
            t = _measure(lambda: all_reduce_avg(buf), lambda: buf.copy_(src), sync, align, iters, args.warmup, slowest)
            ratio = 1.0 if m != "bf16" else 2.0
            row.update(t, ratio=ratio, node_out_bytes=ring / ratio)
            return row
        reducer = reducers[m]
        eps = reducer.state.bound
        if first and reducer.state.bound_kind == "eps":
            y = reducer(x.clone()).wait()  # a first call: zero residuals, so |err| <= eps
            sync()
            err = torch.tensor([(y.double() - exact).abs().max().item()], dtype=torch.float64, device=dev)
            dist.all_reduce(err, op=dist.ReduceOp.MAX)
            row["max_err_over_eps"] = err.item() / eps
        buf = x.clone()
        # fallback="auto" times each chunk both ways over its first calls: all warm-up
        warm = max(args.warmup, reducer.state.trial_steps + 1)
        t = _measure(lambda: reducer(buf), lambda: buf.copy_(x), sync, align, iters, warm, slowest,
                     before=reducer.state.reset_stats)
        st = reducer.state.stats()
        # bytes out of each node per call: every rank's bytes to other nodes, over the nodes
        out = torch.tensor([float(st["between_nodes"])], dtype=torch.float64, device=dev)
        dist.all_reduce(out)
        row.update(t, ratio=st["ratio"], eps=eps,
                   resends=st["resends"], plain_chunks=st["plain_buckets"],
                   compressed_chunks=st["compressed_buckets"], node_out_bytes=out.item() / nodes / iters,
                   levels=reducer.state.levels)
        return row

    for nbytes in sizes:
        n = nbytes // 4
        x = rank_input(base, rank, n).to(dev)
        exact = x.double()
        dist.all_reduce(exact)
        exact.div_(world)
        # NCCL's rings cross each node's boundary once: 2 (n - 1) / n of the tensor leaves a node
        ring = 2 * (world - 1) / world * nbytes if nodes > 1 else 0.0
        per_round: Dict[str, List[Dict[str, Any]]] = {m: [] for m in methods}
        for r in range(rounds):
            for m in methods:
                per_round[m].append(one(m, nbytes, x, exact, ring, r == 0))
                progress.step(f"{_label(nbytes)} {m}")
        plain_s = statistics.median(r["seconds"] for r in per_round["fp32"])
        for m in methods:
            row = dict(per_round[m][0])
            for k in ("seconds", "call_seconds", "node_out_bytes"):
                row[k] = statistics.median(r[k] for r in per_round[m])
            row["rounds"] = rounds
            row["algbw_GBps"] = nbytes / row["seconds"] / 1e9
            row["busbw_GBps"] = row["algbw_GBps"] * 2 * (world - 1) / world
            row["speedup"] = plain_s / row["seconds"]
            rows.append(row)
        x = exact = None  # free this size's tensors (and residuals) before the next
        if cuda:
            torch.cuda.empty_cache()

    result = {
        "world": world,
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "backend": dist.get_backend(),
        "transport": label,
        "iters": iters,
        "chunk_numel": chunk,
        "rms": rms,
        "nodes": nodes,
        "data": args.grads or "random",
        "rows": rows,
    }
    if rank == 0:
        print(_table(result))
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        if args.png:
            _plot(result, args.png)
    for reducer in reducers.values():
        reducer.close()
    return result


def _guess_transport(cuda: bool) -> str:
    if not cuda:
        return "gloo (CPU)"
    if os.environ.get("NCCL_NET", "").lower() == "socket" and os.environ.get("NCCL_P2P_DISABLE") == "1":
        return "NCCL socket"
    if os.environ.get("NCCL_HOSTID"):
        return "NCCL, nodes emulated by NCCL_HOSTID (sockets between them)"
    return "NCCL (NVLink/PCIe/shm)"


def _table(result: Dict[str, Any]) -> str:
    head = (
        f"all-reduce (average), {result['world']} ranks, {result['device']}, {result['transport']}; "
        f"{result.get('nodes', 1)} nodes; medians of {result['iters']}"
        f"{' x ' + str(result['rows'][0].get('rounds', 1)) + ' rounds' if result['rows'] else ''}; "
        f"data: {result['data']}; time: lower is better\n"
        "| size | method | time ms | algbw GB/s | busbw GB/s | vs fp32 | ratio | MB out of each node | "
        "call returns ms | max err / eps |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in result["rows"]:
        err = f"{r['max_err_over_eps']:.3f}" if "max_err_over_eps" in r else "-"
        out = f"{r['node_out_bytes'] / 1e6:.2f}" if "node_out_bytes" in r else "-"
        lines.append(
            f"| {_label(r['size'])} | {r['method']} | {r['seconds'] * 1e3:.3f} | {r['algbw_GBps']:.2f} | "
            f"{r['busbw_GBps']:.2f} | {r['speedup']:.2f}x | {r['ratio']:.2f}x | {out} | "
            f"{r['call_seconds'] * 1e3:.3f} | {err} |"
        )
    return "\n".join(lines)


def _normalise(result: Dict[str, Any]) -> Dict[str, Any]:
    """A JSON of ``cfc-bench`` (rows with ``seconds``, and ``ranks`` on the CPU or ``gpus``)
    in the shape ``_plot`` reads; this benchmark's own JSON passes unchanged."""
    rows = result.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "size" in r and "method" in r for r in rows):
        raise SystemExit("not a benchmark JSON: it needs rows with size and method")
    out = dict(result)
    out["rows"] = []
    for r in rows:
        r = dict(r)
        if "algbw_GBps" not in r:
            if not r.get("seconds"):
                raise SystemExit(f"a row without algbw_GBps or seconds: {r}")
            r["algbw_GBps"] = r["size"] / r["seconds"] / 1e9
        if "ranks" in r and "gpus" not in r:  # cfc-bench's CPU mode: one curve per rank count
            r["method"] = f"{r['method']}, {r['ranks']} ranks"
        out["rows"].append(r)
    first = out["rows"][0] if out["rows"] else {}
    ranks = sorted({r["ranks"] for r in rows if "ranks" in r})
    out.setdefault("world", first.get("gpus", ", ".join(map(str, ranks)) or "?"))
    out.setdefault("device", "GPUs" if "gpus" in first else "CPU threads")
    out.setdefault("transport", f"NCCL {result['nccl']}" if "nccl" in result else "in-process")
    return out


def _plot(result: Dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in dict.fromkeys(r["method"] for r in result["rows"]):
        pts = [(r["size"], r["algbw_GBps"]) for r in result["rows"] if r["method"] == m]
        ax.plot([s / 2**20 for s, _ in pts], [b for _, b in pts], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("all-reduce size (MB of float32)")
    ax.set_ylabel("algbw (GB/s of float32)")
    ax.set_title(f"{result['world']} ranks, {result['device']}, {result['transport']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
