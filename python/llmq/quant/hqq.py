"""Method "hqq": half-quadratic optimisation of each group's zero point (Badri & Shaji 2023,
"Half-Quadratic Quantization of Large Machine Learning Models"), calibration-free.

HQQ minimises the sparsity-promoting loss ||W - s (Q(W) - z)||_p^p (p < 1) over the zero point
z with the scale s held fixed (as the paper does), by half-quadratic splitting: an auxiliary
error W_e is updated in closed form by the generalized soft-thresholding operator of the lp
norm, then z in closed form, while the penalty beta grows by kappa each iteration:

    W_q = clamp(round(W / s + z), 0, 2^b - 1)
    W_e = shrink_p(W - s (W_q - z), beta),   shrink_p(x, beta) = sign(x) max(|x| - |x|^(p-1) / beta, 0)
    z   = mean_group(W_q - (W - W_e) / s)
    beta = kappa * beta

Here, per group of the weight (format "int", asymmetric only, since the zero is what is
optimised), with P_NORM = 0.7, BETA = 10, KAPPA = 1.01, ITERS = 20:

* start: the "minmax" range [min(min, 0), max(max, 0)] gives s = max(fl32(range / (2^b - 1)),
  eps) (the scale is *not* mantissa-rounded: the zero is a float, stored exactly as bias =
  fl32(-z s)) and the float zero z0 = fl32(-min_neg / s);
* each iteration updates z from the codes and residual of the current z, then evaluates the
  new z: codes q = clamp(round(fl32(W * fl32(1/s)) + z)), residual x = W - fl32(s * (q - z))
  (float32), error = sum x^2 in float64 (in the fixed order of `_sum64`);
* early stop, per group: as soon as an update does not lower the group's squared error the
  group stops and keeps its best z (so the result never has a larger squared error, as
  computed above, than the float-zero minmax start);
* z = fl32(sum_j fl32(q_j - fl32((W_j - W_e_j) * fl32(1/s))) / n), the sum in float64 (same
  order); shrink_p in float64, |x|^(p-1) by `pow_det` (plain float64 +, *, / in a fixed
  order, no libm) so that the C++ kernel (cpp/quant/hqq_quant.h) reproduces every bit.

Codes, packing and bias = fl32(0 - z s) are produced by llmq.quant.quantize with the chosen
(s, z); the result is an ordinary GroupQuantizedWeight (bias/scale need not be an integer).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

import llmq.quant._native as _native
from llmq.quant.codecs import round_to_dtype, smallest_scale

P_NORM = 0.7
BETA = 10.0
KAPPA = 1.01
ITERS = 20

_EPS = torch.finfo(torch.float32).smallest_normal
_LN2 = 0.6931471805599453
_SQRT_HALF = 0.7071067811865476
# ln(m) = 2t * (1 + t^2/3 + t^4/5 + ...), t = (m-1)/(m+1), |t| <= 0.172: 10 terms
_LOG_COEFS = tuple(1.0 / (2 * i + 1) for i in range(9, -1, -1))
# exp(r) = sum r^i / i!, |r| <= ln2/2: 14 terms
_EXP_COEFS = tuple(1.0 / float(math.factorial(i)) for i in range(13, -1, -1))


def pow_det(a: torch.Tensor, e: float) -> torch.Tensor:
    """a^e for positive normal float64 a (relative error ~1e-15), by float64 +, *, / in a
    fixed order (frexp, a log series, an exp series and an exact power of two), so that
    hqq_quant.cc computes the same bits without depending on a math library."""
    m, k = torch.frexp(a)  # a = m 2^k, m in [0.5, 1)
    k = k.to(torch.float64)
    small = m < _SQRT_HALF
    m = torch.where(small, m * 2.0, m)
    k = torch.where(small, k - 1.0, k)
    t = (m - 1.0) / (m + 1.0)
    t2 = t * t
    s = torch.full_like(t, _LOG_COEFS[0])
    for c in _LOG_COEFS[1:]:
        s = s * t2 + c
    y = (2.0 * t * s + k * _LN2) * e
    n = torch.round(y / _LN2)
    r = y - n * _LN2
    p = torch.full_like(r, _EXP_COEFS[0])
    for c in _EXP_COEFS[1:]:
        p = p * r + c
    two_n = ((n.to(torch.int64) + 1023) << 52).view(torch.float64)
    return p * two_n


def shrink_lp(x: torch.Tensor, beta: float, p: float) -> torch.Tensor:
    """Generalized soft-thresholding of float32 x for the lp norm: sign(x) max(|x| -
    |x|^(p-1)/beta, 0), computed in float64 and rounded once to float32; |x| below float32's
    smallest normal (the threshold there is astronomically larger than |x|) gives 0."""
    a = x.abs().to(torch.float64)
    normal = a >= _EPS
    thr = pow_det(torch.where(normal, a, 1.0), p - 1.0) / beta
    v = a - thr
    keep = normal & (v > 0)
    return torch.where(keep, v.to(torch.float32) * torch.sign(x), torch.zeros_like(x))


# Sums over a group run in LANES interleaved partial sums (element j into lane j % LANES, each
# in element order), combined as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)); a group whose size is not
# a multiple of LANES is summed in element order. The C++ kernel sums in the same order.
LANES = 8


def _sum64(t: torch.Tensor) -> torch.Tensor:
    """float64 sum over the last dimension of t in the fixed order above."""
    t = t.to(torch.float64)
    n = t.shape[-1]
    if n % LANES:
        acc = t[..., 0].clone()
        for j in range(1, n):
            acc += t[..., j]
        return acc
    v = t.reshape(*t.shape[:-1], n // LANES, LANES)
    a = v[..., 0, :].clone()
    for i in range(1, n // LANES):
        a += v[..., i, :]
    return ((a[..., 0] + a[..., 1]) + (a[..., 2] + a[..., 3])) + ((a[..., 4] + a[..., 5]) + (a[..., 6] + a[..., 7]))


def _evaluate(g, inv, s, z, qmax, a=None):
    """Codes, float32 residual and float64 squared error (weighted by float64 a[G, gs] when
    given: sum (x^2) a) of groups g[R, G, gs] at zero z."""
    q = torch.mul(g, inv.unsqueeze(-1)).add_(z.unsqueeze(-1)).round_().clamp_(0, qmax)
    x = g - s.unsqueeze(-1) * (q - z.unsqueeze(-1))
    sq = x.to(torch.float64).square()
    return q, x, _sum64(sq if a is None else sq * a)


def init_qparams(g: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The start of the iteration: (s, z0) float32 [R, G] from the minmax range of g[R, G, gs]."""
    qmax = float((1 << bits) - 1)
    min_neg = torch.clamp(g.amin(-1), max=0.0)
    max_pos = torch.clamp(g.amax(-1), min=0.0)
    s = torch.clamp((max_pos - min_neg) / qmax, min=_EPS)
    return s, 0.0 - min_neg / s


def hqq_qparams_torch(g: torch.Tensor, bits: int, *, importance: Optional[torch.Tensor] = None, iters: int = ITERS,
                      p: float = P_NORM, beta: float = BETA, kappa: float = KAPPA,
                      early_stop: bool = True, scale_dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """The torch reference: (scale, float zero) float32 [R, G] of finite float32 groups
    g[R, G, gs] (see the module docstring). early_stop=False runs all `iters` updates and
    returns the last zero (what the step-by-step test follows). scale_dtype float16/bfloat16: the
    scale is rounded to it (at least its smallest positive value) before the zero is optimised.

    importance: optional positive float32 [G, gs] (per input channel, e.g. mean squared
    activations): the error becomes sum a x^2 and the zero update the a-weighted mean
    sum(a t) / sum(a) (both sums in `_sum64` order, products (x^2) a and t a in float64)."""
    qmax = float((1 << bits) - 1)
    n = g.shape[-1]
    a = None if importance is None else importance.to(torch.float64).reshape(g.shape[-2:])
    den = None if a is None else _sum64(a)
    s, z = init_qparams(g, bits)
    if scale_dtype != torch.float32:
        s = torch.clamp(round_to_dtype(s, scale_dtype), min=smallest_scale(scale_dtype))
        z = 0.0 - torch.clamp(g.amin(-1), max=0.0) / s
    inv = 1.0 / s
    q, x, err = _evaluate(g, inv, s, z, qmax, a)
    best_err, best_z = err, z.clone()
    active = torch.ones_like(err, dtype=torch.bool)
    b = float(beta)
    for _ in range(iters):
        we = shrink_lp(x, b, p)
        t = q - (g - we) * inv.unsqueeze(-1)
        z_new = (_sum64(t) / n if a is None else _sum64(t.to(torch.float64) * a) / den).to(torch.float32)
        b *= kappa
        q_new, x_new, err_new = _evaluate(g, inv, s, z_new, qmax, a)
        if not early_stop:
            z, q, x = z_new, q_new, x_new
            continue
        improved = active & (err_new < best_err)
        best_err = torch.where(improved, err_new, best_err)
        best_z = torch.where(improved, z_new, best_z)
        active = improved
        if not bool(active.any()):
            break
        z = torch.where(active, z_new, z)
        q = torch.where(active.unsqueeze(-1), q_new, q)
        x = torch.where(active.unsqueeze(-1), x_new, x)
    return s, (best_z if early_stop else z)


def hqq_qparams(g: torch.Tensor, bits: int, importance: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) per group of finite float32 g[R, G, gs] (importance: optional positive
    float32 [G, gs]), through the compiled kernel (cpp/quant/hqq_quant.h, same bits) when it
    is loaded, else hqq_qparams_torch."""

    if g.device.type == "cpu" and _native.hqq_available():
        rows, groups, gs = g.shape
        return _native.hqq_qparams(g.reshape(rows, groups * gs), gs, bits,
                                   importance=None if importance is None else importance.reshape(-1))
    return hqq_qparams_torch(g, bits, importance=importance)
