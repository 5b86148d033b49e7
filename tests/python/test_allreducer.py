"""cfc.distributed.AllReducer and ``python -m cfc.bench``, through cfc's engine: 2 processes, gloo
on CPU tensors (in CI); NCCL on CUDA tensors (``-m gpu``, with 2 GPUs); and 3 processes sharing
one GPU over gloo (``-m gpu``, any GPU). conftest.py says where each kind of run places its ranks."""

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cfc
from conftest import GPUS, GRADS, close_cfc_states, enough_gpus, place_rank, world_of

EPS = 1e-5


def data(rank, call, n):
    g = torch.Generator().manual_seed(100 * rank + call)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4) * 1e-3


def exact_average(call, n, world):
    return sum(data(r, call, n).double() for r in range(world)) / world


def check_close(y, exact, eps):
    """Every element within eps of the exact average (plus float32 rounding of the result)."""
    err = (y.double().cpu() - exact).abs().max().item()
    assert err <= eps * (1 + 1e-6) + 2.0**-23 * exact.abs().max().item(), (err, eps)
    return err


def _worker(rank, world, init_file, scenario, device, algorithm=None):
    def State(**kw):  # noqa: N802 - the state of this run's algorithm (None: cfc's choice)
        return cfc.CfcState(algorithm=algorithm, **kw)

    dev, backend = place_rank(device, rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        state = State(eps=EPS, warmup_steps=0, min_compress_numel=0)
        reducer = cfc.distributed.AllReducer(state, chunk_numel=3000)
        if scenario == "coders":
            # Rice frames hold the codes bit planes hold: the same results on every rank, fewer
            # bytes (in the all-gather: the reduce-scatter, 3 ranks' default, keeps bit planes)
            seen = {}
            for coder in ("planes", "rice"):
                st = cfc.CfcState(rms=0.3, warmup_steps=0, min_compress_numel=0, coder=coder,
                                  algorithm="all-gather")
                red = cfc.distributed.AllReducer(st, chunk_numel=30000)
                seen[coder] = [red(data(rank, call, 70000).to(dev)).wait().cpu() for call in range(3)]
                seen[coder + " bytes"] = st.stats()["bytes_sent"]
                red.close()
            for a, b in zip(seen["planes"], seen["rice"]):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32))
            assert seen["rice bytes"] < 0.95 * seen["planes bytes"], seen
        elif scenario == "blocks":
            # Block scales: values whose scale drops 10x every 1024 elements; with one step per
            # bucket the quietest 1024 round to zero; with a step per block of 256 (blocks and
            # shards line up with the decades here) each block is within rms=0.3 of its largest
            # rank's RMS (first call: zero residuals).
            n, k = 6 * 1024, 0.3
            decades = torch.tensor([10.0 ** -(i // 1024) for i in range(n)])
            given = [data(r, 0, n).double() * decades for r in range(world)]
            exact = sum(given) / world
            got = {}
            for block in (0, 256):
                st = State(rms=k, block=block, warmup_steps=0, min_compress_numel=0)
                assert st.block == block
                red = cfc.distributed.AllReducer(st, chunk_numel=1 << 20)
                got[block] = red((data(rank, 0, n) * decades).to(dev)).wait().double().cpu()
                red.close()
            assert torch.all(got[0][5 * 1024:] == 0)
            for lo in range(0, n, 256):
                bound = k * max(g[lo:lo + 256].pow(2).mean().sqrt().item() for g in given)
                err = (got[256][lo:lo + 256] - exact[lo:lo + 256]).abs().max().item()
                assert err <= bound * (1 + 1e-5), (lo, err, bound)
            assert torch.any(got[256][5 * 1024:] != 0)
        elif scenario == "average":
            # 10000 values: chunks of 3000, 3000, 3000 and a 1000 tail; then a bf16 tensor
            for call in range(3):
                x = data(rank, call, 10000).to(dev)
                y = reducer(x).wait()
                assert y is x  # in place
                if call == 0:  # zero residuals: the plain bound
                    check_close(y, exact_average(0, 10000, world), EPS)
            s = state.stats()
            assert s["compressed_buckets"] == 12 and s["plain_buckets"] == 0, s
            # data 100x larger needs larger frames than the slots sized from the last calls:
            # they are sent again, exactly, and the result keeps its bound
            big = State(eps=EPS, warmup_steps=0, min_compress_numel=0)
            rb = cfc.distributed.AllReducer(big, chunk_numel=3000)
            for call in range(2):
                scale = 1.0 if call == 0 else 100.0
                x = data(rank, 20 + call, 10000).to(dev) * scale
                exact = sum(data(k, 20 + call, 10000).double() * scale for k in range(world)) / world
                check_close(rb(x).wait(), exact, 2 * EPS)  # the second carries the first's residual
            assert big.stats()["resends"] > 0, big.stats()
            assert s["ratio"] > 2, s
            xb = data(rank, 7, 5000).bfloat16().reshape(50, 100).to(dev)
            yb = cfc.distributed.AllReducer(State(eps=EPS, warmup_steps=0, min_compress_numel=0))(xb).wait()
            assert yb.dtype == torch.bfloat16 and yb.shape == (50, 100)
            exact_b = sum(data(r, 7, 5000).bfloat16().double() for r in range(world)) / world
            # the bf16 result is also rounded to bf16 (8 bits of mantissa), its sum too
            err = (yb.double().cpu().reshape(-1) - exact_b).abs()
            assert (err <= EPS + exact_b.abs() * 2.0**-7).all()
            # calls need not be waited for one by one (each waits for the one before); an
            # empty tensor is a no-op once the ranks agree on it
            r2 = cfc.distributed.AllReducer(State(eps=EPS, warmup_steps=0, min_compress_numel=0), chunk_numel=3000)
            xs = [data(rank, 10 + k, 10000).to(dev) for k in range(3)]
            pending = [r2(x) for x in xs]
            pending[-1].wait()
            check_close(xs[0], exact_average(10, 10000, world), EPS)  # zero residuals
            check_close(xs[2], exact_average(12, 10000, world), 2 * EPS)  # plus what is carried
            assert r2(torch.empty(0, device=dev)).wait().numel() == 0
        elif scenario == "feedback":
            # Every value is 0.4 eps: alone, each call would round it to 0. With error feedback
            # the sum of the results follows the exact sum within eps.
            n, calls = 4000, 20
            total = torch.zeros(n, dtype=torch.float64)
            for call in range(calls):
                x = torch.full((n,), 0.4 * EPS, device=dev)
                total += reducer(x).wait().double().cpu()
            drift = (total - calls * 0.4 * EPS).abs().max().item()
            assert drift <= EPS * 1.01, drift
            # the control: without error feedback everything is lost
            plain = cfc.distributed.AllReducer(
                State(eps=EPS, warmup_steps=0, min_compress_numel=0, error_feedback=False), chunk_numel=3000
            )
            lost = torch.zeros(n, dtype=torch.float64)
            for call in range(calls):
                lost += plain(torch.full((n,), 0.4 * EPS, device=dev)).wait().double().cpu()
            assert (lost == 0).all()
            # what rounding dropped is measured from the residuals: where none is kept, the
            # largest error is not known, and stats() says so rather than 0
            assert 0 < reducer.state.stats()["max_error"] <= EPS * (1 + 1e-6)
            assert math.isnan(plain.state.stats()["max_error"])
        elif scenario == "resize":
            # another size starts afresh (its first call is within eps), then the first again
            for call, n in enumerate((10000, 4321, 10000)):
                y = reducer(data(rank, call, n).to(dev)).wait()
                check_close(y, exact_average(call, n, world), EPS)
        elif scenario == "rms":
            # rms=0.3: the bound follows the data's RMS over every rank (every rank quantizes
            # with one step): all report the same eps, from every rank's data.
            st = State(rms=0.3, warmup_steps=0, min_compress_numel=0)
            rr = cfc.distributed.AllReducer(st, chunk_numel=3000)
            xs = {c: [data(k, c, 10000).double() for k in range(world)] for c in (30, 31, 32)}
            # each chunk's bound follows its own RMS: the largest of any rank's chunk bounds all
            top = max(
                float(v[a : a + 3000].pow(2).mean().sqrt()) for c in xs for v in xs[c] for a in (0, 3000, 6000, 9000)
            )
            check_close(rr(data(rank, 30, 10000).to(dev)).wait(), sum(xs[30]) / world, 0.3 * top * (1 + 1e-5))
            for call in (31, 32):
                rr(data(rank, call, 10000).to(dev)).wait()
            eps = torch.tensor([st.stats()["eps"]], dtype=torch.float64, device=dev)
            everyone = [torch.empty_like(eps) for _ in range(world)]
            dist.all_gather(everyone, eps)
            assert all(torch.equal(e, eps) for e in everyone), everyone
            overall = math.sqrt(sum(float(v.pow(2).sum()) for v in xs[30]) / (10000 * world))
            # (the residuals carried add a little to the RMS of later calls)
            assert 0.3 * overall * 0.5 <= eps.item() <= 0.3 * top * 1.05, (eps, overall, top)
        elif scenario == "mismatch":
            # ranks that disagree on the size all raise; the state is then done (a failure is
            # final: a later call raises at once), and a new one goes on
            n = 10000 if rank == 0 else 9000
            # (found by the rows' check words, the lengths a transport receives, or the
            # agreement on every job of a run's first step; over NCCL, collectives of other
            # sizes may also wait until the timeout, here 20 s, which ends them)
            reducer = cfc.distributed.AllReducer(State(eps=EPS, warmup_steps=0, min_compress_numel=0, timeout=20),
                                                 chunk_numel=3000)
            with pytest.raises(cfc.CfcError, match="check word|were agreed|did not answer|ranks disagree|out of step"):
                reducer(data(rank, 0, n).to(dev)).wait()
            t0 = time.monotonic()
            with pytest.raises(cfc.CfcError):
                reducer(data(rank, 0, 10000).to(dev))
            assert time.monotonic() - t0 < 1
            reducer = cfc.distributed.AllReducer(State(eps=EPS, warmup_steps=0, min_compress_numel=0))
            x = data(rank, 0, 10000).to(dev)
            check_close(reducer(x).wait(), exact_average(0, 10000, world), EPS)
            # a tensor the last rank refuses (dtype, layout): it raises its own error, the
            # others CfcError naming it, at once
            x = data(rank, 3, 10000).to(dev)
            if rank == world - 1:
                with pytest.raises(TypeError):
                    reducer(x.double())
            else:
                with pytest.raises(cfc.CfcError, match=f"rank {world - 1}"):
                    reducer(x).wait()
        elif scenario == "close":
            # close() finishes the last call (not waited for here), then lets the engine go;
            # later calls raise, and closing again does nothing
            x = data(rank, 0, 10000).to(dev)
            reducer(x)
            reducer.close()
            check_close(x, exact_average(0, 10000, world), EPS)
            assert state._closed and state._engine is None
            with pytest.raises(cfc.CfcError, match="was closed"):
                reducer(x)
            reducer.close()
            assert state.stats()["compressed_buckets"] == 4
        elif scenario == "let_go":
            # Engines let go of without close() stop on their own; at exit (cfc._engine's exit
            # handler, called here) the process waits for their threads, and stops an engine
            # still open, so that none still frees its resources while the process exits.
            for call in range(3):
                other = cfc.distributed.AllReducer(State(eps=EPS, warmup_steps=0, min_compress_numel=0))
                other(data(rank, call, 10000).to(dev)).wait()
                del other
            import gc

            gc.collect()
            reducer(data(rank, 0, 10000).to(dev)).wait()
            engine = state._engine
            assert engine in cfc._engine._live
            t0 = time.monotonic()
            cfc._engine._settle_at_exit()
            assert time.monotonic() - t0 < cfc._engine.EXIT_WAIT_SECONDS
            assert cfc._native.settle_dropped_engines(0.0) == 0
            with pytest.raises(cfc.CfcError, match="closed"):
                engine.wait()
            with pytest.raises(ValueError, match="seconds"):
                cfc._native.settle_dropped_engines(-1.0)
        elif scenario == "auto":
            # fallback="auto": the first 2 calls time each chunk both ways, then every rank
            # takes the same choice; a new size runs its own trial
            auto = State(eps=EPS, warmup_steps=0, min_compress_numel=0, fallback="auto", trial_steps=2)
            reducer = cfc.distributed.AllReducer(auto, chunk_numel=3000)
            for n in (10000, 7000):
                auto.reset_stats()
                for call in range(4):
                    y = reducer(data(rank, call, n).to(dev)).wait()
                    if call == 0:  # the trial starts with plain all-reduce (exact but rounding)
                        check_close(y, exact_average(0, n, world), 1e-9)
                s = auto.stats()
                chunks = -(-n // 3000)
                assert s["compressed_buckets"] >= chunks and s["plain_buckets"] >= chunks, s
                decisions = [b["decision"] for b in auto._engine.state()["buckets"]]
                assert len(decisions) == chunks and all(d is not None for d in decisions), decisions
                choice = torch.tensor([float(d) for d in decisions], device=dev)
                everyone = [torch.empty_like(choice) for _ in range(world)]
                dist.all_gather(everyone, choice)
                assert all(torch.equal(e, choice) for e in everyone)
        elif scenario == "dead_peer":
            # rank 1 takes part once and then stops answering (alive, silent): rank 0's next
            # call fails after the state's timeout, with an error, instead of waiting forever
            state = State(eps=EPS, warmup_steps=0, min_compress_numel=0, timeout=3)
            reducer = cfc.distributed.AllReducer(state, chunk_numel=3000)
            reducer(data(rank, 0, 10000).to(dev)).wait()
            if rank == 0:
                t0 = time.perf_counter()
                with pytest.raises(cfc.CfcError, match="did not answer within 3"):
                    reducer(data(rank, 1, 10000).to(dev)).wait()
                waited = time.perf_counter() - t0
                assert 2.5 < waited < 8, waited  # rank 1 is silent for 12 s
            else:
                time.sleep(12)  # alive but silent until rank 0 has given up
            os._exit(0)
        elif scenario == "returns_early":
            # The caller's thread does not wait for the GPU: with the stream held up by a
            # half-second kernel queued before it, the call still returns at once.
            reducer = cfc.distributed.AllReducer(state, chunk_numel=1 << 16)
            x = data(rank, 0, 1 << 20).to(dev)
            reducer(x.clone()).wait()  # the engine starts (a round of every rank) at the first
            torch.cuda.synchronize()
            torch.cuda._sleep(1_000_000_000)
            t0 = time.perf_counter()
            pending = reducer(x)
            returned = time.perf_counter() - t0
            busy = not torch.cuda.current_stream().query()
            y = pending.wait()
            torch.cuda.synchronize()
            total = time.perf_counter() - t0
            assert busy and returned < 0.05 and total > 0.2, (returned, total)
            assert torch.isfinite(y).all()
    finally:
        close_cfc_states()  # first (see conftest.py)
        dist.destroy_process_group()


def spawn(tmp_path, scenario, device, world=None, algorithm=None):
    world = world or world_of(device)
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), scenario, device, algorithm), nprocs=world, join=True)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("shared-gpu", marks=pytest.mark.gpu)]
GPU_RUNS = DEVICES[1:]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scenario", ["average", "feedback", "resize", "mismatch", "auto", "rms", "let_go"])
def test_all_reducer(tmp_path, scenario, device):
    enough_gpus(device)
    spawn(tmp_path, scenario, device)


@pytest.mark.parametrize("device", DEVICES)
def test_all_reducer_close(tmp_path, device):
    # on CUDA with as many GPUs as there are, up to GPUS (one is enough)
    world = max(1, min(GPUS, torch.cuda.device_count())) if device == "cuda" else None
    spawn(tmp_path, "close", device, world=world)


# Buckets move as an all-gather of frames or a reduce-scatter of codes (the default from 3
# ranks): both, whatever the number of ranks.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", ["all-gather", "reduce-scatter"])
@pytest.mark.parametrize("scenario", ["average", "feedback", "resize", "rms", "blocks"])
def test_all_reducer_algorithms(tmp_path, scenario, algorithm, device):
    enough_gpus(device)
    spawn(tmp_path, scenario, device, algorithm=algorithm)


@pytest.mark.parametrize("device", DEVICES)
def test_rice_frames_give_the_values_of_bit_planes_in_fewer_bytes(tmp_path, device):
    enough_gpus(device)
    spawn(tmp_path, "coders", device)


def test_a_silent_peer_is_an_error_after_the_timeout(tmp_path):
    spawn(tmp_path, "dead_peer", "cpu")


def test_all_reducer_over_three_ranks(tmp_path):
    spawn(tmp_path, "average", "cpu", world=3)


@pytest.mark.gpu
def test_the_call_returns_before_the_gpu_is_done(tmp_path):
    # on as many GPUs as there are, up to GPUS (one is enough)
    spawn(tmp_path, "returns_early", "cuda", world=max(1, min(GPUS, torch.cuda.device_count())))


@pytest.mark.gpu
def test_one_gpu_rank_gives_the_cpu_codecs_values(tmp_path):
    """One rank, one GPU: each call's result is, bit for bit, what the CPU codec decodes from
    the call's input compressed with error feedback at eps (the average of one frame)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        for dtype in (torch.float32, torch.bfloat16):
            reducer = cfc.distributed.AllReducer(cfc.CfcState(eps=EPS, warmup_steps=0, min_compress_numel=0),
                                                 chunk_numel=1 << 20)
            r = torch.zeros(10000)  # the CPU codec's residual, beside the engine's own
            for call in range(3):
                x = data(0, call, 10000).to(dtype)
                expect = cfc.decompress(cfc.compress(x, eps=EPS, residual=r))
                y = reducer(x.cuda()).wait()
                assert torch.equal(y.cpu(), expect), (y.cpu() - expect).abs().max()
            reducer.close()
    finally:
        close_cfc_states()
        dist.destroy_process_group()


def test_all_reducer_rejects_bad_tensors():
    r = cfc.distributed.AllReducer(cfc.CfcState(eps=1e-3))
    for bad in (torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.int32), [1.0]):
        with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
            r(bad)
    with pytest.raises(ValueError, match="contiguous"):
        r(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="negated view"):  # its memory holds -x: no place to average in
        r(torch._neg_view(torch.zeros(4)))
    with pytest.raises(ValueError, match="chunk_numel"):
        cfc.distributed.AllReducer(chunk_numel=0)


def test_bench_runs_on_cpu(tmp_path, grads):  # grads: skips where the vectors are missing
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "cfc.bench", "--cpu", "--sizes", "256K,1M", "--iters", "2", "--warmup", "1",
        "--chunk-numel", "131072", "--grads", str(GRADS),
        "--json", str(out),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| 1MB | cfc@0.3 |" in r.stdout, r.stdout
    result = json.loads(out.read_text())
    assert result["world"] == 2 and result["backend"] == "gloo"
    rows = {(row["size"], row["method"]): row for row in result["rows"]}
    assert set(rows) == {(s, m) for s in (1 << 18, 1 << 20) for m in ("fp32", "bf16", "cfc@0.3", "cfc@0.1")}
    for (size, m), row in rows.items():
        assert row["seconds"] > 0 and row["algbw_GBps"] > 0
        if m.startswith("cfc"):
            assert 0 < row["max_err_over_eps"] <= 1 + 1e-6, row
            assert row["ratio"] > 3, row  # at 0.1 x RMS of the real vectors: about 6x



def test_bench_compares_the_two_algorithms(tmp_path, grads):
    out = tmp_path / "bench.json"
    base = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "cfc.bench", "--cpu", "--sizes", "256K", "--iters", "2", "--warmup", "1",
        "--chunk-numel", "131072", "--grads", str(GRADS), "--bounds", "0.3",
    ]
    r = subprocess.run(base + ["--algorithms", "all-gather,reduce-scatter", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["method"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"fp32", "bf16", "cfc-ag@0.3", "cfc-rs@0.3"}, rows
    for m in ("cfc-ag@0.3", "cfc-rs@0.3"):
        assert 0 < rows[m]["max_err_over_eps"] <= 1 + 1e-6 and rows[m]["ratio"] > 3, rows[m]
    bad = subprocess.run(base + ["--algorithms", "ring"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--algorithms takes" in bad.stdout + bad.stderr


def test_bench_plots_a_json_of_the_rust_benchmark(tmp_path):
    pytest.importorskip("matplotlib")
    import cfc.bench
    # The shape `cfc-bench --gpu 2 --json` writes (two rows per method), and a malformed one.
    rows = [
        {"gpus": 2, "size": s, "method": m, "seconds": t, "call_seconds": None, "bytes_sent": 1,
         "max_err_over_eps": None}
        for s in (16 << 20, 64 << 20)
        for m, t in (("nccl-fp32", 1e-4 * (s >> 20)), ("cfc-auto@0.3 (plain)", 1.1e-4 * (s >> 20)))
    ]
    src = tmp_path / "gpu.json"
    src.write_text(json.dumps({"iters": 20, "rms": 1e-3, "nccl": "2.28.3", "rows": rows}))
    png = tmp_path / "gpu.png"
    result = cfc.bench.main(["--plot", str(src), "--png", str(png)])
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert result["world"] == 2 and result["transport"] == "NCCL 2.28.3"
    assert abs(result["rows"][0]["algbw_GBps"] - (16 << 20) / 1.6e-3 / 1e9) < 1e-9
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": [{"size": 1}]}))
    with pytest.raises(SystemExit, match="needs rows with size and method"):
        cfc.bench.main(["--plot", str(bad), "--png", str(tmp_path / "x.png")])
