"""Training parity over seeds: reads the ``losses.json`` that ``examples/ddp_train.py --out DIR``
wrote for each seed and prints one table: every hook's final training loss (mean of the last
10% of steps) and held-out loss per seed, each against the first hook's (plain all-reduce), and
the mean and standard error of those differences over seeds. A hook listed twice in a run is
plain's rerun: it shows how far two runs of the same hook land apart.

    python benches/parity_table.py OUT/ddp_parity_seed*/losses.json

``--curve`` adds the held-out loss at every scoring step, each hook against plain, as a mean
over seeds: how far a hook lags in the middle of training, where the final loss no longer shows
it.
"""

import argparse
import json
import math
import statistics
from pathlib import Path


def load(path: Path):
    d = json.loads(path.read_text())
    seed = d["args"].get("seed", "?")
    rows, seen = [], {}
    for r in d["results"]:
        n = seen[r["hook"]] = seen.get(r["hook"], 0) + 1
        name = r["hook"] if n == 1 else f"{r['hook']} (rerun)"
        # as examples/ddp_train.py computed them: the mean of the last 10% of steps' training
        # loss, and the last held-out score
        rows.append((name, r["final_loss"], r["final_held_out"], r.get("cfc", {}).get("ratio"), r["held_out"]))
    return seed, rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--curve", action="store_true", help="also the held-out loss at every scoring step, against plain")
    args = p.parse_args()
    runs = [load(f) for f in args.files]
    diffs = {}  # hook -> [(train %, held-out %)] over seeds
    print("| seed | hook | final training loss | vs plain | held-out loss | vs plain | fewer bytes |")
    print("|---|---|---|---|---|---|---|")
    for seed, rows in runs:
        _, base_final, base_held, _, _ = rows[0]
        for name, final, held, ratio, _ in rows:
            dt, dh = 100 * (final / base_final - 1), 100 * (held / base_held - 1)
            if name != rows[0][0]:
                diffs.setdefault(name, []).append((dt, dh))
            fewer = f"{ratio:.1f}x" if ratio else "-"
            print(f"| {seed} | {name} | {final:.4f} | {dt:+.2f}% | {held:.4f} | {dh:+.2f}% | {fewer} |")
    print("\n| hook | seeds | training loss vs plain: mean (s.e.) | held-out vs plain: mean (s.e.) | range of held-out |")
    print("|---|---|---|---|---|")
    for name, ds in diffs.items():
        t, h = [x for x, _ in ds], [y for _, y in ds]

        def ms(v):
            se = f"{statistics.stdev(v) / math.sqrt(len(v)):.2f}%" if len(v) > 1 else "-"
            return f"{statistics.mean(v):+.2f}% ({se})"

        print(f"| {name} | {len(ds)} | {ms(t)} | {ms(h)} | {min(h):+.2f}% .. {max(h):+.2f}% |")
    if args.curve:
        curve(runs)


def curve(runs):
    """Held-out loss against plain's at each scoring step, mean over seeds (and range)."""
    at = {}  # hook -> step -> [% vs plain]
    for _, rows in runs:
        base = dict(map(tuple, rows[0][4]))
        for name, _, _, _, held in rows[1:]:
            for step, v in held:
                if step in base:
                    at.setdefault(name, {}).setdefault(step, []).append(100 * (v / base[step] - 1))
    steps = sorted({st for per in at.values() for st in per})
    print("\nHeld-out loss against plain's at each scoring step: mean over seeds (min .. max)")
    print("| hook | " + " | ".join(str(st) for st in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for name, per in at.items():
        cells = [f"{statistics.mean(per[st]):+.1f}% ({min(per[st]):+.1f}..{max(per[st]):+.1f})" if st in per else "-"
                 for st in steps]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
