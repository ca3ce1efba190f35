"""Gemma 4 (dense text) as the quantize_and_save pipeline sees it (models/pipeline/arch.py)."""

from __future__ import annotations

from models.gemma4 import config, gguf_checkpoint, keymap, model
from models.pipeline.arch import package_architecture

LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]


def tiny_hf_config() -> dict:
    """A tiny Gemma 4 text config in the 31B's shape: 5 sliding : 1 full layers, K=V on full
    layers, soft-capped logits, tied embeddings; every K a multiple of 64."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, global_head_dim=64, num_global_key_value_heads=1,
        attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=8, final_logit_softcapping=30.0,
        layer_types=LAYER_TYPES,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        },
    ).to_dict()


ARCHITECTURE = package_architecture(
    "gemma4", __file__, config=config, model=model, keymap=keymap, tiny_hf_config=tiny_hf_config,
    prepare_default=model.prepare_default, gguf_import=gguf_checkpoint,
)
