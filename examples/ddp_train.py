"""Train a byte-level transformer LM with DDP and a choice of gradient communication hooks.

The corpus is the Python standard library's own ``.py`` sources, which every Python ships
with. Run it under torchrun; it uses NCCL and one GPU per process when there are GPUs, gloo
and the CPU otherwise::

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --hook allreduce,cfc --steps 200

Several hooks (comma-separated; ``cfc@0.1`` is cfc with ``rms=0.1``) train one after the
other from the same initial weights on the same batches, and the run ends with a table per
hook: the final training loss (mean of the last 10% of steps) and the final held-out loss
(bytes of the corpus's last 5%, never trained on, scored every tenth of the run), each against
the first hook's; bytes sent per step; throughput. ``--out DIR`` writes the loss curves as
JSON, and as a PNG when matplotlib is installed.

The recipe is a usual one for LMs: AdamW, a 20-step warm-up, cosine decay to a tenth of the
learning rate at the last step (``--schedule``), the gradient norm clipped at 1 (``--clip``).
``--deterministic`` makes two runs of one hook give the same losses bit for bit (deterministic
kernels, attention by its plain math form), so that a difference between hooks is the hooks'
own and not the GPU's scheduling.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cfc

HOOKS = ("allreduce", "fp16", "bf16", "powersgd", "cfc", "cfc@X")


def corpus(limit: int) -> torch.Tensor:
    """The standard library's .py files, concatenated in sorted order, as bytes (uint8)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for f in sorted(root.rglob("*.py")):
        if "site-packages" in f.parts:
            continue
        try:
            b = f.read_bytes()
        except OSError:
            continue
        chunks.append(b)
        total += len(b)
        if total >= limit:
            break
    data = b"".join(chunks)[:limit]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class LM(nn.Module):
    """A small causal transformer over bytes."""

    def __init__(self, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, t):
        x = self.emb(t) + self.pos[: t.shape[1]]
        x = self.blocks(x, mask=self.mask[: t.shape[1], : t.shape[1]], is_causal=True)
        return self.head(self.norm(x))


def start() -> torch.device:
    """This rank's device, its process group started (under torchrun): NCCL and one GPU per
    process where there are enough GPUs, gloo and the CPU (its cores shared out) otherwise."""
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun, e.g. torchrun --standalone --nproc_per_node=2 " + sys.argv[0])
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    if use_cuda:
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ["LOCAL_WORLD_SIZE"])))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return dev


def register(ddp: DDP, hook: str, args):
    """Registers a hook; returns the cfc state (None for PyTorch's hooks). ``cfc@X`` is cfc
    with ``rms=X`` (default ``--rms``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "powersgd":
        st = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
        ddp.register_comm_hook(st, powerSGD_hook.powerSGD_hook)
    elif hook.partition("@")[0] == "cfc":
        name, _, x = hook.partition("@")
        try:
            rms = float(x) if x else args.rms
        except ValueError:
            raise SystemExit(f"{name}@X needs a number X (rms), got {hook!r}") from None
        state = cfc.CfcState() if rms is None else cfc.CfcState(rms=rms)
        ddp.register_comm_hook(state, cfc.cfc_hook)
        return state
    elif hook != "allreduce":
        raise SystemExit(f"unknown hook {hook!r}; choose from {', '.join(HOOKS)}")
    return None


def bar(i: int, n: int, text: str) -> None:
    done = int(30 * i / n)
    sys.stderr.write(f"\r  [{'#' * done}{'.' * (30 - done)}] {i}/{n} {text}")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()


def batch(data: torch.Tensor, gen: torch.Generator, args) -> torch.Tensor:
    """``args.batch`` random windows of ``args.seq + 1`` bytes."""
    starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=gen)
    return data[starts[:, None] + torch.arange(args.seq + 1)].long()


def save_grads(model, folder):
    """The gradients of the model's 5 largest parameters, as float32 .npy files in ``folder``
    (kept if the folder holds some already: the first hook's run, plain all-reduce in the demo)."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.glob("*.npy")):
        return
    named = sorted(((n, p) for n, p in model.named_parameters() if p.grad is not None),
                   key=lambda np_: -np_[1].numel())[:5]
    for name, p in named:
        np.save(folder / f"{name.replace('.', '_')}.npy", p.grad.detach().float().flatten().cpu().numpy())


@torch.no_grad()
def held_out_loss(model: nn.Module, heldout: torch.Tensor, dev: torch.device, args) -> float:
    """Mean loss on ``args.eval_batches`` fixed batches of held-out bytes (the same for every
    hook, seed and step), split over the ranks. Every rank runs as many forward passes as the
    others (a sharded model's forward is a collective): a rank past the last batch runs the
    first one again and does not count it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1234)
    chunks = [batch(heldout, gen, args) for _ in range(args.eval_batches)]
    total = torch.zeros(2, dtype=torch.float64, device=dev)
    for i in range(rank, -(-len(chunks) // world) * world, world):
        chunk = chunks[i if i < len(chunks) else 0].to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = model(chunk[:, :-1])
        if i >= len(chunks):
            continue
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        total += torch.stack([loss.double(), torch.tensor(chunk[:, 1:].numel(), dtype=torch.float64, device=dev)])
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def lr_factor(step: int, args) -> float:
    """The learning rate's multiplier at ``step``: linear warm-up over 20 steps, then constant
    or a cosine decay to 0.1 at the last step."""
    if step < 20:
        return (step + 1) / 20
    if args.schedule == "constant":
        return 1.0
    done = (step - 20) / max(1, args.steps - 21)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, done)))


def train(hook: str, data: torch.Tensor, heldout: torch.Tensor, dev: torch.device, args) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = LM(args.d_model, args.layers, args.heads, args.seq).to(dev)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    state = register(ddp, hook, args)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args))
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # the same batches for every hook
    every = args.eval_every or max(1, args.steps // 10)
    losses, evals, tokens, t0 = [], [], 0, time.perf_counter()
    scoring = 0.0  # seconds of held-out scoring, left out of the training throughput
    for step in range(args.steps):
        chunk = batch(data, gen, args).to(dev, non_blocking=True)
        x, y = chunk[:, :-1], chunk[:, 1:]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = ddp(x)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        if args.save_grads is not None and rank == 0 and step == args.steps - 1:
            save_grads(model, args.save_grads)
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tokens += x.numel() * world
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if args.eval_batches and ((step + 1) % every == 0 or step == args.steps - 1):
            t_eval = time.perf_counter()
            evals.append((step + 1, held_out_loss(model, heldout, dev, args)))
            scoring += time.perf_counter() - t_eval
        if rank == 0 and (step % 5 == 4 or step == args.steps - 1):
            rate = tokens / (time.perf_counter() - t0 - scoring)
            bar(step + 1, args.steps, f"{hook}: loss {losses[-1]:.3f}, {rate / 1e3:.1f}k tok/s")
    seconds = time.perf_counter() - t0 - scoring  # training steps only
    if args.save is not None and rank == 0:
        # The trained weights, for examples/compress_model.py (the last hook's model wins).
        args.save.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.save)
    out = {"hook": hook, "losses": losses, "held_out": evals, "seconds": seconds, "tokens_per_s": tokens / seconds}
    if state is not None:
        s = state.stats()
        out["cfc"] = {k: s[k] for k in ("ratio", "bytes_sent", "bytes_uncompressed", "max_error", "eps", "compressed_buckets", "plain_buckets")}
        state.close()  # its engine (thread, links, NCCL communicator), before the next hook's run
    return out


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help: the module's docs as written (without their reStructuredText markup), and every
    option's default."""


def _described(doc: str) -> str:
    """The module's docs for --help: ``code`` as `code`, a literal block's "::" as ":"."""
    return doc.replace("``", "`").replace("::\n", ":\n")


def main() -> None:
    p = argparse.ArgumentParser(description=_described(__doc__), formatter_class=_HelpFormatter)
    p.add_argument("--hook", default="allreduce,cfc", help=f"comma-separated, from {', '.join(HOOKS)}")
    p.add_argument("--steps", type=int, default=200, help="training steps of each hook")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=128, help="bytes per sequence")
    p.add_argument("--d-model", type=int, default=128, help="the transformer's width")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads per block")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW's peak learning rate")
    p.add_argument("--rms", type=float, default=None, help="cfc's bound, relative to the bucket's RMS (default: CfcState's)")
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                   help="learning rate after the warm-up: cosine decay to 0.1 x --lr, or constant")
    p.add_argument("--clip", type=float, default=1.0, help="clip the gradient norm at this (0: no clipping)")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches per scoring (0: none)")
    p.add_argument("--eval-every", type=int, default=0, help="score held-out bytes every N steps (default: steps / 10)")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels: two runs of one hook give the same losses bit for bit")
    p.add_argument("--corpus-mb", type=float, default=16.0, help="MB of the standard library's sources to train on")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    p.add_argument("--out", type=Path, default=None, help="directory for losses.json and losses.png")
    p.add_argument("--save", type=Path, default=None, help="save the trained model's state_dict here")
    p.add_argument("--save-grads", type=Path, default=None, metavar="DIR",
                   help="save the last step's averaged gradients of the 5 largest parameters as .npy files "
                        "(float32), for examples/compress_demo.py and the benchmarks' --grads; the first hook's run "
                        "writes them")
    args = p.parse_args()

    if args.deterministic:
        # cuBLAS needs this before its first use to pick deterministic reductions
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    dev = start()
    use_cuda = dev.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    data = corpus(int(args.corpus_mb * 2**20))
    split = data.numel() - data.numel() // 20  # the last 5%: held out
    data, heldout = data[:split], data[split:]
    if rank == 0:
        print(f"corpus: {(data.numel() + heldout.numel()) / 2**20:.1f} MiB of the standard library's .py files "
              f"(the last 5% held out); "
              f"{world} ranks on {'NCCL/' + torch.cuda.get_device_name(dev) if use_cuda else 'gloo/CPU'}", flush=True)
    attention = contextlib.nullcontext()
    if args.deterministic:  # the fused attention kernels' backward passes accumulate in any order
        from torch.nn.attention import SDPBackend, sdpa_kernel

        attention = sdpa_kernel(SDPBackend.MATH)
    with attention:
        results = [train(h.strip(), data, heldout, dev, args) for h in args.hook.split(",")]

    if rank == 0:
        tail = max(1, args.steps // 10)
        for r in results:
            r["final_loss"] = sum(r["losses"][-tail:]) / tail
            r["final_held_out"] = r["held_out"][-1][1] if r["held_out"] else math.nan
        first = results[0]
        vs = "vs " + first["hook"]
        print(f"\n{'hook':<10} {'final loss':>10} {vs:>14} {'held-out':>10} {vs:>14} {'tok/s':>10} "
              f"{'bytes/step/rank':>15} {'fewer bytes':>12}")
        for r in results:
            line = (f"{r['hook']:<10} {r['final_loss']:>10.4f} {100 * (r['final_loss'] / first['final_loss'] - 1):>+13.2f}% "
                    f"{r['final_held_out']:>10.4f} {100 * (r['final_held_out'] / first['final_held_out'] - 1):>+13.2f}% "
                    f"{r['tokens_per_s']:>10.0f}")
            if "cfc" in r:
                c = r["cfc"]
                line += f" {c['bytes_sent'] / args.steps:>15.0f} {c['ratio']:>11.1f}x"
            print(line)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "losses.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
            try:
                import matplotlib

                matplotlib.use("Agg")
                import matplotlib.pyplot as plt

                fig, ax = plt.subplots(figsize=(7, 4))
                for r in results:
                    line, = ax.plot(r["losses"], label=r["hook"], linewidth=1, alpha=0.8)
                    if r["held_out"]:
                        steps, held = zip(*r["held_out"])
                        ax.plot(steps, held, "o--", color=line.get_color(), markersize=3, linewidth=1,
                                label=f"{r['hook']} (held-out)")
                ax.set_xlabel("step")
                ax.set_ylabel("loss (nats/byte)")
                ax.set_ylim(top=min(6.0, max(max(r["losses"]) for r in results)))
                ax.legend()
                fig.tight_layout()
                fig.savefig(args.out / "losses.png", dpi=120)
                print(f"wrote {args.out / 'losses.json'} and {args.out / 'losses.png'}")
            except ImportError:
                print(f"wrote {args.out / 'losses.json'} (install matplotlib for the plot)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
