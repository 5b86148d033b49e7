"""cfc.compress / cfc.decompress on CPU tensors and numpy arrays (mirrors src/codec/bounded.rs)."""

import pickle

import numpy as np
import pytest
import torch

import cfc

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def max_err(x, y):
    finite = torch.isfinite(x)
    return (x.double()[finite] - y.double()[finite]).abs().max().item() if finite.any() else 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (1,), (31,), (33,), (7, 5, 3), (1 << 16) + 7])
def test_round_trip_keeps_dtype_shape_and_bound(dtype, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3e-3).to(dtype)
    c = cfc.compress(x, eps=1e-4)
    y = cfc.decompress(c)
    assert y.dtype == dtype and y.shape == x.shape
    assert c.dtype == dtype and c.shape == tuple(x.shape) and c.numel == x.numel()
    assert max_err(x, y) <= c.eps == 1e-4


@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_values_come_back_exactly(dtype):
    x = torch.tensor([0.5, float("nan"), float("inf"), -float("inf"), -0.0, 1e-3] * 11, dtype=dtype)
    for kw in ({"eps": 1e-3}, {"rel": 0.01}, {"bits": 6}):
        y = cfc.decompress(cfc.compress(x, **kw))
        assert torch.isnan(y[1::6]).all()
        assert (y[2::6] == float("inf")).all() and (y[3::6] == -float("inf")).all()


def test_relative_bound_is_relative_to_max_finite_magnitude():
    x = torch.linspace(-2.0, 4.0, 5000)
    x[7] = float("inf")
    c = cfc.compress(x, rel=1e-3)
    assert c.mode == "rel" and c.eps == pytest.approx(4e-3, rel=1e-12)
    assert max_err(x, cfc.decompress(c)) <= c.eps


def test_fixed_rate_size_is_known_in_advance_and_bound_reported():
    x = torch.randn(10_000, 3)
    c = cfc.compress(x, bits=6)
    assert c.nbytes == cfc.fixed_rate_size(x.shape, 6)
    assert c.mode == "bits" and 0 < c.eps <= c.step / 2 * (1 + 1e-6)
    assert max_err(x, cfc.decompress(c)) <= c.eps
    # no size for frames that cannot exist (compress refuses them too)
    for shape, bits, match in (([100], 0, "bits"), ([100], 1, "bits"), ([100], 33, "bits"), ([100], 300, "bits"),
                               ([100], -1, "bits"), ([1] * 9, 8, "dimensions")):
        with pytest.raises(ValueError, match=match):
            cfc.fixed_rate_size(shape, bits)
    assert cfc.fixed_rate_size([1] * 8, 32) > 0


def test_gradient_vectors_ratio_and_bound(grads):
    total_in = sum(g.nbytes for g in grads.values())
    for k, floor, zfloor in ((0.3, 11.5, 15.0), (0.1, 7.5, 9.0)):
        plain = zst = 0
        for g in grads.values():
            eps = k * float(np.sqrt(np.mean(g.astype(np.float64) ** 2)))
            c = cfc.compress(g, eps=eps)
            y = cfc.decompress(c).numpy()
            assert np.abs(y.astype(np.float64) - g.astype(np.float64)).max() <= eps
            plain += c.nbytes
            zst += cfc.compress(g, eps=eps, zstd=True).nbytes
        assert total_in / plain > floor
        assert total_in / zst > zfloor


def test_numpy_input_and_all_frame_holders():
    x = np.random.default_rng(1).normal(size=(64, 65)).astype(np.float32)
    c = cfc.compress(x, eps=1e-2)
    raw = bytes(c)
    holders = [c, raw, bytearray(raw), memoryview(raw), np.frombuffer(raw, np.uint8),
               torch.frombuffer(bytearray(raw), dtype=torch.uint8)]
    for h in holders:
        y = cfc.decompress(h)
        assert isinstance(y, torch.Tensor) and y.shape == (64, 65)
        assert np.abs(y.numpy().astype(np.float64) - x).max() <= 1e-2


def test_pinned_frames_are_frame_holders_everywhere():
    c = cfc.compress(torch.randn(1000), eps=1e-2)
    p = cfc.pin(c)
    assert cfc.frame_info(p) == cfc.frame_info(c)
    assert bytes(cfc.sum_compressed([p, p])) == bytes(cfc.sum_compressed([c, c]))


def test_counts_the_native_arguments_cannot_hold_are_value_errors():
    """Not pyo3's OverflowError: a thread count, dimension or width out of range is a bad value."""
    c = cfc.compress(torch.randn(100), eps=1e-3, threads=2**64)  # no more threads than useful
    assert cfc.decompress(c, threads=2**64).shape == (100,)
    with pytest.raises(ValueError, match="threads"):
        cfc.decompress(c, threads=-1)
    for shape, bits in (([-1], 8), ([2**64], 8), ([4], 2**63)):
        with pytest.raises(ValueError):
            cfc.fixed_rate_size(shape, bits)


def test_device_size_functions_refuse_counts_past_those_they_are_exact_for():
    """Past 2^48 elements (or 8 dimensions, or 65535 parts) the device codec's sizes would wrap
    around, and a buffer allocated from one would be too small: refused, on any machine."""
    from cfc import _native

    assert _native.cuda_compress_capacity(1 << 48, "float32", 1, eps=1e-3) > 4 << 48
    calls = [
        lambda: _native.cuda_compress_capacity(2**64 - 1, "float32", 1, eps=1e-3),
        lambda: _native.cuda_compress_capacity(10, "float32", 2**61, eps=1e-3),
        lambda: _native.cuda_workspace_len(2**64 - 1, compress=True, feedback=True),
        lambda: _native.cuda_lossless_sizes(2**64 - 1, "float64", 1),
        lambda: _native.cuda_sum_sizes(1000, "float32", 1, 2**63),
        lambda: _native.cuda_decode_sum_workspace_len(2**63, 2),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="at most"):
            call()


def test_non_contiguous_and_grad_tensors():
    x = torch.randn(40, 30, requires_grad=True)
    c = cfc.compress(x.t(), eps=1e-3)  # a transposed view
    assert max_err(x.detach().t(), cfc.decompress(c)) <= 1e-3


def test_zstd_stage_shrinks_and_round_trips():
    x = torch.randn(1 << 16) * torch.rand(1 << 16).pow(8)  # heavy-tailed
    a = cfc.compress(x, eps=1e-3)
    b = cfc.compress(x, eps=1e-3, zstd=True)
    assert b.info["zstd"] and b.nbytes < a.nbytes
    assert torch.equal(cfc.decompress(a), cfc.decompress(b))


def test_threads_do_not_change_bytes():
    x = torch.randn(1 << 19)
    frames = {bytes(cfc.compress(x, eps=1e-2, threads=t)) for t in (1, 2, 4)}
    assert len(frames) == 1


def test_sum_of_frames_is_sum_of_values_within_summed_bound():
    torch.manual_seed(3)
    xs = [torch.randn(5000) for _ in range(4)]
    s = cfc.sum_compressed([cfc.compress(x, eps=1e-3) for x in xs])
    assert s.mode == "sum" and s.eps == pytest.approx(4e-3)
    exact = torch.stack([x.double() for x in xs]).sum(0)
    half_ulp = exact.abs().max().item() * 2.0**-24
    assert (cfc.decompress(s).double() - exact).abs().max().item() <= s.eps + half_ulp


def test_sum_rejects_different_steps_and_dtypes():
    x = torch.randn(100)
    with pytest.raises(cfc.CfcError, match="step"):
        cfc.sum_compressed([cfc.compress(x, eps=1e-3), cfc.compress(x, eps=2e-3)])
    with pytest.raises(TypeError, match="dtype"):
        cfc.sum_compressed([cfc.compress(x, eps=1e-3), cfc.compress(x.half(), eps=1e-3)])


def test_compressed_pickles_and_compares():
    c = cfc.compress(torch.randn(100), eps=1e-2)
    d = pickle.loads(pickle.dumps(c))
    assert d == c and d.ratio == c.ratio and d.shape == c.shape


def test_decompress_to_device_cpu():
    c = cfc.compress(torch.randn(10), eps=1e-2)
    assert cfc.decompress(c, device="cpu").device.type == "cpu"


@pytest.mark.parametrize(
    "kw, match",
    [
        ({}, "exactly one"),
        ({"eps": 1e-3, "rel": 1e-3}, "exactly one"),
        ({"eps": 0.0}, "positive"),
        ({"eps": -1.0}, "positive"),
        ({"eps": float("nan")}, "finite"),
        ({"eps": float("inf")}, "finite"),
        ({"rel": 0.0}, "rel"),
        ({"bits": 1}, "bits"),
        ({"bits": 33}, "bits"),
        ({"bits": 300}, "bits"),
        ({"bits": 2**63}, "bits"),  # past the native integer: still the bound's ValueError
        ({"bits": -(2**70)}, "bits"),
        ({"eps": 1e-3, "zstd": 99}, "zstd"),
        ({"eps": 1e-3, "threads": -1}, "threads"),
    ],
)
def test_bad_arguments_raise_value_error(kw, match):
    with pytest.raises(ValueError, match=match):
        cfc.compress(torch.randn(10), **kw)


@pytest.mark.parametrize("x", [torch.arange(10), torch.randn(3).double(), np.arange(4), [1.0, 2.0]])
def test_bad_types_raise_type_error(x):
    with pytest.raises(TypeError):
        cfc.compress(x, eps=1e-3)


@pytest.mark.parametrize(
    "kw, match",
    [({"eps": True}, "eps must be a number"), ({"rel": "1e-3"}, "rel must be a number"),
     ({"bits": 4.0}, "bits must be an integer"), ({"bits": True}, "bits must be an integer")],
)
def test_bounds_of_the_wrong_type_raise_type_error(kw, match):
    # eps=True would otherwise be taken as 1.0, and bits=True as 1
    with pytest.raises(TypeError, match=match):
        cfc.compress(torch.randn(10), **kw)
    assert cfc.compress(torch.randn(10), eps=np.float32(1e-3), bits=None).eps == pytest.approx(1e-3)
    assert cfc.compress(torch.randn(10), bits=np.int64(8)).mode == "bits"
    # 0-d tensors and arrays of numbers are numbers
    assert cfc.compress(torch.randn(10), eps=np.array(1e-3)).eps == pytest.approx(1e-3)
    assert cfc.compress(torch.randn(10), eps=torch.tensor(1e-3, dtype=torch.float64)).eps == pytest.approx(1e-3)
    assert cfc.compress(torch.randn(10), bits=torch.tensor(8)).mode == "bits"
    for bad in ({"eps": torch.tensor(True)}, {"eps": torch.ones(2)}, {"bits": torch.tensor(8.0)}):
        with pytest.raises(TypeError):
            cfc.compress(torch.randn(10), **bad)


def test_a_negated_view_is_compressed_as_the_values_it_shows():
    """A lazily negated view (as the imaginary part of a conjugate is): where its memory is
    contiguous, it holds the opposite values, which a codec reading memory would store."""
    x = torch.randn(1000)
    for neg in (torch._neg_view(x), torch.tensor([1 + 2j]).conj().imag):
        assert neg.is_neg() and neg.is_contiguous()
        shown = neg.resolve_neg()
        assert max_err(shown, cfc.decompress(cfc.compress(neg, eps=1e-3))) <= 1e-3
        assert torch.equal(cfc.decompress(cfc.compress(neg, lossless=True)), shown)
    with pytest.raises(ValueError, match="negated view"):
        cfc.compress(torch.randn(1000), eps=1e-3, residual=torch._neg_view(torch.zeros(1000)))


def test_frame_info_fields():
    info = cfc.frame_info(cfc.compress(torch.randn(4, 8), eps=1e-2))
    assert info["dtype"] == "float32" and info["shape"] == [4, 8] and info["numel"] == 32
    assert info["version"] == cfc.FORMAT_VERSION and info["codec"] in ("quantized", "raw")


@pytest.mark.parametrize("dtype", DTYPES)
def test_error_feedback_running_sum_tracks_the_inputs(dtype):
    torch.manual_seed(5)
    eps = 2e-4
    residual = torch.zeros(3000)
    sent = torch.zeros(3000, dtype=torch.float64)
    truth = torch.zeros(3000, dtype=torch.float64)
    for _ in range(60):
        x = (torch.rand(3000) * 2e-3 - 1e-3).to(dtype)
        sent += cfc.decompress(cfc.compress(x, eps=eps, residual=residual)).double()
        truth += x.double()
    # sum(sent) = sum(x) - residual: one bound plus the dtype's rounding of x + r.
    slack = eps + 60 * float(torch.finfo(dtype).eps) * 2e-3 if dtype != torch.float32 else eps * 1.01
    assert (sent - truth).abs().max().item() <= slack


def test_error_feedback_argument_checks():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="holds 9"):
        cfc.compress(x, eps=1e-3, residual=torch.zeros(9))
    with pytest.raises(TypeError, match="float32"):
        cfc.compress(x, eps=1e-3, residual=torch.zeros(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        cfc.compress(x, eps=1e-3, residual=torch.zeros(20)[::2])
    # a read-only array (here over an immutable bytes object) is not written into
    frozen = bytes(40)
    with pytest.raises(ValueError, match="read-only"):
        cfc.compress(x.numpy(), eps=1e-3, residual=np.frombuffer(frozen, np.float32))
    assert frozen == bytes(40)
    # a misaligned array is named as such (it was reported as a size that is not whole elements)
    r = np.frombuffer(bytearray(41), np.float32, offset=1)
    with pytest.raises(ValueError, match="aligned"):
        cfc.compress(x.numpy(), eps=1e-3, residual=r)


def test_a_residual_that_shares_the_inputs_memory_is_refused():
    """The residual is written while the input is read: memory both hold would be read after
    it was written (and the native call's input and output would alias). Refused before any
    work, on numpy and torch alike; neighbours that share no byte are fine."""
    buf = torch.randn(200)
    for x, r in ((buf[:100], buf[:100]), (buf[:100], buf[50:150]), (buf[50:150], buf[:100])):
        before = buf.clone()
        for xx, rr in ((x, r), (x.numpy(), r.numpy())):
            with pytest.raises(ValueError, match="shares memory"):
                cfc.compress(xx, eps=1e-3, residual=rr)
        assert torch.equal(buf, before)
    want = cfc.compress(buf[:100].clone(), eps=1e-3, residual=buf[100:].clone())
    assert bytes(cfc.compress(buf[:100], eps=1e-3, residual=buf[100:])) == bytes(want)


def test_a_residual_inside_a_strided_inputs_memory_is_refused():
    """A strided (or lazily negated) input is read through a copy, so the native call never
    sees the overlap; the residual's update would still rewrite the caller's input. Refused
    from the memory between the input's first and last elements, negative strides too."""
    buf = torch.randn(300)
    z = torch.view_as_complex(buf[:200].view(100, 2))
    strided = (buf[:200:2], buf[:200].view(20, 10).t(), buf.numpy()[199::-2], z.conj().imag)
    for x in strided:
        n = x.size if isinstance(x, np.ndarray) else x.numel()
        before = buf.clone()
        pairs = [(x, buf[1:1 + n].numpy())]
        if isinstance(x, torch.Tensor):
            pairs.append((x, buf[1:1 + n]))
            if not x.is_neg():  # (numpy has no negated views)
                pairs.append((x.numpy(), buf[1:1 + n].numpy()))
        for xx, rr in pairs:
            with pytest.raises(ValueError, match="shares memory"):
                cfc.compress(xx, eps=1e-3, residual=rr)
        assert torch.equal(buf, before)
    # past the last element there is no overlap
    x = buf[:199:2]
    want = cfc.compress(x.clone(), eps=1e-3, residual=buf[199:299].clone())
    assert bytes(cfc.compress(x, eps=1e-3, residual=buf[199:299])) == bytes(want)


# (torch warns that these layouts are in beta or prototype: this test makes them on purpose)
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype:UserWarning")
@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 4).to_sparse(),
    lambda: torch.randn(4, 4).to_sparse_csr(),
    lambda: torch.nested.nested_tensor([torch.randn(3), torch.randn(5)]),
    lambda: torch.empty(16, device="meta"),
])
def test_tensors_without_plain_memory_are_type_errors(make):
    x = make()
    for kw in ({"eps": 1e-3}, {"lossless": True}):
        with pytest.raises(TypeError, match="dense tensors"):
            cfc.compress(x, **kw)


def test_zstd_levels_are_checked_whatever_the_path():
    for bad in (0, 23, -1, "1"):
        with pytest.raises(ValueError, match="zstd"):
            cfc.compress(torch.randn(10), eps=1e-3, zstd=bad)
        with pytest.raises(ValueError, match="zstd"):
            cfc.sum_compressed([cfc.compress(torch.randn(10), eps=1e-3)], zstd=bad)


def test_a_one_element_view_of_any_stride():
    """One element is contiguous whatever its stride; the codec reads it, and a residual of that
    kind is updated in place."""
    x = torch.randn(10)[::3][:1]
    assert x.is_contiguous() and x.stride() == (3,)
    assert torch.equal(cfc.decompress(cfc.compress(x, lossless=True)), x)
    assert max_err(x, cfc.decompress(cfc.compress(x, eps=1e-3))) <= 1e-3
    base = torch.full((10,), 0.5)
    c = cfc.compress(torch.tensor([0.125]), eps=1e-2, residual=base[::3][:1])
    # One element goes as a raw frame: x + residual exactly, and nothing left over.
    assert float(cfc.decompress(c)) == 0.625 and float(base[0]) == 0.0 and float(base[1]) == 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rice_frames_decode_like_bit_planes_in_fewer_bytes(dtype, grads):
    x = torch.from_numpy(grads["lm_ffn_block5_2M"][:300_000].astype(np.float32)).to(dtype)
    eps = 0.3 * x.double().pow(2).mean().sqrt().item()
    x[7] = float("nan")
    planes = cfc.compress(x, eps=eps)
    rice = cfc.compress(x, eps=eps, coder="rice")
    assert cfc.frame_info(rice)["codec"] == "rice" and cfc.frame_info(planes)["codec"] == "quantized"
    assert torch.equal(cfc.decompress(rice).view(torch.int16 if dtype != torch.float32 else torch.int32),
                       cfc.decompress(planes).view(torch.int16 if dtype != torch.float32 else torch.int32))
    assert rice.nbytes < 0.9 * planes.nbytes
    both = cfc.decompress(cfc.sum_compressed([rice, rice]))
    assert torch.equal(both.nan_to_num(), cfc.decompress(cfc.sum_compressed([planes, planes])).nan_to_num())


def test_rice_argument_checks():
    x = torch.randn(100)
    with pytest.raises(ValueError, match="coder must be"):
        cfc.compress(x, eps=0.1, coder="huffman")
    with pytest.raises(ValueError, match="bits= and lossless="):
        cfc.compress(x, bits=8, coder="rice")
    with pytest.raises(ValueError, match="bits= and lossless="):
        cfc.compress(x, lossless=True, coder="rice")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("coder", ["planes", "rice"])
def test_block_scales_keep_each_blocks_precision(dtype, coder):
    """rms= with block=: every block within rms x its own RMS (rounded down to a power of two);
    one bound for the whole tensor rounds the quiet blocks to zero."""
    g = torch.Generator().manual_seed(3)
    decades = torch.tensor([10.0 ** -((i // 1000) % 5) for i in range(5000)])
    x = (torch.randn(5000, generator=g) * decades).to(dtype)
    c = cfc.compress(x, rms=0.3, block=128, coder=coder)
    info = cfc.frame_info(c)
    assert info["block"] == 128 and info["mode"] == "rms" and c.mode == "rms"
    y = cfc.decompress(c).double()
    xd = x.double()
    for lo in range(0, 5000, 128):
        blk = xd[lo:lo + 128]
        rms = blk.pow(2).mean().sqrt().item()
        assert (y[lo:lo + 128] - blk).abs().max().item() <= 0.3 * rms * (1 + 1e-9)
    whole = cfc.decompress(cfc.compress(x, eps=0.3 * xd.pow(2).mean().sqrt().item())).double()
    assert torch.all(whole[4000:] == 0) and torch.any(y[4000:] != 0)
    # error feedback with block scales: what is sent plus the residual is what was given
    r = torch.zeros(5000)
    sent = torch.zeros(5000, dtype=torch.float64)
    for _ in range(5):
        sent += cfc.decompress(cfc.compress(x, rms=0.3, block=128, coder=coder, residual=r)).double()
    assert torch.allclose(sent + r.double(), 5 * xd, rtol=1e-3, atol=1e-6)
    # frames with the same scales add exactly; frame_info of a frame without scales says 0
    assert cfc.frame_info(cfc.sum_compressed([c, c]))["block"] == 128
    assert cfc.frame_info(cfc.compress(x, eps=0.1))["block"] == 0


def test_block_scale_argument_checks():
    x = torch.randn(100)
    for bad, match in [(dict(rms=0.3, block=100), "power of two"), (dict(rms=0.3, block=16), "power of two"),
                       (dict(eps=0.1, block=64), "block= goes with rms="), (dict(rms=1.5), "below 1"),
                       (dict(rms=0.3, eps=0.1), "exactly one")]:
        with pytest.raises(ValueError, match=match):
            cfc.compress(x, **bad)
    with pytest.raises(ValueError, match="lossless"):
        cfc.compress(x, rms=0.3, lossless=True)
