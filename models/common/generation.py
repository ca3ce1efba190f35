"""Greedy generation over any model with ``new_cache()`` and ``forward(input_ids, cache)``."""

from __future__ import annotations

from typing import Iterable, Optional

import torch


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    eos_token_id: Optional[int | Iterable[int]] = None,
) -> torch.Tensor:
    """Prefill ``input_ids`` [B, S] once, then decode one token at a time (argmax).

    Returns [B, S + n] with n <= max_new_tokens; stops early only when every row has produced
    an end-of-sequence token (rows that finished keep emitting it).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"generate: input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    cache = model.new_cache(batch_size=input_ids.shape[0])
    logits = model(input_ids, cache=cache)
    tokens = [input_ids]
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for step in range(max_new_tokens):
        next_token = logits[:, -1].argmax(dim=-1)
        if eos:
            eos_hit = torch.isin(next_token, torch.tensor(sorted(eos), device=next_token.device))
            fill = next(iter(sorted(eos)))
            next_token = torch.where(finished, torch.full_like(next_token, fill), next_token)
            finished = finished | eos_hit
        tokens.append(next_token[:, None])
        if eos and bool(finished.all()):
            break
        if step + 1 < max_new_tokens:
            logits = model(next_token[:, None], cache=cache)
    return torch.cat(tokens, dim=1)
