"""How many bits per element the quantized codes take in a cfc frame, against what an entropy
coder could reach: how many fewer bytes a coded body would send, before anyone builds one.

For every gradient vector (``.npy``) in ``--grads`` and every bound ``eps = B x RMS``, prints:

- ``frame``: bits per element of the frame cfc's CPU codec writes (header, width bytes,
  bit planes, exceptions), measured;
- ``planes``: the bit-plane body alone (one width byte per group of 32, ``width`` bits per
  element), computed from the codes, to show the frame is what this model says;
- ``H0``: the order-0 entropy of the codes (one distribution for the whole vector);
- ``rice``: a Rice code of the zigzag codes per chunk of 1024 elements, each chunk with the
  best of 16 parameters ``k`` (cost ``(z >> k) + 1 + k`` bits, a code past 32 unary bits
  escaped with 64 more), plus 5 bytes per chunk (its ``k`` and its offset); and ``best``:
  per chunk the smaller of that and the chunk's bit planes (one more bit per chunk).

The codes are the format's (``docs/FORMAT.md``): ``q = round_half_even(x / (2 eps))``, zigzag
``z = 2q`` or ``-2q - 1``. Runs on the CPU::

    python benches/code_entropy.py --grads ../shared/data/grads
"""

import argparse
import pathlib

import numpy as np
import torch

import cfc

CHUNK, GROUP = 1024, 32


def zigzag_codes(x: np.ndarray, eps: float) -> np.ndarray:
    q = np.rint(x.astype(np.float64) / (2 * eps)).astype(np.int64)
    return (q << 1) ^ (q >> 63)


def plane_bits(z: np.ndarray) -> np.ndarray:
    """Bits of each group of 32's bit planes plus its width byte (rows: groups)."""
    g = z.reshape(-1, GROUP).max(axis=1)
    width = np.where(g == 0, 0, np.floor(np.log2(np.maximum(g, 1))) + 1)
    return width * GROUP + 8


def rice_bits(z: np.ndarray) -> np.ndarray:
    """Each chunk's (rows of 1024 codes) Rice-coded size at its best k, in bits."""
    costs = []
    for k in range(16):
        unary = z >> k
        per = np.where(unary < 32, unary + 1 + k, 32 + 64)
        costs.append(per.sum(axis=1))
    return np.min(np.stack(costs), axis=0) + 40


def entropy(z: np.ndarray) -> float:
    _, counts = np.unique(z, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grads", default="../shared/data/grads", help="folder of .npy gradient vectors")
    p.add_argument("--bounds", type=float, nargs="*", default=[0.3, 0.1], help="eps as multiples of the RMS")
    args = p.parse_args()
    files = sorted(pathlib.Path(args.grads).glob("*.npy"))
    if not files:
        raise SystemExit(f"no .npy files in {args.grads}")
    print("| vector | bound | zeros | frame | planes | H0 | rice | best | frame / best |")
    print("|---|---|---|---|---|---|---|---|---|")
    for f in files:
        x = np.load(f).astype(np.float32).ravel()
        n = x.size - x.size % CHUNK  # whole chunks, so every column counts the same elements
        x = x[:n]
        rms = float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))
        for b in args.bounds:
            eps = b * rms
            frame = cfc.compress(torch.from_numpy(x), eps=eps).nbytes * 8 / n
            z = zigzag_codes(x, eps)
            planes = plane_bits(z)
            chunks = z.reshape(-1, CHUNK)
            rice = rice_bits(chunks)
            planes_per_chunk = planes.reshape(-1, CHUNK // GROUP).sum(axis=1)
            best = np.minimum(rice, planes_per_chunk) + 1
            row = [
                f.stem, f"{b:g}", f"{np.mean(z == 0):.0%}", f"{frame:.2f}", f"{planes.sum() / n:.2f}",
                f"{entropy(z):.2f}", f"{rice.sum() / n:.2f}", f"{best.sum() / n:.2f}", f"{frame / (best.sum() / n):.2f}x",
            ]
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
