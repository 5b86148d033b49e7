"""The checkpoint of a :class:`cfc.CfcState` (``state_dict`` / ``load_state_dict``): its fields
checked before anything changes."""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, Mapping, Sequence

from cfc import _native
from cfc.ddp.options import Options

logger = logging.getLogger("cfc")

# 4: the engine's state (per-bucket statistics and choices) in one field
STATE_VERSION = 4
# What a refusal says: one checkpoint format serves cfc_hook, AllReducer and cfc.fsdp (the
# engine's part says the same: python/src/engine_state.rs).
NOT_A_STATE = "not a CfcState checkpoint"
# What a state can serve (CfcState._serve), as its checkpoint says.
ENTRY_POINTS = ("cfc_hook", "AllReducer", "cfc.fsdp", "cfc.fsdp replicas")


def _sequence(value: Any, what: str) -> Sequence:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{NOT_A_STATE}: {what} is a {type(value).__name__}, not a list")
    return value


def _count(value: Any, what: str, key: bool = False) -> int:
    if key and isinstance(value, str) and value.isdigit():
        value = int(value)  # a key that went through a format whose keys are strings
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{NOT_A_STATE}: {what} is {value!r}, not an integer >= 0")
    return value


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{NOT_A_STATE}: {what} is {value!r}, not a number")
    return float(value)


def _mapping(sd: Mapping, name: str) -> Mapping:
    if name not in sd:
        raise ValueError(f"{NOT_A_STATE}: no {name!r}")
    value = sd[name]
    if not isinstance(value, Mapping):
        raise ValueError(f"{NOT_A_STATE}: {name!r} is a {type(value).__name__}, not a mapping")
    return value


def _engine_state(e: Any) -> Dict[str, Any]:
    """The engine's part, checked by the core (its one reader and writer:
    ``python/src/engine_state.rs``), as ``_native.Engine.load_state`` takes it."""
    return _native.parse_engine_state(e)


def parse_state(sd: Mapping, options: Options, rank: int, world: int) -> Dict[str, Any]:
    """The fields of a state saved by ``CfcState.state_dict``, checked and converted, or
    ``ValueError`` naming the first field that is not what ``state_dict`` makes. CPU residuals are
    kept as they are, not copied (a large model's take as much memory as its parameters)."""
    import torch

    if not isinstance(sd, Mapping) or sd.get("version") != STATE_VERSION:
        raise ValueError(f"{NOT_A_STATE} (or one of another version)")
    saved_rank, saved_world = _count(sd.get("rank"), "rank"), _count(sd.get("world"), "world")
    if (saved_world, saved_rank) != (world, rank):
        raise ValueError(
            f"this state was saved by rank {saved_rank} of {saved_world}; this is rank {rank} of {world} "
            "(each rank loads its own)"
        )
    # (states saved before a field existed: "block" was 0, and "fsdp" was not recorded)
    saved = {"block": 0, "fsdp": options.saved()["fsdp"], **dict(_mapping(sd, "options"))}
    fsdp = saved["fsdp"]
    if isinstance(fsdp, Mapping) and "per_parameter" in fsdp:
        # cfc.fsdp's per-parameter scales, which block scales replaced: residuals were saved in
        # the parameters' own units, so the run resumes without them (one step per group).
        saved["fsdp"] = {k: v for k, v in fsdp.items() if k != "per_parameter"}
        if fsdp["per_parameter"]:
            logger.warning("cfc: this state was saved with cfc.fsdp's per-parameter scales, which this version of "
                           "cfc does not have; it resumes with one step per FSDP group (block scales, "
                           "CfcState(block=256), give each block of 256 values its own)")
    if saved != options.saved():
        raise ValueError(f"this state was saved with {saved}; these options are {options.saved()}")
    residuals = {}
    for o, r in _mapping(sd, "residuals").items():
        o = _count(o, "a residual's parameter ordinal", key=True)
        if not (isinstance(r, torch.Tensor) and r.dtype == torch.float32 and r.dim() == 1
                and r.layout == torch.strided and r.device.type != "meta"):
            raise ValueError(f"the residual of parameter {o} is not a 1-D float32 dense tensor: {NOT_A_STATE}")
        r = r.detach().cpu()
        if not bool(torch.isfinite(r).all()):
            # the codec never leaves a non-finite value in a residual (it would reach the
            # gradients of every rank)
            raise ValueError(f"the residual of parameter {o} holds a NaN or an infinity: {NOT_A_STATE}")
        residuals[o] = r
    layouts = {_count(i, "a bucket index", key=True): tuple(_count(x, "a layout's ordinal")
                                                             for x in _sequence(l, "a layout"))
               for i, l in _mapping(sd, "layouts").items()}
    step = _count(sd.get("step"), "step")
    engine = dict(_mapping(sd, "engine"))
    if "step_check" in sd and engine.get("step_check") is None:
        # (cfc.fsdp's step check, saved beside the engine's state before the engine ran it)
        engine["step_check"] = sd["step_check"]
    engine = _engine_state(engine)
    if not math.isfinite(float(step)):  # pragma: no cover - an int
        raise ValueError(NOT_A_STATE)
    serves = sd.get("serves")  # (None: a state that served nothing, or saved before it was recorded)
    if serves is not None and serves not in ENTRY_POINTS:
        raise ValueError(f"{NOT_A_STATE}: it serves {serves!r}, not one of {list(ENTRY_POINTS)}")
    return {"step": step, "residuals": residuals, "layouts": layouts, "engine": engine, "serves": serves}
