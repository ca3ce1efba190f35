"""Rebuild a runnable model from quantized tensors (a reloaded bundle).

The model is built on the meta device; each quantized weight swaps its module for one that
holds the canonical fields (QuantizedLinear / QuantizedEmbedding / QuantizedExperts) and
dequantizes inside forward; every other tensor is assigned as is. Anything the model expects
that the tensors do not provide is named in the error. Weights of a format no quantized module
holds (the floating-point ones) are dequantized exactly to the dtype they were quantized from.
"""

from __future__ import annotations

from typing import Dict, Union

import torch
import torch.nn.functional as F
from torch import nn

from llmq.quant import GroupQuantizedWeight, QuantizedEmbedding, QuantizedLinear, dequantize, format_of
from llmq.quant.modules import dequantize_graph, kernel_for

Value = Union[torch.Tensor, GroupQuantizedWeight]


class _StackedQuantized(nn.Module):
    """Buffers of one stacked [E, N, K] canonical weight."""

    def __init__(self, qw: GroupQuantizedWeight):
        super().__init__()
        self.bits, self.group_size, self.k = qw.bits, qw.group_size, qw.shape[-1]
        self.register_buffer("qdata", qw.qdata.clone())
        self.register_buffer("scale", qw.scale.clone())
        self.register_buffer("bias", qw.bias.clone())

    def expert(self, e: int) -> torch.Tensor:
        """float32 weight of one expert: only that slice is ever dequantized."""
        return dequantize_graph(self.qdata[e], self.scale[e], self.bias[e], self.bits, self.group_size, self.k)

    def linear(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """x @ W_e^T: through the installed compiled kernel (llmq.quant.modules.set_linear_kernel)
        where it takes the format, each expert packed on first use; else dequantized."""
        kernel = kernel_for(x)
        packed = None if kernel is None else self._packed(kernel, e)
        if kernel is not None and packed is not None:
            return kernel.linear(x, packed)
        return F.linear(x, self.expert(e).to(x.dtype))

    def _packed(self, kernel, e: int):
        key = (id(kernel),) + tuple((b.data_ptr(), b._version) for b in (self.qdata, self.scale, self.bias))
        cache = self.__dict__.get("_kernel_packed")
        if cache is None or cache[0] != key:
            cache = self.__dict__["_kernel_packed"] = (key, {})
        if e not in cache[1]:
            qw = GroupQuantizedWeight(self.qdata[e], self.scale[e], self.bias[e], self.bits, self.group_size,
                                      (self.scale.shape[1], self.k))
            cache[1][e] = kernel.pack(qw)
        return cache[1][e]


class QuantizedExperts(nn.Module):
    """Drop-in for a model's stacked `Experts` (gate_up_proj [E, 2F, D], down_proj [E, D, F])
    whose weights are quantized; forward has the same signature and math."""

    def __init__(self, gate_up: Value, down: Value):
        super().__init__()
        self.num_experts = gate_up.shape[0]
        self.gate_up = self._hold(gate_up)
        self.down = self._hold(down)

    @staticmethod
    def _hold(value: Value) -> nn.Module:
        if isinstance(value, GroupQuantizedWeight):
            return _StackedQuantized(value)
        holder = nn.Module()
        holder.weight = nn.Parameter(value.detach().float(), requires_grad=False)
        holder.expert = lambda e, w=holder.weight: w[e]
        return holder

    @staticmethod
    def _linear(holder: nn.Module, x: torch.Tensor, e: int) -> torch.Tensor:
        if isinstance(holder, _StackedQuantized):
            return holder.linear(x, e)
        return F.linear(x, holder.expert(e).to(x.dtype))

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        gate, up = self._linear(self.gate_up, x, e).chunk(2, dim=-1)
        return self._linear(self.down, F.silu(gate) * up, e)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        if torch.compiler.is_exporting():  # static shapes: every expert, zero weight where not routed
            per_expert = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype).scatter_add(1, index, weights)
            for e in range(self.num_experts):
                out = out + self._expert(x, e) * per_expert[:, e, None]
            return out
        for e in torch.unique(index).tolist():
            token, slot = torch.where(index == e)
            y = self._expert(x[token], e)
            # out[token] += ...: the tokens of one expert are distinct, so this is index_add_ bit for bit,
            # without CPU index_add_'s slow bfloat16 path (~40 ms a call)
            out[token] = out[token] + (y * weights[token, slot, None]).to(out.dtype)
        return out


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _swap_quantized(model: nn.Module, tensors: Dict[str, Value]) -> Dict[str, Value]:
    """Swap the module of every quantized weight in `tensors` for its quantized counterpart; returns
    the rest (dense tensors, by name) for load_state_dict."""
    dense: Dict[str, Value] = {}
    experts: Dict[str, Dict[str, Value]] = {}
    for name, value in tensors.items():
        fmt = format_of(value)
        if fmt is not None and not fmt.has_quantized_module:
            value = dequantize(value)  # no module holds this format: its exact values, in the weight's dtype
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            path, _, part = name.rpartition(".")
            experts.setdefault(path, {})[part] = value
        elif isinstance(value, GroupQuantizedWeight):
            if not name.endswith(".weight"):
                raise ValueError(f"{name}: a quantized tensor must be a module's .weight (or fused experts)")
            path = name[: -len(".weight")]
            module = model.get_submodule(path)
            if isinstance(module, nn.Linear):
                new = QuantizedLinear.from_quantized(value, bias=tensors.get(path + ".bias"))
            elif isinstance(module, nn.Embedding):
                new = QuantizedEmbedding.from_quantized(value, module.padding_idx)
            else:
                raise ValueError(f"{name}: quantized, but module {path!r} is a {type(module).__name__}, "
                                 "which has no quantized counterpart")
            _set_module(model, path, new)
        else:
            dense[name] = value
    for path, parts in experts.items():
        if set(parts) != {"gate_up_proj", "down_proj"}:
            raise ValueError(f"{path}: expected both gate_up_proj and down_proj, got {sorted(parts)}")
        if any(isinstance(v, GroupQuantizedWeight) for v in parts.values()):
            _set_module(model, path, QuantizedExperts(parts["gate_up_proj"], parts["down_proj"]))
        else:
            dense.update({f"{path}.{part}": value for part, value in parts.items()})
    return dense


def _assign(model: nn.Module, dense: Dict[str, Value]) -> None:
    result = model.load_state_dict(dense, strict=False, assign=True)
    if result.unexpected_keys:
        raise ValueError(f"tensors the model does not have: {sorted(result.unexpected_keys)[:10]}")


def _check_filled(model: nn.Module, what: str = "model") -> None:
    still_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if still_meta:
        raise ValueError(f"tensors missing for {len(still_meta)} {what} entries, e.g. {still_meta[:10]}")


@torch.no_grad()
def fill_module(module: nn.Module, tensors: Dict[str, Value], what: str = "module") -> nn.Module:
    """Fill one part of a model (e.g. a decoder layer, built on the meta device) from `tensors`
    named relative to it, as build_quantized_model fills a whole model; returns it, ready on CPU."""
    _assign(module, _swap_quantized(module, tensors))
    _check_filled(module, what)
    return module.eval()


@torch.no_grad()
def build_quantized_model(model: nn.Module, tensors: Dict[str, Value]) -> nn.Module:
    """Fill `model` (built on the meta device) from `tensors`; returns it, ready on CPU."""
    dense = _swap_quantized(model, tensors)
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    embed = model.get_submodule("model.embed_tokens")
    if tied and isinstance(embed, QuantizedEmbedding) and isinstance(getattr(model, "lm_head", None), nn.Linear):
        model.lm_head = QuantizedLinear.from_quantized(embed.quantized_weight())
    if tied:
        dense.pop("lm_head.weight", None)
    _assign(model, dense)
    if tied and hasattr(model, "tie_weights") and not isinstance(model.lm_head, QuantizedLinear):
        model.tie_weights()
    _check_filled(model)
    return model.eval()
