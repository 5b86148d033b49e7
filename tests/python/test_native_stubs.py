"""torch_hook/cfc/_native.pyi stays in step with the native module."""

import ast
import pathlib

import pytest

import cfc
import cfc._native as native

STUB = pathlib.Path(__file__).resolve().parents[2] / "torch_hook" / "cfc" / "_native.pyi"


def stub_names():
    tree = ast.parse(STUB.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
    return names


def test_every_stub_exists_and_every_public_name_has_a_stub():
    public = {n for n in dir(native) if not n.startswith("_")} | {"__version__"}
    assert stub_names() == public


@pytest.mark.skipif(native.cuda_available(), reason="checks the error raised without CUDA")
def test_cuda_calls_without_cuda_raise_a_clear_error():
    with pytest.raises(cfc.CfcError, match="CUDA"):
        native.cuda_compress(0, 0, 0, 0, "float32", [0], 0, 1 << 12, 0, 1 << 12, eps=1e-3)


def test_cuda_sum_checks_its_frame_count_before_touching_a_device():
    # sum_offsets gives each frame a row of the grid, which CUDA caps at 65535 rows.
    with pytest.raises(cfc.CfcError, match="at most 65535 frames"):
        native.cuda_sum(0, 0, [0] * 65536, [100] * 65536, 1, "float32", [1], 0, 1 << 20, 0, 1 << 30)
    with pytest.raises(cfc.CfcError, match="at least one frame"):
        native.cuda_sum(0, 0, [], [], 1, "float32", [1], 0, 1 << 20, 0, 1 << 30)
    # Each frame's length must hold its header and a width byte per group of 32 elements.
    with pytest.raises(cfc.CfcError, match="2 frame lengths"):
        native.cuda_sum(0, 0, [0], [100, 100], 1, "float32", [1], 0, 1 << 20, 0, 1 << 30)
    with pytest.raises(cfc.FormatError, match="frame"):
        native.cuda_sum(0, 0, [0], [72 + 31], 1000, "float32", [1000], 0, 1 << 20, 0, 1 << 30)


def test_cuda_decode_sum_and_copy_rows_check_their_arguments_before_touching_a_device():
    with pytest.raises(cfc.CfcError, match="1 to 65535 frames"):
        native.cuda_decode_sum(0, 0, [], [], 1, "float32", 1, 1.0, 0, "float32", 0, 1 << 20, 0)
    with pytest.raises(TypeError, match="float64"):
        native.cuda_decode_sum(0, 0, [0], [100], 1, "float32", 1, 1.0, 0, "float64", 0, 1 << 20, 0)
    with pytest.raises(ValueError, match="10 bytes"):
        native.cuda_decode_sum(0, 0, [0], [100], 1 << 20, "float32", 1, 1.0, 0, "float32", 0, 10, 0)
    with pytest.raises(cfc.FormatError, match="frame"):
        native.cuda_decode_sum(0, 0, [0, 0], [4096, 72 + 31], 1000, "float32", 1, 1.0, 0, "float32", 0, 1 << 20, 0)
    with pytest.raises(cfc.CfcError, match="pitch"):
        native.cuda_copy_rows(0, 0, 0, 4, 0, 8, 8, 2)


@pytest.mark.skipif(native.cuda_available(), reason="checks the errors raised without CUDA")
def test_bucket_exchange_refuses_bad_arguments_and_a_machine_without_nccl_or_cuda_clearly():
    with pytest.raises(cfc.CfcError, match="256 hex digits"):
        native.BucketExchange(0, "xyz", 0, 2)
    with pytest.raises(cfc.CfcError, match="rank 3 of 2"):
        native.BucketExchange(0, "00" * 128, 3, 2)
    with pytest.raises(cfc.CfcError, match="NCCL|CUDA") as missing:
        native.BucketExchange(0, "00" * 128, 0, 2)
    assert str(missing.value).count("is not available") == 1, missing.value  # said once
    # The scratch of a launch: this rank's row (a 16-byte head, then the frame capacity rounded
    # up to 16 bytes), the workspace, then every rank's rows of the slot asked for (clamped to
    # the capacity), both 256-byte aligned: only the end moves with the slot. Computed on the
    # host: no CUDA needed.
    n, world = 1000, 3
    cap = native.cuda_compress_capacity(n, "float32", 1, eps=1e-3)
    for slot, feedback in [(0, False), (100, True), (1 << 40, False)]:
        at = native.BucketExchange.scratch_layout(n, "float32", 1e-3, feedback, slot, world)
        assert at["capacity"] == -(-cap // 16) * 16
        assert at["slot"] == min(-(-slot // 16) * 16, at["capacity"])
        assert at["workspace_at"] == -(-(16 + at["capacity"]) // 256) * 256
        assert at["workspace_len"] >= native.cuda_workspace_len(n, compress=True, feedback=feedback)
        assert at["workspace_len"] >= native.cuda_decode_sum_workspace_len(n, world)
        assert at["recv_at"] == -(-(at["workspace_at"] + at["workspace_len"]) // 256) * 256
        assert at["len"] == at["recv_at"] + world * (16 + at["slot"])
    with pytest.raises(TypeError, match="unsupported dtype"):
        native.BucketExchange.scratch_layout(n, "complex64", 1e-3, False, 0, world)
