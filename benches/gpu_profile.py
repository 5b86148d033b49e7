"""Per-kernel GPU time of compress and decompress (torch.profiler), to see where time goes.

    python benches/gpu_profile.py [--mb 256] [--grads DIR]
"""

import argparse
import pathlib

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import cfc

ap = argparse.ArgumentParser()
ap.add_argument("--mb", type=int, default=256)
ap.add_argument("--grads", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "grads")
args = ap.parse_args()
base = torch.cat([torch.from_numpy(np.load(f)) for f in sorted(args.grads.glob("*.npy"))]).cuda()
n = args.mb * (1 << 20) // 4
x = base.repeat(n // base.numel() + 1)[:n].contiguous()
eps = 0.1 * base.double().pow(2).mean().sqrt().item()
for mode in ({"eps": eps}, {"rel": 1e-2}, {"bits": 4}):
    c = cfc.compress(x, **mode)
    cfc.decompress(c)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            c = cfc.compress(x, **mode)
            cfc.decompress(c)
        torch.cuda.synchronize()
    print(f"--- {args.mb} MB float32, {mode}, 5 x (compress + decompress), ratio {x.numel() * 4 / c.nbytes:.2f}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=40))
