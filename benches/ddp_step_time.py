"""DDP step time of a 217M-parameter transformer LM with PyTorch's built-in hooks and cfc_hook.

The configuration of ``../shared/docs/ANCHORS.md`` (d=1024, 12 layers, vocab 32000, T=256,
batch 8 per GPU, bf16 autocast, AdamW). Every hook runs in the same process group, one after
the other, with ``noop`` (no communication: the floor) first and last; each is reported as its
median step time and as a ratio to noop's. ``allreduce`` is DDP's built-in all-reduce (no
hook); ``allreduce-py`` is the same all-reduce as a Python comm hook (PyTorch's
``allreduce_hook``), which shows what running any Python hook costs. Run under torchrun with one GPU per process::

    torchrun --standalone --nproc_per_node=2 benches/ddp_step_time.py --steps 30

For the socket transport, set NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1
NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo. ``--json FILE`` writes the per-step times.
"""

import argparse
import faulthandler
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import cfc

D, LAYERS, VOCAB, T, B = 1024, 12, 32000, 256, 8


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, 16, 4 * D, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, t):
        return self.head(self.blocks(self.emb(t)))


def register(ddp, name):
    state = None
    if name == "noop":
        ddp.register_comm_hook(None, debugging_hooks.noop_hook)
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
        # cfc, cfc-auto (fallback="auto"), cfc@0.1 (rms=0.1), cfc-ag / cfc-rs (the all-gather or
        # the reduce-scatter; default: cfc's choice); any hook:capN sets bucket_cap_mb
        rms = float(name.split("@")[1]) if "@" in name else 0.3
        algorithm = "all-gather" if "-ag" in name else "reduce-scatter" if "-rs" in name else None
        state = cfc.CfcState(rms=rms, fallback="auto" if "auto" in name else False, algorithm=algorithm)
        ddp.register_comm_hook(state, cfc.cfc_hook)
    elif name != "allreduce":
        raise SystemExit(f"unknown hook {name}")
    return state


def run(name, rank, steps, warmup):
    """``name`` is a hook, optionally with ``:capN`` for DDP buckets of N MB (default 25)."""
    hook, _, cap = name.partition(":cap")
    torch.manual_seed(0)
    model = LM().cuda()
    ddp = DDP(model, device_ids=[rank], bucket_cap_mb=float(cap) if cap else None)
    state = register(ddp, hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    g = torch.Generator(device="cuda").manual_seed(rank)

    def step():
        t = torch.randint(0, VOCAB, (B, T), device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(ddp(t).flatten(0, 1).float(), t.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    if state is not None:
        state.reset_stats()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    extra = {}
    if state is not None:
        s = state.stats()
        extra = {k: s[k] for k in ("ratio", "max_error", "eps", "compressed_buckets", "plain_buckets", "direct_buckets")}
    nparams = sum(p.numel() for p in model.parameters())
    return times, extra, nparams


def main():
    p = argparse.ArgumentParser()
    p.add_argument("hooks", nargs="*", default=["noop", "allreduce", "fp16", "bf16", "powersgd4", "cfc", "cfc-auto", "noop"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--label", default=os.environ.get("LABEL", ""))
    p.add_argument("--json", default=None)
    p.add_argument("--watchdog", type=float, default=180, help="seconds a hook may take (0: no limit)")
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    rows = []
    for name in args.hooks:
        if args.watchdog:  # a hook that hangs prints every thread's stack and ends the run
            faulthandler.dump_traceback_later(args.watchdog, exit=True)
        times, extra, nparams = run(name, rank, args.steps, args.warmup)
        faulthandler.cancel_dump_traceback_later()
        torch.cuda.empty_cache()  # the last hook's model is gone
        t = torch.tensor(times, device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
        times = t.tolist()
        rows.append({"hook": name, "median_ms": 1e3 * statistics.median(times), "times": times, **extra})
        if rank == 0:
            print(f"  {args.label} {name}: median {rows[-1]['median_ms']:.1f} ms {extra}", flush=True)
    if rank == 0:
        noop = [r["median_ms"] for r in rows if r["hook"] == "noop"]
        floor = min(noop) if noop else None
        print(f"\nDDP step time, {nparams / 1e6:.0f}M-parameter LM, {dist.get_world_size()} GPUs, {args.label}: "
              f"median of {args.steps} steps after {args.warmup}")
        print("| hook | median step | x noop | ratio (bytes) | max error / eps |")
        print("|---|---|---|---|---|")
        for r in rows:
            x = f"{r['median_ms'] / floor:.2f}x" if floor else "-"
            ratio = f"{r['ratio']:.1f}x" if "ratio" in r else "-"
            err = f"{r['max_error'] / r['eps']:.2f}" if r.get("eps") else "-"
            print(f"| {r['hook']} | {r['median_ms']:.1f} ms | {x} | {ratio} | {err} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"label": args.label, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
