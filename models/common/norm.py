"""RMSNorm as the Gemma models compute it: in float32, cast back to the input dtype."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * (offset + weight), in float32.

    ``offset`` 0: the weight is the scale (Gemma 4); ``offset`` 1: the stored weight is the scale
    minus 1 (Gemma 2/3, HF ``Gemma3RMSNorm``). ``with_scale=False``: no weight at all (Gemma 4's v_norm).
    """

    def __init__(self, dim: int, eps: float, with_scale: bool = True, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            xf = xf * (self.weight.float() + self.offset) if self.offset else xf * self.weight.float()
        return xf.to(x.dtype)
