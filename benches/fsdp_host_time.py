"""Where cfc.fsdp's reduce-scatter spends the host's time: FSDP2 calls it on the thread that
runs the backward pass, and the call returns only once its exchange is done, so every
millisecond it holds the host is a millisecond the next group's backward is not queued.

Trains ``examples/fsdp_train.py``'s LM with each ``--comm`` way (its ``cfc*`` ways) and times,
on the host (no extra synchronisation), per step: the whole reduce-scatter calls, and inside
them the 4-bit residuals' packing and unpacking. The rest of a call is the engine's submit and
its wait. Under torchrun, on GPUs::

    torchrun --standalone --nproc_per_node=2 benches/fsdp_host_time.py --comm cfc,cfc-b256@0.1,cfc-r4-b256@0.1 \\
        --d-model 1024 --layers 8 --heads 16 --seq 256 --batch 8 --steps 25

Medians over the steps after the first fifth, rank 0's.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import cfc.fsdp  # noqa: E402
from cfc.fsdp import packed_residuals  # noqa: E402
from ddp_train import batch, corpus, lr_factor  # noqa: E402
from fsdp_train import build  # noqa: E402

SPOTS = {  # what is timed: (module or class, attribute) -> label
    (cfc.fsdp, "reduce_scatter"): "calls",
    (packed_residuals, "pack"): "pack",
    (packed_residuals, "unpack"): "unpack",
}


def timed(spent: dict, label: str, f):
    @functools.wraps(f)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            spent[label] += time.perf_counter() - t0
    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comm", default="cfc,cfc-b256@0.1,cfc-r4-b256@0.1")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--rms", type=float, default=0.3)
    p.add_argument("--schedule", default="cosine")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    data = corpus(4 << 20)
    spent: dict = collections.defaultdict(float)
    for (mod, name), label in SPOTS.items():
        setattr(mod, name, timed(spent, label, getattr(mod, name)))
    rows = {}
    for way in args.comm.split(","):
        if not way.startswith("cfc"):
            raise SystemExit(f"{way!r}: only cfc ways go through cfc.fsdp")
        model, state = build(way, dev, args)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        gen = torch.Generator().manual_seed(args.seed * 1000 + dist.get_rank())
        per_step = collections.defaultdict(list)
        for step in range(args.steps):
            for g in opt.param_groups:
                g["lr"] = args.lr * lr_factor(step, args)
            chunk = batch(data, gen, args).to(dev)
            spent.clear()
            t0 = time.perf_counter()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                logits = model(chunk[:, :-1])
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(dev)
            per_step["step"].append(time.perf_counter() - t0)
            for label in SPOTS.values():
                per_step[label].append(spent[label])
        state.close()
        rows[way] = {k: 1e3 * statistics.median(v[len(v) // 5:]) for k, v in per_step.items()}
    if dist.get_rank() == 0:
        labels = ["step", *SPOTS.values()]
        print(f"host ms per step (median), {dist.get_world_size()} ranks, {dev.type}; calls = the reduce-scatter "
              "calls in all, the rest inside them but the step end's agreement")
        print("| way | " + " | ".join(labels) + " |")
        print("|---" * (len(labels) + 1) + "|")
        for way, r in rows.items():
            print(f"| {way} | " + " | ".join(f"{r[k]:.2f}" for k in labels) + " |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
