"""--backend=gguf end to end, read back by gguf-py (the independent reader).

Each model's tiny default (Gemma 3, Gemma 4), from its HF folder and then from the GGUF that run wrote, with a recipe using
every block type its shapes allow: each GGUF tensor, read with gguf.GGUFReader and dequantized with
gguf.quants.dequantize, equals llmq's own dequantization of the same quantized weight (the bundle of
the same run) exactly, and --verify's reload through llmq's GGUF import passes. The GGUF input's keys
are all carried over. Refusals: an int config without a block type, a row the K-quants cannot tile,
a model without a GGUF export -- each one line, before anything is written.
"""

import json
import os

import gguf
import numpy as np
import pytest

from llmq.backend import BackendError, WriteJob
from llmq.checkpoint import load_bundle
from llmq.quant.formats import GroupQuantizedWeight, dequantize_canonical
from llmq_gguf.backend import GGUFBackend
from models.gemma3.architecture import ARCHITECTURE as GEMMA3
from models.gemma4.architecture import ARCHITECTURE as GEMMA4
from models.pipeline import inputs
from models.pipeline.default_model import write_default_checkpoint, write_tiny_tokenizer
from models.pipeline.gguf_output import gguf_fields
from models.pipeline.quantize_and_save import UsageError, run
from models.qwen.architecture import ARCHITECTURE as QWEN

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Tiny Gemma 3 / 4: hidden 128, intermediate 256 (down_proj's rows are the only ones the K-quants tile).
RECIPE = {"name": "every-block", "rules": [
    {"pattern": r".*\.mlp\.down_proj", "layers": [0, 1], "config": {"format": "q4_k", "bits": 4, "group_size": 32,
                                                                     "symmetric": False}},
    {"pattern": r".*\.mlp\.down_proj", "layers": [2], "config": {"format": "q5_k", "bits": 5, "group_size": 32,
                                                                  "symmetric": False}},
    {"pattern": r".*\.mlp\.down_proj", "config": {"format": "q6_k", "bits": 6, "group_size": 16}},
    {"pattern": r".*\.mlp\.gate_proj", "config": {"format": "int", "bits": 4, "group_size": 32, "symmetric": False}},
    {"pattern": r".*\.mlp\.up_proj", "config": {"format": "q5_1", "bits": 5, "group_size": 32, "symmetric": False}},
    {"pattern": r".*\.self_attn\.[qk]_proj", "config": {"format": "int", "bits": 5, "group_size": 32}},
    {"pattern": r".*\.self_attn\.v_proj", "config": {"format": "int", "bits": 8, "group_size": 32}},
    {"pattern": r".*\.self_attn\.o_proj", "config": {"format": "int", "bits": 4, "group_size": 32}},
    {"pattern": r".*embed_tokens", "config": {"format": "q8_0", "bits": 8, "group_size": 32}},
]}
# Tiny Qwen3.5-MoE: no row of 256 (hidden 128, expert widths 64), so no K-quant.
QWEN_RECIPE = {"name": "every-32-block", "rules": [
    {"pattern": r".*\.experts\.gate_up_proj", "config": {"format": "q5_1", "bits": 5, "group_size": 32,
                                                         "symmetric": False}},
    {"pattern": r".*\.experts\.down_proj", "config": {"format": "int", "bits": 4, "group_size": 32, "symmetric": False}},
    {"pattern": r".*\.shared_expert\..*", "config": {"format": "int", "bits": 8, "group_size": 32}},
    {"pattern": r".*\.linear_attn\.(in_proj_qkv|in_proj_z|out_proj)", "config": {"format": "int", "bits": 5,
                                                                              "group_size": 32}},
    {"pattern": r".*\.self_attn\.[qkvo]_proj", "config": {"format": "q4_0", "bits": 4, "group_size": 32}},
    {"pattern": r"lm_head", "config": {"format": "q8_0", "bits": 8, "group_size": 32}},
]}


def _run(tmp_path, backend, recipe, checkpoint, out, verify=False, arch=GEMMA3):
    return run(arch, checkpoint=checkpoint, recipe=recipe, backend=backend, out=str(tmp_path / out), resume=True,
               max_shard_size=1 << 20, verify=verify, seed=0, progress=False)


def _recipe(tmp_path, recipe=RECIPE):
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    return str(path)


def _expected(arch, checkpoint, kind, bundle):
    """{GGUF name: llmq's float32 value} of a bundle's tensors, through the model's own GGUF naming."""
    source = inputs.open_input(arch, checkpoint, kind)
    to_gguf = gguf_fields(arch, source)["to_gguf"]
    out = {}
    for name, value in load_bundle(bundle).items():
        for gname, gvalue in to_gguf(name, value).items():
            out[gname] = (dequantize_canonical(gvalue) if isinstance(gvalue, GroupQuantizedWeight)
                          else gvalue.float()).numpy()
    return out


def _read(path):
    reader = gguf.GGUFReader(path)
    tensors = {t.name: (t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type).reshape(
        tuple(reversed([int(d) for d in t.shape])))) for t in reader.tensors}
    return reader, tensors


def _check_exact(gguf_path, expected, skip=()):
    reader, tensors = _read(gguf_path)
    assert set(tensors) == set(expected)
    for name, (_, values) in tensors.items():
        if name not in skip:
            assert np.array_equal(values.astype(np.float32), expected[name].astype(np.float32)), name
    return reader, tensors


@pytest.fixture(scope="module", params=[GEMMA3, GEMMA4, QWEN], ids=lambda a: a.name)
def hf_run(request, tmp_path_factory):
    arch = request.param
    tmp = tmp_path_factory.mktemp("hf")
    checkpoint = write_default_checkpoint(arch, str(tmp / "ckpt"))
    write_tiny_tokenizer(checkpoint, 512)  # a byte-level BPE tokenizer.json, read by gguf-py's BpeVocab
    recipe = _recipe(tmp, QWEN_RECIPE if arch is QWEN else RECIPE)
    result = _run(tmp, "gguf", recipe, checkpoint, "out", verify=True, arch=arch)
    # the same recipe as the gguf backend takes it, written by the bundle (llmq's own values)
    from llmq.quant import QuantRecipe
    from llmq_gguf.backend import recipe_as_blocks

    blocks = tmp / "blocks.json"
    recipe_as_blocks(QuantRecipe.from_file(recipe)).to_file(blocks)
    _run(tmp, "bundle", str(blocks), checkpoint, "bundle", arch=arch)
    return arch, tmp, checkpoint, result


def test_hf_input_reads_back_exactly_with_gguf_py(hf_run):
    arch, tmp, checkpoint, result = hf_run
    assert result["verification_failure"] is None and result["cosine"] > 0.9
    reader, tensors = _check_exact(str(tmp / "out" / "model.gguf"),
                                   _expected(arch, checkpoint, "hf", str(tmp / "bundle")))
    types = {name: t for name, (t, _) in tensors.items()}
    fields = reader.fields
    assert fields["general.architecture"].contents() == gguf_fields(arch, inputs.open_input(arch, checkpoint, "hf"))[
        "gguf_arch"]
    assert len(fields["tokenizer.ggml.tokens"].contents()) == 512
    if arch is QWEN:
        assert {types["blk.0.ffn_gate_exps.weight"], types["blk.0.ffn_up_exps.weight"]} == {"Q5_1"}
        assert types["blk.0.ffn_down_exps.weight"] == "Q4_1" and types["blk.0.ffn_up_shexp.weight"] == "Q8_0"
        assert types["blk.0.attn_qkv.weight"] == "Q5_0" and types["blk.3.attn_q.weight"] == "Q4_0"
        assert types["output.weight"] == "Q8_0" and types["blk.0.ssm_a"] == "F32"
        assert fields["qwen35moe.full_attention_interval"].contents() == 4
        return
    assert {types[f"blk.{i}.ffn_down.weight"] for i in range(6)} == {"Q4_K", "Q5_K", "Q6_K"}
    assert types["blk.0.ffn_gate.weight"] == "Q4_1" and types["blk.0.ffn_up.weight"] == "Q5_1"
    assert types["blk.0.attn_q.weight"] == "Q5_0" and types["blk.0.attn_v.weight"] == "Q8_0"
    assert types["blk.0.attn_output.weight"] == "Q4_0" and types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.attn_norm.weight"] == "F32" and "output.weight" not in types  # tied
    assert fields[f"{arch.name}.block_count"].contents() == 6
    assert fields[f"{arch.name}.attention.key_length"].contents() == 64  # both: the full layers' head dim


def test_gguf_input_carries_every_key_and_reads_back_exactly(hf_run, tmp_path):
    arch, tmp, _, _ = hf_run
    source = str(tmp / "out" / "model.gguf")
    result = _run(tmp_path, "gguf", "int4", source, "again", verify=True, arch=arch)
    assert result["verification_failure"] is None
    _run(tmp_path, "bundle", "int4", source, "bundle", arch=arch)
    written = str(tmp_path / "again" / "model.gguf")
    # Gemma 3's embedding, imported dequantized, is quantized again by its int4 recipe (int8 g32): q8_0 in the
    # GGUF, int8 with float32 scales in the bundle; compared with the source's blocks below instead
    embedding = ("token_embd.weight",) if arch is GEMMA3 else ()
    reader, tensors = _check_exact(written, _expected(arch, source, "gguf", str(tmp_path / "bundle")), skip=embedding)
    before = gguf.GGUFReader(source).fields
    for key, field in before.items():
        if not key.startswith("GGUF.") and key != "general.file_type":
            assert reader.fields[key].contents() == field.contents(), key
    # the imported blocks went back as the same block types and values (but the Gemma embedding, which the
    # import dequantizes: Gemma 4's int4 recipe keeps it, F32; Gemma 3's quantizes it at 8 bits, q8_0 again)
    _, src = _read(source)
    for name, (t, values) in src.items():
        if t.startswith("Q") and not (name == "token_embd.weight" and arch is not QWEN):
            assert tensors[name][0] == t and np.array_equal(tensors[name][1], values), name
    if arch is GEMMA4:
        assert tensors["token_embd.weight"][0] == "F32"
    for name in embedding:
        assert tensors[name][0] == "Q8_0", tensors[name][0]
        if src[name][0] == "Q8_0":  # q8_0 of q8_0 values: llama.cpp's rounding gives the same blocks back
            assert np.array_equal(tensors[name][1], src[name][1]), name
    weights = {}
    for t, values in tensors.values():
        weights[t] = weights.get(t, 0) + values.size
    dominant = max((t for t in weights if t.startswith("Q")), key=weights.get)
    assert reader.fields["general.file_type"].contents() == int(
        gguf.LlamaFileType[{"Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M"}.get(dominant, "MOSTLY_" + dominant)])


@pytest.mark.parametrize("rule, message", [
    ({"pattern": ".*", "config": {"format": "int", "bits": 3, "group_size": 32}}, "int3 g32 sym has no GGUF block type"),
    ({"pattern": ".*", "config": {"format": "int", "bits": 4, "group_size": 64}}, "int4 g64 sym has no GGUF block type"),
    ({"pattern": r".*\.mlp\.gate_proj", "config": {"format": "q4_k", "bits": 4, "group_size": 32, "symmetric": False}},
     "q4_k (Q4_K) needs rows of a multiple of 256 elements, got K=128"),
])
def test_refused_in_one_line_before_any_work(tmp_path, rule, message):
    checkpoint = write_default_checkpoint(GEMMA3, str(tmp_path / "ckpt"))
    with pytest.raises(UsageError) as e:
        _run(tmp_path, "gguf", _recipe(tmp_path, {"rules": [rule]}), checkpoint, "out")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "out")


def test_model_without_gguf_export_is_refused(tmp_path):
    job = WriteJob(out=str(tmp_path / "out"), recipe=None, recipe_name="int4", architecture="other")
    with pytest.raises(BackendError, match="^--backend gguf: no GGUF export for other "):
        GGUFBackend().check(job)


@pytest.mark.parametrize("budget, method", [(4.8, "search"), (6.0, "minmax")])
def test_budget_chooses_block_types_and_counts_the_files_bits(tmp_path, budget, method):
    """--backend=gguf --budget_bits_per_weight: per matrix a block type among Q2_K .. Q8_0 (K-quants only where the
    rows are a multiple of 256: the tiny Gemma 3's down_proj), the file's blocks fit the budget, and the summary's
    bits per weight are the GGUF's quantized tensors' bytes x 8 / their weights, read by gguf-py."""
    checkpoint = write_default_checkpoint(GEMMA3, str(tmp_path / "ckpt"))
    result = run(GEMMA3, checkpoint=checkpoint, recipe="int4", backend="gguf", out=str(tmp_path / "out"), resume=True,
                 max_shard_size=1 << 20, verify=True, seed=0, progress=False, budget_bits_per_weight=budget,
                 budget_method=method)
    assert result["verification_failure"] is None
    reader = gguf.GGUFReader(str(tmp_path / "out" / "model.gguf"))
    quantized = [t for t in reader.tensors if t.tensor_type.name.startswith("Q")]
    disk_bits = 8 * sum(int(t.n_bytes) for t in quantized)
    weights = sum(int(t.n_elements) for t in quantized)
    assert weights == result["quantized_weights"]
    assert result["bits_per_weight"] == disk_bits / weights == result["budget"].bits_per_weight <= budget
    assert result["bits_per_weight"] > budget - 0.5  # the budget is spent, not left idle
    types = {t.name: t.tensor_type.name for t in quantized}
    assert len(set(types.values())) >= 2
    for name, t in types.items():  # rows of 128 cannot take a K-quant
        k = int(next(x for x in reader.tensors if x.name == name).shape[0])
        assert k % 256 == 0 or not t.endswith("_K"), (name, t)
    chosen = json.loads((tmp_path / "out" / "budget_recipe.json").read_text())
    assert {r["config"]["format"] for r in chosen["rules"]} <= set(GGUFBackend().accepts_formats)


def test_budget_refuses_a_matrix_no_block_type_holds(tmp_path):
    import torch

    from llmq.backend import storage_of
    from llmq.quant.budget import measure_options

    backend = GGUFBackend()
    with pytest.raises(ValueError) as e:
        measure_options("m.w", torch.randn(4, 48), backend.budget_options(), storage=storage_of(backend))
    assert str(e.value).startswith("m.w: none of the candidate formats holds its shape [4, 48]: ")
    assert "q4_0 (Q4_0) needs rows of a multiple of 32 elements, got K=48" in str(e.value) and "\n" not in str(e.value)
