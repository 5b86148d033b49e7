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


class _OnCuda:
    """A stand-in for a contiguous CUDA tensor or stream of device 0 (the binding reads tensors
    through their methods): reaches the checks made before a device is touched, on any machine.
    Its memory is never read: every call below is refused first."""

    def __init__(self, numel=0, dtype="uint8", addr=1 << 20):
        import torch

        self._numel, self.dtype, self._addr = numel, getattr(torch, dtype), addr
        self.device = torch.device("cuda", 0)
        self.cuda_stream = 0

    def is_contiguous(self):
        return True

    def data_ptr(self):
        return self._addr

    def numel(self):
        return self._numel

    def element_size(self):
        import torch

        return torch.empty(0, dtype=self.dtype).element_size()


@pytest.mark.skipif(native.cuda_available(), reason="checks the error raised without CUDA")
def test_cuda_calls_without_cuda_raise_a_clear_error():
    pytest.importorskip("torch")
    with pytest.raises(cfc.CfcError, match="CUDA"):
        native.cuda_compress(_OnCuda(), _OnCuda(16, "float32"), [16], _OnCuda(1 << 12), _OnCuda(1 << 12), eps=1e-3)


def test_the_cuda_codec_takes_tensors_and_checks_them_first():
    torch = pytest.importorskip("torch")
    s, ws = _OnCuda(), _OnCuda(1 << 12)
    for call, error, match in [
        (lambda: native.cuda_compress(0, _OnCuda(16, "float32"), [16], ws, ws, eps=1e-3), TypeError,
         "torch.cuda.Stream"),
        (lambda: native.cuda_compress(s, 12345, [16], ws, ws, eps=1e-3), TypeError, "data must be a tensor"),
        (lambda: native.cuda_compress(s, torch.zeros(16), [16], ws, ws, eps=1e-3), ValueError,
         "data is on cpu; it must be on cuda:0"),
        (lambda: native.cuda_compress(s, _OnCuda(16, "float32", addr=0), [16], ws, ws, eps=1e-3), ValueError,
         "null data_ptr"),
        (lambda: native.cuda_compress(s, _OnCuda(16, "float32"), [4, 5], ws, ws, eps=1e-3), ValueError,
         "a shape of 20 elements for a tensor of 16"),
        (lambda: native.cuda_compress(s, _OnCuda(16, "float32"), [16], ws, ws, eps=1e-3,
                                      residual=_OnCuda(16, "bfloat16")), ValueError, "float32 of 16"),
        (lambda: native.cuda_decode_sum(s, [_OnCuda(100)], "float32", 1, 1.0, _OnCuda(1, "float32"), ws,
                                        _OnCuda(10)), ValueError, "8 bytes, got 10"),
    ]:
        with pytest.raises(error, match=match):
            call()


def test_the_host_codec_takes_arrays_and_checks_them_first():
    import numpy as np

    x = np.linspace(-1, 1, 1000, dtype=np.float32)
    r = np.zeros_like(x)
    frame = native.compress(x.view(np.uint8), "float32", [1000], eps=1e-3, residual=r.view(np.uint8))
    back = np.frombuffer(native.decompress(frame), dtype=np.float32)
    assert np.abs(back - x).max() <= 1e-3 * (1 + 1e-6) and 0 < np.abs(r).max() <= 1e-3 * (1 + 1e-6)
    assert native.decompress(native.compress_lossless(x, "float32", [1000])) == x.tobytes()
    assert len(native.zstd_compress(np.zeros(4096, dtype=np.uint8))) < 100
    frozen = r.copy()
    frozen.flags.writeable = False
    for call, error, match in [
        (lambda: native.compress(x.ctypes.data, "float32", [1000], eps=1e-3), TypeError, "data must be a numpy array"),
        (lambda: native.compress(x[::2], "float32", [500], eps=1e-3), ValueError, "C-contiguous"),
        (lambda: native.compress(x, "float32", [1000], eps=1e-3, residual=frozen), ValueError, "read-only"),
        (lambda: native.compress(x, "float32", [1000], eps=1e-3, residual=x), ValueError, "overlaps the data"),
        (lambda: native.compress_lossless(b"1234", "float32", [1]), TypeError, "numpy array"),
        (lambda: native.zstd_compress(12345), TypeError, "numpy array"),
    ]:
        with pytest.raises(error, match=match):
            call()
    assert np.all(r == frozen)  # (refused before anything was written)


def test_cuda_sum_checks_its_frame_count_before_touching_a_device():
    pytest.importorskip("torch")
    s, big = _OnCuda(), _OnCuda(1 << 30)
    # sum_offsets gives each frame a row of the grid, which CUDA caps at 65535 rows.
    with pytest.raises(cfc.CfcError, match="at most 65535 frames"):
        native.cuda_sum(s, [_OnCuda(100)] * 65536, "float32", [1], _OnCuda(1 << 20), big)
    with pytest.raises(cfc.CfcError, match="at least one frame"):
        native.cuda_sum(s, [], "float32", [1], _OnCuda(1 << 20), big)
    # Each frame's length must hold its header and a width byte per group of 32 elements.
    with pytest.raises(cfc.FormatError, match="frame"):
        native.cuda_sum(s, [_OnCuda(72 + 31)], "float32", [1000], _OnCuda(1 << 20), big)


def test_cuda_decode_sum_checks_its_arguments_before_touching_a_device():
    pytest.importorskip("torch")
    s, ws = _OnCuda(), _OnCuda(1 << 20)
    with pytest.raises(cfc.CfcError, match="1 to 65535 frames"):
        native.cuda_decode_sum(s, [], "float32", 1, 1.0, _OnCuda(1, "float32"), ws, _OnCuda(8))
    with pytest.raises(TypeError, match="float64"):
        native.cuda_decode_sum(s, [_OnCuda(100)], "float32", 1, 1.0, _OnCuda(1, "float64"), ws, _OnCuda(8))
    with pytest.raises(ValueError, match="10 bytes"):
        native.cuda_decode_sum(s, [_OnCuda(100)], "float32", 1, 1.0, _OnCuda(1 << 20, "float32"), _OnCuda(10),
                               _OnCuda(8))
    with pytest.raises(cfc.FormatError, match="frame"):
        native.cuda_decode_sum(s, [_OnCuda(4096), _OnCuda(72 + 31)], "float32", 1, 1.0, _OnCuda(1000, "float32"), ws,
                               _OnCuda(8))


def _engine(**kw):
    """A one-rank engine (its own listener, its own address)."""
    listener = native.Listener(True)
    opts = dict(bound_kind="rms", bound=0.3, error_feedback=True, algorithm=None, fallback="never", trial_steps=0,
                warmup_steps=0, min_compress_numel=0, timeout=30.0)
    opts.update(kw)
    return native.Engine(listener, [listener.addresses()], 0, 1, bytes(32), 7, **opts)


def test_the_engine_refuses_bad_options_and_jobs_clearly():
    for bad, match in [
        (dict(bound_kind="maybe"), "unknown bound kind"),
        (dict(algorithm="ring"), "unknown algorithm"),
        (dict(fallback="sometimes"), "unknown fallback"),
        (dict(bound=-1.0), "positive"),
        (dict(bound_kind="rel", bound=1.5), "below 1"),
        (dict(fallback="auto", trial_steps=3), "even number"),
        (dict(timeout=0.0), "between 0.1 s"),
        (dict(timeout=1e12), "30 days"),
    ]:
        with pytest.raises((ValueError, cfc.CfcError), match=match):
            _engine(**bad)
    listener = native.Listener(True)  # every rank on this host: loopback only
    assert [a.split(":")[0] for a in listener.addresses()] == ["127.0.0.1"]
    with pytest.raises(cfc.CfcError, match="secret has 16 to 64 bytes"):
        native.Engine(native.Listener(True), [[]], 0, 1, b"short", 7, bound_kind="rms", bound=0.3,
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

    e = _engine(bound_kind="eps", bound=1e-3)
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
