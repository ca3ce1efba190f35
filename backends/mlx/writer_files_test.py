"""The mlx-lm folder writer's files: permissions follow the umask, a full disk is one line naming
the file and leaves no folder (needs no MLX runtime: nothing is loaded)."""

import errno
import os
import stat

import pytest
import torch

from llmq.checkpoint import OutputWriteError
from llmq_mlx import write_mlx_lm_folder
from mlx_testutil import random_canonical

CONFIG = {"model_type": "llama"}


def items():
    yield "model.embed_tokens.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4)
    yield "model.layers.0.mlp.down_proj.weight", random_canonical((16, 128), 4, 64, seed=1)


@pytest.fixture
def umask():
    old = os.umask(0o022)
    os.umask(old)

    def set_umask(mask):
        os.umask(mask)

    yield set_umask
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
@pytest.mark.parametrize("shard", [1 << 30, 1024])
def test_files_get_the_umask_permissions(tmp_path, umask, mask, shard):
    umask(mask)
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    os.chmod(tok, 0o600)  # the copy takes the umask's mode, not the source's
    out = write_mlx_lm_folder(tmp_path / "out", items(), CONFIG, tokenizer_files=[tok], max_shard_bytes=shard)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert any(n.startswith("model") and n.endswith(".safetensors") for n in modes)
    assert modes == {n: 0o666 & ~mask for n in modes}, modes
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask


def test_a_full_disk_is_one_line_naming_the_file(tmp_path, monkeypatch):
    def full(fd, data, offset):  # shard bytes go through os.pwrite (the streaming shard file)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OutputWriteError) as info:
        write_mlx_lm_folder(tmp_path / "out", items(), CONFIG)
    assert str(info.value) == f"{info.value.path}: No space left on device"
    assert info.value.path.startswith(str(tmp_path / "out.partial") + os.sep)
    assert list(tmp_path.iterdir()) == []  # nothing published, no debris

    monkeypatch.undo()
    real_write = os.write

    def enospc(fd, data):  # the journal, config.json and the index go through os.write
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", enospc)
    with pytest.raises(OutputWriteError, match=r"out\.partial/journal\.json: No space left on device$"):
        write_mlx_lm_folder(tmp_path / "out", items(), CONFIG)
    monkeypatch.setattr(os, "write", real_write)
    assert list(tmp_path.iterdir()) == []
