"""mlx-lm's names, layouts and config.json per model, one module per mlx-lm model file (as mlx-lm keeps
them), found by the Hugging Face config's model_type.

Each module has HF_MODEL_TYPES, `mlx_tensors(name, value) -> [(mlx_name, value)]` (one model-layout
tensor, HF text names, in mlx-lm's names and layouts) and `mlx_config(hf_config, model_config) -> dict`.
Adding a model to the MLX backend: write `<mlx-lm model file name>.py` here and list it in _MODULES.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Dict, Mapping, Optional

from llmq_mlx.mlx_lm_models import gemma3_text, gemma4, qwen3_5_moe

_MODULES = (gemma3_text, gemma4, qwen3_5_moe)
BY_MODEL_TYPE: Dict[str, ModuleType] = {t: m for m in _MODULES for t in m.HF_MODEL_TYPES}


def naming_for(hf_config: Mapping[str, Any]) -> Optional[ModuleType]:
    """The mlx-lm naming module for a config.json dict (by its model_type), or None."""
    return BY_MODEL_TYPE.get(hf_config.get("model_type"))
