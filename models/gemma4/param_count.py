"""Print the parameter count of Gemma 4 31B's text model (dense: every parameter is active).

Builds the model on the meta device from ``configs/gemma4_31b.json`` (or ``--config``).

    bazel run //models/gemma4:param_count [-- --config=path/to/config.json]
"""

from __future__ import annotations

import os
from typing import Dict

from models.common import params
from models.gemma4.config import ModelConfig
from models.gemma4.model import build_model

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "gemma4_31b.json")


def _group(name: str) -> str:
    if name.startswith("model.embed_tokens"):
        return "embed_tokens (tied lm_head)"
    if ".self_attn." in name and "norm" not in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    return "norms"


def parameter_counts(config: ModelConfig) -> Dict[str, int]:
    return params.parameter_counts(build_model(config, device="meta"), _group)


def _describe(config: ModelConfig) -> str:
    full = config.layer_types.count("full_attention")
    return (f"layers {config.num_hidden_layers} ({config.num_hidden_layers - full} sliding, {full} full), "
            f"hidden {config.hidden_size}, tied embeddings {config.tie_word_embeddings}, "
            f"{config.num_hidden_layers} layer scalars (buffers)")


if __name__ == "__main__":
    params.main_for("Gemma 4", DEFAULT_CONFIG, ModelConfig.from_hf_dict, parameter_counts, _describe)
