"""--verify for model-free quantization (models/pipeline/generic.py): the output read back through its
backend and compared with the checkpoint it came from.

Always: every tensor against its original (relative Frobenius error; a missing or non-finite tensor
fails). Where transformers knows the architecture (a causal-LM class for its model_type): transformers'
own class, built on the meta device and filled by streaming (models/pipeline/transformers_model.py),
runs the unquantized checkpoint and then, the reference freed, the dequantized output on one prompt:
logits cosine, KL(reference || quantized) per position, top-1 agreement, 8 greedy tokens each. Memory
holds one float model (plus the reloaded output's quantized tensors), never two. The summary says
which of the two checks ran, and why the model check did not.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from models.pipeline.agreement import verification_prompt
from models.pipeline.usage_error import UsageError
from models.pipeline.verify import verdict

Rows = List[Tuple[str, str]]
NEW_TOKENS = 8


def _step(message: str) -> None:
    print(message, flush=True)


def _dense(value: Any) -> torch.Tensor:
    from llmq.quant import dequantize

    if isinstance(value, torch.Tensor):
        return value.float()
    return dequantize(value).float()


def tensor_errors(reference: Iterator[Tuple[str, Any]], reloaded: Dict[str, Any]) -> Tuple[Dict[str, float], List[str]]:
    """({name: ||output - original|| / ||original||} for every tensor the output changed, [problems]):
    a tensor the output lacks or holds non-finite values in is a problem."""
    errors: Dict[str, float] = {}
    problems: List[str] = []
    for name, original in reference:
        if name not in reloaded:
            problems.append(f"{name}: missing from the output")
            continue
        got = _dense(reloaded[name])
        want = _dense(original)  # (a GGUF input's quantized blocks, dequantized exactly)
        if tuple(got.shape) != tuple(want.shape):
            problems.append(f"{name}: shape {list(got.shape)} in the output, {list(want.shape)} in the checkpoint")
            continue
        if not bool(torch.isfinite(got).all()):
            problems.append(f"{name}: non-finite values in the output")
            continue
        if not torch.equal(got, want):
            norm = want.double().norm().item()
            errors[name] = (got.double() - want.double()).norm().item() / norm if norm else math.inf
    return errors, problems


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.double()


@torch.no_grad()
def _greedy(model, prompt: torch.Tensor, n: int) -> List[int]:
    ids = prompt
    for _ in range(n):
        nxt = _logits(model, ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[0, prompt.shape[1]:].tolist()


def compare(ref: torch.Tensor, got: torch.Tensor) -> Dict[str, Any]:
    """Logits [1, T, V] of the reference and the quantized model: cosine, SQNR, mean KL(ref || got)
    per position (nats), top-1 agreement, finiteness."""
    finite_ref, finite_got = bool(torch.isfinite(ref).all()), bool(torch.isfinite(got).all())
    noise = (ref - got).pow(2).sum().item()
    log_p, log_q = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    top1 = (ref.argmax(-1) == got.argmax(-1)).double().mean().item()
    return {
        "cosine": torch.nn.functional.cosine_similarity(ref.flatten(), got.flatten(), dim=0).item(),
        "sqnr_db": math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise),
        "kl": kl, "top1": top1, "finite_reference": finite_ref, "finite_quantized": finite_got,
    }


def _model_check(arch, reference_stream, reloaded: Dict[str, Any], seed: int) -> Dict[str, Any]:
    """transformers' class on the reference, then on the output (NoPlace where a tensor has no place)."""
    from models.pipeline.transformers_model import empty_model, load_streamed

    config = arch.transformers_config
    prompt = verification_prompt(config.get_text_config().vocab_size, seed)
    _step(f"verify: transformers' model class for {arch.name}, the unquantized checkpoint streamed in")
    model = load_streamed(empty_model(config), ((n, _dense(v)) for n, v in reference_stream()))
    cls = type(model).__name__
    ref = _logits(model, prompt)
    ref_tokens = _greedy(model, prompt, NEW_TOKENS)
    del model
    _step("verify: the same class, the output's weights (dequantized) streamed in")
    model = load_streamed(empty_model(config), ((n, _dense(reloaded.pop(n))) for n in list(reloaded)))
    got = _logits(model, prompt)
    check = compare(ref, got)
    check.update(model_class=cls, tokens_reference=ref_tokens, tokens_quantized=_greedy(model, prompt, NEW_TOKENS),
                 prompt_tokens=prompt.shape[1])
    return check


# The logits-cosine floor where --verify_min_cosine is not given (model-free runs have no llmq model for
# verify.py's round-to-nearest rule).
DEFAULT_MIN_COSINE = 0.9


def verify(arch, config, model_input, backend, job, path: str, reference_stream, *, seed: int,
           min_cosine: Optional[float] = None, use_moe_op: bool = False, recipe: Any = None,
           requantized_input: bool = False) -> Tuple[Rows, Dict[str, Any], Optional[str]]:
    """(summary rows, numbers, failure or None): models/pipeline/verify.py's contract
    (requantized_input does not apply: a model-free run reads float checkpoints)."""
    min_cosine = DEFAULT_MIN_COSINE if min_cosine is None else min_cosine
    from models.pipeline.transformers_model import NoPlace

    if use_moe_op:
        raise UsageError("--use_moe_quantized_op: model-free quantization has no llmq MoE model to run the op in "
                         f"(use {arch.own.target if getattr(arch, 'own', None) else 'a per-model target'})")
    _step(f"verify: reloading {path}")
    reloaded = backend.reload(path, job)
    _step("verify: every tensor of the output against the checkpoint's")
    errors, problems = tensor_errors(reference_stream(), reloaded)
    result: Dict[str, Any] = {"tensor_errors": errors, "tensor_problems": problems}
    rows: Rows = []
    if errors:
        worst = max(errors, key=errors.get)
        mean = sum(errors.values()) / len(errors)
        rows.append(("per-tensor error", f"{len(errors)} tensors changed: mean relative error {mean:.4g}, "
                                         f"worst {errors[worst]:.4g} ({worst})"))
    else:
        rows.append(("per-tensor error", "no tensor changed"))
    rows += [("problem", p) for p in problems[:5]]
    failure = f"{problems[0]}" if problems else None
    how = None
    if failure is None and arch.transformers_config is not None:
        try:
            check = _model_check(arch, reference_stream, reloaded, seed)
        except NoPlace as e:
            how = f"per-tensor error only: transformers' class has no place for the checkpoint's tensors ({e})"
        else:
            result.update(check)
            how = (f"through transformers' {check['model_class']} (model_type {arch.name}), weights streamed in; "
                   f"{check['prompt_tokens']}-token prompt")
            top1 = check["top1"] * check["prompt_tokens"]
            rows += [
                ("logits cosine", f"{check['cosine']:.5f}"),
                ("logits SQNR", f"{check['sqnr_db']:.1f} dB"),
                ("logits KL", f"{check['kl']:.4g} nats per position (reference || quantized)"),
                ("top-1 agreement", f"{top1:.0f}/{check['prompt_tokens']} positions"),
                ("greedy (unquantized)", " ".join(map(str, check["tokens_reference"]))),
                ("greedy (quantized)", " ".join(map(str, check["tokens_quantized"]))),
            ]
            failure = verdict(check, min_cosine=min_cosine)
    elif failure is None:
        how = f"per-tensor error only: {arch.transformers_missing}"
    rows.insert(0, ("verified", how or "per-tensor error only"))
    rule = (f"logits cosine >= {min_cosine}" if "cosine" in result
            else "every tensor present and finite")
    rows.append(("verification", "FAILED: " + failure if failure else f"passed ({rule})"))
    return rows, result, failure
