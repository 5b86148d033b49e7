"""Malformed frames give cfc.FormatError, never a crash (mirrors tests/hostile.rs)."""

import random

import pytest
import torch

import cfc


@pytest.fixture(scope="module")
def frame():
    x = torch.randn(3000) * torch.rand(3000).pow(4)
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
