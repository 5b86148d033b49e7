"""cfc.distributed.all_reduce across real processes (torch.distributed, gloo, CPU)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cfc


def data(rank, step, n=5000):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4) * 1e-3


def _worker(rank, world, init_file, scenario):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
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
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("scenario", ["sum", "feedback", "mismatch"])
@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_over_gloo(tmp_path, scenario, world):
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), scenario), nprocs=world, join=True)


def test_only_cpu_tensors_until_the_nccl_transport_exists():
    for x in (torch.zeros(3, device="meta"), torch.zeros(3).numpy()):
        with pytest.raises(ValueError, match="CPU tensors"):
            cfc.distributed.all_reduce(x, eps=1e-3)
