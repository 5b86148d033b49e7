"""cfc: error-bounded and lossless compression of float tensors for PyTorch.

The codec compresses float32, bfloat16 and float16 tensors (CPU tensors and numpy arrays)
into self-describing frames in which every finite element comes back within a strict bound.

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
from cfc.ddp import CfcState, cfc_hook
from cfc.codec import (
    Compressed,
    CudaCompressed,
    compress,
    decompress,
    fixed_rate_size,
    frame_info,
    sum_compressed,
)

__all__ = [
    "CfcError",
    "CfcState",
    "Compressed",
    "CudaCompressed",
    "FORMAT_VERSION",
    "FormatError",
    "__version__",
    "compress",
    "cfc_hook",
    "cuda_available",
    "decompress",
    "distributed",
    "fixed_rate_size",
    "frame_info",
    "sum_compressed",
]
