"""The step check of :mod:`cfc.fsdp`'s ``fallback="auto"``: whole steps timed with the ways the
groups' trial chose and with every group sent plainly, and every group plain unless the
trial's ways are faster.

Why: the engine's trial times each group's exchange alone, which is what a DDP bucket costs
(the hook returns at once and the exchange overlaps the rest of the backward pass). An FSDP
call returns only once its result is queued, so a compressed group also holds up the host
until its exchange is done, and the backward kernels of the next groups wait behind it; a
plain group costs FSDP nothing of the kind. Over a fast link (NVLink) the trial could then
choose compression for groups whose exchange alone it made faster while the step got slower.
The check measures what the user pays, the step.

How: after the trial, ``trial_steps`` more steps alternate between every group plain (even
steps of the check) and the trial's ways (odd ones). Each is timed from the end of the step
before to its own end, with the device synchronised at both ends (only in these steps), so the
time covers the whole step: forward, backward, optimizer. Every rank's medians go through the
engine (``Engine.gather``) and every rank takes the same verdict from them: the trial's ways
stay only if the slowest rank's median step with them is shorter than the slowest rank's with
every group plain. A new trial (a group changed) starts a new check.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Any, Callable, Dict, List, Optional

logger = logging.getLogger("cfc")


def ahead(engine_state: Dict[str, Any], options: Any) -> int:
    """The next step's index past the trial (negative during the warm-up and the trial), from
    the engine's state (``Engine.state()``, or a checkpoint's) and the state's options. The
    trial's choice is made at the first job of the step after it, so the check starts from the
    step after that one."""
    return engine_state["step"] - engine_state["origin"] - options.warmup_steps - options.trial_steps - 1


class StepCheck:
    """See the module docs. ``steps``: steps of the check, half of them each way (the state's
    ``trial_steps``, an even number). ``clock``: seconds, read at the steps' ends."""

    def __init__(self, steps: int, clock: Callable[[], float] = time.perf_counter):
        self.steps = steps
        self.clock = clock
        self.origin: Optional[int] = None  # the engine's origin of the trial being checked
        self.times: List[List[float]] = [[], []]  # seconds per step: [0] every group plain, [1] the trial's ways
        self.verdict: Optional[bool] = None  # True: the trial's ways; False: every group plain
        self.all_plain = False  # whether every group goes plain in the step under way
        self._last: Optional[float] = None  # the clock at the end of the step before a check step

    def step_ended(self, ahead: int, origin: int, any_compressed: bool, sync: Callable[[], None],
                   gather: Callable[[bytes], List[bytes]]) -> None:
        """At every step's end, on every rank alike. ``ahead``: the next step's index past the
        trial (negative during the warm-up and the trial); ``origin``: the engine's origin of
        that trial; ``any_compressed``: whether the trial chose compression for any group (if
        not, there is nothing to check). ``sync`` waits for the device; ``gather`` is
        ``Engine.gather``."""
        if origin != self.origin:
            self.origin, self.times, self.verdict, self._last = origin, [[], []], None, None
        ended = ahead - 1  # the index of the step that just ended
        if ahead >= 0 and self.verdict is None and not any_compressed:
            self.verdict = False  # (the trial chose plain for every group: so be it)
        if self.verdict is None and -1 <= ended < self.steps and ahead >= 0:
            sync()
            now = self.clock()
            if ended >= 0 and self._last is not None:
                self.times[ended % 2 == 1].append(now - self._last)
            self._last = now if ahead < self.steps else None
            if ended == self.steps - 1:
                self._decide(gather)
        self._set_ahead(ahead)

    def _set_ahead(self, ahead: int) -> None:
        self.all_plain = self.verdict is False or (self.verdict is None and 0 <= ahead < self.steps and ahead % 2 == 0)

    def _decide(self, gather: Callable[[bytes], List[bytes]]) -> None:
        """Every rank's medians gathered, and the verdict taken from them alike on every rank."""
        import struct

        mine = [statistics.median(t) if t else math.nan for t in self.times]
        everyone = [struct.unpack("<2d", b) for b in gather(struct.pack("<2d", *mine))]
        plain, chosen = (max(r[i] for r in everyone) for i in (0, 1))
        if any(math.isnan(x) for r in everyone for x in r):
            # (a way some rank has no time of, as after a resume within the check)
            plain = chosen = math.nan
        self.verdict = not (chosen >= plain)  # (no times: the trial's ways stay)
        logger.info("cfc.fsdp: steps took %.1f ms with the trial's ways and %.1f ms with every group plain "
                    "(the slowest rank's medians over %d steps each): %s", 1e3 * chosen, 1e3 * plain,
                    self.steps // 2, "the trial's ways stay" if self.verdict else "every group goes plain")

    # ---- checkpoints ----

    def saved(self) -> Dict[str, Any]:
        return {"origin": self.origin, "times": [list(t) for t in self.times], "verdict": self.verdict}

    def load(self, saved: Optional[Dict[str, Any]], ahead: int) -> None:
        """What :meth:`saved` gave (checked by ``cfc.ddp.checkpoint``), or None: a fresh check;
        ``ahead`` as in :meth:`step_ended`, for the next step. The interval under way when it
        was saved is lost (the next check step is not timed)."""
        saved = saved or {"origin": None, "times": [[], []], "verdict": None}
        self.origin, self.verdict = saved["origin"], saved["verdict"]
        self.times = [list(t) for t in saved["times"]]
        self._last = None
        self._set_ahead(ahead)
