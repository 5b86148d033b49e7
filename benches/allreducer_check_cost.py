"""What the size check of every ``cfc.distributed.AllReducer`` call costs.

Each call first all-gathers every rank's size and dtype over a gloo group of the reducer's own
(``AllReducer._check``), on the host, so that ranks which disagree all raise instead of hanging.
The check touches no GPU, so CPU processes measure it as it runs beside CUDA tensors; it is one
host round trip between the processes (here over loopback, as on one machine)::

    python benches/allreducer_check_cost.py [RANKS] [CALLS]

Prints, per rank, the median, 10th and 90th percentile of the check alone, in microseconds.
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cfc


def worker(rank, world, init_file, calls):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    reducer = cfc.distributed.AllReducer(cfc.CfcState(eps=1e-5, warmup_steps=0))
    x = torch.zeros(1 << 20)
    reducer._check(x)  # the first call makes the gloo group
    times = []
    for _ in range(calls):
        dist.barrier()  # every rank starts the check together, as calls in step would
        t0 = time.perf_counter()
        reducer._check(x)
        times.append(time.perf_counter() - t0)
    q = statistics.quantiles(times, n=10)
    print(f"rank {rank}: check median {statistics.median(times) * 1e6:.0f} us, "
          f"p10 {q[0] * 1e6:.0f} us, p90 {q[-1] * 1e6:.0f} us over {calls} calls", flush=True)
    reducer.state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 500
    init = f"/tmp/cfc_check_cost_{os.getpid()}"
    mp.spawn(worker, args=(world, init, calls), nprocs=world, join=True)
