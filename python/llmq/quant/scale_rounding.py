"""Integer weights whose scales and biases are written in 16 bits (QuantConfig.scale_dtype float16
or bfloat16, as MLX and mlx-lm store them): the rounding is part of the choice, not applied after.

Every method proposes, per group, candidate (scale, bias) pairs in float32 exactly as it does for
float32 scales; each candidate is then rounded to the scale dtype (scale to nearest, at least the
dtype's smallest positive value; bias to nearest, or exactly -2^(b-1) x the rounded scale for
symmetric formats), the codes are chosen against the rounded pair (q = clamp(round((w - bias) /
scale)) in float64: the nearest code of each element), and the candidate whose dequantized group
(scale*q + bias in float64, rounded once to float32, as `dequantize` computes it) has the smallest
squared error, importance-weighted when given, wins (the first on ties). The canonical weight keeps
float32 scale and bias holding those 16-bit values, so a backend writing them in 16 bits writes
llmq's values exactly.

Candidates per method:
* minmax: its one (scale, zero) pair;
* search: every candidate of llmq.quant.search (the first is minmax's);
* hqq: the half-quadratic zero optimised with the scale rounded first, and the float32 HQQ result
  (rounded like any candidate: at least as good as rounding that result after the fact).

Each candidate's codes are re-chosen against its rounded pair, so the result is never worse (in
the measured error) than rounding the same candidate's scale and bias after quantizing.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

from llmq.quant.codecs import BestPerGroup, qparams_asymmetric, qparams_symmetric, round_to_dtype, smallest_scale

NARROW_SCALE_DTYPES = (torch.float16, torch.bfloat16)


def _rounded(scale: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype, offset: Optional[int], name: str):
    s = torch.clamp(round_to_dtype(scale, dtype), min=smallest_scale(dtype))
    b = s * -float(offset) if offset is not None else round_to_dtype(bias, dtype)
    if not (bool(torch.isfinite(s).all()) and bool(torch.isfinite(b).all())):
        raise ValueError(f"{name}: a group's scale or bias overflows {str(dtype).replace('torch.', '')}; quantize it "
                         "with scale_dtype float32 (or a backend that writes float32 scales)")
    return s, b


def best_rounded(g: torch.Tensor, candidates: Iterable[Tuple[torch.Tensor, torch.Tensor]], bits: int,
                 dtype: torch.dtype, symmetric: bool, importance: Optional[torch.Tensor] = None,
                 name: str = "<tensor>") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [R, G, gs], scale [R, G], bias [R, G]) of float32 groups g [R, G, gs]: the best
    candidate (scale, bias) float32 [R, G] after rounding to `dtype` (module docstring);
    importance: optional positive [G, gs]."""
    qmax = float((1 << bits) - 1)
    offset = (1 << (bits - 1)) if symmetric else None
    g64 = g.to(torch.float64)
    imp = None if importance is None else importance.to(torch.float64)
    best = BestPerGroup()
    for scale, bias in candidates:
        s, b = _rounded(scale, bias, dtype, offset, name)
        s64, b64 = s.to(torch.float64).unsqueeze(-1), b.to(torch.float64).unsqueeze(-1)
        q = (g64 - b64).div_(s64).round_().clamp_(0.0, qmax)
        recon = (q * s64).add_(b64).to(torch.float32).to(torch.float64)
        sq = recon.sub_(g64).square_()
        if imp is not None:
            sq.mul_(imp)
        best.offer(sq.sum(-1), q, s, b)
    codes, scale, bias = best.chosen(name)
    return codes.to(torch.uint8), scale, bias


def quantize_groups(g: torch.Tensor, config, importance: Optional[torch.Tensor], name: str):
    """(codes uint8 [R, G, gs], scale, bias) of finite float32 groups g for an integer `config` whose
    scale_dtype is 16-bit, by its method (module docstring)."""
    import llmq.quant.hqq as hqq
    import llmq.quant.search as search

    bits, dtype = config.bits, config.scale_dtype
    xmin, xmax = g.amin(-1), g.amax(-1)
    half = float(1 << (bits - 1))

    def with_bias(pairs):
        for s, z in pairs:
            yield s, (s * -half) if z is None else 0.0 - z * s

    if config.method == "search":
        cands = with_bias(search.candidates(xmin, xmax, bits, config.symmetric))
    elif config.method == "hqq":
        s, z = hqq.hqq_qparams_torch(g, bits, importance=importance, scale_dtype=dtype)
        s32, z32 = hqq.hqq_qparams(g, bits, importance)
        cands = [(s, 0.0 - z * s), (s32, 0.0 - z32 * s32)]
    elif config.symmetric:
        cands = with_bias([(qparams_symmetric(xmin, xmax, bits), None)])
    else:
        cands = with_bias([qparams_asymmetric(xmin, xmax, bits, name)])
    return best_rounded(g, cands, bits, dtype, config.symmetric, importance, name)
