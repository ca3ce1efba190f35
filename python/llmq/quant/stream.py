"""quantize_stream: quantize a lazy stream of (name, tensor) pairs one item at a time, so a
checkpoint far larger than memory can flow from a reader to a writer."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional, Tuple, Union

import torch

from llmq.quant.formats import GroupQuantizedWeight
from llmq.quant.quantize import quantize_weight
from llmq.quant.recipe import QuantRecipe

StreamItem = Tuple[str, Union[torch.Tensor, GroupQuantizedWeight]]


def quantize_stream(items: Iterable[StreamItem], recipe: QuantRecipe, *, weight_suffix: str = ".weight",
                    num_layers: Optional[int] = None,
                    module_of: Optional[Callable[[str], Optional[str]]] = None) -> Iterator[StreamItem]:
    """Yield (fqn, quantized weight in the config's format) for each `<module><weight_suffix>`
    tensor whose module the recipe maps to a config, and every other item unchanged. Pulls one item from `items`
    per item yielded. `num_layers` binds recipes that count layers from the end.

    module_of: name -> the module fqn the recipe sees, or None for "never quantize"; replaces
    the suffix rule for models whose weights are not all `<module>.weight` (e.g. fused MoE
    experts stored as `...experts.gate_up_proj` [E, 2F, D]).
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
        if isinstance(tensor, torch.Tensor) and module is not None:
            config = recipe.get_config(module)
            if config is not None:
                yield fqn, quantize_weight(tensor, config, name=fqn)
                continue
        yield fqn, tensor
