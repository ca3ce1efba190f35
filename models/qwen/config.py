"""Qwen3.5-MoE text configuration, read from a Hugging Face ``config.json`` dict.

Field names and defaults follow transformers' ``Qwen3_5MoeTextConfig`` (whose defaults are the
Qwen3.5-35B-A3B values). A multimodal config (``model_type`` "qwen3_5_moe") contributes only
its ``text_config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from models.common.hf_config import (
    check_activation,
    check_heads,
    check_layer_types,
    known_values,
    periodic_layer_types,
    text_config,
)

TEXT_MODEL_TYPES = ("qwen3_5_moe_text",)
MULTIMODAL_MODEL_TYPES = ("qwen3_5_moe",)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 8
    num_experts: int = 256
    layer_types: List[str] = field(default_factory=list)
    eos_token_id: Optional[object] = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_dict(cls, config: dict) -> "ModelConfig":
        """Build from a parsed config.json (text-only or multimodal); unknown keys are ignored."""
        config = text_config(config, TEXT_MODEL_TYPES, MULTIMODAL_MODEL_TYPES, "Qwen3.5-MoE")
        if config.get("attn_output_gate", True) is False:
            raise NotImplementedError("config.json: attn_output_gate=false is not supported (Qwen3.5 gates attention output)")
        if config.get("norm_topk_prob", True) is False:
            raise NotImplementedError("config.json: norm_topk_prob=false is not supported (Qwen3.5 renormalises top-k)")
        if config.get("mlp_only_layers"):
            raise NotImplementedError("config.json: mlp_only_layers (dense layers among MoE layers) is not supported")
        values = known_values(cls, config)
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise NotImplementedError(f"config.json: rope_type {rope_type!r} is not supported (only default RoPE)")
        values["rope_theta"] = float(rope.get("rope_theta", config.get("rope_theta", cls.rope_theta)))
        values["partial_rotary_factor"] = float(
            rope.get("partial_rotary_factor", config.get("partial_rotary_factor", cls.partial_rotary_factor))
        )
        if "head_dim" not in values:
            values["head_dim"] = values.get("hidden_size", cls.hidden_size) // values.get(
                "num_attention_heads", cls.num_attention_heads
            )
        num_layers = values.get("num_hidden_layers", cls.num_hidden_layers)
        if not values.get("layer_types"):
            interval = int(config.get("full_attention_interval", 4))
            values["layer_types"] = periodic_layer_types(num_layers, interval, "linear_attention")
        result = cls(**values)
        result.validate()
        return result

    def validate(self) -> None:
        check_layer_types(self.layer_types, self.num_hidden_layers, ("linear_attention", "full_attention"))
        check_activation("hidden_act", self.hidden_act, "silu", "Qwen3.5")
        check_heads(self.num_attention_heads, self.num_key_value_heads)
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("config: linear_num_value_heads must be a multiple of linear_num_key_heads")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError("config: need 0 < num_experts_per_tok <= num_experts")
        if self.rotary_dim % 2:
            raise ValueError(f"config: rotary dimension {self.rotary_dim} (head_dim * partial_rotary_factor) must be even")
