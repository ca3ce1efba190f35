"""Qwen3.5-MoE from a llama.cpp GGUF file (arch ``qwen35moe``): config and tensors back to our layout.

What llama.cpp's converter (``Qwen3_5MoeTextModel`` and its bases ``Qwen3NextModel`` /
``_LinearAttentionVReorderBase`` / ``_Qwen35MtpMixin``) does, and how it is undone here:

==============================================  =================================================
converter                                       import
==============================================  =================================================
zero-centred RMSNorm weights (every            ``w - 1`` (F32 in GGUF; refused if quantized)
``*norm.weight`` but ``linear_attn.norm``) +1
``A_log`` stored as ``ssm_a = -exp(A_log)``     ``log(-ssm_a)`` (refused if quantized)
``dt_bias`` renamed ``ssm_dt.bias``             rename
conv1d [C, 1, K] squeezed to [C, K]             unsqueeze
DeltaNet V heads reordered from grouped by K    inverse permutation: rows of in_proj_qkv (V part),
head to tiled, when K heads != V heads          in_proj_z, in_proj_a/b, A_log, dt_bias, conv1d (V
                                                part); column blocks of out_proj -- exact on
                                                quantized rows, and on quantized columns when a
                                                head is a whole number of groups; otherwise
                                                out_proj is dequantized exactly, reordered and
                                                left to the recipe (with a note)
experts gate_up [E, 2F, D] split into           fused back (exact for same-format halves, see
ffn_gate_exps / ffn_up_exps                     gguf_input.ExpertPairFuser)
MTP layers appended as blocks >= n_layer        dropped (the text model has no MTP head)
==============================================  =================================================

Attention q/k are not permuted for this architecture (no rotary interleave change), and M-RoPE
reduces to plain RoPE for text, so the rope sections are not needed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Tuple

import torch

from llmq.quant import GroupQuantizedWeight
from models.common.keymap import TableConverter, block_template, hf_to_gguf_name
from models.pipeline.gguf_input import (
    ExpertPairFuser,
    GGUFTensors,
    Metadata,
    Value,
    permute_column_blocks,
    permute_rows,
    refuse_quantized,
)
from models.qwen import keymap

GGUF_ARCH = "qwen35moe"

_PAIRS = {gate: "gate" for gate, _ in keymap.GGUF_EXPERT_PAIRS}
_PAIRS.update({up: "up" for _, up in keymap.GGUF_EXPERT_PAIRS})
_PAIR_TARGET = {half: target for pair, target in keymap.GGUF_EXPERT_PAIRS.items() for half in pair}


def hf_config_from_gguf(metadata: Dict[str, Any], tensors: GGUFTensors) -> Dict[str, Any]:
    """An HF ``qwen3_5_moe_text`` config.json dict from the GGUF metadata (ValueError names what is missing)."""
    m = Metadata(metadata, GGUF_ARCH, tensors)
    mtp_layers = m.count("nextn_predict_layers", 0, lo=0)
    num_layers = m.layers(extra=mtp_layers) - mtp_layers
    if num_layers < 1:
        raise ValueError(f"GGUF qwen35moe: block_count leaves {num_layers} text layers after "
                         f"nextn_predict_layers = {mtp_layers}")
    head_dim = m.dim("attention.key_length")
    if m.dim("attention.value_length", head_dim) != head_dim:
        raise ValueError("GGUF qwen35moe: attention.value_length != key_length is not supported")
    rotary = m.count("rope.dimension_count", head_dim, hi=head_dim, why=" (attention.key_length)")
    interval = m.count("full_attention_interval")
    value_heads = m.dim("ssm.time_step_rank")
    key_heads = m.dim("ssm.group_count")
    inner = m.dim("ssm.inner_size")
    if inner % value_heads:
        raise ValueError(f"GGUF qwen35moe: ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {value_heads}")
    if value_heads % key_heads:
        raise ValueError(f"GGUF qwen35moe: ssm.time_step_rank {value_heads} (value heads) is not a multiple of "
                         f"ssm.group_count {key_heads} (key heads)")
    if m.dim("expert_shared_feed_forward_length", 0, lo=0) <= 0:
        raise ValueError("GGUF qwen35moe: no expert_shared_feed_forward_length (Qwen3.5-MoE has a shared expert)")
    experts = m.dim("expert_count")
    config = {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": m.vocab_size(),
        "hidden_size": m.dim("embedding_length"),
        "num_hidden_layers": num_layers,
        "num_attention_heads": m.dim_per_layer("attention.head_count"),
        "num_key_value_heads": m.dim_per_layer("attention.head_count_kv"),
        "head_dim": head_dim,
        "rms_norm_eps": m.number("attention.layer_norm_rms_epsilon", hi=1.0),
        "tie_word_embeddings": "output.weight" not in tensors.shapes,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.number("rope.freq_base", lo_open=True),
                            "partial_rotary_factor": rotary / head_dim},
        "linear_conv_kernel_dim": m.dim("ssm.conv_kernel"),
        "linear_key_head_dim": m.dim("ssm.state_size"),
        "linear_value_head_dim": inner // value_heads,
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "moe_intermediate_size": m.dim("expert_feed_forward_length"),
        "shared_expert_intermediate_size": m.dim("expert_shared_feed_forward_length"),
        "num_experts": experts,
        "num_experts_per_tok": m.count("expert_used_count", hi=experts, why=" (expert_count)"),
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)],
        "max_position_embeddings": m.count("context_length", 32768),
    }
    eos = m.token_id("tokenizer.ggml.eos_token_id", config["vocab_size"])
    if eos is not None:
        config["eos_token_id"] = eos
    return config


def gguf_metadata(hf_config: Dict[str, Any], config) -> Dict[str, Any]:
    """The ``qwen35moe.*`` GGUF keys of a Qwen3.5-MoE config (parsed: `config`), as llama.cpp's converter writes
    them (the inverse of hf_config_from_gguf); ValueError where full attention is not every n-th layer."""
    types = list(config.layer_types)
    interval = types.index("full_attention") + 1 if "full_attention" in types else len(types) + 1
    if types != ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(types))]:
        raise ValueError(f"layer_types {types} are not full attention every n-th layer (GGUF full_attention_interval)")
    rotary = int(config.head_dim * float(config.partial_rotary_factor))
    text = dict(hf_config.get("text_config") or hf_config)
    sections = list((text.get("rope_parameters") or {}).get("mrope_section") or [rotary // 2])
    keys: Dict[str, Any] = {
        "context_length": int(text.get("max_position_embeddings", 32768)),
        "embedding_length": int(config.hidden_size),
        "block_count": int(config.num_hidden_layers),
        "attention.head_count": int(config.num_attention_heads),
        "attention.head_count_kv": int(config.num_key_value_heads),
        "attention.key_length": int(config.head_dim),
        "attention.value_length": int(config.head_dim),
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "rope.freq_base": float(config.rope_theta),
        "rope.dimension_count": rotary,
        "rope.dimension_sections": (sections + [0, 0, 0, 0])[:4],
        "expert_count": int(config.num_experts),
        "expert_used_count": int(config.num_experts_per_tok),
        "expert_feed_forward_length": int(config.moe_intermediate_size),
        "expert_shared_feed_forward_length": int(config.shared_expert_intermediate_size),
        "ssm.conv_kernel": int(config.linear_conv_kernel_dim),
        "ssm.state_size": int(config.linear_key_head_dim),
        "ssm.group_count": int(config.linear_num_key_heads),
        "ssm.time_step_rank": int(config.linear_num_value_heads),
        "ssm.inner_size": int(config.linear_value_head_dim * config.linear_num_value_heads),
        "full_attention_interval": interval,
    }
    return {f"{GGUF_ARCH}.{k}": v for k, v in keys.items()}


def _row_slice(value: Value, start: int, stop: int) -> Value:
    """value[..., start:stop, :], exact on quantized weights (each row carries its own groups)."""
    if isinstance(value, GroupQuantizedWeight):
        return dataclasses.replace(value, qdata=value.qdata[..., start:stop, :].contiguous(),
                                   scale=value.scale[..., start:stop, :].contiguous(),
                                   bias=value.bias[..., start:stop, :].contiguous(),
                                   shape=(*value.shape[:-2], stop - start, value.shape[-1]))
    return value[..., start:stop, :].contiguous()


def _grouped_from_tiled(k_heads: int, v_heads: int, head_dim: int) -> torch.Tensor:
    """Index vector taking llama.cpp's tiled V-head order back to HF's grouped-by-K-head order:
    HF row (k * R + r) * d + j sits at GGUF row (r * K + k) * d + j (R = V heads per K head)."""
    per_k = v_heads // k_heads
    return torch.arange(v_heads * head_dim).reshape(per_k, k_heads, head_dim).transpose(0, 1).reshape(-1)


class GGUFConverter(TableConverter):
    """``convert(gguf_name, value) -> [(model_name, value)]``, one GGUF tensor at a time (the shared
    table converter, models/common/keymap.py); ``close()`` checks nothing is left half-fused."""

    GGUF_ARCH = GGUF_ARCH
    GGUF_TO_HF = keymap.GGUF_TO_HF
    KEY_MAP = staticmethod(keymap.hf_to_llmq_key)
    UNMAPPED = f"expected one of gguf-py's {GGUF_ARCH.upper()} tensor names used by the text model"

    def __init__(self, config):
        super().__init__(config)
        self._fuser = ExpertPairFuser()
        self.notes: List[str] = self._fuser.notes
        k, v = config.linear_num_key_heads, config.linear_num_value_heads
        self._key_dim = config.linear_key_head_dim * k
        self._v_rows = _grouped_from_tiled(k, v, config.linear_value_head_dim)
        self._v_heads = _grouped_from_tiled(k, v, 1)

    def convert(self, name: str, value: Value) -> List[Tuple[str, Value]]:
        layer, template = block_template(name)
        if layer is not None and layer >= self.config.num_hidden_layers:
            return []  # MTP blocks appended after the text stack
        if template in _PAIR_TARGET:
            target = _PAIR_TARGET[template].format(L=layer)
            return [(keymap.hf_to_llmq_key(t), v) for t, v in self._fuser.add(target, _PAIRS[template], value)]
        return super().convert(name, value)

    def to_gguf(self, hf_name: str, value: Value) -> List[Tuple[str, Value]]:
        """As the table says, but the fused expert stack [E, 2F, D] goes out as llama.cpp's gate and up stacks
        (exact row slices)."""
        if hf_name.endswith(".mlp.experts.gate_up_proj"):
            prefix = hf_name[: -len("gate_up_proj")]
            f = value.shape[-2] // 2
            return [(hf_to_gguf_name(keymap._EXPERT_HALVES)(prefix + leaf), _row_slice(value, start, start + f))
                    for leaf, start in (("gate_proj.weight", 0), ("up_proj.weight", f))]
        return super().to_gguf(hf_name, value)

    def redo(self, hf_name: str, gguf_name: str, value: Value) -> Value:
        """The inverse of `undo` (the table in the module docstring, read right to left)."""
        v_rows, v_heads = torch.argsort(self._v_rows), torch.argsort(self._v_heads)
        if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
            return refuse_quantized(hf_name, value, "adding llama.cpp's +1 on a zero-centred norm").float() + 1.0
        if hf_name.endswith(".linear_attn.A_log"):
            return -torch.exp(permute_rows(refuse_quantized(hf_name, value, "-exp(A_log)").float().reshape(-1), v_heads))
        if hf_name.endswith(".linear_attn.dt_bias"):
            return permute_rows(refuse_quantized(hf_name, value, "a V-head reorder").reshape(-1), v_heads)
        if hf_name.endswith(".linear_attn.conv1d.weight"):
            w = refuse_quantized(hf_name, value, "a reshape to [C, K]")
            w = w.reshape(w.shape[0], -1)
            return torch.cat([w[: 2 * self._key_dim], w[2 * self._key_dim:].index_select(0, v_rows)])
        if hf_name.endswith(".linear_attn.in_proj_qkv.weight"):
            keep = torch.arange(2 * self._key_dim)
            return permute_rows(value, torch.cat([keep, v_rows + 2 * self._key_dim]))
        if hf_name.endswith(".linear_attn.in_proj_z.weight"):
            return permute_rows(value, v_rows)
        if hf_name.endswith((".linear_attn.in_proj_a.weight", ".linear_attn.in_proj_b.weight")):
            return permute_rows(value, v_heads)
        if hf_name.endswith(".linear_attn.out_proj.weight"):
            return permute_column_blocks(value, v_heads, self.config.linear_value_head_dim, name=hf_name,
                                         notes=self.notes)
        if hf_name.endswith(".mlp.shared_expert_gate.weight") and isinstance(value, torch.Tensor):
            return value.reshape(-1)  # llama.cpp's ffn_gate_inp_shexp is [n_embd]
        return value

    def undo(self, hf_name: str, name: str, value: Value) -> Value:
        if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
            return refuse_quantized(name, value, "subtracting llama.cpp's +1 on a zero-centred norm").float() - 1.0
        if hf_name.endswith(".linear_attn.A_log"):
            a = refuse_quantized(name, value, "log(-ssm_a)").float()
            if (a >= 0).any():
                raise ValueError(f"{name}: ssm_a must be negative (-exp(A_log)); found values >= 0")
            return permute_rows(torch.log(-a).reshape(-1), self._v_heads)
        if hf_name.endswith(".linear_attn.dt_bias"):
            return permute_rows(refuse_quantized(name, value, "a reshape").reshape(-1), self._v_heads)
        if hf_name.endswith(".linear_attn.conv1d.weight"):
            w = refuse_quantized(name, value, "a reshape to [C, 1, K]")
            w = w.reshape(w.shape[0], -1)
            v_part = w[2 * self._key_dim:].index_select(0, self._v_rows)
            return torch.cat([w[: 2 * self._key_dim], v_part]).unsqueeze(1)
        if hf_name.endswith(".linear_attn.in_proj_qkv.weight"):
            keep = torch.arange(2 * self._key_dim)
            return permute_rows(value, torch.cat([keep, self._v_rows + 2 * self._key_dim]))
        if hf_name.endswith(".linear_attn.in_proj_z.weight"):
            return permute_rows(value, self._v_rows)
        if hf_name.endswith((".linear_attn.in_proj_a.weight", ".linear_attn.in_proj_b.weight")):
            return permute_rows(value, self._v_heads)
        if hf_name.endswith(".linear_attn.out_proj.weight"):
            return permute_column_blocks(value, self._v_heads, self.config.linear_value_head_dim, name=name,
                                         notes=self.notes)
        if hf_name.endswith(".mlp.shared_expert_gate.weight") and isinstance(value, torch.Tensor) and value.dim() == 1:
            return value.reshape(1, -1)
        return value

    def close(self) -> None:
        self._fuser.close()
