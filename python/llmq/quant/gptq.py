"""Method "gptq": error-compensating rounding of an integer weight against its layer's inputs.

GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", Algorithm 1) rounds the columns of W [N, K] one at a time and moves each column's
rounding error onto the columns not yet rounded, so that the layer's output error on the
calibration inputs, ||X (W - W')^T||^2 = tr((W - W') H (W - W')^T) with H = X^T X, stays small
rather than each weight's own error. What llmq computes, for H = the mean of x x^T over the
calibration tokens (llmq.quant.importance.Calibration.hessians):

1. Dampening and dead columns: a column whose inputs are all zero (H[i, i] == 0) is cut off from
   the rest (its row and column of H zeroed, H[i, i] = 1): no error flows into or out of it and it
   is rounded to nearest with its group's scale (its weight is kept, not zeroed: a text the
   calibration never saw may excite it). Then H += damp * mean(diag H) * I (option "damp",
   default 0.01). If the Cholesky factorisation still fails (H not positive definite in float64),
   the dampening is raised tenfold, up to three times, then the weight is refused naming it.
2. U = the upper Cholesky factor of H^-1 (float64, then the compute dtype). For column i, in
   processing order: q_i = the nearest code of w_i with its group's (scale, bias), err_i = (w_i -
   dequant(q_i)) / U[i, i], and every later column j gets w_j -= err_i * U[i, j].
3. Lazy blocks (option "block_size", default 128): inside a block of columns the update is applied
   column by column; the later columns get the block's updates at its end in one matrix product
   (Err_block @ U[block, later]); the same arithmetic, reordered.
4. Groups: the (scale, bias) of a group of `group_size` columns (its original columns, always:
   the canonical form stores groups of consecutive input columns) is fitted when the first of its
   columns is about to be rounded, from the group's current (already updated) values, by the
   method of option "fit" ("search", the default, or "minmax"; llmq.quant.search and the minmax
   rule, with the scale dtype of the config: 16-bit scales are chosen in 16 bits, as every
   method does, llmq.quant.scale_rounding). With "search" the group's error is weighted by
   diag(H) (the importance of its columns). Columns of the group outside the current block get
   the block's pending updates first, so the fit sees exactly what the unblocked algorithm sees.
5. Activation order (option "act_order", default false): columns are processed in decreasing
   order of H[i, i]. The groups stay the original consecutive groups; a group's scale is fitted
   when the first of its columns in that order comes up, from all its columns' current values
   (GPTQ's "static groups" would fit every group on the original weights instead).
6. GGUF block types (formats q4_0 .. q8_0, q2_k .. q6_k; llmq.quant.formats.gguf_fit): the unit
   fitted at once is a block (32 columns) or a K-quant super-block (256 columns: its sub-block
   scales share one float16 d, and dmin), not a group. When the first of its columns comes up, its
   stored parameters are fitted from its current values by gguf_fit.fit (option "fit": "search",
   importance-weighted by diag(H) as for "int", or "minmax"), and each of its columns is then
   rounded with them by gguf_fit.round_columns: every scale, bias and code is one the block type
   stores, so the GGUF backend writes the result as it is (gguf_quant.encode_blocks).

The result is an ordinary GroupQuantizedWeight (codes, float32 scale and bias per group in the
canonical form), so every backend takes it; `dequantize` gives scale*q + bias as for any method.
The arithmetic runs in float32 (compute dtype; float64 for the reference tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import torch

import llmq.quant.search as search
from llmq.quant.codecs import (
    check_finite,
    check_weight,
    pack_bits,
    qparams_asymmetric,
    qparams_symmetric,
    round_to_dtype,
    smallest_scale,
)
from llmq.quant.gptq_options import FITS, OPTIONS, check_options  # noqa: F401 (re-exported)

# Dampening is raised tenfold at most this many times when H is not positive definite.
DAMP_RETRIES = 3


def inverse_cholesky(hessian: torch.Tensor, damp: float, name: str = "<tensor>"):
    """(U, dead): U float64 [K, K] the upper Cholesky factor of (H')^-1, where H' is `hessian`
    with its dead columns (H[i, i] <= 0) cut off and dampened (module docstring, step 1);
    dead a bool [K]."""
    h = hessian.detach().to(device="cpu", dtype=torch.float64)
    h = (h + h.T) * 0.5
    diag = h.diagonal()
    dead = ~(diag > 0)
    h[dead, :] = 0.0
    h[:, dead] = 0.0
    h.diagonal()[dead] = 1.0
    live = diag[~dead]
    mean = float(live.mean()) if live.numel() else 1.0
    eye = torch.eye(h.shape[0], dtype=torch.float64)
    factor = damp
    for _ in range(DAMP_RETRIES + 1):
        lower, info = torch.linalg.cholesky_ex(h + (factor * mean) * eye)
        if int(info) == 0:
            break
        factor = max(factor, 1e-6) * 10.0
    else:
        raise ValueError(f"{name}: the inputs' second moment H is not positive definite even with dampening "
                         f"{factor / 10:g} x mean(diag H); raise option 'damp'")
    hinv = torch.cholesky_inverse(lower)
    upper, info = torch.linalg.cholesky_ex(hinv, upper=True)
    if int(info):
        raise ValueError(f"{name}: H^-1 is not positive definite in float64 (H is too ill-conditioned); raise option 'damp'")
    return upper, dead


# Candidates of a group fit evaluated together: at most this many elements per float64 temporary.
_FIT_ELEMENTS = 1 << 22


def _fit(values: torch.Tensor, config, fit: str, importance: Optional[torch.Tensor], name: str):
    """(scale, bias) float32 [N] of one group, values float32 [N, gs], by `fit` (module docstring,
    step 4): the candidates of llmq.quant.search ("search") or the minmax pair, each rounded to the
    config's scale dtype as llmq.quant.scale_rounding rounds them, codes re-chosen against the
    rounded pair; the least (importance-weighted) squared error of the dequantized group wins, the
    first candidate on ties. All candidates are evaluated in one batch."""
    bits, symmetric, dtype = config.bits, config.symmetric, config.scale_dtype
    xmin, xmax = values.amin(-1), values.amax(-1)
    half = float(1 << (bits - 1))
    if fit == "search":
        pairs = list(search.candidates(xmin, xmax, bits, symmetric))
    elif symmetric:
        pairs = [(qparams_symmetric(xmin, xmax, bits), None)]
    else:
        pairs = [qparams_asymmetric(xmin, xmax, bits, name)]
    scales = torch.stack([p[0] for p in pairs])
    scales = torch.clamp(round_to_dtype(scales, dtype), min=smallest_scale(dtype))
    if symmetric:
        biases = scales * -half
    else:
        biases = round_to_dtype(torch.stack([0.0 - z * sc for sc, z in pairs]), dtype)
    if not (bool(torch.isfinite(scales).all()) and bool(torch.isfinite(biases).all())):
        raise ValueError(f"{name}: a group's scale or bias overflows {dtype}; quantize it with scale_dtype float32")
    qmax = float((1 << bits) - 1)
    g64 = values.to(torch.float64).unsqueeze(0)
    imp = None if importance is None else importance.to(torch.float64)
    step = max(1, _FIT_ELEMENTS // max(1, values.numel()))
    errors = []
    for c0 in range(0, scales.shape[0], step):
        s64 = scales[c0:c0 + step].to(torch.float64).unsqueeze(-1)
        b64 = biases[c0:c0 + step].to(torch.float64).unsqueeze(-1)
        q = (g64 - b64).div_(s64).round_().clamp_(0.0, qmax)
        sq = q.mul_(s64).add_(b64).to(torch.float32).to(torch.float64).sub_(g64).square_()
        errors.append((sq if imp is None else sq.mul_(imp)).sum(-1))
    best = torch.cat(errors).argmin(0, keepdim=True)  # the first least error per row
    return scales.gather(0, best)[0], biases.gather(0, best)[0]


def _check_hessian(hessian, k: int, name: str) -> torch.Tensor:
    if not isinstance(hessian, torch.Tensor) or tuple(hessian.shape) != (k, k):
        got = list(hessian.shape) if isinstance(hessian, torch.Tensor) else type(hessian).__name__
        raise ValueError(f"{name}: method 'gptq' needs the layer's input second moment H of shape [{k}, {k}], got {got}")
    if not bool(torch.isfinite(hessian).all()):
        raise ValueError(f"{name}: the layer's input second moment H holds NaN/Inf")
    return hessian


@dataclasses.dataclass(frozen=True)
class _Grid:
    """What a format stores for a run of columns, as the column loop needs it: the parameters of `unit`
    consecutive columns are fitted together (`fit`: current values float32 [N, unit] and their columns'
    importance [unit] -> scale, bias [N, unit / group]), `group` columns share one (scale, bias), and
    `round` gives one column's codes and dequantized values (column [N], its unit's scale and bias
    [N, unit / group], its offset in the unit)."""

    unit: int
    group: int
    bits: int
    fit: Callable[[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]
    round: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], Tuple[torch.Tensor, torch.Tensor]]


def _int_grid(w: torch.Tensor, config, fit: str, name: str) -> _Grid:
    """Format "int": a unit is a group, fitted by `_fit` (module docstring, step 4)."""
    from llmq.quant.formats.int_affine import _check_weight

    gs = _check_weight(w, config.bits, config.group_size, name)
    qmax = float((1 << config.bits) - 1)

    def fit_unit(values, importance):
        s, b = _fit(values, config, fit, importance, name)
        return s.unsqueeze(1), b.unsqueeze(1)

    def round_column(col, scale, bias, offset):
        s, b = scale[:, 0].to(col.dtype), bias[:, 0].to(col.dtype)
        q = ((col - b) / s).round_().clamp_(0.0, qmax)
        return q, q * s + b

    return _Grid(gs, gs, config.bits, fit_unit, round_column)


def _gguf_grid(w: torch.Tensor, config, fit: str, name: str) -> _Grid:
    """A GGUF block type: a unit is a block (a K-quant's super-block), fitted by gguf_fit.fit and rounded by
    gguf_fit.round_columns (module docstring, step 6)."""
    from llmq.quant.formats.gguf_fit import BLOCK_TYPES, fit as fit_block, round_columns

    kind = config.format
    t = BLOCK_TYPES[kind]
    check_weight(w, name)
    if w.shape[-1] % t.block:
        raise ValueError(f"{name}: {kind} ({t.ggml}) needs rows of a multiple of {t.block} elements, got K={w.shape[-1]}")

    def fit_unit(values, importance):
        return fit_block(kind, values, method=fit, importance=importance, name=name)

    def round_column(col, scale, bias, offset):
        q, deq = round_columns(kind, col.unsqueeze(1), scale, bias, offset)
        return q[:, 0], deq[:, 0].to(col.dtype)

    return _Grid(t.block, t.group, t.bits, fit_unit, round_column)


def grid_of(w: torch.Tensor, config, fit: str, name: str = "<tensor>") -> _Grid:
    """The column loop's view of `config`'s format ("int" or a GGUF block type); ValueError (one line)
    for a format gptq cannot round to."""
    from llmq.quant.formats.gguf_fit import BLOCK_TYPES

    if config.format == "int":
        return _int_grid(w, config, fit, name)
    if config.format in BLOCK_TYPES:
        return _gguf_grid(w, config, fit, name)
    raise ValueError(f"{name}: method 'gptq' rounds to the integer formats ('int' and the GGUF block types "
                     f"{', '.join(BLOCK_TYPES)}), not {config.format!r}")


def gptq_quantize(w: torch.Tensor, config, hessian: torch.Tensor, *, name: str = "<tensor>",
                  compute_dtype: torch.dtype = torch.float32):
    """The GroupQuantizedWeight of a 2-D float weight w [N, K] for an "int" or GGUF block type `config`
    with method "gptq" (its options: config.options), rounded against H = `hessian` [K, K] (the mean of
    x x^T over the layer's calibration inputs); see the module docstring."""
    from llmq.quant.formats.int_affine import GroupQuantizedWeight

    check_weight(w, name)
    if w.dim() != 2:
        raise ValueError(f"{name}: method 'gptq' rounds 2-D [out, in] weights; got shape {list(w.shape)}")
    check_finite(w, name)
    n, k = w.shape
    opts = check_options(dict(config.options or ()))
    grid = grid_of(w, config, opts["fit"], name)
    _check_hessian(hessian, k, name)
    diag = hessian.detach().to(device="cpu", dtype=torch.float64).diagonal()
    dead = ~(diag > 0)
    live = diag[~dead]
    floor = 1e-6 * (float(live.mean()) if live.numel() else 1.0)
    importance = diag.clamp_min(floor).to(torch.float32)  # for the search fit: positive everywhere
    if opts["act_order"]:
        perm = torch.argsort(diag.masked_fill(dead, -1.0), descending=True, stable=True)
        upper, _ = inverse_cholesky(hessian.detach()[perm][:, perm], opts["damp"], name)
    else:
        perm = torch.arange(k)
        upper, _ = inverse_cholesky(hessian, opts["damp"], name)
    inv_perm = torch.argsort(perm)
    dt = compute_dtype
    u = upper.to(dt)
    weight = w.detach().to(device="cpu", dtype=dt)[:, perm].clone()
    codes = torch.empty(n, k, dtype=torch.uint8)
    unit, per = grid.unit, grid.unit // grid.group
    scale = torch.zeros(n, k // grid.group, dtype=torch.float32)
    bias = torch.zeros(n, k // grid.group, dtype=torch.float32)
    fitted = [False] * (k // unit)
    column = perm.tolist()
    block = opts["block_size"]
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        w1 = weight[:, b0:b1].clone()
        err1 = torch.zeros(n, b1 - b0, dtype=dt)
        u1 = u[b0:b1, b0:b1]
        for j in range(b1 - b0):
            c = column[b0 + j]
            g = c // unit
            if not fitted[g]:
                pos = inv_perm[g * unit:(g + 1) * unit]  # the unit's columns in processing order
                current = torch.empty(n, unit, dtype=dt)
                inside = pos < b1
                if bool(inside.any()):
                    current[:, inside] = w1[:, pos[inside] - b0]
                if not bool(inside.all()):
                    out = pos[~inside]
                    current[:, ~inside] = weight[:, out] - err1[:, :j] @ u[b0:b0 + j, out]
                s, bb = grid.fit(current.to(torch.float32), importance[g * unit:(g + 1) * unit])
                scale[:, g * per:(g + 1) * per], bias[:, g * per:(g + 1) * per] = s, bb
                fitted[g] = True
            col = w1[:, j]
            q, approx = grid.round(col, scale[:, g * per:(g + 1) * per], bias[:, g * per:(g + 1) * per], c - g * unit)
            codes[:, b0 + j] = q.to(torch.uint8)
            e = (col - approx) / u1[j, j]
            if j + 1 < b1 - b0:
                w1[:, j + 1:].addr_(e, u1[j, j + 1:], alpha=-1.0)
            err1[:, j] = e
        if b1 < k:
            weight[:, b1:].addmm_(err1, u[b0:b1, b1:], alpha=-1.0)
    codes = codes[:, inv_perm].contiguous()
    return GroupQuantizedWeight(qdata=pack_bits(codes, grid.bits), scale=scale, bias=bias, bits=grid.bits,
                                group_size=grid.group, shape=(n, k), dtype=w.dtype)


def without_hessian(config):
    """The config a gptq rule falls back to for a weight with no H: the same format rounded by its
    group fit alone (option "fit": method "search" or "minmax")."""
    fit = check_options(dict(config.options or ()))["fit"]
    return dataclasses.replace(config, method=fit, options=None)

