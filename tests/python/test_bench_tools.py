"""The parts of the benchmark scripts that run without a GPU: ``benches/ddp_trace.py``'s summary
of a profiler trace, and its marking of hook calls."""

import gzip
import json
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
