"""How cfc_hook changes what Adam sees: a diagnostic for the lag in the middle of training.

Trains the byte-level LM of ``examples/ddp_train.py`` (small, on the CPU over gloo, or one GPU
per process over NCCL) for ``--steps`` steps, once with plain all-reduce and once with cfc_hook
(``--rms``), from the same weights on the same batches, and compares AdamW's moments at the
end, element by element: the root of the second moment (``sqrt(v)``), grouped by plain's
quartiles, and the size of the normalised step ``|m| / sqrt(v)``. Quantization noise that
error feedback carries to later steps still adds to ``v``; if it does so for the many small
gradients, their steps shrink. Run under torchrun::

    torchrun --standalone --nproc_per_node=2 benches/adam_moments.py --steps 120
"""

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import ddp_train  # noqa: E402

import cfc  # noqa: E402


def moments(hook, data, dev, args):
    """AdamW's sqrt(v) and |m| of every element after training with ``hook``."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = ddp_train.LM(args.d_model, args.layers, args.heads, args.seq).to(dev)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    if hook == "cfc":
        ddp.register_comm_hook(cfc.CfcState(rms=args.rms, per_tensor=args.per_tensor), cfc.cfc_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        chunk = ddp_train.batch(data, gen, args).to(dev)
        loss = nn.functional.cross_entropy(ddp(chunk[:, :-1]).flatten(0, 1), chunk[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = list(model.parameters())
    v = torch.cat([opt.state[p]["exp_avg_sq"].sqrt().flatten() for p in params]).cpu()
    m = torch.cat([opt.state[p]["exp_avg"].abs().flatten() for p in params]).cpu()
    return v, m


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--rms", type=float, default=0.3)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--per-tensor", action="store_true", help="one bound per parameter (per_tensor=True)")
    args = p.parse_args()
    args.batch, args.seq, args.d_model, args.layers, args.heads = 16, 128, 128, 2, 4
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    data = ddp_train.corpus(4 * 2**20)
    vp, mp = moments("plain", data, dev, args)
    vc, mc = moments("cfc", data, dev, args)
    if dist.get_rank() == 0:
        seen = vp > 0  # bytes never seen leave their embedding rows at v = 0 either way
        vp, mp, vc, mc = vp[seen], mp[seen], vc[seen], mc[seen]
        edges = [0.0] + torch.quantile(vp[:1_000_000], torch.tensor([0.25, 0.5, 0.75, 0.95])).tolist() + [float("inf")]
        print(f"AdamW after {args.steps} steps, plain all-reduce against cfc_hook at rms={args.rms}, "
              f"{'per tensor' if args.per_tensor else 'per bucket'} "
              f"({vp.numel()} elements with nonzero v)")
        print("| elements, by plain's sqrt(v) | count | median sqrt(v) cfc / plain | median |m|/sqrt(v): plain | cfc |")
        print("|---|---|---|---|---|")
        names = ["lowest quarter", "second quarter", "third quarter", "75-95%", "top 5%"]
        for name, lo, hi in zip(names, edges, edges[1:]):
            sel = (vp >= lo) & (vp < hi)
            ratio = float((vc[sel] / vp[sel]).median())
            step_p, step_c = float((mp[sel] / vp[sel]).median()), float((mc[sel] / vc[sel].clamp_min(1e-30)).median())
            print(f"| {name} | {int(sel.sum())} | {ratio:.3f} | {step_p:.3f} | {step_c:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
