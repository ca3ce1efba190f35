"""Sizes are bytes on disk: what a backend writes for one quantized weight, and its bits.

The bits per weight a run budgets (--budget_bits_per_weight), reports (the error report) and
summarises are those of the tensors its backend writes for the quantized weights, scales, biases,
zero points and per-tensor extras included: bytes on disk x 8 / weights. Each backend declares them
(`llmq.backend.Backend.storage(config, job)` -> `Storage`); this module computes with the
declaration and never imports a backend.

A declaration says, for one QuantConfig:

* ``scale_dtype``: the dtype the backend writes per-group scales and float biases in. The run
  quantizes with ``QuantConfig.scale_dtype`` set to it, so the methods choose scales (and biases)
  exactly representable in it and the codes against them: what is written is llmq's value exactly.
* ``tensors(scale_dtype, shape)``: role -> (dtype, shape) of every tensor written for a weight of
  logical ``shape`` (codes packed into words, scales, biases or packed zero points, per-tensor extras;
  a block type of fixed bytes per block is one uint8 tensor of blocks x bytes). None: the weight's
  canonical container as it is (the llmq bundle): its `stored` tensors.
* ``widen_to``: a weight whose scales and biases ``scale_dtype`` cannot hold exactly (a GGUF block
  imported exactly, never a weight the run quantized) is written with scales of the first of these
  dtypes that holds them; () where the backend never widens.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch

Shape = Tuple[int, ...]
Tensors = Dict[str, Tuple[torch.dtype, Shape]]

def element_bits(dtype: torch.dtype) -> int:
    """Bits of one element of a dtype a backend writes (uint8 words for packed sub-byte codes)."""
    return torch.empty((), dtype=dtype).element_size() * 8


@dataclasses.dataclass(frozen=True)
class Storage:
    """How a backend writes the weights of one QuantConfig (see the module docstring)."""

    scale_dtype: torch.dtype = torch.float32
    tensors: Optional[Callable[[torch.dtype, Shape], Tensors]] = None
    widen_to: Tuple[torch.dtype, ...] = ()

    def written_scale_dtype(self, value: Any = None) -> torch.dtype:
        """The dtype `value`'s scales are written in: scale_dtype, or the first of widen_to that holds
        them exactly where scale_dtype cannot."""
        if value is None or not self.widen_to:
            return self.scale_dtype
        return narrowest_exact(value, (self.scale_dtype,) + tuple(self.widen_to))

    def layout(self, shape: Shape, value: Any = None) -> Tensors:
        """role -> (dtype, shape) of what is written for a weight of logical `shape` (`value`: the
        quantized weight itself, needed where tensors is None or the scales may widen)."""
        if self.tensors is None:
            if value is None:
                raise ValueError("this storage writes the canonical container: its bits need the quantized value")
            from llmq.quant.formats import format_of

            fmt = format_of(value)
            if fmt is None:
                raise ValueError(f"{type(value).__name__} is not a quantized weight of a registered format")
            stored = fmt.stored(value)
            return {role: (t.dtype, tuple(t.shape)) for role, t in stored.items()}
        return self.tensors(self.written_scale_dtype(value), tuple(shape))

    def bits(self, shape: Shape, value: Any = None) -> int:
        """Bits on disk of one weight of logical `shape` (see `layout`)."""
        from llmq.quant.row_blocks import QuantizedRowBlocks

        if self.tensors is None and isinstance(value, QuantizedRowBlocks):
            return value.nbytes * 8  # carried as row blocks: the canonical tensors it will store
        return sum(element_bits(d) * math.prod(s) for d, s in self.layout(shape, value).values())


CANONICAL = Storage()  # the llmq bundle: the canonical containers as they are


def holds_scales(value: Any, dtype: torch.dtype) -> bool:
    """Whether every scale and bias of an integer weight is exactly representable in `dtype`
    (True for other containers: they carry no float scales to narrow)."""
    scale, bias = getattr(value, "scale", None), getattr(value, "bias", None)
    if not isinstance(scale, torch.Tensor) or not isinstance(bias, torch.Tensor) or dtype == torch.float32:
        return True
    return all(torch.equal(t.to(dtype).to(t.dtype), t) for t in (scale, bias))


def narrowest_exact(value: Any, dtypes: Tuple[torch.dtype, ...]) -> torch.dtype:
    """The first of `dtypes` that holds `value`'s scales and biases exactly (the last if none does)."""
    return next((d for d in dtypes if holds_scales(value, d)), dtypes[-1])


def group_tensors(bits: int, group_size: Optional[int], *, code_dtype: torch.dtype = torch.uint8,
                  bias: bool = True) -> Callable[[torch.dtype, Shape], Tensors]:
    """The tensors of a group-wise integer weight written as codes packed LSB-first along K into
    words of `code_dtype` (rows padded to whole words), a scale per group and, when `bias`, a
    float bias per group in the scale dtype: MLX affine, the canonical form's layout."""

    def tensors(scale_dtype: torch.dtype, shape: Shape) -> Tensors:
        lead, k = (tuple(shape[:-1]) if len(shape) >= 2 else (1,)), shape[-1]
        word = element_bits(code_dtype)
        groups = lead + (k // (group_size or k),)
        out = {"codes": (code_dtype, lead + (-(-k * bits // word),)), "scale": (scale_dtype, groups)}
        if bias:
            out["bias"] = (scale_dtype, groups)
        return out

    return tensors
