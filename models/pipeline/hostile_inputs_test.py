"""Hostile and unlucky inputs through quantize_and_save's entry point: every one gives one stderr
line naming the key / flag / file, exit status 2, and nothing at --out.

The files are tiny and generated here (GGUFs under 1 KB by gguf-py's GGUFWriter), never downloaded.
"""

import os

import gguf
import numpy as np
import pytest

from models.gemma3.spec import ARCHITECTURE as GEMMA3
from models.pipeline.cli_testing import assert_one_line_exit_2, run_main
from models.qwen.spec import ARCHITECTURE as QWEN

T = gguf.GGUFValueType

# A Gemma 3 GGUF's hyper-parameters (arch-relative key -> (value, type)); the file holds one block.
GEMMA3_KV = {
    "block_count": (1, T.UINT32), "context_length": (64, T.UINT32), "embedding_length": (8, T.UINT32),
    "feed_forward_length": (16, T.UINT32), "attention.head_count": (2, T.UINT32),
    "attention.head_count_kv": (1, T.UINT32), "attention.key_length": (4, T.UINT32),
    "attention.value_length": (4, T.UINT32), "attention.layer_norm_rms_epsilon": (1e-6, T.FLOAT32),
    "attention.sliding_window": (4, T.UINT32),
}
QWEN_KV = {
    "block_count": (1, T.UINT32), "context_length": (64, T.UINT32), "embedding_length": (8, T.UINT32),
    "attention.head_count": (2, T.UINT32), "attention.head_count_kv": (1, T.UINT32),
    "attention.key_length": (4, T.UINT32), "attention.value_length": (4, T.UINT32),
    "attention.layer_norm_rms_epsilon": (1e-6, T.FLOAT32), "rope.freq_base": (1e4, T.FLOAT32),
    "full_attention_interval": (1, T.UINT32), "ssm.time_step_rank": (2, T.UINT32), "ssm.inner_size": (8, T.UINT32),
    "ssm.group_count": (1, T.UINT32), "ssm.conv_kernel": (4, T.UINT32), "ssm.state_size": (4, T.UINT32),
    "expert_feed_forward_length": (8, T.UINT32), "expert_shared_feed_forward_length": (8, T.UINT32),
    "expert_count": (2, T.UINT32), "expert_used_count": (1, T.UINT32),
}


def write_gguf(path, arch: str, kv, *, extra=None, tensors=None):
    """A GGUF with `kv` (arch-relative keys) plus `extra` (full keys), and small float32 tensors."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype) in {**{f"{arch}.{k}": v for k, v in kv.items()}, **(extra or {})}.items():
        if isinstance(value, list):
            writer.add_key_value(key, value, T.ARRAY, sub_type=vtype)
        else:
            writer.add_key_value(key, value, vtype)
    for name, shape in (tensors or {"token_embd.weight": (16, 8), "blk.0.attn_q.weight": (8, 8)}).items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def run_cli(arch, args, tmp_path, timeout=120):
    out = tmp_path / "out"
    result = run_main(arch, [], list(args) + [f"--out={out}", "--noverify", "--progress=false"], tmp_path,
                      timeout=timeout)
    return result, out


def assert_refused(result, out, *words):
    line = assert_one_line_exit_2(result, *words)
    assert not out.exists(), f"something was published at --out: {line}"
    return line


# ---- item: hostile GGUF hyper-parameters ---------------------------------------------------------

HYPER = [
    # (case, arch, key, value, type, words in the error)
    ("block_count 2^40", GEMMA3, "block_count", 1 << 40, T.UINT64, ["gemma3.block_count", "1099511627776", "1..1"]),
    ("block_count array", GEMMA3, "block_count", [1, 1], T.UINT32, ["gemma3.block_count", "integer"]),
    ("block_count string", GEMMA3, "block_count", "1", T.STRING, ["gemma3.block_count", "integer"]),
    ("head_count 0", GEMMA3, "attention.head_count", 0, T.UINT32, ["gemma3.attention.head_count", "0"]),
    ("head_count 2^40", GEMMA3, "attention.head_count", 1 << 40, T.UINT64, ["gemma3.attention.head_count"]),
    ("sliding_window_pattern 0", GEMMA3, "attention.sliding_window_pattern", 0, T.UINT32,
     ["gemma3.attention.sliding_window_pattern"]),
    ("sliding_window_pattern short array", GEMMA3, "attention.sliding_window_pattern", [True, False], T.BOOL,
     ["gemma3.attention.sliding_window_pattern", "1 booleans"]),
    ("rms epsilon nan", GEMMA3, "attention.layer_norm_rms_epsilon", float("nan"), T.FLOAT32,
     ["gemma3.attention.layer_norm_rms_epsilon", "finite"]),
    ("rope scaling type int", GEMMA3, "rope.scaling.type", 3, T.UINT32, ["gemma3.rope.scaling.type", "string"]),
    ("qwen block_count 2^40", QWEN, "block_count", 1 << 40, T.UINT64, ["qwen35moe.block_count"]),
    ("qwen time_step_rank 0", QWEN, "ssm.time_step_rank", 0, T.UINT32, ["qwen35moe.ssm.time_step_rank", "0"]),
    ("qwen group_count 0", QWEN, "ssm.group_count", 0, T.UINT32, ["qwen35moe.ssm.group_count"]),
    ("qwen interval 0", QWEN, "full_attention_interval", 0, T.UINT32, ["qwen35moe.full_attention_interval"]),
    ("qwen expert_used_count > experts", QWEN, "expert_used_count", 3, T.UINT32,
     ["qwen35moe.expert_used_count", "1..2"]),
]


@pytest.mark.parametrize("case,arch,key,value,vtype,words", HYPER, ids=[c[0] for c in HYPER])
def test_hostile_gguf_hyper_parameter_is_one_line(case, arch, key, value, vtype, words, tmp_path):
    base = GEMMA3_KV if arch is GEMMA3 else QWEN_KV
    path = write_gguf(tmp_path / "m.gguf", arch.gguf_import.GGUF_ARCH, {**base, key: (value, vtype)})
    assert os.path.getsize(path) < 2048
    result, out = run_cli(arch, [f"--checkpoint={path}"], tmp_path, timeout=60)
    assert_refused(result, out, path, *words)


# ---- item: wrong acceptances ---------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--budget_bits_per_weight=nan", "--verify_min_cosine=nan"])
def test_nan_flags_are_refused(flag, tmp_path):
    result, out = run_cli(QWEN, [flag], tmp_path)
    assert_refused(result, out, flag.split("=")[0], "finite")


def test_asymmetric_mxfp8_rule_is_refused_before_work(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rules:\n  - pattern: '.*'\n    config: {format: mxfp8, bits: 8, group_size: 32, symmetric: false}\n")
    result, out = run_cli(QWEN, [f"--recipe={recipe}", "--backend=hf-compressed-tensors"], tmp_path)
    assert_refused(result, out, "symmetric", "mxfp8")


def test_catastrophic_recipe_pattern_does_not_hang(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rules:\n  - pattern: '(.+)+!'\n    config: {bits: 4, group_size: 32}\n"
                      "  - pattern: '.*proj'\n    config: {bits: 8, group_size: 32}\n")
    result, out = run_cli(QWEN, [f"--recipe={recipe}"], tmp_path, timeout=200)
    assert result[0] == 0, result[2][-2000:]
    assert out.is_dir()


def test_recipe_fifo_is_refused(tmp_path):
    fifo = tmp_path / "r.yaml"
    os.mkfifo(fifo)
    result, out = run_cli(QWEN, [f"--recipe={fifo}"], tmp_path, timeout=60)
    assert_refused(result, out, str(fifo), "FIFO")


@pytest.fixture(scope="module")
def qwen_checkpoint(tmp_path_factory):
    from models.pipeline.default_model import write_default_checkpoint

    return write_default_checkpoint(QWEN, str(tmp_path_factory.mktemp("qwen") / "ckpt"), seed=1)


def _copy_with(folder, dest, change):
    """A copy of the HF folder `folder` at `dest` with change(tensors) applied to every shard."""
    import shutil

    import torch  # noqa: F401  (safetensors.torch needs it)
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    for f in os.listdir(dest):
        if f.endswith(".safetensors"):
            tensors = load_file(os.path.join(dest, f))
            change(tensors)
            save_file(tensors, os.path.join(dest, f), metadata={"format": "pt"})
    return str(dest)


@pytest.mark.parametrize("dtype", ["int32", "float8_e5m2", "bool", "float8_e4m3fn"])
def test_non_float_weight_is_refused_before_writing(dtype, qwen_checkpoint, tmp_path):
    import torch

    name = "model.layers.0.mlp.shared_expert.down_proj.weight"

    def change(tensors):
        if name in tensors:
            tensors[name] = tensors[name].to(getattr(torch, dtype))

    folder = _copy_with(qwen_checkpoint, tmp_path / "ckpt", change)
    result, out = run_cli(QWEN, [f"--checkpoint={folder}"], tmp_path)
    assert_refused(result, out, name, "stored as")
    assert not (tmp_path / "out.partial").exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_zero_element_tensor_with_huge_dim_is_a_checkpoint_error(tmp_path):
    import json
    import struct

    from llmq.checkpoint import UnsupportedCheckpointError, iter_checkpoint

    header = json.dumps({"a": {"dtype": "F32", "shape": [0, 1 << 63], "data_offsets": [0, 0]}}).encode()
    path = tmp_path / "z.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    assert os.path.getsize(path) < 128
    with pytest.raises(UnsupportedCheckpointError, match="64-bit"):
        dict(iter_checkpoint(str(path)))
    gguf_path = tmp_path / "z.gguf"
    writer = gguf.GGUFWriter(str(gguf_path), "gemma3")
    writer.add_tensor_info("a", (0, 1 << 63), np.float32, 0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with pytest.raises(UnsupportedCheckpointError, match="64-bit"):
        dict(iter_checkpoint(str(gguf_path)))


def test_gguf_integer_tensor_is_refused_before_writing(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    for key, (value, vtype) in GEMMA3_KV.items():
        writer.add_key_value(f"gemma3.{key}", value, vtype)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((8, 8), dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result, out = run_cli(GEMMA3, [f"--checkpoint={path}"], tmp_path)
    assert_refused(result, out, "blk.0.attn_q.weight", "stored as I32")
