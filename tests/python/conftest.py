import os
import pathlib

import numpy as np
import pytest

GRADS = pathlib.Path(
    os.environ.get(
        "CFC_GRADS_DIR",
        pathlib.Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "grads",
    )
)

# Where the ranks of a multi-process test run (its ``device`` parameter):
#   "cpu":        gloo, CPU tensors (in CI), 2 processes unless the test says otherwise;
#   "cuda":       NCCL, one GPU per rank, CFC_TEST_GPUS of them (default 2; 4 on a 4-GPU
#                 machine checks that nothing assumes 2 ranks);
#   "shared-gpu": gloo, CFC_TEST_SHARED_RANKS ranks (default 3) all on cuda:0. This runs the
#                 CUDA engine at a world size above 1 on a machine with one GPU, its rows
#                 moved through host memory (NCCL refuses two ranks on one GPU).
GPUS = int(os.environ.get("CFC_TEST_GPUS", "2"))
# CFC_TEST_ONE_RANK=1 with CFC_TEST_GPUS=1 runs the "cuda" scenarios at world size 1 on one GPU
# (those that compare ranks, or expect two ranks' bytes, then prove less or fail by design).
ONE_RANK = os.environ.get("CFC_TEST_ONE_RANK") == "1"
SHARED_RANKS = int(os.environ.get("CFC_TEST_SHARED_RANKS", "3"))
# Every CPU engine the tests start (in this process and the ranks it spawns) checks that its
# lanes are ordered wherever they share memory (src/engine/backend/lanes.rs): on a GPU a missing
# order is a race, which the CPU backend then reports as an error.
os.environ.setdefault("CFC_CHECK_LANES", "1")


def world_of(device):
    """How many processes a multi-process test starts on ``device``."""
    return {"cpu": 2, "cuda": GPUS, "shared-gpu": SHARED_RANKS}[device]


def place_rank(device, rank):
    """The torch device and the process-group backend of ``rank`` (in its own process)."""
    import torch

    if device == "cpu":
        return torch.device("cpu"), "gloo"
    dev = torch.device("cuda", rank if device == "cuda" else 0)
    torch.cuda.set_device(dev)
    return dev, "nccl" if device == "cuda" else "gloo"


def run_scenario(rank, world, init_file, module, scenario, out, device="cpu"):
    """One rank of a multi-process test, in its own process: ``module.SCENARIOS[scenario]``
    (a function of ``(rank, world, out)``) with the module's ``DEV`` set to this rank's device,
    its process group joined, and the cfc states it leaves closed before the process ends."""
    import importlib

    import torch
    import torch.distributed as dist

    mod = importlib.import_module(module)
    mod.DEV, backend = place_rank(device, rank)
    if mod.DEV.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the same bits every run
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        mod.SCENARIOS[scenario](rank, world, out)
    finally:
        close_cfc_states()
        dist.destroy_process_group()


def spawn_scenario_results(tmp_path, module, scenario, world, device="cpu"):
    """Runs ``scenario`` of test module ``module`` on ``world`` processes; returns everything
    they put in their queue, in the order it came. (Keep each item small: a process whose item
    is still in the pipe's buffer cannot exit, and the join waits for it.)"""
    import torch.multiprocessing as mp

    tmp_path.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.spawn(run_scenario, args=(world, str(tmp_path / "init"), module, scenario, out, device), nprocs=world,
             join=True)
    got = []
    while not out.empty():
        got.append(out.get())
    return got


def spawn_scenario(tmp_path, module, scenario, world, device="cpu"):
    """Runs ``scenario`` of test module ``module`` on ``world`` processes; returns what one of
    them put in its queue, if any."""
    got = spawn_scenario_results(tmp_path, module, scenario, world, device)
    return got[0] if got else None


def enough_gpus(device):
    """Skip a test on ``device`` where this machine has too few GPUs for it."""
    import torch

    if device == "cuda" and GPUS < 2 and not ONE_RANK:
        # (their scenarios compare ranks; the shared-gpu runs put several ranks on one GPU)
        pytest.skip(f"CFC_TEST_GPUS={GPUS}: the tests of one GPU per rank need 2 ranks or more")
    need = {"cpu": 0, "cuda": GPUS, "shared-gpu": 1}[device]
    if torch.cuda.device_count() < need:
        pytest.skip(f"needs {need} GPUs")


def close_cfc_states():
    """Before a worker destroys its process groups: free the CfcStates that only reference
    cycles hold, and close the rest. A state holds cfc's own process group; a CUDA state's
    comm thread also holds the state, so that group would outlive destroy_process_group until
    the process exits, and a gloo group freed that late can abort the process ("terminate
    called without an active exception"). A failure here is printed, not raised: it must not
    hide the scenario's own error."""
    import gc
    import traceback

    import cfc

    import warnings

    gc.collect()
    with warnings.catch_warnings():
        # (isinstance on every live object touches torch's deprecated module attributes)
        warnings.simplefilter("ignore", FutureWarning)
        states = [o for o in gc.get_objects() if isinstance(o, cfc.CfcState)]
    for state in states:
        try:
            state.close()
        except Exception:  # noqa: BLE001 - see above
            traceback.print_exc()


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def grads():
    files = sorted(GRADS.glob("*.npy"))
    if not files:
        pytest.skip(f"no gradient vectors in {GRADS}")
    return {f.stem: np.load(f) for f in files}


def pytest_terminal_summary(terminalreporter):
    """One line per reason tests were skipped (most skip for want of a GPU), so that a run on
    a machine without one says what it did not run and why."""
    import collections

    reasons = collections.Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.write_sep("-", "skipped, by reason")
        for reason, n in reasons.most_common():
            terminalreporter.write_line(f"{n:5d}  {reason}")
