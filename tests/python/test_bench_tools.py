"""The parts of ``benches/ddp_step_time.py`` that run without a GPU: its pinning of threads
(``+pin``)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))


def test_pinning_gives_the_hooks_thread_a_cpu_of_its_own_and_restores_every_thread(monkeypatch):
    import threading

    import ddp_step_time

    calls = {}
    monkeypatch.setattr(ddp_step_time.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    monkeypatch.setattr(ddp_step_time.os, "sched_setaffinity", lambda tid, cpus: calls.__setitem__(tid, set(cpus)))
    seen = []
    pin = ddp_step_time._Pinning(rank=1, inner=None)
    hook = pin.wrap(lambda state, bucket: seen.append(threading.get_native_id()) or "fut")
    t = threading.Thread(target=hook, args=("state", "bucket"))
    t.start()
    t.join()
    with pin:  # the hook's thread has ended: only this process's live threads are set
        pinned = dict(calls)
    assert seen == [pin.tid] and pin.tid != threading.get_native_id()
    me = threading.get_native_id()
    assert pinned[me] == {0, 1, 2, 3}, "every other thread leaves both ranks' CPUs"
    assert calls[me] == {0, 1, 2, 3, 4, 5}, "and gets every CPU back afterwards"

    # The hook's thread itself, while it lives.
    calls.clear()
    go, done = threading.Event(), threading.Event()

    def waiting(state, bucket):
        go.set()
        done.wait()

    t = threading.Thread(target=pin.wrap(waiting), args=("state", "bucket"))
    t.start()
    go.wait()
    with pin:
        assert calls[pin.tid] == {4}, "rank 1 takes the next-to-last CPU"
    assert calls[pin.tid] == {0, 1, 2, 3, 4, 5}
    done.set()
    t.join()

    monkeypatch.setattr(ddp_step_time.os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(SystemExit, match="at least 3 CPUs"):
        ddp_step_time._Pinning(rank=0)
