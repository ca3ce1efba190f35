"""Gemma 3 (text) as the quantize_and_save pipeline sees it (models/pipeline/arch.py)."""

from __future__ import annotations

import os

from models.gemma3 import gguf_checkpoint, keymap
from models.gemma3.config import ModelConfig
from models.gemma3.model import build_model
from models.pipeline.arch import Architecture, recipe_files

RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")


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


def prepare_default(model) -> None:
    """Make the random embedded default behave like a trained model: embeddings of unit RMS after the
    sqrt(hidden) scale, and post-norm scales 1/sqrt(2L) (scaled residual init), so that the 2L blocks'
    random outputs do not swamp the residual stream. Gemma 3 norms store scale - 1."""
    residual_gain = (2 * len(model.model.layers)) ** -0.5
    embed = model.model.embed_tokens.weight
    embed.normal_(0.0, embed.shape[1] ** -0.5)
    for name, module in model.named_modules():
        if name.endswith(("post_attention_layernorm", "post_feedforward_layernorm")):
            module.weight.fill_(residual_gain - 1.0)


ARCHITECTURE = Architecture(
    name="gemma3",
    tiny_hf_config=tiny_hf_config,
    config_from_hf=ModelConfig.from_hf_dict,
    build_model=build_model,
    key_map=keymap.hf_to_llmq_key,
    presets=recipe_files(RECIPES),
    prepare_default=prepare_default,
    gguf_import=gguf_checkpoint,
)
