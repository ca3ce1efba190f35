"""Constructing a model without touching memory until its weights are known."""

from __future__ import annotations

from typing import Callable

import torch


def build_on_device(model_class: type, config, device: str | torch.device, dtype: torch.dtype,
                    init_weights: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
    """``model_class(config)`` constructed on ``device`` in ``dtype``: on the meta device no memory (for
    loading and counting); on a real device ``init_weights(model)`` fills it (tests, the embedded default)."""
    with torch.device(device):
        model = model_class(config)
    model = model.to(dtype=dtype)
    if torch.device(device).type != "meta":
        init_weights(model)
    return model
