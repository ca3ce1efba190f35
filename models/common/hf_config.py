"""What every model's config reader does with a Hugging Face ``config.json`` dict.

A model's ``ModelConfig.from_hf_dict`` (models/<m>/config.py) keeps only what differs between
architectures (its fields and defaults, refusals, derived geometry); these helpers do the shared parts:
the multimodal wrapper, the known-field filter, the layer-type pattern and the checks on layer types,
per-layer-type RoPE and head counts.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Dict, Iterable, List, Sequence, Tuple


def text_config(config: dict, text_types: Tuple[str, ...], multimodal_types: Tuple[str, ...], family: str) -> dict:
    """The text model's config dict: a multimodal config's ``text_config`` (its model_type defaulted to
    ``text_types[0]``) or ``config`` itself; ValueError unless the model_type is one of ``text_types``."""
    model_type = config.get("model_type")
    if model_type in multimodal_types:
        if not isinstance(config.get("text_config"), dict):
            raise ValueError(f"config.json: model_type {model_type!r} needs a 'text_config' object")
        config = dict(config["text_config"])
        config.setdefault("model_type", text_types[0])
        model_type = config["model_type"]
    if model_type not in text_types:
        raise ValueError(f"config.json: model_type {model_type!r} is not a {family} text model "
                         f"(expected one of {text_types + multimodal_types})")
    return config


def known_values(cls, config: dict, exclude: Iterable[str] = ()) -> Dict[str, Any]:
    """The entries of ``config`` that are fields of dataclass ``cls`` (minus ``exclude``) and not None."""
    known = {f.name for f in fields(cls)} - set(exclude)
    return {k: v for k, v in config.items() if k in known and v is not None}


def periodic_layer_types(num_layers: int, period: int, other: str, every: str = "full_attention") -> List[str]:
    """``every`` on each ``period``-th layer (1-based), ``other`` elsewhere: the older configs' layer pattern."""
    return [every if (i + 1) % period == 0 else other for i in range(num_layers)]


def check_layer_types(layer_types: Sequence[str], num_layers: int, allowed: Tuple[str, ...]) -> None:
    if len(layer_types) != num_layers:
        raise ValueError(f"config: layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - set(allowed))
    if unknown:
        raise ValueError(f"config: unknown layer types {unknown} (expected {allowed})")


def check_rope_per_layer_type(rope_parameters: Dict[str, dict], layer_types: Sequence[str],
                              rope_types: Tuple[str, ...]) -> None:
    """Every layer type has a RoPE dict whose rope_type (default "default") is one of ``rope_types``."""
    for layer_type in sorted(set(layer_types)):
        rope = rope_parameters.get(layer_type)
        if not isinstance(rope, dict) or rope.get("rope_type", "default") not in rope_types:
            raise NotImplementedError(f"config: rope_parameters[{layer_type!r}] = {rope!r}; "
                                      f"only {rope_types} RoPE is supported")


def check_activation(name: str, value: str, expected: str, family: str) -> None:
    if value != expected:
        raise NotImplementedError(f"config: {name} {value!r} is not supported ({family} uses {expected})")


def check_heads(num_heads: int, kv_heads: int, where: str = "") -> None:
    if num_heads % kv_heads:
        raise ValueError(f"config: {where}{num_heads} heads not a multiple of {kv_heads} kv heads")
