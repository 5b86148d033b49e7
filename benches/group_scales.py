"""How one quantization step per group treats each parameter: the byte-level LM of
``examples/ddp_train.py``, trained on one process (AdamW, the quality benchmark's learning rate),
and at chosen steps, for each parameter, its gradient's RMS and, for a bound of ``--rms`` x RMS,
the step ``eps`` it gets and the share of its values below ``eps`` (values that round to 0):

* ``ddp``: one step per DDP bucket (parameters in reverse order, the first bucket 1 MiB, then
  25 MiB: DDP's defaults);
* ``fsdp``: one step per FSDP2 group (each transformer layer, and the root: embeddings, head,
  final norm), as ``cfc.fsdp.register`` sends them with a state of ``block=0``;
* ``fsdp+blocks``: the same groups with block scales of 256 values (``CfcState(block=256)``,
  ``cfc.fsdp.register``'s own state): each block of the group's values gets ``k`` x its own RMS,
  rounded down to a power of two (its "eps / RMS" here is the median over the parameter's values).

No process group and no cfc engine: the steps are computed from the gradients as the engine's
rms rule sets them (k x the RMS of the group's values, or of the block's). Run::

    python benches/group_scales.py --steps 1,60
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from ddp_train import LM, corpus  # noqa: E402


def groupings(model: torch.nn.Module) -> dict:
    """Parameter name -> group, for DDP's buckets and FSDP's groups."""
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    fsdp = {n: (n.split(".")[2] if n.startswith("blocks.layers.") else "root") for n in names}
    ddp, bucket, size, cap = {}, 0, 0, 1 << 20
    for n in reversed(names):
        s = params[n].numel() * params[n].element_size()
        if size + s > cap and size > 0:
            bucket, size, cap = bucket + 1, 0, 25 << 20
        ddp[n] = bucket
        size += s
    return {"ddp": ddp, "fsdp": fsdp}


BLOCK = 256


def block_eps(values: torch.Tensor, k: float) -> torch.Tensor:
    """Each value's step under block scales: ``k`` x its block's RMS, rounded down to a power
    of two (blocks of :data:`BLOCK` values in the group's order; the last one shorter)."""
    n = values.numel()
    padded = torch.zeros(-(-n // BLOCK) * BLOCK)
    padded[:n] = values
    sums = padded.view(-1, BLOCK).pow(2).sum(1)
    counts = torch.full_like(sums, BLOCK)
    counts[-1] = n - BLOCK * (counts.numel() - 1)
    eps = k * (sums / counts).sqrt()
    eps = torch.where(eps > 0, torch.exp2(torch.floor(torch.log2(eps))), torch.zeros_like(eps))
    return eps.repeat_interleave(BLOCK)[:n]


def table(model: torch.nn.Module, k: float) -> list:
    grads = {n: p.grad.detach().float().reshape(-1) for n, p in model.named_parameters()}
    rows = []
    for label, grouping in groupings(model).items():
        for blocks in ((False, True) if label == "fsdp" else (False,)):
            for n, g in grads.items():
                members = [m for m in grads if grouping[m] == grouping[n]]
                values = torch.cat([grads[m] for m in members])
                if blocks:
                    at = sum(grads[m].numel() for m in members[: members.index(n)])
                    eps = block_eps(values, k)[at : at + g.numel()]
                else:
                    eps = torch.full_like(g, k * values.pow(2).mean().sqrt().item())
                rms = g.pow(2).mean().sqrt().item()
                rows.append((label + ("+blocks" if blocks else ""), n, g.numel(), rms, eps.median().item() / rms,
                             (g.abs() < eps).float().mean().item()))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", default="1,60", help="report at these steps")
    p.add_argument("--rms", type=float, default=0.05, help="the bound, x RMS")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--corpus-mb", type=float, default=4.0)
    p.add_argument("--all", action="store_true", help="every parameter (default: the embeddings, head, norms)")
    args = p.parse_args()
    torch.manual_seed(0)
    model = LM(args.d_model, args.layers, args.heads, args.seq)
    data = corpus(int(args.corpus_mb * 1e6))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    report = sorted(int(s) for s in args.steps.split(","))
    for step in range(1, report[-1] + 1):
        starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=gen)
        x = data[starts[:, None] + torch.arange(args.seq + 1)].long()
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1))
        loss.backward()
        if step in report:
            rows = table(model, args.rms)
            shown = [r for r in rows if args.all or not r[1].startswith("blocks.") or r[1].startswith("blocks.layers.0.")]
            print(f"\nstep {step}, bound {args.rms} x RMS of each group's values:")
            print("| grouping | parameter | elements | RMS | eps / RMS | values below eps |")
            print("|---|---|---|---|---|---|")
            for label, n, numel, rms, ratio, below in shown:
                print(f"| {label} | {n} | {numel} | {rms:.2e} | {ratio:.3f} | {100 * below:.1f}% |")
        opt.step()
        opt.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
