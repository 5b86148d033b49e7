"""How far apart the gradient scales of one DDP bucket's parameters are: the case for
``CfcState(per_tensor=True)``.

Trains the byte-level LM of ``examples/ddp_train.py`` (the parity configuration: d=256, 4
layers, batch 32 x 256 bytes) plainly on the CPU, one process, and at the given steps prints
each parameter's gradient RMS against the RMS of all of them (the model fits one bucket), and
the share of its elements below 0.3 x that overall RMS (what a bucket-wide bound of ``rms=0.3``
rounds to zero)::

    python benches/grad_scales.py --steps 60
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import ddp_train  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--show", type=int, nargs="*", default=None, help="steps to print (default: the last)")
    p.add_argument("--bound", type=float, default=0.3, help="the bucket-wide bound, as a multiple of its RMS")
    args = p.parse_args()
    args.batch, args.seq, args.d_model, args.layers, args.heads = 32, 256, 256, 4, 8
    show = set(args.show or [args.steps - 1])
    torch.manual_seed(0)
    data = ddp_train.corpus(4 << 20)
    model = ddp_train.LM(args.d_model, args.layers, args.heads, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        chunk = ddp_train.batch(data, gen, args)
        loss = nn.functional.cross_entropy(model(chunk[:, :-1]).flatten(0, 1), chunk[:, 1:].flatten())
        loss.backward()
        if step in show:
            grads = [(n, q.grad) for n, q in model.named_parameters()]
            whole = torch.cat([g.flatten() for _, g in grads]).pow(2).mean().sqrt()
            print(f"\nstep {step}: loss {float(loss):.3f}; gradient RMS of the whole model {float(whole):.3g}")
            print(f"| parameter | elements | RMS / whole | below {args.bound} x whole |")
            print("|---|---|---|---|")
            rows = sorted((float(g.pow(2).mean().sqrt() / whole), n, g.numel(),
                           float((g.abs() < args.bound * whole).float().mean())) for n, g in grads)
            for r, n, k, below in rows:
                print(f"| {n} | {k} | {r:.3f} | {100 * below:.0f}% |")
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
