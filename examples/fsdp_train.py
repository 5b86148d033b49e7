"""Train the byte-level transformer LM of ``ddp_train.py`` with FSDP2 (``fully_shard``), its
gradients reduce-scattered plainly in float32, plainly in bfloat16 (``reduce_dtype``), or by cfc
(``cfc.fsdp.register``). Under torchrun; NCCL and one GPU per process where there are GPUs,
gloo and the CPU otherwise::

    torchrun --standalone --nproc_per_node=2 examples/fsdp_train.py --comm plain,cfc --steps 100
    # about 1B parameters (the size FSDP is for), on GPUs:
    torchrun --standalone --nproc_per_node=2 examples/fsdp_train.py --d-model 2048 --layers 20 \\
        --heads 16 --seq 256 --batch 8

Each way trains from the same initial weights on the same batches, and the run ends with a
table: final training loss (mean of the last 10% of steps) and held-out loss, each against the
first way's, the median step time (and its spread over rounds), cfc's bytes against plain
float32's ("fewer bytes"), "resends" (exchanges in which a compressed frame outgrew the slot
sized for it and went a second time: each costs a round trip) and the share of FSDP's calls
that went compressed ("compressed"; below 100% where ``fallback="auto"`` chose plain). ``noop`` moves no
gradients at all (each rank keeps its own shard): the floor for the step time. ``cfc-auto`` is
cfc with ``fallback="auto"``: each group is timed both ways over the first steps and keeps the
faster (plain where compression does not pay, as over NVLink). ``cfc-r4`` is cfc with
residuals kept in 4 bits (``residual_bits=4``), ``cfc-rice`` cfc whose frames are Rice-coded
(``coder="rice"``). A cfc way quantizes each FSDP group with one
step; ``-bK`` after it (``cfc-b256``, ``cfc-auto-b256@0.3``) gives it block scales of ``K``
values (``CfcState(block=K)``, as ``cfc.fsdp.register``'s own state has).

Step times of ways run one after the other drift (clocks, the allocator, the link), so
``--rounds N`` trains every way N times, each round in a rotated order, and reports each way's
median over the rounds with their spread; a way named twice (``--comm plain,cfc,plain``) is an
A/A copy that shows the noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import cfc
import cfc.fsdp
from ddp_train import LM, batch, corpus, held_out_loss, lr_factor

WAYS = ("noop", "plain", "bf16", "cfc", "cfc@X", "cfc-auto", "cfc-auto@X", "cfc-r4", "cfc-r4@X", "cfc-rice",
        "cfc-rice@X")


class NoComm(cfc.fsdp._ReduceScatter):  # type: ignore[misc,valid-type]
    """The floor: each rank keeps its own shard of its own gradients (no traffic; the model
    then trains on one rank's data per shard, so only its step time means anything)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])
        return None


def block_of(way: str) -> int:
    """The block size of a ``...-bK`` way (``cfc-b256@0.3`` -> 256), or 0."""
    head, _, tail = way.partition("@")[0].rpartition("-b")
    return int(tail) if head and tail.isdigit() else 0


def base_of(way: str) -> str:
    """A way's name without its bound and block size (``cfc-auto-b256@0.3`` -> ``cfc-auto``)."""
    name = way.partition("@")[0]
    return name.rpartition("-b")[0] if block_of(way) else name


def build(way: str, dev: torch.device, args) -> tuple:
    torch.manual_seed(args.seed)
    model = LM(args.d_model, args.layers, args.heads, args.seq).to(dev)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if way == "bf16" else None)
    for layer in model.blocks.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    state = None
    if way == "noop":
        for m in model.modules():
            if hasattr(m, "set_custom_reduce_scatter"):
                m.set_custom_reduce_scatter(NoComm())
    if way.startswith("cfc"):
        rms = float(way.split("@", 1)[1]) if "@" in way else args.rms
        fallback = "auto" if way.startswith("cfc-auto") else "never"
        block = block_of(way)
        bound = {} if rms is None else {"rms": rms}
        if block:
            bound["block"] = block
        coder = "rice" if way.startswith("cfc-rice") else "planes"
        state = cfc.fsdp.register(model, cfc.CfcState(**bound, warmup_steps=0, fallback=fallback, coder=coder),
                                  residual_bits=4 if way.startswith("cfc-r4") else 32)
    return model, state


def train(way: str, data: torch.Tensor, heldout: torch.Tensor, dev: torch.device, args) -> dict:
    rank = dist.get_rank()
    model, state = build(way, dev, args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    losses, times = [], []
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_factor(step, args)
        chunk = batch(data, gen, args).to(dev)
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = model(chunk[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
        if rank == 0 and (step + 1) % max(1, args.steps // 5) == 0:
            # a progress line (stderr: the table on stdout stays clean)
            print(f"  {way}: step {step + 1}/{args.steps}, loss {losses[-1]:.3f}, "
                  f"{1e3 * statistics.median(times):.0f} ms/step", file=sys.stderr, flush=True)
    out = {
        "final": statistics.mean(losses[-max(1, args.steps // 10):]),
        "held_out": held_out_loss(model, heldout, dev, args) if args.eval_batches else float("nan"),
        "step_ms": 1e3 * statistics.median(times[len(times) // 5:]),
        "params": sum(p.numel() for p in model.parameters()),
    }
    if state is not None:
        out["stats"] = state.stats()
        state.close()
    return out


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help: the module's docs as written (without their reStructuredText markup), and every
    option's default."""


def _described(doc: str) -> str:
    """The module's docs for --help: ``code`` as `code`, a literal block's "::" as ":"."""
    return doc.replace("``", "`").replace("::\n", ":\n")


def main() -> None:
    p = argparse.ArgumentParser(description=_described(__doc__), formatter_class=_HelpFormatter)
    p.add_argument("--comm", default="plain,cfc", help=f"comma-separated, from {', '.join(WAYS)}")
    p.add_argument("--steps", type=int, default=100, help="training steps of each way")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=128, help="bytes per sequence")
    p.add_argument("--d-model", type=int, default=128, help="the transformer's width")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads per block")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW's peak learning rate")
    p.add_argument("--rms", type=float, default=None, help="cfc's bound, relative to each group's RMS (default: CfcState's)")
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                   help="learning rate after the warm-up: cosine decay to 0.1 x --lr, or constant")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches scored at the end")
    p.add_argument("--corpus-mb", type=float, default=16.0, help="MB of the standard library's sources to train on")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    p.add_argument("--rounds", type=int, default=1, help="train every way this many times, in rotated orders")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    data = corpus(int(args.corpus_mb * 2**20))
    cut = int(data.numel() * 0.95)
    train_data, heldout = data[:cut], data[cut:]
    ways = args.comm.split(",")
    known = {w.split("@")[0] for w in WAYS}
    for way in ways:
        if base_of(way) not in known:
            raise SystemExit(f"{way!r} is not a way: {', '.join(WAYS)}")
    # A way named twice is an A/A copy: labelled "plain#2", trained alike.
    labels = [w if ways[:i].count(w) == 0 else f"{w}#{ways[:i].count(w) + 1}" for i, w in enumerate(ways)]
    results: dict = {label: [] for label in labels}
    for r in range(args.rounds):
        turn = r % len(ways)
        for way, label in list(zip(ways, labels))[turn:] + list(zip(ways, labels))[:turn]:
            results[label].append(train(way, train_data, heldout, dev, args))
    if rank == 0:
        first = results[labels[0]][0]
        print(f"{first['params'] / 1e6:.1f}M parameters, {dist.get_world_size()} ranks, {dev.type}, "
              f"{args.rounds} round(s), step ms: median over rounds (min-max)")
        print(f"{'way':10} {'final loss':>11} {'vs first':>9} {'held-out':>9} {'vs first':>9} {'step ms':>8} "
              f"{'min-max':>13} {'fewer bytes':>12} {'resends':>8} {'compressed':>11}")
        for label in labels:
            runs = results[label]
            r, ms = runs[0], [x["step_ms"] for x in runs]
            fewer = f"{r['stats']['ratio']:.1f}x" if "stats" in r else ""
            resends = r["stats"]["resends"] if "stats" in r else ""
            # (the share of cfc's reduce-scatter calls that went compressed)
            calls = r["stats"]["compressed_buckets"] + r["stats"]["plain_buckets"] if "stats" in r else 0
            compressed = f"{100 * r['stats']['compressed_buckets'] / calls:.0f}%" if calls else ""
            print(f"{label:10} {r['final']:11.4f} {100 * (r['final'] / first['final'] - 1):+8.2f}% "
                  f"{r['held_out']:9.4f} {100 * (r['held_out'] / first['held_out'] - 1):+8.2f}% "
                  f"{statistics.median(ms):8.1f} {f'{min(ms):.1f}-{max(ms):.1f}':>13} {fewer:>12} {resends:>8} {compressed:>11}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
