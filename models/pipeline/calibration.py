"""--calibration_text: per-layer statistics from running the unquantized model on a text.

The text is tokenized with the checkpoint's own tokenizer (an HF folder's tokenizer files, a
GGUF's tokenizer.ggml.* metadata, the embedded default's byte-level one), cut to --calibration_tokens,
and run through the unquantized model in windows of WINDOW tokens. What is kept per linear layer
(llmq.quant.importance.Calibration): E[x^2] per input column (the importance that methods "hqq"
and "search" (llmq.quant.takes_importance) and --budget_bits_per_weight weight their errors by) and up to SAMPLE_ROWS input rows (the error
report's layer output error). The model is held in memory for this step only, as --verify does.
"""

from __future__ import annotations

import os
from typing import Callable

from llmq.quant.importance import Calibration, collect_calibration, token_batches
from models.common.tokenizer import has_tokenizer, load_tokenizer
from models.pipeline.arch import Architecture
from models.pipeline.quantized_model import build_quantized_model
from models.pipeline.usage_error import UsageError

WINDOW = 512
SAMPLE_ROWS = 64


def tokenizer_source(source) -> str:
    """Where the source's tokenizer is read from, or UsageError naming the checkpoint."""
    if source.from_gguf:
        if has_tokenizer(source.path):
            return source.path
    elif source.tokenizer_files:
        return os.path.dirname(source.tokenizer_files[0])
    raise UsageError(f"--calibration_text: {source.path} has no tokenizer (tokenizer.json or tokenizer.model in an "
                     "HF folder, tokenizer.ggml.* in a GGUF) to turn the text into tokens")


def read_tokens(path: str, tokenizer, limit: int):
    import torch

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise UsageError(f"--calibration_text {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise UsageError(f"--calibration_text {path}: {e.strerror or e}") from None
    ids = tokenizer.encode(text)
    if len(ids) < 2:
        raise UsageError(f"--calibration_text {path}: {len(ids)} tokens; expected a text of at least a few "
                         "hundred tokens")
    return torch.tensor(ids[:limit], dtype=torch.long)


def calibrate(arch: Architecture, config, source, model_stream: Callable, text_path: str, tokens: int) -> Calibration:
    """Run the unquantized model on the first `tokens` tokens of the text; see the module docstring."""
    tokenizer = load_tokenizer(tokenizer_source(source))
    ids = read_tokens(text_path, tokenizer, tokens)
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and int(ids.max()) >= vocab:
        raise UsageError(f"--calibration_text {text_path}: the tokenizer gives id {int(ids.max())}, outside the "
                         f"model's vocabulary of {vocab}")
    model = build_quantized_model(arch.build_model(config, device="meta"), dict(model_stream())).eval()
    calibration = collect_calibration(model, token_batches(ids, WINDOW), sample_rows=SAMPLE_ROWS)
    del model
    return calibration
