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


def parameter_counts(model: torch.nn.Module, group_of: Callable[[str], str], routed: str = "",
                     top_k: int = 0, num_experts: int = 0) -> Dict[str, int]:
    """{"total", ["active",] per-group counts...}. With ``routed`` (the group of the routed experts),
    "active" counts that group at top_k / num_experts and everything else in full."""
    groups = count_by_group(model, group_of)
    total = count_parameters(model)
    if not routed:
        return {"total": total, **groups}
    active = total - groups[routed] + groups[routed] * top_k // num_experts
    return {"total": total, "active": active, **groups}


def main_for(title: str, default_config: str, config_from_hf, counts: Callable, describe: Callable,
             argv=None) -> None:
    """The ``param_count`` binaries: ``--config`` (default ``default_config``) -> ``counts(config)`` printed
    as one line per group and the totals; ``describe(config)`` is the line under the title. A bad file:
    one line on stderr naming it, exit status 1."""
    import json
    import sys

    from absl import app, flags

    flags.DEFINE_string("config", default_config, f"Hugging Face config.json of a {title} model")

    def run(_):
        path = flags.FLAGS.config
        try:
            with open(path) as f:
                config = config_from_hf(json.load(f))
        except (OSError, ValueError, NotImplementedError) as exc:
            print(f"error: {path}: {exc}", file=sys.stderr)
            sys.exit(1)
        result = counts(config)
        print(f"{title} text model from {path}")
        print(f"  {describe(config)}")
        for name, n in result.items():
            if name not in ("total", "active"):
                print(f"  {name:28s} {format_count(n)}")
        if "active" in result:
            print(f"  {'total':28s} {format_count(result['total'])}")
            print(f"  {'active per token':28s} {format_count(result['active'])}")
            if "embed_tokens" in result:
                print(f"  {'active w/o embeddings':28s} {format_count(result['active'] - result['embed_tokens'])}")
        else:
            print(f"  {'total (all active)':28s} {format_count(result['total'])}")

    app.run(run, argv=argv)
