"""Checkpoint names for Qwen3.5-MoE: Hugging Face -> llmq, per-expert stacking, GGUF <-> HF.

Our module names are HF's ``Qwen3_5MoeForCausalLM`` names, so the map only
- drops the multimodal wrapper prefix (``model.language_model.`` -> ``model.``),
- skips what the text model does not have (``model.visual.*`` vision tower, ``mtp.*`` multi-token
  prediction head),
- keeps per-expert tensors (``...mlp.experts.{e}.gate_proj.weight``) under their own names for
  ``stack_experts`` (a whole dict) or ``ExpertStacks`` (one block, tensor by tensor, as streamed) to fuse
  into ``experts.gate_up_proj`` [E, 2F, D] / ``experts.down_proj`` [E, D, F].
"""

from __future__ import annotations

import re
from typing import Dict

import gguf
import torch

from models.common.keymap import gguf_to_hf_table, text_key_map

hf_to_llmq_key = text_key_map(("model.visual.", "visual.", "mtp.", "model.mtp."))
_PER_EXPERT = re.compile(r"^(?P<prefix>model\.layers\.\d+\.mlp\.experts)\.(?P<e>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")


def is_per_expert_key(name: str) -> bool:
    return _PER_EXPERT.match(name) is not None


class ExpertStacks:
    """One MoE block's fused expert stacks, filled in place as its per-expert tensors arrive.

    ``add`` copies gate_e and up_e into ``gate_up_proj[e]`` (gate rows first) and down_e into
    ``down_proj[e]``; the caller may free each tensor right after, so a streamed layer costs its
    stacks once rather than its per-expert tensors plus the stacks. ValueError names a tensor
    that does not fit (index out of range, given twice, shape or dtype unlike the others)."""

    def __init__(self, prefix: str, n_experts: int):
        self.prefix, self.n_experts = prefix, n_experts
        self._stacks: Dict[str, torch.Tensor] = {}
        self._filled: set = set()

    @classmethod
    def for_tensor(cls, name: str, n_experts: int) -> "ExpertStacks":
        """The stacks that the per-expert tensor `name` belongs to."""
        m = _PER_EXPERT.match(name)
        if m is None:
            raise ValueError(f"{name}: not a per-expert tensor")
        return cls(m["prefix"], n_experts)

    @property
    def count(self) -> int:
        return len(self._filled)

    @property
    def complete(self) -> bool:
        return self.count == 3 * self.n_experts

    def add(self, name: str, tensor: torch.Tensor) -> None:
        m = _PER_EXPERT.match(name)
        if m is None or m["prefix"] != self.prefix:
            raise ValueError(f"{name}: not a per-expert tensor of {self.prefix}")
        e, part = int(m["e"]), m["part"]
        if not 0 <= e < self.n_experts:
            raise ValueError(f"{name}: expert index {e} is outside 0..{self.n_experts - 1}")
        if (e, part) in self._filled:
            raise ValueError(f"{name}: given twice")
        fused = "down_proj" if part == "down_proj" else "gate_up_proj"
        if fused not in self._stacks and tensor.dim() == 2:
            rows, cols = tensor.shape
            shape = (self.n_experts, rows if fused == "down_proj" else 2 * rows, cols)
            self._stacks[fused] = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        stack = self._stacks.get(fused)
        rows = 0 if stack is None else stack.shape[1] // (1 if fused == "down_proj" else 2)
        if stack is None or tuple(tensor.shape) != (rows, stack.shape[2]) or tensor.dtype != stack.dtype:
            want = "a 2-D tensor" if stack is None else f"{[rows, stack.shape[2]]} {stack.dtype}"
            raise ValueError(f"{name}: per-expert tensors have inconsistent shapes: {list(tensor.shape)} "
                             f"{tensor.dtype}, the block's others are {want}")
        r0 = rows if part == "up_proj" else 0
        stack[e, r0:r0 + rows].copy_(tensor)
        self._filled.add((e, part))

    def stacks(self) -> Dict[str, torch.Tensor]:
        """{prefix.gate_up_proj: [E, 2F, D], prefix.down_proj: [E, D, F]} once every expert arrived."""
        if not self.complete:
            counts = {p: sum(1 for _, q in self._filled if q == p) for p in ("gate_proj", "up_proj", "down_proj")}
            raise ValueError(f"{self.prefix}: per-expert tensors incomplete (counts per projection: {counts})")
        return {f"{self.prefix}.gate_up_proj": self._stacks["gate_up_proj"],
                f"{self.prefix}.down_proj": self._stacks["down_proj"]}


def stack_experts(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Replace per-expert tensors by the fused stacks; other entries pass through unchanged.

    ``model.layers.L.mlp.experts.{e}.{gate,up,down}_proj.weight`` for e = 0..E-1 become
    ``...experts.gate_up_proj`` = stack_e(cat(gate_e, up_e)) [E, 2F, D] and ``...experts.down_proj`` [E, D, F]
    (built by ExpertStacks). Works on any subset of layers (e.g. one streamed layer). Raises
    ValueError naming a layer whose experts are incomplete or inconsistent.
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
        stacks = ExpertStacks(prefix, len(experts))
        for e in experts:
            for part in ("gate_proj", "up_proj", "down_proj"):
                stacks.add(f"{prefix}.{e}.{part}.weight", parts[part][e])
        out.update(stacks.stacks())
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


# GGUF (llama.cpp arch "qwen35moe") names, from gguf-py's MODEL_ARCH.QWEN35MOE table ({L}: block index),
# which covers every tensor of the text model. Not covered by the table, because llama.cpp's converter
# renames first (RENAMED): dt_bias (it is written as dt_proj.bias) and the expert stacks (written with a
# .weight suffix). Names only: the converter also changes some VALUES (e.g. -exp(A_log) as ssm_a, +1 on
# zero-centred norms, conv1d reshaped); undoing those is gguf_checkpoint.py's job. Expert stacks come
# either fused (ffn_gate_up_exps) or as separate gate/up stacks, which GGUF_EXPERT_PAIRS concatenates
# along dim 1 into gate_up_proj.
_LAYER = "model.layers.{L}."
HF_TENSORS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight") + tuple(_LAYER + n for n in (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
    "linear_attn.in_proj_a.weight", "linear_attn.conv1d.weight", "linear_attn.dt_bias", "linear_attn.A_log",
    "linear_attn.norm.weight", "linear_attn.out_proj.weight",
    "mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.shared_expert_gate.weight",
    "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight", "mlp.shared_expert.down_proj.weight",
))
RENAMED = {
    _LAYER + "linear_attn.dt_bias": _LAYER + "linear_attn.dt_proj.bias",
    _LAYER + "mlp.experts.gate_up_proj": _LAYER + "mlp.experts.gate_up_proj.weight",
    _LAYER + "mlp.experts.down_proj": _LAYER + "mlp.experts.down_proj.weight",
}
GGUF_TO_HF = gguf_to_hf_table(gguf.MODEL_ARCH.QWEN35MOE, HF_TENSORS, RENAMED)
# (gate, up) GGUF expert stacks concatenated along dim 1 into the HF fused tensor.
_EXPERT_HALVES = gguf_to_hf_table(gguf.MODEL_ARCH.QWEN35MOE, [_LAYER + "mlp.experts.gate_proj.weight",
                                                                _LAYER + "mlp.experts.up_proj.weight"])
GGUF_EXPERT_PAIRS = {tuple(_EXPERT_HALVES): _LAYER + "mlp.experts.gate_up_proj"}
