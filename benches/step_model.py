"""A step-time model of data-parallel training across nodes: plain float32 and bfloat16 all-reduce,
cfc's flat exchange and its two-level exchange, from the bytes each sends per level.

    python benches/step_model.py                       # the projection table (markdown)
    python benches/step_model.py --png model.png       # and its picture
    python benches/step_model.py --check run.json      # against an emulated run of cfc.bench

The model, per step, for B bytes of float32 gradients, N nodes of G GPUs (W = N G ranks), each
node with one network link of L bytes/s and GPUs joined inside it at V bytes/s each, cfc's
compression ratio c and codec throughput K (bytes of gradient compressed and decoded per second
on one GPU):

* **float32 ring** (NCCL, rings that cross each node's boundary once): ``2 (W-1)/W B`` leaves
  each node: ``2 (W-1)/W B / L``, plus the same bytes through NVLink, ``/ V``;
* **bfloat16 hook**: the same with ``B/2``;
* **cfc flat**: every rank's codes and sums to every rank, ``2 (W-1)/W B/c`` per rank, of which
  the part for other nodes, ``(W-G)/(W-1)``, leaves the node for each of its G ranks; plus the
  codec on ``B``;
* **cfc two-level**: reduce-scatter and all-gather inside the node, ``2 (G-1)/G B / V``; along
  the rails, each rank's ``B/G`` shard compressed: ``B/c`` leaves a node at 2 nodes (one
  all-gather), ``2 (N-1)/N B/c`` from 3 (reduce-scatter of codes and all-gather of sums); the
  codec on ``B/G``.

cfc's compressed exchanges move their bytes at ``--cfc-efficiency`` of the link's rate for
rings: they are NCCL sends and receives of frames whose sizes the ranks learn first, and reach
less of a link than NCCL's rings do (0.33 of it at 64 MB, 0.45 at 256 MB, in the emulated run of
docs/performance.md, "Two levels, emulated"; the default is 0.4).

The step is the compute time plus the exchange's (no overlap: DDP hides part of the exchange
behind the backward pass, so the figures are upper bounds for every way alike). The defaults are
the 217M LM of docs/performance.md on H200 (``--compute-ms`` its step without communication,
``--ratio`` cfc's at its default bound, ``--codec-gbps`` the CUDA codec's with error feedback).

``--check FILE``: the JSON of ``python -m cfc.bench --json`` run on emulated nodes (every rank's
bytes over loopback, ranks sharing GPUs). The link's rate is taken from the float32 rows, and the
other rows' times predicted from the bytes their ranks sent (``ratio``: a float32 ring's bytes
over each rank's) plus the codec's time, then compared with the measured times.
"""

import argparse
import json
import sys


def exchange_seconds(way, B, N, G, L, V, c, K, e=1.0):
    """Seconds of one step's exchange of ``B`` float32 bytes, by ``way`` (``e``: the part of the
    link's rate cfc's compressed exchanges reach)."""
    W = N * G
    ring = 2 * (W - 1) / W
    if way == "fp32":
        return ring * B / L + ring * B / V
    if way == "bf16":
        return ring * B / 2 / L + ring * B / 2 / V
    if way == "cfc flat":
        per_rank = ring * B / c
        out_of_node = G * per_rank * (W - G) / (W - 1) if W > 1 else 0.0
        return out_of_node / (e * L) + per_rank / V + B / K
    if way == "cfc two-level":
        inside = 2 * (G - 1) / G * B / V
        rail = (1.0 if N == 2 else 2 * (N - 1) / N) * B / c if N > 1 else 0.0
        return inside + rail / (e * L) + B / G / K
    raise ValueError(way)


WAYS = ("fp32", "bf16", "cfc flat", "cfc two-level")


def project(args):
    B = args.params * 4
    rows = []
    for gbit in args.gbits:
        L = gbit * 1e9 / 8
        for N in args.nodes:
            step = {w: args.compute_ms / 1e3 + exchange_seconds(w, B, N, args.per_node, L, args.nvlink_gbps * 1e9,
                                                                    args.ratio, args.codec_gbps * 1e9,
                                                                    args.cfc_efficiency)
                    for w in WAYS}
            rows.append({"gbit": gbit, "nodes": N, **{w: step[w] * 1e3 for w in WAYS}})
    return rows


def table(rows, args):
    out = [f"Step time (ms, lower is better) of a {args.params / 1e6:.0f}M-parameter model, "
           f"{args.compute_ms:g} ms of compute, nodes of {args.per_node} GPUs (NVLink {args.nvlink_gbps:g} GB/s), "
           f"cfc at {args.ratio:g}x fewer bytes, {args.cfc_efficiency:g} of the link's rate and a "
           f"{args.codec_gbps:g} GB/s codec; no overlap",
           "| link per node | nodes | fp32 ring | bf16 hook | cfc flat | cfc two-level | two-level vs fp32 | vs bf16 | vs flat |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["cfc two-level"]
        out.append(f"| {r['gbit']:g} Gbit/s | {r['nodes']} | {r['fp32']:.0f} | {r['bf16']:.0f} | {r['cfc flat']:.0f} | "
                   f"{t:.0f} | {r['fp32'] / t:.2f}x | {r['bf16'] / t:.2f}x | {r['cfc flat'] / t:.2f}x |")
    return "\n".join(out)


def plot(rows, args, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gbits = sorted({r["gbit"] for r in rows})
    fig, axes = plt.subplots(1, len(gbits), figsize=(4.2 * len(gbits), 3.6), sharey=True)
    for ax, g in zip(axes if len(gbits) > 1 else [axes], gbits):
        rs = [r for r in rows if r["gbit"] == g]
        for w in WAYS:
            ax.plot([r["nodes"] for r in rs], [r[w] for r in rs], marker="o", label=w)
        ax.axhline(args.compute_ms, color="grey", ls=":", label="compute alone")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{g:g} Gbit/s per node of {args.per_node} GPUs")
        ax.set_xlabel("nodes")
    axes_list = axes if len(gbits) > 1 else [axes]
    axes_list[0].set_ylabel("step time, ms (lower is better)")
    axes_list[0].legend(fontsize=8)
    fig.suptitle(f"{args.params / 1e6:.0f}M parameters: modelled step time (benches/step_model.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def check(path, args):
    """Predicted against measured times of an emulated run (see the module docs): the rate of
    rings from the fp32 rows, the rate of cfc's compressed exchanges from the flat cfc rows
    (every byte of these runs crosses loopback, inside nodes too); bf16 and two-level predicted."""
    with open(path) as f:
        run = json.load(f)
    W, nodes = run["world"], run.get("nodes", 1)
    G = W // max(1, nodes)
    out = [f"{path}: {W} ranks as {nodes} nodes of {G}; rates from the fp32 and cfc flat rows; codec "
           f"{args.codec_gbps:g} GB/s shared by {args.ranks_per_gpu} ranks of one GPU",
           "| size | method | measured ms | predicted ms | predicted / measured |", "|---|---|---|---|---|"]
    worst = 0.0
    for size in sorted({r["size"] for r in run["rows"]}):
        rows = {r["method"]: r for r in run["rows"] if r["size"] == size}
        ring = 2 * (W - 1) / W * size  # a float32 ring's bytes per rank
        ring_rate = W * ring / rows["fp32"]["seconds"]  # every rank's bytes over loopback, per second
        flat = next(r for m, r in rows.items() if m.startswith("cfc-flat"))
        codec = lambda part: args.ranks_per_gpu * part / (args.codec_gbps * 1e9)  # noqa: E731
        cfc_rate = W * ring / flat["ratio"] / (flat["seconds"] - codec(size))
        out.append(f"| {size >> 20}MB | (rates) | ring {ring_rate / 1e9:.2f} GB/s | cfc {cfc_rate / 1e9:.2f} GB/s | "
                   f"{cfc_rate / ring_rate:.2f} |")
        for m, r in rows.items():
            if m == "bf16":
                predicted = W * ring / 2 / ring_rate
            elif m.startswith("cfc-2l"):
                inside = 2 * (G - 1) / G * size  # per rank: the node's plain reduce-scatter and all-gather
                between = r["node_out_bytes"] * nodes  # every node's bytes to the others
                predicted = W * inside / ring_rate + between / cfc_rate + codec(size / G)
            else:
                continue
            q = predicted / r["seconds"]
            worst = max(worst, abs(q - 1))
            out.append(f"| {size >> 20}MB | {m} | {r['seconds'] * 1e3:.2f} | {predicted * 1e3:.2f} | {q:.2f} |")
    out.append(f"largest difference: {worst * 100:.0f}%")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=217e6, help="gradient elements (float32)")
    p.add_argument("--compute-ms", type=float, default=35.0, help="the step without communication")
    p.add_argument("--ratio", type=float, default=5.0, help="cfc's bytes, fewer than float32 by this")
    p.add_argument("--codec-gbps", type=float, default=500.0, help="GB/s compressed and decoded on one GPU")
    p.add_argument("--nvlink-gbps", type=float, default=300.0, help="GB/s of one GPU's collectives inside a node")
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument("--cfc-efficiency", type=float, default=0.4,
                   help="the part of a link's rate for rings that cfc's compressed exchanges reach")
    p.add_argument("--nodes", default="2,4,8,16,32,64")
    p.add_argument("--gbits", default="100,200,400", help="each node's network link, Gbit/s")
    p.add_argument("--png", default=None)
    p.add_argument("--check", default=None, metavar="JSON")
    p.add_argument("--ranks-per-gpu", type=int, default=1, help="with --check: ranks sharing one GPU's codec")
    args = p.parse_args(argv)
    args.nodes = [int(x) for x in args.nodes.split(",")]
    args.gbits = [float(x) for x in args.gbits.split(",")]
    if args.check:
        print(check(args.check, args))
        return
    rows = project(args)
    print(table(rows, args))
    if args.png:
        plot(rows, args, args.png)


if __name__ == "__main__":
    sys.exit(main())
