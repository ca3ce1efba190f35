"""The mlx-lm folder writer under hostile conditions (needs no MLX runtime: nothing is loaded): a
second run into the same folder is refused before any work, a killed run's work folder is cleared
by the next run, and a kill or an I/O error at every file-system step (llmq.checkpoint.crash_points)
leaves either nothing or the complete folder, and nothing else."""

import os

import pytest
import torch

from llmq.checkpoint import OutputBusyError
from llmq.checkpoint.crash_points import check_every_crash_point, digest, killed_at
from llmq_mlx import write_mlx_lm_folder
from mlx_testutil import random_canonical

CONFIG = {"model_type": "llama"}


def items():
    yield "model.embed_tokens.weight", torch.arange(48, dtype=torch.float32).reshape(12, 4)
    for i in range(3):
        yield f"model.layers.{i}.mlp.down_proj.weight", random_canonical((16, 128), 4, 64, seed=i)
        yield f"model.layers.{i}.input_layernorm.weight", torch.ones(128)


def write(out, stream=None, **kwargs):
    return write_mlx_lm_folder(out, stream if stream is not None else items(), CONFIG, max_shard_bytes=2048, **kwargs)


def test_a_second_run_is_refused_before_any_work(tmp_path):
    out = tmp_path / "out"
    refused, consumed = [], []

    def second_stream():
        consumed.append(True)
        yield from items()

    def first_stream():
        for i, item in enumerate(items()):
            if i == 3:
                with pytest.raises(OutputBusyError) as info:
                    write(out, second_stream())
                refused.append(str(info.value))
            yield item

    write(out, first_stream())
    assert refused == [f"{out}: another llmq run is writing there (pid {os.getpid()})"] and consumed == []
    write(tmp_path / "ref")
    assert digest(str(out)) == digest(str(tmp_path / "ref"))


def test_a_killed_runs_work_folder_is_cleared_by_the_next_run(tmp_path):
    out = tmp_path / "out"
    assert killed_at(lambda: write(out), 6) == 97  # killed with shards on disk
    assert os.listdir(tmp_path / "out.partial")  # what the kill left (it was a hidden folder per run before)
    write(out)
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_kill_or_failure_at_every_step_leaves_nothing_or_the_complete_folder(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
    torch.set_num_threads(1)  # the forked children run torch
    seen = check_every_crash_point(lambda out: write(out, tokenizer_files=[tmp_path / "tokenizer.json"]),
                                   str(tmp_path / "runs"),
                                   accept_refusal=lambda e: "output already exists" in str(e))
    assert any(s.endswith(": resumed") for s in seen) and any("refused" in s for s in seen)
    assert any(s.startswith("fail") for s in seen)
