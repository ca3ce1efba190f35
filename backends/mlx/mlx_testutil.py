"""Random canonical weights for the MLX backend tests (test-only).

Random q, scale and bias are the best test input for a packer: every bit pattern and
every sign of scale occurs, and nothing depends on a quantizer being right.
"""

from __future__ import annotations

import numpy as np
import torch

from llmq.quant.formats import GroupQuantizedWeight, pack_bits

FP32_UNIT_ROUNDOFF = 2.0 ** -24


def gamma(n: int) -> float:
    """Higham's gamma_n = n*u / (1 - n*u): the relative error bound of n fp32 roundings."""
    nu = n * FP32_UNIT_ROUNDOFF
    return nu / (1.0 - nu)


def random_canonical(shape, bits, group_size, seed=0, negative_scales=True) -> GroupQuantizedWeight:
    """A GroupQuantizedWeight with uniform random q, scales of both signs and mixed magnitude."""
    g = torch.Generator().manual_seed(seed)
    *lead, n, k = shape
    q = torch.randint(0, 1 << bits, (*lead, n, k), generator=g, dtype=torch.int64)
    ngroups = k // group_size
    mag = torch.exp(torch.empty(*lead, n, ngroups).uniform_(-7.0, -3.0, generator=g))
    sign = torch.where(torch.rand(*lead, n, ngroups, generator=g) < 0.3, -1.0, 1.0) if negative_scales else 1.0
    scale = (mag * sign).to(torch.float32)
    bias = (-scale * ((1 << bits) - 1) / 2 + 0.01 * torch.randn(*lead, n, ngroups, generator=g)).to(torch.float32)
    return GroupQuantizedWeight(
        qdata=pack_bits(q, bits), scale=scale, bias=bias, bits=bits, group_size=group_size, shape=tuple(shape)
    )


def exact_weight_f64(w: GroupQuantizedWeight) -> np.ndarray:
    """scale*q + bias in float64 without rounding to float32: the matmul reference's weight."""
    from llmq.quant.formats import unpack_bits

    k = w.shape[-1]
    q = unpack_bits(w.qdata, w.bits, k).to(torch.float64).reshape(*w.shape[:-1], k // w.group_size, w.group_size)
    out = q * w.scale.double().unsqueeze(-1) + w.bias.double().unsqueeze(-1)
    return out.reshape(w.shape).numpy()


def abs_weight_f64(w: GroupQuantizedWeight) -> np.ndarray:
    """|scale*q| + |bias|: the magnitude that bounds rounding error in any evaluation order."""
    from llmq.quant.formats import unpack_bits

    k = w.shape[-1]
    q = unpack_bits(w.qdata, w.bits, k).to(torch.float64).reshape(*w.shape[:-1], k // w.group_size, w.group_size)
    out = (q * w.scale.double().unsqueeze(-1)).abs() + w.bias.double().abs().unsqueeze(-1)
    return out.reshape(w.shape).numpy()


def logits_tolerance(ref64, reduction_lengths):
    """Both sides evaluate the same function in fp32 from identical weights (up to the
    half-ulp MLX's two-rounding dequantize adds, one more rounding per weight). Each
    reduction of length n carries at most gamma_n relative error of its |terms|; summed
    along the longest chain of dependent reductions this bounds the error relative to
    the logits' scale. A layout or grouping bug moves logits by O(max|logit|)."""
    n = sum(reduction_lengths) + 2 * len(reduction_lengths)
    return 2 * n * FP32_UNIT_ROUNDOFF * float(np.abs(ref64).max())


def hf_logits(model, ids):
    with torch.no_grad():
        out32 = model(torch.tensor([ids])).logits[0].numpy()
        out64 = model.double()(torch.tensor([ids])).logits[0].numpy()
    model.float()
    return out32, out64
