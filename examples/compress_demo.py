"""cfc's main job on any machine: compress real gradients and a model's parameters.

Prints, for the gradient vectors of ``../shared/data/grads`` (or ``--grads DIR``) at
eps = 0.3, 0.1 and 0.01 x RMS, and for every parameter of a transformer language model
(built here, or any ``state_dict`` file given with ``--state-dict``): the compression ratio
with and without the zstd stage, the largest error against the bound, and throughput.

    python examples/compress_demo.py [--grads DIR] [--state-dict FILE] [--eps 1e-4]
"""

from __future__ import annotations

import argparse
import pathlib
import time

import numpy as np
import torch
import torch.nn as nn

import cfc
from compress_model import tensors_of  # (examples/, beside this script)

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_GRADS = HERE.parent.parent / "shared" / "data" / "grads"


def timed(fn, repeat=3):
    """Median wall time of ``fn()`` over ``repeat`` runs, and its last result."""
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def gradient_table(folder: pathlib.Path) -> None:
    files = sorted(folder.glob("*.npy"))
    if not files:
        print(f"(no .npy gradient vectors in {folder}; skipping)")
        return
    grads = [torch.from_numpy(np.load(f)) for f in files]
    total = sum(g.numel() * g.element_size() for g in grads)
    kinds = ", ".join(sorted({str(g.dtype).replace("torch.", "") for g in grads}))
    print(f"\nReal gradient vectors: {len(files)} of {kinds}, {sum(g.numel() for g in grads) / 1e6:.1f}M values "
          f"({total / 1e6:.0f} MB) from {folder}")
    print(f"{'eps/RMS':>8} {'ratio':>7} {'+zstd':>7} {'max err/eps':>12} {'violations':>10} "
          f"{'compress GB/s':>14} {'decompress GB/s':>16}")
    for k in (0.3, 0.1, 0.01):
        nbytes = zbytes = violations = 0
        worst = tc = td = 0.0
        for g in grads:
            eps = k * g.double().pow(2).mean().sqrt().item()
            dt, c = timed(lambda: cfc.compress(g, eps=eps))
            tc += dt
            dt, y = timed(lambda: cfc.decompress(c))
            td += dt
            err = (y.double() - g.double()).abs()
            worst = max(worst, err.max().item() / eps)
            violations += int((err > eps).sum())
            nbytes += c.nbytes
            zbytes += cfc.compress(g, eps=eps, zstd=True).nbytes
        print(f"{k:>8} {total / nbytes:>6.2f}x {total / zbytes:>6.2f}x {worst:>12.6f} {violations:>10d} "
              f"{total / tc / 1e9:>14.2f} {total / td / 1e9:>16.2f}")


def language_model() -> nn.Module:
    """A 6-layer byte-level transformer LM (about 19M parameters), freshly initialised."""
    torch.manual_seed(0)
    d = 512
    layer = nn.TransformerEncoderLayer(d, 8, 4 * d, batch_first=True, norm_first=True)
    return nn.ModuleDict({
        "embed": nn.Embedding(256, d),
        "blocks": nn.TransformerEncoder(layer, 6, enable_nested_tensor=False),
        "head": nn.Linear(d, 256),
    })


def parameter_table(state: dict, eps: float) -> None:
    tensors = {k: v for k, v in tensors_of(state).items()
               if v.dtype in (torch.float32, torch.bfloat16, torch.float16)}
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    if not total:
        print("\nModel parameters: no float32/bf16/fp16 tensor with data in that file")
        return
    print(f"\nModel parameters: {len(tensors)} tensors, {sum(v.numel() for v in tensors.values()) / 1e6:.1f}M "
          f"values, {total / 1e6:.0f} MB; bound eps = {eps:g}")
    for label, zstd in (("cfc", False), ("cfc + zstd", True)):
        t0 = time.perf_counter()
        frames = {k: cfc.compress(v, eps=eps, zstd=zstd) for k, v in tensors.items()}
        tc = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = {k: cfc.decompress(c) for k, c in frames.items()}
        td = time.perf_counter() - t0
        worst = max(((out[k].double() - v.double()).abs().max().item() for k, v in tensors.items() if v.numel()),
                    default=0.0)
        size = sum(c.nbytes for c in frames.values())
        print(f"  {label:<11} ratio {total / size:5.2f}x  max error {worst:.3e} (bound {eps:g}, "
              f"{'ok' if worst <= eps else 'VIOLATED'})  compress {total / tc / 1e9:.2f} GB/s  "
              f"decompress {total / td / 1e9:.2f} GB/s")
    biggest = max(tensors, key=lambda k: tensors[k].numel())
    print(f"  largest tensor {biggest} {tuple(tensors[biggest].shape)}: {frames[biggest]!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grads", type=pathlib.Path, default=DEFAULT_GRADS)
    ap.add_argument("--state-dict", type=pathlib.Path, help="a torch.save'd state_dict to compress")
    ap.add_argument("--eps", type=float, default=1e-4, help="absolute bound for the parameters")
    args = ap.parse_args()
    print(f"cfc {cfc.__version__} (format v{cfc.FORMAT_VERSION}), torch {torch.__version__}")
    gradient_table(args.grads)
    if args.state_dict:
        state = torch.load(args.state_dict, map_location="cpu", weights_only=True)
    else:
        state = language_model().state_dict()
    parameter_table(state, args.eps)


if __name__ == "__main__":
    main()
