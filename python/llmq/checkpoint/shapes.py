"""The shapes a reader may hand to torch: a tensor's dimensions, even with zero elements, must be
representable as torch's int64 sizes and strides."""

from __future__ import annotations

from typing import Optional, Sequence

INT64_MAX = (1 << 63) - 1


def dims_problem(dims: Sequence[int]) -> Optional[str]:
    """What keeps torch from making a tensor of these (non-negative) dims, as a phrase, or None.
    The product of the non-zero dims bounds every stride; a zero-element tensor of dims
    [0, 2^63] holds no data but still cannot be built."""
    extent = 1
    for d in dims:
        extent *= max(d, 1)
    if extent > INT64_MAX:
        return f"dims {list(dims)} exceed torch's 64-bit sizes (the product of the non-zero dims must be < 2^63)"
    return None
