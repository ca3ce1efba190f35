"""Per-input-channel importance from a calibration run (the imatrix idea).

`collect_importance(model, batches)` runs the unquantized model on a few token batches and
returns, for every `nn.Linear` (by the module name a recipe sees), the mean over tokens of the
squared input activation of each input column: E[x_k^2]. A weight error on column k then costs
about importance[k] times its square in the layer's output (for independent activations), so
quantizers and the budget weight their squared error by it (`llmq.quant.budget.weight_error`).

Only the statistics are kept (one float64 vector per layer), never the activations.
"""

from __future__ import annotations

from typing import Dict, Iterable

import torch
from torch import nn


class _Accumulator:
    def __init__(self):
        self.sum_sq: Dict[str, torch.Tensor] = {}
        self.count: Dict[str, int] = {}

    def hook(self, name: str):
        def record(module: nn.Module, args) -> None:
            x = args[0].detach()
            flat = x.reshape(-1, x.shape[-1]).double()
            acc = self.sum_sq.get(name)
            add = flat.pow(2).sum(dim=0)
            self.sum_sq[name] = add if acc is None else acc + add
            self.count[name] = self.count.get(name, 0) + flat.shape[0]

        return record


@torch.no_grad()
def collect_importance(model: nn.Module, batches: Iterable[torch.Tensor], floor: float = 1e-6) -> Dict[str, torch.Tensor]:
    """{linear module name: float32 [in_features] E[x^2]} over every token of every batch
    (each batch a LongTensor of token ids [batch, seq] passed as model(ids)). A column the text
    never excites (E[x^2] = 0) gets `floor` times the layer's mean instead, so every weight
    stays > 0 (quantizers take a positive importance; a dead column's error then costs little)."""
    acc = _Accumulator()
    handles = [m.register_forward_pre_hook(acc.hook(name)) for name, m in model.named_modules()
               if isinstance(m, nn.Linear)]
    try:
        for ids in batches:
            model(ids)
    finally:
        for h in handles:
            h.remove()
    out = {}
    for name, total in acc.sum_sq.items():
        mean_sq = total / acc.count[name]
        out[name] = mean_sq.clamp_min(floor * max(float(mean_sq.mean()), 1e-30)).float()
    return out


def token_batches(ids: torch.Tensor, seq_len: int) -> Iterable[torch.Tensor]:
    """A 1-D token stream cut into [1, seq_len] batches (the last one shorter)."""
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"calibration tokens must be a non-empty 1-D tensor, got shape {list(ids.shape)}")
    for start in range(0, ids.numel(), seq_len):
        yield ids[start:start + seq_len].unsqueeze(0)
