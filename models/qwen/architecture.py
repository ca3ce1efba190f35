"""Qwen3.5-MoE as the quantize_and_save pipeline sees it (models/pipeline/arch.py)."""

from __future__ import annotations

from models.pipeline.arch import package_architecture
from models.qwen import config, gguf_checkpoint, keymap, model


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


ARCHITECTURE = package_architecture(
    "qwen3.5-moe", __file__, config=config, model=model, keymap=keymap, tiny_hf_config=tiny_hf_config,
    is_per_expert=keymap.is_per_expert_key, merge_experts=keymap.stack_experts,
    expert_stacks=keymap.ExpertStacks.for_tensor, to_hf_tensors=keymap.unstack_experts,
    gguf_import=gguf_checkpoint,
)
