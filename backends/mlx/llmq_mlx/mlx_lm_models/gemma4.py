"""Gemma 4 (dense text) pipeline tensors -> the names and config.json that mlx-lm's `gemma4_text` loads.

Facts from mlx-lm 0.32.2 (`models/gemma4_text.py`):

* Module names equal transformers' text names (`model.layers.N.self_attn.q_proj`, ...,
  `model.layers.N.layer_scalar`), and RMSNorm weights are used as stored (no +1), as in ours.
  K=V full-attention layers have no `v_proj` on either side. Tied embeddings: no `lm_head`;
  mlx-lm multiplies by the (possibly quantized) embedding.
* Its defaults are those of the small Gemma 4 models: `num_kv_shared_layers=20`,
  `hidden_size_per_layer_input=256`, `use_double_wide_mlp=True`. A config that omits them gets
  KV sharing and per-layer inputs, so we always write them (0 / 0 / False: the dense stack).
* Full-attention geometry is `global_head_dim` and, on K=V layers, `num_global_key_value_heads`;
  transformers' saved configs may carry it as `per_layer_config` instead, so it is re-derived from
  the parsed per-layer geometry and refused if mlx-lm cannot express it.
* A MoE block would be `experts.switch_glu.{gate,up,down}_proj` (sanitize splits only float
  stacks): mapped here for completeness, though our model refuses MoE configs today.
"""

from __future__ import annotations

from typing import Any, List, Tuple, Union

import torch

from llmq.quant.formats import GroupQuantizedWeight
from llmq_mlx.mlx_lm_models.common import copied, special_token_ids, split_rows, text_section

Value = Union[torch.Tensor, GroupQuantizedWeight]

# The HF config.json model_type values whose checkpoints this mlx-lm naming serves.
HF_MODEL_TYPES = ("gemma4_text", "gemma4")


def mlx_tensors(name: str, value: Value) -> List[Tuple[str, Value]]:
    """One pipeline tensor (our = HF text names) -> [(mlx-lm name, value)]: names are shared."""
    if name.endswith(".experts.gate_up_proj"):
        base = name[: -len("gate_up_proj")] + "switch_glu."
        half = value.shape[-2] // 2
        return [(base + "gate_proj.weight", split_rows(value, 0, half)),
                (base + "up_proj.weight", split_rows(value, half, value.shape[-2]))]
    if name.endswith(".experts.down_proj"):
        return [(name[: -len("down_proj")] + "switch_glu.down_proj.weight", value)]
    return [(name, value)]


def _full_attention_geometry(c: Any) -> Tuple[int, int]:
    """(global_head_dim, num_global_key_value_heads) of the full layers; ValueError where mlx-lm cannot say it."""
    by_type = {}
    for i, (layer_type, g) in enumerate(zip(c.layer_types, c.layer_geometry)):
        seen = by_type.setdefault(layer_type, g)
        if seen != g:
            raise ValueError(f"layer {i} ({layer_type}) has geometry {g}, other {layer_type} layers {seen}; "
                             "mlx-lm's gemma4_text gives all layers of a type one geometry")
    sliding = by_type.get("sliding_attention")
    if sliding is not None and (sliding.head_dim, sliding.num_key_value_heads, sliding.has_v_proj) != (
            c.head_dim, c.num_key_value_heads, True):
        raise ValueError(f"sliding layers have geometry {sliding}; mlx-lm expects head_dim/num_key_value_heads and a v_proj")
    full = by_type.get("full_attention")
    if full is None:
        return c.head_dim, c.num_key_value_heads
    if full.has_v_proj != (not c.attention_k_eq_v):
        raise ValueError("full-attention layers' v_proj presence disagrees with attention_k_eq_v")
    if not c.attention_k_eq_v and full.num_key_value_heads != c.num_key_value_heads:
        raise ValueError("full-attention layers have their own kv-head count without attention_k_eq_v; "
                         "mlx-lm's gemma4_text cannot express that")
    return full.head_dim, full.num_key_value_heads


def mlx_config(hf_config: dict, c: Any) -> dict:
    """config.json for mlx-lm's `gemma4_text` (without "quantization"; the folder writer adds it).

    `c`: the parsed model config (the model's own reading of hf_config: attributes as the model uses them)."""
    text = text_section(hf_config)
    global_head_dim, global_kv_heads = _full_attention_geometry(c)
    rope = {}
    for layer_type, params in c.rope_parameters.items():
        params = dict(params)
        if params.get("rope_type", "default") == "default" and float(params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"rope_parameters[{layer_type!r}]: mlx-lm's default RoPE rotates the whole head "
                             "(partial_rotary_factor must be 1)")
        rope[layer_type] = params
    config = {
        "model_type": "gemma4_text",
        **copied(c, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim"),
        "global_head_dim": global_head_dim,
        "num_global_key_value_heads": global_kv_heads,
        "attention_k_eq_v": c.attention_k_eq_v,
        "rms_norm_eps": c.rms_norm_eps,
        "sliding_window": c.sliding_window,
        "layer_types": list(c.layer_types),
        "rope_parameters": rope,
        "max_position_embeddings": int(text.get("max_position_embeddings", 131072)),
        "final_logit_softcapping": c.final_logit_softcapping,
        "tie_word_embeddings": c.tie_word_embeddings,
        # mlx-lm's defaults describe the small (KV-shared, per-layer-input) models: say "dense" explicitly.
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "use_double_wide_mlp": False,
        "enable_moe_block": False,
    }
    return dict(config, **special_token_ids(hf_config, text))
