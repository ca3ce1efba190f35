"""Fuse quantized sibling projections (q|k|v, gate|up) along the output dimension.

The weights' format family does it (`Format.fuse_along_output`): for group-wise formats rows are
independent, so concatenating the stored fields along N is exact (no requantization, no rounding).
"""

from __future__ import annotations

from typing import Any, Sequence

from llmq.quant.formats import format_of


def fuse_along_output(weights: Sequence[Any]) -> Any:
    """Concatenate quantized weights [..., N_i, K] of one format into one [..., sum N_i, K]."""
    weights = list(weights)
    if not weights:
        raise ValueError("fuse_along_output needs at least one weight")
    fmt = format_of(weights[0])
    if fmt is None:
        raise ValueError(f"fuse_along_output: item 0 is a {type(weights[0]).__name__}, expected a quantized weight")
    for i, w in enumerate(weights):
        if format_of(w) is not fmt or fmt is None:
            raise ValueError(f"fuse_along_output: item {i} is a {type(w).__name__}, expected "
                             f"{fmt.container.__name__ if fmt is not None else 'a quantized weight'} like item 0")
    return fmt.fuse_along_output(weights)
