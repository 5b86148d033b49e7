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
