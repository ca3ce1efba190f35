"""What the pipeline needs to know about one model architecture, in one place.

Each model package (models/qwen, models/gemma4) fills an `Architecture`; the pipeline code
never names a model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from llmq.quant import QuantRecipe


@dataclasses.dataclass(frozen=True)
class Architecture:
    name: str
    # A deterministic tiny HF config.json dict of this architecture (the embedded default).
    tiny_hf_config: Callable[[], Dict[str, Any]]
    config_from_hf: Callable[[Dict[str, Any]], Any]
    build_model: Callable[..., nn.Module]  # (config, device=..., dtype=...) -> model
    key_map: Callable[[str], Optional[str]]  # HF name -> model state name | None (skip)
    # Per-expert HF tensors -> the model's stacked layout (None: the architecture has none). With
    # is_per_expert, both: merge_experts for a dict of tensors (loading), expert_stacks for a stream:
    # (a per-expert tensor's name, experts per layer) -> the stacks it belongs to, filled tensor by
    # tensor (`add(name, t)`, `complete`, `count`, `stacks()`), each tensor copied once.
    is_per_expert: Optional[Callable[[str], bool]] = None
    merge_experts: Optional[Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]]] = None
    expert_stacks: Optional[Callable[[str, int], Any]] = None
    # One model tensor -> the HF checkpoint tensors it is stored as (e.g. per-expert unstacking).
    to_hf_tensors: Callable[[str, torch.Tensor], Dict[str, torch.Tensor]] = lambda name, t: {name: t}
    # Adjusts the random embedded-default model where plain random init is unlike a trained model.
    prepare_default: Callable[[nn.Module], None] = lambda model: None
    presets: Dict[str, QuantRecipe] = dataclasses.field(default_factory=dict)
    default_recipe: str = "int4"
    # --checkpoint=model.gguf: a module (models/<m>/gguf_checkpoint.py) with GGUF_ARCH, `hf_config_from_gguf` and
    # `GGUFConverter` (see models/pipeline/gguf_input.py; None: GGUF input is refused).
    gguf_import: Optional[Any] = None
    # config.json model_type values this architecture reads, and the bazel target of its binary: a
    # checkpoint of another architecture given to this binary is told which target to use instead.
    hf_model_types: Tuple[str, ...] = ()
    target: str = ""
    # One line per preset saying what it does (the recipe files' "description"), for --list_recipes.
    recipe_descriptions: Dict[str, str] = dataclasses.field(default_factory=dict)

    def reads(self, hf_config: Dict[str, Any]) -> bool:
        """Whether a config.json dict is of this architecture (by its model_type)."""
        return hf_config.get("model_type") in self.hf_model_types

    def num_layers(self, config) -> int:
        return int(config.num_hidden_layers)


def quantizable_module(name: str) -> Optional[str]:
    """The module fqn a recipe sees for a tensor name, or None if the tensor is never quantized.

    `<module>.weight` matrices and fused expert stacks (`...experts.gate_up_proj`,
    `...experts.down_proj`) are weights; biases, norms' vectors and other parameters are not.
    """
    if name.endswith(".weight"):
        return name[: -len(".weight")]
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        return name
    return None


def _recipe_paths(folder: str) -> Dict[str, str]:
    import os

    return {os.path.splitext(f)[0]: os.path.join(folder, f)
            for f in sorted(os.listdir(folder)) if f.endswith((".json", ".yaml", ".yml"))}


def recipe_files(folder: str) -> Dict[str, QuantRecipe]:
    """`<folder>/<name>.json` recipe files as presets named `<name>` (int4, int8, mixed, ...)."""
    return {name: QuantRecipe.from_file(path) for name, path in _recipe_paths(folder).items()}


def recipe_file_descriptions(folder: str) -> Dict[str, str]:
    """The "description" field of each recipe file in `folder`, by preset name."""
    import json

    out = {}
    for name, path in _recipe_paths(folder).items():
        with open(path, encoding="utf-8") as f:
            if path.endswith(".json"):
                data = json.load(f)
            else:
                import yaml

                data = yaml.safe_load(f)
        if isinstance(data, dict) and isinstance(data.get("description"), str):
            out[name] = data["description"]
    return out


def package_architecture(name: str, package_file: str, *, config, model, keymap, **fields) -> Architecture:
    """A model package's Architecture from its conventional parts (models/<dir>/): ``config.ModelConfig.from_hf_dict``
    and ``config.TEXT_MODEL_TYPES + MULTIMODAL_MODEL_TYPES``, ``model.build_model``, ``keymap.hf_to_llmq_key``,
    the recipe files ``recipes/*.json`` (presets and their descriptions) and the target
    ``//models/<dir>:quantize_and_save``; ``fields`` gives the rest (tiny_hf_config, gguf_import, ...)."""
    import os

    package = os.path.dirname(os.path.abspath(package_file))
    recipes = os.path.join(package, "recipes")
    return Architecture(
        name=name, config_from_hf=config.ModelConfig.from_hf_dict, build_model=model.build_model,
        key_map=keymap.hf_to_llmq_key, presets=recipe_files(recipes), recipe_descriptions=recipe_file_descriptions(recipes),
        hf_model_types=config.TEXT_MODEL_TYPES + config.MULTIMODAL_MODEL_TYPES,
        target=f"//models/{os.path.basename(package)}:quantize_and_save", **fields)
