"""The pieces cfc.fsdp runs each group through, without processes: residuals in 4 bits
(``cfc.fsdp.packed_residuals``), and the checkpoint of the engine's check of
``fallback="auto"`` over whole steps."""

import math

import pytest
import torch

from cfc import _native
from cfc.fsdp import packed_residuals


@pytest.mark.parametrize("n", [1, 2, 1001, 4096])
def test_a_packed_residual_is_within_a_fourteenth_of_its_chunks_largest_value(n):
    # a scale that drops 10x every 256 values (residuals of block scales differ so): each chunk
    # keeps its own precision
    g = torch.Generator().manual_seed(n)
    r = 1e-3 * torch.randn(n, generator=g) * 10.0 ** -(torch.arange(n) // 256 % 4).float()
    p = packed_residuals.pack(r)
    chunks = -(-n // 256)
    assert p.codes.dtype == torch.uint8 and p.codes.numel() == chunks * 128 and p.step.numel() == chunks
    back = packed_residuals.unpack(p)
    assert back.shape == r.shape
    for lo in range(0, n, 256):
        chunk, got = r[lo : lo + 256], back[lo : lo + 256]
        assert (got - chunk).abs().max().item() <= chunk.abs().max().item() / 14 * (1 + 1e-6), lo
        # the largest value and its sign come back exactly (code +-7)
        i = chunk.abs().argmax()
        assert torch.isclose(got[i], chunk[i], rtol=1e-6)


def test_a_zero_residual_packs_to_zero():
    p = packed_residuals.pack(torch.zeros(7))
    assert torch.equal(packed_residuals.unpack(p), torch.zeros(7))
    assert p.nbytes() == 128 + 4  # the codes of one chunk, and its number


def engine_state(step_check):
    return {"step": 3, "origin": 0, "buckets": [], "step_check": step_check}


def test_the_step_check_goes_into_the_engines_part_of_a_checkpoint_and_back():
    # (the check itself is the engine's: src/engine/step_check.rs, with its tests there and in
    # src/engine/tests/step_checks.rs)
    check = {"origin": 0, "times": [[1.5], [0.25, 2.0]], "verdict": None}
    assert _native.parse_engine_state(engine_state(check))["step_check"] == check
    assert _native.parse_engine_state(engine_state(None))["step_check"] is None


@pytest.mark.parametrize("bad", [{"origin": -1, "times": [[], []], "verdict": None},
                                 {"origin": 0, "times": [[]], "verdict": None},
                                 {"origin": 0, "times": [[math.nan], []], "verdict": None},
                                 {"origin": 0, "times": [[-1.0], []], "verdict": None},
                                 {"origin": 0, "times": [[], []], "verdict": "plain"},
                                 [0, [[], []], None]])
def test_a_malformed_step_check_is_refused(bad):
    with pytest.raises(ValueError, match="not a CfcState checkpoint.*step check"):
        _native.parse_engine_state(engine_state(bad))
