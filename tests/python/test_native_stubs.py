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


def test_cuda_decode_sum_checks_its_arguments_before_touching_a_device():
    with pytest.raises(cfc.CfcError, match="1 to 65535 frames"):
        native.cuda_decode_sum(0, 0, [], [], 1, "float32", 1, 1.0, 0, "float32", 0, 1 << 20, 0)
    with pytest.raises(TypeError, match="float64"):
        native.cuda_decode_sum(0, 0, [0], [100], 1, "float32", 1, 1.0, 0, "float64", 0, 1 << 20, 0)
    with pytest.raises(ValueError, match="10 bytes"):
        native.cuda_decode_sum(0, 0, [0], [100], 1 << 20, "float32", 1, 1.0, 0, "float32", 0, 10, 0)
    with pytest.raises(cfc.FormatError, match="frame"):
        native.cuda_decode_sum(0, 0, [0, 0], [4096, 72 + 31], 1000, "float32", 1, 1.0, 0, "float32", 0, 1 << 20, 0)


def _engine(**kw):
    """A one-rank engine (its own listener, its own address)."""
    listener = native.Listener(True)
    opts = dict(bound="rms", value=0.3, error_feedback=True, algorithm=None, fallback="never", trial_steps=0,
                warmup_steps=0, min_compress_numel=0, timeout=30.0)
    opts.update(kw)
    return native.Engine(listener, [listener.addresses()], 0, 1, bytes(32), 7, **opts)


def test_the_engine_refuses_bad_options_and_jobs_clearly():
    for bad, match in [
        (dict(bound="maybe"), "unknown bound"),
        (dict(algorithm="ring"), "unknown algorithm"),
        (dict(fallback="sometimes"), "unknown fallback"),
        (dict(value=-1.0), "positive"),
        (dict(bound="rel", value=1.5), "below 1"),
        (dict(fallback="auto", trial_steps=3), "even number"),
        (dict(timeout=0.0), "between 0.1 s"),
        (dict(timeout=1e12), "30 days"),
    ]:
        with pytest.raises((ValueError, cfc.CfcError), match=match):
            _engine(**bad)
    listener = native.Listener(True)  # every rank on this host: loopback only
    assert [a.split(":")[0] for a in listener.addresses()] == ["127.0.0.1"]
    with pytest.raises(cfc.CfcError, match="secret has 16 to 64 bytes"):
        native.Engine(native.Listener(True), [[]], 0, 1, b"short", 7, bound="rms", value=0.3,
                      error_feedback=True, algorithm=None, fallback="never", trial_steps=0, warmup_steps=0,
                      min_compress_numel=0, timeout=30.0)
    torch = pytest.importorskip("torch")
    e = _engine()
    assert (e.rank, e.world) == (0, 1)
    x = torch.zeros(8)
    # What the binding refuses (no address crosses as a number): the engine is untouched.
    for args, error, match in [
        ((torch.zeros(4, dtype=torch.complex64), None, None), TypeError, "unsupported dtype"),
        ((12345, None, None), TypeError, "data must be a tensor"),
        ((torch.zeros(4, 4).t(), None, None), ValueError, "data must be contiguous"),
        ((torch.zeros(4, device="meta"), None, None), ValueError, "meta device"),
        ((x, (x.data_ptr(), 8), None), TypeError, "the residual must be a tensor"),
        ((x, None, torch.zeros(8)[::2]), ValueError, "out must be contiguous"),
    ]:
        with pytest.raises(error, match=match):
            e.submit(0, 0, *args, None, True, False, None)
    with pytest.raises(ValueError, match="a CUDA stream for an engine on the cpu"):
        e.submit(0, 0, x, None, None, None, True, False, object())
    with pytest.raises(ValueError, match="a CUDA stream for an engine on the cpu"):
        e.wait(object())
    # A job the engine refuses fails it on every rank (here, the one): later calls say so at once.
    with pytest.raises(TypeError, match="float64"):
        e.submit(0, 0, torch.zeros(4, dtype=torch.float64), None, None, None, True, False, None)
    with pytest.raises(cfc.CfcError, match="rank 0"):
        e.submit(0, 0, x, None, None, None, True, False, None)
    e.close()
    e.close()
    with pytest.raises(cfc.CfcError, match="closed"):
        e.wait()


def test_a_one_rank_engine_averages_a_host_tensor_in_place():
    torch = pytest.importorskip("torch")

    e = _engine(bound="eps", value=1e-3)
    x = torch.linspace(-1, 1, 10_000)
    r = torch.zeros_like(x)
    want = x.clone()
    e.submit(0, 1, x, r, None, None, True, False, None)
    e.wait()
    assert (x - want).abs().max() <= 1e-3 * (1 + 1e-6)
    assert r.abs().max() <= 1e-3 * (1 + 1e-6) and r.abs().max() > 0
    s = e.stats()
    assert s["compressed_buckets"] == 1 and s["bytes_sent"] == 0  # one rank sends nothing
    state = e.state()
    assert state["step"] == 1 and state["buckets"][0]["fingerprint"] == 1
    e.close()
