"""Gemma 4 text configuration (``gemma4_text``), read from a Hugging Face ``config.json`` dict.

Field names and defaults follow transformers' ``Gemma4TextConfig``. Gemma 4 gives full-attention
layers their own geometry (``global_head_dim``, and with ``attention_k_eq_v`` fewer KV heads,
``num_global_key_value_heads``, and no v_proj); transformers records that as ``per_layer_config``
overrides, which a saved config.json carries instead of ``global_head_dim``. Both spellings are read.

Supported: the dense text stack of Gemma 4 31B (sliding/full pattern, K=V full layers, proportional
RoPE, final-logit soft-capping, tied embeddings, per-layer scalars). Refused with NotImplementedError:
MoE blocks (26B-A4B), per-layer input embeddings and KV sharing (the E2B/E4B models), bidirectional attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Dict, List, Optional, Tuple

from models.common.hf_config import (
    check_activation,
    check_heads,
    check_layer_types,
    check_rope_per_layer_type,
    known_values,
    periodic_layer_types,
    text_config,
)

TEXT_MODEL_TYPES = ("gemma4_text",)
MULTIMODAL_MODEL_TYPES = ("gemma4",)
LAYER_TYPES = ("sliding_attention", "full_attention")
ROPE_TYPES = ("default", "proportional")


@dataclass(frozen=True)
class LayerGeometry:
    head_dim: int
    num_key_value_heads: int
    has_v_proj: bool


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    sliding_window: int = 512
    final_logit_softcapping: Optional[float] = None
    attention_k_eq_v: bool = False
    layer_types: List[str] = field(default_factory=list)
    # per layer type: {"rope_type": "default"|"proportional", "rope_theta": float, "partial_rotary_factor", "factor"}
    rope_parameters: Dict[str, dict] = field(default_factory=dict)
    # per layer index: its attention geometry (filled by from_hf_dict)
    layer_geometry: Tuple[LayerGeometry, ...] = ()
    eos_token_id: Optional[object] = None
    pad_token_id: Optional[int] = None

    # What the Gemma module code (models/gemma4/model.py, shared with Gemma 3) asks of a config.
    norm_offset: ClassVar[float] = 0.0  # RMSNorms scale by offset + weight
    value_norm: ClassVar[bool] = True  # a scale-free RMSNorm on v
    layer_scalar: ClassVar[bool] = True  # a learned per-layer output scalar
    attention_scaling: ClassVar[float] = 1.0  # softmax(scaling * q.k)
    family: ClassVar[str] = "Gemma 4"
    rope_types: ClassVar[Tuple[str, ...]] = ROPE_TYPES

    @classmethod
    def from_hf_dict(cls, config: dict) -> "ModelConfig":
        config = text_config(config, TEXT_MODEL_TYPES, MULTIMODAL_MODEL_TYPES, cls.family)
        _refuse_unsupported(config)
        values = known_values(cls, config, exclude=("layer_geometry", "rope_parameters", "layer_types"))
        num_layers = values.get("num_hidden_layers", cls.num_hidden_layers)
        layer_types = list(config.get("layer_types") or periodic_layer_types(num_layers, 6, "sliding_attention"))
        if layer_types and layer_types[-1] != "full_attention":
            layer_types[-1] = "full_attention"  # transformers forces this too
        values["layer_types"] = layer_types
        values["rope_parameters"] = config.get("rope_parameters") or {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        }
        values["layer_geometry"] = tuple(_layer_geometry(config, values, layer_types))
        result = cls(**values)
        result.validate()
        return result

    def validate(self) -> None:
        """Also Gemma 3's (its config is this class with other defaults, ``family`` and ``rope_types``)."""
        check_layer_types(self.layer_types, self.num_hidden_layers, LAYER_TYPES)
        check_rope_per_layer_type(self.rope_parameters, self.layer_types, self.rope_types)
        check_activation("hidden_activation", self.hidden_activation, "gelu_pytorch_tanh", self.family)
        for i, g in enumerate(self.layer_geometry):
            check_heads(self.num_attention_heads, g.num_key_value_heads, where=f"layer {i}: ")


def _refuse_unsupported(config: dict) -> None:
    if config.get("enable_moe_block"):
        raise NotImplementedError("config: enable_moe_block (Gemma 4 MoE, e.g. 26B-A4B) is not supported; only the dense stack")
    # transformers' default is 256 (on), so a config that omits the key asks for per-layer embeddings
    if config.get("hidden_size_per_layer_input", 256):
        raise NotImplementedError(
            "config: hidden_size_per_layer_input > 0 (per-layer input embeddings, Gemma 4 E2B/E4B) is not supported"
        )
    if config.get("num_kv_shared_layers", 0):
        raise NotImplementedError("config: num_kv_shared_layers > 0 (KV sharing, Gemma 4 E2B/E4B) is not supported")
    if config.get("use_bidirectional_attention") == "all":
        raise NotImplementedError("config: use_bidirectional_attention='all' is not supported (causal text model only)")


def _layer_geometry(config: dict, values: dict, layer_types: List[str]) -> List[LayerGeometry]:
    """Each layer's head_dim / kv heads / v_proj presence, as transformers' per-layer overrides define them."""
    head_dim = values.get("head_dim", ModelConfig.head_dim)
    kv_heads = values.get("num_key_value_heads", ModelConfig.num_key_value_heads)
    k_eq_v = bool(values.get("attention_k_eq_v", False))
    overrides: Dict[int, dict] = {}
    per_layer = config.get("per_layer_config")
    if per_layer:
        for key, override in per_layer.items():
            if str(key).isdigit():
                overrides[int(key)] = dict(override)
            elif key in LAYER_TYPES:
                for i, t in enumerate(layer_types):
                    if t == key:
                        overrides.setdefault(i, {}).update(override)
    else:
        full = {"head_dim": config.get("global_head_dim", 512)}
        if k_eq_v and config.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = config["num_global_key_value_heads"]
        overrides = {i: full for i, t in enumerate(layer_types) if t == "full_attention"}
    geometry = []
    for i, t in enumerate(layer_types):
        o = overrides.get(i, {})
        geometry.append(
            LayerGeometry(
                head_dim=int(o.get("head_dim", head_dim)),
                num_key_value_heads=int(o.get("num_key_value_heads", kv_heads)),
                has_v_proj=not (k_eq_v and t == "full_attention"),
            )
        )
    return geometry
