"""The wire's share of cfc's all-reduce: plain NCCL ``all_gather_into_tensor`` of slots the size
of cfc's frames (the tensor's bytes / ``--ratio``) against plain fp32 ``all_reduce`` of the
tensor, over whatever transport NCCL uses. No cfc code runs: the all-gather's time is the
floor of cfc's all-gather variant on that transport. Run under torchrun:

    torchrun --standalone --nproc_per_node=2 benches/nccl_slot_probe.py [--mb 64,256] [--ratio 9.8]

Times: rank 0's median of ``--iters`` calls (after 3 untimed ones), each after a barrier, from
the call until the GPU has finished.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", default="64,256")
    ap.add_argument("--ratio", type=float, default=9.8, help="cfc's bytes ratio at 0.3 x RMS")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--label", default=os.environ.get("LABEL", ""))
    args = ap.parse_args()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    world = dist.get_world_size()

    def median_ms(fn) -> float:
        times = []
        for _ in range(args.iters + 3):
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[3:]) * 1e3

    for mb in (int(m) for m in args.mb.split(",")):
        x = torch.randn(mb << 18, device=dev)
        slot = torch.empty(int((mb << 20) / args.ratio), dtype=torch.uint8, device=dev)
        got = torch.empty(world * slot.numel(), dtype=torch.uint8, device=dev)
        ar = median_ms(lambda: dist.all_reduce(x))
        ag = median_ms(lambda: dist.all_gather_into_tensor(got, slot))
        if dist.get_rank() == 0:
            print(f"{args.label} {mb} MB: all_reduce fp32 {ar:.2f} ms; all_gather of "
                  f"{slot.numel() / 1e6:.2f} MB slots {ag:.2f} ms ({ar / ag:.2f}x)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
