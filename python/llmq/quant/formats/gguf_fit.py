"""Fitting GGUF (llama.cpp) blocks: the parameters a block type stores, chosen by a method, then the codes.

A block type stores, per block of 32 (q4_0 .. q8_0) or super-block of 256 (the K-quants), a float16
super-scale d (asymmetric K-quants also a float16 super-min dmin) and, for the K-quants, small integer
sub-block scales (and mins). What a weight dequantizes to is ``scale * q + bias`` per group:

=====  ====  =====  ==========================================  =================================
name   bits  group  scale                                       bias
=====  ====  =====  ==========================================  =================================
q4_0   4     32     d (float16)                                 -8 d
q4_1   4     32     d (float16)                                 m (float16)
q5_0   5     32     d                                           -16 d
q5_1   5     32     d                                           m
q8_0   8     32     d                                           -128 d
q2_k   2     16     d * sc_j (d float16, sc_j in 0..15)         -dmin * m_j (m_j in 0..15)
q3_k   3     16     d * sc_j (sc_j in -32..31)                  -4 d sc_j
q4_k   4     32     d * sc_j (sc_j in 0..63)                    -dmin * m_j (dmin float16, m_j in 0..63)
q5_k   5     32     d * sc_j                                    -dmin * m_j
q6_k   6     16     d * sc_j (sc_j in -128..127)                -32 d sc_j
=====  ====  =====  ==========================================  =================================

Two steps, usable apart (a column-by-column method such as GPTQ fits a run of columns, then rounds each
column with the parameters held fixed): `fit(kind, x)` -> the stored per-group (scale, bias) of a run of
whole blocks (a K-quant's sub-block scales depend on their whole super-block: a run is a multiple of 256
columns); `round_codes(kind, x, scale, bias)` -> the nearest code of each value under them, and
`round_columns(kind, x_cols, scale, bias, first)` the same for any columns of the run (one at a time). Every
parameter `fit` returns is one the block stores (the float16 rounding and the sub-block integers are
applied inside the method, before its error is measured), so the error a method minimises is the error
of the written file.

Methods (`fit`'s ``method``; ``importance``: positive weights [K], one per input column, that weight the
squared error of "search" and "hqq"):

* "minmax": q4_0 .. q8_0 exactly llama.cpp's reference quantizer (gguf-py's ``gguf.quants.quantize``, byte
  for byte; `minmax_legacy`): q*_0 d = the value of largest magnitude / -2^(b-1) (sign kept, so that
  value is exact), q8_0 d = max|x| / 127, q*_1 d = (max - min) / (2^b - 1) and m = min, codes
  trunc(x / d + 2^(b-1) + 0.5) (q8_0: round half away from zero) against the unrounded float32 d, then
  d and m stored as float16. K-quants: each sub-block's min-max scale (and min, clamped <= 0; symmetric
  types the sign trick), then d (dmin) = the largest over the super-block / the largest integer, each
  sub-block integer round(s / d), and codes nearest under the stored values.
* "search": per group, candidate scales (the min-max scale times SEARCH_FACTORS; asymmetric ranges shrunk
  about their centre), each refitted by (importance-weighted) least squares to its own codes (REFITS
  times: codes, then scale and bias); the least error wins. K-quants then quantize the sub-block
  parameters against SUPER_FACTORS candidate d (and dmin), each sub-block integer floor or ceil of its
  ratio, and keep per super-block the least error under the stored values.
* "hqq": half-quadratic optimisation with an lp loss (llmq.quant.hqq's constants and shrink operator):
  asymmetric types optimise the zero with the scale fixed (llmq.quant.hqq, the paper's method),
  symmetric types, whose zero is fixed, the scale (W_e = shrink(W - s (q - z)), s = the least-squares
  scale of W - W_e); then the K-quants' sub-block step as for "search".

"search" and "hqq" end by comparing, per block (super-block), their result with "minmax"'s under the
stored values and keeping the better, so they are never worse than minmax in the (weighted) squared error.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

from llmq.quant.hqq import BETA, ITERS, KAPPA, P_NORM, hqq_qparams_torch, shrink_lp


@dataclasses.dataclass(frozen=True)
class BlockType:
    ggml: str  # GGML type name (gguf.GGMLQuantizationType member)
    bits: int
    group: int  # elements sharing one scale / bias (a sub-block for the K-quants)
    block: int  # elements per block (32, or 256 for the K-quants' super-blocks)
    symmetric: bool  # bias = -2^(b-1) * scale
    sub: Optional[Tuple[int, int]] = None  # K-quants: the integer range of the sub-block scales
    mins: int = 0  # asymmetric K-quants: the largest integer sub-block min

    @property
    def offset(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def top(self) -> int:
        return (1 << self.bits) - 1

    @property
    def per(self) -> int:
        """Groups per block."""
        return self.block // self.group


BLOCK_TYPES: Dict[str, BlockType] = {
    "q4_0": BlockType("Q4_0", 4, 32, 32, True),
    "q4_1": BlockType("Q4_1", 4, 32, 32, False),
    "q5_0": BlockType("Q5_0", 5, 32, 32, True),
    "q5_1": BlockType("Q5_1", 5, 32, 32, False),
    "q8_0": BlockType("Q8_0", 8, 32, 32, True),
    "q2_k": BlockType("Q2_K", 2, 16, 256, False, (0, 15), 15),
    "q3_k": BlockType("Q3_K", 3, 16, 256, True, (-32, 31)),
    "q4_k": BlockType("Q4_K", 4, 32, 256, False, (0, 63), 63),
    "q5_k": BlockType("Q5_K", 5, 32, 256, False, (0, 63), 63),
    "q6_k": BlockType("Q6_K", 6, 16, 256, True, (-128, 127)),
}
METHODS = ("minmax", "search", "hqq")

# "search": the min-max scale times each factor (1.0, minmax's own, first), every candidate refitted REFITS times.
SEARCH_FACTORS = (1.0,) + tuple(round(0.70 + 0.025 * i, 3) for i in range(17) if i != 12)
REFITS = 2
# K-quants: the super-block's (d, dmin) times each pair of factors, each tried with every sub-block integer floor / ceil.
SUPER_FACTORS = ((1.0, 1.0), (0.97, 1.0), (1.03, 1.0), (1.0, 0.97), (1.0, 1.03))


def f16(x: torch.Tensor, name: str) -> torch.Tensor:
    """x rounded to float16 (nearest even), as float32; a value float16 cannot hold is refused."""
    r = x.to(torch.float16).to(torch.float32)
    if not bool(torch.isfinite(r).all()):
        raise ValueError(f"{name}: a block scale overflows float16 (|scale| > 65504): no GGUF block holds it")
    return r


def signed_extreme(g: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude along the last dim, sign kept (the first one on a tie)."""
    return g.gather(-1, g.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)


def _safe(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s == 0, torch.ones_like(s), s)


def codes(x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, top: int) -> torch.Tensor:
    """The nearest code in [0, top] of each value of x [..., g] under scale, bias [...] (scale 0: code 0)."""
    q = ((x - bias.unsqueeze(-1)) / _safe(scale).unsqueeze(-1)).round_().clamp_(0, top)
    return torch.where((scale == 0).unsqueeze(-1), torch.zeros_like(q), q)


def group_error(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
                a: Optional[torch.Tensor]) -> torch.Tensor:
    """sum over the last dim of a * (scale q + bias - x)^2 (float32; a broadcast over x or None)."""
    e = (q * scale.unsqueeze(-1) + bias.unsqueeze(-1) - x).square_()
    return (e if a is None else e.mul_(a)).sum(-1)


def _exact_error(x, q, scale, bias, a) -> torch.Tensor:
    """group_error in float64 of the values as dequantized (float64 scale q + bias rounded once to float32)."""
    v = (q.double() * scale.double().unsqueeze(-1) + bias.double().unsqueeze(-1)).float().double()
    e = (v - x.double()).square_()
    return (e if a is None else e * a.double()).sum(-1)


def round_codes(kind: str, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x [R, n] (a run of whole groups of `kind`), its stored scale, bias [R, n / group] -> float codes [R, n]."""
    t = BLOCK_TYPES[kind]
    rows, n = x.shape
    g = x.reshape(rows, n // t.group, t.group)
    return codes(g, scale, bias, t.top).reshape(rows, n)


def round_columns(kind: str, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
                  first: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Columns first .. first + c - 1 of a run, x [R, c] (any c, e.g. one column at a time), rounded with the
    run's fixed stored scale, bias [R, n / group] (what `fit` returned for the run): (float codes [R, c], their
    dequantized values [R, c], float32 as dequantize gives them)."""
    t = BLOCK_TYPES[kind]
    cols = torch.arange(first, first + x.shape[1]) // t.group
    s, b = scale[:, cols], bias[:, cols]
    q = ((x - b) / _safe(s)).round_().clamp_(0, t.top)
    q = torch.where(s == 0, torch.zeros_like(q), q)
    return q, (q.double() * s.double() + b.double()).float()


# --------------------------------------------------------------------------------------------
# llama.cpp's reference quantizer of the blocks of 32 (gguf-py's quants.py), to the byte
# --------------------------------------------------------------------------------------------


def _round_away(v: torch.Tensor) -> torch.Tensor:
    """roundf: half away from zero, as floor(a) + floor(2 (a - floor(a))) with a = |v| (exact in float32)."""
    a = v.abs()
    fl = a.floor()
    return torch.sign(v) * (fl + (2.0 * (a - fl)).floor())


def minmax_legacy(g: torch.Tensor, kind: str, name: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's q4_0 .. q8_0 of float32 groups g [..., 32]: (codes, stored scale, stored bias)."""
    t = BLOCK_TYPES[kind]
    if kind == "q8_0":
        d = g.abs().amax(-1) / 127.0
    elif t.symmetric:
        d = signed_extreme(g) / -float(t.offset)
    else:
        lo = g.amin(-1)
        d = (g.amax(-1) - lo) / float(t.top)
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / _safe(d)).unsqueeze(-1)
    if kind == "q8_0":
        q = _round_away(g * inv).add_(128.0)
    elif t.symmetric:
        q = (g * inv).add_(float(t.offset) + 0.5).trunc_().clamp_(0, t.top)
    else:
        q = (g - lo.unsqueeze(-1)).mul_(inv).add_(0.5).trunc_().clamp_(0, t.top)
    scale = f16(d, name)
    bias = scale * -float(t.offset) if t.symmetric else f16(lo, name)
    return q, scale, bias


# --------------------------------------------------------------------------------------------
# Per group: float (scale, bias) by a method
# --------------------------------------------------------------------------------------------


def _minmax_float(g: torch.Tensor, t: BlockType) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each group's min-max (scale, bias); K-quant mins clamped <= 0 (the block stores -dmin * m, m >= 0)."""
    if t.symmetric:
        s = signed_extreme(g) / -float(t.offset)
        return s, s * -float(t.offset)
    lo = g.amin(-1)
    if t.sub is not None:
        lo = lo.clamp(max=0.0)
    return (g.amax(-1) - lo) / float(t.top), lo


def refit(g: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, t: BlockType,
          a: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The (importance-weighted) least-squares (scale, bias) of groups g for fixed codes q (a group whose
    codes do not determine them keeps its own); asymmetric K-quants keep bias <= 0."""
    w = torch.ones_like(g) if a is None else a.expand_as(g)
    if t.symmetric:
        c = q - float(t.offset)
        den = (w * c * c).sum(-1)
        s = torch.where(den > 0, (w * c * g).sum(-1) / _safe(den), scale)
        return s, s * -float(t.offset)
    sw, sq, sqq = w.sum(-1), (w * q).sum(-1), (w * q * q).sum(-1)
    sx, sqx = (w * g).sum(-1), (w * q * g).sum(-1)
    det = sw * sqq - sq * sq
    ok = det > 1e-12 * sw * sqq
    s = torch.where(ok, (sw * sqx - sq * sx) / _safe(det), scale)
    b = torch.where(ok, (sqq * sx - sq * sqx) / _safe(det), bias)
    if t.sub is not None:  # bias must be <= 0: refit the scale alone at bias 0 where it is not
        pos = b > 0
        s0 = torch.where(sqq > 0, sqx / _safe(sqq), scale)
        s, b = torch.where(pos, s0, s), torch.where(pos, torch.zeros_like(b), b)
    return s, b


def _search_float(g: torch.Tensor, t: BlockType, a: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Method "search" before storing: each group's best refitted candidate (float scale, bias)."""
    s0, b0 = _minmax_float(g, t)
    hi = g.amax(-1)
    best = _Least()
    for f in SEARCH_FACTORS:
        s = s0 * f
        b = s * -float(t.offset) if t.symmetric else b0 + (hi - b0 - s * float(t.top)) / 2.0  # centred
        if t.sub is not None and not t.symmetric:
            b = b.clamp(max=0.0)
        for _ in range(REFITS):
            s, b = refit(g, codes(g, s, b, t.top), s, b, t, a)
        best.offer(group_error(g, codes(g, s, b, t.top), s, b, a), s, b)
    return best.values[0], best.values[1]


def _hqq_float(g: torch.Tensor, t: BlockType, a: Optional[torch.Tensor],
               scale_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Method "hqq" before storing (see the module docstring): float (scale, bias) per group of g [R, ..., n]
    (a [..., n] or None)."""
    if not t.symmetric:
        lead = g.shape[:-1]
        s, z = hqq_qparams_torch(g.reshape(lead[0], -1, g.shape[-1]), t.bits,
                                 importance=None if a is None else a.reshape(-1, g.shape[-1]), scale_dtype=scale_dtype)
        s, z = s.reshape(lead), z.reshape(lead)
        b = 0.0 - z * s
        return s, (b.clamp(max=0.0) if t.sub is not None else b)
    s, _ = _minmax_float(g, t)
    if scale_dtype != torch.float32:
        s = s.to(scale_dtype).to(torch.float32)
    off = float(t.offset)
    w = torch.ones_like(g) if a is None else a.expand_as(g)
    q = codes(g, s, s * -off, t.top)
    best_err, best_s = group_error(g, q, s, s * -off, a), s.clone()
    active = torch.ones_like(best_err, dtype=torch.bool)
    beta = BETA
    for _ in range(ITERS):
        c = q - off
        we = shrink_lp(g - s.unsqueeze(-1) * c, beta, P_NORM)
        den = (w * c * c).sum(-1)
        s_new = torch.where(den > 0, (w * c * (g - we)).sum(-1) / _safe(den), s)
        if scale_dtype != torch.float32:
            s_new = s_new.to(scale_dtype).to(torch.float32)
        beta *= KAPPA
        q_new = codes(g, s_new, s_new * -off, t.top)
        err = group_error(g, q_new, s_new, s_new * -off, a)
        improved = active & (err < best_err)
        best_err, best_s = torch.where(improved, err, best_err), torch.where(improved, s_new, best_s)
        active = improved
        if not bool(active.any()):
            break
        s = torch.where(active, s_new, s)
        q = torch.where(active.unsqueeze(-1), q_new, q)
    return best_s, best_s * -off


class _Least:
    """The least-error candidate so far at each position of its error tensor (the earlier one on a tie); its
    values may have trailing dimensions beyond the error's."""

    def __init__(self) -> None:
        self.err: Optional[torch.Tensor] = None
        self.values: Tuple[torch.Tensor, ...] = ()

    def offer(self, err: torch.Tensor, *values: torch.Tensor) -> None:
        if self.err is None:
            self.err, self.values = err, values
            return
        win = err < self.err
        self.err = torch.where(win, err, self.err)
        self.values = tuple(torch.where(win.reshape(win.shape + (1,) * (v.dim() - win.dim())), v, old)
                            for v, old in zip(values, self.values))


def _float_params(g, t, method, a, scale_dtype):
    if method == "search":
        return _search_float(g, t, a)
    if method == "hqq":
        return _hqq_float(g, t, a, scale_dtype)
    return _minmax_float(g, t)


# --------------------------------------------------------------------------------------------
# Storing: float16 (blocks of 32) or super-block d times sub-block integers (K-quants)
# --------------------------------------------------------------------------------------------


def _store_legacy(g, s, b, t, name):
    scale = f16(s, name)
    bias = scale * -float(t.offset) if t.symmetric else f16(b, name)
    return scale, bias


def _ratio_candidates(v: torch.Tensor, d: torch.Tensor, lo: int, hi: int, exact: bool):
    """Integer candidates for v / d [..., S] (d [...]): round (minmax), else floor and ceil; 0 where d == 0."""
    r = v / _safe(d).unsqueeze(-1)
    out = [r.round()] if not exact else [r.floor(), r.ceil()]
    return [torch.where(d.unsqueeze(-1) == 0, torch.zeros_like(c), c.clamp(lo, hi)) for c in out]


def _store_k(sub: torch.Tensor, s: torch.Tensor, b: torch.Tensor, t: BlockType, a: Optional[torch.Tensor],
             name: str, exact: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sub-block float (s, b) [R, B, S] -> the stored (scale, bias) [R, B, S] of sub [R, B, S, g].
    exact=False: llama.cpp's rule (d from the largest, each integer rounded); True: the least stored error
    over SUPER_FACTORS, the best (d, dmin) per super-block, each sub-block's integers floor or ceil."""
    assert t.sub is not None
    lo, hi = t.sub
    off = float(t.offset)
    if t.symmetric:
        d0 = signed_extreme(s) / float(lo)  # the sub-scale of largest magnitude maps to the most negative integer
        dmin0 = None
    else:
        d0 = s.amax(-1) / float(hi)
        dmin0 = (-b).amax(-1) / float(t.mins)
    best = _Least()
    factors = SUPER_FACTORS if exact else ((1.0, 1.0),)
    for fd, fm in factors:
        if dmin0 is None and fm != 1.0:
            continue
        d = f16(d0 * fd, name)
        dmin = None if dmin0 is None else f16(dmin0 * fm, name)
        per_sub = _Least()
        for sc in _ratio_candidates(s, d, lo, hi, exact):
            scale = d.unsqueeze(-1) * sc
            if dmin is None:
                per_sub.offer(group_error(sub, codes(sub, scale, scale * -off, t.top), scale, scale * -off, a),
                              scale, scale * -off)
                continue
            for mn in _ratio_candidates(-b, dmin, 0, t.mins, exact):
                bias = 0.0 - dmin.unsqueeze(-1) * mn
                per_sub.offer(group_error(sub, codes(sub, scale, bias, t.top), scale, bias, a), scale, bias)
        assert per_sub.err is not None
        best.offer(per_sub.err.sum(-1), *per_sub.values)
    return best.values[0], best.values[1]


# --------------------------------------------------------------------------------------------
# The two steps
# --------------------------------------------------------------------------------------------


def _grouped(x: torch.Tensor, t: BlockType, importance: Optional[torch.Tensor]):
    """x [R, n] -> sub [R, B, S, g]; importance [n] -> [B, S, g] (or None)."""
    rows, n = x.shape
    shape = (n // t.block, t.per, t.group)
    return x.reshape(rows, *shape), (None if importance is None else importance.reshape(shape))


def _with_minmax(kind, sub, a, scale, bias, name):
    """Per block, the better under the stored values of (scale, bias) and minmax's own parameters."""
    t = BLOCK_TYPES[kind]
    if t.sub is None:
        _, ms, mb = minmax_legacy(sub, kind, name)
    else:
        s, b = _minmax_float(sub, t)
        ms, mb = _store_k(sub, s, b, t, a, name, exact=False)
    err = _exact_error(sub, codes(sub, scale, bias, t.top), scale, bias, a).sum(-1)
    ref = _exact_error(sub, codes(sub, ms, mb, t.top), ms, mb, a).sum(-1)
    win = (ref < err).unsqueeze(-1)
    return torch.where(win, ms, scale), torch.where(win, mb, bias)


def fit(kind: str, x: torch.Tensor, *, method: str = "minmax", importance: Optional[torch.Tensor] = None,
        name: str = "<tensor>") -> Tuple[torch.Tensor, torch.Tensor]:
    """The stored (scale, bias) [R, n / group] of block type `kind` for float32 x [R, n] (n a multiple of the
    block), chosen by `method` (importance: positive [n] per column, weighting "search" and "hqq")."""
    t = BLOCK_TYPES[kind]
    rows, n = x.shape
    if n % t.block:
        raise ValueError(f"{name}: {kind} needs runs of a multiple of {t.block} columns, got {n}")
    if method not in METHODS:
        raise ValueError(f"{name}: GGUF block method {method!r} unknown; expected one of {METHODS}")
    sub, a = _grouped(x, t, importance)
    if t.sub is None:
        if method == "minmax":
            _, scale, bias = minmax_legacy(sub, kind, name)
        else:
            s, b = _float_params(sub, t, method, a, torch.float16)
            scale, bias = _store_legacy(sub, s, b, t, name)
    else:
        s, b = _float_params(sub, t, method, a, torch.float32)
        scale, bias = _store_k(sub, s, b, t, a, name, exact=method != "minmax")
    if method != "minmax":
        scale, bias = _with_minmax(kind, sub, a, scale, bias, name)
    return scale.reshape(rows, -1), bias.reshape(rows, -1)


def quantize_rows(x: torch.Tensor, kind: str, name: str = "<tensor>", method: str = "minmax",
                  importance: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 rows [R, K] (K a multiple of the block) -> (codes uint8 [R, K], scale [R, G], bias [R, G])."""
    t = BLOCK_TYPES[kind]
    if method == "minmax" and t.sub is None:  # llama.cpp's own codes, against the unrounded d
        rows, k = x.shape
        q, scale, bias = minmax_legacy(x.reshape(rows, k // t.group, t.group), kind, name)
        return q.reshape(rows, k).to(torch.uint8), scale, bias
    scale, bias = fit(kind, x, method=method, importance=importance, name=name)
    return round_codes(kind, x, scale, bias).to(torch.uint8), scale, bias
