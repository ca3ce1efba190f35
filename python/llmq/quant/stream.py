"""quantize_stream: quantize a lazy stream of (name, tensor) pairs one item at a time, so a
checkpoint far larger than memory can flow from a reader to a writer."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional, Tuple, Union

import torch

import llmq.quant.gptq as gptq
from llmq.quant.formats import GroupQuantizedWeight
from llmq.quant.importance import Calibration
from llmq.quant.quantize import quantize_weight, takes_importance
from llmq.quant.recipe import QuantRecipe
from llmq.quant.report import ErrorReport
from llmq.quant.row_blocks import RowBlocks, quantize_row_blocks

StreamItem = Tuple[str, Union[torch.Tensor, GroupQuantizedWeight]]


def quantize_stream(items: Iterable[StreamItem], recipe: QuantRecipe, *, weight_suffix: str = ".weight",
                    num_layers: Optional[int] = None,
                    module_of: Optional[Callable[[str], Optional[str]]] = None,
                    calibration: Optional[Calibration] = None,
                    report: Optional[ErrorReport] = None,
                    without_hessian: Optional[list] = None) -> Iterator[StreamItem]:
    """Yield (fqn, quantized weight in the config's format) for each `<module><weight_suffix>`
    tensor whose module the recipe maps to a config, and every other item unchanged. Pulls one item from `items`
    per item yielded. `num_layers` binds recipes that count layers from the end.

    module_of: name -> the module fqn the recipe sees, or None for "never quantize"; replaces
    the suffix rule for models whose weights are not all `<module>.weight` (e.g. fused MoE
    experts stored as `...experts.gate_up_proj` [E, 2F, D]).

    calibration: per-module statistics from a calibration text (llmq.quant.importance); a
    config that takes importance weights (method "hqq") gets its module's, and the report
    gets its input rows (the layer's output error). Modules it has none for quantize without.
    A config of method "gptq" gets its module's H (Calibration.hessians); a module with none
    (no calibration, or a weight no nn.Linear computes with, such as stacked experts) is rounded
    by the rule's group fit alone (its option "fit", "search" by default) and listed in
    `without_hessian` when a list is given.
    report: every quantized tensor's error figures are added to it as it passes (the
    original is dropped right after, as without a report).

    A tensor that arrives as row blocks (llmq.quant.row_blocks.RowBlocks, from
    ``iter_checkpoint(..., chunk_bytes=)``) and is quantized leaves as a QuantizedRowBlocks,
    quantized block by block while the writer reads it (same bytes), when its format can
    (``Format.row_quantizer``) and neither importance weights nor a report need the whole
    weight; otherwise it is read whole first. One that is not quantized passes through as it came.
    """
    if not isinstance(recipe, QuantRecipe):
        raise ValueError(f"quantize_stream expects a QuantRecipe, got {type(recipe).__name__}")
    if num_layers is not None:
        recipe = recipe.bind(num_layers)
    for fqn, tensor in items:
        if module_of is not None:
            module = module_of(fqn)
        elif fqn.endswith(weight_suffix):
            module = fqn[: len(fqn) - len(weight_suffix)]
        else:
            module = None
        if isinstance(tensor, (torch.Tensor, RowBlocks)) and module is not None:
            config = recipe.get_config(module)
            if config is not None:
                importance = calibration.importance_of(module) if calibration is not None else None
                if importance is not None and not takes_importance(config):
                    importance = None
                hessian = None
                if config.method == "gptq":
                    hessian = calibration.hessian_of(module) if calibration is not None else None
                    if hessian is None:
                        config = gptq.without_hessian(config)
                        if without_hessian is not None:
                            without_hessian.append(fqn)
                if isinstance(tensor, RowBlocks):
                    blocks = None
                    if importance is None and report is None and hessian is None:
                        blocks = quantize_row_blocks(tensor, config, name=fqn)
                    if blocks is not None:
                        yield fqn, blocks
                        del tensor, blocks
                        continue
                    tensor = tensor.whole()
                quantized = quantize_weight(tensor, config, name=fqn, importance=importance, hessian=hessian)
                if report is not None:
                    inputs = calibration.inputs_of(module) if calibration is not None else None
                    report.add(fqn, tensor, quantized, config, inputs=inputs)
                yield fqn, quantized
                del tensor, quantized  # neither is held while the next item is read
                continue
        yield fqn, tensor
        del tensor
