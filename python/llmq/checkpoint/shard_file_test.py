"""StreamingShardFile: files written tensor by tensor read back with safetensors.safe_open
(the reference reader) bit for bit, in every dtype the writers emit; fits() refuses what
would break the size limit, alignment or header gap."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from llmq.checkpoint.shard_file import StreamingShardFile, header_reserve


def _tensors():
    gen = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(33, 17, generator=gen).to(torch.bfloat16),
        "a.codes": torch.randint(0, 255, (8, 24), generator=gen, dtype=torch.uint8),
        "a.fp8": torch.randn(16, 16, generator=gen).to(torch.float8_e4m3fn),
        "a.scale": torch.rand(4, 1, generator=gen),
        "zero-d": torch.tensor(3.5),
        "t.view": torch.randn(16, 8, generator=gen).t(),  # non-contiguous
        "h": torch.randn(5, generator=gen).to(torch.float16),
        "i": torch.arange(6, dtype=torch.int32).reshape(2, 3),
    }


def _read(path):
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def test_round_trip_through_safe_open(tmp_path):
    path = str(tmp_path / "x.safetensors")
    f = StreamingShardFile(path, 4096, {"format": "pt"})
    want = _tensors()
    for name, t in sorted(want.items(), key=lambda kv: -kv[1].element_size()):  # aligned order
        assert f.fits(name, t, 1 << 30)
        f.add(name, t)
    f.close()
    got, meta = _read(path)
    assert meta == {"format": "pt"}
    assert set(got) == set(want)
    for k in want:
        _same(got[k], want[k])
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    assert n == 4096 - 8 and os.path.getsize(path) == 4096 + sum(t.numel() * t.element_size() for t in want.values())
    assert list(k for k in header if k != "__metadata__") == [k for k, _ in sorted(want.items(), key=lambda kv: -kv[1].element_size())]


def test_fits_refuses_size_alignment_and_header_overflow(tmp_path):
    f = StreamingShardFile(str(tmp_path / "y.safetensors"), 4096)
    odd = torch.zeros(3, dtype=torch.uint8)
    assert f.fits("odd", odd, 10)
    f.add("odd", odd)
    assert not f.fits("f", torch.zeros(2), 1 << 20)  # offset 3 is not a multiple of 4
    assert f.fits("u", torch.zeros(5, dtype=torch.uint8), 8)
    assert not f.fits("u", torch.zeros(6, dtype=torch.uint8), 8)  # 3 + 6 > 8
    assert not f.fits("n" * 5000, torch.zeros(1, dtype=torch.uint8), 1 << 20)  # header gap
    with pytest.raises(ValueError, match="outgrow its 4096-byte reserve"):
        f.add("n" * 5000, torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="written twice"):
        f.add("odd", odd)
    f.close()
    got, _ = _read(f.path)
    _same(got["odd"], odd)


def test_header_reserve_grows_with_shard_size():
    assert header_reserve(1 << 20) == 4096
    assert header_reserve(5 << 30) == 1 << 20


def test_a_failed_background_write_is_raised_naming_file_and_tensor(tmp_path, monkeypatch):
    """Writes run on the file's writer thread: a failure there comes back to the caller (at the
    next add or at close) naming the file and the tensor, and later queued writes are dropped."""
    from llmq.checkpoint import shard_file
    from llmq.checkpoint.errors import OutputWriteError

    real, written = shard_file.write_all, []

    def full_disk(fd, mv, offset):
        if written:  # the first tensor lands; the second fails
            raise OSError(5, "Input/output error")
        written.append(offset)
        real(fd, mv, offset)

    monkeypatch.setattr(shard_file, "write_all", full_disk)
    path = str(tmp_path / "x.safetensors")
    f = StreamingShardFile(path, header_reserve(1 << 20))
    with pytest.raises(OutputWriteError, match=r"x\.safetensors.*b\.weight.*Input/output error") as e:
        for name in ("a.weight", "b.weight", "c.weight", "d.weight"):
            f.add(name, torch.ones(64, 64))
        f.close()
    assert e.value.tensor == "b.weight" and written == [f.reserve]  # nothing after the failure was written
    f.discard()
    assert not os.path.exists(path)
