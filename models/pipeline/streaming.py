"""Checkpoint -> model-layout stream, one layer's worth of tensors live at most.

Per-expert HF tensors (`...mlp.experts.{e}.gate_proj.weight`, ...) are copied into the stacked
layout the model uses as they arrive (an architecture's `expert_stacks`; else buffered per layer
for its `merge_experts`) and the stacks emitted as soon as that layer's set is complete, so peak
memory is one layer's stacks, never the model.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable, Iterator, Tuple

import torch

from llmq.quant.chunked import RowBlocks
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
    pending: Dict[str, Any] = {}  # layer prefix -> its stacks being filled (or its per-expert tensors)
    need = 3 * experts_per_layer  # gate, up, down per expert
    for name, tensor in items:
        if isinstance(tensor, RowBlocks) and arch.is_per_expert(name):
            tensor = tensor.whole()  # stacked with the layer's others: needed whole
        if not (isinstance(tensor, torch.Tensor) and arch.is_per_expert(name)):
            yield name, tensor
            continue
        layer = _layer_prefix(name)
        if arch.expert_stacks is not None:  # copied into its slot now, not held until the layer completes
            stacks = pending.get(layer) or pending.setdefault(layer, arch.expert_stacks(name, experts_per_layer))
            stacks.add(name, tensor)
            del tensor
            if stacks.complete:
                yield from pending.pop(layer).stacks().items()
            del stacks
            continue
        bucket = pending.setdefault(layer, {})
        bucket[name] = tensor
        if len(bucket) == need:
            yield from arch.merge_experts(pending.pop(layer)).items()
    if pending:
        layer, held = next(iter(pending.items()))
        count = len(held) if isinstance(held, dict) else held.count
        raise ValueError(
            f"checkpoint ended with incomplete experts for layer {layer!r}: {count} of {need} "
            f"per-expert tensors (expected gate/up/down for {experts_per_layer} experts)"
        )
