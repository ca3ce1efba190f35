"""Gemma 4 (dense text) from a llama.cpp GGUF file (arch ``gemma4``): config and tensors back to our layout.

What llama.cpp's converter (``Gemma4Model`` on ``Gemma3Model``) does, and how it is undone here:

* norms: Gemma 4's RMSNorm scales by the weight itself (``norm_shift`` 0), so no +1 to undo;
* ``lm_head`` is not written (tied to ``token_embd``); ``token_embd`` is cut to the real vocabulary,
  so the vocabulary size is read from its rows;
* a quantized ``token_embd`` is imported dequantized (exactly, float32): our Gemma 4 forward
  needs a dense embedding (it reads the embedding's dtype);
* ``layer_scalar`` becomes ``blk.N.layer_output_scale.weight`` ([1]);
* full-attention layers' proportional RoPE is written as a ``rope_freqs`` tensor (1.0 for the
  rotated frequency pairs, 1e30 for the unrotated ones): the config reads partial_rotary_factor
  back from it and the tensor itself is dropped;
* per-layer geometry goes to metadata: ``attention.sliding_window_pattern`` (layer types),
  ``attention.head_count_kv`` (array: sliding vs full), ``key_length`` (full head dim) and
  ``key_length_swa``; K=V full layers simply have no ``attn_v``.

Refused with a ValueError: MoE blocks (``expert_count`` > 0), per-layer input embeddings and KV
sharing (E2B/E4B), partial RoPE on sliding layers, and any tensor without a mapping.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from llmq.quant import GroupQuantizedWeight
from llmq.quant.formats import dequantize_canonical
from models.common.keymap import TableConverter
from models.gemma4 import keymap
from models.pipeline.gguf_input import GGUFTensors, Metadata, Value

GGUF_ARCH = "gemma4"
ROPE_FREQS = "rope_freqs.weight"
EMBEDDING = "model.embed_tokens.weight"
# llama.cpp marks an unrotated frequency pair with this factor (its freq is divided by it).
_UNROTATED_FACTOR = 1e29


def hf_config_from_gguf(metadata: Dict[str, Any], tensors: GGUFTensors) -> Dict[str, Any]:
    """An HF ``gemma4_text`` config.json dict from the GGUF metadata (ValueError names what is missing)."""
    m = Metadata(metadata, GGUF_ARCH, tensors)
    num_layers = m.layers()
    if m.count("expert_count", 0, lo=0) > 0:
        raise ValueError("GGUF gemma4: expert_count > 0 (Gemma 4 MoE) is not supported; only the dense stack")
    pattern = m.flags("attention.sliding_window_pattern", num_layers)
    layer_types = ["sliding_attention" if swa else "full_attention" for swa in pattern]
    full = [not swa for swa in pattern]
    head_dim_full = m.dim("attention.key_length")
    head_dim_swa = m.dim("attention.key_length_swa", head_dim_full)
    rot_swa = m.dim("rope.dimension_count_swa", head_dim_swa)
    if rot_swa != head_dim_swa:
        raise ValueError(f"GGUF gemma4: rope.dimension_count_swa {rot_swa} != head dim {head_dim_swa} "
                         f"(partial RoPE on sliding layers is not supported)")
    kv_swa = m.dim_per_layer("attention.head_count_kv", per_layer=pattern) if any(pattern) else None
    kv_full = m.dim_per_layer("attention.head_count_kv", per_layer=full) if any(full) else kv_swa
    k_eq_v = not any(f"blk.{i}.attn_v.weight" in tensors.shapes for i, t in enumerate(full) if t)
    vocab = m.vocab_size()
    config = {
        "model_type": "gemma4_text",
        "vocab_size": vocab,
        "hidden_size": m.dim("embedding_length"),
        "intermediate_size": m.dim_per_layer("feed_forward_length"),
        "num_hidden_layers": num_layers,
        "num_attention_heads": m.dim_per_layer("attention.head_count"),
        "num_key_value_heads": kv_swa if kv_swa is not None else kv_full,
        "head_dim": head_dim_swa,
        "global_head_dim": head_dim_full,
        "num_global_key_value_heads": kv_full,
        "attention_k_eq_v": k_eq_v,
        # keyed by layer index, as transformers writes it (a config.json transformers loads)
        "per_layer_config": {str(i): {"head_dim": head_dim_full, "num_key_value_heads": kv_full}
                             for i, t in enumerate(layer_types) if t == "full_attention"},
        "rms_norm_eps": m.number("attention.layer_norm_rms_epsilon", hi=1.0),
        "sliding_window": m.count("attention.sliding_window"),
        "final_logit_softcapping": m.number("final_logit_softcapping", None, lo_open=True),
        "hidden_size_per_layer_input": m.dim("embedding_length_per_layer_input", 0, lo=0),
        "num_kv_shared_layers": m.count("attention.shared_kv_layers", 0, lo=0, hi=num_layers),
        "tie_word_embeddings": "output.weight" not in tensors.shapes,
        "layer_types": layer_types,
        "rope_parameters": {
            # llama.cpp defaults the sliding-layer base to 10000 when the key is absent, as we do.
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": m.number("rope.freq_base_swa", 10_000.0, lo_open=True)},
            "full_attention": _full_rope(m, tensors, head_dim_full),
        },
        "max_position_embeddings": m.count("context_length", 131072),
    }
    for key, hf_key in (("tokenizer.ggml.eos_token_id", "eos_token_id"), ("tokenizer.ggml.padding_token_id",
                                                                             "pad_token_id")):
        token = m.token_id(key, vocab)
        if token is not None:
            config[hf_key] = token
    return config


def _full_rope(m: Metadata, tensors: GGUFTensors, head_dim: int) -> Dict[str, Any]:
    theta = m.number("rope.freq_base", lo_open=True)
    if ROPE_FREQS not in tensors.shapes:
        return {"rope_type": "default", "rope_theta": theta}
    factors = tensors.read(ROPE_FREQS)
    if not isinstance(factors, torch.Tensor) or factors.numel() != head_dim // 2:
        raise ValueError(f"GGUF gemma4: {ROPE_FREQS} must be a float vector of {head_dim // 2} (head_dim/2) factors")
    factors = factors.float().reshape(-1)
    rotated = int((factors == 1.0).sum())
    if not (bool((factors[:rotated] == 1.0).all()) and bool((factors[rotated:] >= _UNROTATED_FACTOR).all())):
        raise ValueError(f"GGUF gemma4: {ROPE_FREQS} is not llama.cpp's proportional-RoPE pattern "
                         f"(1.0 for rotated pairs, then 1e30)")
    return {"rope_type": "proportional", "partial_rotary_factor": 2 * rotated / head_dim, "rope_theta": theta}


def _text(hf_config: Dict[str, Any]) -> Dict[str, Any]:
    return dict(hf_config.get("text_config") or hf_config)


def gguf_metadata(hf_config: Dict[str, Any], config) -> Dict[str, Any]:
    """The ``gemma4.*`` GGUF keys of an HF ``gemma4_text`` config and its parsed `config` (per-layer geometry;
    the inverse of hf_config_from_gguf); ValueError for what the import refuses (MoE, per-layer input
    embeddings, KV sharing, partial sliding RoPE, layers of one kind with different geometries)."""
    c = _text(hf_config)
    if int(c.get("hidden_size_per_layer_input") or 0) or int(c.get("num_kv_shared_layers") or 0):
        raise ValueError("per-layer input embeddings / KV sharing (E2B/E4B) have no GGUF export here")
    if c.get("enable_moe_block") or int(c.get("num_experts") or 0):
        raise ValueError("Gemma 4 MoE blocks have no GGUF export here; only the dense stack")
    layers = int(config.num_hidden_layers)
    swa = [t == "sliding_attention" for t in config.layer_types]
    geometry = {kind: {(g.head_dim, g.num_key_value_heads) for g, s in zip(config.layer_geometry, swa) if s == kind}
                for kind in (True, False)}
    if any(len(g) > 1 for g in geometry.values()):
        raise ValueError(f"layers of one kind differ in head dim or KV heads ({geometry}); GGUF has one per kind")
    (head_full, kv_full), = geometry[False] or {(config.head_dim, config.num_key_value_heads)}
    (head_swa, kv_swa), = geometry[True] or {(head_full, kv_full)}
    rope = config.rope_parameters or {}
    full, sliding = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    if sliding.get("rope_type", "default") != "default" or float(sliding.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial or scaled RoPE on sliding layers is not expressible in llama.cpp's Gemma 4")
    keys: Dict[str, Any] = {
        "context_length": int(c.get("max_position_embeddings", 131072)),
        "embedding_length": int(c["hidden_size"]),
        "block_count": layers,
        "feed_forward_length": int(c["intermediate_size"]),
        "attention.head_count": int(c["num_attention_heads"]),
        "attention.head_count_kv": [kv_swa if s else kv_full for s in swa],
        "attention.key_length": head_full,
        "attention.value_length": head_full,
        "attention.key_length_swa": head_swa,
        "attention.value_length_swa": head_swa,
        "attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]),
        "attention.sliding_window": int(c["sliding_window"]),
        "attention.sliding_window_pattern": swa,
        "attention.shared_kv_layers": 0,
        "embedding_length_per_layer_input": 0,
        "rope.freq_base": float(full.get("rope_theta", 1_000_000.0)),
        "rope.freq_base_swa": float(sliding.get("rope_theta", 10_000.0)),
        "rope.dimension_count": head_full,
        "rope.dimension_count_swa": head_swa,
    }
    if c.get("final_logit_softcapping") is not None:
        keys["final_logit_softcapping"] = float(c["final_logit_softcapping"])
    return {f"{GGUF_ARCH}.{k}": v for k, v in keys.items()}


def gguf_extra_tensors(hf_config: Dict[str, Any], config) -> Dict[str, torch.Tensor]:
    """Tensors llama.cpp needs that are no model tensor: proportional RoPE on full layers as ``rope_freqs``
    (1.0 for the rotated frequency pairs, 1e30 for the others; what _full_rope reads back)."""
    full = (config.rope_parameters or {}).get("full_attention", {})
    if full.get("rope_type", "default") == "default":
        return {}
    if full.get("rope_type") != "proportional":
        raise ValueError(f"full-attention rope_type {full.get('rope_type')!r} (llama.cpp's Gemma 4: default or "
                         "proportional)")
    head = next((g.head_dim for g, t in zip(config.layer_geometry, config.layer_types) if t == "full_attention"),
                config.head_dim)
    rotated = int(head * float(full["partial_rotary_factor"]) / 2)
    return {ROPE_FREQS: torch.tensor([1.0] * rotated + [1e30] * (head // 2 - rotated), dtype=torch.float32)}


class GGUFConverter(TableConverter):
    """``convert(gguf_name, value) -> [(model_name, value)]``, one GGUF tensor at a time (the shared
    table converter, models/common/keymap.py). Gemma 3's converter is this one with its own table."""

    GGUF_ARCH = GGUF_ARCH
    GGUF_TO_HF = keymap.GGUF_TO_HF
    KEY_MAP = staticmethod(keymap.hf_to_llmq_key)
    UNMAPPED = (f"the dense text stack's gguf-py {GGUF_ARCH.upper()} names are supported; MoE and per-layer-embedding "
                f"tensors are not")
    # GGUF tensors imported dequantized whatever their type (see undo): the recipe decides them
    # (models/pipeline/size_estimate.py counts them so)
    DEQUANTIZED = ("token_embd.weight",)

    def convert(self, name: str, value: Value) -> List[Tuple[str, Value]]:
        if name == ROPE_FREQS:
            return []  # read into the config's full-attention rope_parameters
        return super().convert(name, value)

    def undo(self, hf_name: str, name: str, value: Value) -> Value:
        if hf_name.endswith(".layer_scalar"):
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise ValueError(f"{name}: expected one float (the layer's output scale)")
            value = value.reshape(1)
        if hf_name == EMBEDDING and isinstance(value, GroupQuantizedWeight):
            # Our Gemma 4 forward reads embed_tokens.weight.dtype (the sqrt(hidden) scale), which a
            # quantized embedding does not have: keep it dense, dequantized exactly.
            self.notes.append(f"{name}: quantized ({value.bits}-bit) in the GGUF; imported dequantized (exact "
                              f"float32 values) because the Gemma model needs a dense embedding")
            value = dequantize_canonical(value)
        return value
