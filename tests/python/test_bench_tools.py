"""The parts of the benchmark scripts that run without a GPU: ``benches/ddp_trace.py``'s summary
of a profiler trace (per hook and per kind of operation) and its marking of hook calls,
``ddp_step_time.py``'s pinning of threads (``+pin``), and what ``host_threads.py`` and
``thread_waits.py`` read from Linux's ``/proc``."""

import gzip
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
import ddp_trace  # noqa: E402


def _x(name, cat, tid, ts, dur, **args):
    e = {"ph": "X", "name": name, "cat": cat, "tid": tid, "pid": 1, "ts": ts, "dur": dur}
    if args:
        e["args"] = args
    return e


def _trace():
    """Two backward passes of 1000 us on the main thread (tid 1), run by the autograd thread
    (tid 2), with a comm thread (tid 3); kernels on the default stream (7) and NCCL's (20)."""
    ev = []
    for k, t0 in enumerate((0, 5000)):
        ev.append(_x("cfc_trace_backward", "user_annotation", 1, t0, 1000))
        ev.append(_x("cfc_trace_backward", "gpu_user_annotation", 7, t0 + 50, 1000))  # the GPU's copy: ignored
        ev.append(_x("autograd::engine::evaluate_function: MmBackward0", "cpu_op", 2, t0 + 100, 300))
        ev.append(_x("cudaLaunchKernel", "cuda_runtime", 2, t0 + 150, 10))
        ev.append(_x("cudaLaunchKernel", "cuda_runtime", 2, t0 + 200, 30))
        ev.append(_x("autograd::engine::evaluate_function: AccumulateGrad", "cpu_op", 2, t0 + 500, 200))
        ev.append(_x("cfc_trace_hook", "user_annotation", 2, t0 + 520, 100 + 50 * k))
        ev.append(_x("cudaEventRecord", "cuda_runtime", 2, t0 + 560, 5))  # inside the hook: its time
        ev.append(_x("cfc_trace_hook", "user_annotation", 2, t0 + 800, 50))  # (outside an operation)
        ev.append(_x("cuLaunchKernel", "cuda_driver", 3, t0 + 600, 20))
        ev.append(_x("gemm", "kernel", 7, t0 + 160, 200, stream=7))
        ev.append(_x("gemm", "kernel", 7, t0 + 300, 200, stream=7))  # overlaps the first: 340 us busy
        ev.append(_x("ncclDevKernel_AllGather_RING_LL", "kernel", 20, t0 + 650, 300, stream=20))
    return {"traceEvents": ev + [{"ph": "M", "name": "thread_name", "tid": 2}]}


def test_the_trace_summary_adds_up_each_backward_pass():
    s = ddp_trace.summarize(_trace(), "x")
    assert s["steps"] == 2
    assert s["backward ms"] == 1.0
    assert s["last hook ms"] == 0.8
    assert s["hook calls"] == 2
    assert s["hook us, total"] == (150 + 200) / 2  # median of the two passes
    assert s["autograd: CUDA calls"] == 3 and s["autograd: CUDA call us"] == 45
    assert s["autograd: launch us, mean"] == 20  # the two launches
    # outermost operations 300 + 200 us, less 40 us of CUDA calls and the hook inside them
    # (100 / 150 us; the one outside them is not part of their time)
    assert s["autograd: other work ms"] == pytest.approx((360 + 310) / 2 / 1e3)
    assert s["thread 3: CUDA calls"] == 1 and s["thread 3: launch us, mean"] == 20
    assert s["GPU stream 7 busy %"] == 34.0
    assert s["GPU other streams busy %"] == 30.0
    assert s["GPU NCCL kernels, count"] == 1 and s["GPU NCCL kernels busy ms"] == 0.3


def test_the_summary_reads_gzipped_traces(tmp_path, capsys):
    path = tmp_path / "trace_cfc.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    ddp_trace.print_table([ddp_trace.summarize(ddp_trace._load(str(path)), "cfc")])
    out = capsys.readouterr().out
    assert "| | cfc |" in out and "| backward ms | 1.0 |" in out


def test_an_interleaved_trace_is_summed_up_per_hook(tmp_path, capsys, monkeypatch):
    trace = _trace()
    ranges = [e for e in trace["traceEvents"]
              if e.get("name") == "cfc_trace_backward" and e["cat"] == "user_annotation"]
    for e, hook in zip(sorted(ranges, key=lambda e: e["ts"]), ("noop", "cfc")):
        e["name"] = f"cfc_trace_backward:{hook}"
    assert ddp_trace.hooks_in(trace) == ["noop", "cfc"]
    noop, cfc = (ddp_trace.summarize(trace, h, hook=h) for h in ("noop", "cfc"))
    assert noop["steps"] == cfc["steps"] == 1
    assert (noop["hook us, total"], cfc["hook us, total"]) == (150, 200)  # each its own step's two
    assert ddp_trace.summarize(trace, "all")["steps"] == 2
    path = tmp_path / "trace_noop+cfc.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    monkeypatch.setattr(sys, "argv", ["ddp_trace.py", "--summarize", str(path), "--ops", "1"])
    ddp_trace.main()
    out = capsys.readouterr().out
    assert "| | noop | cfc |" in out and "| hook us, total | 150 | 200 |" in out
    assert "| MmBackward0 | 1 | 300.0 | 300.0 | 1.00 |" in out


def test_operation_times_compare_each_kind_of_autograd_operation_across_traces(capsys):
    slow = _trace()
    for e in slow["traceEvents"]:
        if e.get("name", "").endswith("MmBackward0"):
            e["dur"] *= 2
    slow["traceEvents"].append(_x("autograd::engine::evaluate_function: MmBackward0", "cpu_op", 2, 9000, 50))  # outside
    t = ddp_trace.op_times(_trace())
    assert t == {"MmBackward0": (1.0, 300, 0.3), "AccumulateGrad": (1.0, 200, 0.2)}
    assert ddp_trace.op_times(slow)["MmBackward0"] == (1.0, 600, 0.6)
    ddp_trace.print_ops([t, ddp_trace.op_times(slow)], ["noop", "cfc"], top=1)
    out = capsys.readouterr().out
    assert "| MmBackward0 | 1 | 300.0 | 600.0 | 2.00 |" in out and "AccumulateGrad" not in out


def test_the_trace_marks_each_hook_call_through_ddp_step_times_registration():
    import ddp_step_time
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks
    from torch.profiler import ProfilerActivity, profile

    class FakeDDP:
        def register_comm_hook(self, state, hook):
            self.hook = hook

    ddp = FakeDDP()
    ddp_step_time.register(ddp, "noop", ddp_trace._Marker())
    assert ddp.hook.__wrapped__ is debugging_hooks.noop_hook

    seen = []
    marked = ddp_trace._Marker().wrap(lambda state, bucket: seen.append((state, bucket)) or "fut")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert marked("state", "bucket") == "fut"
    assert seen == [("state", "bucket")]
    assert "cfc_trace_hook" in {e.name for e in prof.events()}


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


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_host_threads_finds_the_matching_processes_threads_and_counts_interrupts():
    import subprocess

    import host_threads

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)  # cfc-host-threads-test"])
    try:
        time_out = 50
        while time_out and not host_threads._threads("cfc-host-threads-test"):
            subprocess.run(["sleep", "0.1"])
            time_out -= 1
        found = host_threads._threads("cfc-host-threads-test")
        assert {pid for pid, _ in found} == {str(child.pid)}
        name, ticks, cpu, vol, invol = found[(str(child.pid), str(child.pid))]
        assert ticks >= 0 and cpu >= 0 and vol >= 0 and invol >= 0
    finally:
        child.kill()
        child.wait()
    assert all(isinstance(v, int) for v in host_threads._interrupts().values())


def test_thread_waits_names_the_mapping_that_holds_a_lock():
    import thread_waits

    maps = [(0x1000, 0x2000, "libcuda.so.1"), (0x5000, 0x9000, "[heap]")]
    starts = [m[0] for m in maps]
    assert thread_waits._where(maps, starts, 0x1800) == "libcuda.so.1"
    assert thread_waits._where(maps, starts, 0x5000) == "[heap]"
    assert thread_waits._where(maps, starts, 0x2000) == "?"  # past the end of the first
    assert thread_waits._where(maps, starts, 0x10) == "?"


@pytest.mark.skipif(not Path("/proc/self/syscall").exists(), reason="reads Linux's /proc/<pid>/syscall")
def test_thread_waits_samples_a_child_waiting_on_a_lock_and_sleeping():
    import subprocess
    import time

    import thread_waits

    code = ("import threading, time; e = threading.Event(); "
            "threading.Thread(target=e.wait, daemon=True).start(); time.sleep(30)  # cfc-thread-waits-test")
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        while len(os.listdir(f"/proc/{child.pid}/task")) < 2:  # its waiting thread has started
            assert time.monotonic() < deadline and child.poll() is None, "the child did not start"
            time.sleep(0.05)
        time.sleep(0.2)  # (the thread reaches its wait)
        try:  # a machine may forbid reading another process's system calls: then nothing to test
            with open(f"/proc/{child.pid}/task/{child.pid}/syscall") as f:
                f.read()
        except PermissionError:
            pytest.skip("this machine does not let a process read its child's system calls")
        found = thread_waits.sample("cfc-thread-waits-test", 0.3, 0.01, callers=4)
        try:  # (opening checks that this process may read the child's memory)
            os.close(os.open(f"/proc/{child.pid}/mem", os.O_RDONLY))
            readable = True
        except OSError:
            readable = False
    finally:
        child.kill()
        child.wait()
    assert {pid for pid, _ in found} == {str(child.pid)}
    waits = [k for _, c, _ in found.values() for k in c]
    futex = [k for k in waits if k.startswith("futex in ")]
    assert futex, waits  # the Event's lock
    assert any(k in ("clock_nanosleep", "nanosleep", "select", "pselect6") for k in waits), waits
    if readable:  # the lock is taken by the interpreter's code: its caller is named
        assert any("(from " in k and "python" in k.split("(from ")[1] for k in futex), futex
