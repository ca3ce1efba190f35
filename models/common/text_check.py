"""Text in, text out: how far a quantized model agrees with its reference on an English prompt.

    result = text_agreement(tokenizer, reference, quantized, prompt="The capital of France is", new_tokens=24)
    rows = text_rows(result)   # (label, value) pairs for a report table

The prompt becomes ids through the checkpoint's own tokenizer (``models.common.tokenizer``); both
models continue it greedily (``models.common.generation.generate``) and the continuations come back
as text. Agreement is measured three ways:

* ``greedy_equal``: how many leading generated tokens are identical (greedy runs diverge for good
  after their first difference, so this is a strict, order-sensitive count);
* ``token_agreement``: teacher-forced top-1 agreement -- both models read the same sequence (the
  prompt plus the reference's continuation) and, at each position that predicts a continuation
  token, their argmax tokens are compared; one divergence does not poison the rest;
* ``logits_cosine``: cosine of the two models' float64 logits over the prompt positions.

``models.pipeline`` prints these rows in its verification when the source has a tokenizer; the
models only need ``new_cache()`` and ``forward(ids, cache=None) -> logits`` (every llmq model).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch

from models.common.generation import generate

DEFAULT_PROMPT = "The capital of France is"
DEFAULT_NEW_TOKENS = 24


@torch.no_grad()
def text_agreement(tokenizer, reference: torch.nn.Module, quantized: torch.nn.Module, *,
                   prompt: str = DEFAULT_PROMPT, new_tokens: int = DEFAULT_NEW_TOKENS,
                   eos_token_id: Optional[Union[int, Iterable[int]]] = None) -> Dict:
    """Encode `prompt`, greedy-generate `new_tokens` from each model, compare (see the module doc).

    `tokenizer` needs encode(text) -> ids and decode(ids) -> text (``models.common.tokenizer``);
    `eos_token_id` defaults to the tokenizer's (generation stops there)."""
    if new_tokens < 1:
        raise ValueError(f"text_agreement: new_tokens must be >= 1, got {new_tokens}")
    ids = [int(i) for i in tokenizer.encode(prompt)]
    if not ids:
        raise ValueError(f"text_agreement: the tokenizer gives no tokens for the prompt {prompt!r}")
    if eos_token_id is None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
    prompt_ids = torch.tensor([ids])
    n = len(ids)
    ref_tokens = generate(reference, prompt_ids, new_tokens, eos_token_id=eos_token_id)[0, n:].tolist()
    q_tokens = generate(quantized, prompt_ids, new_tokens, eos_token_id=eos_token_id)[0, n:].tolist()

    # Teacher forcing: both read prompt + the reference's continuation (all but its last token).
    sequence = torch.tensor([ids + ref_tokens[:-1]])
    ref_logits = reference(sequence)[0].double()
    q_logits = quantized(sequence)[0].double()
    predicting = slice(n - 1, n - 1 + len(ref_tokens))  # positions whose next token is a continuation token
    agree = (ref_logits[predicting].argmax(-1) == q_logits[predicting].argmax(-1)).tolist()
    cosine = torch.nn.functional.cosine_similarity(ref_logits[:n].flatten(), q_logits[:n].flatten(), dim=0).item()
    greedy_equal = next((i for i, (a, b) in enumerate(zip(ref_tokens, q_tokens)) if a != b),
                        min(len(ref_tokens), len(q_tokens)))
    return {
        "prompt": prompt,
        "prompt_ids": ids,
        "tokens_reference": ref_tokens,
        "tokens_quantized": q_tokens,
        "text_reference": tokenizer.decode(ref_tokens),
        "text_quantized": tokenizer.decode(q_tokens),
        "greedy_equal": greedy_equal,
        "token_agreement": sum(agree) / len(agree),
        "tokens_compared": len(agree),
        "logits_cosine": cosine,
    }


def text_rows(result: Dict) -> List[Tuple[str, str]]:
    """The summary rows of a text_agreement result (label, value), for a report table."""
    return [
        ("prompt", f"{result['prompt']!r} ({len(result['prompt_ids'])} tokens)"),
        ("greedy text (unquantized)", repr(result["text_reference"])),
        ("greedy text (quantized)", repr(result["text_quantized"])),
        ("token agreement", f"{result['token_agreement']:.3f} teacher-forced top-1 over "
                            f"{result['tokens_compared']} tokens; greedy identical for the first "
                            f"{result['greedy_equal']} of {len(result['tokens_reference'])}"),
        ("prompt logits cosine", f"{result['logits_cosine']:.5f}"),
    ]

