"""GPU codec benchmark: compress / decompress GB/s of input, ratio, and in the same run the
device-to-device copy bandwidth (the ceiling) and each kernel's memory-traffic floor.

Data: float32 made by tiling the real gradient vectors (``--grads``, default
``../shared/data/grads``), eps = k x the RMS of the values compressed at that size. Timings are CUDA-event medians over ``--iters`` runs
of the whole call (every kernel launch and the asynchronous size copy), after warm-up. Small
calls are bound by the host's launch time; the "gpu us" columns give the GPU's own time per
call, measured with the host kept ahead (calls queued behind a spinning kernel).

    python benches/gpu_codec.py [--sizes 1,4,16,64,256,1024] [--json out.json] [--feedback]
                                [--coders planes,rice]

``--feedback`` compresses with error feedback (a float32 residual read and updated in place by
every call; the compress floor then counts its 8 bytes per element).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import numpy as np
import torch

import cfc

HERE = pathlib.Path(__file__).resolve().parent


def load_grads(folder: pathlib.Path) -> torch.Tensor:
    files = sorted(folder.glob("*.npy"))
    if not files:
        raise SystemExit(f"no .npy files in {folder}")
    return torch.cat([torch.from_numpy(np.load(f)) for f in files])


def event_median(fn, iters: int) -> float:
    """Median GPU time of ``fn()`` in seconds, by CUDA events on the current stream."""
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def gpu_median(fn, iters: int, calls: int = 10) -> float:
    """Median GPU time of one ``fn()`` in seconds when the host keeps ahead of the GPU: ``calls``
    calls are queued while a spinning kernel holds the stream, and events around them time
    what the GPU spends on them, launch gaps between their kernels included."""
    times = []
    for _ in range(iters):
        torch.cuda._sleep(20_000_000)  # some ms: longer than the host takes to queue the calls
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    return statistics.median(times)


def wall_median(fn, iters: int) -> float:
    """Median wall time of the call alone (what the calling thread spends), in seconds."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grads", type=pathlib.Path, default=HERE.parent.parent / "shared" / "data" / "grads")
    ap.add_argument("--sizes", default="1,4,16,64,256,1024", help="MB of float32")
    ap.add_argument("--ks", default="0.1", help="eps as multiples of RMS")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--feedback", action="store_true", help="compress with a residual (error feedback)")
    ap.add_argument("--coders", default="planes", help="planes, rice or both (comma-separated)")
    args = ap.parse_args()
    coders = args.coders.split(",")
    dev = torch.device("cuda")
    base = load_grads(args.grads).to(dev)
    print(f"cfc {cfc.__version__} on {torch.cuda.get_device_name()} ; torch {torch.__version__}"
          f" ; error feedback {'on' if args.feedback else 'off'}")
    rows = []
    header = (f"{'MB':>6} {'eps/RMS':>7} {'coder':>6} {'ratio':>7} {'comp GB/s':>10} {'decomp GB/s':>11} "
              f"{'copy GB/s':>10} {'comp floor':>10} {'decomp floor':>12} {'comp us':>8} {'decomp us':>9} "
              f"{'call us':>8} {'gpu comp us':>11} {'gpu decomp us':>13}")
    print(header)
    for mb in [int(s) for s in args.sizes.split(",")]:
        n = mb * (1 << 20) // 4
        x = base.repeat(n // base.numel() + 1)[:n].contiguous()
        # The RMS of the values compressed at this size: the vectors' scales differ by 50x, and
        # the first sizes hold only the first of them (the RMS of all would be another bound).
        rms = x.double().pow(2).mean().sqrt().item()
        nbytes = n * 4
        y = torch.empty_like(x)
        fb = {"residual": torch.zeros_like(x)} if args.feedback else {}
        copy = event_median(lambda: y.copy_(x), args.iters)
        copy_bw = 2 * nbytes / copy  # bytes read + written per second
        for k in [float(v) for v in args.ks.split(",")]:
            eps = k * rms
            for coder in coders:
                kw = dict(fb, coder=coder)
                for _ in range(3):
                    c = cfc.compress(x, eps=eps, **kw)
                    cfc.decompress(c)
                torch.cuda.synchronize()
                tc = event_median(lambda: cfc.compress(x, eps=eps, **kw), args.iters)
                c = cfc.compress(x, eps=eps, **kw)
                size = c.nbytes
                td = event_median(lambda: cfc.decompress(c), args.iters)
                call = wall_median(lambda: cfc.compress(x, eps=eps, **kw), args.iters)
                gc = gpu_median(lambda: cfc.compress(x, eps=eps, **kw), args.iters)
                gd = gpu_median(lambda: cfc.decompress(c), args.iters)
                # Floors: compress reads the input (and the residual, which it writes back) and
                # writes the frame; decompress reads the frame and writes the output.
                comp_floor = (nbytes + size + (2 * nbytes if args.feedback else 0)) / copy_bw
                decomp_floor = (size + nbytes) / copy_bw
                row = dict(mb=mb, k=k, coder=coder, ratio=nbytes / size, compress_gbs=nbytes / tc / 1e9,
                           decompress_gbs=nbytes / td / 1e9, copy_gbs=copy_bw / 1e9,
                           compress_floor_gbs=nbytes / comp_floor / 1e9, decompress_floor_gbs=nbytes / decomp_floor / 1e9,
                           compress_us=tc * 1e6, decompress_us=td * 1e6, compress_call_us=call * 1e6,
                           compress_gpu_us=gc * 1e6, decompress_gpu_us=gd * 1e6)
                rows.append(row)
                print(f"{mb:>6} {k:>7} {coder:>6} {row['ratio']:>6.2f}x {row['compress_gbs']:>10.1f} {row['decompress_gbs']:>11.1f} "
                      f"{row['copy_gbs']:>10.1f} {row['compress_floor_gbs']:>10.1f} {row['decompress_floor_gbs']:>12.1f} "
                      f"{row['compress_us']:>8.1f} {row['decompress_us']:>9.1f} {row['compress_call_us']:>8.1f} "
                      f"{row['compress_gpu_us']:>11.1f} {row['decompress_gpu_us']:>13.1f}", flush=True)
        x = y = fb = c = None  # the GPU memory goes back before the next size
        torch.cuda.empty_cache()
    # Ratio on the five vectors, each compressed alone, as ANCHORS.md measured the original.
    print("\nRatio on the five gradient vectors (GPU, no CPU stage) vs the original cuda_float_compress (GPU + CPU zstd):")
    files = sorted(args.grads.glob("*.npy"))
    for k, orig in ((0.3, 12.97), (0.1, 8.25), (0.01, 4.47)):
        total_in = total_out = 0
        for f in files:
            g = torch.from_numpy(np.load(f)).to(dev)
            eps = k * g.double().pow(2).mean().sqrt().item()
            total_in += g.numel() * 4
            total_out += cfc.compress(g, eps=eps).nbytes
        r = total_in / total_out
        rows.append(dict(vectors=True, k=k, ratio=r, original=orig))
        print(f"  eps = {k} x RMS: cfc {r:.2f}x, original {orig}x ({100 * r / orig:.0f}%)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
