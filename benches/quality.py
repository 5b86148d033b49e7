"""Training quality over seeds: every hook's held-out loss against plain all-reduce's, at every
tenth of training, on two model families, with the time each hook takes to reach plain's final
held-out loss.

Run it under torchrun: NCCL and one GPU per process where there are GPUs, gloo and the CPU
otherwise::

    torchrun --standalone --nproc_per_node=2 benches/quality.py --seeds 5 \\
        --hooks allreduce,cfc,cfc@0.1,cfc-noef,bf16,fp16,powersgd --png quality.png

Families (``--families``):

* ``lm``: the byte-level transformer LM of ``examples/ddp_train.py`` on the Python standard
  library's sources (the last 5% held out), AdamW, warm-up and cosine decay, bf16 autocast on
  GPUs;
* ``gpt2``: HuggingFace's GPT-2 (6 x 512, byte vocabulary, tied embeddings; needs
  ``transformers``) on the same corpus and schedule as ``lm``;
* ``conv``: a convolutional net learning a fixed random teacher of the same shape on Gaussian
  images (mean squared error over the teacher's output variance, so the optimum is 0 and the
  first step is near 1), Adam, the same schedule, a fixed held-out set.

For each family and seed every hook trains from the same initial weights on the same batches;
the held-out loss is scored at every tenth of the steps. The table gives, per hook and point,
the mean over seeds of ``held-out / plain's held-out - 1`` (same seed, same point) and its
standard error; then the bytes against a ring all-reduce of float32 (cfc's own count; PyTorch's
hooks: 2x for fp16/bf16) and the median over seeds of the wall time (training steps only) at
which the hook's held-out loss first reached plain's final one. The first hook is the
reference (``allreduce`` by default); a hook named twice is an A/A copy: on the CPU two runs
of one hook give the same bits, on GPUs they show the noise.

Hooks: ``allreduce`` (DDP's own), ``fp16``, ``bf16``, ``powersgd`` (rank 4), ``cfc`` (its
defaults, or ``--rms``), ``cfc@X`` (``rms=X``), ``cfc-bK`` and ``cfc-bK@X`` (block scales of
``K`` values: ``block=K``), ``cfc-noef`` and ``cfc-noef@X`` (no error
feedback). ``--fsdp`` trains with FSDP2 instead (``fully_shard`` on every transformer layer, or
the conv net whole, and on the model): ``allreduce`` is then FSDP's own float32 reduce-scatter,
``bf16`` its ``reduce_dtype=bfloat16``, and the ``cfc`` ways go through ``cfc.fsdp.register``
(``warmup_steps=0``, as its default; ``cfc`` and ``cfc@X`` with one step per FSDP group,
``cfc-bK`` and ``cfc-bK@X`` with block scales, ``cfc-r4`` and ``cfc-r4@X`` with residuals kept
in 4 bits, ``residual_bits=4``). ``--json`` keeps every curve; ``--png`` draws the mean gaps with their standard
error as bands (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import cfc  # noqa: E402
import ddp_train  # noqa: E402
from ddp_train import LM, batch, corpus, held_out_loss, lr_factor, start  # noqa: E402

POINTS = 10  # scored at every tenth of training


class Teacher(nn.Module):
    """The conv family's model (teacher and student alike): two 3x3 convolutions, a pooling
    and a linear map to 10 outputs."""

    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.GELU(),
            nn.Conv2d(width, width, 3, padding=1), nn.GELU(),
            nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(16 * width, 10))

    def forward(self, x):
        return self.body(x)


class ConvTask:
    """Images and the teacher's outputs for them; the teacher is fixed by the family, not by
    the seed, so that every seed learns the same function."""

    def __init__(self, args, dev):
        g = torch.Generator().manual_seed(4321)
        self.teacher = Teacher(args.width)
        with torch.no_grad():
            for p in self.teacher.parameters():
                # weights at He scale (their fan-in), biases small
                std = (2.0 / p[0].numel()) ** 0.5 if p.dim() > 1 else 0.1
                p.copy_(torch.randn(p.shape, generator=g) * std)
        self.teacher.to(dev).eval()
        self.heldout = torch.randn(512, 3, 16, 16, generator=g).to(dev)
        with torch.no_grad():
            self.heldout_y = self.teacher(self.heldout)
        self.scale = self.heldout_y.var().item()
        self.args, self.dev, self.lr = args, dev, args.conv_lr

    def model(self):
        return Teacher(self.args.width)

    def batch(self, gen):
        x = torch.randn(self.args.batch, 3, 16, 16, generator=gen).to(self.dev)
        with torch.no_grad():
            y = self.teacher(x)
        return x, y

    def loss(self, model, xy):
        x, y = xy
        return nn.functional.mse_loss(model(x), y) / self.scale

    @torch.no_grad()
    def held_out(self, model):
        return (nn.functional.mse_loss(model(self.heldout), self.heldout_y) / self.scale).item()


class LMTask:
    """The byte-level LM of examples/ddp_train.py."""

    def __init__(self, args, dev):
        data = corpus(int(args.corpus_mb * 2**20))
        split = data.numel() - data.numel() // 20
        self.data, self.heldout = data[:split], data[split:]
        self.args, self.dev, self.lr = args, dev, args.lr

    def model(self):
        a = self.args
        return LM(a.d_model, a.layers, a.heads, a.seq)

    def batch(self, gen):
        return batch(self.data, gen, self.args).to(self.dev)

    def loss(self, model, chunk):
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.dev.type == "cuda"):
            logits = model(chunk[:, :-1])
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())

    def held_out(self, model):
        return held_out_loss(model, self.heldout, self.dev, self.args)


class GPT2Task(LMTask):
    """The ``gpt2`` family: HuggingFace's GPT-2 (``transformers``; 6 layers of 512, 8 heads, a
    byte vocabulary, tied input and output embeddings) on the LM family's corpus, a model whose
    code cfc was not written against."""

    def model(self):
        from transformers import GPT2Config, GPT2LMHeadModel

        a = self.args
        cfg = GPT2Config(vocab_size=256, n_positions=a.seq, n_embd=512, n_layer=6, n_head=8,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return _Logits(GPT2LMHeadModel(cfg))


class _Logits(nn.Module):
    """A HuggingFace causal LM as the LM family's models are called: ids in, logits out."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids):
        return self.inner(input_ids=ids).logits


def cfc_state(hook: str, args, **extra):
    """The CfcState of a ``cfc``, ``cfc@X``, ``cfc-noef``, ``cfc-noef@X``, ``cfc-bK`` or
    ``cfc-bK@X`` way (``-bK``: block scales of K values)."""
    name, _, x = hook.partition("@")
    name, block = block_of(name)
    kw = {"error_feedback": name in ("cfc", "cfc-r4"), **extra}
    if x or args.rms is not None:
        kw["rms"] = float(x) if x else args.rms
    if block:
        kw["block"] = block
    return cfc.CfcState(**kw)


def block_of(name: str):
    """``cfc-b256`` -> (``cfc``, 256); other names -> (name, 0)."""
    head, _, tail = name.rpartition("-b")
    return (head, int(tail)) if head and tail.isdigit() else (name, 0)


def layers_of(model) -> list:
    """The transformer layers FSDP2 shards one by one: the LM's blocks, GPT-2's ``h``."""
    inner = getattr(getattr(model, "inner", None), "transformer", None)
    if inner is not None:
        return list(inner.h)
    return list(getattr(getattr(model, "blocks", None), "layers", []))


def sharded(task, hook: str, args, dev):
    """The task's model under FSDP2 with `hook`'s reduce-scatter; returns it and the cfc
    state (or None)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    name = block_of(hook.partition("@")[0])[0]
    if name not in ("allreduce", "bf16", "cfc", "cfc-noef", "cfc-r4"):
        raise SystemExit(f"{hook!r} is not a way of --fsdp (allreduce, bf16, cfc, cfc@X, cfc-bK@X, cfc-noef, cfc-r4)")
    model = task.model().to(dev)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if name == "bf16" else None)
    for layer in layers_of(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    state = None
    if name.startswith("cfc"):
        import cfc.fsdp

        state = cfc.fsdp.register(model, cfc_state(hook, args, warmup_steps=0),
                                  residual_bits=4 if name == "cfc-r4" else 32)
    return model, state


def register(ddp: DDP, hook: str, args):
    """Registers `hook` on `ddp`; returns the cfc state, or None. PyTorch's hooks as
    examples/ddp_train.py registers them; the cfc ways with this benchmark's options."""
    if block_of(hook.partition("@")[0])[0] in ("cfc", "cfc-noef"):
        state = cfc_state(hook, args)
        ddp.register_comm_hook(state, cfc.cfc_hook)
        return state
    return ddp_train.register(ddp, hook, args)


def fewer_bytes(hook: str, state) -> float:
    if state is not None:
        return state.stats()["ratio"]
    return {"fp16": 2.0, "bf16": 2.0}.get(hook.partition("@")[0], 1.0) if hook != "powersgd" else math.nan


def train(task, hook: str, seed: int, args, dev) -> dict:
    """One run: held-out loss and training wall time at every tenth of the steps."""
    rank = dist.get_rank()
    torch.manual_seed(seed)
    if args.fsdp:
        model, state = sharded(task, hook, args, dev)
        ddp = model  # (FSDP2 shards in place: the model is its own wrapper)
    else:
        model = task.model().to(dev)
        ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
        state = register(ddp, hook, args)
    opt = torch.optim.AdamW(ddp.parameters(), lr=task.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args))
    gen = torch.Generator().manual_seed(seed * 1000 + rank)  # the same batches for every hook
    marks = {max(1, round(args.steps * (i + 1) / POINTS)) for i in range(POINTS)}
    points, wall = [], 0.0
    early = None  # cfc's counters at 20% of training: the wire's parts are counted after it
    for step in range(1, args.steps + 1):
        if state is not None and early is None and step > args.steps // 5:
            early = state.stats()
        xy = task.batch(gen)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        loss = task.loss(ddp, xy)
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        wall += time.perf_counter() - t0
        if step in marks:
            points.append({"step": step, "held_out": task.held_out(model), "seconds": wall})
    out = {"hook": hook, "seed": seed, "points": points, "fewer_bytes": fewer_bytes(hook, state)}
    if state is not None:
        # where cfc's bytes went from 20% of training on (past the warm-up's plain steps and the
        # first steps' rounds; see print_table)
        s, e = state.stats(), early or {}
        out["bytes"] = {k: s[k] - e.get(k, 0) for k in ("bytes_sent", "frame_bytes", "slack_bytes",
                                                        "resends", "compressed_buckets")}
        state.close()
    return out


def labelled(hooks: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for h in hooks:
        seen[h] = seen.get(h, 0) + 1
        out.append(h if seen[h] == 1 else f"{h} ({seen[h]})")
    return out


def summarize(runs: list[dict], labels: list[str]) -> dict:
    """Per label: the mean gap to the reference (the first label) and its standard error at
    each point, the bytes, and the time to the reference's final held-out loss."""
    ref = labels[0]
    by = {(r["label"], r["seed"]): r for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    out = {}
    for label in labels:
        gaps = []  # per seed: the gap at each point
        times = []
        for s in seeds:
            mine, base = by[(label, s)]["points"], by[(ref, s)]["points"]
            gaps.append([m["held_out"] / b["held_out"] - 1 for m, b in zip(mine, base)])
            target = base[-1]["held_out"]
            times.append(next((m["seconds"] for m in mine if m["held_out"] <= target), math.inf))
        cols = list(zip(*gaps))
        mean = [statistics.fmean(c) for c in cols]
        se = [statistics.stdev(c) / math.sqrt(len(c)) if len(c) > 1 else math.nan for c in cols]
        out[label] = {
            "steps": [p["step"] for p in by[(label, seeds[0])]["points"]],
            "mean_gap": mean,
            "se": se,
            "fewer_bytes": statistics.fmean(by[(label, s)]["fewer_bytes"] for s in seeds),
            # (shares of cfc's bytes sent, where the runs kept them)
            "frames": _share(by, label, seeds, "frame_bytes"),
            "slack": _share(by, label, seeds, "slack_bytes"),
            "resends": _per_bucket(by, label, seeds),
            "time_to_target": statistics.median(times),
            "reached": sum(t < math.inf for t in times),
            "seeds": len(seeds),
        }
    return out


def _share(by: dict, label: str, seeds: list, key: str) -> float:
    """The mean over seeds of ``key``'s share of cfc's bytes sent (NaN where not kept)."""
    kept = [by[(label, s)].get("bytes") for s in seeds]
    if not all(kept) or not all(b["bytes_sent"] for b in kept):
        return math.nan
    return statistics.fmean(b[key] / b["bytes_sent"] for b in kept)


def _per_bucket(by: dict, label: str, seeds: list) -> float:
    """The mean over seeds of resends per compressed bucket (NaN where not kept)."""
    kept = [by[(label, s)].get("bytes") for s in seeds]
    if not all(kept) or not all(b.get("compressed_buckets") for b in kept):
        return math.nan
    return statistics.fmean(b["resends"] / b["compressed_buckets"] for b in kept)


def print_table(family: str, summary: dict, args) -> None:
    labels = list(summary)
    steps = summary[labels[0]]["steps"]
    how = "FSDP2" if args.fsdp else "DDP"
    print(f"\n{family}, {how}: held-out loss against {labels[0]}'s (mean over {summary[labels[0]]['seeds']} "
          f"seeds, +- standard error), at each tenth of {steps[-1]} steps")
    print("| hook | " + " | ".join(f"{100 * (i + 1) // POINTS}%" for i in range(len(steps)))
          + " | fewer bytes | time to the reference's final loss |")
    print("|---|" + "---|" * len(steps) + "---|---|")
    for label, s in summary.items():
        cells = [f"{100 * m:+.2f}% +- {100 * e:.2f}" if not math.isnan(e) else f"{100 * m:+.2f}%"
                 for m, e in zip(s["mean_gap"], s["se"])]
        t = (f"{s['time_to_target']:.1f} s ({s['reached']}/{s['seeds']} seeds)" if s["reached"] * 2 > s["seeds"]
             else f"not reached ({s['reached']}/{s['seeds']} seeds)")
        b = "-" if math.isnan(s["fewer_bytes"]) else f"{s['fewer_bytes']:.1f}x"
        print(f"| {label} | " + " | ".join(cells) + f" | {b} | {t} |")
    wire = {label: s for label, s in summary.items() if not math.isnan(s.get("frames", math.nan))}
    if wire:
        # frames: the compressed frames themselves; slack: slot bytes frames did not fill (and
        # tails' padding); the rest: rows' heads and block exponents, rounds of their own, plain
        # buckets. Resends: exchanges that took a second round for the tails of frames that
        # outgrew their slots, per compressed bucket.
        print(f"\n{family}: where cfc's bytes sent from 20% of training on went (mean share over seeds)")
        print("| hook | frames | slack | the rest | second rounds per bucket |")
        print("|---|---|---|---|---|")
        for label, s in wire.items():
            rest = 1 - s["frames"] - s["slack"]
            print(f"| {label} | {100 * s['frames']:.1f}% | {100 * s['slack']:.1f}% | {100 * rest:.1f}% "
                  f"| {s['resends']:.2f} |")


def draw(path: Path, summaries: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summaries), figsize=(6 * len(summaries), 4), squeeze=False)
    for ax, (family, summary) in zip(axes[0], summaries.items()):
        for label, s in list(summary.items())[1:]:
            m = [100 * v for v in s["mean_gap"]]
            e = [0.0 if math.isnan(v) else 100 * v for v in s["se"]]
            line, = ax.plot(s["steps"], m, "o-", markersize=3, label=label)
            ax.fill_between(s["steps"], [a - b for a, b in zip(m, e)], [a + b for a, b in zip(m, e)],
                            color=line.get_color(), alpha=0.2)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_title(f"{family}: held-out loss vs {list(summary)[0]}")
        ax.set_xlabel("step")
        ax.set_ylabel("gap (%), mean +- s.e. over seeds")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summarize_saved(args) -> None:
    """The tables and PNG of a saved --json, from its runs: a run cut short counts the seeds
    that every hook finished."""
    summaries, merged = {}, {}
    for path in args.summarize:  # (files of one setup split by --first-seed add up)
        saved = json.loads(path.read_text())
        args.fsdp = saved["args"].get("fsdp") == "True"
        for family, runs in saved["runs"].items():
            merged.setdefault(family, {}).update({(r["label"], r["seed"]): r for r in runs})
    for family, runs in merged.items():
        summarize_family(summaries, family, list(runs.values()), args)
    if args.png is not None:
        draw(args.png, summaries)


def summarize_family(summaries: dict, family: str, runs: list, args) -> None:
    """Adds the table of one family's saved runs, over the seeds every hook finished."""
    labels = list(dict.fromkeys(r["label"] for r in runs))
    done = [s for s in sorted({r["seed"] for r in runs})
            if {r["label"] for r in runs if r["seed"] == s} == set(labels)]
    runs = [r for r in runs if r["seed"] in done]
    if runs:
        name = family + (" (FSDP2)" if args.fsdp else "")
        summaries[name] = summarize(runs, labels)
        print_table(family, summaries[name], args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default="lm,conv")
    p.add_argument("--hooks", default="allreduce,cfc,cfc@0.1,cfc-noef,bf16,fp16,powersgd",
                   help="comma-separated; the first is the reference")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=2e-3,
                   help="lm and gpt2: the peak learning rate (gpt2 at 2e-3 over 600 steps: plain's seeds end 27%% "
                        "apart, too far to rank ways; 6e-4 kept them within 1.3%%: docs/performance.md)")
    p.add_argument("--conv-lr", type=float, default=3e-4, help="conv: the peak learning rate")
    p.add_argument("--clip", type=float, default=1.0, help="clip the gradient norm at this (0: no clipping)")
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine")
    p.add_argument("--rms", type=float, default=None, help="cfc's bound for `cfc` (default: CfcState's)")
    p.add_argument("--batch", type=int, default=16, help="examples per rank and step")
    p.add_argument("--seq", type=int, default=256, help="lm: bytes per sequence")
    p.add_argument("--d-model", type=int, default=256, help="lm")
    p.add_argument("--layers", type=int, default=4, help="lm")
    p.add_argument("--heads", type=int, default=8, help="lm")
    p.add_argument("--eval-batches", type=int, default=8, help="lm: held-out batches per scoring")
    p.add_argument("--corpus-mb", type=float, default=16.0, help="lm")
    p.add_argument("--width", type=int, default=64, help="conv: channels")
    p.add_argument("--fsdp", action="store_true", help="train with FSDP2 (see above)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="seeds first-seed .. first-seed + seeds - 1 (a run split over calls; --summarize joins them)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--png", type=Path, default=None)
    p.add_argument("--summarize", type=Path, nargs="+", default=None,
                   help="no training: the tables (and --png) of --json files, over the seeds every hook finished")
    args = p.parse_args()
    if args.summarize is not None:
        return summarize_saved(args)
    dev = start()
    rank = dist.get_rank()
    hooks = [h.strip() for h in args.hooks.split(",") if h.strip()]
    labels = labelled(hooks)
    tasks = {"lm": LMTask, "conv": ConvTask, "gpt2": GPT2Task}
    summaries, everything = {}, {}

    def write_json() -> None:
        # Rewritten after every seed, so that a run cut short keeps the seeds it finished.
        if rank == 0 and args.json is not None:
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "summaries": summaries, "runs": everything}, indent=1))

    for family in [f.strip() for f in args.families.split(",") if f.strip()]:
        if family not in tasks:
            raise SystemExit(f"unknown family {family!r}; choose from {', '.join(tasks)}")
        task = tasks[family](args, dev)
        runs = everything[family] = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for hook, label in zip(hooks, labels):
                r = train(task, hook, seed, args, dev)
                r["label"] = label
                runs.append(r)
                if rank == 0:
                    last = r["points"][-1]
                    print(f"{family} seed {seed} {label}: held-out {last['held_out']:.4f} "
                          f"after {last['seconds']:.1f} s", flush=True)
            write_json()
        summaries[family] = summarize(runs, labels)
        if rank == 0:  # (each family's table as soon as it is done)
            print_table(family, summaries[family], args)
    write_json()
    if rank == 0:
        if args.png is not None:
            try:
                draw(args.png, summaries)
            except ImportError:
                print("(no matplotlib: no PNG)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
