"""Model-free --backend=gguf (models/pipeline/generic_gguf.py) on tiny random transformers checkpoints of Llama,
Qwen3, Mistral, Qwen3-MoE and Mixtral, read back by gguf-py (the independent reader).

Each file is read with gguf.GGUFReader and dequantized with gguf.quants.dequantize; every tensor, its name looked
up in gguf-py's own table and llama.cpp's q/k row order undone here (numpy, as llama.cpp's converter writes it)
and expert stacks split, equals llmq's own dequantization of the same weight (the bundle written with the same
recipe) exactly. The metadata keys llama.cpp reads hold the config's values, the tokenizer is the folder's, and
--verify (the file read back through llmq's GGUF import and run in transformers' own class) passes. Refusals:
a model_type outside the table, and a config llama.cpp's graph would run differently, each one line before
any work.
"""

import json
import os
import shutil

import gguf
import numpy as np
import pytest
import torch

import llmq_gguf.backend  # noqa: F401  --backend=gguf registered
import models.architectures  # noqa: F401
from llmq.checkpoint import load_bundle
from llmq.quant import QuantRecipe
from llmq.quant.formats import GroupQuantizedWeight, dequantize_canonical
from llmq_gguf.backend import recipe_as_blocks
from models.pipeline.cli_testing import assert_one_line_exit_2, run_main
from models.pipeline.default_model import write_tiny_tokenizer
from models.pipeline.generic import generic_architecture
from models.pipeline.inputs import read_hf_config
from models.pipeline.run import run

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
CONFIGS = {
    "llama": dict(COMMON, rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
    "qwen3": dict(COMMON, head_dim=32),  # head_dim != hidden / heads: key_length / value_length
    "mistral": dict(COMMON, sliding_window=None, num_key_value_heads=1),
    "qwen3_moe": dict(COMMON, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=1, norm_topk_prob=True),
    "mixtral": dict(COMMON, num_local_experts=4, num_experts_per_tok=2),
}
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}
# One GGUF block type per kind of matrix (tiny rows: no K-quant tiles them); routers and norms kept (F32).
RECIPE = {"name": "blocks", "rules": [
    {"pattern": r".*\.self_attn\.[qk]_proj", "config": {"format": "int", "bits": 5, "group_size": 32}},
    {"pattern": r".*\.self_attn\.v_proj", "config": {"format": "int", "bits": 8, "group_size": 32}},
    {"pattern": r".*\.self_attn\.o_proj", "config": {"format": "int", "bits": 4, "group_size": 32,
                                                       "symmetric": False}},
    {"pattern": r".*\.(down_proj|w2)", "config": {"format": "int", "bits": 5, "group_size": 32, "symmetric": False}},
    {"pattern": r".*\.(gate_proj|up_proj|w1|w3)", "config": {"format": "q4_0", "bits": 4, "group_size": 32}},
    {"pattern": r".*(embed_tokens|lm_head)", "config": {"format": "int", "bits": 8, "group_size": 32}},
]}


def _checkpoint(root, model_type, fields=None):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = os.path.join(str(root), model_type)
    if not os.path.isdir(folder):
        torch.manual_seed(0)
        config = AutoConfig.for_model(model_type, **(fields or CONFIGS[model_type]))
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        write_tiny_tokenizer(folder, config.vocab_size)  # byte-level BPE tokenizer.json: gguf-py's BpeVocab
    return folder


def _run(folder, out, recipe, backend="gguf", verify=False):
    arch = generic_architecture(folder, read_hf_config(folder))
    return run(arch, checkpoint=folder, recipe=recipe, backend=backend, out=str(out), resume=False,
               max_shard_size=1 << 30, verify=verify, seed=0, progress=False)


def _gguf_names(arch_name, hf_names, blocks):
    """{GGUF name: (HF name, expert index or None)} of a checkpoint's tensors by gguf-py's own table (experts
    by their stack's name, as llama.cpp's converter hands them to it)."""
    import re

    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch_name], blocks)
    out = {}
    for name in hf_names:
        m = re.match(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$", name)
        asked = f"{m[1]}.{m[3]}.weight" if m else name
        gguf_name = table.get_name(asked, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, asked
        out.setdefault(gguf_name, []).append((name, int(m[2]) if m else None))
    return out


def _llama_cpp_rows_undone(values, heads):
    """llama.cpp's converter stores q/k of arch llama as w.reshape(heads, 2, d/2, K).swapaxes(1, 2): undone."""
    rows, k = values.shape
    return values.reshape(heads, rows // heads // 2, 2, k).swapaxes(1, 2).reshape(rows, k)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{model_type: (checkpoint, GGUF run result, GGUF path, bundle path)}, written once per module."""
    root = tmp_path_factory.mktemp("generic-gguf")
    recipe = root / "recipe.json"
    recipe.write_text(json.dumps(RECIPE))
    blocks = root / "blocks.json"  # the recipe as the gguf backend takes it (int -> block formats), for the bundle
    recipe_as_blocks(QuantRecipe.from_file(str(recipe))).to_file(str(blocks))
    cache = {}

    def get(model_type):
        if model_type not in cache:
            folder = _checkpoint(root / "ckpt", model_type)
            result = _run(folder, root / f"{model_type}-gguf", str(recipe), verify=True)
            _run(folder, root / f"{model_type}-bundle", str(blocks), backend="bundle")
            cache[model_type] = (folder, result, str(root / f"{model_type}-gguf" / "model.gguf"),
                                 str(root / f"{model_type}-bundle"))
        return cache[model_type]

    return get


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_gguf_reads_back_exactly_with_gguf_py(written, model_type):
    folder, result, path, bundle = written(model_type)
    assert result["verification_failure"] is None and result["cosine"] > 0.9, result.get("cosine")
    hf = read_hf_config(folder)
    arch = GGUF_ARCH[model_type]
    ours = load_bundle(bundle)
    names = _gguf_names(arch.upper(), ours, hf["num_hidden_layers"])
    reader = gguf.GGUFReader(path)
    read = {t.name: (t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type).reshape(
        tuple(reversed([int(d) for d in t.shape])))) for t in reader.tensors}
    assert set(read) == set(names)
    permuted = arch == "llama"
    for gguf_name, (_, values) in read.items():
        for hf_name, expert in names[gguf_name]:
            value = ours[hf_name]
            want = (dequantize_canonical(value) if isinstance(value, GroupQuantizedWeight) else value.float()).numpy()
            got = values[expert] if expert is not None else values
            if permuted and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = hf["num_attention_heads"] if "q_proj" in hf_name else hf["num_key_value_heads"]
                assert not np.array_equal(got, want), hf_name  # llama.cpp's row order differs from HF's
                got = _llama_cpp_rows_undone(got, heads)
            assert np.array_equal(got.astype(np.float32), want.astype(np.float32)), (gguf_name, hf_name)
    types = {name: kind for name, (kind, _) in read.items()}
    assert types["blk.0.attn_q.weight"] == "Q5_0" and types["blk.1.attn_k.weight"] == "Q5_0"
    assert types["blk.0.attn_v.weight"] == "Q8_0" and types["blk.0.attn_output.weight"] == "Q4_1"
    assert types["token_embd.weight"] == "Q8_0" and types["output.weight"] == "Q8_0"
    assert types["blk.0.attn_norm.weight"] == "F32"
    if "moe" in model_type or model_type == "mixtral":
        assert types["blk.1.ffn_gate_exps.weight"] == "Q4_0" and types["blk.1.ffn_down_exps.weight"] == "Q5_1"
        assert types["blk.1.ffn_gate_inp.weight"] == "F32"  # the router, kept
        assert read["blk.1.ffn_up_exps.weight"][1].shape == (4, hf.get("moe_intermediate_size", 128), 64)
    else:
        assert types["blk.0.ffn_gate.weight"] == "Q4_0" and types["blk.0.ffn_down.weight"] == "Q5_1"


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_metadata_llama_cpp_reads(written, model_type):
    folder, _, path, _ = written(model_type)
    hf = read_hf_config(folder)
    fields = gguf.GGUFReader(path).fields
    arch = GGUF_ARCH[model_type]

    def key(name):
        return fields[f"{arch}.{name}"].contents()

    assert fields["general.architecture"].contents() == arch
    assert key("block_count") == hf["num_hidden_layers"] and key("embedding_length") == hf["hidden_size"]
    assert key("context_length") == hf["max_position_embeddings"]
    assert key("feed_forward_length") == hf["intermediate_size"]
    assert key("attention.head_count") == hf["num_attention_heads"]
    assert key("attention.head_count_kv") == hf["num_key_value_heads"]
    assert key("attention.layer_norm_rms_epsilon") == pytest.approx(hf["rms_norm_eps"], rel=1e-6)  # float32
    assert key("rope.freq_base") == hf["rope_parameters"]["rope_theta"]
    if "head_dim" in CONFIGS[model_type]:
        assert key("attention.key_length") == key("attention.value_length") == hf["head_dim"]
    if arch == "llama":
        assert key("vocab_size") == hf["vocab_size"]
        assert key("rope.dimension_count") == (hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    if model_type in ("qwen3_moe", "mixtral"):
        assert key("expert_count") == 4 and key("expert_used_count") == 2
    if model_type == "qwen3_moe":
        assert key("expert_feed_forward_length") == hf["moe_intermediate_size"]
    # the folder's tokenizer (token id = byte), by gguf-py's vocabulary helpers
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == hf["vocab_size"] and fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["general.file_type"].contents() in {int(gguf.LlamaFileType[t]) for t in (
        "MOSTLY_Q4_0", "MOSTLY_Q5_0", "MOSTLY_Q5_1", "MOSTLY_Q8_0")}


def test_llama3_rope_writes_rope_freqs(tmp_path):
    """Llama 3.x's RoPE scaling is llama.cpp's rope_freqs tensor (its converter's factors), not a key."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    folder = _checkpoint(tmp_path, "llama", fields=dict(COMMON, rope_parameters=rope))
    _run(folder, tmp_path / "out", "int4")
    reader = gguf.GGUFReader(str(tmp_path / "out" / "model.gguf"))
    freqs = {t.name: np.asarray(t.data) for t in reader.tensors}["rope_freqs.weight"]
    dim = COMMON["hidden_size"] // COMMON["num_attention_heads"]
    wavelen = 2 * np.pi * 500000.0 ** (np.arange(0, dim, 2) / dim)
    assert freqs.shape == (dim // 2,)
    assert np.all(freqs[wavelen < 16 / 4] == 1.0) and np.all(freqs[wavelen > 16] == 8.0)
    assert ((freqs > 1) & (freqs < 8)).any()  # the smooth band in between


def test_refused_in_one_line_before_any_work(tmp_path):
    from models.pipeline.cli import main_model_free

    # a model_type outside the table: named, with the ones supported
    folder = str(tmp_path / "custom")
    shutil.copytree(_checkpoint(tmp_path, "llama"), folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["model_type"] = "llmq_test_custom"
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    result = run_main(None, [f"--checkpoint={folder}", "--backend=gguf", f"--out={tmp_path / 'a'}"], tmp_path,
                      entry=main_model_free)
    assert_one_line_exit_2(result, "--backend gguf", "'llmq_test_custom'", "llama, mistral, mixtral, qwen2, qwen3")
    assert not os.path.exists(tmp_path / "a")
    # Qwen3-MoE without renormalised top-k weights: llama.cpp's graph renormalises
    moe = _checkpoint(tmp_path, "qwen3_moe", fields=dict(CONFIGS["qwen3_moe"], norm_topk_prob=False))
    result = run_main(None, [f"--checkpoint={moe}", "--backend=gguf", f"--out={tmp_path / 'b'}"], tmp_path,
                      entry=main_model_free)
    assert_one_line_exit_2(result, "--backend gguf", "norm_topk_prob", "renormalises")
    assert not os.path.exists(tmp_path / "b")


def test_gguf_input_goes_out_as_it_came_in(tmp_path):
    """//models:quantize with a .gguf input and --backend=gguf: the model's own GGUF import and export (the
    per-model pipelines' path): every key carried over (file type updated), names and tokenizer as in the input.
    --requantize_gguf, so that the int4 recipe applies to the input's q8_0 blocks (else they keep their type)."""
    from models.gemma3.architecture import ARCHITECTURE as GEMMA3
    from models.pipeline.cli import main_model_free
    from models.pipeline.default_model import write_default_checkpoint

    checkpoint = write_default_checkpoint(GEMMA3, str(tmp_path / "ckpt"))
    write_tiny_tokenizer(checkpoint, 512)
    q8_0 = tmp_path / "q8_0.json"
    q8_0.write_text(json.dumps({"rules": [{"pattern": r".*(_proj|embed_tokens)", "config": {
        "format": "q8_0", "bits": 8, "group_size": 32}}]}))
    run(GEMMA3, checkpoint=checkpoint, recipe=str(q8_0), backend="gguf", out=str(tmp_path / "src"), resume=False,
        max_shard_size=1 << 30, verify=False, seed=0, progress=False)
    source = str(tmp_path / "src" / "model.gguf")
    code, out, err = run_main(None, [f"--checkpoint={source}", "--backend=gguf", "--recipe=int4",
                                     "--requantize_gguf", f"--out={tmp_path / 'out'}", "--noverify"], tmp_path, entry=main_model_free)
    assert code == 0, err[-3000:]
    before, after = gguf.GGUFReader(source), gguf.GGUFReader(str(tmp_path / "out" / "model.gguf"))
    for key, field in before.fields.items():
        if not key.startswith("GGUF.") and key != "general.file_type":
            assert after.fields[key].contents() == field.contents(), key
    assert before.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    assert after.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q4_0)
    assert [t.name for t in after.tensors] == [t.name for t in before.tensors]
    assert {t.name: t.tensor_type.name for t in after.tensors}["blk.0.attn_q.weight"] == "Q4_0"


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_llama_family_gguf_input_round_trips(written, model_type, tmp_path):
    """A GGUF this export wrote, as //models:quantize's --checkpoint: read model-free (its config and names
    rebuilt by gguf-py's table; the q/k row order and expert stacks undone), written again as GGUF: every key,
    name, block type and value as in the input (its blocks are kept; its float tensors are norms and routers,
    which the recipe keeps); --verify through transformers' class passes."""
    from models.pipeline.generic import model_free_architecture
    from models.pipeline.usage_error import UsageError

    _, _, source, _ = written(model_type)
    with pytest.raises(UsageError, match="--backend mlx: it needs model knowledge"):
        model_free_architecture(source, "mlx")  # refused before any work, as for the HF folder
    arch = model_free_architecture(source, "gguf")
    assert arch.name == model_type if model_type != "mistral" else arch.name == "llama"  # one GGUF arch: llama
    result = run(arch, checkpoint=source, recipe="int4", backend="gguf", out=str(tmp_path / "again"), resume=False,
                 max_shard_size=1 << 30, verify=True, seed=0, progress=False)
    assert result["verification_failure"] is None and result["tensor_errors"] == {}
    before, after = gguf.GGUFReader(source), gguf.GGUFReader(str(tmp_path / "again" / "model.gguf"))
    assert {k for k in after.fields if not k.startswith("GGUF.")} == {k for k in before.fields if not k.startswith(
        "GGUF.")}
    for key, field in before.fields.items():
        if not key.startswith("GGUF."):
            assert after.fields[key].contents() == field.contents(), key
    assert [t.name for t in after.tensors] == [t.name for t in before.tensors]
    for old, new in zip(before.tensors, after.tensors):
        assert old.tensor_type == new.tensor_type and np.array_equal(old.data, new.data), old.name
