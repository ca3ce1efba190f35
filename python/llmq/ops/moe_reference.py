"""Eager float64 reference of quantized_moe_ffn: the same math, written plainly.

Weights are the canonical GroupQuantizedWeight values (exact in float64). With
act_quant=True the activations are quantized exactly as the kernel does (the rounding
steps are fp32 operations, reproduced here in fp32), so the only difference from the
kernel left is the kernel's fp32 accumulation; with act_quant=False this is the plain
weight-only-quantized MoE block (what the int8 activation path approximates).
"""

from __future__ import annotations

from typing import Optional

import torch

from llmq.quant.formats import GroupQuantizedWeight, dequantize_canonical


def quantize_activations(x: torch.Tensor, group_size: int):
    """Per-row, per-group symmetric int8, as the kernel: returns (q int32 [..., K], scale fp32 [..., K/gs]).
    scale = amax/127 (fp32), q = round_half_even(x * (127/amax)) clamped to +-127; a group
    with amax < 1e-30 is zero; a group with a NaN/inf gets scale NaN and q = 0."""
    x = x.to(torch.float32)
    *lead, k = x.shape
    g = x.reshape(*lead, k // group_size, group_size)
    amax = g.abs().amax(-1)
    bad = ~torch.isfinite(g).all(-1)
    zero = ~(amax >= 1e-30) | bad
    safe = torch.where(zero, torch.ones_like(amax), amax)
    inv = torch.tensor(127.0, dtype=torch.float32) / safe
    q = torch.round(g * inv.unsqueeze(-1)).clamp(-127, 127)
    q = torch.where(zero.unsqueeze(-1), torch.zeros_like(q), q).to(torch.int32)
    scale = torch.where(zero, torch.zeros_like(amax), safe / torch.tensor(127.0, dtype=torch.float32))
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    return q.reshape(*lead, k), scale


def fake_quantize_activations(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """scale * q in float64: the activation the kernel's int8 path multiplies by."""
    q, scale = quantize_activations(x, group_size)
    *lead, k = q.shape
    deq = q.to(torch.float64).reshape(*lead, k // group_size, group_size) * scale.to(torch.float64).unsqueeze(-1)
    return deq.reshape(*lead, k)


def route_reference(x, router_weight, expert_bias, top_k: int, score_func: str = "softmax", route_scale: float = 1.0):
    """(indices [T, k] int64, weights [T, k] float64, logits [T, E] float64). Selection keys:
    logits (softmax) or sigmoid(logits) + bias (sigmoid); NaN keys rank as -inf; ties go to
    the lower expert index (stable sort)."""
    logits = x.to(torch.float64) @ router_weight.to(torch.float64).T
    if score_func == "softmax":
        keys = logits.clone()
    elif score_func == "sigmoid":
        keys = torch.sigmoid(logits)
        if expert_bias is not None:
            keys = keys + expert_bias.to(torch.float64)
    else:
        raise ValueError(f"unknown score_func {score_func!r}")
    keys = torch.nan_to_num(keys, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    idx = torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :top_k]
    return idx, routing_weights(logits, idx, score_func, route_scale), logits


def routing_weights(logits: torch.Tensor, idx: torch.Tensor, score_func: str, route_scale: float) -> torch.Tensor:
    """Weights of the chosen experts: softmax over their logits, or their sigmoids
    renormalised to sum 1; times route_scale. float64."""
    chosen = torch.gather(logits.to(torch.float64), 1, idx.long())
    if score_func == "softmax":
        w = torch.softmax(chosen, dim=-1)
    else:
        s = torch.sigmoid(chosen)
        w = s / s.sum(-1, keepdim=True)
    return w * route_scale


def _abs_terms(w: GroupQuantizedWeight) -> torch.Tensor:
    """|scale|*q + |bias| in float64: the size of the two terms the kernel sums for each weight."""
    return dequantize_canonical(
        GroupQuantizedWeight(w.qdata, w.scale.abs(), w.bias.abs(), w.bits, w.group_size, w.shape, w.dtype)
    ).to(torch.float64)


def _expert(x64, w13, w2, w2abs, gs13: int, gs2: int, act_quant: bool, x_is_prequantized: bool):
    """One SwiGLU expert on float64 weights; returns (y [n, D], term magnitude, one-flip size)."""
    f = w13.shape[0] // 2
    a = x64 if x_is_prequantized or not act_quant else fake_quantize_activations(x64.float(), gs13)
    gu = a @ w13.T
    h = torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]
    if act_quant:
        h32 = h.to(torch.float32)
        _, hscale = quantize_activations(h32, gs2)
        hq = fake_quantize_activations(h32, gs2)
        flip = w2.abs().amax(1)[None, :] * hscale.to(torch.float64).amax(-1, keepdim=True)
    else:
        hq = h
        flip = torch.zeros(h.shape[0], w2.shape[0], dtype=torch.float64)
    y = hq @ w2.T
    mag = hq.abs() @ w2abs.T
    return y, mag, flip


def moe_reference(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    expert_bias: Optional[torch.Tensor],
    w13: GroupQuantizedWeight,
    w2: GroupQuantizedWeight,
    top_k: int,
    score_func: str = "softmax",
    route_scale: float = 1.0,
    shared_w13: Optional[GroupQuantizedWeight] = None,
    shared_w2: Optional[GroupQuantizedWeight] = None,
    shared_gate_weight: Optional[torch.Tensor] = None,
    act_quant: bool = True,
    selected: Optional[torch.Tensor] = None,
    return_bounds: bool = False,
):
    """out [T, D] float64 of the MoE block. `selected` [T, k] overrides the expert choice
    (weights are still recomputed here), so routing can be checked separately.
    With return_bounds, also returns (magnitude, flip): sum over terms of |w * W2 * h| and
    the output change one int8 rounding flip of h can cause (for test tolerances)."""
    idx, wts, logits = route_reference(x, router_weight, expert_bias, top_k, score_func, route_scale)
    if selected is not None:
        idx = selected.long()
        wts = routing_weights(logits, idx, score_func, route_scale)
    x64 = x.to(torch.float32).to(torch.float64)
    t, d = x64.shape
    out = torch.zeros(t, d, dtype=torch.float64)
    mag = torch.zeros_like(out)
    flip = torch.zeros_like(out)
    w13d = dequantize_canonical(w13).to(torch.float64)
    w2d = dequantize_canonical(w2).to(torch.float64)
    xa = fake_quantize_activations(x.to(torch.float32), w13.group_size) if act_quant else x64
    w2abs = _abs_terms(w2) if return_bounds else w2d
    for e in torch.unique(idx).tolist():
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        y, m, fl = _expert(xa[tok], w13d[e], w2d[e], w2abs[e], w13.group_size, w2.group_size, act_quant, True)
        wt = wts[tok, slot].unsqueeze(-1)
        out.index_add_(0, tok, wt * y)
        mag.index_add_(0, tok, wt.abs() * m)
        flip.index_add_(0, tok, wt.abs() * fl)
    if shared_w13 is not None:
        s13 = dequantize_canonical(shared_w13).to(torch.float64).reshape(-1, d)
        s2 = dequantize_canonical(shared_w2).to(torch.float64).reshape(d, -1)
        s2abs = (_abs_terms(shared_w2) if return_bounds else s2).reshape(d, -1)
        y, m, fl = _expert(x64, s13, s2, s2abs, shared_w13.group_size, shared_w2.group_size, act_quant, False)
        g = torch.ones(t, 1, dtype=torch.float64)
        if shared_gate_weight is not None:
            g = torch.sigmoid(x64 @ shared_gate_weight.to(torch.float64).reshape(1, d).T)
        out += g * y
        mag += g * m
        flip += g * fl
    if return_bounds:
        return out, mag, flip
    return out
