"""The pieces cfc.fsdp runs each group through, without processes: residuals in 4 bits
(``cfc.fsdp.packed_residuals``) and the check of ``fallback="auto"`` over whole steps
(``cfc.fsdp.step_check``)."""

import math

import numpy as np
import pytest
import torch

from cfc.fsdp import packed_residuals, step_check
from cfc.ddp.checkpoint import _step_check as parsed_step_check


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


class Steps:
    """Drives a StepCheck through steps as cfc.fsdp does, with a clock that advances by each
    step's cost (``plain`` when every group went plain, ``chosen`` otherwise), and another rank
    whose medians are ``other`` (plain, chosen)."""

    def __init__(self, check, plain, chosen, other=(0.0, 0.0), any_compressed=True):
        self.check, self.plain, self.chosen, self.other = check, plain, chosen, other
        self.any_compressed, self.now, self.syncs, self.gathers, self.ways = any_compressed, 0.0, 0, 0, []
        check.clock = lambda: self.now

    def sync(self):
        self.syncs += 1

    def gather(self, mine):
        self.gathers += 1
        return [mine, np.asarray(self.other, dtype="<f8").tobytes()]

    def run(self, aheads, origin=0):
        for ahead in aheads:  # the step under way ends; `ahead` is the next one's index
            self.now += self.plain if self.check.all_plain else self.chosen
            self.check.step_ended(ahead, origin, self.any_compressed, self.sync, self.gather)
            self.ways.append("plain" if self.check.all_plain else "chosen")


def test_the_step_check_alternates_then_keeps_the_faster_way():
    check = step_check.StepCheck(4)
    steps = Steps(check, plain=1.0, chosen=0.5)
    steps.run([-2, -1, 0, 1, 2, 3, 4, 5])  # (the ways of steps -2, -1, 0, ..., 5)
    assert steps.ways == ["chosen", "chosen", "plain", "chosen", "plain", "chosen", "chosen", "chosen"]
    # synchronised at the end of the step before the check and of each of its 4 steps; one gather
    assert (steps.syncs, steps.gathers) == (5, 1)
    assert check.times == [[1.0, 1.0], [0.5, 0.5]] and check.verdict is True
    check = step_check.StepCheck(4)
    steps = Steps(check, plain=1.0, chosen=1.5)
    steps.run(range(-1, 6))
    assert check.verdict is False and steps.ways[-2:] == ["plain", "plain"]


def test_the_step_check_follows_the_slowest_rank_and_an_equal_time_goes_plain():
    for other, verdict in (((1.0, 2.0), False), ((3.0, 0.1), True), ((1.0, 0.9), True)):
        check = step_check.StepCheck(2)
        Steps(check, plain=1.0, chosen=0.5, other=other).run(range(-1, 3))
        assert check.verdict is verdict, other
    check = step_check.StepCheck(2)
    Steps(check, plain=1.0, chosen=1.0).run(range(-1, 3))
    assert check.verdict is False


def test_the_step_check_is_skipped_when_the_trial_chose_plain_and_restarts_with_a_new_trial():
    check = step_check.StepCheck(2)
    steps = Steps(check, plain=1.0, chosen=0.5, any_compressed=False)
    steps.run(range(-1, 3))
    assert check.verdict is False and (steps.syncs, steps.gathers) == (0, 0) and check.all_plain
    check = step_check.StepCheck(2)
    steps = Steps(check, plain=1.0, chosen=0.5)
    steps.run(range(-1, 3))
    assert check.verdict is True
    steps.chosen = 2.0
    steps.run(range(-1, 3), origin=7)  # (a group changed: the engine's trial ran again)
    assert check.verdict is False and steps.gathers == 2


def test_a_step_check_resumed_within_the_check_keeps_the_trials_ways_without_times():
    check = step_check.StepCheck(4)
    steps = Steps(check, plain=1.0, chosen=2.0)
    steps.run(range(-1, 3))
    saved = check.saved()
    resumed = step_check.StepCheck(4)
    resumed.load(parsed_step_check(saved), ahead=2)
    assert resumed.all_plain and resumed.times == [[1.0], [2.0]]
    steps = Steps(resumed, plain=1.0, chosen=2.0)
    steps.run([3, 4])  # the step resumed at is not timed: no time of "plain" but the saved one
    assert resumed.times == [[1.0], [2.0, 2.0]] and resumed.verdict is False
    resumed = step_check.StepCheck(2)
    resumed.load(parsed_step_check(step_check.StepCheck(2).saved()), ahead=0)
    Steps(resumed, plain=1.0, chosen=2.0).run([1, 2])  # no time of "plain" at all
    assert resumed.verdict is True
    done = step_check.StepCheck(2)
    done.load({"origin": 0, "times": [[1.0], [2.0]], "verdict": False}, ahead=9)
    assert done.all_plain


@pytest.mark.parametrize("bad", [{"origin": -1, "times": [[], []], "verdict": None},
                                 {"origin": 0, "times": [[]], "verdict": None},
                                 {"origin": 0, "times": [[math.nan], []], "verdict": None},
                                 {"origin": 0, "times": [[], []], "verdict": "plain"}])
def test_a_malformed_step_check_is_refused(bad):
    with pytest.raises(ValueError, match="not a CfcState checkpoint"):
        parsed_step_check(bad)
