"""Every Python snippet of README.md runs as written: the codec's here, the GPU's on a GPU, the
ones that need a model or a tensor (``ddp_model``, ``model``, ``x``) on 2 CPU ranks over gloo,
with those names made first and a training step after. A snippet of a kind this file does not
know fails the test, so none goes unrun."""

import pathlib
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conftest import spawn_scenario_results

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
DEV = torch.device("cpu")  # set in each worker process


def snippets():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def kind(code):
    """Where a snippet runs: on a GPU, in a process group (and with what made first), or alone."""
    if "import torch, cfc" in code:
        return "alone"
    if 'device="cuda"' in code and "ddp_model" not in code:
        return "gpu"
    if "ddp_model" in code:
        return "ddp"
    if "fully_shard" in code:
        return "fsdp"
    if "reducer(x)" in code:
        return "allreducer"
    if "CfcState(" in code and "process_group" in code:
        return "state"
    return "unknown"


class Layers(nn.Module):
    """A small model with ``layers``, as the FSDP2 snippet iterates."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def step(model, rank):
    g = torch.Generator().manual_seed(rank)
    model(torch.randn(8, 256, generator=g)).square().mean().backward()


def run_all(rank, world, out):
    """The snippets that need a process group, each after what it names is made."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    ran = []
    for i, code in enumerate(snippets()):
        k = kind(code)
        if k not in ("ddp", "fsdp", "allreducer", "state"):
            continue
        torch.manual_seed(0)
        names = {}
        if k == "ddp":
            names["ddp_model"] = DDP(Layers())
        elif k == "fsdp":
            names["model"] = Layers()
        elif k == "allreducer":
            names["x"] = torch.randn(100_000, generator=torch.Generator().manual_seed(rank))
        exec(compile(code, f"README.md snippet {i}", "exec"), names)
        if k == "ddp":
            for _ in range(3):
                step(names["ddp_model"], rank)
        elif k == "fsdp":
            step(names["model"], rank)
        elif k == "allreducer":
            mean = names["x"].clone()
            dist.all_reduce(mean)
            assert torch.allclose(names["y"], mean / world, atol=1e-4 * 1.001, rtol=0)
        state = names.get("state")
        if state is not None and hasattr(state, "close"):
            state.close()
        ran.append(i)
    out.put({"rank": rank, "ran": ran})


SCENARIOS = {"run_all": run_all}


def test_every_snippet_is_of_a_known_kind():
    kinds = [kind(c) for c in snippets()]
    assert kinds and "unknown" not in kinds, kinds
    assert {"ddp", "fsdp", "allreducer", "state", "alone", "gpu"} <= set(kinds), kinds


def test_the_codec_snippet_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (it writes model.cfc)
    alone = [c for c in snippets() if kind(c) == "alone"]
    assert alone
    for code in alone:
        exec(compile(code, "README.md", "exec"), {})
    assert (tmp_path / "model.cfc").exists()


@pytest.mark.gpu
def test_the_gpu_snippet_runs():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    # (it follows the codec's snippet, whose imports it uses)
    codec = next(c for c in snippets() if kind(c) == "alone")
    names = {}
    exec(compile(codec.split("\ng = ")[0], "README.md", "exec"), names)
    for code in (c for c in snippets() if kind(c) == "gpu"):
        exec(compile(code, "README.md", "exec"), names)


def test_the_snippets_with_a_process_group_run(tmp_path):
    got = spawn_scenario_results(tmp_path, "test_readme", "run_all", 2)
    want = [i for i, c in enumerate(snippets()) if kind(c) in ("ddp", "fsdp", "allreducer", "state")]
    assert len(got) == 2 and all(r["ran"] == want for r in got), (got, want)
