"""The all-reduce's last step on the GPU: every rank's frame decoded, added, divided by the
world size and written in the bucket's dtype. The fused kernel (``_decode_sum_cuda``: one pass
that reads only the frames, as the engine runs it) against decoding each frame into its own
array, adding in float32, dividing and copying into the bucket, in one run.

Data: float32 made by tiling the real gradient vectors (``--grads``), scaled differently per
frame, eps = k x RMS; the frames are compressed once beforehand. "GPU" is the GPU's time per
call with the host kept ahead (``gpu_median``: calls queued behind a spinning kernel); "host"
is what the calling thread spends per call (``wall_median``). "GB/s" counts the output's bytes
once per frame (what decoding every frame into float32 writes).

    python benches/gpu_decode_sum.py [--mb 16,64,256] [--parts 1,2,4,8] [--out float32,bfloat16]
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np
import torch

import cfc
from cfc._gpu import _decode_sum_cuda, _decompress_cuda
from gpu_codec import gpu_median, load_grads, wall_median

HERE = pathlib.Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grads", type=pathlib.Path, default=HERE.parent.parent / "shared" / "data" / "grads")
    ap.add_argument("--mb", default="16,64,256", help="MB of float32 per frame")
    ap.add_argument("--parts", default="1,2,4,8")
    ap.add_argument("--out", default="float32,bfloat16", help="output (bucket) dtypes")
    ap.add_argument("--k", type=float, default=0.3, help="eps = k x RMS")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    g = load_grads(args.grads)
    # The RMS of the values compressed at each size (the vectors' scales differ by 50x: the
    # RMS of all of them would be another bound at each size).
    print(f"{torch.cuda.get_device_name()}, eps = {args.k} x the RMS of each size's data, medians of {args.iters}")
    print("| MB/frame | frames | output | fused: GPU | fused: host | decode + add + divide: GPU | host "
          "| GPU speed-up | same values |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mb in (float(s) for s in args.mb.split(",")):
        n = int(mb * (1 << 20)) // 4
        base = g.repeat(-(-n // g.numel()))[:n].cuda()
        eps = args.k * float(base.double().pow(2).mean().sqrt())
        for parts in (int(s) for s in args.parts.split(",")):
            cs = [cfc.compress(base * (1.0 - 0.1 * i), eps=eps * (1 + 0.01 * i)) for i in range(parts)]
            frames = [c._out for c in cs]
            scale = float(np.float32(1) / np.float32(parts))
            for out_name in args.out.split(","):
                out = torch.empty(n, dtype=getattr(torch, out_name), device="cuda")

                def fused():
                    _decode_sum_cuda(frames, n, "float32", out, scale)

                def separate():
                    acc = None
                    for f in frames:
                        y = _decompress_cuda(f, n, "float32", (n,), 1)
                        acc = y if acc is None else acc.add_(y)
                    out.copy_(acc.div_(parts))

                separate()
                want = out.clone()
                fused()
                same = "yes" if torch.equal(out, want) else "NO"
                t_f, t_s = gpu_median(fused, args.iters), gpu_median(separate, args.iters)
                h_f, h_s = wall_median(fused, args.iters), wall_median(separate, args.iters)
                gb = parts * n * 4 / 1e9
                print(f"| {mb:g} | {parts} | {out_name} | {t_f * 1e3:.3f} ms ({gb / t_f:.0f} GB/s) | "
                      f"{h_f * 1e6:.0f} us | {t_s * 1e3:.3f} ms ({gb / t_s:.0f} GB/s) | {h_s * 1e6:.0f} us | "
                      f"{t_s / t_f:.2f}x | {same} |")


if __name__ == "__main__":
    main()
