"""Parity of models.gemma4 with transformers' Gemma4ForCausalLM on tiny random configs.

Both read the same save_pretrained folder and run in float32 on CPU, within models.common.parity's
FP32_REL_TOL (derived there from fp32 rounding). The prompt (11 tokens) is longer than the sliding window (4), so decode exercises window eviction.
"""

import json
import os

import pytest
import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

from models.common import parity
from models.common.loading import load_model
from models.gemma4 import keymap
from models.gemma4.architecture import ARCHITECTURE
from models.gemma4.config import ModelConfig
from models.gemma4.model import build_model

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def tiny_hf_config(**overrides):
    values = dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
        hidden_size_per_layer_input=0, sliding_window=4, final_logit_softcapping=3.0, layer_types=LAYER_TYPES,
        initializer_range=0.1,  # larger than the default so logits are O(1) and the soft-cap's tanh is non-linear
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1_000_000.0},
        },
    )
    values.update(overrides)
    return Gemma4TextConfig(**values)


def _save_random(folder, **overrides):
    torch.manual_seed(0)
    hf = Gemma4ForCausalLM(tiny_hf_config(**overrides)).eval()
    with torch.no_grad():  # HF initialises norms and layer scalars to 1; randomise them so they are tested
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for layer in hf.model.layers:
            layer.layer_scalar.fill_(0.5 + torch.rand(()).item())
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module", params=[True, False], ids=["k_eq_v", "separate_v"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4_tiny")
    return folder, _save_random(folder, attention_k_eq_v=request.param)


def test_prefill_and_decode_match_transformers(checkpoint):
    parity.check_prefill_and_decode(ARCHITECTURE, *checkpoint, vocab=96)


def test_generate_matches_transformers_greedy(checkpoint):
    parity.check_greedy_generate(ARCHITECTURE, *checkpoint, [5, 17, 3, 42, 8, 9, 60])


def test_full_layers_have_their_own_geometry(checkpoint):
    folder, hf = checkpoint
    config = ModelConfig.from_hf_dict(json.load(open(os.path.join(folder, "config.json"))))
    k_eq_v = hf.config.attention_k_eq_v
    for i, (t, g) in enumerate(zip(config.layer_types, config.layer_geometry)):
        attn = hf.model.layers[i].self_attn
        assert (g.head_dim, g.has_v_proj) == (attn.head_dim, attn.v_proj is not None), i
        assert g.num_key_value_heads == attn.k_proj.out_features // attn.head_dim, i
        if t == "full_attention":
            assert g.head_dim == 16 and g.num_key_value_heads == (1 if k_eq_v else 2) and g.has_v_proj == (not k_eq_v)


def test_raw_hub_style_config_gives_the_same_geometry():
    """A config.json as published (global_head_dim / num_global_key_value_heads, no per_layer_config)."""
    raw = {"model_type": "gemma4", "text_config": {
        "model_type": "gemma4_text", "num_hidden_layers": 5, "layer_types": LAYER_TYPES, "head_dim": 8,
        "num_key_value_heads": 2, "global_head_dim": 16, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
        "hidden_size_per_layer_input": 0}}
    config = ModelConfig.from_hf_dict(raw)
    saved = ModelConfig.from_hf_dict(tiny_hf_config().to_dict())
    assert config.layer_geometry == saved.layer_geometry


def test_multimodal_layout_loads_the_same(checkpoint, tmp_path):
    parity.check_multimodal_layout_loads_the_same(ARCHITECTURE, checkpoint[0], tmp_path, "gemma4", {
        "model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight": torch.zeros(2, 2),
        "model.embed_vision.embedding_projection.weight": torch.zeros(2, 2)})


def test_key_map():
    assert keymap.hf_to_llmq_key("model.language_model.layers.0.layer_scalar") == "model.layers.0.layer_scalar"
    assert keymap.hf_to_llmq_key("model.vision_tower.patch_embedder.input_proj.weight") is None
    assert keymap.hf_to_llmq_key("model.audio_tower.layers.0.x") is None


def test_unsupported_variants_are_refused():
    for extra, match in (({"enable_moe_block": True}, "MoE"), ({"hidden_size_per_layer_input": 256}, "per-layer"),
                         ({"num_kv_shared_layers": 2}, "KV sharing"), ({}, "per-layer")):
        cfg = {"model_type": "gemma4_text", "num_hidden_layers": 5, "layer_types": LAYER_TYPES}
        if extra:
            cfg.update(hidden_size_per_layer_input=0)
        cfg.update(extra)
        with pytest.raises(NotImplementedError, match=match):
            ModelConfig.from_hf_dict(cfg)


def test_meta_build():
    model = build_model(ModelConfig.from_hf_dict(tiny_hf_config().to_dict()), device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_prefill_exports_and_bfloat16_tracks_float32(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma4_export")
    _save_random(folder)
    ours = load_model(ARCHITECTURE, folder).eval()
    prompt = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(5))
    program = torch.export.export(ours, (prompt,))
    with torch.no_grad():
        ref = ours(prompt)
        torch.testing.assert_close(program.module()(prompt), ref, rtol=1e-5, atol=1e-5)
        low = load_model(ARCHITECTURE, folder, dtype=torch.bfloat16)(prompt).float()
    assert torch.nn.functional.cosine_similarity(ref.flatten(), low.flatten(), dim=0).item() > 0.99
