"""Gemma 3 names: the GGUF table (from gguf-py's GEMMA3 table) covers every model tensor; the HF map skips the towers."""

from models.common.parity import check_gguf_names_round_trip
from models.gemma3 import keymap
from models.gemma3.architecture import ARCHITECTURE


def test_gguf_names_cover_the_model():
    check_gguf_names_round_trip(ARCHITECTURE, {
        "blk.{L}.post_ffw_norm.weight": "model.layers.{L}.post_feedforward_layernorm.weight",
        "blk.{L}.attn_k_norm.weight": "model.layers.{L}.self_attn.k_norm.weight",
        "output_norm.weight": "model.norm.weight",
    })


def test_hf_key_map():
    assert keymap.hf_to_llmq_key("model.language_model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.up_proj.weight"
    assert keymap.hf_to_llmq_key("language_model.model.norm.weight") == "model.norm.weight"
    assert keymap.hf_to_llmq_key("language_model.lm_head.weight") == "lm_head.weight"
    assert keymap.hf_to_llmq_key("model.layers.0.self_attn.q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    for skipped in ("model.vision_tower.vision_model.post_layernorm.weight", "vision_tower.x",
                    "model.multi_modal_projector.mm_soft_emb_norm.weight", "multi_modal_projector.y"):
        assert keymap.hf_to_llmq_key(skipped) is None
