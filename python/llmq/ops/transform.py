"""Source transform: swap Qwen3.5-MoE sparse MoE blocks for QuantizedMoEBlock, which calls
torch.ops.llmq.quantized_moe_ffn on experts quantized by a recipe.

A block is recognised by structure, not class (so any model with the same layout works):
`gate.weight` [E, D] + `gate.top_k`, `experts.gate_up_proj` [E, 2F, D] and
`experts.down_proj` [E, D, F], optionally `shared_expert` (gate_proj/up_proj/down_proj
Linear) and `shared_expert_gate` (Linear D -> 1). Recipe lookups use module fqns:
`<block>.experts` for the routed experts, `<block>.shared_expert.gate_proj` (and up/down,
which must agree) for the shared expert; `None` keeps a part in high precision (routed
experts: the block is left as it is; shared expert: it runs densely next to the op).
"""

from __future__ import annotations

from typing import List, Optional, Union

import torch
from torch import nn

import llmq.ops.moe_op  # noqa: F401  (registers torch.ops.llmq.quantized_moe_ffn)
from llmq.ops.kernel_loader import load_kernel
from llmq.ops.moe_reference import moe_reference
from llmq.ops.packing import PackedExperts, pack_moe_experts, unpack_matrix_tiles, unpack_moe_w13
from llmq.quant import QuantConfig, QuantRecipe, quantize_weight


def is_qwen_moe_block(module: nn.Module) -> bool:
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    return (
        gate is not None and experts is not None and isinstance(getattr(gate, "weight", None), torch.Tensor)
        and hasattr(gate, "top_k") and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(experts, "down_proj", None), torch.Tensor) and experts.gate_up_proj.dim() == 3
    )


class QuantizedMoEBlock(nn.Module):
    """Drop-in replacement of a Qwen3.5-MoE sparse block: [B, S, D] -> [B, S, D]."""

    def __init__(self, router_weight: torch.Tensor, top_k: int, experts: PackedExperts,
                 shared: Optional[PackedExperts] = None, shared_gate: Optional[torch.Tensor] = None,
                 dense_shared: Optional[nn.Module] = None, dense_shared_gate: Optional[nn.Module] = None,
                 num_threads: int = 0):
        super().__init__()
        self.top_k, self.bits, self.group_size = int(top_k), experts.bits, experts.group_size
        self.num_threads = num_threads
        self.register_buffer("router_weight", router_weight.detach().to(torch.float32).contiguous())
        for name in ("w13_qdata", "w13_sb", "w2_qdata", "w2_sb"):
            self.register_buffer(name, getattr(experts, name))
        self.has_shared = shared is not None
        self.shared_bits = shared.bits if shared else 4
        self.shared_group_size = shared.group_size if shared else 32
        for name in ("w13_qdata", "w13_sb", "w2_qdata", "w2_sb"):
            self.register_buffer("shared_" + name, getattr(shared, name) if shared else None)
        self.register_buffer("shared_gate_weight", None if shared_gate is None
                             else shared_gate.detach().to(torch.float32).reshape(1, -1).contiguous())
        self.dense_shared = dense_shared
        self.dense_shared_gate = dense_shared_gate

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.to(torch.float32)
        out = torch.ops.llmq.quantized_moe_ffn(
            x, self.router_weight, None, self.w13_qdata, self.w13_sb, self.w2_qdata, self.w2_sb, self.top_k,
            self.bits, self.group_size, "softmax", 1.0, self.shared_w13_qdata, self.shared_w13_sb,
            self.shared_w2_qdata, self.shared_w2_sb, self.shared_gate_weight, self.shared_bits,
            self.shared_group_size, self.num_threads)
        out = out.to(hidden_states.dtype)
        if self.dense_shared is not None:
            shared = self.dense_shared(hidden_states.reshape(-1, shape[-1]))
            if self.dense_shared_gate is not None:
                shared = torch.sigmoid(self.dense_shared_gate(hidden_states.reshape(-1, shape[-1]))) * shared
            out = out + shared
        return out.reshape(shape)

    def reference_forward(self, hidden_states: torch.Tensor, return_bounds: bool = False):
        """The same block through the float64 eager reference (moe_reference), from the
        packed weights; for checking the op inside a whole model. With return_bounds, also
        the (magnitude, one-flip) error scales of moe_reference, [T, D] float64."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).to(torch.float32)
        e, d, f = self.w13_qdata.shape[0], shape[-1], self.w13_qdata.shape[1] * 8
        w13 = unpack_moe_w13(self.w13_qdata, self.w13_sb, self.bits, self.group_size, (e, 2 * f, d))
        w2 = unpack_matrix_tiles(self.w2_qdata, self.w2_sb, self.bits, self.group_size, (e, d, f))
        s13 = s2 = None
        if self.has_shared:
            fs = self.shared_w13_qdata.shape[1] * 8
            s13 = unpack_moe_w13(self.shared_w13_qdata, self.shared_w13_sb, self.shared_bits,
                                      self.shared_group_size, (1, 2 * fs, d))
            s2 = unpack_matrix_tiles(self.shared_w2_qdata, self.shared_w2_sb, self.shared_bits,
                                     self.shared_group_size, (1, d, fs))
        out, mag, flip = moe_reference(x, self.router_weight, None, w13, w2, self.top_k, "softmax", 1.0, s13, s2,
                                       self.shared_gate_weight, return_bounds=True)
        if self.dense_shared is not None:
            shared = self.dense_shared(hidden_states.reshape(-1, shape[-1]))
            if self.dense_shared_gate is not None:
                shared = torch.sigmoid(self.dense_shared_gate(hidden_states.reshape(-1, shape[-1]))) * shared
            out = out + shared.double()
            mag = mag + shared.double().abs()
        if return_bounds:
            return out.reshape(shape), mag.reshape(shape), flip.reshape(shape)
        return out.to(hidden_states.dtype).reshape(shape)


def _config_for(recipe_or_config, fqn: str) -> Optional[QuantConfig]:
    if recipe_or_config is None or isinstance(recipe_or_config, QuantConfig):
        return recipe_or_config
    if isinstance(recipe_or_config, QuantRecipe):
        return recipe_or_config.get_config(fqn)
    raise TypeError(f"expected a QuantRecipe or QuantConfig, got {type(recipe_or_config).__name__}")


# What the fused MoE kernel takes (declared like a backend's ACCEPTS_FORMATS: docs/formats.md section 0).
KERNEL_FORMATS = ("int",)
KERNEL_BITS = (4, 8)


def _check_kernel_config(cfg: QuantConfig, fqn: str) -> None:
    if cfg.format not in KERNEL_FORMATS or cfg.bits not in KERNEL_BITS:
        raise ValueError(f"{fqn}: the MoE kernel takes INT4/INT8 group-wise weights, recipe gives "
                         f"format={cfg.format!r} bits={cfg.bits}")


def _shared_parts(block: nn.Module, name: str, recipe_or_config, scale_dtype: torch.dtype):
    se = getattr(block, "shared_expert", None)
    if se is None:
        return None, None, None, None
    gate_lin = getattr(block, "shared_expert_gate", None)
    fqns = [f"{name}.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    cfgs = [_config_for(recipe_or_config, f) for f in fqns]
    if cfgs[0] is None and cfgs[1] is None and cfgs[2] is None:
        return None, None, se, gate_lin
    if not (cfgs[0] == cfgs[1] == cfgs[2]):
        raise ValueError(f"{name}.shared_expert: gate_proj, up_proj and down_proj must share one quantization "
                         f"config for the fused kernel, recipe gives {cfgs}")
    _check_kernel_config(cfgs[0], fqns[0])
    w13 = torch.cat([se.gate_proj.weight, se.up_proj.weight], dim=0).detach()
    q13 = quantize_weight(w13.float(), cfgs[0], name=f"{name}.shared_expert.gate_up")
    q2 = quantize_weight(se.down_proj.weight.detach().float(), cfgs[2], name=fqns[2])
    gate_w = gate_lin.weight if gate_lin is not None else None
    return pack_moe_experts(q13, q2, scale_dtype), gate_w, None, None


def replace_moe_blocks(model: nn.Module, recipe_or_config: Union[QuantRecipe, QuantConfig],
                       num_threads: int = 0, scale_dtype: torch.dtype = torch.float32) -> List[str]:
    """Quantize and swap every Qwen3.5-MoE-style sparse block in `model` (in place) for a
    QuantizedMoEBlock; returns the fqns replaced. Blocks whose experts the recipe keeps in
    high precision are left alone. Raises MoEKernelUnavailable (naming the missing
    _moe_kernel.so) before touching the model if the compiled kernel cannot be loaded.
    scale_dtype=torch.bfloat16 packs scales/biases in the compact layout (pack_moe_experts)."""
    targets = [(n, m) for n, m in model.named_modules() if is_qwen_moe_block(m)]
    if targets:
        load_kernel()  # fail before quantizing anything if the compiled kernel is missing (clear error)
    replaced = []
    for name, block in targets:
        cfg = _config_for(recipe_or_config, f"{name}.experts")
        if cfg is None:
            continue
        _check_kernel_config(cfg, f"{name}.experts")
        ex = block.experts
        q13 = quantize_weight(ex.gate_up_proj.detach().float(), cfg, name=f"{name}.experts.gate_up_proj")
        q2 = quantize_weight(ex.down_proj.detach().float(), cfg, name=f"{name}.experts.down_proj")
        packed = pack_moe_experts(q13, q2, scale_dtype)
        shared, shared_gate, dense, dense_gate = _shared_parts(block, name, recipe_or_config, scale_dtype)
        new = QuantizedMoEBlock(block.gate.weight, block.gate.top_k, packed, shared, shared_gate, dense, dense_gate,
                                num_threads)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
        replaced.append(name)
    return replaced
