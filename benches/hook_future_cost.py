"""Host time per bucket of the future cfc_hook hands to DDP: a CUDA future that the comm thread
completes (``set_result`` on its stream) and DDP waits for, alone and behind the callback future
(``fut.then(_bucket_of)``) through which a failure on the comm thread reaches backward() as the
error it was. Both on one thread here (the comm thread and DDP's are two in the hook); medians
over rounds, microseconds per bucket::

    python benches/hook_future_cost.py [--buckets 2000] [--rounds 7]
"""

import argparse
import statistics
import time

import torch

from cfc.ddp import _bucket_of


def per_bucket(buckets: int, chained: bool, buf, side) -> float:
    dev = buf.device
    t0 = time.perf_counter()
    for _ in range(buckets):
        fut = torch.futures.Future(devices=[dev])
        held = fut.then(_bucket_of) if chained else fut
        with torch.cuda.stream(side):
            fut.set_result(buf)  # records an event on the comm thread's stream
        held.wait()  # DDP's stream waits for it
    return (time.perf_counter() - t0) / buckets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buckets", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    buf = torch.zeros(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    per_bucket(200, True, buf, side)  # warm up both
    per_bucket(200, False, buf, side)
    alone, chained = [], []
    for _ in range(args.rounds):  # interleaved
        alone.append(per_bucket(args.buckets, False, buf, side))
        chained.append(per_bucket(args.buckets, True, buf, side))
    a, c = statistics.median(alone) * 1e6, statistics.median(chained) * 1e6
    print(f"{torch.cuda.get_device_name()}: medians of {args.rounds} rounds of {args.buckets} buckets")
    print("| future DDP holds | host time per bucket |")
    print("|---|---|")
    print(f"| the comm thread's own | {a:.1f} us |")
    print(f"| a callback's future behind it | {c:.1f} us (+{c - a:.1f} us) |")


if __name__ == "__main__":
    main()
