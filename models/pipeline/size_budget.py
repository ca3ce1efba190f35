"""--budget_bits_per_weight: choose, per quantized matrix, the integer format that keeps the total
weight error smallest while everything the recipe quantizes fits the budget
(llmq.quant.budget: measure, choose, write as a recipe).

Which matrices: those the run's recipe (--recipe, or the model's default) quantizes and that
arrive as float tensors (a GGUF's quantized blocks are kept as they are and not counted). The
candidates: the backend's `budget_options` (`llmq.quant.budget.DEFAULT_OPTIONS`: 3, 4, 5, 6, 8 bits,
groups of 32 and 4-bit groups of 128, asymmetric; --backend=gguf: its block types q2_k .. q8_0) with
--budget_method; a matrix takes only the candidates its shape allows (a K-quant needs rows of a multiple
of 256: the others choose among the blocks of 32, one line says how many); a matrix no candidate holds is
refused in one line; bits are counted as the run's backend writes them
(its `storage` declaration: an MLX folder's 16-bit scale and bias per group, the bundle's float32
pair), and each candidate is quantized with the scale dtype it writes. With --calibration_text the errors are weighted
by each layer's importance. Each option's error is relative to its matrix's (weighted) energy, about
the layer's relative output error: on Gemma 3 270M at 4.5 bits per weight this objective beat the
absolute error sum (docs/quality.md). One pass over the input measures every option (only the
numbers are kept); the quantizing pass then reads the input again. A matrix of more than
`SAMPLE_WEIGHTS` (1 Mi) elements is measured on an evenly spaced sample of its rows, every column kept
(llmq.quant.budget.sample_rows: its error estimated from theirs, its bits exact), so the pass costs at
most that much per matrix and candidate whatever the model's size.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from llmq.quant import QuantRecipe
from llmq.quant.budget import (
    DEFAULT_OPTIONS,
    SAMPLE_WEIGHTS,
    Option,
    budget_recipe,
    choose,
    measure_options,
    shape_problem,
    summarize,
)
from llmq.quant.importance import Calibration
from llmq.quant.storage import CANONICAL, Storage
from models.pipeline.arch import quantizable_module
from models.pipeline.usage_error import UsageError

RECIPE_FILE = "budget_recipe.json"


@dataclasses.dataclass
class BudgetChoice:
    recipe: QuantRecipe
    bits_per_weight: float  # achieved, over the matrices counted
    matrices: int
    counts: Dict[str, int]  # config description -> how many matrices took it


def candidates(method: str, options: Sequence[Any] = DEFAULT_OPTIONS):
    return tuple(dataclasses.replace(c, method=method) for c in options)


def choose_recipe(stream: Callable, base: QuantRecipe, num_layers: int, budget_bits_per_weight: float, method: str,
                  calibration: Optional[Calibration] = None,
                  storage: Callable[[Any], Storage] = lambda config: CANONICAL,
                  options: Sequence[Any] = DEFAULT_OPTIONS,
                  sample_weights: Optional[int] = SAMPLE_WEIGHTS) -> BudgetChoice:
    bound = base.bind(num_layers)
    configs = candidates(method, options)
    narrowed: Dict[str, List[str]] = {}  # "what it cannot take" -> the matrices a candidate's shape check left out
    options: Dict[str, List[Option]] = {}
    numel: Dict[str, int] = {}
    modules: Dict[str, str] = {}
    for fqn, value in stream():
        module = quantizable_module(fqn)
        if module is None or not isinstance(value, torch.Tensor) or bound.get_config(module) is None:
            continue
        importance = calibration.importance_of(module) if calibration is not None else None
        hessian = calibration.hessian_of(module) if calibration is not None and method == "gptq" else None
        if method == "gptq" and hessian is None:  # no H for this matrix: its options are measured by search
            configs_here = candidates("search")
        else:
            configs_here = configs
        try:
            options[fqn] = measure_options(fqn, value, configs_here, importance=importance, relative=True,
                                           storage=storage, hessian=hessian, sample_weights=sample_weights)
        except ValueError as e:
            raise UsageError(f"--budget_bits_per_weight: {e}") from None
        numel[fqn] = value.numel()
        modules[fqn] = module
        left_out = sorted({c.format for c in configs if shape_problem(c, tuple(value.shape)) is not None})
        if left_out:
            narrowed.setdefault(", ".join(left_out), []).append(f"{fqn} {list(value.shape)}")
    for formats, names in narrowed.items():
        print(f"budget: {len(names)} matrices cannot take {formats} (their rows, e.g. {names[0]}, are not whole "
              f"blocks of them): they choose among the other candidates", flush=True)
    if not options:
        raise UsageError("--budget_bits_per_weight: the recipe quantizes no float matrix of this checkpoint; "
                         "nothing to choose formats for")
    try:
        choice = choose(options, numel, budget_bits_per_weight)
    except ValueError as e:
        raise UsageError(f"--budget_bits_per_weight: {e}") from None
    chosen = [(modules[n], options[n][i].config) for n, i in choice.items()]
    counts: Dict[str, int] = {}
    for _, config in chosen:
        counts[config.describe()] = counts.get(config.describe(), 0) + 1
    return BudgetChoice(budget_recipe(chosen), summarize(options, numel, choice)["bits_per_weight"], len(chosen),
                        counts)
