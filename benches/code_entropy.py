"""How close cfc's frames come to the entropy of the codes they hold.

For each float32 gradient slice of a folder (default ``../shared/data/grads``) and each bound
``k x RMS``: the order-0 entropy of the quantized codes (``round(x / (2 eps))``), in bits per
value, against the bits per value of cfc's frames (no zstd stage) at the same bound, with bit
planes (``coder="planes"``) and with Rice codes (``coder="rice"``), and the share of the
entropy each reaches (entropy / frame bits). The entropy is what any coder of one code at a
time with one table for the whole slice could reach; a coder that adapts to each block can do
better (more than 100%). With ``--dtypes``, each slice is also cast to bfloat16 and float16: their
frames against the dtype's own bytes, and the values that travel as exceptions (where the
dtype's spacing is coarser than the bound).

    python benches/code_entropy.py [--grads DIR] [--bounds 0.05,0.1,0.3] [--dtypes]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

import cfc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grads", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/grads")
    p.add_argument("--bounds", default="0.05,0.1,0.3", help="bounds, as multiples of each slice's RMS")
    p.add_argument("--dtypes", action="store_true", help="also bfloat16 and float16: ratio and exceptions")
    args = p.parse_args()
    files = sorted(args.grads.glob("*.npy"))
    if not files:
        raise SystemExit(f"no .npy gradient slices in {args.grads}")
    print("| slice | k | entropy of the codes | bit planes | rice | share of the entropy: planes / rice "
          "| fewer bytes than float32: entropy / planes / rice |")
    print("|---|---|---|---|---|---|---|")
    for f in files:
        x = torch.from_numpy(np.load(f).astype(np.float32)).flatten()
        rms = x.double().pow(2).mean().sqrt().item()
        for k in (float(b) for b in args.bounds.split(",")):
            eps = k * rms
            _, counts = torch.unique(torch.round(x.double() / (2 * eps)).to(torch.int64), return_counts=True)
            prob = counts.double() / counts.sum()
            entropy = -(prob * prob.log2()).sum().item()
            planes = 8 * cfc.compress(x, eps=eps).nbytes / x.numel()
            rice = 8 * cfc.compress(x, eps=eps, coder="rice").nbytes / x.numel()
            print(f"| {f.stem} | {k:g} | {entropy:.2f} bits | {planes:.2f} bits | {rice:.2f} bits "
                  f"| {entropy / planes:.0%} / {entropy / rice:.0%} "
                  f"| {32 / entropy:.1f}x / {32 / planes:.1f}x / {32 / rice:.1f}x |")
    if args.dtypes:
        print("\n| slice | dtype | k | fewer bytes than the dtype's own | exceptions |")
        print("|---|---|---|---|---|")
        for f in files:
            x = torch.from_numpy(np.load(f).astype(np.float32)).flatten()
            for dtype in (torch.bfloat16, torch.float16):
                y = x.to(dtype)
                rms = y.double().pow(2).mean().sqrt().item()
                for k in (float(b) for b in args.bounds.split(",")):
                    c = cfc.compress(y, eps=k * rms)
                    info = cfc.codec.frame_info(c)
                    print(f"| {f.stem} | {str(dtype)[6:]} | {k:g} | {y.numel() * y.element_size() / c.nbytes:.2f}x "
                          f"| {100 * info['exceptions'] / y.numel():.2f}% |")


if __name__ == "__main__":
    main()
