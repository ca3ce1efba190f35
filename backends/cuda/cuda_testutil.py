"""Random canonical 4-bit weights and error bounds for the CUDA backend tests (test-only)."""

from __future__ import annotations

import torch

from llmq.quant.formats import GroupQuantizedWeight, pack_bits

FP32_UNIT_ROUNDOFF = 2.0 ** -24
BF16_UNIT_ROUNDOFF = 2.0 ** -8


def gamma(n: int, u: float = FP32_UNIT_ROUNDOFF) -> float:
    """Higham's gamma_n = n*u / (1 - n*u): the relative error bound of n roundings."""
    return n * u / (1.0 - n * u)


def random_q(shape, bits=4, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, shape, generator=g, dtype=torch.int64).to(torch.uint8)


def random_canonical(shape, group_size, bits=4, seed=0) -> GroupQuantizedWeight:
    """Uniform random q; scales of both signs over two decades; biases around -8*scale."""
    g = torch.Generator().manual_seed(seed + 1)
    *lead, n, k = shape
    q = random_q(shape, bits, seed)
    ng = k // group_size
    scale = torch.exp(torch.empty(*lead, n, ng).uniform_(-7.0, -3.0, generator=g))
    scale = scale * torch.where(torch.rand(*lead, n, ng, generator=g) < 0.3, -1.0, 1.0)
    bias = -8 * scale + 0.01 * torch.randn(*lead, n, ng, generator=g)
    return GroupQuantizedWeight(
        qdata=pack_bits(q, bits), scale=scale.float(), bias=bias.float(), bits=bits, group_size=group_size,
        shape=tuple(shape),
    )
