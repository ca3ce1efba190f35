"""Method "search": per group, the scale (and integer zero) with the smallest squared error
among a small fixed set of candidates, instead of round-to-nearest on min/max ("minmax").

Calibration-free and deterministic. The candidates of a group are built from its min/max
exactly as method "minmax" builds its scale (llmq.quant.quantize, docs/formats.md section 4):

* symmetric: scale_f = max(fl32(scale_minmax * f), eps) for each f in SEARCH_FACTORS; the
  zero stays 2^(b-1) (bias = -2^(b-1) * scale).
* asymmetric: scale_f = round_mantissa(max(fl32(scale_minmax_unrounded * f), eps), 24 - b)
  (so bias = -zero*scale stays exact in float32) and, for each scale, three integer zeros
  clamped to [0, 2^b - 1], in this order: anchored at the minimum
  (-round(min_neg / s), the "minmax" rule), anchored at the maximum
  (2^b - 1 - round(max_pos / s)) and centred (round((2^b - 1)/2 - (min_neg + max_pos)/2 / s)).

Codes are then chosen exactly as by "minmax" for that (scale, zero). The error of a candidate
is sum((fl32(scale * (q - zero)) - w)^2) in float64, i.e. against what `dequantize` returns;
with importance weights a (one per input channel) each term is multiplied by a_j (float64
product (d^2) * a_j). Errors are summed in element order. The C++ kernel
(cpp/quant/search_quant.h) chooses the same candidate bit for bit: exactly these sums on its
portable path; on its vector path float32 estimates with a rigorous error bound, and these
exact sums only for the candidates the bound cannot rule out. The first candidate with the smallest error wins; f = 1.0 with the minimum-anchored zero comes
first and *is* the "minmax" result, so "search" is never worse than "minmax" on any group and
equals it on ties.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

import llmq.quant._native as _native
from llmq.quant.codecs import round_scale_mantissa

# Shrink factors of the min/max scale, largest first (dyadic, so exact in float32).
SEARCH_FACTORS = tuple(1.0 - i / 64.0 for i in range(32))

_EPS = torch.finfo(torch.float32).smallest_normal


def codes(g: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], bits: int) -> torch.Tensor:
    """Unsigned codes of float32 groups g[R, G, gs] for scale[R, G] and integer zero[R, G]
    (None = symmetric), by the "minmax" rounding rule; float32 values in [0, 2^b)."""
    inv = (1.0 / scale).unsqueeze(-1)
    if zero is None:
        offset = 1 << (bits - 1)
        return torch.mul(g, inv).round_().clamp_(-offset, offset - 1).add_(offset)
    return torch.mul(g, inv).round_().add_(zero.unsqueeze(-1)).clamp_(0, (1 << bits) - 1)


def group_error(g: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor], bits: int,
                importance: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float64 [R, G]: sum over each group of (dequantized - w)^2 (times importance[G, gs],
    float32 per input channel, when given), dequantized exactly as llmq's dequantize does
    (scale*(q - zero) in float64, rounded once to float32)."""
    q = codes(g, scale, zero, bits).to(torch.float64)
    z = float(1 << (bits - 1)) if zero is None else zero.to(torch.float64).unsqueeze(-1)
    recon = (q - z).mul_(scale.to(torch.float64).unsqueeze(-1)).to(torch.float32).to(torch.float64)
    sq = recon.sub_(g.to(torch.float64)).square_()
    if importance is not None:
        sq.mul_(importance.to(torch.float64))
    err = sq[..., 0].clone()
    for j in range(1, sq.shape[-1]):  # in element order, as the C++ kernel sums
        err += sq[..., j]
    return err


def candidates(xmin: torch.Tensor, xmax: torch.Tensor, bits: int, symmetric: bool):
    """Yield the candidate (scale, zero) pairs of every group, in search order (see the
    module docstring); zero is None for symmetric."""

    min_neg = torch.clamp(xmin, max=0.0)
    max_pos = torch.clamp(xmax, min=0.0)
    if symmetric:
        qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        base = torch.clamp(torch.max(-min_neg, max_pos) / (float(qmax - qmin) / 2), min=_EPS)
        for f in SEARCH_FACTORS:
            yield torch.clamp(base * f, min=_EPS), None
        return
    qmax = (1 << bits) - 1
    base = torch.clamp((max_pos - min_neg) / float(qmax), min=_EPS)
    centre = (min_neg + max_pos) * 0.5
    for f in SEARCH_FACTORS:
        s = round_scale_mantissa(torch.clamp(base * f, min=_EPS), 24 - bits)
        yield s, torch.clamp(0.0 - torch.round(min_neg / s), 0, qmax)
        yield s, torch.clamp(qmax - torch.round(max_pos / s), 0, qmax)
        yield s, torch.clamp(torch.round(qmax / 2.0 - centre / s), 0, qmax)


def search_qparams(g: torch.Tensor, xmin: torch.Tensor, xmax: torch.Tensor, bits: int,
                   symmetric: bool, importance: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(scale, zero) per group of finite float32 g[R, G, gs]; zero is None for symmetric.
    importance: optional positive float32 [G, gs] (the per-input-channel weights of one row).
    Through the compiled kernel (cpp/quant/search_quant.h, same bits) when it is loaded."""

    if g.device.type == "cpu" and _native.search_available():
        rows, groups, gs = g.shape
        imp = None if importance is None else importance.reshape(groups * gs)
        scale, zero = _native.search_qparams(g.reshape(rows, groups * gs), gs, bits, symmetric, importance=imp)
        return scale, zero
    return search_qparams_torch(g, xmin, xmax, bits, symmetric, importance)


def search_qparams_torch(g: torch.Tensor, xmin: torch.Tensor, xmax: torch.Tensor, bits: int,
                         symmetric: bool, importance: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The torch reference of search_qparams: the smallest group_error among `candidates`
    (the first one on ties); importance [G, gs] weights each term."""
    best_err = best_scale = best_zero = None
    for s, z in candidates(xmin, xmax, bits, symmetric):
        err = group_error(g, s, z, bits, importance)
        if best_err is None:
            best_err, best_scale, best_zero = err, s.clone(), None if z is None else z.clone()
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, s, best_scale)
        if z is not None:
            best_zero = torch.where(better, z, best_zero)
    return best_scale, best_zero
