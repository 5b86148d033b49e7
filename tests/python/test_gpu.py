"""The CUDA codec writes the CPU reference's bytes and decodes to the same values (run with
`pytest -m gpu` on a machine with a GPU; skipped elsewhere)."""

import numpy as np
import pytest
import torch

import cfc

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
BOUNDS = [{"eps": 1e-3}, {"eps": 0.05}, {"rel": 1e-2}, {"bits": 3}, {"bits": 8}, {"bits": 32}]
LENGTHS = [0, 1, 31, 32, 33, 1000, (1 << 20) + 7]


def awkward(n, dtype, seed=0):
    """Gaussian and heavy-tailed values with NaN, infinities, -0.0, tiny and huge values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(6) * 0.1
    if n >= 12:
        finfo = torch.finfo(dtype)
        specials = [float("nan"), float("inf"), -float("inf"), -0.0, finfo.tiny / 4,
                    finfo.max, -finfo.max / 3, 1e-30, 0.0, 1.0, -1.0, finfo.eps]
        idx = torch.randperm(n, generator=g)[: len(specials)]
        x[idx] = torch.tensor(specials)
    return x.to(dtype)


def same_bits(a, b):
    return torch.equal(a.cpu().view(INT_VIEW[a.dtype]), b.cpu().view(INT_VIEW[b.dtype]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bound", BOUNDS, ids=lambda b: "-".join(f"{k}{v}" for k, v in b.items()))
@pytest.mark.parametrize("n", LENGTHS)
def test_gpu_frames_are_the_cpu_reference_bytes(dtype, bound, n):
    x = awkward(n, dtype, seed=n)
    want = bytes(cfc.compress(x, **bound))
    c = cfc.compress(x.cuda(), **bound)
    assert isinstance(c, cfc.CudaCompressed)
    got = bytes(c)
    assert got == want
    ref = cfc.decompress(want)
    assert same_bits(cfc.decompress(c), ref)                 # device frame, decoded on the GPU
    assert same_bits(cfc.decompress(want, device="cuda"), ref)  # host frame, decoded on the GPU


@pytest.mark.parametrize("k", [0.3, 0.1, 0.01])
def test_gpu_real_gradients_match_cpu_and_bound(grads, k):
    for name, g in grads.items():
        x = torch.from_numpy(g)
        eps = k * float(np.sqrt(np.mean(g.astype(np.float64) ** 2)))
        c = cfc.compress(x.cuda(), eps=eps)
        assert bytes(c) == bytes(cfc.compress(x, eps=eps)), name
        y = cfc.decompress(c)
        assert (y.double() - x.cuda().double()).abs().max().item() <= eps


def test_gpu_compresses_a_negated_view_as_the_values_it_shows():
    """A lazily negated view (as the imaginary part of a conjugate is) whose memory is
    contiguous holds the opposite values, which the CUDA codec (reading memory by address)
    would otherwise store."""
    x = torch.randn(5000, device="cuda")
    neg = torch._neg_view(x)
    assert neg.is_neg() and neg.is_contiguous()
    c = cfc.compress(neg, eps=1e-3)
    assert isinstance(c, cfc.CudaCompressed)
    assert bytes(c) == bytes(cfc.compress(-x.cpu(), eps=1e-3))
    assert torch.equal(cfc.decompress(cfc.compress(neg, lossless=True)), -x)


def test_gpu_shapes_survive():
    x = torch.randn(3, 5, 7, device="cuda")
    y = cfc.decompress(cfc.compress(x, eps=1e-2))
    assert y.shape == x.shape and y.device == x.device


def test_gpu_compress_returns_before_the_gpu_finishes():
    x = torch.randn(1 << 20, device="cuda")
    torch.cuda._sleep(200_000_000)  # keeps the stream busy for a while
    c = cfc.compress(x, eps=1e-3)
    assert not c._event.query(), "compress waited for the GPU"
    c.synchronize()
    assert c._event.query()


def test_gpu_hostile_frames_rejected_before_the_gpu_reads_them():
    frame = bytearray(bytes(cfc.compress(torch.randn(5000), eps=1e-3)))
    assert frame[72] <= 64  # a 1-D header is 72 bytes: the first group's width byte follows
    frame[72] = 200  # far over 64
    with pytest.raises(cfc.FormatError, match="bit width 200"):
        cfc.decompress(bytes(frame), device="cuda")
    with pytest.raises(cfc.FormatError, match="body is 28 bytes"):
        cfc.decompress(bytes(frame)[:100], device="cuda")


def test_gpu_invalid_arguments():
    with pytest.raises(ValueError):
        cfc.compress(torch.randn(10, device="cuda"), eps=-1.0)
    with pytest.raises(ValueError):
        cfc.compress(torch.randn(10, device="cuda"), bits=40)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bound", [{"eps": 1e-3}, {"eps": 1e-9}, {"rel": 1e-2}, {"bits": 4}],
                         ids=["eps", "eps-tiny-raw", "rel", "bits"])
@pytest.mark.parametrize("n", [1, 33, (1 << 18) + 5])
def test_gpu_error_feedback_matches_cpu_bits(dtype, bound, n):
    x = awkward(n, dtype, seed=7 + n)
    r0 = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3
    r_cpu, r_gpu = r0.clone(), r0.cuda()
    want = bytes(cfc.compress(x, residual=r_cpu, **bound))
    got = bytes(cfc.compress(x.cuda(), residual=r_gpu, **bound))
    assert got == want
    assert torch.equal(r_gpu.cpu().view(torch.int32), r_cpu.view(torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_raw_frame_with_feedback_rebuilds_every_compensated_value(dtype):
    """With error feedback the encoder writes the residuals a quantized frame leaves; a frame
    that then falls back to raw needs each compensated value c again, and the packer rebuilds
    it as decoded + residual where that is exact. Where it is not, here c = -0.0 (x and r both
    -0.0: decoded +0.0 plus residual -0.0 gives +0.0), in a group with no exception, the encoder
    must have kept c, or the raw bytes lose the sign."""
    n = 64 * 32
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(n, generator=g) - 0.5).to(torch.float64)
    x[n // 2:] = 1e4  # exceptions everywhere in the second half: the frame is written raw
    zeros = torch.tensor([5, 37, 100, 101, 700])
    x[zeros] = -0.0
    x = x.to(dtype)
    r0 = torch.randn(n, generator=g) * 1e-3
    r0[zeros] = -0.0
    eps = 2.0**-32
    r_cpu, r_gpu = r0.clone(), r0.cuda()
    want = bytes(cfc.compress(x, eps=eps, residual=r_cpu))
    assert cfc.frame_info(want)["codec"] == "raw"
    got = bytes(cfc.compress(x.cuda(), eps=eps, residual=r_gpu))
    assert got == want
    assert torch.equal(r_gpu.cpu().view(torch.int32), r_cpu.view(torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "feedback"])
@pytest.mark.parametrize("offset", [1, 3])
def test_gpu_views_at_any_alignment_match_cpu(dtype, feedback, offset):
    # The encoder stages whole tiles with 16-byte loads only where the input (and residual)
    # pointers allow it; views that start off a 16-byte boundary take the other path.
    n = (1 << 16) + 5
    x = awkward(n + offset, dtype, seed=offset).cuda()[offset:]
    assert x.data_ptr() % 16 != 0
    on_cpu, on_gpu = {"eps": 1e-3}, {"eps": 1e-3}
    if feedback:
        r0 = torch.randn(n + offset, generator=torch.Generator().manual_seed(offset)) * 1e-3
        on_cpu["residual"], on_gpu["residual"] = r0[offset:].clone(), r0.cuda()[offset:]
        assert on_gpu["residual"].data_ptr() % 16 != 0
    want = bytes(cfc.compress(x.cpu(), **on_cpu))
    got = bytes(cfc.compress(x, **on_gpu))
    assert got == want
    if feedback:
        assert torch.equal(on_gpu["residual"].cpu().view(torch.int32), on_cpu["residual"].view(torch.int32))


def near_boundaries(n, dtype, eps, seed):
    """Values that sit where a float32 quantize rule could round differently from the f64
    reference: a few ulps around half-integer multiples of the step (code ties), around codes
    plus or minus eps (the bound test), codes near 2^19 and beyond, and random bits."""
    rng = np.random.default_rng(seed)
    step = 2.0 * eps
    kind = rng.integers(0, 5, n)
    k = rng.integers(-(1 << 12), 1 << 12, n).astype(np.float64)
    big = rng.integers(1 << 18, 1 << 21, n).astype(np.float64) * rng.choice([-1.0, 1.0], n)
    v = np.select(
        [kind == 0, kind == 1, kind == 2, kind == 3],
        [(k + 0.5) * step, k * step + eps, k * step - eps, (big + 0.5) * step],
        rng.standard_normal(n) * step * 8,
    ).astype(np.float32)
    nudged = v.view(np.int32) + rng.integers(-4, 5, n).astype(np.int32)
    v = np.where(rng.random(n) < 0.02, rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.int32),
                 nudged).view(np.float32)
    return torch.from_numpy(v.copy()).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
# A generic f64 eps, one that makes the step a float32, a power of two, and two outside the
# range where the encoder uses its float32 route at all.
@pytest.mark.parametrize("eps", [0.1 * 0.7071067811865476, float(np.float32(0.0371)), 2.0**-7, 1e-35, 1e35],
                         ids=["f64", "f32", "pow2", "tiny", "huge"])
@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "feedback"])
def test_gpu_values_at_rounding_boundaries_match_cpu(dtype, eps, feedback):
    n = (1 << 17) + 3
    x = near_boundaries(n, dtype, eps, seed=len(str(eps)))
    on_cpu, on_gpu = {"eps": eps}, {"eps": eps}
    if feedback:
        r0 = torch.randn(n, generator=torch.Generator().manual_seed(5)) * (eps / 4)
        on_cpu["residual"], on_gpu["residual"] = r0.clone(), r0.cuda()
    want = bytes(cfc.compress(x, **on_cpu))
    got = bytes(cfc.compress(x.cuda(), **on_gpu))
    assert got == want
    if feedback:
        assert torch.equal(on_gpu["residual"].cpu().view(torch.int32), on_cpu["residual"].view(torch.int32))


def test_cuda_error_feedback_running_sum():
    eps = 2e-4
    residual = torch.zeros(1 << 16, device="cuda")
    sent = torch.zeros(1 << 16, dtype=torch.float64, device="cuda")
    truth = torch.zeros_like(sent)
    for _ in range(40):
        x = torch.rand(1 << 16, device="cuda") * 2e-3 - 1e-3
        sent += cfc.decompress(cfc.compress(x, eps=eps, residual=residual)).double()
        truth += x.double()
    assert (sent - truth).abs().max().item() <= eps * 1.01


def test_gpu_decode_on_another_stream_waits_for_compression():
    x = torch.randn(1 << 22, device="cuda")
    want = cfc.decompress(cfc.compress(x, eps=1e-3))
    side = torch.cuda.Stream()
    for _ in range(5):
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # the side stream is still busy when we decode
            c = cfc.compress(x, eps=1e-3)
        assert torch.equal(cfc.decompress(c), want)


def test_a_device_number_that_does_not_exist_is_unsupported_and_harms_nothing():
    native = cfc._native
    for bad in (torch.cuda.device_count(), 2**40, 2**64 - 1):  # (2**64 - 1 + 1 wraps to 0)
        assert not native.cuda_supported(bad)
    assert native.cuda_supported(0)  # the device cache still works
    x = torch.randn(1000, device="cuda")
    assert bytes(cfc.compress(x, eps=1e-3)) == bytes(cfc.compress(x.cpu(), eps=1e-3))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_compress_leaves_torchs_current_device_alone():
    torch.cuda.set_device(0)
    x = torch.randn(1000, device="cuda:1")
    c = cfc.compress(x, eps=1e-3)
    assert torch.cuda.current_device() == 0
    y = cfc.decompress(c)
    assert y.device == x.device and torch.cuda.current_device() == 0
    assert bytes(c) == bytes(cfc.compress(x.cpu(), eps=1e-3))


def test_gpu_unusable_rel_bound_is_reported_and_leaves_the_residual():
    x = torch.full((100,), 1e-30, device="cuda")
    r = torch.full((100,), 1e-31, device="cuda")
    before = r.clone()
    with pytest.raises(ValueError):
        cfc.compress(x.cpu(), rel=1e-300, residual=r.cpu())
    c = cfc.compress(x, rel=1e-300, residual=r)
    with pytest.raises(ValueError, match="rel"):
        c.synchronize()
    assert torch.equal(r, before)


def test_gpu_sums_and_decodings_refuse_parts_that_failed_before_anyone_waited():
    """A compression with an unusable rel bound, or a sum of frames of different steps, fails
    on the device; its error shows when it is waited for. A sum of it queued before that wait
    (a tree of sums, which waits nowhere) must fail too, as the CPU's would, not add a frame
    coded with a made-up step: the failed frame's magic is broken on the device, so every
    reader there refuses it."""
    from cfc._gpu import _decode_status_error, _decode_sum_cuda

    x, y = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
    good = cfc.compress(x, eps=1e-3)
    bad_bound = cfc.compress(y, rel=1e-320)
    bad_sum = cfc.sum_compressed([cfc.compress(x, eps=1e-3), cfc.compress(y, eps=2e-3)])
    for name, bad in (("rel", bad_bound), ("sum", bad_sum)):
        for parts in ([good, bad], [bad]):
            s = cfc.sum_compressed(parts)
            with pytest.raises(cfc.CfcError, match=f"frame {len(parts) - 1} of the sum"):
                s.synchronize()
        out = torch.full((1000,), 7.0, device="cuda")
        status = _decode_sum_cuda([good._out, bad._out], 1000, "float32", out)
        assert _decode_status_error(status) is not None, name
        assert torch.equal(out, torch.full_like(out, 7.0)), name
    with pytest.raises(ValueError, match="rel"):
        bad_bound.synchronize()
    with pytest.raises(cfc.CfcError, match="steps"):
        bad_sum.synchronize()


def test_gpu_zstd_path_checks_as_the_others_do():
    """A CUDA tensor takes the same arguments on every path: zstd level 0 is refused as on the
    CPU (it went to the GPU codec, as False does), a residual that requires grad is updated on
    the zstd path as on the two others (it raised there, after compressing), and a residual
    that shares the input's memory is refused."""
    x = torch.randn(1000, device="cuda")
    with pytest.raises(ValueError, match="zstd"):
        cfc.compress(x, eps=1e-3, zstd=0)
    r = {p: torch.zeros(1000, device="cuda", requires_grad=True) for p in ("gpu", "zstd")}
    cfc.compress(x, eps=1e-3, residual=r["gpu"]).synchronize()
    cfc.compress(x, eps=1e-3, residual=r["zstd"], zstd=True)
    assert torch.equal(r["gpu"], r["zstd"]) and r["gpu"].abs().max() > 0
    buf = torch.randn(2000, device="cuda")
    for zstd in (False, True):
        with pytest.raises(ValueError, match="shares memory"):
            cfc.compress(buf[:1000], eps=1e-3, residual=buf[500:1500], zstd=zstd)
        before = buf.clone()
        with pytest.raises(ValueError, match="shares memory"):  # a strided input's span
            cfc.compress(buf[:2000:2], eps=1e-3, residual=buf[1:1001], zstd=zstd)
        assert torch.equal(buf, before)


def test_gpu_numpy_residual_for_a_cuda_tensor_is_refused():
    with pytest.raises(TypeError, match="residual"):
        cfc.compress(torch.randn(10, device="cuda"), eps=1e-3, residual=np.zeros(10, np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_zstd_frames_of_a_cuda_tensor_take_its_cuda_residual(dtype):
    """zstd runs on the CPU: the CUDA tensor and its CUDA residual go through host copies, and
    the frame and the updated residual are the CPU codec's, step after step."""
    r_cpu = torch.zeros(5000)
    r_gpu = torch.zeros(5000, device="cuda")
    for step in range(3):
        x = awkward(5000, dtype, seed=step)
        want = bytes(cfc.compress(x, eps=1e-3, zstd=True, residual=r_cpu))
        got = cfc.compress(x.cuda(), eps=1e-3, zstd=True, residual=r_gpu)
        assert isinstance(got, cfc.Compressed) and bytes(got) == want
        assert r_gpu.device.type == "cuda" and torch.equal(r_gpu.cpu(), r_cpu)
    assert r_cpu.abs().max() > 0  # the residual did carry something


def test_gpu_frames_pin_and_give_their_bytes_to_frame_info():
    x = awkward(70000, torch.float32)
    for c in (cfc.compress(x.cuda(), eps=1e-3), cfc.compress(x.cuda(), lossless=True)):
        assert isinstance(c, cfc.CudaCompressed)
        p = cfc.pin(c)
        assert bytes(p) == bytes(c) and cfc.frame_info(c)["nbytes"] == c.nbytes
        assert same_bits(cfc.decompress(p, device="cuda"), cfc.decompress(bytes(c)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "feedback"])
@pytest.mark.parametrize("n", [33, 4097, (1 << 18) + 5])
def test_gpu_compress_writes_nothing_past_the_capacity_or_workspace(dtype, feedback, n):
    """Frames whose quantized body would outgrow the raw bytes (a tiny eps) are written raw: the
    planes that do not fit must not be written past the output's capacity either. Guard bytes
    after the output and the workspace (and before them) must come back untouched."""
    from cfc import _native

    guard = 4096
    x = awkward(n, dtype, seed=n).cuda()
    bound = {"eps": 1e-9}
    cap = _native.cuda_compress_capacity(n, str(dtype).split(".")[1], 1, **bound)
    ws_len = _native.cuda_workspace_len(n, compress=True, feedback=feedback)
    out = torch.full((guard + cap + guard,), 0xAB, dtype=torch.uint8, device="cuda")
    ws = torch.full((guard + ws_len + guard,), 0xCD, dtype=torch.uint8, device="cuda")
    r = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3).cuda() if feedback else None
    stream = torch.cuda.current_stream()
    _native.cuda_compress(stream, x, [n], out[guard : guard + cap], ws[guard : guard + ws_len], **bound, residual=r)
    torch.cuda.synchronize()
    for buf, fill, length in ((out, 0xAB, cap), (ws, 0xCD, ws_len)):
        assert bool((buf[:guard] == fill).all()), "written before the buffer"
        assert bool((buf[guard + length:] == fill).all()), "written past the buffer"
    size = int(ws[guard + _native.CUDA_FRAME_SIZE_OFFSET : guard + _native.CUDA_FRAME_SIZE_OFFSET + 8]
               .cpu().numpy().view(np.int64)[0])
    rc = None if r is None else (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3)
    want = bytes(cfc.compress(x.cpu(), **bound, **({} if rc is None else {"residual": rc})))
    assert bytes(out[guard : guard + size].cpu().numpy()) == want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [1e-2, 1e-12], ids=["quantized", "raw"])
@pytest.mark.parametrize("n", [33, 4097, (1 << 18) + 5, (24 << 20) + 7])
def test_gpu_compress_writes_its_size_and_raises_the_running_maximum(dtype, eps, n):
    """The compressor's last kernel also writes the frame's size where it is asked to (the head
    of an exchange's row) and raises a running maximum by the largest finite |residual| it
    leaves (cfc_hook's max_error), where a copy and a kernel of their own did before: for
    quantized frames and raw ones (whose residuals that kernel rewrites), in both geometries of
    the encoder (the largest n takes 4 chunks per warp). A maximum already higher stays."""
    from cfc import _native

    name = str(dtype).split(".")[1]
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 0.01).to(dtype).cuda()
    r = (torch.randn(n, generator=g) * 1e-3).cuda()
    cap = _native.cuda_compress_capacity(n, name, 1, eps=eps)
    ws_len = _native.cuda_workspace_len(n, compress=True, feedback=True)
    out = torch.empty(cap, dtype=torch.uint8, device="cuda")
    ws = torch.empty(ws_len, dtype=torch.uint8, device="cuda")
    size = torch.full((2,), -1, dtype=torch.int64, device="cuda")  # [1] stays: nothing past 8 bytes
    most = torch.zeros(2, dtype=torch.float64, device="cuda")
    most[1] = 1e9  # already higher
    stream = torch.cuda.current_stream()
    for target in (most, most[1:]):
        r_step = r.clone()
        _native.cuda_compress(stream, x, [n], out, ws, eps=eps, residual=r_step, size=size, max_error=target)
    torch.cuda.synchronize()
    at = _native.CUDA_FRAME_SIZE_OFFSET
    in_ws = int(ws[at : at + 8].cpu().numpy().view(np.int64)[0])
    assert size.tolist() == [in_ws, -1]
    raw = int(out[5].item()) == 1  # the header's codec byte: 1 raw, 0 quantized
    assert raw == (eps < 1e-6), "the test's bounds no longer give the frames it means to cover"
    left = r_step.double().abs()
    want = float(left[torch.isfinite(left)].max())
    assert want > 0 or (raw and dtype == torch.float32)  # float32 sent raw is sent exactly
    assert most.tolist() == [want, 1e9]


class _Misplaced:
    """A CUDA tensor's stand-in at an address off its alignment (torch makes none): what the
    binding passes on, for the core's checks."""

    def __init__(self, t, offset):
        self.t, self.offset = t, offset
        self.dtype, self.device = t.dtype, t.device

    def is_contiguous(self):
        return True

    def data_ptr(self):
        return self.t.data_ptr() + self.offset

    def numel(self):
        return self.t.numel() - 1

    def element_size(self):
        return self.t.element_size()


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_compress_refuses_memory_off_its_alignment(dtype):
    """A workspace, residual or input off its alignment would fault on the device: refused
    before anything is queued."""
    from cfc import _native

    name, n = str(dtype).split(".")[1], 5000
    x = (torch.randn(n, generator=torch.Generator().manual_seed(11)) * 0.01).to(dtype).cuda()
    cap = _native.cuda_compress_capacity(n, name, 1, eps=1e-3)
    ws_len = _native.cuda_workspace_len(n, compress=True, feedback=True)
    stream = torch.cuda.current_stream()
    out = torch.zeros(cap, dtype=torch.uint8, device="cuda")
    ws = torch.empty(ws_len, dtype=torch.uint8, device="cuda")
    wide = torch.empty(ws_len + 16, dtype=torch.uint8, device="cuda")
    rr = torch.zeros(n + 1, device="cuda")
    xx = torch.zeros(n + 1, dtype=dtype, device="cuda")
    r = torch.zeros(n, device="cuda")
    for where, (xp, wp, rp) in {
        "workspace's": (x, wide[8 : 8 + ws_len], r),
        "residual's": (x, ws, _Misplaced(rr, 2)),
        "input's": (_Misplaced(xx, 1), ws, r),
    }.items():
        with pytest.raises(Exception, match=f"{where} address .* is not"):
            _native.cuda_compress(stream, xp, [n], out, wp, eps=1e-3, residual=rp)
    torch.cuda.synchronize()
    assert not bool(out.any()), "nothing was queued"


def test_gpu_decoded_sum_reads_the_lengths_before_its_frames_where_asked():
    """With ``lens_before`` the decoder takes each frame's length from the u64 that many bytes
    before it (a row's head in cfc's exchanges), where a recorded CUDA graph finds each step's
    lengths (the smaller of the two: what is passed is the room each frame lies in). With the
    heads holding the lengths passed, or more, the same bits as without heads; with a head too
    short for its frame's body, the device's check fails that frame and nothing is written,
    which shows the heads are what it read."""
    n = 5000
    cs = [cfc.compress(awkward(n, torch.float32, seed=i).cuda(), eps=1e-3) for i in range(3)]
    lens = [c._out.numel() for c in cs]
    row = 16 + -(-max(lens) // 16) * 16
    rows = torch.zeros(len(cs) * row, dtype=torch.uint8, device="cuda")
    for j, c in enumerate(cs):
        rows[j * row : j * row + 8].view(torch.int64).fill_(lens[j])
        rows[j * row + 16 : j * row + 16 + lens[j]] = c._out
    frames = [rows[j * row + 16 : j * row + 16 + lens[j]] for j in range(len(cs))]
    ws_len = cfc._native.cuda_decode_sum_workspace_len(n, len(cs))
    stream = torch.cuda.current_stream()

    def decode(before):
        out = torch.full((n,), 7.0, device="cuda")
        ws = torch.empty(ws_len, dtype=torch.uint8, device="cuda")
        status = torch.zeros(2, dtype=torch.int32, device="cuda")
        cfc._native.cuda_decode_sum(stream, frames, "float32", 1, 0.5, out, ws, status, lens_before=before)
        torch.cuda.synchronize()
        return out, status.tolist()

    passed, ok = decode(0)
    assert ok == [0, 0]
    assert same_values(passed, _decoded_sum_reference(cs, 0.5, torch.float32))
    read, ok = decode(16)
    assert ok == [0, 0] and torch.equal(read.view(torch.int32), passed.view(torch.int32))
    rows[row : row + 8].view(torch.int64).fill_(1 << 40)  # frame 1's head: past its room
    kept, ok = decode(16)  # the room passed holds: nothing past it is read
    assert ok == [0, 0] and torch.equal(kept.view(torch.int32), passed.view(torch.int32))
    rows[row : row + 8].view(torch.int64).fill_(100)  # frame 1's head: too short for its body
    short, bad = decode(16)
    assert bad[0] != 0 and bad[1] == 2, bad  # frame 1 (reported as its index + 1)
    assert bool((short == 7.0).all()), "nothing written"
    with pytest.raises(Exception, match="8-aligned"):
        decode(12)


@pytest.mark.parametrize("n", [(24 << 20) + 7, (40 << 20) + 3], ids=["24M", "40M"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "feedback"])
def test_gpu_large_input_matches_cpu(dtype, feedback, n):
    """Inputs large enough to fill the GPU take the encoder's other geometry (4 chunks per warp,
    from about 17M values on an H200): the same bytes and residuals as the CPU reference. From
    32M values the final scans' runs outgrow one batch of loads per lane (more than 256 spans),
    their other branch."""
    x = awkward(n, dtype, seed=3)
    bound = {"eps": 1e-3}
    r0 = torch.randn(n, generator=torch.Generator().manual_seed(5)) * 1e-3 if feedback else None
    kw_cpu = {} if r0 is None else {"residual": r0.clone()}
    kw_gpu = {} if r0 is None else {"residual": r0.cuda()}
    want = bytes(cfc.compress(x, **bound, **kw_cpu))
    got = bytes(cfc.compress(x.cuda(), **bound, **kw_gpu))
    assert got == want
    if feedback:
        assert torch.equal(kw_gpu["residual"].cpu(), kw_cpu["residual"])
    assert same_bits(cfc.decompress(want, device="cuda"), cfc.decompress(want))


# ---- sums of frames: codes added in an integer accumulator on the GPU ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts", [1, 2, 5, 11])
@pytest.mark.parametrize("n", [1, 33, 1000, (1 << 20) + 7])
def test_gpu_sum_is_the_cpu_sums_bytes(dtype, parts, n):
    """Parts with NaN, infinities and outliers (exceptions in some parts only): the GPU's sum
    frame is the CPU reference's, byte for byte, and decodes alike."""
    xs = [awkward(n, dtype, seed=100 * parts + i) for i in range(parts)]
    got = cfc.sum_compressed([cfc.compress(x.cuda(), eps=1e-3) for x in xs])
    assert isinstance(got, cfc.CudaCompressed)
    want = cfc.sum_compressed([cfc.compress(x, eps=1e-3) for x in xs])
    assert bytes(got) == bytes(want)
    assert same_bits(cfc.decompress(got), cfc.decompress(want))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_sum_with_a_raw_part(dtype):
    """A part stored raw (every code out of range) adds its values as exceptions everywhere."""
    n = 5000
    g = torch.Generator().manual_seed(7)
    raw = (torch.randn(n, generator=g) * 1e8).to(dtype)
    assert cfc.frame_info(cfc.compress(raw, eps=1e-3))["codec"] == "raw"
    xs = [awkward(n, dtype, seed=1), raw, awkward(n, dtype, seed=2)]
    got = cfc.sum_compressed([cfc.compress(x.cuda(), eps=1e-3) for x in xs])
    want = cfc.sum_compressed([cfc.compress(x, eps=1e-3) for x in xs])
    assert bytes(got) == bytes(want)


def test_gpu_sum_of_sums_reaches_64_bit_codes_then_overflows():
    """Doubling a sum again and again: widths past 32 bits, the same bytes as the CPU at every
    step, until the codes leave the 64-bit range, which both report."""
    x = torch.linspace(-2000.0, 2000.0, 300)
    c_cpu, c_gpu = cfc.compress(x, eps=1e-3), cfc.compress(x.cuda(), eps=1e-3)
    wide = False
    for _ in range(64):
        try:
            c_cpu = cfc.sum_compressed([c_cpu, c_cpu])
        except cfc.CfcError as e:
            assert "overflow" in str(e)
            with pytest.raises(cfc.CfcError, match="64-bit"):
                cfc.sum_compressed([c_gpu, c_gpu]).nbytes
            break
        c_gpu = cfc.sum_compressed([c_gpu, c_gpu])
        assert bytes(c_gpu) == bytes(c_cpu)
        wide |= max(np.frombuffer(bytes(c_cpu)[72 : 72 + 10], dtype=np.uint8)) > 32
    else:
        pytest.fail("the codes never overflowed")
    assert wide


def test_gpu_sum_ignores_the_padding_codes_of_a_partial_last_group():
    """33 zeros: the last group holds one value, and its 31 other codes are padding, which the
    format leaves free. Here they are all near the top of the 64-bit range (a sum frame's
    width of 64), so adding two would overflow. Decoding and the CPU's sum ignore them; the
    GPU's sum gives the CPU's bytes instead of an overflow."""
    from cfc._gpu import _sum_frames_cuda

    frame = bytearray(bytes(cfc.compress(torch.zeros(33), eps=1e-3))[:72])  # the 1-D header
    frame[8] = 3  # a sum frame: codes up to 64 bits wide
    # widths 0 and 64; the last group's planes: bit j of each 32-bit word is lane j's, and
    # lanes 1-31 hold zigzag 2**64 - 2 (all bits but the lowest)
    body = bytes([0, 64]) + bytes(4) + (0xFFFFFFFE).to_bytes(4, "little") * 63
    frame[40:64] = bytes(8) + len(body).to_bytes(8, "little") * 2  # no exceptions; body lengths
    frame += body
    padded = cfc.Compressed(bytes(frame))
    assert not cfc.decompress(padded).any()
    want = bytes(cfc.sum_compressed([padded] * 2))
    dev = torch.frombuffer(bytearray(frame), dtype=torch.uint8).cuda()
    assert bytes(_sum_frames_cuda([dev, dev], "float32", (33,))) == want


def test_gpu_sum_whose_bound_overflows_is_refused_as_on_the_cpu():
    """The sum's eps is the parts' eps added: past the largest float64, the CPU refuses the
    sum, and so does the GPU (rather than write a frame of eps inf that no decoder reads)."""
    x = torch.tensor([1e30, -2e30, 0.0, 3.0])
    c_cpu, c_gpu = cfc.compress(x, eps=4e307), cfc.compress(x.cuda(), eps=4e307)
    assert bytes(cfc.sum_compressed([c_gpu] * 4)) == bytes(cfc.sum_compressed([c_cpu] * 4))  # eps 1.6e308
    with pytest.raises(cfc.CfcError, match="eps inf"):
        cfc.sum_compressed([c_cpu] * 5)
    with pytest.raises(cfc.CfcError, match="largest float64"):
        cfc.sum_compressed([c_gpu] * 5).synchronize()


@pytest.mark.parametrize("k", [0.3, 0.1])
def test_gpu_sum_of_real_gradients(grads, k):
    for name, g in grads.items():
        x = torch.from_numpy(g)
        eps = k * float(np.sqrt(np.mean(g.astype(np.float64) ** 2)))
        xs = [x, x * 0.5, -x + 1e-3]
        got = cfc.sum_compressed([cfc.compress(v.cuda(), eps=eps) for v in xs])
        want = cfc.sum_compressed([cfc.compress(v, eps=eps) for v in xs])
        assert bytes(got) == bytes(want), name
        exact = (xs[0].double() + xs[1].double() + xs[2].double()).cuda()
        assert (cfc.decompress(got).double() - exact).abs().max().item() <= 3 * eps * (1 + 1e-6)


def test_gpu_sum_refuses_what_does_not_add():
    a = cfc.compress(torch.randn(100, device="cuda"), eps=1e-3)
    b = cfc.compress(torch.randn(100, device="cuda"), eps=2e-3)
    s = cfc.sum_compressed([a, b])  # different steps: known on the device only
    with pytest.raises(cfc.CfcError, match="steps"):
        s.nbytes
    with pytest.raises(cfc.CfcError, match="steps"):
        cfc.decompress(s)
    with pytest.raises(TypeError, match="not both"):
        cfc.sum_compressed([a, a.to_host()])
    with pytest.raises(ValueError, match="zstd"):
        cfc.sum_compressed([a, a], zstd=True)
    with pytest.raises(TypeError, match="bfloat16"):
        cfc.sum_compressed([a, cfc.compress(torch.randn(100, device="cuda").bfloat16(), eps=1e-3)])
    with pytest.raises(cfc.CfcError, match="shapes"):
        cfc.sum_compressed([a, cfc.compress(torch.randn(10, 10, device="cuda"), eps=1e-3)])
    with pytest.raises(ValueError, match="lossless"):
        cfc.sum_compressed([a, cfc.compress(torch.randn(100, device="cuda"), lossless=True)])


def test_gpu_sum_returns_before_the_gpu_finishes():
    cs = [cfc.compress(torch.randn(1 << 20, device="cuda"), eps=1e-3) for _ in range(3)]
    torch.cuda._sleep(200_000_000)
    s = cfc.sum_compressed(cs)
    assert not s._event.query(), "the sum waited for the GPU"
    assert s.nbytes > 64


# ---- decoded sums: unpack, add, scale and write the output dtype in one pass ----

def _decoded_sum_reference(cs, scale, out_dtype):
    """What the all-reduce's average did before the fused kernel: decode each frame, add in
    float32 in order, multiply, convert."""
    acc = None
    for c in cs:
        y = cfc.decompress(c).float()
        acc = y if acc is None else acc + y
    if scale != 1.0:
        acc = acc * scale
    return acc.to(out_dtype)


def same_values(got, want):
    """The same bits, except that a NaN only has to be a NaN."""
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    keep = ~nan
    return torch.equal(got[keep].view(INT_VIEW[got.dtype]), want[keep].view(INT_VIEW[want.dtype]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("parts", [1, 2, 3, 9])
@pytest.mark.parametrize("n", [1, 33, 1000, (1 << 20) + 7])
def test_gpu_decoded_sum_is_the_frames_decoded_and_added(dtype, out_dtype, parts, n):
    """Frames with different steps, NaN, infinities and outliers (exceptions in some frames
    only): the fused kernel writes what decoding each frame and adding them gives."""
    from cfc._gpu import _decode_sum_cuda

    xs = [awkward(n, dtype, seed=10 * parts + i).cuda() for i in range(parts)]
    cs = [cfc.compress(x, eps=1e-3 * (i + 1)) for i, x in enumerate(xs)]
    for scale in (1.0, float(np.float32(1) / np.float32(3)), 0.5):
        out = torch.full((n,), 7.0, dtype=out_dtype, device="cuda")
        _decode_sum_cuda([c._out for c in cs], n, dtype.__repr__()[6:], out, scale)
        assert same_values(out, _decoded_sum_reference(cs, scale, out_dtype)), scale


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_gpu_decoded_sum_of_sum_frames(grads, out_dtype):
    """The reduce-scatter's last step: a frame of summed codes (64-bit widths possible),
    decoded, divided by the world size and written in the bucket's dtype."""
    from cfc._gpu import _decode_sum_cuda

    for name, g in grads.items():
        x = torch.from_numpy(g).cuda()
        eps = 0.3 * float(x.double().pow(2).mean().sqrt())
        s = cfc.sum_compressed([cfc.compress(v, eps=eps) for v in (x, 0.5 * x, -x)])
        scale = float(np.float32(1) / np.float32(3))
        out = torch.empty(x.numel(), dtype=out_dtype, device="cuda")
        _decode_sum_cuda([s._out], x.numel(), "float32", out, scale)
        assert same_values(out, _decoded_sum_reference([s], scale, out_dtype)), name


def test_gpu_decoded_sum_writes_only_its_output():
    n, guard = 5000, 4096
    cs = [cfc.compress(awkward(n, torch.float32, seed=i).cuda(), eps=1e-3) for i in range(2)]
    out = torch.full((2 * n + 2 * guard,), 0xAB, dtype=torch.uint8, device="cuda")  # bfloat16 out
    ws_len = cfc._native.cuda_decode_sum_workspace_len(n, 2)
    ws = torch.full((ws_len + 2 * guard,), 0xCD, dtype=torch.uint8, device="cuda")
    status = torch.zeros(2, dtype=torch.int32, device="cuda")
    lens = [c._out.numel() for c in cs]
    stream = torch.cuda.current_stream()
    frames = [c._out[:length] for c, length in zip(cs, lens)]
    cfc._native.cuda_decode_sum(stream, frames, "float32", 1, 0.5, out[guard : guard + 2 * n].view(torch.bfloat16),
                                ws[guard : guard + ws_len], status)
    torch.cuda.synchronize()
    for buf, fill, length in ((out, 0xAB, 2 * n), (ws, 0xCD, ws_len)):
        assert bool((buf[:guard] == fill).all()), "written before the buffer"
        assert bool((buf[guard + length:] == fill).all()), "written past the buffer"
    assert status.tolist() == [0, 0], "good frames pass the check"
    got = out[guard : guard + 2 * n].view(torch.bfloat16)
    assert same_values(got, _decoded_sum_reference(cs, 0.5, torch.bfloat16))
    with pytest.raises(ValueError, match="bytes"):
        cfc._native.cuda_decode_sum(stream, frames, "float32", 1, 0.5, out[: 2 * n].view(torch.bfloat16),
                                    ws[: ws_len - 1], status)



RICE_BOUNDS = [{"eps": 1e-3}, {"eps": 0.05}, {"rel": 1e-2}]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bound", RICE_BOUNDS, ids=lambda b: "-".join(f"{k}{v}" for k, v in b.items()))
@pytest.mark.parametrize("n", [0, 1, 31, 1000, 1025, 5000, (1 << 20) + 7])
def test_gpu_rice_frames_are_the_cpu_reference_bytes(dtype, bound, n):
    x = awkward(n, dtype, seed=n)
    c = cfc.compress(x.cuda(), coder="rice", **bound)
    ref = cfc.compress(x, coder="rice", **bound)
    assert bytes(c) == bytes(ref)
    assert same_bits(cfc.decompress(c), cfc.decompress(ref))


@pytest.mark.parametrize("k", [0.05, 0.3])
def test_gpu_rice_real_gradients_match_cpu(grads, k):
    for name, g in grads.items():
        x = torch.from_numpy(g.astype(np.float32))
        eps = k * x.double().pow(2).mean().sqrt().item()
        c = cfc.compress(x.cuda(), eps=eps, coder="rice")
        assert bytes(c) == bytes(cfc.compress(x, eps=eps, coder="rice")), name
        assert same_bits(cfc.decompress(c), cfc.decompress(cfc.compress(x, eps=eps))), name


def test_gpu_decodes_host_rice_frames_sums_included():
    xs = [awkward(70_000, torch.float32, seed=s) for s in range(3)]
    frames = [cfc.compress(x, eps=0.01, coder="rice") for x in xs]
    total = cfc.sum_compressed(frames)
    assert cfc.frame_info(total)["codec"] == "rice"
    for f in frames + [total]:
        assert same_bits(cfc.decompress(f, device="cuda"), cfc.decompress(f))
    # codes wider than 32 bits (k = 33: planes past the warp's first 32 lanes)
    x = torch.zeros(3000)
    x[::700] = 1.0
    wide = cfc.sum_compressed([cfc.compress(x, eps=2.5e-10, coder="rice")] * 40)
    assert cfc.frame_info(wide)["codec"] == "rice"
    assert same_bits(cfc.decompress(wide, device="cuda"), cfc.decompress(wide))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bound", RICE_BOUNDS, ids=lambda b: "-".join(f"{k}{v}" for k, v in b.items()))
@pytest.mark.parametrize("n", [1, 1000, 5000, (1 << 20) + 7])
def test_gpu_rice_error_feedback_matches_cpu_bits(dtype, bound, n):
    x = awkward(n, dtype, seed=n + 1)
    r_gpu = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3
    r_cpu = r_gpu.clone()
    r_gpu = r_gpu.cuda()
    for step in range(3):  # the residual carries over
        c = cfc.compress(x.cuda(), coder="rice", residual=r_gpu, **bound)
        ref = cfc.compress(x, coder="rice", residual=r_cpu, **bound)
        assert bytes(c) == bytes(ref), step
        assert same_bits(r_gpu, r_cpu), step


def test_gpu_rice_raw_frame_with_feedback():
    # A bound far below the values' spacing: every value is an exception, the frame falls back to
    # raw bytes, and the residual is c - the value sent.
    x = torch.randn(3000)
    r_gpu, r_cpu = torch.full((3000,), 1e-3, device="cuda"), torch.full((3000,), 1e-3)
    c = cfc.compress(x.cuda(), eps=1e-30, coder="rice", residual=r_gpu)
    ref = cfc.compress(x, eps=1e-30, coder="rice", residual=r_cpu)
    assert cfc.frame_info(ref)["codec"] == "raw" and bytes(c) == bytes(ref)
    assert same_bits(r_gpu, r_cpu)
