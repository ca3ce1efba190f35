"""--verify: reload the written output through its backend and compare it with the unquantized model.

The reference is built from the input (from a GGUF file: the GGUF model itself, its quantized
weights dequantized exactly); the quantized model from `backend.reload` (the output read back in
canonical form). Both run one prompt (logits cosine, SQNR, greedy tokens). Then, where the backend
declares `checks_consumer`, `backend.check_consumer` loads the folder as its consumer does (e.g.
mlx_lm.load), and with --use_moe_quantized_op the MoE blocks run through the fused C++ kernel.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

from models.common.text_check import DEFAULT_PROMPT, text_agreement, text_rows
from models.common.tokenizer import has_tokenizer, load_tokenizer
from models.pipeline.agreement import compare_logits, verdict, verification_prompt
from models.pipeline.arch import Architecture
from models.pipeline.quantized_model import build_quantized_model


def step(message: str) -> None:
    """What a long step is doing, as it starts (verification takes ~35 s on an 844 MB model)."""
    print(message, flush=True)


def verify(arch: Architecture, config, model_input, backend, job, path: str, reference_stream: Callable, *, seed: int,
           min_cosine: float, use_moe_op: bool) -> Tuple[List[Tuple[str, str]], Dict, Optional[str]]:
    """(summary rows, numbers, failure or None)."""
    step(f"verify: loading the unquantized reference model from {model_input.path}")
    reference = build_quantized_model(arch.build_model(config, device="meta"), dict(reference_stream()))
    if model_input.from_gguf:
        print("verification reference: the GGUF model, its quantized weights dequantized")
    step(f"verify: reloading {path}")
    reloaded = backend.reload(path, job)
    quantized = build_quantized_model(arch.build_model(config, device="meta"), reloaded)
    step("verify: running both models on a 16-token prompt, then 8 greedy tokens each")
    check = compare_logits(reference, quantized, vocab_size=config.vocab_size, seed=seed)
    result = dict(check)
    rows = [
        ("logits cosine", f"{check['cosine']:.5f}"),
        ("logits SQNR", f"{check['sqnr_db']:.1f} dB"),
        ("greedy (unquantized)", " ".join(map(str, check["tokens_reference"]))),
        ("greedy (quantized)", " ".join(map(str, check["tokens_quantized"]))),
    ]
    failure = verdict(check, min_cosine=min_cosine)
    if model_input.kind != "embedded" and has_tokenizer(model_input.path):
        tokenizer, skipped = _text_check_tokenizer(model_input.path, config.vocab_size)
        if skipped:
            rows.append(("text check", f"not run: {skipped}"))
        else:
            step(f"verify: the input's tokenizer turns {DEFAULT_PROMPT!r} into ids; greedy text from both models")
            text = text_agreement(tokenizer, reference, quantized)
            result["text"] = text
            rows += text_rows(text)
    if backend.checks_consumer and failure is None:
        step(f"verify: loading {path} as its consumer does (--backend {backend.name}) and comparing its logits")
        consumer_rows, consumer_result = backend.check_consumer(path, job, reference, quantized,
                                                                verification_prompt(config.vocab_size, seed))
        rows += consumer_rows
        result.update(consumer_result)
        failure = failure or consumer_result.get("failure")
    if use_moe_op and failure is None:
        from models.pipeline.moe_op_swap import swap_in_moe_op

        with_op = build_quantized_model(arch.build_model(config, device="meta"), reloaded)
        swapped = swap_in_moe_op(with_op, "--use_moe_quantized_op")
        step("verify: running the MoE blocks through torch.ops.llmq.quantized_moe_ffn")
        op_check = compare_logits(quantized, with_op, vocab_size=config.vocab_size, seed=seed)
        result["moe_op"] = dict(op_check, blocks=len(swapped))
        rows += [
            ("MoE op blocks", f"{len(swapped)} via torch.ops.llmq.quantized_moe_ffn"),
            ("op vs eager quantized", f"cosine {op_check['cosine']:.6f}, SQNR {op_check['sqnr_db']:.1f} dB"),
            ("greedy (quantized, op)", " ".join(map(str, op_check["tokens_quantized"]))),
        ]
    rows.append(("verification", "FAILED: " + failure if failure else f"passed (logits cosine >= {min_cosine})"))
    return rows, result, failure


def _text_check_tokenizer(path: str, vocab_size: int):
    """(the input's tokenizer, None), or (None, why the text check is skipped): a tokenizer that
    cannot be built (e.g. hostile GGUF tokenizer metadata) or that gives ids outside the model."""
    try:
        tokenizer = load_tokenizer(path)
    except ValueError as e:  # e.g. a GGUF vocabulary of a tokenizer kind transformers cannot build
        return None, str(e)
    outside = [int(i) for i in tokenizer.encode(DEFAULT_PROMPT) if not 0 <= int(i) < vocab_size]
    if outside:
        return None, f"the tokenizer gives id {outside[0]} for the prompt, outside the model's vocabulary of {vocab_size}"
    return tokenizer, None
