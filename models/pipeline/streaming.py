"""Checkpoint -> model-layout stream, one layer's worth of tensors live at most.

Per-expert HF tensors (`...mlp.experts.{e}.gate_proj.weight`, ...) are copied into the stacked
layout the model uses as they arrive (the architecture's `expert_stacks`) and the stacks emitted
as soon as that layer's set is complete, so peak memory is one layer's stacks, never the model.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable, Iterator, Tuple

import torch

from llmq.quant.row_blocks import RowBlocks
from models.pipeline.arch import Architecture

_LAYER = re.compile(r"^(.*?layers\.\d+\.)")


def _layer_prefix(name: str) -> str:
    m = _LAYER.match(name)
    return m.group(1) if m else ""


def merge_experts_stream(items: Iterable[Tuple[str, torch.Tensor]], arch: Architecture,
                         experts_per_layer: int) -> Iterator[Tuple[str, torch.Tensor]]:
    """Stack per-expert tensors layer by layer; everything else passes straight through."""
    if arch.is_per_expert is None:
        yield from items
        return
    pending: Dict[str, Any] = {}  # layer prefix -> its stacks being filled (arch.expert_stacks)
    for name, tensor in items:
        if isinstance(tensor, RowBlocks) and arch.is_per_expert(name):
            tensor = tensor.whole()  # copied into the layer's stacks: needed whole
        if not (isinstance(tensor, torch.Tensor) and arch.is_per_expert(name)):
            yield name, tensor
            continue
        layer = _layer_prefix(name)
        stacks = pending.get(layer)
        if stacks is None:
            stacks = pending[layer] = arch.expert_stacks(name, experts_per_layer)
        stacks.add(name, tensor)  # copied into its slot: not held until the layer completes
        del tensor
        if stacks.complete:
            yield from pending.pop(layer).stacks().items()
        del stacks
    if pending:
        layer, stacks = next(iter(pending.items()))
        raise ValueError(
            f"checkpoint ended with incomplete experts for layer {layer!r}: {stacks.count} of "
            f"{3 * experts_per_layer} per-expert tensors (expected gate/up/down for {experts_per_layer} experts)"
        )
