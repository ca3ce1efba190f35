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

from dataclasses import dataclass, field, fields
from typing import ClassVar, Dict, List, Optional, Tuple

from models.gemma4.config import LAYER_TYPES, LayerGeometry

TEXT_MODEL_TYPES = ("gemma3_text",)
MULTIMODAL_MODEL_TYPES = ("gemma3",)
ROPE_TYPES = ("default", "linear")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 262_208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    sliding_window: int = 4096
    query_pre_attn_scalar: float = 256
    final_logit_softcapping: Optional[float] = None
    layer_types: List[str] = field(default_factory=list)
    # per layer type: {"rope_type": "default"|"linear", "rope_theta": float, "factor": float}
    rope_parameters: Dict[str, dict] = field(default_factory=dict)
    layer_geometry: Tuple[LayerGeometry, ...] = ()  # the same for every layer (for the shared Gemma modules)
    eos_token_id: Optional[object] = None
    pad_token_id: Optional[int] = None

    # What the Gemma module code (models/gemma4/model.py) asks of a config.
    norm_offset: ClassVar[float] = 1.0  # RMSNorm scales by 1 + weight
    value_norm: ClassVar[bool] = False
    layer_scalar: ClassVar[bool] = False

    @property
    def attention_scaling(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5

    @classmethod
    def from_hf_dict(cls, config: dict) -> "ModelConfig":
        model_type = config.get("model_type")
        if model_type in MULTIMODAL_MODEL_TYPES:
            if not isinstance(config.get("text_config"), dict):
                raise ValueError(f"config.json: model_type {model_type!r} needs a 'text_config' object")
            config = dict(config["text_config"])
            config.setdefault("model_type", TEXT_MODEL_TYPES[0])
            model_type = config["model_type"]
        if model_type not in TEXT_MODEL_TYPES:
            raise ValueError(f"config.json: model_type {model_type!r} is not a Gemma 3 text model "
                             f"(expected one of {TEXT_MODEL_TYPES + MULTIMODAL_MODEL_TYPES})")
        if config.get("attn_logit_softcapping") is not None:
            raise NotImplementedError("config: attn_logit_softcapping is not supported (no Gemma 3 release uses it)")
        if config.get("use_bidirectional_attention"):
            raise NotImplementedError("config: use_bidirectional_attention is not supported (causal text model only)")
        known = {f.name for f in fields(cls)} - {"layer_geometry", "rope_parameters", "layer_types"}
        values = {k: v for k, v in config.items() if k in known and v is not None}
        num_layers = values.get("num_hidden_layers", cls.num_hidden_layers)
        layer_types = list(config.get("layer_types") or [])
        if not layer_types:
            pattern = int(config.get("sliding_window_pattern") or 6)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        values["layer_types"] = layer_types
        values["rope_parameters"] = _rope_parameters(config)
        head_dim = int(values.get("head_dim", cls.head_dim))
        geometry = LayerGeometry(head_dim=head_dim, has_v_proj=True,
                                 num_key_value_heads=int(values.get("num_key_value_heads", cls.num_key_value_heads)))
        values["layer_geometry"] = (geometry,) * num_layers
        result = cls(**values)
        result.validate()
        return result

    def validate(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"config: layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"config: unknown layer types {unknown} (expected {LAYER_TYPES})")
        for layer_type in set(self.layer_types):
            rope = self.rope_parameters.get(layer_type)
            if not isinstance(rope, dict) or rope.get("rope_type", "default") not in ROPE_TYPES:
                raise NotImplementedError(f"config: rope_parameters[{layer_type!r}] = {rope!r}; "
                                          f"only {ROPE_TYPES} RoPE is supported")
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise NotImplementedError(f"config: hidden_activation {self.hidden_activation!r} (Gemma 3 uses gelu_pytorch_tanh)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"config: {self.num_attention_heads} heads not a multiple of {self.num_key_value_heads} kv heads")


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
