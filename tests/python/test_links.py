"""The engine's own links admit only the job's ranks, and opening an engine is bounded by the
timeout (CPU ranks over gloo, in CI). The links' framing and handshake are tested on their own
in ``src/engine/transport/tcp``; here, whole DDP jobs."""

import hashlib
import os
import socket
import struct
import time
import zlib

import pytest
import torch
import torch.distributed as dist

import cfc
import cfc._engine
from cfc import CfcState
from conftest import spawn_scenario_results
from test_ddp import make, train

DEV = torch.device("cpu")  # set in each worker process (the helpers of test_ddp read their own)


def _store():
    return dist.distributed_c10d._get_default_store()


def _attack(store, n, world, out):
    """What a stranger that can read the store does, before rank 1 links: connects to rank 0's
    published address with nothing (and stays), with the handshake cfc's links used to take
    (``"cfcL"``, the token every 2-rank job had, rank 1) followed by a frame of data, and with a
    well-formed hello for rank 1 whose proof it cannot make. Returns the connections."""
    prefix = f"cfc/engine/{n}"
    address = store.get(f"{prefix}/links/0").decode().split(",")[0]
    host, port = address.rsplit(":", 1)
    target = (host, int(port))
    idle = socket.create_connection(target)
    old = socket.create_connection(target)
    token = zlib.crc32(f"{prefix}/{tuple(range(world))}".encode())
    old.sendall(b"cfcL" + struct.pack("<QI", token, 1) + b"\0" + struct.pack("<Q", 16) + bytes(16))
    forger = socket.create_connection(target)
    forger.settimeout(20)
    hello = b"cfcH" + bytes([1, 0, 0, 0]) + struct.pack("<QIII", n, world, 1, 0) + os.urandom(16)
    forger.sendall(hello)
    answer = forger.recv(52)
    forger.sendall(os.urandom(32))  # not the proof: the secret is not known
    out.put({"answered": len(answer)})
    return idle, old, forger


def strangers(rank, world, out):
    """Trains 12 steps with cfc, with (``attack``) or without strangers at rank 0's port, and
    reports the final parameters; the strangers' connections must be refused."""
    attack = os.environ.get("CFC_TEST_ATTACK") == "1"
    kept = []
    if attack and rank == 1:
        real = cfc._engine._wait_for

        def wait_then_attack(store, keys, timeout, r, n, what):
            real(store, keys, timeout, r, n, what)
            if what == "their link addresses":  # rank 0 listens; rank 1 has not dialled yet
                kept.extend(_attack(store, n, world, out))

        cfc._engine._wait_for = wait_then_attack
    state = CfcState(warmup_steps=1, min_compress_numel=0, timeout=60)
    ddp, opt = make(state)
    train(ddp, opt, rank, 12)
    assert state.stats()["compressed_buckets"] > 0
    if kept:
        idle, old, forger = kept
        for s in (old, forger):
            s.settimeout(20)
            assert s.recv(1) == b"", "a stranger's connection was not closed"
        idle.close()
    if rank == 0:
        # (a digest: a queue item past the pipe's buffer would hold the process at exit)
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in ddp.parameters()))
        out.put({"params": digest.hexdigest()})


def one_rank_short(rank, world, out):
    """Ranks 0 and 1 register cfc's hook; rank 2 does not (a script that registers it under a
    condition). Ranks 0 and 1 must raise within their timeout, naming rank 2."""
    store = _store()
    if rank < 2:
        state = CfcState(warmup_steps=0, min_compress_numel=0, timeout=3)
        ddp, opt = make(state)
        t0 = time.monotonic()
        with pytest.raises(Exception) as e:
            train(ddp, opt, rank, 1)
        took = time.monotonic() - t0
        out.put({"rank": rank, "took": took, "error": str(e.value)})
        store.set(f"done/{rank}", "1")
    else:
        ddp, opt = make()  # (DDP's constructor is a collective: every rank makes one)
        store.wait(["done/0", "done/1"])


SCENARIOS = {f.__name__: f for f in (strangers, one_rank_short)}


def _run(tmp_path, scenario, world):
    """Runs ``scenario`` on ``world`` CPU ranks; everything they put in the queue."""
    return spawn_scenario_results(tmp_path, "test_links", scenario, world)


def test_strangers_at_a_rank_s_port_neither_join_nor_change_training(tmp_path, monkeypatch):
    clean = _run(tmp_path / "clean", "strangers", 2)
    monkeypatch.setenv("CFC_TEST_ATTACK", "1")
    attacked = _run(tmp_path / "attacked", "strangers", 2)
    answered = [r for r in attacked if "answered" in r]
    assert len(answered) == 1, attacked  # the attack ran
    params = lambda rs: next(r["params"] for r in rs if "params" in r)  # noqa: E731
    assert params(clean) == params(attacked), "the strangers changed training"


def test_a_hook_on_some_ranks_only_raises_within_the_timeout(tmp_path):
    got = _run(tmp_path, "one_rank_short", 3)
    assert sorted(r["rank"] for r in got) == [0, 1], got
    for r in got:
        assert "rank(s) [2]" in r["error"] and "did not" in r["error"], r
        assert "registered" in r["error"], r
        assert r["took"] < 3 + 10, r  # the timeout (3 s) and the store's polling, not 5 minutes


def test_timeouts_outside_what_the_engine_takes_are_refused_when_the_state_is_made(monkeypatch):
    import datetime

    for bad in (1e12, datetime.timedelta(days=365), 1e-9, float("nan")):
        with pytest.raises(ValueError, match="timeout"):
            CfcState(timeout=bad)
    monkeypatch.setenv("CFC_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="CFC_TIMEOUT"):
        CfcState()
    monkeypatch.setenv("CFC_TIMEOUT", "7")
    assert CfcState().options.timeout == 7.0
