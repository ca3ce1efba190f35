"""Checkpoint names for Qwen3.5-MoE: Hugging Face -> llmq, per-expert stacking, GGUF <-> HF.

Our module names are HF's ``Qwen3_5MoeForCausalLM`` names, so the map only
- drops the multimodal wrapper prefix (``model.language_model.`` -> ``model.``),
- skips what the text model does not have (``model.visual.*`` vision tower, ``mtp.*`` multi-token
  prediction head),
- keeps per-expert tensors (``...mlp.experts.{e}.gate_proj.weight``) under their own names for
  ``stack_experts`` to fuse into ``experts.gate_up_proj`` [E, 2F, D] / ``experts.down_proj`` [E, D, F].
"""

from __future__ import annotations

import re
from typing import Dict, Optional

import torch

_SKIP_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
_TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_PER_EXPERT = re.compile(r"^(?P<prefix>model\.layers\.\d+\.mlp\.experts)\.(?P<e>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")


def hf_to_llmq_key(hf_name: str) -> Optional[str]:
    """llmq state-dict name for an HF tensor name, or None for tensors the text model does not use."""
    if hf_name.startswith(_SKIP_PREFIXES):
        return None
    for old, new in _TEXT_PREFIXES:
        if hf_name.startswith(old):
            return new + hf_name[len(old):]
    return hf_name


def is_per_expert_key(name: str) -> bool:
    return _PER_EXPERT.match(name) is not None


def stack_experts(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Replace per-expert tensors by the fused stacks; other entries pass through unchanged.

    ``model.layers.L.mlp.experts.{e}.{gate,up,down}_proj.weight`` for e = 0..E-1 become
    ``...experts.gate_up_proj`` = stack_e(cat(gate_e, up_e)) [E, 2F, D] and ``...experts.down_proj`` [E, D, F].
    Works on any subset of layers (e.g. one streamed layer). Raises ValueError naming a layer whose
    experts are incomplete or inconsistent.
    """
    out: Dict[str, torch.Tensor] = {}
    groups: Dict[str, Dict[str, Dict[int, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = tensor
            continue
        groups.setdefault(m["prefix"], {}).setdefault(m["part"], {})[int(m["e"])] = tensor
    for prefix, parts in groups.items():
        counts = {part: len(by_expert) for part, by_expert in parts.items()}
        experts = sorted(parts.get("down_proj", {}))
        if set(parts) != {"gate_proj", "up_proj", "down_proj"} or len(set(counts.values())) != 1:
            raise ValueError(f"{prefix}: per-expert tensors incomplete (counts per projection: {counts})")
        if experts != list(range(len(experts))) or any(sorted(parts[p]) != experts for p in parts):
            raise ValueError(f"{prefix}: expert indices must be 0..{len(experts) - 1} for gate, up and down")
        try:
            gate_up = torch.stack([torch.cat((parts["gate_proj"][e], parts["up_proj"][e]), dim=0) for e in experts])
            down = torch.stack([parts["down_proj"][e] for e in experts])
        except RuntimeError as exc:
            raise ValueError(f"{prefix}: per-expert tensors have inconsistent shapes: {exc}") from None
        out[f"{prefix}.gate_up_proj"] = gate_up
        out[f"{prefix}.down_proj"] = down
    return out


def unstack_experts(name: str, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Inverse of ``stack_experts`` for one fused tensor (for writers that need the per-expert layout)."""
    if name.endswith(".experts.gate_up_proj"):
        prefix, half = name[: -len(".gate_up_proj")], tensor.shape[1] // 2
        result = {}
        for e in range(tensor.shape[0]):
            result[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :half]
            result[f"{prefix}.{e}.up_proj.weight"] = tensor[e, half:]
        return result
    if name.endswith(".experts.down_proj"):
        prefix = name[: -len(".down_proj")]
        return {f"{prefix}.{e}.down_proj.weight": tensor[e] for e in range(tensor.shape[0])}
    return {name: tensor}


# GGUF (llama.cpp arch "qwen35moe") tensor NAMES, from gguf-py's constants (MODEL_ARCH.QWEN35MOE); {L} is
# the block index. Names only: llama.cpp's converter also changes some VALUES (e.g. it may store
# -exp(A_log) as ssm_a, add 1 to zero-centred norms, reshape conv1d); undoing those is the GGUF
# importer's job and is not verified here. Expert stacks come either fused (ffn_gate_up_exps) or as
# separate gate/up stacks, which GGUF_EXPERT_PAIRS concatenates along dim 1 into gate_up_proj.
GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{L}.attn_norm.weight": "model.layers.{L}.input_layernorm.weight",
    "blk.{L}.post_attention_norm.weight": "model.layers.{L}.post_attention_layernorm.weight",
    "blk.{L}.attn_q.weight": "model.layers.{L}.self_attn.q_proj.weight",
    "blk.{L}.attn_k.weight": "model.layers.{L}.self_attn.k_proj.weight",
    "blk.{L}.attn_v.weight": "model.layers.{L}.self_attn.v_proj.weight",
    "blk.{L}.attn_output.weight": "model.layers.{L}.self_attn.o_proj.weight",
    "blk.{L}.attn_q_norm.weight": "model.layers.{L}.self_attn.q_norm.weight",
    "blk.{L}.attn_k_norm.weight": "model.layers.{L}.self_attn.k_norm.weight",
    "blk.{L}.attn_qkv.weight": "model.layers.{L}.linear_attn.in_proj_qkv.weight",
    "blk.{L}.attn_gate.weight": "model.layers.{L}.linear_attn.in_proj_z.weight",
    "blk.{L}.ssm_beta.weight": "model.layers.{L}.linear_attn.in_proj_b.weight",
    "blk.{L}.ssm_alpha.weight": "model.layers.{L}.linear_attn.in_proj_a.weight",
    "blk.{L}.ssm_conv1d.weight": "model.layers.{L}.linear_attn.conv1d.weight",
    "blk.{L}.ssm_dt.bias": "model.layers.{L}.linear_attn.dt_bias",
    "blk.{L}.ssm_a": "model.layers.{L}.linear_attn.A_log",
    "blk.{L}.ssm_norm.weight": "model.layers.{L}.linear_attn.norm.weight",
    "blk.{L}.ssm_out.weight": "model.layers.{L}.linear_attn.out_proj.weight",
    "blk.{L}.ffn_gate_inp.weight": "model.layers.{L}.mlp.gate.weight",
    "blk.{L}.ffn_gate_up_exps.weight": "model.layers.{L}.mlp.experts.gate_up_proj",
    "blk.{L}.ffn_down_exps.weight": "model.layers.{L}.mlp.experts.down_proj",
    "blk.{L}.ffn_gate_inp_shexp.weight": "model.layers.{L}.mlp.shared_expert_gate.weight",
    "blk.{L}.ffn_gate_shexp.weight": "model.layers.{L}.mlp.shared_expert.gate_proj.weight",
    "blk.{L}.ffn_up_shexp.weight": "model.layers.{L}.mlp.shared_expert.up_proj.weight",
    "blk.{L}.ffn_down_shexp.weight": "model.layers.{L}.mlp.shared_expert.down_proj.weight",
}
# (gate, up) GGUF expert stacks concatenated along dim 1 into the HF fused tensor.
GGUF_EXPERT_PAIRS = {
    ("blk.{L}.ffn_gate_exps.weight", "blk.{L}.ffn_up_exps.weight"): "model.layers.{L}.mlp.experts.gate_up_proj",
}
