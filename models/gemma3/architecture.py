"""Gemma 3 (text) as the quantize_and_save pipeline sees it (models/pipeline/arch.py)."""

from __future__ import annotations

from models.gemma3 import config, gguf_checkpoint, keymap, model
from models.gemma4 import model as gemma4_model
from models.pipeline.arch import package_architecture


def tiny_hf_config() -> dict:
    """A tiny Gemma 3 text config in the 270M's shape: 5 sliding : 1 global layers, one KV head,
    head_dim wider than hidden/heads, query_pre_attn_scalar = head_dim, tied embeddings; every K a multiple of 64."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, sliding_window=8,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
    ).to_dict()


ARCHITECTURE = package_architecture(
    "gemma3", __file__, config=config, model=model, keymap=keymap, tiny_hf_config=tiny_hf_config,
    prepare_default=gemma4_model.prepare_default, gguf_import=gguf_checkpoint,
)
