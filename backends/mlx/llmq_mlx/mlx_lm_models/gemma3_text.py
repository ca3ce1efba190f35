"""Gemma 3 (text) pipeline tensors -> the names and config.json that mlx-lm's `gemma3_text` loads.

Facts from mlx-lm 0.32.2 (`models/gemma3_text.py`):

* Module names equal transformers' `Gemma3ForCausalLM` names, and its RMSNorm scales by
  1 + weight, as transformers and llmq store it: tensors pass through unchanged. Tied embeddings:
  no `lm_head` (its sanitize ties when the weight is absent).
* Layer kinds come from `sliding_window_pattern` (every n-th layer global), not `layer_types`, so a
  config whose layer_types do not follow one pattern is refused. RoPE: `rope_local_base_freq` on
  sliding layers, `rope_theta` and `rope_scaling` (e.g. linear, factor 8) on global layers.
"""

from __future__ import annotations

from typing import Any, List, Tuple

from llmq_mlx.mlx_lm_models.common import copied, special_token_ids, text_section

HF_MODEL_TYPES = ("gemma3_text", "gemma3")


def mlx_tensors(name: str, value: Any) -> List[Tuple[str, Any]]:
    """One pipeline tensor -> [(mlx-lm name, value)]: the names are shared."""
    return [(name, value)]


def _pattern(layer_types: List[str]) -> int:
    """n such that layer i is global exactly when (i + 1) % n == 0; ValueError if there is none."""
    for n in range(1, len(layer_types) + 1):
        if all((t == "full_attention") == ((i + 1) % n == 0) for i, t in enumerate(layer_types)):
            return n
    raise ValueError(f"layer_types {layer_types} follow no sliding_window_pattern; mlx-lm's gemma3_text cannot "
                     "express them")


def mlx_config(hf_config: dict, c: Any) -> dict:
    """config.json for mlx-lm's `gemma3_text` (without "quantization"; the folder writer adds it)."""
    text = text_section(hf_config)
    sliding = c.rope_parameters.get("sliding_attention", {})
    full = dict(c.rope_parameters.get("full_attention", {}))
    config = {
        "model_type": "gemma3_text",
        **copied(c, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "query_pre_attn_scalar", "sliding_window"),
        "sliding_window_pattern": _pattern(list(c.layer_types)),
        "rope_local_base_freq": float(sliding.get("rope_theta", 10_000.0)),
        "rope_theta": float(full.get("rope_theta", 1_000_000.0)),
        "max_position_embeddings": int(text.get("max_position_embeddings", 32768)),
    }
    if full.get("rope_type", "default") != "default":
        config["rope_scaling"] = {"rope_type": full["rope_type"], "factor": float(full.get("factor", 1.0))}
    return dict(config, **special_token_ids(hf_config, text))
