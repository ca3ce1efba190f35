"""The HF export (write_hf_quantized_checkpoint) under hostile conditions: a second run into the
same folder, a work folder somebody else left, an output that appears meanwhile, and a kill or an
I/O error at every file-system step (llmq.checkpoint.crash_points)."""

import os

import pytest
import torch

from llmq.checkpoint import CheckpointError, OutputBusyError
from llmq.checkpoint.crash_points import check_every_crash_point, digest
from llmq.export import write_hf_quantized_checkpoint
from llmq.quant.presets import INT4, NVFP4


def tensors():
    g = torch.Generator().manual_seed(3)
    yield "model.embed_tokens.weight", torch.randn(32, 64, generator=g).to(torch.bfloat16)
    for i in range(2):
        for proj in ("q_proj", "k_proj", "v_proj"):
            yield f"model.layers.{i}.self_attn.{proj}.weight", torch.randn(64, 64, generator=g).to(torch.bfloat16)
        yield f"model.layers.{i}.mlp.down_proj.weight", torch.randn(64, 64, generator=g).to(torch.bfloat16)
        yield f"model.layers.{i}.input_layernorm.weight", torch.ones(64, dtype=torch.bfloat16)


def recipe(fqn):
    if fqn.endswith("embed_tokens"):
        return None
    return INT4 if fqn.endswith("down_proj") else NVFP4


def write(out, stream=None, **kwargs):
    kwargs = {"style": "compressed-tensors", "max_shard_bytes": 12_000, "resume": True, **kwargs}
    return write_hf_quantized_checkpoint(str(out), stream if stream is not None else tensors(), recipe,
                                         config={"model_type": "qwen3"}, **kwargs)


def test_a_second_run_into_the_same_folder_is_refused_at_once(tmp_path):
    out = tmp_path / "out"
    refused = []

    def first_stream():
        for i, item in enumerate(tensors()):
            if i == 5:  # the first run holds the lock and has written shards
                before = _contents(tmp_path / "out.partial")
                for resume in (True, False):
                    with pytest.raises(OutputBusyError) as info:
                        write(out, resume=resume, style="modelopt")
                    refused.append(str(info.value))
                after = _contents(tmp_path / "out.partial")
                # nothing touched: every file as it was, except that the first run's own writer thread
                # may still be appending queued tensors to its open shard (.part) meanwhile
                assert sorted(after) == sorted(before)
                for name, data in before.items():
                    assert after[name].startswith(data) if name.endswith(".part") else after[name] == data, name
            yield item

    write(out, first_stream())
    assert refused == [f"{out}: another llmq run is writing there (pid {os.getpid()})"] * 2
    write(tmp_path / "ref")
    assert digest(str(out)) == digest(str(tmp_path / "ref"))
    assert sorted(os.listdir(tmp_path)) == ["out", "ref"]


@pytest.mark.parametrize("resume", [True, False])
def test_a_work_folder_llmq_did_not_make_is_refused_untouched(tmp_path, resume):
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / "notes.txt").write_text("mine")
    (partial / "model.safetensors").write_bytes(b"not ours")
    with pytest.raises(CheckpointError) as info:
        write(tmp_path / "out", resume=resume)
    assert str(info.value).startswith(f"{partial}: exists without an llmq journal") and "\n" not in str(info.value)
    assert digest(str(partial)) == {"model.safetensors": digest_of(b"not ours"), "notes.txt": digest_of(b"mine")}
    assert not (tmp_path / "out").exists()


def _contents(folder):
    return {name: (folder / name).read_bytes() for name in os.listdir(folder)}


def digest_of(data):
    import hashlib

    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_output_that_appears_meanwhile_is_never_deleted(tmp_path, overwrite):
    out = tmp_path / "out"

    def stream():
        for i, item in enumerate(tensors()):
            if i == 3:
                out.mkdir()
                (out / "theirs.txt").write_text("made by somebody else")
            yield item

    with pytest.raises(CheckpointError) as info:
        write(out, stream(), overwrite=overwrite)
    assert str(info.value).startswith(f"{out}: appeared while this run was writing")
    assert os.listdir(out) == ["theirs.txt"]
    os.rename(out, tmp_path / "moved")
    write(out)  # the finished work folder is published by the rerun, nothing recomputed
    write(tmp_path / "ref")
    assert digest(str(out)) == digest(str(tmp_path / "ref"))


def test_a_kill_or_failure_at_every_step_resumes_byte_identically_and_leaves_nothing(tmp_path):
    """Killed at any os.write/pwrite/fsync/rename/unlink/... (a forked child dying there), the rerun
    gives the uninterrupted folder (a kill while the shards get their final names included), or
    refuses in one line when the folder was already published; an injected EIO fails the run in one
    line with nothing published. Nothing is left next to the output."""
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
    torch.set_num_threads(1)  # the forked children run torch
    seen = check_every_crash_point(lambda out: write(out, extra_files=[str(tmp_path / "tokenizer.json")]),
                                   str(tmp_path / "runs"),
                                   accept_refusal=lambda e: "output already exists" in str(e))
    assert any(s.endswith(": resumed") for s in seen) and any("refused" in s for s in seen)
    assert any(s.startswith("fail") for s in seen)


def test_a_full_disk_in_a_shard_leaves_no_partial_shard_and_resumes(tmp_path, monkeypatch):
    import errno

    from llmq.checkpoint import OutputWriteError

    real_pwrite, calls = os.pwrite, []

    def pwrite(fd, data, offset):  # the disk fills up in the second shard, after its first write
        if any(n.endswith(".tmp.safetensors") for n in os.listdir(tmp_path / "out.partial")):
            calls.append(1)
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(OutputWriteError) as info:
        write(tmp_path / "out")
    monkeypatch.undo()
    assert str(info.value).endswith(".part: No space left on device") and "\n" not in str(info.value)
    left = os.listdir(tmp_path / "out.partial")
    assert not [n for n in left if n.endswith(".part")], left  # the unfinished shard was dropped
    assert any(n.endswith(".tmp.safetensors") for n in left), left  # finished ones kept for the resume
    summary = write(tmp_path / "out")
    assert summary.resumed_tensors > 0
    write(tmp_path / "ref")
    assert digest(str(tmp_path / "out")) == digest(str(tmp_path / "ref"))
