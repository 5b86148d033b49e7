"""The options of :class:`cfc.CfcState`, checked once and frozen.

The same names are used by :class:`cfc.distributed.AllReducer` (which takes a ``CfcState``) and by
``python -m cfc.bench``: ``eps`` / ``rel`` / ``rms`` (the bound), ``error_feedback``,
``warmup_steps``, ``min_compress_numel``, ``fallback`` (``"never"``, ``"auto"``, ``"always"``),
``trial_steps``, ``algorithm``, ``topology``, ``coder``, ``block``, ``timeout``.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import Any, Dict, Optional

from cfc import _native
from cfc._checks import _check_flag, _check_integer, _check_number

BOUND_KINDS = ("eps", "rel", "rms")

# The bound when none is given: rms=0.05. Over 5 seeds on a byte-level LM and a conv net (DDP, 2
# GPUs), it kept the held-out loss within 0.70% and 0.57% of plain all-reduce's from 20% of
# training on, at 4.9-5.6x fewer bytes; rms=0.1 ended 1.8-1.9% above plain (5.7-6.7x), rms=0.3
# 4.4-7.1% (7.8-9x). See docs/performance.md, "Training quality over seeds".
DEFAULT_RMS = 0.05
ALGORITHMS = ("all-gather", "reduce-scatter")
FALLBACKS = ("never", "auto", "always")
TOPOLOGIES = ("auto", "flat", "two-level")
CODERS = ("planes", "rice")
# Block scales (``block=``): elements per block, a power of two in this range, or 0 for none
# (defined by the core: cfc::scales).
BLOCK_RANGE = _native.BLOCK_RANGE
# The absolute bounds the codec accepts (defined by the core: cfc::MIN_EPS, cfc::MAX_EPS): normal
# float64 values up to a quarter of the largest, so that a step of 2 eps and its sums stay finite.
EPS_MIN, EPS_MAX = _native.EPS_RANGE
# How long any wait for a peer lasts before the engine fails, unless `timeout=` or CFC_TIMEOUT says.
DEFAULT_TIMEOUT = 300.0
# The timeouts the engine takes, in seconds (defined in cfc::engine::options).
TIMEOUT_RANGE = _native.TIMEOUT_RANGE


def _default_timeout() -> float:
    """CFC_TIMEOUT (seconds) where it is set, else ``DEFAULT_TIMEOUT``; read (by the core:
    ``cfc::env``) when options are made, so that a malformed value is an error of the state
    being made, not of ``import cfc``."""
    said = _native.env_timeout()
    return DEFAULT_TIMEOUT if said is None else said


@dataclasses.dataclass(frozen=True)
class FsdpOptions:
    """The options of :mod:`cfc.fsdp`'s calls (see :func:`cfc.fsdp.register`), set on a state
    by ``cfc.fsdp``: the engine agrees them between ranks with the others, and checkpoints
    record them."""

    residual_bits: int = 32  # residuals kept between calls as float32 (32) or packed (4)
    # with fallback="auto", the trial's ways checked over whole steps by the engine
    # (src/engine/step_check.rs): the reduce-scatters' state, not the replicas'
    step_check: bool = False


@dataclasses.dataclass(frozen=True)
class Options:
    """Checked options (see :class:`cfc.CfcState` for their meaning)."""

    bound_kind: str = "rms"
    bound: float = 0.3
    error_feedback: bool = True
    warmup_steps: int = 2
    min_compress_numel: int = 16384
    fallback: str = "never"
    trial_steps: int = 0
    algorithm: Optional[str] = None
    topology: str = "auto"
    coder: str = "planes"
    block: int = 0
    timeout: float = DEFAULT_TIMEOUT
    log_every: int = 0
    fsdp: Optional[FsdpOptions] = None  # set by cfc.fsdp for the states it runs on

    @classmethod
    def parse(
        cls,
        *,
        eps: Any = None,
        rel: Any = None,
        rms: Any = None,
        error_feedback: Any = True,
        warmup_steps: Any = 2,
        min_compress_numel: Any = 16384,
        fallback: Any = "never",
        trial_steps: Any = 4,
        algorithm: Any = None,
        topology: Any = "auto",
        coder: Any = "planes",
        block: Any = 0,
        timeout: Any = None,
        log_every: Any = 0,
    ) -> "Options":
        """Checks every option; raises ``ValueError`` or ``TypeError`` naming the first bad one."""
        given = [(k, v) for k, v in (("eps", eps), ("rel", rel), ("rms", rms)) if v is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of eps, rel, rms; got {[k for k, _ in given]}")
        kind, value = given[0] if given else ("rms", DEFAULT_RMS)
        bound = _check_number(kind, value)
        if not (math.isfinite(bound) and bound > 0):
            raise ValueError(f"{kind} must be positive and finite, got {value!r}")
        if kind == "rel" and bound >= 1:
            # Every element lies within the bucket's largest magnitude of zero: all would come
            # back as zero, every step, and the residuals would only grow.
            raise ValueError(f"rel must be below 1 (rel=0.01 is 1% of the largest magnitude), got {value!r}")
        if kind == "eps" and not (EPS_MIN <= bound <= EPS_MAX):
            raise ValueError(f"eps must lie between {EPS_MIN:g} and {EPS_MAX:g}, got {value!r}")
        _check_flag("error_feedback", error_feedback)
        counts = {}
        for name, count in (("warmup_steps", warmup_steps), ("min_compress_numel", min_compress_numel),
                            ("log_every", log_every), ("trial_steps", trial_steps)):
            counts[name] = _check_integer(name, count)
            if counts[name] < 0:
                raise ValueError(f"{name} must be >= 0, got {count}")
        if fallback is False:
            fallback = "never"  # the documented spelling of "always compress"
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback must be 'never' (or False), 'auto' or 'always', got {fallback!r}")
        trial = counts["trial_steps"] if fallback == "auto" else 0
        if fallback == "auto" and (trial < 2 or trial % 2):
            raise ValueError(f"trial_steps must be an even number >= 2, got {trial_steps}")
        if algorithm is not None and algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be None, 'all-gather' or 'reduce-scatter', got {algorithm!r}")
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology must be 'auto', 'flat' or 'two-level', got {topology!r}")
        if coder not in CODERS:
            raise ValueError(f"coder must be 'planes' or 'rice', got {coder!r}")
        block = _check_integer("block", block)
        if block:
            low, high = BLOCK_RANGE
            if kind != "rms" or bound >= 1:
                raise ValueError(f"block scales follow each block's RMS: block={block} takes rms= below 1, "
                                 f"not {kind}={value!r}")
            if block & (block - 1) or not low <= block <= high:
                raise ValueError(f"block must be 0 or a power of two from {low} to {high}, got {block}")
        if timeout is None:
            seconds = _default_timeout()
        elif isinstance(timeout, datetime.timedelta):
            seconds = timeout.total_seconds()
        elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            seconds = float(timeout)
        else:
            raise ValueError(f"timeout must be positive seconds or a timedelta, got {timeout!r}")
        low, high = TIMEOUT_RANGE
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        if not low <= seconds <= high:
            raise ValueError(f"timeout must lie between {low:g} s and {high / 86400:g} days, got {timeout!r}")
        return cls(
            bound_kind=kind, bound=bound, error_feedback=bool(error_feedback),
            warmup_steps=counts["warmup_steps"], min_compress_numel=counts["min_compress_numel"],
            fallback=fallback, trial_steps=trial, algorithm=algorithm, topology=topology, coder=coder,
            block=block, timeout=seconds,
            log_every=counts["log_every"],
        )

    def engine(self) -> Dict[str, Any]:
        """The options as ``_native.Engine`` takes them."""
        return {
            "bound_kind": self.bound_kind, "bound": self.bound, "error_feedback": self.error_feedback,
            "algorithm": self.algorithm, "fallback": self.fallback, "trial_steps": self.trial_steps,
            "warmup_steps": self.warmup_steps, "min_compress_numel": self.min_compress_numel,
            "topology": self.topology, "coder": self.coder, "block": self.block, "timeout": self.timeout,
            "fsdp": None if self.fsdp is None else (self.fsdp.residual_bits, self.fsdp.step_check),
        }

    def saved(self) -> Dict[str, Any]:
        """What a checkpoint records and compares (the timeout, logging, topology and coder may
        differ: a state saved under one topology loads under another, see
        ``src/engine/levels.rs``, and the coder changes the bytes, not the codes or residuals)."""
        d = dataclasses.asdict(self)
        del d["timeout"], d["log_every"], d["topology"], d["coder"]
        return d
