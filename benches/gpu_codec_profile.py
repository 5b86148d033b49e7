"""Three compress + decompress calls of float32 (the tiled gradient vectors, 256 MB unless
``--mb`` says otherwise; eps = 0.1 x RMS) on the GPU, for a profiler:

    ncu -k regex:"encode_groups|pack_chunks|decode_chunks|decode_offsets" \\
        --launch-skip 4 --launch-count 4 \\
        --metrics gpu__time_duration.sum,smsp__inst_executed.sum,\\
sm__warps_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed \\
        python benches/gpu_codec_profile.py --grads DIR [--mb 256]

The stall reasons quoted in docs/perf-notes.md come from the same command with
``--section WarpStateStats --section SchedulerStats`` and ``--mb 1``.

The first calls compile the kernels; the last decode is checked against the bound.
"""

import argparse
import pathlib

import numpy as np
import torch

import cfc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grads", type=pathlib.Path,
                    default=pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "grads")
    ap.add_argument("--mb", type=int, default=256, help="input size in MB (2^20 bytes)")
    args = ap.parse_args()
    base = torch.cat([torch.from_numpy(np.load(f)) for f in sorted(args.grads.glob("*.npy"))]).cuda()
    n = args.mb << 18  # float32 values
    x = base.repeat(n // base.numel() + 1)[:n].contiguous()
    eps = 0.1 * x.double().pow(2).mean().sqrt().item()
    for _ in range(3):
        c = cfc.compress(x, eps=eps)
        y = cfc.decompress(c)
    torch.cuda.synchronize()
    err = (y.double() - x.double()).abs().max().item()
    assert err <= eps, f"max error {err} over eps {eps}"
    print(f"ratio {x.numel() * 4 / c.nbytes:.2f}x, max error / eps {err / eps:.3f}")


if __name__ == "__main__":
    main()
