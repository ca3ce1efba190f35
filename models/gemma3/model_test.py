"""Parity of models.gemma3 with transformers' Gemma3ForCausalLM on tiny random configs.

Both read the same save_pretrained folder and run in float32 on CPU, within models.common.parity's
FP32_REL_TOL (derived there from fp32 rounding). The prompt
(11 tokens) is longer than the sliding window (4), so decode exercises window eviction.
"""

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from models.common import parity
from models.gemma3.architecture import ARCHITECTURE
from models.gemma3.config import ModelConfig
from models.gemma3.model import build_model

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def tiny_hf_config(**overrides):
    values = dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=12, sliding_window=4, layer_types=LAYER_TYPES,
        initializer_range=0.1,  # larger than the default so logits are O(1)
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
    )
    values.update(overrides)
    return Gemma3TextConfig(**values)


def _save_random(folder, **overrides):
    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(tiny_hf_config(**overrides)).eval()
    with torch.no_grad():  # HF initialises the norm weights to 0 (scale 1); randomise them so they are tested
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(folder)
    return hf


VARIANTS = {
    "linear_rope": {},
    "default_rope_softcap_kv1": dict(
        num_key_value_heads=1, final_logit_softcapping=3.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3_tiny")
    return folder, _save_random(folder, **VARIANTS[request.param])


def test_prefill_and_decode_match_transformers(checkpoint):
    parity.check_prefill_and_decode(ARCHITECTURE, *checkpoint, vocab=96)


def test_generate_matches_transformers_greedy(checkpoint):
    parity.check_greedy_generate(ARCHITECTURE, *checkpoint, [5, 17, 3, 42, 8, 9, 60])


def test_hub_style_config_reads_like_transformers():
    """A config.json as published for google/gemma-3-270m (flat rope keys, no rope_parameters), and one
    with rope_scaling and only sliding_window_pattern: the same RoPE and layer types transformers derives."""
    for raw in (
        {"model_type": "gemma3_text", "num_hidden_layers": 18, "rope_theta": 1_000_000.0,
         "rope_local_base_freq": 10_000.0, "rope_scaling": None, "query_pre_attn_scalar": 256},
        {"model_type": "gemma3_text", "num_hidden_layers": 8, "rope_theta": 1_000_000.0,
         "rope_local_base_freq": 10_000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
         "sliding_window_pattern": 4},
    ):
        ours = ModelConfig.from_hf_dict(raw)
        theirs = Gemma3TextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
        assert ours.layer_types == theirs.layer_types
        for t in ours.layer_types:
            mine, ref = ours.rope_parameters[t], theirs.rope_parameters[t]
            assert mine["rope_type"] == ref["rope_type"] and mine["rope_theta"] == ref["rope_theta"], t
            assert mine.get("factor", 1.0) == ref.get("factor", 1.0), t


def test_multimodal_layout_loads_the_same(checkpoint, tmp_path):
    parity.check_multimodal_layout_loads_the_same(ARCHITECTURE, checkpoint[0], tmp_path, "gemma3", {
        "model.vision_tower.vision_model.embeddings.patch_embedding.weight": torch.zeros(2, 2),
        "model.multi_modal_projector.mm_input_projection_weight": torch.zeros(2, 2)})


def test_unsupported_variants_are_refused():
    for extra, match in (({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
                         ({"use_bidirectional_attention": True}, "bidirectional"),
                         ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "RoPE"),
                         ({"model_type": "gemma4_text"}, "not a Gemma 3")):
        cfg = dict({"model_type": "gemma3_text", "num_hidden_layers": 6}, **extra)  # layer 5 is global
        with pytest.raises((NotImplementedError, ValueError), match=match):
            ModelConfig.from_hf_dict(cfg)


def test_meta_build_has_hf_names():
    config = ModelConfig.from_hf_dict(tiny_hf_config().to_dict())
    model = build_model(config, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    theirs = Gemma3ForCausalLM(tiny_hf_config()).state_dict().keys()
    assert set(model.state_dict()) == set(theirs)
