"""Checkpoint -> model-layout stream, one layer's worth of tensors live at most.

Per-expert HF tensors (`...mlp.experts.{e}.gate_proj.weight`, ...) are buffered per layer and
emitted as the stacked layout the model uses as soon as that layer's set is complete, so peak
memory is one layer's experts, never the model.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, Iterator, Tuple

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
    pending: Dict[str, Dict[str, torch.Tensor]] = {}
    need = 3 * experts_per_layer  # gate, up, down per expert
    for name, tensor in items:
        if isinstance(tensor, RowBlocks) and arch.is_per_expert(name):
            tensor = tensor.whole()  # stacked with the layer's others: needed whole
        if not (isinstance(tensor, torch.Tensor) and arch.is_per_expert(name)):
            yield name, tensor
            continue
        layer = _layer_prefix(name)
        bucket = pending.setdefault(layer, {})
        bucket[name] = tensor
        if len(bucket) == need:
            yield from arch.merge_experts(pending.pop(layer)).items()
    if pending:
        layer, bucket = next(iter(pending.items()))
        raise ValueError(
            f"checkpoint ended with incomplete experts for layer {layer!r}: {len(bucket)} of {need} "
            f"per-expert tensors (expected gate/up/down for {experts_per_layer} experts)"
        )
