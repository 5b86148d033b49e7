"""What :mod:`cfc.fsdp` keeps for a :class:`cfc.CfcState` beyond its options, engine and
residuals: :class:`FsdpState`, made by :func:`cfc.fsdp.register` and held as the state's
``_fsdp`` (None for a state DDP or ``AllReducer`` use). The state saves and loads it with its
own checkpoint (:meth:`FsdpState.saved`, :meth:`FsdpState.load`) and counts its plain sends in
its ``stats()``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from cfc.fsdp.step_check import StepCheck, ahead


class FsdpState:
    """One state's FSDP part.

    Args:
        options: the state's options (``cfc.ddp.options.Options``), their ``fsdp`` part set:
            its ``residual_bits`` are 32 (float32 residuals) or 4
            (:mod:`cfc.fsdp.packed_residuals`).
        checks_steps: whether ``fallback="auto"``'s choice is checked over whole steps
            (:mod:`cfc.fsdp.step_check`): the reduce-scatters' state, not the replicas'.
    """

    def __init__(self, options: Any, checks_steps: bool):
        self.residual_bits = options.fsdp.residual_bits
        self.packed: Dict[int, Any] = {}  # residuals kept in 4 bits between calls, by key
        # groups sent plainly without the engine (cfc.fsdp._direct): the keys the trial chose
        # plain, the keys whose residual went out with them, and their counts
        self.plain_keys: set = set()
        self.folded: set = set()
        self.direct = {"plain_buckets": 0, "bytes_sent": 0}
        self.step_check: Optional[StepCheck] = (
            StepCheck(options.trial_steps) if checks_steps and options.fallback == "auto" else None)
        self.step_open = False  # whether a backward pass's step is open (its end is queued)
        self.replicas: Any = None  # with replicas: their state, told of this state's failures

    def saved(self) -> Dict[str, Any]:
        """What the state's checkpoint adds for FSDP: the step check, where there is one."""
        return {} if self.step_check is None else {"step_check": self.step_check.saved()}

    def load(self, loaded: Dict[str, Any], options: Any) -> None:
        """After the state loaded a checkpoint (``loaded``: ``cfc.ddp.checkpoint.parse_state``'s):
        the groups the saved trial chose plain go through torch from the next step, as they did
        in the saved run, their residuals going out with their first plain call; packed
        residuals give way to the loaded ones; the step check goes on where it was."""
        self.packed = {}
        self.plain_keys = ({b["key"] for b in loaded["engine"]["buckets"] if b["decision"] is False}
                           if options.fallback == "auto" else set())
        self.folded = set()
        if self.step_check is not None:
            self.step_check.load(loaded["step_check"], ahead(loaded["engine"], options))
