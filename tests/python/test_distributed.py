"""cfc.distributed.all_reduce across real processes (torch.distributed, gloo, CPU)."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cfc


def data(rank, step, n=5000):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4) * 1e-3


def _worker(rank, world, init_file, scenario):
    # A rank left waiting for a peer fails after a minute, not gloo's default half hour.
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        if scenario == "sum":
            for kw in ({"eps": 1e-5}, {"rel": 1e-3}, {"eps": 1e-5, "average": True}):
                y, report = cfc.distributed.all_reduce(data(rank, 0), **kw)
                exact = sum(data(r, 0).double() for r in range(world))
                if kw.get("average"):
                    exact = exact / world
                err = (y.double() - exact).abs().max().item()
                slack = 2.0**-23 * exact.abs().max().item()
                assert err <= report["bound"] + slack, (kw, err, report)
                assert report["bytes_sent"] * 3 < report["bytes_uncompressed"], report
            # the all-gather variant gives the same bits; a wrong name is refused
            y_rs, _ = cfc.distributed.all_reduce(data(rank, 2), eps=1e-5, algorithm="reduce-scatter")
            y_ag, _ = cfc.distributed.all_reduce(data(rank, 2), eps=1e-5, algorithm="all-gather")
            assert torch.equal(y_rs, y_ag)
            with pytest.raises(ValueError, match="algorithm"):
                cfc.distributed.all_reduce(data(rank, 2), eps=1e-5, algorithm="ring")
            # bf16 and a shape survive too
            y, _ = cfc.distributed.all_reduce(data(rank, 1).bfloat16().reshape(50, 100), eps=1e-4)
            assert y.dtype == torch.bfloat16 and y.shape == (50, 100)
        elif scenario == "feedback":
            residual = torch.zeros(5000)
            total = torch.zeros(5000, dtype=torch.float64)
            exact = torch.zeros(5000, dtype=torch.float64)
            for step in range(20):
                y, report = cfc.distributed.all_reduce(data(rank, step), eps=5e-5, residual=residual)
                total += y.double()
                exact += sum(data(r, step).double() for r in range(world))
            drift = (total - exact).abs().max().item()
            assert drift <= world * 5e-5 * 1.05, drift
        elif scenario == "mismatch":
            n = 5000 if rank == 0 else 4000
            with pytest.raises(cfc.CfcError, match="disagree"):
                cfc.distributed.all_reduce(data(rank, 0, n), eps=1e-5)
            # Input that one rank refuses before any collective: that rank raises its own error,
            # the others CfcError at once (before, they waited for it until the group's timeout)
            refused = [
                ({"tensor": data(rank, 1).double()}, TypeError),                    # cfc.codec
                ({"residual": torch.zeros(4999)}, ValueError),                      # cfc.codec
                ({"residual": torch.zeros(5000).numpy()}, TypeError),               # all_reduce
                ({"eps": None, "rel": None}, ValueError),                           # the binding
                ({"algorithm": "ring"}, ValueError),                                # the binding
                ({"eps": "1e-5"}, TypeError),               # types the binding would refuse first
                ({"average": 1}, TypeError),
                ({"algorithm": 3}, TypeError),
                ({"residual": torch.zeros(5000, dtype=torch.float64)}, TypeError),  # cfc.codec
            ]
            for kw, error in refused:
                args = {"tensor": data(rank, 1), "eps": 1e-5, **(kw if rank == world - 1 else {})}
                if rank == world - 1:
                    with pytest.raises(error):
                        cfc.distributed.all_reduce(args.pop("tensor"), **args)
                else:
                    with pytest.raises(cfc.CfcError, match=f"rank {world - 1} refused its input"):
                        cfc.distributed.all_reduce(args.pop("tensor"), **args)
            # and the ranks go on together
            y, _ = cfc.distributed.all_reduce(data(rank, 2), eps=1e-5)
            assert (y.double() - sum(data(r, 2).double() for r in range(world))).abs().max() <= world * 1e-5 * 1.01
        elif scenario == "midcall":
            # Rank 0 cuts short the shard it sends rank 1 (as if corrupted on the way). Rank 1
            # cannot sum it; its peers hear so in the next round and raise at once (they used
            # to wait for rank 1's sum until the group's timeout), no rank keeps the step, and
            # the ranks go on together.
            send = cfc.distributed.TorchTransport.all_to_all
            calls = []

            def cut(self, parts):
                calls.append(1)
                if rank == 0 and len(calls) == 2:  # 1: the agreement, 2: the shards
                    parts = list(parts)
                    parts[1] = parts[1][:20]
                return send(self, parts)

            cfc.distributed.TorchTransport.all_to_all = cut
            try:
                residual = torch.full((5000,), 1e-6)
                t0 = time.monotonic()
                with pytest.raises(cfc.CfcError, match="malformed" if rank == 1 else "failed on rank 1"):
                    cfc.distributed.all_reduce(data(rank, 0), eps=1e-5, residual=residual)
                assert time.monotonic() - t0 < 20
                assert torch.equal(residual, torch.full((5000,), 1e-6))
            finally:
                cfc.distributed.TorchTransport.all_to_all = send
            y, _ = cfc.distributed.all_reduce(data(rank, 2), eps=1e-5)
            assert (y.double() - sum(data(r, 2).double() for r in range(world))).abs().max() <= world * 1e-5 * 1.01
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("scenario", ["sum", "feedback", "mismatch", "midcall"])
@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_over_gloo(tmp_path, scenario, world):
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), scenario), nprocs=world, join=True)


def test_only_cpu_tensors_until_the_nccl_transport_exists():
    for x in (torch.zeros(3, device="meta"), torch.zeros(3).numpy()):
        with pytest.raises(ValueError, match="CPU tensors"):
            cfc.distributed.all_reduce(x, eps=1e-3)


class _Loopback:
    """A transport of one rank that hands messages back, and fails its ``fail_at``-th call."""

    rank, world = 0, 1

    def __init__(self, fail_at=0):
        self.calls, self.fail_at = 0, fail_at

    def all_to_all(self, parts):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError("the peer is gone")
        return parts


def test_a_call_that_fails_leaves_the_residual_as_it_was():
    x = data(0, 0)
    for fail_at in (2, 3, 4):  # the frames', the sums' and the closing round (the agreement is the first)
        r = torch.full((5000,), 1e-6)
        with pytest.raises(cfc.CfcError, match="peer is gone"):
            cfc.distributed.all_reduce(x, eps=1e-4, residual=r, transport=_Loopback(fail_at))
        assert torch.equal(r, torch.full((5000,), 1e-6))
    y, _ = cfc.distributed.all_reduce(x, eps=1e-4, residual=r, transport=_Loopback())
    assert not torch.equal(r, torch.full((5000,), 1e-6))  # one that succeeds does write it
    assert (y.double() - x.double()).abs().max() <= 1e-4 + 1e-6  # within eps of x + residual


def test_a_residual_that_shares_the_tensors_memory_is_refused():
    """The residual is written while the tensor is read: memory both hold (the tensor's own,
    or one inside a strided tensor's span) is refused before anything moves."""
    buf = data(0, 0, 300)
    before = buf.clone()
    for x, r in ((buf[:100], buf[:100]), (buf[:200:2], buf[1:101])):
        t = _Loopback()
        with pytest.raises(ValueError, match="shares memory"):
            cfc.distributed.all_reduce(x, eps=1e-4, residual=r, transport=t)
        assert t.calls == 1  # the refusal, in the agreement round
        assert torch.equal(buf, before)


def test_a_transport_of_an_impossible_world_is_refused():
    for rank, world in ((0, 0), (2, 2), (0, 2**40)):
        t = _Loopback()
        t.rank, t.world = rank, world
        with pytest.raises(ValueError, match="rank"):
            cfc.distributed.all_reduce(data(0, 0), eps=1e-4, transport=t)
        assert t.calls == 0


def test_negated_views_and_one_element_strided_tensors_are_read_as_they_show():
    """A lazily negated view holds -x in memory; a one-element view may have any stride. Both
    are reduced as the values they show, and a one-element strided residual is updated in
    place."""
    x = data(0, 0)
    y, _ = cfc.distributed.all_reduce(torch._neg_view(x), eps=1e-4, transport=_Loopback())
    assert (y.double() + x.double()).abs().max() <= 1e-4
    base = torch.full((10,), 0.5)
    r = base[::3][:1]  # contiguous (one element), stride 3
    y, _ = cfc.distributed.all_reduce(torch.tensor([0.125]), eps=1e-2, residual=r, transport=_Loopback())
    # One element goes as a raw frame: x + residual exactly, and nothing left over.
    assert float(y) == 0.625 and float(base[0]) == 0.0 and float(base[1]) == 0.5
