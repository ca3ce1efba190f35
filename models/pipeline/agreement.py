"""How close two whole models are: logits cosine, SQNR, greedy tokens (the MoE op against the eager path, the
GGUF import tests); the pass/fail rule of --verify is models/pipeline/verify.verdict."""

from __future__ import annotations

import math
from typing import Dict, Sequence, Tuple

import torch

from models.common.generation import generate


def verification_prompt(vocab_size: int, seed: int, prompt_len: int = 16) -> torch.Tensor:
    """The deterministic prompt [1, T] every verification in the pipeline runs."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, prompt_len), generator=g)


@torch.no_grad()
def compare_logits(reference: torch.nn.Module, quantized: torch.nn.Module, *, vocab_size: int, seed: int = 0,
                   prompt_len: int = 16, new_tokens: int = 8) -> Dict:
    prompt = verification_prompt(vocab_size, seed, prompt_len)
    ref = reference(prompt).double()
    got = quantized(prompt).double()
    finite_ref, finite_got = bool(torch.isfinite(ref).all()), bool(torch.isfinite(got).all())
    noise = (ref - got).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    cosine = torch.nn.functional.cosine_similarity(ref.flatten(), got.flatten(), dim=0).item()
    return {
        "cosine": cosine,
        "sqnr_db": math.inf if noise == 0 else 10 * math.log10(signal / noise),
        "max_abs_error": (ref - got).abs().max().item(),
        "finite_reference": finite_ref,
        "finite_quantized": finite_got,
        "tokens_reference": generate(reference, prompt, new_tokens)[0, prompt_len:].tolist(),
        "tokens_quantized": generate(quantized, prompt, new_tokens)[0, prompt_len:].tolist(),
    }


def format_table(rows: Sequence[Tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 2 + max(len(str(v)) for _, v in rows))
    return "\n".join([line] + [f"{k:<{width}}  {v}" for k, v in rows] + [line])
