"""Compress a model's parameters: cfc lossless, cfc within a bound, zstd, and bf16/fp16 casts.

For every tensor of a state_dict (the LM trained by ``examples/ddp_train.py --save FILE``, any
``torch.save``'d state_dict, or a freshly initialised byte-level transformer LM), prints the
size, the ratio of each method, its largest error and the time it took, then the totals; and
writes the whole model with ``cfc.save`` and reads it back with ``cfc.load``.

    python examples/compress_model.py [--state-dict FILE] [--eps 1e-4] [--top 12]
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import torch
import torch.nn as nn

import cfc
from cfc import _native

HERE = pathlib.Path(__file__).resolve().parent
TRAINED = HERE.parent / "bench-out" / "ddp_train" / "lm.pt"


def tensors_of(obj, prefix: str = "") -> dict:
    """The tensors of a loaded checkpoint, by dotted name: a state_dict, or a dict holding some
    (e.g. ``{"model": ..., "opt": ...}``), walked through nested dicts and lists."""
    if isinstance(obj, torch.Tensor):
        return {prefix.rstrip("."): obj} if obj.layout == torch.strided else {}  # (dense only)
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    found = {}
    for k, v in items:
        found.update(tensors_of(v, f"{prefix}{k}."))
    return found


def fresh_lm() -> dict:
    """A 6-layer byte-level transformer LM (about 19M parameters), freshly initialised."""
    torch.manual_seed(0)
    d = 512
    layer = nn.TransformerEncoderLayer(d, 8, 4 * d, batch_first=True, norm_first=True)
    model = nn.ModuleDict({"embed": nn.Embedding(256, d),
                           "blocks": nn.TransformerEncoder(layer, 6, enable_nested_tensor=False),
                           "head": nn.Linear(d, 256)})
    return model.state_dict()


def methods(eps: float):
    """(name, fn(tensor) -> (compressed bytes, decoded tensor or None for exact)) for each method."""
    def lossless(t, zstd=False):
        c = cfc.compress(t, lossless=True, zstd=zstd)
        return c.nbytes, cfc.decompress(c)

    def bounded(t):
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return lossless(t)
        c = cfc.compress(t, eps=eps)
        return c.nbytes, cfc.decompress(c)

    def zstd(t):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        return len(_native.zstd_compress(raw, 3)), t

    def cast(dtype):
        def go(t):
            if t.dtype != torch.float32:
                return t.numel() * t.element_size(), t  # casts only shrink float32
            y = t.to(dtype)
            return y.numel() * y.element_size(), y.float()
        return go

    return [("cfc lossless", lossless), ("+ zstd", lambda t: lossless(t, True)),
            (f"cfc eps={eps:g}", bounded), ("zstd -3", zstd),
            ("bf16 cast", cast(torch.bfloat16)), ("fp16 cast", cast(torch.float16))]


def max_err(t, y) -> float:
    if not t.is_floating_point() or t.numel() == 0:
        return 0.0 if torch.equal(t, y) else float("inf")
    a, b = t.double(), y.double()
    fin = torch.isfinite(a)
    return (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state-dict", type=pathlib.Path, default=None)
    ap.add_argument("--eps", type=float, default=1e-4, help="absolute bound of the bounded method")
    ap.add_argument("--top", type=int, default=12, help="tensors listed one by one (the largest)")
    args = ap.parse_args()
    path = args.state_dict or (TRAINED if TRAINED.is_file() else None)
    if path is not None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        print(f"state_dict from {path}")
    else:
        state = fresh_lm()
        print("a freshly initialised 19M-parameter LM (train one with examples/ddp_train.py --save FILE)")
    state = tensors_of(state)
    known = cfc._checks._DTYPE_NAMES + cfc._checks._LOSSLESS_ONLY
    skipped = sorted({str(v.dtype).replace("torch.", "") for v in state.values()} - set(known))
    state = {k: v for k, v in state.items() if str(v.dtype).replace("torch.", "") in known}
    if skipped:
        print(f"(left out: tensors of {', '.join(skipped)}, which cfc does not store)")
    ms = methods(args.eps)
    total = sum(v.numel() * v.element_size() for v in state.values())
    if not total:
        raise SystemExit("no tensor with data to compress in that file")
    sizes = {m: 0 for m, _ in ms}
    errs = {m: 0.0 for m, _ in ms}
    secs = {m: 0.0 for m, _ in ms}
    rows = []
    for name, t in state.items():
        row = [name, str(t.dtype).replace("torch.", ""), t.numel() * t.element_size()]
        for m, fn in ms:
            t0 = time.perf_counter()
            size, y = fn(t)
            secs[m] += time.perf_counter() - t0
            e = max_err(t, y)
            sizes[m] += size
            errs[m] = max(errs[m], e)
            row.append((row[2] / max(size, 1), e))
        rows.append(row)
    print(f"\n{len(state)} tensors, {total / 1e6:.1f} MB. Ratio (max error) per method; "
          f"the {args.top} largest tensors, then the total:")
    head = f"{'tensor':<40} {'dtype':<9} {'MB':>7}" + "".join(f" {m:>20}" for m, _ in ms)
    print(head)
    for r in sorted(rows, key=lambda r: -r[2])[: args.top]:
        cells = "".join(f" {f'{q:.3f}x ({e:.0e})' if e else f'{q:.3f}x (exact)':>20}" for q, e in r[3:])
        print(f"{r[0][:40]:<40} {r[1]:<9} {r[2] / 1e6:>7.2f}{cells}")
    cells = "".join(f" {f'{total / sizes[m]:.3f}x ({errs[m]:.0e})' if errs[m] else f'{total / sizes[m]:.3f}x (exact)':>20}"
                    for m, _ in ms)
    print(f"{'TOTAL':<40} {'':<9} {total / 1e6:>7.2f}{cells}")
    print(f"{'compress + decompress, s':<58}" + "".join(f" {secs[m]:>20.2f}" for m, _ in ms))

    with tempfile.TemporaryDirectory() as tmp:
        f = pathlib.Path(tmp) / "model.cfc"
        t0 = time.perf_counter()
        rep = cfc.save(state, f)
        t1 = time.perf_counter()
        back = cfc.load(f)
        t2 = time.perf_counter()
        exact = all(torch.equal(back[k].reshape(-1).view(torch.uint8), v.contiguous().reshape(-1).view(torch.uint8))
                    if v.dtype != torch.bool else torch.equal(back[k], v) for k, v in state.items())
        print(f"\ncfc.save: {rep['bytes'] / 1e6:.1f} MB ({rep['ratio']:.3f}x) in {t1 - t0:.2f} s; cfc.load in "
              f"{t2 - t1:.2f} s; every bit back: {exact}")


if __name__ == "__main__":
    main()
