"""Gemma 3 (text) from a llama.cpp GGUF file (arch ``gemma3``): config and tensors back to our layout.

What llama.cpp's converter (``Gemma3Model``) does, and how it is undone here:

* norms: llama.cpp's RMSNorm multiplies by the stored weight, so the converter stores 1 + w
  (``norm_shift``); we subtract 1. In float32, fl(fl(1 + w) - 1) may differ from w by less than
  2^-24 when |w| < 2^-16, but the scale our RMSNorm applies, fl(w' + 1), equals the stored
  1 + w bit for bit, so the model computes exactly what the file holds;
* ``lm_head`` is not written (tied to ``token_embd``), and a quantized ``token_embd`` is imported
  dequantized (exact float32), as for Gemma 4 (the shared converter below);
* metadata the file does not carry is llama.cpp's fixed Gemma 3 choice: sliding layers every
  layer but each 6th (unless ``attention.sliding_window_pattern`` is present), sliding-layer RoPE
  base 10000 (unless ``rope.freq_base_swa``), attention scale ``key_length``^-0.5 except on the
  62-layer 27B, which uses (hidden / heads)^-0.5; linear RoPE scaling (``rope.scaling.type`` /
  ``rope.scaling.factor``) applies to the global layers only.

Refused with a ValueError: a value head size other than the key head size, and any tensor
without a mapping (e.g. the vision tower of a multimodal GGUF, which llama.cpp writes elsewhere).
"""

from __future__ import annotations

from typing import Any, Dict

from llmq.quant import GroupQuantizedWeight
from models.gemma3 import keymap
from models.gemma4 import gguf_checkpoint as gemma4_gguf
from models.pipeline.gguf_input import GGUFTensors, Metadata, Value

GGUF_ARCH = "gemma3"
SLIDING_WINDOW_PATTERN = 6  # llama.cpp: hparams.set_swa_pattern(6) for LLM_ARCH_GEMMA3
LAYERS_27B = 62


def hf_config_from_gguf(metadata: Dict[str, Any], tensors: GGUFTensors) -> Dict[str, Any]:
    """An HF ``gemma3_text`` config.json dict from the GGUF metadata (ValueError names what is missing)."""
    m = Metadata(metadata, GGUF_ARCH, tensors)
    num_layers = m.layers()
    if m.is_array("attention.sliding_window_pattern"):
        swa = m.flags("attention.sliding_window_pattern", num_layers)
    else:
        pattern = m.count("attention.sliding_window_pattern", SLIDING_WINDOW_PATTERN)
        swa = [bool((i + 1) % pattern) for i in range(num_layers)]
    hidden = m.dim("embedding_length")
    heads = m.dim_per_layer("attention.head_count")
    head_dim = m.dim("attention.key_length", max(hidden // heads, 1))
    if m.dim("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"GGUF gemma3: attention.value_length {m.get('attention.value_length')} != key_length {head_dim}")
    full_rope: Dict[str, Any] = {"rope_type": "default",
                                 "rope_theta": m.number("rope.freq_base", 1_000_000.0, lo_open=True)}
    scaling = m.text("rope.scaling.type", "none")
    if scaling == "linear":
        full_rope.update(rope_type="linear", factor=m.number("rope.scaling.factor", lo_open=True))
    elif scaling != "none":
        raise ValueError(f"GGUF gemma3: rope.scaling.type {scaling!r} (Gemma 3 uses none or linear)")
    vocab = m.vocab_size()
    config = {
        "model_type": "gemma3_text",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": m.dim_per_layer("feed_forward_length"),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": m.dim_per_layer("attention.head_count_kv"),
        "head_dim": head_dim,
        "query_pre_attn_scalar": hidden // heads if num_layers == LAYERS_27B else head_dim,
        "rms_norm_eps": m.number("attention.layer_norm_rms_epsilon", hi=1.0),
        "sliding_window": m.count("attention.sliding_window"),
        "final_logit_softcapping": m.number("final_logit_softcapping", None, lo_open=True),
        "attn_logit_softcapping": m.number("attn_logit_softcapping", None, lo_open=True),
        "tie_word_embeddings": "output.weight" not in tensors.shapes,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in swa],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": m.number("rope.freq_base_swa", 10_000.0, lo_open=True)},
            "full_attention": full_rope,
        },
        "max_position_embeddings": m.count("context_length", 131072),
    }
    for key, hf_key in (("tokenizer.ggml.eos_token_id", "eos_token_id"), ("tokenizer.ggml.padding_token_id",
                                                                             "pad_token_id"),
                        ("tokenizer.ggml.bos_token_id", "bos_token_id")):
        token = m.token_id(key, vocab)
        if token is not None:
            config[hf_key] = token
    return config


def gguf_metadata(hf_config: Dict[str, Any], config=None) -> Dict[str, Any]:
    """The ``gemma3.*`` GGUF keys of an HF ``gemma3_text`` config (`config`, the parsed one, unused), as llama.cpp's converter writes them (the
    inverse of hf_config_from_gguf); ValueError for what llama.cpp's Gemma 3 cannot express."""
    c = dict(hf_config.get("text_config") or hf_config)
    layers = int(c["num_hidden_layers"])
    heads = int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
    expected_scalar = c["hidden_size"] // heads if layers == LAYERS_27B else head_dim
    if int(c.get("query_pre_attn_scalar", expected_scalar)) != expected_scalar:
        raise ValueError(f"query_pre_attn_scalar {c.get('query_pre_attn_scalar')} is not llama.cpp's fixed Gemma 3 "
                         f"choice ({expected_scalar})")
    if c.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is set; llama.cpp's Gemma 3 has none")
    rope = c.get("rope_parameters") or {}
    full = rope.get("full_attention", {"rope_theta": c.get("rope_theta", 1_000_000.0)})
    swa = rope.get("sliding_attention", {"rope_theta": c.get("rope_local_base_freq", 10_000.0)})
    keys: Dict[str, Any] = {
        "context_length": int(c.get("max_position_embeddings", 131072)),
        "embedding_length": int(c["hidden_size"]),
        "block_count": layers,
        "feed_forward_length": int(c["intermediate_size"]),
        "attention.head_count": heads,
        "attention.head_count_kv": int(c["num_key_value_heads"]),
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]),
        "attention.sliding_window": int(c["sliding_window"]),
        "rope.freq_base": float(full["rope_theta"]),
    }
    if float(swa["rope_theta"]) != 10_000.0:
        keys["rope.freq_base_swa"] = float(swa["rope_theta"])
    if full.get("rope_type", "default") == "linear":
        keys["rope.scaling.type"], keys["rope.scaling.factor"] = "linear", float(full["factor"])
    elif full.get("rope_type", "default") != "default":
        raise ValueError(f"full-attention rope_type {full.get('rope_type')!r} (llama.cpp's Gemma 3: default or linear)")
    types = c.get("layer_types") or []
    if types and [t == "sliding_attention" for t in types] != [bool((i + 1) % SLIDING_WINDOW_PATTERN)
                                                                for i in range(layers)]:
        keys["attention.sliding_window_pattern"] = [t == "sliding_attention" for t in types]
    if c.get("final_logit_softcapping") is not None:
        keys["final_logit_softcapping"] = float(c["final_logit_softcapping"])
    return {f"{GGUF_ARCH}.{k}": v for k, v in keys.items()}


class GGUFConverter(gemma4_gguf.GGUFConverter):
    """Gemma 4's converter with Gemma 3's name table, plus the norm shift undone."""

    GGUF_ARCH = GGUF_ARCH
    GGUF_TO_HF = keymap.GGUF_TO_HF
    UNMAPPED = (f"the text stack's gguf-py {GGUF_ARCH.upper()} names are supported; vision tensors are not")

    def redo(self, hf_name: str, gguf_name: str, value: Value) -> Value:
        """llama.cpp's stored norm is 1 + w (float32); a tied lm_head is not written (see gguf_metadata)."""
        if hf_name.endswith("norm.weight"):
            if isinstance(value, GroupQuantizedWeight):
                raise ValueError(f"{hf_name}: a quantized norm weight cannot take llama.cpp's +1 exactly")
            return value.float() + 1.0
        return value

    def undo(self, hf_name: str, name: str, value: Value) -> Value:
        value = super().undo(hf_name, name, value)
        if hf_name.endswith("norm.weight"):
            if isinstance(value, GroupQuantizedWeight):
                raise ValueError(f"{name}: a quantized norm weight cannot have llama.cpp's +1 removed exactly")
            value = value.float() - 1.0
        return value
