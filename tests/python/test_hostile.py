"""Malformed frames give cfc.FormatError, never a crash (mirrors tests/hostile.rs)."""

import random
import struct

import pytest
import torch

import cfc


@pytest.fixture(scope="module")
def frame():
    g = torch.Generator().manual_seed(3)  # one frame every run: a failure reproduces
    x = torch.randn(3000, generator=g) * torch.rand(3000, generator=g).pow(4)
    x[5] = float("nan")
    return bytes(cfc.compress(x, eps=1e-3))


def test_every_truncation_is_a_format_error(frame):
    for n in range(len(frame)):
        with pytest.raises(cfc.FormatError):
            cfc.decompress(frame[:n])


def test_trailing_bytes_are_rejected(frame):
    with pytest.raises(cfc.FormatError, match="body"):
        cfc.decompress(frame + b"\0")


def test_random_corruption_errors_or_decodes_to_the_right_size(frame):
    rng = random.Random(0)
    for _ in range(3000):
        b = bytearray(frame)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            y = cfc.decompress(b)
        except cfc.FormatError:
            continue
        assert y.numel() == 3000


@pytest.mark.parametrize(
    "offset, value, match",
    [(0, b"XXXX", "magic"), (4, b"\x02", "version"), (6, b"\x0a", "dtype"), (7, b"\x80", "flags")],
)
def test_header_fields_are_checked(frame, offset, value, match):
    b = bytearray(frame)
    b[offset : offset + len(value)] = value
    with pytest.raises(cfc.FormatError, match=match):
        cfc.decompress(b)


def test_format_error_is_a_cfc_error():
    assert issubclass(cfc.FormatError, cfc.CfcError)
    with pytest.raises(cfc.CfcError):
        cfc.decompress(b"not a frame at all, but long enough to hold a header.............")


def test_max_nbytes_refuses_a_tiny_frame_describing_a_huge_tensor():
    zeros = cfc.compress(torch.zeros(1 << 22), eps=1e-3, zstd=True)  # 16 MB of zeros
    assert zeros.nbytes < 2000
    with pytest.raises(ValueError, match="max_nbytes"):
        cfc.decompress(bytes(zeros), max_nbytes=1 << 20)
    assert cfc.decompress(bytes(zeros), max_nbytes=1 << 24).numel() == 1 << 22


def test_an_empty_tensors_frame_with_a_dimension_past_int64_is_malformed():
    # n = 0 bounds no dimension through the product: each is checked on its own
    good = bytes(cfc.compress(torch.empty(0, 5), eps=1e-3))
    assert cfc.frame_info(good)["shape"] == [0, 5]
    for dim in (1 << 63, (1 << 64) - 1):
        bad = bytearray(good)
        _set_u64(bad, 72, dim)
        for read in (cfc.frame_info, cfc.decompress, cfc.pin, lambda f: cfc.sum_compressed([f, f])):
            with pytest.raises(cfc.FormatError, match="shape"):
                read(bytes(bad))
    ok = bytearray(good)
    _set_u64(ok, 72, (1 << 63) - 1)
    assert cfc.decompress(bytes(ok)).shape == (0, (1 << 63) - 1)


def test_max_nbytes_refuses_such_frames_before_they_are_summed():
    zeros = bytes(cfc.compress(torch.zeros(1 << 22), eps=1e-3, zstd=True))  # 16 MB of zeros
    with pytest.raises(ValueError, match="max_nbytes"):
        cfc.sum_compressed([zeros, zeros], max_nbytes=1 << 20)
    total = cfc.sum_compressed([zeros, zeros], max_nbytes=1 << 24)
    assert cfc.decompress(total).numel() == 1 << 22


# ---- frames that reach the GPU's sums from elsewhere (another rank) ----------------------
# The kernels that add frames check them on the device first: a bad one is reported and
# nothing is written, never read past its end (run these under compute-sanitizer to see the
# latter too).

N_GPU = 3000
HEADER_1D = 72  # the fixed header and one dimension


def _values():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_GPU, generator=g) * torch.rand(N_GPU, generator=g).pow(4)
    x[[5, 17, 400]] = torch.tensor([float("nan"), float("inf"), float("nan")])  # exceptions
    return x


def _layout(b):
    """(groups, plane words, exception count, where the exception indices start)."""
    groups = -(-N_GPU // 32)
    words = sum(b[HEADER_1D : HEADER_1D + groups])
    n_exc = int.from_bytes(b[40:48], "little")
    return groups, words, n_exc, HEADER_1D + groups + 4 * words


def _set_u64(b, at, v):
    b[at : at + 8] = v.to_bytes(8, "little")


def _swap_first_exceptions(b):
    at = _layout(b)[3]
    b[at : at + 8] = b[at + 4 : at + 8] + b[at : at + 4]


def _exception_past_the_end(b):
    _, _, n_exc, at = _layout(b)
    b[at + 4 * (n_exc - 1) : at + 4 * n_exc] = (N_GPU + 5).to_bytes(4, "little")


def _set_f64(b, at, v):
    b[at : at + 8] = struct.pack("<d", v)


CORRUPTIONS = {
    "a width past 64": lambda b: b.__setitem__(HEADER_1D + 3, 200),
    "widths that disagree with the body length": lambda b: b.__setitem__(HEADER_1D + 3, b[HEADER_1D + 3] + 1),
    "a huge exception count": lambda b: _set_u64(b, 40, 1 << 40),
    "a body past the frame's size": lambda b: (_set_u64(b, 48, len(b)), _set_u64(b, 56, len(b))),
    "exceptions out of order": _swap_first_exceptions,
    "an exception index past the end": _exception_past_the_end,
    "another dtype": lambda b: b.__setitem__(6, 1),
    "another element count": lambda b: _set_u64(b, 16, N_GPU + 1),
    "a bad magic": lambda b: b.__setitem__(0, ord("X")),
    # Header fields that leave every length as it was (a NaN step would reach the values):
    "a NaN step": lambda b: _set_f64(b, 24, float("nan")),
    "an infinite step": lambda b: _set_f64(b, 24, float("inf")),
    "a zero step": lambda b: _set_f64(b, 24, 0.0),
    "a negative step": lambda b: _set_f64(b, 24, -2e-3),
    "a NaN eps": lambda b: _set_f64(b, 32, float("nan")),
    "a negative eps": lambda b: _set_f64(b, 32, -1.0),
    "an unknown bound mode": lambda b: b.__setitem__(8, 9),
    "lossless mode on quantized codes": lambda b: b.__setitem__(8, 4),
    "bits outside bits mode": lambda b: b.__setitem__(11, 5),
    "bits mode without bits": lambda b: b.__setitem__(8, 2),
    "bits mode with 1 bit": lambda b: (b.__setitem__(8, 2), b.__setitem__(11, 1)),
    "a reserved byte set": lambda b: b.__setitem__(13, 1),
    "a shape that does not hold n": lambda b: _set_u64(b, 64, N_GPU + 1),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_the_gpu_tests_corruptions_are_refused_by_the_host(name):
    """The same bytes as the GPU's frame (the GPU codec writes the CPU's): each corruption the
    GPU tests below make is a malformed frame, as the host's checks see it."""
    raw = bytes(cfc.compress(_values(), eps=1e-3))
    assert _layout(raw)[2] >= 3
    bad = bytearray(raw)
    CORRUPTIONS[name](bad)
    with pytest.raises(cfc.FormatError):
        cfc.decompress(bytes(bad))


def test_a_decoding_status_is_worded_in_one_place():
    """The message of a device decoding's status (the engine's and cfc._gpu's): the bad frame
    counted from 0, the error bits, nothing where the bits are 0."""
    from cfc import _native

    assert _native.decode_status_error(0) is None
    assert _native.decode_status_error(5 << 32) is None
    why = _native.decode_status_error(1 | 2 << 32)
    assert why.startswith("frame 1 of a decoding") and "0x1" in why, why
    assert _native.decode_status_error(1).startswith("a frame")


def _on_gpu(b):
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).cuda()


@pytest.fixture(scope="module")
def gpu_frame():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    c = cfc.compress(_values().cuda(), eps=1e-3)
    raw = bytes(c)
    n_exc = _layout(raw)[2]
    assert n_exc >= 3, "the frame needs exceptions for the corruptions to reach them"
    return c, raw


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_gpu_decoded_sum_refuses_a_bad_frame_and_writes_nothing(gpu_frame, name):
    from cfc._gpu import _decode_status_error, _decode_sum_cuda

    c, raw = gpu_frame
    bad = bytearray(raw)
    CORRUPTIONS[name](bad)
    out = torch.full((N_GPU,), 7.0, device="cuda")
    status = _decode_sum_cuda([_on_gpu(raw), _on_gpu(bad)], N_GPU, "float32", out, 0.5)
    torch.cuda.synchronize()
    why = _decode_status_error(status)
    assert why is not None and "frame 1" in why, (name, why)
    assert torch.equal(out, torch.full_like(out, 7.0)), f"{name}: the output was written"
    # The status is kept: a later call with it decodes nothing, even of a good frame.
    _decode_sum_cuda([_on_gpu(raw)], N_GPU, "float32", out, 1.0, status=status)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 7.0))
    # A new status: the good frame decodes as decompress does.
    fresh = _decode_sum_cuda([_on_gpu(raw)], N_GPU, "float32", out, 1.0)
    assert _decode_status_error(fresh) is None
    want = cfc.decompress(raw).cuda()
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and torch.equal(out.nan_to_num(), want.nan_to_num())


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_gpu_sum_of_frames_refuses_a_bad_frame(gpu_frame, name):
    from cfc._gpu import _sum_frames_cuda

    _, raw = gpu_frame
    bad = bytearray(raw)
    CORRUPTIONS[name](bad)
    s = _sum_frames_cuda([_on_gpu(raw), _on_gpu(bad)], "float32", (N_GPU,))
    with pytest.raises(cfc.CfcError, match="frame 1 of the sum"):
        s.synchronize()
    good = _sum_frames_cuda([_on_gpu(raw), _on_gpu(raw)], "float32", (N_GPU,))
    assert bytes(good) == bytes(cfc.sum_compressed([cfc.Compressed(raw)] * 2)), "the check refuses a good frame"


@pytest.mark.gpu
def test_gpu_frames_too_short_for_their_widths_are_refused_on_the_host(gpu_frame):
    from cfc._gpu import _decode_sum_cuda

    _, raw = gpu_frame
    out = torch.zeros(N_GPU, device="cuda")
    with pytest.raises(cfc.FormatError, match="frame"):
        _decode_sum_cuda([_on_gpu(raw[:HEADER_1D + 10])], N_GPU, "float32", out)


@pytest.mark.gpu
def test_gpu_sum_refuses_frames_of_another_shape_as_the_cpu_does():
    """A frame of shape (64, 48) summed as (48, 64): the same element count, dimensions that
    differ. The CPU refuses to add frames of different shapes, so the GPU's check does too
    (without it, the sum came back as a frame of the caller's shape)."""
    from cfc._gpu import _sum_frames_cuda

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(5))
    raw = bytes(cfc.compress(x, eps=1e-3))
    turned = bytes(cfc.compress(x.reshape(48, 64), eps=1e-3))
    with pytest.raises(cfc.CfcError, match="shape"):
        cfc.sum_compressed([cfc.Compressed(raw), cfc.Compressed(turned)])
    s = _sum_frames_cuda([_on_gpu(raw), _on_gpu(raw)], "float32", (48, 64))
    with pytest.raises(cfc.CfcError, match=r"frame [01] of the sum"):
        s.synchronize()
    good = _sum_frames_cuda([_on_gpu(raw), _on_gpu(raw)], "float32", (64, 48))
    assert bytes(good) == bytes(cfc.sum_compressed([cfc.Compressed(raw)] * 2))


@pytest.mark.gpu
@pytest.mark.parametrize("offset, value", [(0, b"XXXX"), (6, b"\x0a"), (16, b"\x05")])
def test_gpu_decoded_sum_of_no_elements_still_checks_its_frames(offset, value):
    """A bucket of 0 elements writes nothing, but a frame from elsewhere that is not an empty
    frame of this dtype (bad magic, another dtype, a count that is not 0) is reported all the
    same, as the CPU refuses it (before, such a call returned at once and checked nothing)."""
    from cfc._gpu import _decode_status_error, _decode_sum_cuda

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    raw = bytes(cfc.compress(torch.zeros(0), eps=1e-3))
    bad = bytearray(raw)
    bad[offset : offset + len(value)] = value
    with pytest.raises(cfc.FormatError):
        cfc.decompress(bytes(bad))
    out = torch.zeros(0, device="cuda")
    assert _decode_status_error(_decode_sum_cuda([_on_gpu(raw), _on_gpu(raw)], 0, "float32", out)) is None
    why = _decode_status_error(_decode_sum_cuda([_on_gpu(raw), _on_gpu(bad)], 0, "float32", out))
    assert why is not None and "frame 1" in why, why
