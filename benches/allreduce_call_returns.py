"""How soon ``cfc.distributed.AllReducer``'s call returns while the GPU is held busy.

Each rank queues a kernel that holds its stream for about half a second, then calls the
reducer and prints how long the call took to return and how long until the result was there.
Rank 0's first timed call also dumps every thread's stack 0.15 s in, which shows where the
calling thread waits when it does (e.g. in a CUDA call, once the launch queue is full)::

    python benches/allreduce_call_returns.py RANKS NUMEL CHUNK_NUMEL
    python benches/allreduce_call_returns.py 4 4194304 3000    # 1400 chunks: the call waits
    python benches/allreduce_call_returns.py 4 4194304 65536   # 64 chunks: it returns at once
"""

import faulthandler
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cfc


def worker(rank, world, init_file, numel, chunk):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    state = cfc.CfcState(eps=1e-5, warmup_steps=0, min_compress_numel=0)
    reducer = cfc.distributed.AllReducer(state, chunk_numel=chunk)
    g = torch.Generator().manual_seed(rank)
    x = (torch.randn(numel, generator=g) * 1e-3).cuda()
    reducer(x.clone()).wait()  # the first call's agreement rounds wait for the GPU
    torch.cuda.synchronize()
    for attempt in range(2):
        torch.cuda._sleep(1_000_000_000)  # about half a second on an H100/H200
        if rank == 0 and attempt == 0:
            faulthandler.dump_traceback_later(0.15, exit=False)
        t0 = time.perf_counter()
        pending = reducer(x)
        returned = time.perf_counter() - t0
        faulthandler.cancel_dump_traceback_later()
        pending.wait()
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        print(f"rank {rank} call {attempt}: returned after {returned * 1e3:.1f} ms, "
              f"result after {total * 1e3:.1f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    numel = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
    chunk = int(sys.argv[3]) if len(sys.argv) > 3 else 3000
    init = f"/tmp/cfc_call_returns_{os.getpid()}"
    mp.spawn(worker, args=(world, init, numel, chunk), nprocs=world, join=True)
