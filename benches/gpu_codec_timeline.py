"""The GPU's timeline of compress calls, from ``torch.profiler``: every kernel, memset and copy
of a few calls queued behind a spinning kernel (so the host keeps ahead), with the idle gap
before each and its duration. Shows where a small call's GPU time goes besides the kernels.

    python benches/gpu_codec_timeline.py --grads DIR [--mb 1] [--calls 4]

Data: float32 made by tiling the real gradient vectors, eps = 0.1 x RMS.
"""

import argparse
import pathlib

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import cfc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grads", type=pathlib.Path,
                    default=pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "grads")
    ap.add_argument("--mb", type=float, default=1.0, help="input size in MB (2^20 bytes)")
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args()
    base = torch.cat([torch.from_numpy(np.load(f)) for f in sorted(args.grads.glob("*.npy"))]).cuda()
    n = int(args.mb * (1 << 18))  # float32 values
    x = base.repeat(n // base.numel() + 1)[:n].contiguous()
    eps = 0.1 * x.double().pow(2).mean().sqrt().item()
    for _ in range(5):  # compiles the kernels, warms the allocator
        cfc.decompress(cfc.compress(x, eps=eps))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(20_000_000)
        for _ in range(args.calls):
            cfc.compress(x, eps=eps)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "spin_kernel" not in e.name),
                    key=lambda e: e.time_range.start)
    prev = None
    for e in events:
        start, dur = e.time_range.start, e.time_range.end - e.time_range.start
        gap = 0.0 if prev is None else start - prev
        print(f"{e.name[:40]:40s} gap {gap:6.1f} us  duration {dur:6.1f} us")
        prev = start + dur


if __name__ == "__main__":
    main()
