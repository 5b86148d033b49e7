"""How often a compressed bucket's frame outgrows its slot, and what other slot margins would
send: frame sizes of the 217M LM of ``ddp_step_time.py`` recorded step by step, then each rule
replayed over them.

The native exchange all-gathers rows of a fixed length, the bucket's slot, sized from the
bucket's previous frames (``cfc::bucket_exchange::next_slot``: 1/8 and 256 bytes above the
largest; 1/16 before this bench was run). A frame that outgrows it is sent again, whole, in a second all-gather. Each rank then
sends the slot, plus the frame again where it did not fit: a wider margin sends more padding
and fewer frames twice. Run under torchrun, one GPU per process::

    torchrun --standalone --nproc_per_node=1 benches/slot_margin.py --steps 60

After each finish the frames' sizes are read from the heads of the rows the exchange received
(one per rank), and the largest is kept: at one rank that is this rank's frame; at more, the
largest of all ranks'. The table prints, for each margin, the frames sent twice and the bytes
one rank sends per step, as the exchange's rows would carry them (head included), over the
recorded steps after the first; the exchange's own count of frames sent again covers the same
steps, so the row of the rule in effect can be checked against it.
"""

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import allreduce_host_profile as hp  # noqa: E402
import ddp_step_time as st  # noqa: E402

import cfc.ddp as ddp  # noqa: E402

ROW_HEAD = 16


def _round16(x: int) -> int:
    return -(-x // 16) * 16


def _slot(largest: int, margin: float) -> int:
    """``next_slot``'s rule with another margin (the capacity, far above, left out)."""
    return _round16(largest + int(largest * margin) + 256)


class _Recorder:
    """A native exchange whose finishes note each bucket's largest frame (the methods of a
    native class cannot be patched: the hook gets this stand-in, which passes everything else
    on)."""

    def __init__(self, exchange, frames, world):
        self._exchange, self._frames, self._rows = exchange, frames, {}
        self._heads = torch.zeros(world, dtype=torch.int64, pin_memory=True)

    def launch(self, key, *args, **kw):
        # (stream, data, n, dtype, residual, row, capacity, workspace, its length, the sum's
        # workspace and output, slot, recv, ...): where this bucket's rows come in
        self._rows[key] = (args[0], args[12], args[11])
        return self._exchange.launch(key, *args, **kw)

    def finish(self, key, *args):
        need, sent, slot_next = self._exchange.finish(key, *args)
        if not need:  # every rank's row holds its frame's size in its head (the first 8 bytes)
            stream, recv, slot = self._rows[key]
            world = self._heads.numel()
            ddp._native.cuda_copy_rows(torch.cuda.current_device(), stream, recv, ROW_HEAD + slot,
                                       self._heads.data_ptr(), 8, 8, world)
            torch.cuda.synchronize()
            self._frames[key].append(int(self._heads.max()))
        return need, sent, slot_next

    def __getattr__(self, name):
        return getattr(self._exchange, name)


def replay(frames, margin: float):
    """(frames sent twice, bytes sent) over ``frames`` (each bucket's largest frame per step)
    with slots of ``margin``, from each bucket's second step on."""
    twice = sent = 0
    for sizes in frames.values():
        for prev, cur in zip(sizes, sizes[1:]):
            slot = _slot(prev, margin)
            sent += ROW_HEAD + slot
            if cur > slot:
                twice += 1
                sent += ROW_HEAD + _round16(cur)
    return twice, sent


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="steps before recording")
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    frames = defaultdict(list)  # recorded from the warm-up's end
    hp.wrap_exchanges(lambda exchange: _Recorder(exchange, defaultdict(list), dist.get_world_size()))
    runner = st.Runner("cfc", rank)
    for _ in range(args.warmup):
        runner.step()
    if not isinstance(runner.state._exchange, _Recorder):
        raise SystemExit("cfc's native exchange is not in use here: nothing to record")
    runner.state._exchange._frames = frames
    runner.step()  # the first recorded step: what the next one's slots come from
    runner.state.reset_stats()
    for _ in range(args.steps - 1):
        runner.step()
    torch.cuda.synchronize()
    s = runner.state.stats()
    if rank == 0:
        steps = args.steps - 1
        print(f"\nSlot margins, {len(frames)} buckets, {args.steps} recorded steps, {dist.get_world_size()} GPUs: "
              f"{s.get('resends', 0):.0f} frames sent again by the exchange itself over the last {steps} "
              f"({100 * s.get('resends', 0) / max(1, s['compressed_buckets']):.1f}% of compressed buckets)")
        print("| margin | frames sent twice | % of buckets | MB per step, one rank | x the 1/8 margin's |")
        print("|---|---|---|---|---|")
        base = replay(frames, 1 / 8)[1]
        n = sum(max(0, len(v) - 1) for v in frames.values())
        for margin in (1 / 32, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 3 / 8):
            twice, sent = replay(frames, margin)
            print(f"| {margin:.4f} | {twice} | {100 * twice / max(1, n):.1f}% | {sent / steps / 1e6:.2f} | "
                  f"{sent / max(1, base):.3f} |")
        step_ratios = [b / a for v in frames.values() for a, b in zip(v, v[1:]) if a]
        step_ratios.sort()
        q = [step_ratios[int(f * (len(step_ratios) - 1))] for f in (0.1, 0.5, 0.9, 0.99)]
        print(f"\nA bucket's largest frame over its previous step's: 10% {q[0]:.3f}, median {q[1]:.3f}, "
              f"90% {q[2]:.3f}, 99% {q[3]:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
