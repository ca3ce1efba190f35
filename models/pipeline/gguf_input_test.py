"""--checkpoint=model.gguf end to end, on GGUF files written by gguf-py's own GGUFWriter.

Each architecture's tiny embedded-default model is written the way llama.cpp's converter writes it
(its tensor names, metadata keys and value transforms, restated here from the converter's facts),
with most matrices quantized to Q8_0 and a few to Q4_0 by gguf-py's reference quantizer. The
pipeline then imports it, and we check against independent references:

(a) each GGUF-quantized weight reaches the bundle still quantized and dequantizes bit for bit to
    gguf.quants.dequantize of the same bytes;
(b) the reloaded bundle's logits equal those of our model built from the GGUF's weights
    dequantized by gguf-py (fp32 rounding of a different evaluation order only);
(c) against the original float model, logits cosine >= 0.99 (the Q8_0 bar of issue 6).
"""

from __future__ import annotations

import json
import os
import time

import gguf
import numpy as np
import pytest
import torch

from llmq.checkpoint import CheckpointError, load_bundle
from llmq.quant import GroupQuantizedWeight
from llmq.quant.formats import dequantize_canonical
from models.gemma4 import keymap as gemma_keymap
from models.gemma4.architecture import ARCHITECTURE as GEMMA4
from models.gemma4.gguf_checkpoint import GGUFConverter as GemmaConverter
from models.pipeline import arch as arch_registry
from models.pipeline.agreement import compare_logits
from models.pipeline.gguf_input import Metadata
from models.pipeline.quantize_and_save import UsageError, run
from models.pipeline.quantized_model import build_quantized_model
from models.qwen import keymap as qwen_keymap
from models.qwen.architecture import ARCHITECTURE as QWEN
from models.qwen.gguf_checkpoint import GGUFConverter as QwenConverter, hf_config_from_gguf as qwen_config_from_gguf

Q8_0, Q4_0 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0
# Never quantized (llama.cpp keeps them float too): norms, vectors, convs, routers.
_FLOAT_ONLY = ("norm", "conv1d", "A_log", "dt_bias", "layer_scalar", ".mlp.gate.weight", "shared_expert_gate")


def _float_model(arch, seed=0, hf_overrides=None):
    hf = dict(arch.tiny_hf_config(), **(hf_overrides or {}))
    config = arch.config_from_hf(hf)
    torch.manual_seed(seed)
    model = arch.build_model(config, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        arch.prepare_default(model)
    return hf, config, model.eval()


def _reverse_names(table):
    """Our (HF) name template -> GGUF name template, for one layer index."""
    def gguf_name(name):
        parts = name.split(".")
        layer = next((int(p) for p in parts if p.isdigit()), None)
        template = name.replace(f".{layer}.", ".{L}.") if layer is not None else name
        for g, h in table.items():
            if h == template:
                return g.format(L=layer)
        raise KeyError(name)
    return gguf_name


def _tile_v_heads(t, dim, k_heads, v_heads, head_dim):
    """llama.cpp's _LinearAttentionVReorderBase: V heads grouped by K head -> tiled order."""
    shape = list(t.shape)
    t = t.reshape(shape[:dim] + [k_heads, v_heads // k_heads, head_dim] + shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _untile_v_heads(t, dim, k_heads, v_heads, head_dim):
    """The inverse of _tile_v_heads."""
    shape = list(t.shape)
    t = t.reshape(shape[:dim] + [v_heads // k_heads, k_heads, head_dim] + shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _qwen_to_gguf(config, name, w):
    """(gguf_name, float32 tensor) pairs as llama.cpp's Qwen3_5MoeTextModel writes them."""
    gguf_name = _reverse_names(qwen_keymap.GGUF_TO_HF)
    if name.endswith(".experts.gate_up_proj"):
        f = w.shape[1] // 2
        layer = name.split(".")[2]
        return [(f"blk.{layer}.ffn_gate_exps.weight", w[:, :f]), (f"blk.{layer}.ffn_up_exps.weight", w[:, f:])]
    if name.endswith(".experts.down_proj"):
        return [(f"blk.{name.split('.')[2]}.ffn_down_exps.weight", w)]
    kh, vh = config.linear_num_key_heads, config.linear_num_value_heads
    dv, key_dim = config.linear_value_head_dim, config.linear_key_head_dim * config.linear_num_key_heads
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        w = w + 1
    elif name.endswith(".A_log"):
        w = _tile_v_heads(-torch.exp(w)[:, None], 0, kh, vh, 1)[:, 0]
    elif name.endswith(".dt_bias"):
        w = _tile_v_heads(w[:, None], 0, kh, vh, 1)[:, 0]
    elif name.endswith(".conv1d.weight"):
        w = w.squeeze(1)
        w = torch.cat([w[: 2 * key_dim], _tile_v_heads(w[2 * key_dim:], 0, kh, vh, dv)])
    elif name.endswith(".in_proj_qkv.weight"):
        w = torch.cat([w[: 2 * key_dim], _tile_v_heads(w[2 * key_dim:], 0, kh, vh, dv)])
    elif name.endswith(".in_proj_z.weight"):
        w = _tile_v_heads(w, 0, kh, vh, dv)
    elif name.endswith((".in_proj_a.weight", ".in_proj_b.weight")):
        w = _tile_v_heads(w, 0, kh, vh, 1)
    elif name.endswith(".out_proj.weight"):
        w = _tile_v_heads(w, 1, kh, vh, dv)
    return [(gguf_name(name), w)]


def _gemma_to_gguf(config, name, w):
    if name == "lm_head.weight":
        return []  # tied: llama.cpp writes only token_embd
    if name.endswith(".layer_scalar"):
        return [(f"blk.{name.split('.')[2]}.layer_output_scale.weight", w)]
    return [(_reverse_names(gemma_keymap.GGUF_TO_HF)(name), w)]


def _qwen_metadata(writer, hf, config):
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    writer.add_full_attention_interval(4)
    writer.add_rope_dimension_count(config.rotary_dim)
    writer.add_rope_dimension_sections([11, 11, 10, 0])


def _gemma_metadata(writer, hf, config):
    swa = [t == "sliding_attention" for t in config.layer_types]
    full_geometry = config.layer_geometry[swa.index(False)]
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv([g.num_key_value_heads for g in config.layer_geometry])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_sliding_window(config.sliding_window)
    writer.add_shared_kv_layers(0)
    writer.add_embedding_length_per_layer_input(0)
    writer.add_sliding_window_pattern(swa)
    writer.add_key_length(full_geometry.head_dim)
    writer.add_value_length(full_geometry.head_dim)
    writer.add_key_length_swa(config.head_dim)
    writer.add_value_length_swa(config.head_dim)
    writer.add_rope_dimension_count(full_geometry.head_dim)
    writer.add_rope_dimension_count_swa(config.head_dim)


def _gemma_rope_freqs(config):
    head_dim = next(g.head_dim for g, t in zip(config.layer_geometry, config.layer_types) if t == "full_attention")
    rotated = int(head_dim * config.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    return torch.tensor([1.0] * rotated + [1e30] * (head_dim // 2 - rotated), dtype=torch.float32)


# name -> GGUF type for the tensors that get one other than Q8_0 (float-only ones aside).
_SPECIAL = {
    QWEN.name: {"blk.0.ssm_out.weight": Q4_0, "blk.0.attn_gate.weight": Q4_0, "blk.3.attn_output.weight": Q4_0,
                "blk.1.ffn_up_exps.weight": Q4_0},  # blk.1: gate Q8_0, up Q4_0 -> the mixed-format path
    GEMMA4.name: {"blk.0.ffn_down.weight": Q4_0, "blk.5.attn_output.weight": Q4_0},
}


def _dq(w, qtype):
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype), qtype).copy())


def _bf16_raw(t):
    """A bf16 tensor as gguf-py's raw BF16 bytes ([..., K] -> uint8 [..., 2K])."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint8)


def _write_gguf(arch, path, leave_float=(), float_layout=None, hf_overrides=None, extra_kv=None, tokens=None):
    """Write the tiny model as GGUF; returns (config, float model, {our name: gguf-py-dequantized
    reference weight}, {our name: GGUF type of its quantized halves}).

    float_layout="bf16": nothing quantized; the model's weights are rounded to bf16 and written
    the way llama.cpp's convert_hf_to_gguf.py --outtype auto writes a bf16 checkpoint: value
    transforms computed in bf16, matrices as BF16, norms / routers / ssm_a / conv1d / vectors as F32.
    extra_kv: {key: (value, gguf.GGUFValueType, element type or None)} added to the metadata; tokens: the
    token list (default t0, t1, ...)."""
    hf, config, model = _float_model(arch, hf_overrides=hf_overrides)
    if float_layout == "bf16":
        model = model.to(torch.bfloat16)
    is_qwen = arch is QWEN
    writer = gguf.GGUFWriter(str(path), "qwen35moe" if is_qwen else "gemma4")
    (_qwen_metadata if is_qwen else _gemma_metadata)(writer, hf, config)
    writer.add_token_list(tokens or [f"t{i}".encode() for i in range(config.vocab_size)])
    writer.add_eos_token_id(1)
    for key, (value, vtype, sub_type) in (extra_kv or {}).items():
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    reference, types = {}, {}
    for name, w in model.state_dict().items():
        w = w.detach() if float_layout == "bf16" else w.detach().float()
        parts = (_qwen_to_gguf if is_qwen else _gemma_to_gguf)(config, name, w)
        halves = []
        for gguf_name, t in parts:
            quantize = w.dim() >= 2 and not any(s in name for s in _FLOAT_ONLY) and gguf_name not in leave_float
            if float_layout == "bf16":
                if quantize:
                    writer.add_tensor(gguf_name, _bf16_raw(t), raw_dtype=gguf.GGMLQuantizationType.BF16)
                    types[name] = ("BF16",)
                else:
                    writer.add_tensor(gguf_name, t.float().contiguous().numpy())
                halves.append(None)
                continue
            qtype = _SPECIAL[arch.name].get(gguf_name, Q8_0) if quantize else None
            if qtype is None:
                writer.add_tensor(gguf_name, t.contiguous().numpy())
            else:
                writer.add_tensor(gguf_name, gguf.quants.quantize(t.contiguous().numpy(), qtype), raw_dtype=qtype)
            halves.append(qtype)
        if halves and halves[0] is not None:
            # Row and whole-group column permutations commute with block quantization, so the
            # reference is gguf-py's round trip of the weight in our own layout.
            if name.endswith(".experts.gate_up_proj"):
                f = w.shape[1] // 2
                reference[name] = torch.cat([_dq(w[:, :f], halves[0]), _dq(w[:, f:], halves[1])], dim=1)
            elif name.endswith(".linear_attn.out_proj.weight") and config.linear_value_head_dim % 32:
                # The V-head column reorder moves blocks smaller than a quantization group: the
                # GGUF's blocks are formed in llama.cpp's order, then the columns are moved back.
                geometry = (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_value_head_dim)
                reference[name] = _untile_v_heads(_dq(parts[0][1], halves[0]), 1, *geometry)
            else:
                reference[name] = _dq(w, halves[0])
            types[name] = tuple(halves)
        elif halves:
            reference[name] = w
    if not is_qwen:
        writer.add_tensor("rope_freqs.weight", _gemma_rope_freqs(config).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return config, model, reference, types


@pytest.fixture(scope="module")
def keep_recipe(tmp_path_factory):
    """A recipe that quantizes nothing: the bundle then holds exactly what the GGUF held."""
    path = tmp_path_factory.mktemp("recipe") / "keep.json"
    path.write_text(json.dumps({"name": "keep", "rules": [{"pattern": ".*", "config": None}]}))
    return str(path)


def _same_weights_as_reference(result):
    """run()'s verification of a bundle that holds the GGUF's own blocks: with the dequantize path the
    logits equal the GGUF model's; with the compiled kernel (activations rounded to int8, under Bazel)
    they differ by that rounding only, exactly as round-to-nearest's, which keeps the same blocks."""
    if result["quantized_linears"].startswith("llmq::quantized_linear"):
        assert result["cosine"] > 0.999
        assert result["cosine"] == pytest.approx(result["rtn"]["cosine"], abs=1e-12)
    else:
        assert result["cosine"] == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("arch", [QWEN, GEMMA4], ids=lambda a: a.name)
def test_gguf_checkpoint_end_to_end(arch, tmp_path, keep_recipe, capsys):
    path = tmp_path / "model.gguf"
    config, float_model, reference, types = _write_gguf(arch, path)
    result = run(arch, checkpoint=str(path), recipe=keep_recipe, backend="bundle", out=str(tmp_path / "out"),
                 resume=False, max_shard_size=1 << 20, verify=True, seed=0, progress=False)
    printed = capsys.readouterr().out
    assert "verification reference: the GGUF model" in printed
    bundle = load_bundle(result["bundle"])
    assert set(bundle) == set(reference) - ({"lm_head.weight"} if config.tie_word_embeddings else set())

    # (a) exact import of every GGUF-quantized weight
    checked = 0
    for name, halves in types.items():
        if arch is GEMMA4 and name == "model.embed_tokens.weight":  # dense by design (see models/gemma4/gguf_checkpoint.py)
            assert torch.equal(bundle[name], reference[name])
            assert "note: token_embd.weight: quantized (8-bit) in the GGUF; imported dequantized" in printed
            continue
        if len(set(halves)) != 1:  # gate/up stored in different formats: fused dense (see ExpertPairFuser)
            assert isinstance(bundle[name], torch.Tensor) and torch.equal(bundle[name], reference[name]), name
            assert "note: model.layers.1.mlp.experts.gate_up_proj: gate and up" in printed
            continue
        value = bundle[name]
        assert isinstance(value, GroupQuantizedWeight), name
        assert (value.bits, value.group_size) == ({Q8_0: 8, Q4_0: 4}[halves[0]], 32), name
        assert torch.equal(dequantize_canonical(value), reference[name]), name
        checked += 1
    assert checked >= 10

    # (b) the reloaded model == our model on gguf-py's dequantized weights
    reloaded = build_quantized_model(arch.build_model(config, device="meta"), bundle)
    on_reference = build_quantized_model(arch.build_model(config, device="meta"), dict(reference))
    exact = compare_logits(on_reference, reloaded, vocab_size=config.vocab_size)
    # fp32 forward passes that differ only in evaluation order: errors of order 1e-6 relative.
    assert exact["cosine"] > 1 - 1e-9
    assert exact["sqnr_db"] > 100
    assert exact["tokens_quantized"] == exact["tokens_reference"]

    # (c) close to the original float model
    quality = compare_logits(float_model, reloaded, vocab_size=config.vocab_size)
    print(f"{arch.name} GGUF (Q8_0 + some Q4_0) vs float: cosine {quality['cosine']:.5f}, "
          f"SQNR {quality['sqnr_db']:.1f} dB; vs dequantized GGUF: SQNR {exact['sqnr_db']:.1f} dB")
    assert quality["cosine"] >= 0.99
    _same_weights_as_reference(result)  # run()'s own check: GGUF model vs bundle


def test_int4_recipe_quantizes_float_tensors_and_keeps_gguf_ones(tmp_path):
    """With a real recipe the float matrices are quantized and the GGUF-quantized ones pass through."""
    path = tmp_path / "model.gguf"
    _, _, reference, types = _write_gguf(GEMMA4, path, leave_float=("blk.0.ffn_gate.weight",))
    result = run(GEMMA4, checkpoint=str(path), recipe="int4", backend="bundle", out=str(tmp_path / "out"),
                 resume=False, max_shard_size=1 << 20, verify=False, seed=0, progress=False)
    bundle = load_bundle(result["bundle"])
    for name in types:
        value = bundle[name]
        if name != "model.embed_tokens.weight":
            assert isinstance(value, GroupQuantizedWeight), name
        dense = dequantize_canonical(value) if isinstance(value, GroupQuantizedWeight) else value
        assert torch.equal(dense, reference[name]), name
    from_recipe = bundle["model.layers.0.mlp.gate_proj.weight"]  # F32 in the GGUF -> the recipe's INT4
    assert "model.layers.0.mlp.gate_proj.weight" not in types
    assert isinstance(from_recipe, GroupQuantizedWeight) and from_recipe.bits == 4


def test_requantize_gguf_gives_every_matrix_the_recipes_format(tmp_path):
    """--requantize_gguf: the GGUF-quantized matrices are dequantized exactly (gguf-py's values) and quantized by
    the recipe like the float ones, so the bundle holds the recipe's INT4 g32 symmetric codes of those values."""
    from llmq.quant import QuantConfig, quantize_weight

    path = tmp_path / "model.gguf"
    _, _, reference, types = _write_gguf(GEMMA4, path)
    result = run(GEMMA4, checkpoint=str(path), recipe="int4", backend="bundle", out=str(tmp_path / "out"),
                 resume=False, max_shard_size=1 << 20, verify=False, seed=0, progress=False, requantize_gguf=True)
    bundle = load_bundle(result["bundle"])
    matrices = [n for n in types if n != "model.embed_tokens.weight"]
    assert matrices and all(t != "F32" for n in matrices for t in types[n])  # every one quantized in the GGUF
    for name in matrices:
        value = bundle[name]
        expected = quantize_weight(reference[name].float(), QuantConfig(bits=4, group_size=32, symmetric=True))
        assert isinstance(value, GroupQuantizedWeight) and (value.bits, value.group_size) == (4, 32), name
        assert torch.equal(value.qdata, expected.qdata) and torch.equal(value.scale, expected.scale), name


@pytest.fixture
def registered(monkeypatch):
    """An empty architecture registry for the test; register(arch) adds one."""
    monkeypatch.setattr(arch_registry, "_REGISTRY", {})
    return arch_registry.register_architecture


def test_wrong_architecture_is_refused(registered, tmp_path):
    path = tmp_path / "model.gguf"
    _write_gguf(GEMMA4, path)
    with pytest.raises(UsageError, match="general.architecture is 'gemma4'; expected 'qwen35moe'"):
        run(QWEN, checkpoint=str(path), recipe="int4", backend="bundle", out=str(tmp_path / "out"), resume=False,
            max_shard_size=1 << 20, verify=False, seed=0, progress=False)


@pytest.mark.parametrize("arch,other", [(QWEN, GEMMA4), (GEMMA4, QWEN)], ids=lambda a: a.name)
def test_the_other_models_gguf_names_its_target(arch, other, registered, tmp_path):
    registered(arch)
    registered(other)
    path = tmp_path / "model.gguf"
    _write_gguf(other, path)
    with pytest.raises(UsageError, match=f"use `bazel run {other.target} "):
        run(arch, checkpoint=str(path), recipe="int4", backend="bundle", out=str(tmp_path / "out"), resume=False,
            max_shard_size=1 << 20, verify=False, seed=0, progress=False)
    assert not os.path.exists(tmp_path / "out")


def test_missing_metadata_is_named():
    metadata = {"general.architecture": "qwen35moe", "qwen35moe.block_count": 4}
    with pytest.raises(ValueError, match="no 'qwen35moe.attention.key_length'"):
        qwen_config_from_gguf(metadata, tensors=None)
    with pytest.raises(ValueError, match="expected 'gemma4'"):
        Metadata(metadata, "gemma4")


def _q8(shape):
    """A random weight quantized by gguf-py to Q8_0, imported as the reader imports it."""
    from llmq.checkpoint.gguf_import import to_canonical

    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    raw = torch.from_numpy(gguf.quants.quantize(w.numpy(), Q8_0).reshape(-1).copy())
    return to_canonical("Q8_0", raw, tuple(shape))


def test_inexact_transforms_on_quantized_data_are_refused():
    qwen = QwenConverter(QWEN.config_from_hf(QWEN.tiny_hf_config()))
    with pytest.raises(ValueError, match="blk.0.attn_norm.weight: stored quantized .* not exact"):
        qwen.convert("blk.0.attn_norm.weight", _q8((1, 128)))
    with pytest.raises(ValueError, match="no qwen35moe mapping"):
        qwen.convert("blk.0.something_new.weight", torch.zeros(4))
    qwen.convert("blk.0.ffn_gate_exps.weight", torch.zeros(16, 64, 128))
    with pytest.raises(ValueError, match=r"only the \['gate'\] half"):
        qwen.close()
    gemma = GemmaConverter(GEMMA4.config_from_hf(GEMMA4.tiny_hf_config()))
    with pytest.raises(ValueError, match="no gemma4 mapping"):
        gemma.convert("blk.0.ffn_gate_exps.weight", torch.zeros(2, 4, 4))


def test_quantized_column_blocks_permute_exactly():
    """out_proj's V-head column reorder moves whole quantization groups: exact on quantized data."""
    from models.pipeline.gguf_input import permute_column_blocks

    w = _q8((8, 128))
    perm = torch.tensor([2, 0, 3, 1])
    moved = permute_column_blocks(w, perm, 32, name="x")
    dense = dequantize_canonical(w)
    assert torch.equal(dequantize_canonical(moved), dense.reshape(8, 4, 32)[:, perm].reshape(8, 128))
    assert permute_column_blocks(w, torch.arange(8), 16, name="x") is w  # identity: nothing to undo
    # Blocks of 16 split the groups of 32: dequantized exactly, then reordered, with a note.
    notes = []
    perm16 = torch.tensor([1, 0, 3, 2, 5, 4, 7, 6])
    split = permute_column_blocks(w, perm16, 16, name="x", notes=notes)
    assert isinstance(split, torch.Tensor) and split.dtype == torch.float32
    assert torch.equal(split, dense.reshape(8, 8, 16)[:, perm16].reshape(8, 128))
    assert notes == ["x: GGUF reorders its input columns in blocks of 16, which split its 8-bit quantization "
                     "groups of 32; dequantized (exactly), reordered, and left to the recipe to quantize"]


def test_cli_reports_a_bad_gguf_in_one_line(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + bytes(40))
    with pytest.raises((CheckpointError, UsageError)):
        run(QWEN, checkpoint=str(path), recipe="int4", backend="bundle", out=str(tmp_path / "out"), resume=False,
            max_shard_size=1 << 20, verify=False, seed=0, progress=False)


@pytest.mark.parametrize("arch", [QWEN, GEMMA4], ids=lambda a: a.name)
def test_llama_cpp_bf16_gguf_imports_in_one_dtype_and_verifies(arch, tmp_path, keep_recipe, capsys):
    """convert_hf_to_gguf.py --outtype auto on a bf16 checkpoint: BF16 matrices, F32 norms/routers/
    ssm_a/conv1d. The import gives every tensor one dtype (bf16), so verification runs."""
    from llmq.checkpoint.gguf_import import GGUFFile

    path = tmp_path / "model.gguf"
    config, float_model, reference, types = _write_gguf(arch, path, float_layout="bf16")
    with GGUFFile(path) as f:
        assert {t.type_name for t in f.tensors} == {"BF16", "F32"}
    result = run(arch, checkpoint=str(path), recipe=keep_recipe, backend="bundle", out=str(tmp_path / "keep"),
                 resume=False, max_shard_size=1 << 20, verify=True, seed=0, progress=False)
    assert "stores float tensors as BF16, F32; imported as torch.bfloat16 throughout" in capsys.readouterr().out
    bundle = load_bundle(result["bundle"])
    assert {v.dtype for v in bundle.values()} == {torch.bfloat16}
    for name, value in bundle.items():
        if name in types:  # BF16 in the file: exact
            assert torch.equal(value, reference[name]), name
        else:  # F32 in the file, derived in bf16 by the converter (w + 1, -exp(A_log)), rounded back to bf16
            assert torch.allclose(value.float(), reference[name].float(), rtol=2 ** -6, atol=2 ** -7), name
    assert result["cosine"] == pytest.approx(1.0, abs=1e-6)  # the GGUF model vs the bundle: the same weights

    # The default recipe quantizes the bf16 matrices; the bundle verifies against the GGUF model.
    result = run(arch, checkpoint=str(path), recipe=None, backend="bundle", out=str(tmp_path / "default"),
                 resume=False, max_shard_size=1 << 20, verify=True, seed=0, progress=False)
    bundle = load_bundle(result["bundle"])
    assert result["quantized"] > 0
    assert {v.dtype for v in bundle.values()} == {torch.bfloat16}  # quantized weights dequantize to bf16 too
    assert result["cosine"] > 0.9


def test_ssm_out_reorder_that_splits_groups_falls_back_exactly(tmp_path, keep_recipe, capsys):
    """linear_value_head_dim 16: llama.cpp's V-head reorder of ssm_out moves 16-column blocks across
    32-wide Q8_0/Q4_0 groups. The tensor is dequantized exactly, reordered, and handed to the recipe."""
    path = tmp_path / "model.gguf"
    config, _, reference, types = _write_gguf(QWEN, path, hf_overrides={"linear_value_head_dim": 16})
    assert config.linear_value_head_dim == 16 and config.linear_num_key_heads != config.linear_num_value_heads
    result = run(QWEN, checkpoint=str(path), recipe=keep_recipe, backend="bundle", out=str(tmp_path / "keep"),
                 resume=False, max_shard_size=1 << 20, verify=True, seed=0, progress=False)
    printed = capsys.readouterr().out
    bundle = load_bundle(result["bundle"])
    out_projs = [n for n in bundle if n.endswith(".linear_attn.out_proj.weight")]
    assert len(out_projs) == 3
    for name in out_projs:
        layer = name.split(".")[2]
        assert (f"note: blk.{layer}.ssm_out.weight: GGUF reorders its input columns in blocks of 16, which split "
                f"its {8 if layer != '0' else 4}-bit quantization groups of 32; dequantized (exactly)") in printed
        assert isinstance(bundle[name], torch.Tensor) and torch.equal(bundle[name], reference[name]), name
    _same_weights_as_reference(result)
    # with a real recipe the recipe quantizes it
    result = run(QWEN, checkpoint=str(path), recipe="int4", backend="bundle", out=str(tmp_path / "int4"),
                 resume=False, max_shard_size=1 << 20, verify=False, seed=0, progress=False)
    value = load_bundle(result["bundle"])[out_projs[0]]
    assert isinstance(value, GroupQuantizedWeight) and value.bits == 4


def test_pipeline_parses_the_gguf_header_once_and_leaves_the_vocabulary_on_disk(tmp_path, keep_recipe, monkeypatch):
    from llmq.checkpoint import gguf_header

    # The tiny vocabulary then stays on disk, as a real 262k-entry one does.
    monkeypatch.setattr(gguf_header, "EAGER_ARRAY_LIMIT", 16)
    path = tmp_path / "model.gguf"
    config, _, _, _ = _write_gguf(GEMMA4, path)
    hour_ago = time.time() - 3600
    os.utime(path, (hour_ago, hour_ago))  # a freshly written file's times are too coarse to cache on
    gguf_header.clear_cache()
    parses = []
    parse_header, reader = gguf_header.parse_header, gguf.GGUFReader
    monkeypatch.setattr(gguf_header, "parse_header", lambda p: parses.append(p) or parse_header(p))
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: parses.append(a) or reader(*a, **k))
    run(GEMMA4, checkpoint=str(path), recipe=keep_recipe, backend="bundle", out=str(tmp_path / "out"), resume=False,
        max_shard_size=1 << 20, verify=True, seed=0, progress=False)
    assert len(parses) == 1  # config, names, tensor stream and verification share one parse
    tokens = gguf_header.parse_header_cached(str(path)).metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, gguf_header.GGUFArray) and len(tokens) == config.vocab_size > 16
    assert not tokens.loaded
