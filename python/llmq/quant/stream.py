"""quantize_stream: quantize a lazy stream of (name, tensor) pairs one item at a time, so a
checkpoint far larger than memory can flow from a reader to a writer."""

from __future__ import annotations

from typing import Iterable, Iterator, Optional, Tuple, Union

import torch

from llmq.quant.formats import GroupQuantizedWeight
from llmq.quant.quantize import quantize_weight
from llmq.quant.recipe import QuantRecipe

StreamItem = Tuple[str, Union[torch.Tensor, GroupQuantizedWeight]]


def quantize_stream(items: Iterable[StreamItem], recipe: QuantRecipe, *, weight_suffix: str = ".weight",
                    num_layers: Optional[int] = None) -> Iterator[StreamItem]:
    """Yield (fqn, GroupQuantizedWeight) for each `<module><weight_suffix>` tensor whose module
    the recipe maps to a config, and every other item unchanged. Pulls one item from `items`
    per item yielded. `num_layers` binds recipes that count layers from the end."""
    if not isinstance(recipe, QuantRecipe):
        raise ValueError(f"quantize_stream expects a QuantRecipe, got {type(recipe).__name__}")
    if num_layers is not None:
        recipe = recipe.bind(num_layers)
    for fqn, tensor in items:
        if isinstance(tensor, torch.Tensor) and fqn.endswith(weight_suffix):
            config = recipe.get_config(fqn[: len(fqn) - len(weight_suffix)])
            if config is not None:
                yield fqn, quantize_weight(tensor, config, name=fqn)
                continue
        yield fqn, tensor
