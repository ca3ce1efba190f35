"""Qwen3.5-MoE pipeline tensors -> the names, layouts and config.json that mlx-lm's `qwen3_5_moe` loads.

Facts from mlx-lm 0.32.2 (`models/qwen3_5_moe.py`, `qwen3_5.py`, `qwen3_next.py`):

* The model wraps a `language_model` (`TextModel`): every tensor lives under
  `language_model.` (`language_model.model.layers.N...`, `language_model.lm_head`), and the
  "quantization" per-layer overrides must use those full paths.
* Routed experts are a `SwitchGLU` at `mlp.switch_mlp.{gate,up,down}_proj`, stacked
  [E, out, in]. Our fused `experts.gate_up_proj` [E, 2F, D] holds gate in rows [0, F) and up in
  rows [F, 2F) (transformers' order), so the split is a row slice; for a quantized weight it is a
  slice of qdata/scale/bias rows, which is exact. (mlx-lm's sanitize splits only float stacks.)
* `sanitize` decides whether a checkpoint is "HF-shaped" by looking for a `conv1d.weight` whose
  last axis is not 1: if it finds one, it moves the conv axis AND adds 1 to the RMSNorm weights
  (input/post_attention layernorms, model.norm, q_norm, k_norm). We therefore write conv1d as
  [C, K, 1] (MLX's Conv1d layout) and those norms already +1 (Qwen3.5 stores them as offsets from
  1); sanitize then leaves everything alone. The DeltaNet output norm (`linear_attn.norm`) is a
  plain-scale norm and is not shifted.
* Layer kinds come from `full_attention_interval` (layer i is linear unless (i+1) % interval == 0),
  not from `layer_types`, so the config must say the same thing as the checkpoint's pattern.
"""

from __future__ import annotations

from typing import Any, List, Tuple, Union

import torch

from llmq.quant.formats import GroupQuantizedWeight
from llmq_mlx.mlx_lm_models.common import copied, special_token_ids, split_rows, text_section

Value = Union[torch.Tensor, GroupQuantizedWeight]

# The HF config.json model_type values whose checkpoints this mlx-lm naming serves.
HF_MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")

PREFIX = "language_model."
# RMSNorms whose stored weight is an offset from 1 (ours: ZeroCenteredRMSNorm); mlx-lm's are plain.
_SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight")


def _is_shifted_norm(name: str) -> bool:
    return name == "model.norm.weight" or name.endswith(_SHIFTED_NORMS)


def mlx_tensors(name: str, value: Value) -> List[Tuple[str, Value]]:
    """One pipeline tensor (our = HF text names) -> [(mlx-lm name, value in mlx-lm's layout)]."""
    if name.endswith(".mlp.experts.gate_up_proj"):
        base = PREFIX + name[: -len("experts.gate_up_proj")] + "switch_mlp."
        rows = value.shape[-2]
        if rows % 2:
            raise ValueError(f"{name}: fused gate_up has {rows} rows; expected an even number (gate rows, then up rows)")
        half = rows // 2
        return [(base + "gate_proj.weight", split_rows(value, 0, half)),
                (base + "up_proj.weight", split_rows(value, half, rows))]
    if name.endswith(".mlp.experts.down_proj"):
        return [(PREFIX + name[: -len("experts.down_proj")] + "switch_mlp.down_proj.weight", value)]
    if isinstance(value, GroupQuantizedWeight):
        return [(PREFIX + name, value)]
    if name.endswith(".linear_attn.conv1d.weight"):
        if value.dim() != 3 or value.shape[1] != 1:
            raise ValueError(f"{name}: expected a depthwise conv weight [C, 1, K], got {list(value.shape)}")
        return [(PREFIX + name, value.permute(0, 2, 1).contiguous())]  # [C, 1, K] -> MLX [C, K, 1]
    if _is_shifted_norm(name):
        if value.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D norm weight, got {list(value.shape)}")
        return [(PREFIX + name, (value.float() + 1.0).to(value.dtype))]
    return [(PREFIX + name, value)]


def full_attention_interval(layer_types: List[str]) -> int:
    """The period mlx-lm uses to place full-attention layers; ValueError if the pattern has none."""
    if "full_attention" not in layer_types:
        raise ValueError("layer_types has no full_attention layer; mlx-lm's qwen3_5_moe needs a periodic pattern")
    interval = layer_types.index("full_attention") + 1
    expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(layer_types))]
    if list(layer_types) != expected:
        raise ValueError(
            f"layer_types {layer_types} is not 'full attention every {interval}th layer'; mlx-lm's qwen3_5_moe "
            "derives layer kinds from full_attention_interval and cannot express it"
        )
    return interval


def mlx_config(hf_config: dict, c: Any) -> dict:
    """config.json for mlx-lm's `qwen3_5_moe` (without "quantization"; the folder writer adds it).

    `c`: the parsed model config (the model's own reading of hf_config: attributes as the model uses them)."""
    text = text_section(hf_config)
    text_config = {
        "model_type": "qwen3_5_moe_text",
        **copied(c, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "rms_norm_eps"),
        "max_position_embeddings": int(text.get("max_position_embeddings", 262144)),
        **copied(c, "tie_word_embeddings", "attention_bias", "linear_conv_kernel_dim", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads"),
        "full_attention_interval": full_attention_interval(c.layer_types),
        **copied(c, "num_experts", "num_experts_per_tok"),
        "decoder_sparse_step": 1,
        **copied(c, "moe_intermediate_size", "shared_expert_intermediate_size"),
        "norm_topk_prob": True,
        "rope_parameters": {
            "type": "default", "rope_theta": c.rope_theta, "partial_rotary_factor": c.partial_rotary_factor,
        },
    }
    config = {"model_type": "qwen3_5_moe", "text_config": text_config, "tie_word_embeddings": c.tie_word_embeddings}
    return dict(config, **special_token_ids(hf_config, text))
