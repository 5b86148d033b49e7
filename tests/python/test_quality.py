"""benches/quality.py, reduced to what runs in CI: the conv family on 2 CPU ranks over gloo,
2 seeds. Checks the harness (same seed, same batches, gaps against the reference of the same
seed and point), not cfc's quality: that takes the full run on GPUs."""

import json
import math
import pathlib
import subprocess
import sys


def test_quality_bench_compares_each_hook_with_the_reference_of_its_seed(tmp_path):
    bench = pathlib.Path(__file__).resolve().parents[2] / "benches" / "quality.py"
    out = tmp_path / "q.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(bench),
        "--families", "conv", "--seeds", "2", "--steps", "30", "--hooks", "allreduce,allreduce,cfc,cfc-noef@0.5",
        "--json", str(out),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    s = d["summaries"]["conv"]
    assert list(s) == ["allreduce", "allreduce (2)", "cfc", "cfc-noef@0.5"]
    # scored at every tenth of the steps
    assert s["cfc"]["steps"] == [3, 6, 9, 12, 15, 18, 21, 24, 27, 30]
    # the reference against itself, and its rerun (the same bits on the CPU): no gap anywhere
    assert s["allreduce"]["mean_gap"] == [0.0] * 10
    assert s["allreduce (2)"]["mean_gap"] == [0.0] * 10 and s["allreduce (2)"]["reached"] == 2
    # cfc compressed (fewer bytes, a gap of its own) and the model still learned
    for hook in ("cfc", "cfc-noef@0.5"):
        assert s[hook]["fewer_bytes"] > 4, s[hook]
        assert all(math.isfinite(g) for g in s[hook]["mean_gap"])
        assert any(g != 0.0 for g in s[hook]["mean_gap"])
    # a coarser bound without error feedback sends fewer bytes than the default
    assert s["cfc-noef@0.5"]["fewer_bytes"] > s["cfc"]["fewer_bytes"]
    runs = d["runs"]["conv"]
    for seed in (0, 1):
        first = [x for x in runs if x["seed"] == seed and x["label"] == "allreduce"][0]["points"]
        assert first[-1]["held_out"] < 0.8 * first[0]["held_out"]  # plain training learns the teacher
    assert "| cfc |" in r.stdout and "time to the reference's final loss" in r.stdout


def test_quality_bench_runs_fsdp2_ways(tmp_path):
    """--fsdp: FSDP2's own float32 reduce-scatter as the reference (its rerun the same bits),
    and cfc.fsdp's, which compresses."""
    bench = pathlib.Path(__file__).resolve().parents[2] / "benches" / "quality.py"
    out = tmp_path / "q.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(bench),
        "--fsdp", "--families", "conv", "--seeds", "2", "--steps", "10", "--hooks", "allreduce,allreduce,cfc",
        "--json", str(out),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(out.read_text())["summaries"]["conv"]
    assert s["allreduce (2)"]["mean_gap"] == [0.0] * 10
    assert s["cfc"]["fewer_bytes"] > 4 and any(g != 0.0 for g in s["cfc"]["mean_gap"])
    assert "conv, FSDP2" in r.stdout
