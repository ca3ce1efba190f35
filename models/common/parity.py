"""Logits of a transformers model and of an llmq model over the same greedy path (prefill,
then decode steps through each one's KV cache), and the check the model tests share."""

from typing import List, Sequence

import torch


def hf_logits(hf, prompt: torch.Tensor, steps: int) -> List[torch.Tensor]:
    """transformers: prefill `prompt`, then `steps` greedy decode steps; logits of each call."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        out = hf(input_ids=prompt, cache=cache, use_cache=True)
        logits = [out.logits]
        for _ in range(steps):
            out = hf(input_ids=out.logits[:, -1:].argmax(-1), cache=out.cache, use_cache=True)
            logits.append(out.logits)
    return logits


def llmq_logits(model, prompt: torch.Tensor, steps: int) -> List[torch.Tensor]:
    """An llmq model (`new_cache`, `forward(ids, cache=)`): the same calls as `hf_logits`."""
    cache = model.new_cache(batch_size=prompt.shape[0])
    with torch.no_grad():
        logits = [model(prompt, cache=cache)]
        for _ in range(steps):
            logits.append(model(logits[-1][:, -1:].argmax(-1), cache=cache))
    return logits


def assert_logits_match(name: str, expected: Sequence[torch.Tensor], actual: Sequence[torch.Tensor],
                        rel_tol: float) -> None:
    """Max abs error within rel_tol of the largest logit, and the greedy token of every call equal."""
    scale = max(e.abs().max().item() for e in expected)
    worst = max((a - e).abs().max().item() for a, e in zip(actual, expected))
    print(f"{name} parity: max|logit| {scale:.4g}, max abs err {worst:.3g}, rel {worst / scale:.3g}")
    assert worst <= rel_tol * scale, f"max abs error {worst} > {rel_tol} * {scale}"
    for a, e in zip(actual, expected):  # greedy paths agree token for token
        assert torch.equal(a[:, -1].argmax(-1), e[:, -1].argmax(-1))
