"""What :mod:`cfc.fsdp` keeps for a :class:`cfc.CfcState` beyond its options, engine and
residuals: :class:`FsdpState`, made by :func:`cfc.fsdp.register` and held as the state's
``_fsdp`` (None for a state DDP or ``AllReducer`` use). The state counts its plain sends in
its ``stats()``; its checkpoint holds the packed residuals as float32 ones, and the engine's
part holds the trial's choice and the step check, so loading one only resets this part
(:meth:`FsdpState.load`).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Set, Tuple


class FsdpState:
    """One state's FSDP part.

    Args:
        options: the state's options (``cfc.ddp.options.Options``), their ``fsdp`` part set:
            its ``residual_bits`` are 32 (float32 residuals) or 4
            (:mod:`cfc.fsdp.packed_residuals`).
    """

    def __init__(self, options: Any):
        self.residual_bits = options.fsdp.residual_bits
        self.packed: Dict[int, Any] = {}  # residuals kept in 4 bits between calls, by key
        # With fallback="auto", the ways of the step under way, read from the engine at its
        # first call (Engine.ways: whether every group goes plain, the step check's choice, and
        # the keys the trial chose plain); None until then.
        self.ways: Optional[Tuple[bool, Set[int]]] = None
        # groups sent plainly without the engine (cfc.fsdp._direct): the keys whose residual
        # went out with them, and their counts
        self.folded: set = set()
        self.direct = {"plain_buckets": 0, "bytes_sent": 0}
        self.step_open = False  # whether a backward pass's step is open (its end is queued)
        self.replicas: Any = None  # with replicas: their state, told of this state's failures

    def load(self) -> None:
        """After the state loaded a checkpoint: packed residuals give way to the loaded ones,
        and the next step's ways are read from the engine, which has the saved trial's choice
        and step check: the groups the saved trial chose plain go through torch from the next
        step on, as they did in the saved run, their residuals going out with their first plain
        call."""
        self.packed = {}
        self.ways = None
        self.folded = set()
