"""cfc.distributed.AllReducer and ``python -m cfc.bench``: 2 processes, gloo on CPU tensors (in
CI); NCCL on CUDA tensors (``-m gpu``, with 2 GPUs); and 3 processes sharing one GPU over gloo
(``-m gpu``, any GPU). conftest.py says where each kind of run places its ranks."""

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
        if scenario == "average":
            # 10000 values: chunks of 3000, 3000, 3000 and a 1000 tail; then a bf16 tensor
            for call in range(3):
                x = data(rank, call, 10000).to(dev)
                y = reducer(x).wait()
                assert y is x  # in place
                if call == 0:  # zero residuals: the plain bound
                    check_close(y, exact_average(0, 10000, world), EPS)
            s = state.stats()
            assert s["compressed_buckets"] == 12 and s["plain_buckets"] == 0, s
            if dev.type == "cuda":  # the algorithm asked for is the one that ran
                shards = any(isinstance(k, tuple) and k[0] == "shard" for k in state._slots)
                assert shards == (algorithm == "reduce-scatter" or (algorithm is None and world > 2))
            # data 100x larger needs larger frames than the slots sized from the last calls:
            # they are sent again, exactly, and the result keeps its bound
            big = State(eps=EPS, warmup_steps=0, min_compress_numel=0)
            rb = cfc.distributed.AllReducer(big, chunk_numel=3000)
            for call in range(2):
                scale = 1.0 if call == 0 else 100.0
                x = data(rank, 20 + call, 10000).to(dev) * scale
                exact = sum(data(k, 20 + call, 10000).double() * scale for k in range(world)) / world
                check_close(rb(x).wait(), exact, 2 * EPS)  # the second carries the first's residual
            if dev.type == "cuda":
                assert big.stats()["resends"] > 0, big.stats()
            # small chunks: on CUDA each frame travels in a slot 6% and 264 bytes larger, to
            # every peer (all-gather: the ratio against a ring all-reduce falls as 2 / world)
            assert s["ratio"] > (3 if dev.type == "cpu" else 4 / world), s
            xb = data(rank, 7, 5000).bfloat16().reshape(50, 100).to(dev)
            yb = cfc.distributed.AllReducer(State(eps=EPS, warmup_steps=0, min_compress_numel=0))(xb).wait()
            assert yb.dtype == torch.bfloat16 and yb.shape == (50, 100)
            exact_b = sum(data(r, 7, 5000).bfloat16().double() for r in range(world)) / world
            # the bf16 result is also rounded to bf16 (8 bits of mantissa)
            err = (yb.double().cpu().reshape(-1) - exact_b).abs()
            assert (err <= EPS + exact_b.abs() * 2.0**-8).all()
            # calls need not be waited for one by one (each waits for the one before); an
            # empty tensor is a no-op once the ranks agree on it
            r2 = cfc.distributed.AllReducer(
                State(eps=EPS, warmup_steps=0, min_compress_numel=0), chunk_numel=3000
            )
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
                State(eps=EPS, warmup_steps=0, min_compress_numel=0, error_feedback=False),
                chunk_numel=3000,
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
            # rms=0.3: the bound follows the data's RMS. With the reduce-scatter every rank
            # must quantize with one step: all report the same eps, from every rank's data.
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
            shared = dev.type == "cpu" or algorithm == "reduce-scatter" or (algorithm is None and world > 2)
            if shared:
                assert all(torch.equal(e, eps) for e in everyone), everyone
                overall = math.sqrt(sum(float(v.pow(2).sum()) for v in xs[30]) / (10000 * world))
                # (the residuals carried add a little to the RMS of later calls)
                assert 0.3 * overall * 0.5 <= eps.item() <= 0.3 * top * 1.05, (eps, overall, top)
        elif scenario == "corrupt_shard":
            # A shard frame size only rank 1 sees is wrong (as if corrupted on the way): every
            # rank gets the error, none waits for a rank that stopped alone (a timeout of 30 s
            # would end the test with NCCL's abort instead).
            st = cfc.CfcState(eps=EPS, warmup_steps=0, min_compress_numel=0, algorithm="reduce-scatter", timeout=30)
            rc = cfc.distributed.AllReducer(st, chunk_numel=3000)
            rc(data(rank, 0, 10000).to(dev)).wait()  # sizes the slots
            if rank == 1:
                send_sum = cfc.ddp._ShardExchange.send_sum

                def corrupted(self):
                    self.tails_ready.synchronize()
                    self.tails_host[0, 0] = 1 << 40  # the size of rank 0's frame for this shard
                    return send_sum(self)

                cfc.ddp._ShardExchange.send_sum = corrupted
            with pytest.raises(cfc.CfcError, match="frame sizes"):
                rc(data(rank, 1, 10000).to(dev)).wait()
        elif scenario == "mismatch":
            n = 10000 if rank == 0 else 9000
            with pytest.raises(cfc.CfcError, match="disagree on the tensor"):
                reducer(data(rank, 0, n).to(dev))
            x = data(rank, 0, 10000).to(dev)
            with pytest.raises(cfc.CfcError, match="disagree on the tensor"):
                reducer(x if rank == 0 else x.half())
            # the ranks can go on once they agree
            check_close(reducer(x).wait(), exact_average(0, 10000, world), EPS)
            # a size new to rank 0 only, while the others repeat the one they had: all raise
            with pytest.raises(cfc.CfcError, match="disagree on the tensor"):
                reducer(data(rank, 1, 12000 if rank == 0 else 10000).to(dev))
            x = data(rank, 2, 10000).to(dev)
            # (the residuals of the 10000-element calls before it are sent along: 2 eps)
            check_close(reducer(x).wait(), exact_average(2, 10000, world), 2 * EPS)
            # a tensor the last rank refuses (dtype, layout): it raises its own error, the
            # others CfcError at once (before, they waited for it in the check until the timeout)
            x = data(rank, 3, 10000).to(dev)
            for bad, error in ((x.double(), TypeError), (x.view(100, 100).t(), ValueError)):
                if rank == world - 1:
                    with pytest.raises(error):
                        reducer(bad)
                else:
                    with pytest.raises(cfc.CfcError, match=f"rank {world - 1} refused its tensor"):
                        reducer(x)
            check_close(reducer(x).wait(), exact_average(3, 10000, world), 2 * EPS)
        elif scenario == "close":
            # close() finishes the last call (not waited for here), then lets the state's comm
            # thread and communicator go; later calls raise, and closing again does nothing
            x = data(rank, 0, 10000).to(dev)
            reducer(x)
            worker = state._worker
            assert (worker is not None) == (dev.type == "cuda")  # CUDA chunks: the comm thread
            reducer.close()
            check_close(x, exact_average(0, 10000, world), EPS)
            assert state._closed and state._worker is None and state._exchange is None
            if worker is not None:
                assert not worker.thread.is_alive()
            with pytest.raises(cfc.CfcError, match="AllReducer was closed"):
                reducer(x)
            reducer.close()
            assert state.stats()["compressed_buckets"] == 4
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
                choice = torch.tensor([float(auto._decisions[i]) for i in range(chunks)], device=dev)
                everyone = [torch.empty_like(choice) for _ in range(world)]
                dist.all_gather(everyone, choice)
                assert all(torch.equal(e, choice) for e in everyone)
            # What the trial's compressed call left in the residuals is sent along by the next
            # plain call, and only once. The trial's verdict is fixed to "plain" here (timings
            # vary), on every rank alike.
            auto = State(eps=EPS, warmup_steps=0, min_compress_numel=0, fallback="auto", trial_steps=2)

            def plain_verdict(group=None, again=False):
                auto._decisions.update({i: False for i in auto._trial})
                auto._trial.clear()

            auto._decide = plain_verdict
            reducer = cfc.distributed.AllReducer(auto, chunk_numel=3000)
            results = []
            for call in range(4):  # plain (trial), compressed (trial) to 0, plain, plain
                results.append(reducer(torch.full((4000,), 0.4 * EPS, device=dev)).wait().double().cpu())
            assert (results[1] == 0).all()
            assert torch.allclose(results[2], torch.full((4000,), 0.8 * EPS, dtype=torch.float64), rtol=1e-6)
            assert torch.allclose(results[3], torch.full((4000,), 0.4 * EPS, dtype=torch.float64), rtol=1e-6)
            # the last call ran as one plain all-reduce of the whole tensor
            assert cfc.ddp._whole_plain(auto, [3000, 1000]) and auto.step == 4
        elif scenario == "dead_peer":
            # rank 1 takes part once and then stops answering: rank 0's next call fails after
            # the state's timeout, with an error, instead of waiting forever
            state = State(eps=EPS, warmup_steps=0, min_compress_numel=0, timeout=3)
            reducer = cfc.distributed.AllReducer(state, chunk_numel=3000)
            reducer(data(rank, 0, 10000).to(dev)).wait()
            if rank == 0:
                t0 = time.perf_counter()
                with pytest.raises((cfc.CfcError, RuntimeError), match="(?i)timed out") as e:
                    reducer(data(rank, 1, 10000).to(dev)).wait()
                waited = time.perf_counter() - t0
                assert "3000ms" in str(e.value)  # gloo's message, with the state's timeout
                assert 2.5 < waited < 8, waited  # rank 1 is silent for 12 s
            else:
                time.sleep(12)  # alive but silent until rank 0 has given up
            # A gloo group whose operations timed out cannot be torn down cleanly (gloo may
            # abort the process in its destructors); as after any such failure in a job, the
            # processes end here, without destroy_process_group.
            os._exit(0)
        elif scenario == "native":
            # cfc.distributed.NcclAllReducer: the Rust core's all-reduce, over a communicator of
            # its own; chunks of 3000 elements, so 10000 values take four.
            chunk_mb = 3000 * 4 / 2**20
            nr = cfc.distributed.NcclAllReducer(eps=EPS, chunk_mb=chunk_mb, timeout=60)
            assert nr.compressing() is None

            def alike(t):  # the same bits on every rank
                everyone = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(everyone, t)
                return all(torch.equal(e, t) for e in everyone)

            for call in range(3):
                x = data(rank, call, 10000).to(dev)
                report = nr(x)
                assert report["compressed"] and report["eps"] == EPS, report
                if call == 0:
                    check_close(x, exact_average(0, 10000, world), EPS)
                else:  # slots sized by the first call: the frames' bytes only
                    assert report["bytes_sent"] * 3 < report["bytes_uncompressed"], report
                assert alike(x)
            assert nr.compressing() is True
            # error feedback: the mean of 8 results of the same input converges on the average
            fb = cfc.distributed.NcclAllReducer(eps=EPS, chunk_mb=chunk_mb)
            total = torch.zeros(10000, dtype=torch.float64)
            for _ in range(8):
                x = data(rank, 9, 10000).to(dev)
                fb(x)
                total += x.double().cpu()
            err = (total / 8 - exact_average(9, 10000, world)).abs().max().item()
            assert err < 1.5 * EPS / 8 + 1e-9, err
            # bf16, in place
            xb = data(rank, 7, 5000).bfloat16().reshape(50, 100).to(dev)
            assert nr(xb)["compressed"] and xb.shape == (50, 100) and alike(xb)
            # fallback="always": NCCL's own average, as torch.distributed computes it
            plain = cfc.distributed.NcclAllReducer(eps=EPS, fallback="always")
            x = data(rank, 3, 10000).to(dev)
            expect = x.clone()
            dist.all_reduce(expect, op=dist.ReduceOp.AVG)
            report = plain(x)
            assert not report["compressed"] and report["eps"] == 0, report
            assert torch.allclose(x, expect, rtol=1e-6, atol=0), (x - expect).abs().max()
            # fallback="auto": after 2 x 2 trial calls every rank goes the same way
            auto = cfc.distributed.NcclAllReducer(rms=0.3, fallback="auto", trials=2)
            for _ in range(5):
                auto(data(rank, 4, 1 << 20).to(dev))
            way = auto.compressing()
            assert way is not None
            assert alike(torch.tensor([float(way)], device=dev))
            # ranks that disagree on the size all get an error, and the reducer still works
            with pytest.raises(cfc.CfcError, match="1000 x float32"):
                nr(data(rank, 5, 1000 + 24 * rank).to(dev))
            x = data(rank, 6, 10000).to(dev)
            nr(x)
            check_close(x, exact_average(6, 10000, world), EPS)
            for bad, err in ((x.cpu(), ValueError), (x.double(), TypeError), (x[::2], ValueError)):
                with pytest.raises(err):
                    nr(bad)
            for r in (nr, fb, plain, auto):
                r.close()
            with pytest.raises(cfc.CfcError, match="closed"):
                nr(x)
        elif scenario == "returns_early":
            # The caller's thread does not wait for the GPU: with the stream held up by a
            # half-second kernel queued before it, the call still returns at once. (16 chunks:
            # with hundreds, the comm thread's kernels, all queued behind that kernel, fill
            # CUDA's launch queue, and then every CUDA call of the process waits for room, the
            # caller's too; with 8 ranks, chunks of 3000 elements did that.)
            reducer = cfc.distributed.AllReducer(state, chunk_numel=1 << 16)
            x = data(rank, 0, 1 << 20).to(dev)
            reducer(x.clone()).wait()  # the first call's agreement rounds wait; later ones do not
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
@pytest.mark.parametrize("scenario", ["average", "feedback", "resize", "mismatch", "auto", "rms"])
def test_all_reducer(tmp_path, scenario, device):
    enough_gpus(device)
    spawn(tmp_path, scenario, device)


@pytest.mark.parametrize("device", DEVICES)
def test_all_reducer_close(tmp_path, device):
    # on CUDA with as many GPUs as there are, up to GPUS (one is enough)
    world = max(1, min(GPUS, torch.cuda.device_count())) if device == "cuda" else None
    spawn(tmp_path, "close", device, world=world)


# CUDA buckets move as an all-gather of frames or a reduce-scatter of codes (the default from
# 3 ranks): both, whatever the number of GPUs. (CPU tensors run the Rust collective, whose two
# variants tests/collective.rs compares bit for bit.)
@pytest.mark.parametrize("device", GPU_RUNS)
@pytest.mark.parametrize("algorithm", ["all-gather", "reduce-scatter"])
@pytest.mark.parametrize("scenario", ["average", "feedback", "resize", "rms"])
def test_all_reducer_algorithms(tmp_path, scenario, algorithm, device):
    enough_gpus(device)
    spawn(tmp_path, scenario, device, algorithm=algorithm)


def test_a_silent_peer_is_an_error_after_the_timeout(tmp_path):
    spawn(tmp_path, "dead_peer", "cpu")


def test_all_reducer_over_three_ranks(tmp_path):
    spawn(tmp_path, "average", "cpu", world=3)


@pytest.mark.parametrize("device", GPU_RUNS)
def test_a_corrupt_shard_size_stops_every_rank(tmp_path, device):
    enough_gpus(device)
    spawn(tmp_path, "corrupt_shard", device)


@pytest.mark.gpu
def test_the_call_returns_before_the_gpu_is_done(tmp_path):
    # on as many GPUs as there are, up to GPUS (one is enough: what is timed is the call's own
    # waits, the check of every call's size among them)
    spawn(tmp_path, "returns_early", "cuda", world=max(1, min(GPUS, torch.cuda.device_count())))


@pytest.mark.gpu
def test_nccl_all_reducer(tmp_path):
    enough_gpus("cuda")
    spawn(tmp_path, "native", "cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_wait_raises_a_failed_chunks_error_as_it_was(tmp_path, monkeypatch, device):
    """A chunk that fails, on the calling thread (CPU) or on the comm thread (CUDA), reaches
    Pending.wait() as the exception it was, not as the RuntimeError that torch makes of a
    failed future callback. cfc_hook keeps the callback's error for DDP's reducer, which
    cannot read an exception set on the future (backward() names the original)."""
    import cfc.ddp as hook

    dev = torch.device(device)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        state = cfc.CfcState(eps=EPS, warmup_steps=0, min_compress_numel=0)
        reducer = cfc.distributed.AllReducer(state, chunk_numel=3000)
        check_close(reducer(data(0, 0, 10000).to(dev)).wait(), exact_average(0, 10000, 1), EPS)

        def fails(*args, **kw):
            raise cfc.CfcError("a chunk failed")

        monkeypatch.setattr(hook, "_cpu_part" if device == "cpu" else "_gpu_launch", fails)
        with pytest.raises(cfc.CfcError, match="a chunk failed"):
            reducer(data(0, 1, 10000).to(dev)).wait()
        monkeypatch.undo()
        if device == "cpu":
            # The error was raised once: the next call runs (it raised the old error again, and
            # left its own tensor as it was). Within 2 eps: the first call's residual comes
            # along. (On CUDA a failed comm thread fails every later call of its state.)
            check_close(reducer(data(0, 2, 10000).to(dev)).wait(), exact_average(2, 10000, 1), 2 * EPS)
        reducer.close()
        chunk = cfc.distributed._Chunk(0, data(0, 2, 100).to(dev), True)
        with pytest.raises(RuntimeError, match="CfcError: this CfcState was closed") as failed:
            cfc.cfc_hook(state, chunk).wait()
        assert not isinstance(failed.value, cfc.CfcError)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_nccl_all_reducer_on_one_rank_gives_the_cpu_codecs_values(tmp_path):
    """One rank, one GPU: each call's result is, bit for bit, what the CPU codec decodes from
    the call's input compressed with error feedback at eps (the average of one frame; chunks
    of 3000 elements, so 10000 values take four). check() and close() wait for the last call
    and find no bad frame; after close, calls and checks raise and closing again does
    nothing. (A bad frame itself needs a peer: the Rust test of gpu_allreduce.rs sets the
    decoder's status instead.)"""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        nr = cfc.distributed.NcclAllReducer(eps=EPS, chunk_mb=3000 * 4 / 2**20, timeout=60)
        nr.check()  # nothing to wait for yet
        for dtype in (torch.float32, torch.bfloat16):
            r = torch.zeros(10000)  # the CPU codec's residual, beside the reducer's own
            for call in range(3):
                x = data(0, call, 10000).to(dtype)
                expect = cfc.decompress(cfc.compress(x, eps=EPS, residual=r))
                y = x.cuda()
                report = nr(y)
                assert report["compressed"] and report["eps"] == EPS, report
                nr.check()
                assert torch.equal(y.cpu(), expect), (y.cpu() - expect).abs().max()
        with pytest.raises(ValueError, match="negated view"):
            nr(torch._neg_view(torch.zeros(10, device="cuda")))
        nr.close()
        nr.close()
        for use in (nr.check, nr.compressing, lambda: nr(torch.zeros(10, device="cuda"))):
            with pytest.raises(cfc.CfcError, match="closed"):
                use()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_nccl_all_reducer_orders_calls_that_come_on_different_streams(tmp_path):
    """Calls on different streams share the reducer's buffers, so each waits for the last one.
    Here the first call's decoding is held back on its stream A by a GPU sleep that a second
    thread queues while the call waits for its exchange; the next call comes at once on stream
    B. Were B not made to wait for A, its exchange would overwrite the received frames before
    A decodes them, and the first tensor would get the second call's values."""
    import threading

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        n = 10000
        nr = cfc.distributed.NcclAllReducer(eps=EPS, timeout=60)
        r = torch.zeros(n)  # the CPU codec's residual, beside the reducer's own
        xs = [data(0, call, n) for call in range(3)]
        expect = [cfc.decompress(cfc.compress(x, eps=EPS, residual=r)) for x in xs]
        ys = [x.cuda() for x in xs]
        nr(ys[0])  # the first call of a size sends the heads, then the frames; the rest, once
        torch.cuda.synchronize()
        # About 0.3-0.7 s at 1.4-2 GHz: long enough that a thread's queueing lands in it.
        cycles = 1_000_000_000
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        calling = threading.Event()

        def hold_back_the_decoding():
            calling.wait()
            time.sleep(0.1)  # the call has queued its compression and waits for its exchange
            with torch.cuda.stream(a):
                torch.cuda._sleep(cycles)

        holder = threading.Thread(target=hold_back_the_decoding)
        holder.start()
        with torch.cuda.stream(a):
            torch.cuda._sleep(cycles)  # the compression waits behind it, so the call waits too
            calling.set()
            nr(ys[1])
        holder.join()
        with torch.cuda.stream(b):
            nr(ys[2])
        torch.cuda.synchronize()
        for call in (1, 2):
            got = ys[call].cpu()
            assert torch.equal(got, expect[call]), (call, (got - expect[call]).abs().max())
        nr.check()
        nr.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_nccl_joining_without_the_other_ranks_ends_at_the_timeout_given():
    """A communicator of two ranks that only rank 0 joins: the wait for the other rank ends at
    the reducer's ``timeout`` (here 3 s) with an error. Before, the join waited for the default
    timeout (300 s, or CFC_NCCL_TIMEOUT) whatever the argument said. (In a fresh process: the
    aborted join's NCCL threads stay out of the other tests.)"""
    code = (
        "import time, cfc._native as n\n"
        "t0 = time.monotonic()\n"
        "try:\n    n.NcclAllReducer(0, n.nccl_unique_id(), 0, 2, timeout=3)\n"
        "except n.CfcError as e:\n    print('CfcError after', round(time.monotonic() - t0, 1), 's:', e)\n"
    )
    env = {**os.environ, "CFC_NCCL_TIMEOUT": "240"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=200, env=env)
    assert r.returncode == 0 and "CfcError after" in r.stdout, r
    waited = float(r.stdout.split("after")[1].split()[0])
    assert 2.5 <= waited < 60, r.stdout


def _cuda_driver():
    import ctypes

    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        pytest.skip("no libcuda.so.1")


@pytest.mark.gpu
def test_nccl_all_reducer_leaves_the_callers_current_context_as_it_was(tmp_path):
    """PyTorch reads the thread's current CUDA context as its current device, so a call that
    binds its device's context must put the caller's back. Here the caller's is a context of
    its own (one GPU is enough to tell it from the device's primary one, which cfc binds):
    joining, plain and compressed calls, the wait and closing all leave it current. Before,
    they left the primary context bound (on two GPUs: ``torch.cuda.current_device()`` changed
    under ``with torch.cuda.device(1)`` after a call on device 0)."""
    import ctypes

    cuda = _cuda_driver()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        x = torch.ones(50_000, device="cuda")
        stream = torch.cuda.current_stream().cuda_stream
        uid = cfc._native.nccl_unique_id()
        torch.cuda.synchronize()
        dev, own = ctypes.c_int(), ctypes.c_void_p()
        assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
        made = cuda.cuCtxCreate_v2(ctypes.byref(own), 0, dev)  # also makes it current
        assert made == 0 and own.value, made

        def current():
            c = ctypes.c_void_p()
            assert cuda.cuCtxGetCurrent(ctypes.byref(c)) == 0
            return c.value

        try:
            # Only cfc's native calls while it is current (PyTorch's would run in it).
            r = cfc._native.NcclAllReducer(0, uid, 0, 1, timeout=60)
            seen = {"join": current()}
            for fallback in ("always", "never"):
                r.allreduce(stream, x.data_ptr(), x.numel(), "float32", eps=1e-3, fallback=fallback)
                seen[fallback] = current()
            r.wait()
            seen["wait"] = current()
            r.close()
            seen["close"] = current()
        finally:
            assert cuda.cuCtxDestroy_v2(own) == 0
        assert all(c == own.value for c in seen.values()), {k: c == own.value for k, c in seen.items()}
        torch.cuda.synchronize()
        assert torch.equal(x.cpu(), torch.ones(50_000)), "the calls' results"
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_nccl_all_reducer_check_waits_for_an_uncompressed_call_through_the_communicator(tmp_path):
    """check() waits for the last call's work through the communicator (with its timeout), not
    by synchronizing the stream: an uncompressed call's all-reduce is on the caller's stream,
    and only that wait can end in an error when a peer stops. On one rank it returns once the
    call is done; after close it raises."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        nr = cfc.distributed.NcclAllReducer(eps=EPS, fallback="always", timeout=60)
        y = data(0, 0, 10000).cuda()
        assert not nr(y)["compressed"]  # the first call of a size agrees on it (a wait)
        torch.cuda.synchronize()

        class Counting:  # the native reducer, counting its waits
            def __init__(self, inner):
                self.inner, self.waits = inner, 0

            def wait(self):
                self.waits += 1
                return self.inner.wait()

            def __getattr__(self, name):
                return getattr(self.inner, name)

        nr._native = Counting(nr._native)
        torch.cuda._sleep(200_000_000)  # about 0.1 s: the call's all-reduce waits behind it
        slept = torch.cuda.Event()
        slept.record()
        assert not nr(y)["compressed"]  # queued: nothing on the host waits for it
        assert not slept.query(), "the GPU was not behind the call (the test shows nothing)"
        nr.check()
        assert nr._native.waits == 1, "check() did not wait through the communicator"
        assert slept.query(), "check() returned before the call's work was done"
        assert torch.equal(y.cpu(), data(0, 0, 10000)), "one rank's average is its input"
        nr.close()
        with pytest.raises(cfc.CfcError, match="closed"):
            nr._native.inner.wait()
    finally:
        dist.destroy_process_group()


def test_nccl_all_reducer_checks_its_options_and_needs_cuda():
    for kw, err in (({}, "exactly one"), ({"eps": 1e-3, "rms": 0.3}, "exactly one"),
                    ({"eps": -1.0}, "positive"), ({"eps": 1e-3, "fallback": True}, "fallback"),
                    ({"eps": 1e-3, "trials": 0}, "trials")):
        with pytest.raises(ValueError, match=err):
            cfc.distributed.NcclAllReducer(**kw)
    if not torch.cuda.is_available():
        with pytest.raises(cfc.CfcError, match="needs CUDA"):
            cfc.distributed.NcclAllReducer(eps=1e-3)


def test_native_nccl_entry_points_fail_clearly_before_touching_a_device():
    native = cfc._native
    with pytest.raises(cfc.CfcError, match="(?i)hex|id"):
        native.NcclAllReducer(0, "not hex", 0, 2)
    good = "00" * 128
    with pytest.raises(cfc.CfcError, match="rank 2 of 2"):
        native.NcclAllReducer(0, good, 2, 2)
    for bad in (-1.0, 0.0, float("nan"), float("inf"), 1e20):  # 1e20 s: more than a Duration holds
        with pytest.raises(ValueError, match="timeout"):
            native.NcclAllReducer(0, good, 0, 2, timeout=bad)
    # A missing NCCL library is an error that names where it looked (in a fresh process:
    # the library, once found, stays loaded).
    code = "import cfc._native as n\ntry:\n    n.nccl_unique_id()\nexcept n.CfcError as e:\n    print('CfcError:', e)\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CFC_NCCL_LIBRARY": "/nonexistent/libnccl.so.2"})
    assert r.returncode == 0 and "CfcError:" in r.stdout and "/nonexistent/libnccl.so.2" in r.stdout, r


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
        "--chunk-mb", "0.5", "--grads", str(GRADS),
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
        "--chunk-mb", "0.5", "--grads", str(GRADS), "--bounds", "0.3",
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
