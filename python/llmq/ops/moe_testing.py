"""Random quantized MoE weights for tests and benchmarks (drawn directly in the canonical
form: uniform q, positive scales, a bias near -scale * 2^(bits-1), so w is roughly zero-mean
with standard deviation ~ 1/sqrt(K) and activations stay O(1) through the layer)."""

from __future__ import annotations

import math
from typing import Tuple

import torch

from llmq.quant.formats import GroupQuantizedWeight, pack_bits


def random_group_quantized(shape: Tuple[int, ...], bits: int, group_size: int, generator: torch.Generator) -> GroupQuantizedWeight:
    *lead, n, k = shape
    g = k // group_size
    q = torch.randint(0, 1 << bits, tuple(shape), dtype=torch.uint8, generator=generator)
    base = math.sqrt(12.0) / ((1 << bits) * math.sqrt(k))
    scale = base * (0.5 + torch.rand(*lead, n, g, generator=generator))
    bias = -scale * (1 << (bits - 1)) + 0.1 * base * torch.randn(*lead, n, g, generator=generator)
    return GroupQuantizedWeight(pack_bits(q, bits), scale.float(), bias.float(), bits, group_size, tuple(shape))


def random_moe(num_experts: int, hidden: int, inter: int, bits: int, group_size: int, seed: int = 0,
               shared_inter: int = 0):
    """(router [E, D], w13 [E, 2F, D], w2 [E, D, F], shared (w13, w2, gate [1, D]) or None)."""
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(num_experts, hidden, generator=gen) / math.sqrt(hidden)
    w13 = random_group_quantized((num_experts, 2 * inter, hidden), bits, group_size, gen)
    w2 = random_group_quantized((num_experts, hidden, inter), bits, group_size, gen)
    shared = None
    if shared_inter:
        s13 = random_group_quantized((2 * shared_inter, hidden), bits, group_size, gen)
        s2 = random_group_quantized((hidden, shared_inter), bits, group_size, gen)
        gate = torch.randn(1, hidden, generator=gen) / math.sqrt(hidden)
        shared = (s13, s2, gate)
    return router, w13, w2, shared
