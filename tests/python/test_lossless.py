"""Lossless compression (`cfc.compress(x, lossless=True)`), decoding it on the CPU and on a GPU,
pinned frames, and checkpoints (`cfc.save` / `cfc.load`)."""

import json
import os
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import cfc

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.bool]
LENGTHS = [0, 1, 31, 33, 4095, 4097, 3 * 4096 + 5]


def sample(dtype, n, seed=0):
    """Weight-like floats (with NaN, infinities, -0.0 and some zeros), or small integers."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) < 0.1
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        x = torch.randint(-100, 100, (n,), generator=g).clamp(info.min, info.max).to(dtype)
        if n > 2:
            x[0], x[1] = info.min, info.max
        return x
    x = torch.randn(n, generator=g) * 0.02
    x[torch.rand(n, generator=g) < 0.2] = 0.0
    if n > 8:
        x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    return x.to(dtype)


def bits(t):
    """The tensor's bytes, for exact comparisons (NaN payloads and -0.0 included)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", LENGTHS)
def test_every_dtype_comes_back_bit_for_bit(dtype, n):
    x = sample(dtype, n, seed=n).reshape(-1, 1) if n else sample(dtype, 0)
    c = cfc.compress(x, lossless=True)
    assert c.mode == "lossless" and c.eps == 0.0 and c.info["codec"] in ("lossless", "raw")
    assert c.nbytes <= x.numel() * x.element_size() + 64 + 8 * x.dim()
    y = cfc.decompress(c)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert bits(y) == bits(x)


def test_every_bfloat16_bit_pattern_comes_back():
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    w = (torch.randn(1 << 20) * 0.02).to(torch.bfloat16)
    w[torch.randperm(w.numel())[: x.numel()]] = x
    for t in (x, w):
        assert bits(cfc.decompress(cfc.compress(t, lossless=True))) == bits(t)


def test_numpy_arrays_and_zstd():
    a = np.tile(np.arange(-50, 50, dtype=np.int64), 100)
    c = cfc.compress(a, lossless=True, zstd=True)
    assert c.info["zstd"] and c.ratio > 4 * cfc.compress(a, lossless=True).ratio
    y = cfc.decompress(c)
    assert np.array_equal(y.numpy(), a)


def test_ratios_on_weights_and_relu_activations():
    w = (torch.randn(1 << 20) * 0.02).to(torch.bfloat16)
    assert cfc.compress(w, lossless=True).ratio >= 1.3
    a = torch.relu(torch.randn(1 << 20))
    assert cfc.compress(a, lossless=True).ratio >= 1.8


def test_lossless_refuses_a_bound_or_a_residual_and_bounds_refuse_integers():
    x = torch.zeros(10)
    with pytest.raises(ValueError, match="no bound"):
        cfc.compress(x, lossless=True, eps=0.1)
    with pytest.raises(ValueError, match="residual"):
        cfc.compress(x, lossless=True, residual=torch.zeros(10))
    with pytest.raises(TypeError, match="lossless=True"):
        cfc.compress(torch.zeros(10, dtype=torch.int64), eps=0.1)
    with pytest.raises(TypeError, match="losslessly"):
        cfc.compress(torch.zeros(3, dtype=torch.complex64), lossless=True)


def test_hostile_lossless_frames_are_refused():
    good = bytes(cfc.compress(sample(torch.float32, 5000), lossless=True))
    assert cfc.frame_info(good)["codec"] == "lossless"
    bad = bytearray(good)
    bad[72 + 3] = 0x70  # the first chunk's method: 7 does not exist
    with pytest.raises(cfc.FormatError, match="chunk method"):
        cfc.decompress(bytes(bad))
    for cut in (len(good) - 1, 80, 70):
        with pytest.raises(cfc.FormatError):
            cfc.decompress(good[:cut])


HOSTILE_DIR = Path(__file__).resolve().parents[1] / "hostile"


def test_bool_elements_other_than_0_and_1_are_refused():
    """A bool whose byte is not 0 or 1 (made by viewing uint8 data) has no meaning: the encoder
    refuses it, and a frame that holds one is malformed, however its chunks store it."""
    raw = torch.tensor([0, 1, 2, 1], dtype=torch.uint8)
    with pytest.raises(ValueError, match="element 2 of the bool tensor is the byte 2"):
        cfc.compress(raw.view(torch.bool), lossless=True)
    with pytest.raises(ValueError, match="element 2 of the bool tensor"):
        cfc.compress(raw.numpy().view(np.bool_), lossless=True, zstd=True)
    # A valid uint8 frame relabelled bool (dtype byte 9), with and without a zstd stage.
    for zstd in (False, True):
        bad = bytearray(bytes(cfc.compress(torch.arange(5000, dtype=torch.uint8) % 4, lossless=True, zstd=zstd)))
        bad[6] = 9
        for read in (cfc.decompress, cfc.pin):
            with pytest.raises(cfc.FormatError, match="bool element"):
                read(bytes(bad))
    # The crafted corpus (tests/hostile/README.md, "Bool elements"): one per storage method.
    files = sorted(HOSTILE_DIR.glob("bool_*.bin"))
    assert len(files) == 5
    for f in files:
        with pytest.raises(cfc.FormatError, match="bool element"):
            cfc.decompress(f.read_bytes())


# ---- checkpoints ----


def model_state():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(300, 64), torch.nn.Linear(64, 64),
                            torch.nn.LayerNorm(64), torch.nn.Linear(64, 300))
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    sd["1.weight"] = sd["1.weight"].to(torch.bfloat16)
    sd["steps"] = torch.tensor(1234, dtype=torch.int64)
    sd["mask"] = torch.rand(7, 5) < 0.5
    sd["empty"] = torch.zeros(0, 3)
    return sd


def test_save_and_load_round_trip(tmp_path):
    sd = model_state()
    p = tmp_path / "model.cfc"
    report = cfc.save(sd, p, metadata={"step": "1234"})
    assert report["tensors"] == len(sd) and report["bytes"] == p.stat().st_size
    back, meta = cfc.load(p, metadata=True)
    assert meta == {"step": "1234"}
    assert list(back) == list(sd)
    for k in sd:
        assert back[k].dtype == sd[k].dtype and back[k].shape == sd[k].shape, k
        assert bits(back[k]) == bits(sd[k]), k


def test_save_with_bounds(tmp_path):
    sd = model_state()
    p = tmp_path / "model.cfc"
    cfc.save(sd, p, bounds={"0.weight": {"eps": 1e-3}})
    back = cfc.load(p)
    err = (back["0.weight"].double() - sd["0.weight"].double()).abs().max().item()
    assert 0 < err <= 1e-3
    assert bits(back["3.weight"]) == bits(sd["3.weight"])
    cfc.save(sd, p, bounds=lambda name, t: {"rel": 1e-2} if name.endswith("bias") else None)
    back = cfc.load(p)
    assert bits(back["1.weight"]) == bits(sd["1.weight"])
    assert not torch.equal(back["3.bias"], sd["3.bias"])
    with pytest.raises(ValueError, match="bound of"):
        cfc.save(sd, p, bounds={"0.weight": {"tolerance": 1}})
    with pytest.raises(TypeError, match="bounds apply to float32"):
        cfc.save(sd, p, bounds={"steps": {"eps": 1.0}})
    # a blanket function bounds the float tensors and leaves the others lossless
    asked = []
    cfc.save(sd, p, bounds=lambda name, t: asked.append(name) or {"rel": 1e-2})
    back = cfc.load(p)
    assert "steps" not in asked and "mask" not in asked and "0.weight" in asked
    assert torch.equal(back["steps"], sd["steps"]) and not torch.equal(back["0.weight"], sd["0.weight"])


def test_save_refuses_what_it_cannot_store(tmp_path):
    with pytest.raises(TypeError, match="not a tensor"):
        cfc.save({"a": 3}, tmp_path / "x.cfc")
    with pytest.raises(TypeError, match="metadata"):
        cfc.save({}, tmp_path / "x.cfc", metadata={"a": 1})
    # a path that cannot be written leaves nothing behind; a bytes path is a path
    (tmp_path / "a_dir").mkdir()
    with pytest.raises(IsADirectoryError):
        cfc.save({"a": torch.ones(3)}, tmp_path / "a_dir")
    assert sorted(q.name for q in tmp_path.iterdir()) == ["a_dir"]
    cfc.save({"a": torch.ones(3)}, bytes(tmp_path / "b.cfc"))
    assert torch.equal(cfc.load(tmp_path / "b.cfc")["a"], torch.ones(3))


def corrupt(path, offset, value):
    data = bytearray(path.read_bytes())
    data[offset] ^= value
    path.write_bytes(bytes(data))


def rewrite(p, index, frames):
    """A checkpoint with this index (its checksum made to match) and these frame bytes."""
    head = json.dumps(index).encode()
    p.write_bytes(struct.pack("<4sB3xQI4x", b"CFCK", 1, len(head), zlib.crc32(head)) + head + frames)


def test_corrupted_checkpoints_are_refused(tmp_path):
    sd = model_state()
    p = tmp_path / "model.cfc"
    cfc.save(sd, p)
    data = p.read_bytes()
    head_len = struct.unpack_from("<Q", data, 8)[0]
    start = 24 + head_len
    index = json.loads(data[24:start])
    frames = data[start:]
    # A flipped bit in a frame: the checksum names the tensor.
    corrupt(p, start + index["3.weight"]["offset"] + 100, 0x01)
    with pytest.raises(cfc.FormatError, match="'3.weight': checksum"):
        cfc.load(p)
    # A flipped bit in the index (a name, say): the index's own checksum.
    p.write_bytes(data)
    corrupt(p, 24 + data[24:start].index(b"3.weight"), 0x02)
    with pytest.raises(cfc.FormatError, match="index checksum"):
        cfc.load(p)
    for cut in (0, 10, 24 + head_len // 2, len(data) - 1):
        p.write_bytes(data[:cut])
        with pytest.raises(cfc.FormatError):
            cfc.load(p)
    p.write_bytes(b"XXXX" + data[4:])
    with pytest.raises(cfc.FormatError, match="not a cfc checkpoint"):
        cfc.load(p)
    p.write_bytes(data + b"\0")
    with pytest.raises(cfc.FormatError, match="after the last frame"):
        cfc.load(p)
    # Indexes made to pass their checksum, but wrong:
    bad = json.loads(json.dumps(index))
    bad["1.bias"]["shape"] = [63]  # disagrees with its frame
    rewrite(p, bad, frames)
    with pytest.raises(cfc.FormatError, match="'1.bias': frame holds"):
        cfc.load(p)
    bad = json.loads(json.dumps(index))
    bad["copy"] = dict(bad["1.weight"])  # a second entry reading an earlier frame
    rewrite(p, bad, frames)
    with pytest.raises(cfc.FormatError, match="'copy': its frame does not start where the previous one ends"):
        cfc.load(p)
    # The first frame's offset (0) as a number too long to convert, an overflowing float, a
    # negative number, a boolean and a string: each a malformed entry.
    for value in (b"1" + b"0" * 5000, b"1e999", b"-1", b"true", b'"0"'):
        head = json.dumps(index).encode().replace(b'"offset": 0', b'"offset": ' + value, 1)
        p.write_bytes(struct.pack("<4sB3xQI4x", b"CFCK", 1, len(head), zlib.crc32(head)) + head + frames)
        with pytest.raises(cfc.FormatError):
            cfc.load(p)
    head = b"[" * 100000 + b"]" * 100000
    p.write_bytes(struct.pack("<4sB3xQI4x", b"CFCK", 1, len(head), zlib.crc32(head)) + head)
    with pytest.raises(cfc.FormatError, match="unreadable index|not a JSON object"):
        cfc.load(p)
    bad = json.loads(json.dumps(index))
    bad["__metadata__"] = {"a": 1}
    rewrite(p, bad, frames)
    with pytest.raises(cfc.FormatError, match="metadata"):
        cfc.load(p)

    # A key given twice (JSON allows it; readers would disagree on which one counts).
    head = json.dumps(index).encode()
    for dup in (b'{"__metadata__":{"k":"a"},' + head[1:] + b"", head[:-1] + b',"__metadata__":{"k":"EVIL"}}'):
        p.write_bytes(struct.pack("<4sB3xQI4x", b"CFCK", 1, len(dup), zlib.crc32(dup)) + dup + frames)
        with pytest.raises(cfc.FormatError, match="appears twice"):
            cfc.load(p)
    # A dtype that is some other torch attribute is refused by name, not looked up.
    bad = json.loads(json.dumps(index))
    bad["1.bias"]["dtype"] = "_dynamo"
    rewrite(p, bad, frames)
    with pytest.raises(cfc.FormatError, match="'1.bias': unknown dtype '_dynamo'"):
        cfc.load(p)


def test_a_malformed_frame_is_named_in_the_error(tmp_path):
    """A frame whose checksum was made to match but which is malformed (a uint8 frame
    relabelled bool, with a byte 2): the error names the file and the tensor."""
    p = tmp_path / "m.cfc"
    frame = bytearray(bytes(cfc.compress(torch.tensor([0, 2, 1], dtype=torch.uint8), lossless=True)))
    frame[6] = 9
    index = {"__metadata__": {}, "mask": {"dtype": "bool", "shape": [3], "offset": 0,
                                          "nbytes": len(frame), "crc32": zlib.crc32(frame)}}
    rewrite(p, index, bytes(frame))
    with pytest.raises(cfc.FormatError, match=r"m\.cfc: 'mask': .*bool element"):
        cfc.load(p)


def test_load_refuses_before_reading_what_it_cannot_use(tmp_path):
    p = tmp_path / "zeros.cfc"
    cfc.save({"z": torch.zeros(1 << 22), "w": torch.ones(10)}, p, zstd=3)
    assert p.stat().st_size < 10_000  # 16 MB of zeros in a small file
    with pytest.raises(ValueError, match="16777256 bytes, more than max_nbytes=1000000"):
        cfc.load(p, max_nbytes=1_000_000)
    assert cfc.load(p, max_nbytes=16777256)["z"].numel() == 1 << 22
    assert cfc.load(p, device=None)["w"].device.type == "cpu"
    with pytest.raises(TypeError, match="max_nbytes"):
        cfc.load(p, max_nbytes="1")
    with pytest.raises(TypeError, match="metadata"):
        cfc.load(p, metadata="no")
    with pytest.raises(ValueError, match="device 'foo'"):
        cfc.load(p, device="foo")
    with pytest.raises(ValueError, match="CUDA device"):  # one past the last this machine has
        cfc.load(p, device=f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    # Not a path: an int would be taken as a file descriptor (True as stdout) and closed.
    for bad in (True, 1, 3.5, None):
        with pytest.raises(TypeError, match="path"):
            cfc.load(bad)
    # A FIFO would block the reader forever; a directory is no file either.
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        with pytest.raises(ValueError, match="not a regular file"):
            cfc.load(fifo)
    with pytest.raises((ValueError, IsADirectoryError, PermissionError)):
        cfc.load(tmp_path)


def test_save_names_the_tensor_and_refuses_bad_arguments(tmp_path):
    p = tmp_path / "x.cfc"
    mask = torch.tensor([0, 2, 1], dtype=torch.uint8).view(torch.bool)
    with pytest.raises(ValueError, match="'mask': element 1 of the bool tensor"):
        cfc.save({"a": torch.ones(2), "mask": mask}, p)
    with pytest.raises(ValueError, match="'w': invalid eps"):
        cfc.save({"w": torch.ones(2)}, p, bounds={"w": {"eps": -1.0}})
    with pytest.raises(TypeError, match="'w': eps must be a number"):
        cfc.save({"w": torch.ones(2)}, p, bounds={"w": {"eps": True}})
    with pytest.raises(TypeError, match="tensors must be a mapping"):
        cfc.save([("w", torch.ones(2))], p)
    with pytest.raises(TypeError, match="metadata"):
        cfc.save({}, p, metadata=[("a", "b")])
    with pytest.raises(TypeError, match="bounds"):
        cfc.save({}, p, bounds="eps")
    with pytest.raises(TypeError, match="'s': cfc stores dense tensors"):
        cfc.save({"s": torch.eye(3).to_sparse()}, p)

    with pytest.raises(ValueError, match="bytes of index"):  # load would refuse such an index
        cfc.save({}, p, metadata={"big": "\u4e00" * 17_000_000})

    class Twice(dict):  # a mapping whose items() gives one name twice
        def items(self):
            return [("w", torch.ones(2)), ("w", torch.zeros(2))]

    with pytest.raises(ValueError, match="'w' is given twice"):
        cfc.save(Twice(), p)
    assert not p.exists() and list(tmp_path.iterdir()) == []
    # A negated view (its memory holds the opposite values) is stored as the values it shows.
    neg = torch._neg_view(torch.tensor([2.0, -4.0]))
    assert neg.is_neg() and neg.is_contiguous()
    cfc.save({"neg": neg}, p)
    assert torch.equal(cfc.load(p)["neg"], torch.tensor([-2.0, 4.0]))
    # A bound may be a 0-d tensor (computed from the tensor, say).
    w = torch.randn(100)
    cfc.save({"w": w}, p, bounds=lambda name, t: {"eps": 1e-3 * t.abs().max()})
    assert (cfc.load(p)["w"] - w).abs().max() <= 1e-3 * w.abs().max()


def test_saves_to_one_path_at_once_leave_one_whole_checkpoint(tmp_path):
    p = tmp_path / "race.cfc"
    states = [{"w": torch.full((1 << 16,), float(i))} for i in range(4)]
    errors = []

    def save(sd):
        try:
            cfc.save(sd, p)
        except Exception as e:  # noqa: BLE001 - a thread's exception would otherwise be lost
            errors.append(e)

    for _ in range(5):
        threads = [threading.Thread(target=save, args=(sd,)) for sd in states]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        w = cfc.load(p)["w"]
        assert any(torch.equal(w, sd["w"]) for sd in states)
        assert [q.name for q in tmp_path.iterdir()] == ["race.cfc"], "a temp file was left"


def test_pinned_frames_take_max_nbytes():
    p = cfc.pin(cfc.compress(torch.zeros(1 << 16), lossless=True))
    with pytest.raises(ValueError, match="max_nbytes"):
        cfc.decompress(p, max_nbytes=1000)
    assert cfc.decompress(p, max_nbytes=1 << 18).numel() == 1 << 16


# ---- on a GPU ----


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", LENGTHS + [(1 << 20) + 3])
def test_gpu_decodes_lossless_frames_bit_for_bit(dtype, n):
    x = sample(dtype, n, seed=n + 1)
    c = cfc.compress(x, lossless=True)
    y = cfc.decompress(c, device="cuda")
    assert y.is_cuda and y.dtype == dtype
    assert bits(y) == bits(x)
    p = cfc.pin(c)
    assert bits(cfc.decompress(p, device="cuda")) == bits(x)


def four_methods(tail=0):
    """int32 chunks that take raw, pack, sparse and sparse + pack in turn (and `tail` more
    random words)."""
    n = 4096
    g = torch.Generator().manual_seed(5)
    raw = torch.randint(-(1 << 31), (1 << 31) - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    packed = (torch.randn(n, generator=g) * 0.02).view(torch.int32)
    sparse = torch.where(torch.arange(n) % 3 == 0, raw, torch.zeros_like(raw))
    relu = torch.relu(torch.randn(n, generator=g)).view(torch.int32)
    return torch.cat([raw, packed, sparse, relu, raw[:tail]])


@pytest.mark.gpu
def test_gpu_decodes_every_method():
    # raw, pack, sparse and sparse + pack chunks in one frame, in every word width.
    x = four_methods()
    for t in (x, x.view(torch.float32), x.view(torch.int16), x.view(torch.int8), x.view(torch.int64)):
        c = cfc.compress(t, lossless=True)
        assert bits(cfc.decompress(c, device="cuda")) == bits(t)
    body = bytes(cfc.compress(x, lossless=True))[72:88]
    assert [int.from_bytes(body[i:i + 4], "little") >> 28 for i in range(0, 16, 4)] == [0, 1, 2, 3]


@pytest.mark.gpu
def test_gpu_decode_refuses_hostile_frames_before_the_gpu_reads_them():
    good = bytes(cfc.compress(sample(torch.float32, 9000), lossless=True))
    bad = bytearray(good)
    bad[72] ^= 0xff  # the first chunk's length
    with pytest.raises(cfc.FormatError):
        cfc.decompress(bytes(bad), device="cuda")
    with pytest.raises(cfc.FormatError):
        cfc.pin(bytes(bad))


@pytest.mark.gpu
def test_gpu_refuses_bool_elements_other_than_0_and_1():
    raw = torch.tensor([0, 1, 1, 7] * 1000, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="element 3 of the bool tensor is the byte 7"):
        cfc.compress(raw.view(torch.bool), lossless=True)
    good = cfc.compress(raw != 0, lossless=True)
    assert bytes(good) == bytes(cfc.compress((raw != 0).cpu(), lossless=True))
    bad = bytearray(bytes(cfc.compress(raw, lossless=True)))
    bad[6] = 9  # relabelled bool
    with pytest.raises(cfc.FormatError, match="bool element"):
        cfc.decompress(bytes(bad), device="cuda")
    with pytest.raises(cfc.FormatError, match="bool element"):
        cfc.pin(bytes(bad))


@pytest.mark.gpu
def test_checkpoint_loads_onto_the_gpu(tmp_path):
    sd = model_state()
    p = tmp_path / "model.cfc"
    cfc.save({k: v.cuda() for k, v in sd.items()}, p)
    back = cfc.load(p, device="cuda")
    for k in sd:
        assert back[k].is_cuda and bits(back[k]) == bits(sd[k]), k


def test_compress_model_example_runs(tmp_path):
    """examples/compress_model.py on a small saved state_dict: every method listed, every bit
    back from cfc.save / cfc.load."""
    import pathlib
    import subprocess
    import sys

    sd = model_state()
    f = tmp_path / "sd.pt"
    torch.save(sd, f)
    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "compress_model.py"
    out = subprocess.run([sys.executable, str(example), "--state-dict", str(f), "--top", "3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "TOTAL" in out.stdout and "every bit back: True" in out.stdout
    for method in ("cfc lossless", "zstd -3", "bf16 cast"):
        assert method in out.stdout
    # a checkpoint that holds its state_dict among other things (the README's recipe saves
    # {"model": ..., "opt": ..., "cfc": ...}), with a dtype cfc does not store: its tensors by
    # dotted name, the other left out with a note (it stopped at a division by zero)
    torch.save({"model": sd, "cfc": {"step": 3}, "extra": [torch.zeros(3, dtype=torch.complex64)]}, f)
    out = subprocess.run([sys.executable, str(example), "--state-dict", str(f), "--top", "3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "left out: tensors of complex64" in out.stdout and "every bit back: True" in out.stdout
    assert f"{len(sd)} tensors" in out.stdout and "model." in out.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_gpu_fetch_in_pieces_is_bit_for_bit(dtype):
    # Frames of 24 MB or more are copied in pieces, each decoded once it has arrived.
    n = (40 << 20) // torch.tensor([], dtype=dtype).element_size() + 12345
    x = sample(dtype, n, seed=9)
    p = cfc.pin(cfc.compress(x, lossless=True))
    assert p.nbytes >= 2 * cfc._gpu._FETCH_PIECE and p._chunk_ends is not None
    torch.cuda.synchronize()
    y = cfc.decompress(p, device="cuda")
    assert bits(y) == bits(x)
    # The result is ordered on the current stream: work queued after it sees it complete.
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        z = cfc.decompress(p, device="cuda")
        checksum = z.view(torch.uint8).sum() if dtype != torch.bool else z.sum()
    s.synchronize()
    assert int(checksum) == int(np.frombuffer(bits(x), dtype=np.uint8).sum(dtype=np.int64))


def kinds(dtype, n, seed):
    """Inputs that make chunks take every method: weight-like samples, random bits (raw),
    random bits among zeros (sparse), zeros, and a constant."""
    yield "sample", sample(dtype, n, seed)
    if dtype == torch.bool:
        return
    size = torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.int64).to(torch.uint8).view(dtype)
    yield "random bits", noise
    keep = (torch.rand(n, generator=g) < 0.3).view(-1, 1).expand(n, size).reshape(-1)
    yield "sparse bits", torch.where(keep, noise.view(torch.uint8), 0).view(dtype)
    yield "zeros", torch.zeros(n, dtype=dtype)
    yield "constant", torch.full((n,), 3, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", LENGTHS + [(1 << 20) + 3])
def test_gpu_encoder_writes_the_cpu_bytes(dtype, n):
    for kind, x in kinds(dtype, n, seed=n + 2):
        want = bytes(cfc.compress(x, lossless=True))
        c = cfc.compress(x.cuda(), lossless=True)
        assert isinstance(c, cfc.CudaCompressed), kind
        assert bytes(c) == want, f"{kind}: GPU frame differs from the CPU's"
        assert bits(cfc.decompress(c)) == bits(x), kind


@pytest.mark.gpu
def test_gpu_encoder_every_method():
    x = four_methods(tail=77)
    for t in (x, x.view(torch.float32), x.view(torch.int16), x.view(torch.int8), x[:-1].view(torch.int64)):
        want = bytes(cfc.compress(t, lossless=True))
        assert bytes(cfc.compress(t.cuda(), lossless=True)) == want, t.dtype
