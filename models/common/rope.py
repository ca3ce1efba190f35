"""Rotary position embedding helpers shared by the models.

Both models use the "rotate half" convention (the first and second halves of the rotated
slice form the complex pairs), not the interleaved one. A model that rotates only part of a
head passes the rotated width implicitly through the length of ``inv_freq``.
"""

from __future__ import annotations

import torch


def default_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/rotary_dim), i < rotary_dim/2 (float32, always on CPU, even under a meta device context)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / rotary_dim
    return 1.0 / (theta**exponents)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin tables [S, 2*len(inv_freq)] for integer ``positions`` [S], computed in float32."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(device=positions.device, dtype=torch.float32)[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the leading ``cos.shape[-1]`` features of ``x`` [B, H, S, hd]; the rest pass through.

    ``cos``/``sin`` are [S, rotary_dim] and broadcast over batch and heads.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x_rot = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat((x_rot, x_pass), dim=-1)
