"""Group regrouping for MLX, and the explicit re-quantization fallback.

A canonical group of g elements with one (scale, bias) pair is *exactly* the same
weight as g/h consecutive groups of h elements that all repeat that pair. So a coarse
group (256, or a whole row of 5376) becomes the largest MLX group h in (128, 64, 32)
that divides it, losslessly. A group that no legal h divides (16, 48, ...) cannot be
represented; the caller either gets an error or asks for `requantize_affine` from the
high-precision weight.
"""

from __future__ import annotations

import torch

from llmq.quant.formats import GroupQuantizedWeight, pack_bits

# What MLX's affine mode holds (affine.py re-exports these; this module imports nothing from it).
MLX_BITS = (2, 3, 4, 5, 6, 8)
MLX_GROUP_SIZES = (32, 64, 128)


def mlx_group_size_for(group_size: int, k: int, name: str = "weight") -> int:
    """The largest MLX group size that `group_size` is an exact repetition of."""
    for h in sorted(MLX_GROUP_SIZES, reverse=True):
        if group_size % h == 0 and k % h == 0:
            return h
    raise ValueError(
        f"{name}: group_size={group_size} (K={k}) cannot be represented in MLX: it is not a multiple of "
        f"any of {MLX_GROUP_SIZES}. Re-quantize from the high-precision weight "
        f"(pack_mlx_affine(..., requantize_from=w)) or use a recipe with group 32/64/128"
    )


def regroup(w: GroupQuantizedWeight, group_size: int, name: str = "weight") -> GroupQuantizedWeight:
    """Split every group of `w` into groups of `group_size` that repeat its scale and bias.

    Dequantized values are preserved bit for bit; only the metadata grows.
    """
    if group_size == w.group_size:
        return w
    if group_size <= 0 or w.group_size % group_size:
        raise ValueError(
            f"{name}: cannot regroup group_size={w.group_size} into groups of {group_size} exactly "
            f"({group_size} must divide {w.group_size})"
        )
    rep = w.group_size // group_size
    return GroupQuantizedWeight(
        qdata=w.qdata,
        scale=w.scale.repeat_interleave(rep, dim=-1),
        bias=w.bias.repeat_interleave(rep, dim=-1),
        bits=w.bits,
        group_size=group_size,
        shape=tuple(w.shape),
        dtype=w.dtype,
    )


def fallback_params(bits: int, group_size: int, k: int, name: str = "weight"):
    """(bits, group_size) MLX can hold that are closest to an unrepresentable pair.

    Bits: 7 -> 8 (the only width MLX lacks in 2..8). Group: the finest legal MLX group
    (32) that divides K, since unrepresentable groups are either finer than 32 or not a
    multiple of it, and a finer group never loses accuracy against a coarser one.
    """
    new_bits = bits if bits in MLX_BITS else min(b for b in MLX_BITS if b >= bits)
    for h in MLX_GROUP_SIZES:  # ascending: finest first
        if k % h == 0:
            return new_bits, h
    raise ValueError(f"{name}: K={k} is not divisible by any MLX group size {MLX_GROUP_SIZES}; MLX cannot hold it")


def requantize_affine(weight: torch.Tensor, bits: int, group_size: int, name: str = "weight") -> GroupQuantizedWeight:
    """Min-max asymmetric quantization of a high-precision weight [..., N, K] at an MLX-legal
    (bits, group_size): scale = (max - min) / (2^bits - 1), bias = min, q = round((w - min)/scale).

    This is the fallback for weights whose canonical form MLX cannot represent; it is
    lossy (it re-quantizes) and only runs when the caller passes the original weight.
    """
    if weight.dim() < 2:
        raise ValueError(f"{name}: expected a weight [..., N, K], got shape {list(weight.shape)}")
    if bits not in MLX_BITS or group_size not in MLX_GROUP_SIZES:
        raise ValueError(f"{name}: requantize_affine needs bits in {MLX_BITS} and group in {MLX_GROUP_SIZES}")
    k = weight.shape[-1]
    if k % group_size:
        raise ValueError(f"{name}: group_size={group_size} does not divide K={k}")
    w = weight.detach().to(torch.float32).reshape(*weight.shape[:-1], k // group_size, group_size)
    lo = w.amin(dim=-1)
    hi = w.amax(dim=-1)
    qmax = (1 << bits) - 1
    scale = (hi - lo) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((w - lo.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, qmax)
    q = q.to(torch.uint8).reshape(weight.shape)
    return GroupQuantizedWeight(
        qdata=pack_bits(q, bits),
        scale=scale.contiguous(),
        bias=lo.contiguous(),
        bits=bits,
        group_size=group_size,
        shape=tuple(weight.shape),
        dtype=weight.dtype if weight.dtype.is_floating_point else torch.float32,
    )
