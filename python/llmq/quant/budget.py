"""Mixed precision under a size budget: each weight gets the option (a QuantConfig) that keeps
the total weight error smallest while the quantized matrices fit in `budget_bits_per_weight`.

How it works:
1. `measure_options` quantizes one weight with every candidate config, its scale dtype the one
   the backend writes (`storage`: config -> llmq.quant.storage.Storage, the backend's declaration;
   default the llmq bundle's), and records, per option, the bits the backend writes for it (codes,
   scales, biases or zero points as it stores them: `Storage.bits`) and its squared weight
   error, optionally weighted per input channel by an importance vector (the imatrix idea:
   the mean squared activation of each input column, so an error on a busy column costs more).
   Only these numbers are kept: the stream is read once and no quantized weight is held.
   A matrix of more than `sample_weights` elements (SAMPLE_WEIGHTS where the pipeline asks) is
   measured on an evenly spaced sample of its rows (`sample_rows`), every column kept: the formats'
   groups run along a row (`Format.rows_independent`), so those rows' codes and errors are exactly
   what quantizing the whole matrix gives them, and the error of the whole is estimated as the
   sample's times rows / sampled rows; the bits are the whole matrix's, exact. This keeps the
   pass's cost per matrix bounded (a 21504 x 5376 down_proj has 116 M weights; its sample 1 M).
2. `choose` solves the multiple-choice knapsack by its Lagrangian relaxation: for a price
   `lam` per bit every weight independently takes the option minimising error + lam * bits;
   bisection finds the cheapest price whose choice fits the budget, then the bits still free
   go, greedily, to the upgrades with the best error saved per extra bit.
3. `budget_recipe` writes the choice as an ordinary recipe: one exact rule per weight, in the
   order the weights were measured, readable and editable (docs/formats.md, "Recipes").
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from llmq.quant.formats import format_of, get_format
from llmq.quant.quantize import dequantize, quantize_weight, takes_importance
from llmq.quant.recipe import QuantConfig, QuantRecipe, QuantRule
from llmq.quant.storage import CANONICAL, Storage, element_bits

# Integer group-wise options every backend takes (MLX: bits 3..8, groups 32..128).
DEFAULT_OPTIONS: Tuple[QuantConfig, ...] = (
    QuantConfig(bits=3, group_size=32, symmetric=False),
    QuantConfig(bits=4, group_size=128, symmetric=False),
    QuantConfig(bits=4, group_size=32, symmetric=False),
    QuantConfig(bits=5, group_size=32, symmetric=False),
    QuantConfig(bits=6, group_size=32, symmetric=False),
    QuantConfig(bits=8, group_size=32, symmetric=False),
)


# What the pipeline measures a matrix on at most (elements): its rows are sampled above this.
SAMPLE_WEIGHTS = 1 << 20


@dataclasses.dataclass(frozen=True)
class Option:
    """One way to store one weight: its config, the bits it takes and the error it leaves."""

    config: QuantConfig
    bits: int
    error: float


def weight_error(w: torch.Tensor, approx: torch.Tensor, importance: Optional[torch.Tensor] = None) -> float:
    """sum((w - approx)^2 * importance[column]) in float64 (importance: one weight per input column)."""
    diff = (w.double() - approx.double()).pow(2)
    if importance is not None:
        diff = diff * importance.double().reshape((1,) * (diff.dim() - 1) + (-1,))
    return float(diff.sum())


def output_error(w: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr((W - W') H (W - W')^T) in float64: with H the mean of x x^T over a layer's calibration
    inputs, the mean squared output error of the layer over them (correlations included, where
    `weight_error` with importance = diag(H) counts each input column alone)."""
    d = w.detach().double().reshape(-1, w.shape[-1]) - approx.detach().double().reshape(-1, w.shape[-1])
    return float(((d @ hessian.double()) * d).sum())


def sample_rows(w: torch.Tensor, max_weights: int) -> torch.Tensor:
    """The rows [n, K] of `w` (any leading dimensions flattened) that the budget measures it on: all
    of them when they hold at most `max_weights` elements, else n = max(1, max_weights // K) rows
    evenly spaced over all R (row (2i + 1) * R // (2n) for i < n: deterministic, every part of the
    matrix, every expert of a stack, is represented)."""
    k = w.shape[-1]
    rows = w.reshape(-1, k)
    total = rows.shape[0]
    n = max(1, max_weights // max(k, 1))
    if n >= total:
        return rows
    return rows[(torch.arange(n) * 2 + 1) * total // (2 * n)]


def measure_options(name: str, w: torch.Tensor, configs: Sequence[QuantConfig] = DEFAULT_OPTIONS,
                    importance: Optional[torch.Tensor] = None, relative: bool = False,
                    storage: Callable[[QuantConfig], Storage] = lambda config: CANONICAL,
                    hessian: Optional[torch.Tensor] = None, sample_weights: Optional[int] = None) -> List[Option]:
    """Every config that can hold `w` (its format's `shape_problem` is None: e.g. the group size divides K, a
    GGUF K-quant's 256 divides K), with the bits `storage` writes
    for it and its error; each config takes the scale dtype its storage writes.

    relative: the error divided by the (equally weighted) energy of `w`, sum(a_j w_ij^2): with
    importances, about the layer's relative output error ||dW x||^2 / ||W x||^2, which does not
    change when a row of `w` and the next layer's matching column trade a factor.

    hessian: the layer's input second moment H [K, K] (Calibration.hessians): configs of method
    "gptq" round against it, and every option's error is the output error `output_error` (energy:
    tr(W H W^T)) instead of the importance-weighted weight error.

    sample_weights: measure a larger matrix on `sample_rows(w, sample_weights)` (configs whose format
    quantizes rows independently; the others see every row): its error is the sample's times
    rows / sampled rows, an estimate of the whole matrix's (exact for the sampled rows), its bits the
    whole matrix's. None: every row."""
    if importance is not None and importance.shape != (w.shape[-1],):
        raise ValueError(f"{name}: importance has shape {list(importance.shape)}, expected [{w.shape[-1]}] "
                         "(one value per input column)")
    shape = tuple(w.shape)
    sampled = sample_weights is not None and w.dim() >= 2 and w.numel() > sample_weights
    sample = sample_rows(w, sample_weights) if sampled and sample_weights is not None else w
    scale = math.prod(shape[:-1]) / sample.shape[0]  # rows / sampled rows
    options, parts = [], []
    for config in configs:
        if shape_problem(config, shape) is not None:
            continue
        # method "hqq" minimises the importance-weighted error itself; the others only get measured by it
        stored = storage(config)
        if config.format == "int":
            config = dataclasses.replace(config, scale_dtype=stored.scale_dtype)
        part = sample if get_format(config.format).rows_independent else w
        if config.method == "gptq":
            q = quantize_weight(part, config, name=name, hessian=hessian)
        else:
            q = quantize_weight(part, config, name=name, importance=importance if takes_importance(config) else None)
        approx = dequantize(q, torch.float32)
        error = weight_error(part, approx, importance) if hessian is None else output_error(part, approx, hessian)
        options.append(Option(config, _bits(stored, shape, q), error * (scale if part is not w else 1.0)))
        parts.append(part)
    if not options:
        raise ValueError(f"{name}: none of the candidate formats holds its shape {list(w.shape)}: "
                         + "; ".join(sorted({shape_problem(c, tuple(w.shape)) or "" for c in configs})))
    if not relative:
        return options
    energies: Dict[int, float] = {}  # of the rows each option was measured on, scaled alike

    def energy_of(x: torch.Tensor) -> float:
        if id(x) not in energies:
            zero = torch.zeros_like(x, dtype=torch.float32)
            e = weight_error(x, zero, importance) if hessian is None else output_error(x, zero, hessian)
            energies[id(x)] = e * (scale if x is not w else 1.0)
        return energies[id(x)]

    # an all-zero weight is exact in every option: its errors stay 0
    return [dataclasses.replace(o, error=o.error / energy_of(x)) if energy_of(x) > 0 else o
            for o, x in zip(options, parts)]


def _bits(stored: Storage, shape: Tuple[int, ...], q) -> int:
    """The bits `stored` writes for a weight of `shape` quantized as `q` (q: the whole weight, or a
    sample of its rows in the same config: the canonical container's tensors then come from its
    format's layout for the whole shape)."""
    fmt = format_of(q)
    if stored.tensors is not None or fmt is None or tuple(fmt.shape_of(q)) == tuple(shape):
        return stored.bits(shape, q)
    layout = fmt.layout(fmt.name_of(q), fmt.params(q), tuple(shape))
    return sum(element_bits(d) * math.prod(s) for d, s in layout.values())


def shape_problem(config: QuantConfig, shape: Tuple[int, ...]) -> Optional[str]:
    """Why `config` cannot quantize a weight of `shape` (its format's `shape_problem`), or None."""
    return get_format(config.format).shape_problem(config, shape)


def _pick(options: List[Option], lam: float) -> int:
    return min(range(len(options)), key=lambda i: (options[i].error + lam * options[i].bits, options[i].bits))


def choose(options: Dict[str, List[Option]], numel: Dict[str, int], budget_bits_per_weight: float) -> Dict[str, int]:
    """The index of the chosen option of every weight: the smallest total error whose bits
    fit budget_bits_per_weight * (total elements). ValueError if even the smallest options do not."""
    budget = budget_bits_per_weight * sum(numel[n] for n in options)
    smallest = {n: min(range(len(o)), key=lambda i: (o[i].bits, o[i].error)) for n, o in options.items()}
    least = sum(options[n][i].bits for n, i in smallest.items())
    if least > budget:
        total = sum(numel[n] for n in options)
        raise ValueError(f"budget {budget_bits_per_weight} bits per weight is below the smallest candidate "
                         f"assignment ({least / total:.3f} bits per weight); add smaller options or raise the budget")

    def total_bits(choice: Dict[str, int]) -> int:
        return sum(options[n][i].bits for n, i in choice.items())

    lo, hi = 0.0, 1.0
    while total_bits({n: _pick(o, hi) for n, o in options.items()}) > budget:
        hi *= 4
        if hi > 1e30:
            break
    for _ in range(100):  # bisection on the price of a bit
        mid = (lo + hi) / 2
        if total_bits({n: _pick(o, mid) for n, o in options.items()}) > budget:
            lo = mid
        else:
            hi = mid
    choice = {n: _pick(o, hi) for n, o in options.items()}
    if total_bits(choice) > budget:
        choice = smallest
    # Spend what is left on the upgrades that save the most error per extra bit.
    free = budget - total_bits(choice)
    while True:
        best = None
        for n, o in options.items():
            cur = o[choice[n]]
            for i, opt in enumerate(o):
                extra = opt.bits - cur.bits
                saved = cur.error - opt.error
                if 0 < extra <= free and saved > 0 and (best is None or saved / extra > best[0]):
                    best = (saved / extra, n, i, extra)
        if best is None:
            return choice
        _, n, i, extra = best
        choice[n] = i
        free -= extra


def budget_recipe(chosen: Iterable[Tuple[str, QuantConfig]]) -> QuantRecipe:
    """An ordinary recipe with one exact rule per (module, config), in the given order."""
    return QuantRecipe([QuantRule(re.escape(module), config) for module, config in chosen])


def summarize(options: Dict[str, List[Option]], numel: Dict[str, int], choice: Dict[str, int]) -> Dict[str, float]:
    """Bits per weight and total error of a choice (for the run's table)."""
    bits = sum(options[n][i].bits for n, i in choice.items())
    total = sum(numel[n] for n in choice)
    return {"bits_per_weight": bits / max(total, 1), "error": sum(options[n][i].error for n, i in choice.items()),
            "weights": float(total)}
