"""Print the parameter counts of Qwen3.5-35B-A3B's text model (total and active per token).

Builds the model on the meta device from ``configs/qwen3_5_35b_a3b.json`` (or ``--config``), so
it needs no memory and no download. "Active" counts the routed experts at top_k / num_experts;
everything else (attention, DeltaNet, router, shared expert, norms, embeddings, head) runs for every token.

    bazel run //models/qwen:param_count [-- --config=path/to/config.json]
"""

from __future__ import annotations

import os
from typing import Dict

from models.common import params
from models.qwen.config import ModelConfig
from models.qwen.model import build_model

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "qwen3_5_35b_a3b.json")
ROUTED = "routed experts"


def _group(name: str) -> str:
    if name.startswith("model.embed_tokens"):
        return "embed_tokens"
    if name.startswith("lm_head"):
        return "lm_head"
    for key, group in ((".mlp.experts.", ROUTED), (".mlp.gate.", "router"),
                       (".mlp.shared_expert", "shared expert (+gate)"), (".linear_attn.", "Gated DeltaNet"),
                       (".self_attn.", "gated attention")):
        if key in name:
            return group
    return "norms"


def parameter_counts(config: ModelConfig) -> Dict[str, int]:
    """{"total", "active", per-component groups...} for the text model built on the meta device."""
    return params.parameter_counts(build_model(config, device="meta"), _group, routed=ROUTED,
                                   top_k=config.num_experts_per_tok, num_experts=config.num_experts)


def _describe(config: ModelConfig) -> str:
    return (f"layers {config.num_hidden_layers} ({config.layer_types.count('linear_attention')} DeltaNet, "
            f"{config.layer_types.count('full_attention')} full attention), "
            f"experts {config.num_experts} top-{config.num_experts_per_tok}")


if __name__ == "__main__":
    params.main_for("Qwen3.5-MoE", DEFAULT_CONFIG, ModelConfig.from_hf_dict, parameter_counts, _describe)
