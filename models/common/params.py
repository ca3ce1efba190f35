"""Parameter counting on meta-device models (no memory), for the ``param_count`` targets."""

from __future__ import annotations

from typing import Callable, Dict

import torch


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameter elements (tied weights counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def count_by_group(model: torch.nn.Module, group_of: Callable[[str], str]) -> Dict[str, int]:
    """Distinct parameter elements per group name (``group_of(parameter name)``), in first-seen order."""
    seen, groups = set(), {}
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        group = group_of(name)
        groups[group] = groups.get(group, 0) + p.numel()
    return groups


def format_count(n: int) -> str:
    return f"{n:,} ({n / 1e9:.3f} B)"
