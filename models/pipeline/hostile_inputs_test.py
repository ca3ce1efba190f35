"""Hostile and unlucky inputs through quantize_and_save's entry point: every one gives one stderr
line naming the key / flag / file, exit status 2, and nothing at --out.

The files are tiny and generated here (GGUFs under 1 KB by gguf-py's GGUFWriter), never downloaded.
"""

import os

import gguf
import numpy as np
import pytest

from models.gemma3.architecture import ARCHITECTURE as GEMMA3
from models.pipeline.cli_testing import assert_one_line_exit_2, run_main
from models.qwen.architecture import ARCHITECTURE as QWEN

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
    result = run_main(arch, list(args) + [f"--out={out}", "--noverify", "--progress=false"], tmp_path,
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


# ---- item: hostile GGUF tokenizer metadata -------------------------------------------------------

def _qwen_gguf(path, tokenizer_kv):
    from models.pipeline.gguf_input_test import _write_gguf

    _write_gguf(QWEN, path, extra_kv=tokenizer_kv)
    return str(path)


BAD_TOKENIZERS = {
    "integer merges": {"tokenizer.ggml.model": ("gpt2", T.STRING, None),
                       "tokenizer.ggml.merges": ([1, 2], T.ARRAY, T.UINT32)},
    "garbage merges": {"tokenizer.ggml.model": ("gpt2", T.STRING, None),
                       "tokenizer.ggml.merges": (["t1t2", "t1 t2 t3"], T.ARRAY, T.STRING)},
    "no unk for llama": {"tokenizer.ggml.model": ("llama", T.STRING, None)},
}


@pytest.mark.parametrize("case", sorted(BAD_TOKENIZERS))
def test_hostile_tokenizer_skips_the_text_check_with_a_note(case, tmp_path):
    """--verify on a GGUF whose tokenizer cannot be built: the logits check runs, the text check is
    skipped with a note naming the key, and the run exits 0 (it exited 1 with a traceback after
    publishing)."""
    path = _qwen_gguf(tmp_path / "m.gguf", BAD_TOKENIZERS[case])
    out = tmp_path / "out"
    code, stdout, stderr = run_main(QWEN, [f"--checkpoint={path}", f"--out={out}", "--verify",
                                              "--progress=false"], tmp_path, timeout=300)
    assert code == 0, stderr[-3000:]
    assert "text check" in stdout and "not run" in stdout, stdout[-3000:]
    assert "passed" in stdout


@pytest.mark.parametrize("case", sorted(BAD_TOKENIZERS))
def test_hostile_tokenizer_with_calibration_is_one_line_before_writing(case, tmp_path):
    path = _qwen_gguf(tmp_path / "m.gguf", BAD_TOKENIZERS[case])
    text = tmp_path / "text.txt"
    text.write_text("t1 t2 t3 " * 200)
    result, out = run_cli(QWEN, [f"--checkpoint={path}", f"--calibration_text={text}"], tmp_path)
    assert_refused(result, out, "--calibration_text", str(path))


@pytest.mark.parametrize("kv,words", [
    ({"tokenizer.ggml.tokens": ([1, 2, 3], T.ARRAY, T.UINT32)}, ["tokenizer.ggml.tokens", "element 0"]),
    ({"tokenizer.ggml.tokens": (["a", "b", "a"], T.ARRAY, T.STRING)}, ["tokenizer.ggml.tokens", "'a' twice"]),
    ({"tokenizer.ggml.merges": ([1, 2], T.ARRAY, T.UINT32)}, ["tokenizer.ggml.merges", "element 0"]),
    ({"tokenizer.ggml.merges": (["ab"], T.ARRAY, T.STRING)}, ["tokenizer.ggml.merges", "one space"]),
    ({"tokenizer.ggml.bos_token_id": (1 << 40, T.UINT64, None)}, ["tokenizer.ggml.bos_token_id", "outside"]),
    ({"tokenizer.ggml.model": (7, T.UINT32, None)}, ["tokenizer.ggml.model", "string"]),
    ({"tokenizer.ggml.scores": ([0.0], T.ARRAY, T.FLOAT32)}, ["tokenizer.ggml.scores", "elements"]),
])
def test_tokenizer_metadata_is_checked_in_one_line(kv, words, tmp_path):
    from models.common.tokenizer import load_tokenizer

    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen35moe")
    base = {"tokenizer.ggml.model": ("gpt2", T.STRING, None),
            "tokenizer.ggml.tokens": (["a", "b", "ab"], T.ARRAY, T.STRING)}
    for key, (value, vtype, sub) in {**base, **kv}.items():
        writer.add_key_value(key, value, vtype, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert os.path.getsize(path) < 1024
    with pytest.raises(ValueError) as e:
        load_tokenizer(str(path))
    assert "\n" not in str(e.value)
    for word in words:
        assert word in str(e.value)



def test_tokenizer_ids_outside_the_model_skip_the_text_check(tmp_path):
    """A vocabulary larger than the model's: the prompt's ids would index past the embedding after
    publishing; the text check is skipped with a note instead."""
    from models.pipeline.verify import _text_check_tokenizer

    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen35moe")
    writer.add_key_value("tokenizer.ggml.model", "llama", T.STRING)
    tokens = ["<unk>", "<s>"] + list(dict.fromkeys("The capital of France is\u2581"))
    writer.add_key_value("tokenizer.ggml.tokens", tokens, T.ARRAY, sub_type=T.STRING)
    writer.add_key_value("tokenizer.ggml.scores", [0.0] * len(tokens), T.ARRAY, sub_type=T.FLOAT32)
    writer.add_key_value("tokenizer.ggml.unknown_token_id", 0, T.UINT32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tokenizer, skipped = _text_check_tokenizer(str(path), 3)
    assert tokenizer is None and "outside the model's vocabulary of 3" in skipped
    tokenizer, skipped = _text_check_tokenizer(str(path), 100)
    assert tokenizer is not None and skipped is None


# ---- item: unbounded inputs ----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "folder"])
def test_calibration_text_must_be_a_regular_file(kind, tmp_path):
    if kind == "fifo":
        text = tmp_path / "text.fifo"
        os.mkfifo(text)  # opening it for reading blocked forever
    elif kind == "folder":
        text = tmp_path
    else:
        text = kind
    result, out = run_cli(QWEN, [f"--calibration_text={text}"], tmp_path, timeout=60)
    assert_refused(result, out, "--calibration_text", str(text))


def test_calibration_reads_only_a_prefix_of_the_text(tmp_path):
    """The tokens asked for come from the text's beginning: bytes far past them are never read (here
    invalid UTF-8 at 4 MiB, which reading the whole file refused)."""
    from models.pipeline.calibration import read_tokens

    class Words:  # a tokenizer of whitespace-separated words, counting the characters it is given
        seen = 0

        def encode(self, text):
            Words.seen = max(Words.seen, len(text))
            return [len(w) for w in text.split()]

    text = tmp_path / "text.txt"
    with open(text, "wb") as f:
        f.write(b"word " * ((4 << 20) // 5) + b"\xff\xfe" + b"word " * 1000)
    ids = read_tokens(str(text), Words(), 512)
    assert ids.tolist() == [4] * 512
    assert Words.seen <= 1 << 17, Words.seen
    # and a short text is read to its end
    short = tmp_path / "short.txt"
    short.write_text("a bb ccc")
    assert read_tokens(str(short), Words(), 512).tolist() == [1, 2, 3]


# ---- item: flags that would be ignored -----------------------------------------------------------

def test_requantize_gguf_on_safetensors_is_refused(tmp_path):
    result, out = run_cli(QWEN, ["--requantize_gguf"], tmp_path)
    assert_refused(result, out, "--requantize_gguf", "gguf")


def test_calibration_text_with_a_backend_that_quantizes_itself_is_refused(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("hello world " * 100)
    result, out = run_cli(QWEN, [f"--calibration_text={text}", "--backend=hf-compressed-tensors",
                                 "--recipe=nvfp4"], tmp_path)
    assert_refused(result, out, "--calibration_text", "hf-compressed-tensors")
