"""Train a byte-level transformer LM with DDP and a choice of gradient communication hooks.

The corpus is the Python standard library's own ``.py`` sources, which every Python ships
with. Run it under torchrun; it uses NCCL and one GPU per process when there are GPUs, gloo
and the CPU otherwise::

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --hook allreduce,cfc --steps 200

Several hooks (comma-separated) train one after the other from the same initial weights on the
same batches, and the run ends with a table: final loss of each (mean of the last 10% of steps)
against the first hook's, bytes sent per step, throughput. ``--out DIR`` writes the loss curves
as JSON, and as a PNG when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
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

HOOKS = ("allreduce", "fp16", "bf16", "powersgd", "cfc")


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


def register(ddp: DDP, hook: str, args):
    """Registers a hook; returns the cfc state (None for PyTorch's hooks)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "powersgd":
        st = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
        ddp.register_comm_hook(st, powerSGD_hook.powerSGD_hook)
    elif hook == "cfc":
        state = cfc.CfcState(rms=args.rms)
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


def train(hook: str, data: torch.Tensor, dev: torch.device, args) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = LM(args.d_model, args.layers, args.heads, args.seq).to(dev)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    state = register(ddp, hook, args)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # the same batches for every hook
    losses, tokens, t0 = [], 0, time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=gen)
        idx = starts[:, None] + torch.arange(args.seq + 1)
        chunk = data[idx].long().to(dev, non_blocking=True)
        x, y = chunk[:, :-1], chunk[:, 1:]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = ddp(x)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        tokens += x.numel() * world
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0 and (step % 5 == 4 or step == args.steps - 1):
            rate = tokens / (time.perf_counter() - t0)
            bar(step + 1, args.steps, f"{hook}: loss {losses[-1]:.3f}, {rate / 1e3:.1f}k tok/s")
    seconds = time.perf_counter() - t0
    if args.save is not None and rank == 0:
        # The trained weights, for examples/compress_model.py (the last hook's model wins).
        args.save.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.save)
    out = {"hook": hook, "losses": losses, "seconds": seconds, "tokens_per_s": tokens / seconds}
    if state is not None:
        s = state.stats()
        out["cfc"] = {k: s[k] for k in ("ratio", "bytes_sent", "bytes_uncompressed", "max_error", "eps", "compressed_buckets", "plain_buckets")}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hook", default="allreduce,cfc", help=f"comma-separated, from {', '.join(HOOKS)}")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--rms", type=float, default=0.3, help="cfc's bound, relative to the bucket's RMS")
    p.add_argument("--corpus-mb", type=float, default=16.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="directory for losses.json and losses.png")
    p.add_argument("--save", type=Path, default=None, help="save the trained model's state_dict here")
    args = p.parse_args()

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
    rank, world = dist.get_rank(), dist.get_world_size()
    data = corpus(int(args.corpus_mb * 2**20))
    if rank == 0:
        print(f"corpus: {data.numel() / 2**20:.1f} MiB of the standard library's .py files; "
              f"{world} ranks on {'NCCL/' + torch.cuda.get_device_name(dev) if use_cuda else 'gloo/CPU'}", flush=True)
    results = [train(h.strip(), data, dev, args) for h in args.hook.split(",")]

    if rank == 0:
        tail = max(1, args.steps // 10)
        base = sum(results[0]["losses"][-tail:]) / tail
        print(f"\n{'hook':<10} {'final loss':>10} {'vs ' + results[0]['hook']:>14} {'tok/s':>10} {'bytes/step':>12} {'fewer bytes':>12}")
        for r in results:
            final = sum(r["losses"][-tail:]) / tail
            r["final_loss"] = final
            line = f"{r['hook']:<10} {final:>10.4f} {100 * (final - base) / base:>+13.2f}% {r['tokens_per_s']:>10.0f}"
            if "cfc" in r:
                c = r["cfc"]
                line += f" {c['bytes_sent'] / args.steps:>12.0f} {c['ratio']:>11.1f}x"
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
                    ax.plot(r["losses"], label=r["hook"], linewidth=1)
                ax.set_xlabel("step")
                ax.set_ylabel("training loss (nats/byte)")
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
