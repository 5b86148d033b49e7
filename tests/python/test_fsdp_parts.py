"""The pieces cfc.fsdp runs each group through, without processes: per-parameter scales
(``cfc.fsdp.param_scales``), residuals in 4 bits (``cfc.fsdp.packed_residuals``), and the check of
``fallback="auto"`` over whole steps (``cfc.fsdp.step_check``)."""

import math

import numpy as np
import pytest
import torch

from cfc.fsdp import packed_residuals, param_scales, step_check
from cfc.ddp.checkpoint import _step_check as parsed_step_check


def gathered(*ranks):
    """A stand-in for Engine.gather: these ranks' float64 sums (rank 0 is the caller's own
    bytes, replaced by what the caller sends)."""
    def gather(mine):
        return [mine] + [torch.tensor(r, dtype=torch.float64).numpy().tobytes() for r in ranks]
    return gather


def test_scales_are_powers_of_two_that_bring_each_parameters_rms_into_half_to_one():
    g = torch.Generator().manual_seed(0)
    lengths = (300, 5, 1000)
    rows = torch.cat([1e-5 * torch.randn(2, 300, generator=g), 40 * torch.randn(2, 5, generator=g),
                      torch.randn(2, 1000, generator=g)], 1)
    other = [float(s) for s in (4e-8, 3e3, 2e3)]  # another rank's sums of squares
    f = param_scales.agree(rows, lengths, gathered(other))
    assert f.dtype == torch.float32 and f.shape == (3,)
    at = 0
    for i, n in enumerate(lengths):
        mantissa, _ = math.frexp(f[i].item())
        assert mantissa == 0.5, f[i]  # a power of two
        sq = rows[:, at : at + n].double().square().sum().item() + other[i]
        rms = math.sqrt(sq / (2 * n * 2))  # two rows here, two ranks
        assert 0.5 <= rms * f[i].item() < 1, (i, rms, f[i])
        at += n
    cols = param_scales.columns(f, lengths)
    assert cols.shape == (1305,) and cols[0] == f[0] and cols[300] == f[1] and cols[-1] == f[2]


def test_a_zero_or_overflowing_parameter_keeps_the_factor_one():
    rows = torch.tensor([[0.0, 0.0, float("inf"), 1.0]])
    f = param_scales.agree(rows, (2, 2), gathered([0.0, 1.0]))
    assert f.tolist() == [1.0, 1.0]


def test_a_layout_that_does_not_tile_the_row_is_sent_unscaled():
    assert param_scales.agree(torch.ones(2, 10), (4, 5), gathered([1.0, 1.0])) is None


def test_ranks_with_different_parameters_are_refused():
    with pytest.raises(ValueError, match="different numbers of parameters"):
        param_scales.agree(torch.ones(1, 10), (4, 6), gathered([1.0]))


def test_only_dtypes_that_scale_exactly_are_scaled():
    assert param_scales.scalable(torch.float32) and param_scales.scalable(torch.bfloat16)
    assert not param_scales.scalable(torch.float16)


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


def test_a_packed_residual_comes_back_in_the_units_of_the_call_that_reads_it():
    from cfc.fsdp import _unpacked

    lengths = (3, 5)
    own = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    before = torch.tensor([4.0, 0.5])  # the factors of the call that packed it
    p = packed_residuals.pack((own * param_scales.columns(before, lengths)).view(-1), before, 2, lengths)
    back = _unpacked(p).view(2, 8)  # (in its own units)
    assert (back - own).abs().max() <= (own * param_scales.columns(before, lengths)).abs().max() / 14 / 0.5
    for now in (torch.tensor([4.0, 0.5]), torch.tensor([1.0, 2.0]), None):
        cols = torch.ones(8) if now is None else param_scales.columns(now, lengths)
        got = _unpacked(p, now, 2, lengths if now is not None else None).view(2, 8)
        assert torch.equal(got, back * cols), now  # (powers of two: exactly)


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
