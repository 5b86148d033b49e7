"""Host time of each step of cfc's CUDA all-reduce, one GPU: where the comm thread's time goes.

The GPU is held busy (a long sleep kernel) while the calls are made, so every figure is the CPU
cost of queueing the work, never a wait. Run: ``python benches/allreduce_profile.py [--mb 32]``.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import cfc
from cfc.codec import _decompress_cuda


def host_us(fn, reps=50):
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # keep the GPU busy: nothing below can wait for it
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=32)
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    n = int(args.mb * (1 << 20)) // 4
    x = torch.randn(n, device=dev) * 1e-4
    r = torch.zeros(n, device=dev)
    c = cfc.compress(x, eps=3e-5, residual=r)
    frame = c._out
    size = c.size_tensor
    y = torch.empty(n, device=dev)
    got = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    rows = {
        "cfc.compress (eps, residual)": lambda: cfc.compress(x, eps=3e-5, residual=r),
        "_decompress_cuda": lambda: _decompress_cuda(frame, n, "float32", (n,), 1),
        "all_gather_into_tensor (1 MB)": lambda: dist.all_gather_into_tensor(got, got),
        "torch add_ (float32)": lambda: y.add_(x),
        "tensor.float() copy": lambda: x.float(),
        "r.abs().max()": lambda: r.abs().max(),
        "pinned empty(1, int64)": lambda: torch.empty(1, dtype=torch.int64, pin_memory=True),
        "cuda Event() + record": lambda: torch.cuda.Event().record(),
        "size copy to pinned": lambda: torch.empty(1, dtype=torch.int64, pin_memory=True).copy_(size, non_blocking=True),
    }
    print(f"host time per call (median of 50, GPU busy), {args.mb:g} MB chunk, {torch.cuda.get_device_name(dev)}")
    print("| call | host us |\n|---|---|")
    for name, fn in rows.items():
        print(f"| {name} | {host_us(fn):.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
