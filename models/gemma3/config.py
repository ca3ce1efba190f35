"""Gemma 3 text configuration (``gemma3_text``), read from a Hugging Face ``config.json`` dict.

Field names and defaults follow transformers' ``Gemma3TextConfig``. Every layer has the same
attention geometry; ``layer_types`` (or the older ``sliding_window_pattern``, default 6) says which
layers attend within ``sliding_window``. RoPE bases: ``rope_parameters`` per layer type, or the older
``rope_theta`` (global layers), ``rope_local_base_freq`` (sliding layers) and ``rope_scaling``
(global layers only, e.g. {"rope_type": "linear", "factor": 8} on 4B and larger).

Supported: every Gemma 3 text stack (270M .. 27B, and the text part of the multimodal
checkpoints). Refused with NotImplementedError: attention-logit soft-capping, bidirectional
attention, RoPE types other than default and linear, activations other than gelu_pytorch_tanh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, Tuple

from models.common.hf_config import known_values, periodic_layer_types, text_config
from models.gemma4 import config as gemma4_config
from models.gemma4.config import LAYER_TYPES, LayerGeometry

TEXT_MODEL_TYPES = ("gemma3_text",)
MULTIMODAL_MODEL_TYPES = ("gemma3",)
ROPE_TYPES = ("default", "linear")


@dataclass(frozen=True)
class ModelConfig(gemma4_config.ModelConfig):
    """Gemma 4's fields (attention_k_eq_v unused: every layer has v_proj) with Gemma 3's defaults, plus
    query_pre_attn_scalar. rope_parameters per layer type: {"rope_type": "default"|"linear", "rope_theta", "factor"};
    layer_geometry is the same for every layer."""

    vocab_size: int = 262_208
    num_hidden_layers: int = 26
    sliding_window: int = 4096
    query_pre_attn_scalar: float = 256

    # What the Gemma module code (models/gemma4/model.py) asks of a config.
    norm_offset: ClassVar[float] = 1.0  # RMSNorm scales by 1 + weight
    value_norm: ClassVar[bool] = False
    layer_scalar: ClassVar[bool] = False
    family: ClassVar[str] = "Gemma 3"
    rope_types: ClassVar[Tuple[str, ...]] = ROPE_TYPES

    @property
    def attention_scaling(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5

    @classmethod
    def from_hf_dict(cls, config: dict) -> "ModelConfig":
        config = text_config(config, TEXT_MODEL_TYPES, MULTIMODAL_MODEL_TYPES, cls.family)
        if config.get("attn_logit_softcapping") is not None:
            raise NotImplementedError("config: attn_logit_softcapping is not supported (no Gemma 3 release uses it)")
        if config.get("use_bidirectional_attention"):
            raise NotImplementedError("config: use_bidirectional_attention is not supported (causal text model only)")
        values = known_values(cls, config, exclude=("layer_geometry", "rope_parameters", "layer_types", "attention_k_eq_v"))
        num_layers = values.get("num_hidden_layers", cls.num_hidden_layers)
        values["layer_types"] = list(config.get("layer_types") or periodic_layer_types(
            num_layers, int(config.get("sliding_window_pattern") or 6), "sliding_attention"))
        values["rope_parameters"] = _rope_parameters(config)
        head_dim = int(values.get("head_dim", cls.head_dim))
        geometry = LayerGeometry(head_dim=head_dim, has_v_proj=True,
                                 num_key_value_heads=int(values.get("num_key_value_heads", cls.num_key_value_heads)))
        values["layer_geometry"] = (geometry,) * num_layers
        result = cls(**values)
        result.validate()
        return result


def _rope_parameters(config: dict) -> Dict[str, dict]:
    """Per-layer-type RoPE, from ``rope_parameters`` or the older flat keys (as transformers converts them)."""
    given = config.get("rope_parameters")
    if isinstance(given, dict) and ("full_attention" in given or "sliding_attention" in given):
        rope = {t: dict(given.get(t) or {"rope_type": "default"}) for t in LAYER_TYPES}
    else:
        rope = {t: {"rope_type": "default"} for t in LAYER_TYPES}
        if isinstance(config.get("rope_scaling"), dict):
            rope["full_attention"].update(config["rope_scaling"])
    for params in rope.values():  # the older spelling of the type
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
    rope["full_attention"].setdefault("rope_theta", float(config.get("rope_theta", 1_000_000.0)))
    rope["sliding_attention"].setdefault("rope_theta", float(config.get("rope_local_base_freq", 10_000.0)))
    return rope
