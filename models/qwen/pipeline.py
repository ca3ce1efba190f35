"""Qwen3.5-MoE as the quantize_and_save pipeline sees it (models/pipeline/arch.py)."""

from __future__ import annotations

import os

from models.pipeline.arch import Architecture, recipe_file_descriptions, recipe_files
from models.qwen import gguf_checkpoint, keymap
from models.qwen.config import MULTIMODAL_MODEL_TYPES, TEXT_MODEL_TYPES, ModelConfig
from models.qwen.model import build_model


def tiny_hf_config() -> dict:
    """A tiny Qwen3.5-MoE text config: every layer kind (3 Gated DeltaNet : 1 gated attention),
    16 experts top-4 with a shared expert, partial RoPE; every K a multiple of 64."""
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=16,
        num_experts_per_tok=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    ).to_dict()


RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")

ARCHITECTURE = Architecture(
    name="qwen3.5-moe",
    tiny_hf_config=tiny_hf_config,
    config_from_hf=ModelConfig.from_hf_dict,
    build_model=build_model,
    key_map=keymap.hf_to_llmq_key,
    presets=recipe_files(RECIPES),
    is_per_expert=keymap.is_per_expert_key,
    merge_experts=keymap.stack_experts,
    to_hf_tensors=keymap.unstack_experts,
    gguf_import=gguf_checkpoint,
    hf_model_types=TEXT_MODEL_TYPES + MULTIMODAL_MODEL_TYPES,
    target="//models/qwen:quantize_and_save",
    recipe_descriptions=recipe_file_descriptions(RECIPES),
)
