"""Where one `AllReducer` call spends its time: the comm thread's host work, stage by stage,
against its waits for the GPU and the call's total. Run under torchrun (1 or more ranks):

    torchrun --standalone --nproc_per_node=1 benches/allreduce_host_profile.py --mb 16,64

Every stage named below is wrapped with a timer (per thread, per call); "waits" is the time
spent in CUDA event synchronizations, i.e. the thread idle until the GPU got there. What no
stage accounts for is the comm thread's other Python (queueing, closures, accounting).
The native exchange's two calls are timed on their own ("native BucketExchange.launch" and
".finish", the latter with its wait for the frame sizes): the time in cfc's Rust code and the
CUDA driver, against the Python around it ("native exchange: launch").
"""

import argparse
import collections
import functools
import os
import statistics
import threading
import time

import torch
import torch.distributed as dist

import cfc
import cfc.ddp as ddp
from cfc.distributed import AllReducer

_times = collections.defaultdict(float)  # (thread name, label) -> seconds, this call
_lock = threading.Lock()


def _timed(label, fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            dt = time.perf_counter() - t0
            with _lock:
                _times[(threading.current_thread().name, label)] += dt

    return wrapper


class _TimedExchange:
    """A native exchange whose ``launch`` and ``finish`` are timed (the methods of a native
    class cannot be patched: the hook gets this stand-in, which passes everything else on)."""

    def __init__(self, exchange):
        self._exchange = exchange
        self.launch = _timed("  native BucketExchange.launch", exchange.launch)
        self.finish = _timed("  native BucketExchange.finish (incl. wait)", exchange.finish)

    def __getattr__(self, name):
        return getattr(self._exchange, name)


def wrap_exchanges(stand_in):
    """Every native exchange cfc opens from now on is handed to the hook as
    ``stand_in(exchange)`` (the methods of a native class cannot be patched). (The pipeline, off
    by default, needs the native exchange itself: with a stand-in it cannot run.)"""
    open_exchange = ddp._open_exchange

    def opened(*a, **kw):
        exchange = open_exchange(*a, **kw)
        return None if exchange is None else stand_in(exchange)

    ddp._open_exchange = opened


def _timed_exchanges():
    """Every exchange cfc opens from now on is a :class:`_TimedExchange`."""
    wrap_exchanges(_TimedExchange)


def _instrument():
    _timed_exchanges()
    ddp._finite_sumsq = _timed("sum of squares", ddp._finite_sumsq)  # CPU buckets, the reduce-scatter
    ddp._sum_squares = _timed("sum of squares", ddp._sum_squares)  # CUDA buckets, the all-gather
    cfc.compress = _timed("cfc.compress", cfc.compress)  # the reduce-scatter's shards
    ddp._compress_cuda = _timed("cfc.compress", ddp._compress_cuda)  # the all-gather's bucket
    ddp._decode_sum_cuda = _timed("decode + average", ddp._decode_sum_cuda)
    ddp._note_max_error = _timed("max error", ddp._note_max_error)
    # the all-gather's bucket through the native exchange (the default where it fits): its
    # launch; its finish is in "deferred stages (all)" (a method of the native class, not patchable)
    ddp._exchange_launch = _timed("native exchange: launch", ddp._exchange_launch)
    ddp._FrameExchange.__init__ = _timed("exchange: queue", ddp._FrameExchange.__init__)
    ddp._FrameExchange.finish = _timed("exchange: finish (incl. wait)", ddp._FrameExchange.finish)
    ddp._ShardExchange.__init__ = _timed("shards: compress + queue", ddp._ShardExchange.__init__)
    ddp._ShardExchange.send_sum = _timed("shards: sum + queue", ddp._ShardExchange.send_sum)
    ddp._ShardExchange.receive_sums = _timed("shards: receive (incl. wait)", ddp._ShardExchange.receive_sums)
    native = cfc.codec._native
    native.cuda_compress = _timed("  native cuda_compress", native.cuda_compress)
    native.cuda_decode_sum = _timed("  native cuda_decode_sum", native.cuda_decode_sum)
    native.cuda_copy_rows = _timed("  native cuda_copy_rows", native.cuda_copy_rows)
    native.cuda_sum_squares = _timed("  native cuda_sum_squares", native.cuda_sum_squares)
    native.cuda_running_max_abs = _timed("  native cuda_running_max_abs", native.cuda_running_max_abs)
    cfc.codec.CudaCompressed.__init__ = _timed("  CudaCompressed()", cfc.codec.CudaCompressed.__init__)
    ddp._gpu_launch = _timed("launch stage (all)", ddp._gpu_launch)
    ddp._CommThread._run_deferred = _timed("deferred stages (all)", ddp._CommThread._run_deferred)
    torch.cuda.Event.synchronize = _timed("waits: event sync", torch.cuda.Event.synchronize)
    torch.cuda.Stream.synchronize = _timed("waits: stream sync", torch.cuda.Stream.synchronize)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mb", default="16,64")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--algorithm", default=None)
    args = p.parse_args()
    rank = int(os.environ.get("RANK", 0))
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    _instrument()
    for mb in [float(m) for m in args.mb.split(",")]:
        n = int(mb * (1 << 20)) // 4
        src = torch.randn(n, device=dev) * 1e-3
        x = torch.empty_like(src)
        reducer = AllReducer(cfc.CfcState(warmup_steps=0, algorithm=args.algorithm))
        calls, totals, stages = [], [], collections.defaultdict(list)
        for it in range(args.iters + 5):
            x.copy_(src)
            torch.cuda.synchronize()
            dist.barrier()
            with _lock:
                _times.clear()
            t0 = time.perf_counter()
            pending = reducer(x)
            t1 = time.perf_counter()
            pending.wait()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if it < 5:
                continue
            calls.append(t1 - t0)
            totals.append(t2 - t0)
            with _lock:
                for k, v in _times.items():
                    stages[k].append(v)
        if rank == 0:
            print(f"\n{mb:g} MB, world {dist.get_world_size()}, {torch.cuda.get_device_name(dev)}: "
                  f"call returns in {statistics.median(calls) * 1e3:.3f} ms, "
                  f"result after {statistics.median(totals) * 1e3:.3f} ms (medians of {args.iters})")
            print("| thread | stage | ms per call (median) |\n|---|---|---|")
            for (thread, label), v in sorted(stages.items()):
                vals = v + [0.0] * (len(totals) - len(v))
                print(f"| {thread} | {label} | {statistics.median(vals) * 1e3:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
