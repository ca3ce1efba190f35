"""The gated feed-forward block both model families use: ``down(act(gate(x)) * up(x))``.

Parameter names (gate_proj / up_proj / down_proj, no biases) are transformers'; the activation is
GeGLU's tanh-approximated GELU (Gemma) or SwiGLU's SiLU (Qwen's shared expert).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"GatedMLP: activation {activation!r}; expected one of {sorted(ACTIVATIONS)}")
        self.act = ACTIVATIONS[activation]
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
