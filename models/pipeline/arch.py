"""What the pipeline needs to know about one model architecture, in one place, and the one
registry that finds an architecture by the checkpoint it is given.

Each model package (models/qwen, models/gemma4, models/gemma3) fills an `Architecture` in its
architecture.py (`package_architecture`, which checks the package's conventional parts with one message
each); models/architectures.py registers every one (`register_architecture`), and
`architecture_for_model_type` / `architecture_for_gguf` find the one that reads a config.json
`model_type` or a GGUF `general.architecture`. The pipeline code never names a model.
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
    # --verify's comparison (models/pipeline/verify.py's `verify` signature); None: that one, with the
    # model this architecture builds. The model-free architecture (models/pipeline/generic.py) sets its own.
    verify: Optional[Callable[..., Any]] = None

    def reads(self, hf_config: Dict[str, Any]) -> bool:
        """Whether a config.json dict is of this architecture (by its model_type)."""
        return hf_config.get("model_type") in self.hf_model_types

    def num_layers(self, config) -> int:
        return int(config.num_hidden_layers)

    @property
    def gguf_architecture(self) -> str:
        """The GGUF `general.architecture` this architecture imports ("" without a GGUF import)."""
        return self.gguf_import.GGUF_ARCH if self.gguf_import is not None else ""


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


class ModelPackageError(TypeError):
    """A model package that lacks a conventional part, or claims a checkpoint kind another one reads:
    one line naming the package and the part."""


_REGISTRY: Dict[str, Architecture] = {}


def register_architecture(arch: Architecture) -> Architecture:
    """Make `arch` findable by its name, its config.json model_types and its GGUF architecture; a
    second architecture of one name, model_type or GGUF architecture is refused."""
    if arch.name in _REGISTRY:
        raise ModelPackageError(f"architecture {arch.name!r} is already registered")
    for other in _REGISTRY.values():
        shared = set(arch.hf_model_types) & set(other.hf_model_types)
        if shared:
            raise ModelPackageError(f"{arch.target}: model_type {sorted(shared)[0]!r} is already read by "
                                    f"{other.target}")
        if arch.gguf_architecture and arch.gguf_architecture == other.gguf_architecture:
            raise ModelPackageError(f"{arch.target}: GGUF architecture {arch.gguf_architecture!r} is already read "
                                    f"by {other.target}")
    _REGISTRY[arch.name] = arch
    return arch


def registered_architectures() -> Tuple[Architecture, ...]:
    """Every registered architecture, by name."""
    return tuple(_REGISTRY[n] for n in sorted(_REGISTRY))


def architecture_for_model_type(model_type: Any) -> Optional[Architecture]:
    """The registered architecture that reads config.json's `model_type`, or None."""
    return next((a for a in _REGISTRY.values() if model_type in a.hf_model_types), None)


def architecture_for_gguf(gguf_architecture: Any) -> Optional[Architecture]:
    """The registered architecture that imports GGUF files of `general.architecture`, or None."""
    return next((a for a in _REGISTRY.values() if a.gguf_architecture and a.gguf_architecture == gguf_architecture),
                None)


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
    ``//models/<dir>:quantize_and_save``; ``fields`` gives the rest (tiny_hf_config, gguf_import, ...). A part
    that is missing is a ModelPackageError naming it (one line each)."""
    import os

    package = os.path.dirname(os.path.abspath(package_file))
    where = f"models/{os.path.basename(package)}"
    _require(where, "config.py", config, ("ModelConfig", "TEXT_MODEL_TYPES", "MULTIMODAL_MODEL_TYPES"),
             "ModelConfig (with from_hf_dict), TEXT_MODEL_TYPES and MULTIMODAL_MODEL_TYPES (the config.json "
             "model_type values it reads; () where none)")
    _require(where, "config.py", config.ModelConfig, ("from_hf_dict",), "ModelConfig.from_hf_dict(config.json dict)")
    _require(where, "model.py", model, ("build_model",), "build_model(config, device=..., dtype=...)")
    _require(where, "keymap.py", keymap, ("hf_to_llmq_key",), "hf_to_llmq_key(HF name) -> model name | None")
    for types in ("TEXT_MODEL_TYPES", "MULTIMODAL_MODEL_TYPES"):
        value = vars(config)[types]
        if not isinstance(value, tuple) or not all(isinstance(t, str) for t in value):
            raise ModelPackageError(f"{where}/config.py: {types} must be a tuple of model_type strings, got {value!r}")
    gguf = fields.get("gguf_import")
    if gguf is not None:
        _require(where, "gguf_checkpoint.py", gguf, ("GGUF_ARCH", "hf_config_from_gguf", "GGUFConverter"),
                 "GGUF_ARCH, hf_config_from_gguf(metadata, tensors) and GGUFConverter (models/pipeline/gguf_input.py)")
    recipes = os.path.join(package, "recipes")
    if not os.path.isdir(recipes):
        raise ModelPackageError(f"{where}: no recipes/ folder (recipes/<name>.json: the model's presets)")
    return Architecture(
        name=name, config_from_hf=config.ModelConfig.from_hf_dict, build_model=model.build_model,
        key_map=keymap.hf_to_llmq_key, presets=recipe_files(recipes), recipe_descriptions=recipe_file_descriptions(recipes),
        hf_model_types=config.TEXT_MODEL_TYPES + config.MULTIMODAL_MODEL_TYPES,
        target=f"//models/{os.path.basename(package)}:quantize_and_save", **fields)


def _require(where: str, file: str, namespace: Any, names: Tuple[str, ...], expected: str) -> None:
    """One ModelPackageError line for the first of `names` that `namespace` (a module or class) lacks."""
    for n in names:
        if not hasattr(namespace, n):
            raise ModelPackageError(f"{where}/{file}: defines no {n} (expected {expected})")
