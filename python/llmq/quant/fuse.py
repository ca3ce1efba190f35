"""Fuse quantized sibling projections (q|k|v, gate|up) along the output dimension.

Groups run along K (the input dimension), so rows are independent and concatenating the
canonical fields along N is exact: no requantization, no rounding.
"""

from __future__ import annotations

from typing import Sequence

import torch

from llmq.quant.formats import GroupQuantizedWeight


def fuse_along_output(weights: Sequence[GroupQuantizedWeight]) -> GroupQuantizedWeight:
    """Concatenate weights [..., N_i, K] into one [..., sum N_i, K] (2-D or stacked 3-D)."""
    weights = list(weights)
    if not weights:
        raise ValueError("fuse_along_output needs at least one weight")
    for i, w in enumerate(weights):
        if not isinstance(w, GroupQuantizedWeight):
            raise ValueError(f"fuse_along_output: item {i} is a {type(w).__name__}, expected GroupQuantizedWeight")
        if len(w.shape) not in (2, 3):
            raise ValueError(f"fuse_along_output: item {i} has shape {list(w.shape)}; expected [N, K] or [E, N, K]")
    first = weights[0]
    for i, w in enumerate(weights[1:], start=1):
        mismatches = []
        if w.bits != first.bits:
            mismatches.append(f"bits {w.bits} != {first.bits}")
        if w.group_size != first.group_size:
            mismatches.append(f"group_size {w.group_size} != {first.group_size}")
        if len(w.shape) != len(first.shape) or w.shape[:-2] != first.shape[:-2] or w.shape[-1] != first.shape[-1]:
            mismatches.append(f"shape {list(w.shape)} incompatible with {list(first.shape)} (all but N must agree)")
        if w.dtype != first.dtype:
            mismatches.append(f"dtype {w.dtype} != {first.dtype}")
        if mismatches:
            raise ValueError(f"fuse_along_output: item {i} does not match item 0: " + "; ".join(mismatches))
    n = sum(w.shape[-2] for w in weights)
    return GroupQuantizedWeight(
        qdata=torch.cat([w.qdata for w in weights], dim=-2),
        scale=torch.cat([w.scale for w in weights], dim=-2),
        bias=torch.cat([w.bias for w in weights], dim=-2),
        bits=first.bits,
        group_size=first.group_size,
        shape=tuple(first.shape[:-2]) + (n, first.shape[-1]),
        dtype=first.dtype,
    )
