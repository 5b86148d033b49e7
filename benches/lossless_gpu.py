"""Lossless codec on the GPU: ratio, GPU decode speed, and fetching a compressed tensor from
pinned host memory against a plain pinned copy, all measured in one run.

    python benches/lossless_gpu.py [--mb 64,256] [--iters 20] [--grads DIR] [--json out.json]

Inputs (each of the sizes given):
  - bf16 weights: normal with std 0.02, as initialised transformer weights (no pretrained
    model is available offline); and the real gradient vectors (--grads) rounded to bf16;
  - fp32 ReLU activations: relu of normal values (half zero);
  - fp32 weights.
For each: compression ratio, GPU compress GB/s (the GPU encoder, whose frame is checked to be
the CPU encoder's bytes), GPU decode GB/s of decoded output (frame already on
the GPU) next to the device-to-device copy of the same bytes (the ceiling), and host-to-device
time of `cfc.decompress(cfc.pin(frame), device)` (copy of the frame + decode) against
`dst.copy_(pinned tensor)`, as "fetch speed-up" (plain time / cfc time). Times are medians of
CUDA-event intervals.
"""

import argparse
import json
import pathlib
import statistics
import time

import numpy as np
import torch

import cfc
from cfc._gpu import _decompress_cuda


def median_ms(fn, iters):
    torch.cuda.synchronize()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def inputs(mb, grads_dir):
    n32, n16 = mb * (1 << 20) // 4, mb * (1 << 20) // 2
    g = torch.Generator().manual_seed(0)
    yield "bf16 weights N(0, 0.02)", (torch.randn(n16, generator=g) * 0.02).to(torch.bfloat16)
    if grads_dir:
        files = sorted(pathlib.Path(grads_dir).glob("*.npy"))
        if files:
            v = torch.from_numpy(np.concatenate([np.load(f) for f in files]).astype(np.float32))
            yield "bf16 real gradients", v.repeat(n16 // v.numel() + 1)[:n16].to(torch.bfloat16)
    yield "fp32 ReLU activations", torch.relu(torch.randn(n32, generator=g))
    yield "fp32 weights N(0, 0.02)", torch.randn(n32, generator=g) * 0.02


def measure(name, mb, x, dev, iters):
    """One row of the table: every figure for one input."""
    t0 = time.perf_counter()
    c = cfc.compress(x, lossless=True)
    cpu_s = time.perf_counter() - t0
    info = c.info
    nbytes = x.numel() * x.element_size()
    frame_dev = torch.frombuffer(bytearray(bytes(c)), dtype=torch.uint8).to(dev)
    decode = lambda: _decompress_cuda(  # noqa: E731
        frame_dev, info["numel"], info["dtype"], tuple(info["shape"]), len(info["shape"]),
        codec=info["codec"],
    )
    y = decode()
    assert torch.equal(y.view(torch.uint8).cpu(), x.view(torch.uint8)), "GPU decode differs"
    dec_ms = median_ms(decode, iters)
    x_dev = x.to(dev)
    assert bytes(cfc.compress(x_dev, lossless=True)) == bytes(c), "GPU frame differs from the CPU's"
    enc_ms = median_ms(lambda: cfc.compress(x_dev, lossless=True), iters)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    d2d_ms = median_ms(lambda: dst.copy_(src), iters)
    pinned_raw = x.view(torch.uint8).reshape(-1).pin_memory()
    dst_raw = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h2d_ms = median_ms(lambda: dst_raw.copy_(pinned_raw, non_blocking=True), iters)
    p = cfc.pin(c)
    got = cfc.decompress(p, device=dev)
    assert torch.equal(got.view(torch.uint8).cpu(), x.view(torch.uint8)), "fetch differs"
    fetch_ms = median_ms(lambda: cfc.decompress(p, device=dev), iters)
    row = {
        "input": name, "MB": mb, "ratio": c.ratio, "codec": info["codec"],
        "cpu_compress_GBps": nbytes / cpu_s / 1e9,
        "gpu_compress_GBps": nbytes / enc_ms / 1e6,
        "gpu_decode_GBps": nbytes / dec_ms / 1e6, "d2d_copy_GBps": nbytes / d2d_ms / 1e6,
        "h2d_plain_ms": h2d_ms, "h2d_cfc_ms": fetch_ms, "fetch_speedup": h2d_ms / fetch_ms,
    }
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", default="64,256")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--grads", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    rows = []
    for mb in [int(s) for s in args.mb.split(",")]:
        for name, x in inputs(mb, args.grads):
            row = measure(name, mb, x, dev, args.iters)
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    print(f"\nLossless codec, {torch.cuda.get_device_name(0)}: medians of {args.iters} CUDA-event timings")
    print("| input | MB | ratio | GPU compress GB/s | GPU decode GB/s | D2D copy GB/s | H2D plain ms | H2D cfc ms "
          "| fetch speed-up | CPU compress GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['input']} | {r['MB']} | {r['ratio']:.3f}x | {r['gpu_compress_GBps']:.0f} | "
              f"{r['gpu_decode_GBps']:.0f} | {r['d2d_copy_GBps']:.0f} | "
              f"{r['h2d_plain_ms']:.2f} | {r['h2d_cfc_ms']:.2f} | {r['fetch_speedup']:.2f}x | {r['cpu_compress_GBps']:.2f} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
