"""cfc: error-bounded and lossless compression of tensors for PyTorch.

The codec compresses float32, bfloat16 and float16 tensors (CPU and CUDA tensors, numpy
arrays) into self-describing frames in which every finite element comes back within a strict
bound; with ``lossless=True`` it stores tensors of any common dtype bit for bit.
``cfc.save`` / ``cfc.load`` write and read whole checkpoints.

Example::

    >>> import torch, cfc
    >>> x = torch.randn(10_000) * 1e-3
    >>> c = cfc.compress(x, eps=1e-5)
    >>> y = cfc.decompress(c)
    >>> bool((x.double() - y.double()).abs().max() <= c.eps)
    True
"""

from cfc._native import CfcError, FormatError, FORMAT_VERSION, __version__
from cfc._native import cuda_available
from cfc import distributed
from cfc.ddp import CfcState, cfc_hook, register_comm_hook
from cfc.codec import (
    Compressed,
    CudaCompressed,
    PinnedCompressed,
    compress,
    decompress,
    fixed_rate_size,
    frame_info,
    pin,
    sum_compressed,
)
from cfc.checkpoint import load, save

__all__ = [
    "CfcError",
    "CfcState",
    "Compressed",
    "CudaCompressed",
    "FORMAT_VERSION",
    "PinnedCompressed",
    "FormatError",
    "__version__",
    "compress",
    "cfc_hook",
    "cuda_available",
    "decompress",
    "distributed",
    "fixed_rate_size",
    "frame_info",
    "load",
    "pin",
    "register_comm_hook",
    "save",
    "sum_compressed",
]


def __getattr__(name: str):
    # cfc.fsdp imports torch's FSDP2 at once: loaded on first use, so `import cfc` stays light.
    if name == "fsdp":
        import importlib

        return importlib.import_module("cfc.fsdp")
    raise AttributeError(f"module 'cfc' has no attribute {name!r}")
