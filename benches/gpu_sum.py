"""Sums of compressed frames on the GPU: codes added in an integer accumulator and packed as one
frame (``cfc.sum_compressed`` of ``CudaCompressed`` frames, the engine's reduce-scatter step),
against decoding every frame, adding in float32 and compressing the sum again, and against the
CPU reference (``cfc.sum_compressed`` of host frames), in one run.

Data: float32 made by tiling the real gradient vectors (``--grads``), scaled differently per
part, eps = k x RMS; every part is compressed once on the GPU beforehand. Timings are CUDA-event
medians of whole calls (the CPU's: wall-clock medians); "GB/s" counts the parts' float32 bytes.

    python benches/gpu_sum.py [--mb 16,64,256] [--parts 2,4,8] [--k 0.3]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import torch

import cfc
from gpu_codec import event_median, load_grads

HERE = pathlib.Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grads", type=pathlib.Path, default=HERE.parent.parent / "shared" / "data" / "grads")
    ap.add_argument("--mb", default="16,64,256", help="MB of float32 per part")
    ap.add_argument("--parts", default="2,4,8")
    ap.add_argument("--k", type=float, default=0.3, help="eps = k x RMS")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--cpu-max-mb", type=float, default=64, help="time the CPU reference up to this size")
    args = ap.parse_args()
    g = load_grads(args.grads)
    # The RMS of the values compressed at each size (the vectors' scales differ by 50x: the
    # RMS of all of them would be another bound at each size).
    print(f"{torch.cuda.get_device_name()}, eps = {args.k} x the RMS of each size's data, medians of {args.iters}")
    print("| MB/part | parts | GPU sum (codes) | float route | speed-up | CPU reference | same bytes as CPU |")
    print("|---|---|---|---|---|---|---|")
    for mb in (float(s) for s in args.mb.split(",")):
        n = int(mb * (1 << 20)) // 4
        base = g.repeat(-(-n // g.numel()))[:n].cuda()
        eps = args.k * float(base.double().pow(2).mean().sqrt())
        for parts in (int(s) for s in args.parts.split(",")):
            frames = [cfc.compress(base * (1.0 - 0.1 * i), eps=eps) for i in range(parts)]
            torch.cuda.synchronize()
            gb = parts * n * 4 / 1e9

            def codes():
                return cfc.sum_compressed(frames)

            def floats():
                acc = None
                for c in frames:
                    y = cfc.decompress(c)
                    acc = y if acc is None else acc.add_(y)
                return cfc.compress(acc, eps=eps)

            for f in (codes, floats):
                f()
            t_codes = event_median(codes, args.iters)
            t_float = event_median(floats, args.iters)
            same, cpu = "", "-"
            if mb <= args.cpu_max_mb:
                host = [c.to_host() for c in frames]
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    want = cfc.sum_compressed(host)
                    times.append(time.perf_counter() - t0)
                cpu = f"{gb / statistics.median(times):.1f} GB/s"
                same = "yes" if bytes(codes()) == bytes(want) else "NO"
            print(f"| {mb:g} | {parts} | {gb / t_codes:.0f} GB/s ({t_codes * 1e3:.3f} ms) | "
                  f"{gb / t_float:.0f} GB/s ({t_float * 1e3:.3f} ms) | {t_float / t_codes:.2f}x | {cpu} | {same} |")


if __name__ == "__main__":
    main()
