"""``cfc_hook``: a DistributedDataParallel communication hook that all-reduces compressed buckets.

Example::

    >>> # needs an initialised process group: not run as a doctest
    >>> from cfc import CfcState, cfc_hook  # doctest: +SKIP
    >>> ddp.register_comm_hook(CfcState(), cfc_hook)  # doctest: +SKIP

Every bucket is quantized with a strict bound (by default ``0.05 x`` the RMS of the bucket's
gradient), with error feedback: what rounding drops on a rank is added to that rank's next
gradient, so over many steps nothing is lost. NaN and infinities travel exactly, so AMP's
GradScaler still sees an overflow on any rank.

The buckets go through cfc's engine (``cfc::engine`` in the Rust core): one comm thread per
state, CPU buckets over TCP links of its own, CUDA buckets over an NCCL communicator of its
own. The package is split by role:

* :mod:`cfc.ddp.hook`: the hook and :func:`register_comm_hook`;
* :mod:`cfc.ddp.state`: :class:`CfcState`, the options and the engine's life;
* :mod:`cfc.ddp.options`: the options, checked once;
* :mod:`cfc.ddp.residuals`: error-feedback residuals kept per parameter;
* :mod:`cfc.ddp.checkpoint`: the checked fields of a saved state.
"""

from cfc.ddp.hook import cfc_hook, register_comm_hook
from cfc.ddp.state import CfcState

__all__ = ["CfcState", "cfc_hook", "register_comm_hook"]
