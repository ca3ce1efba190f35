"""--calibration_text: per-layer statistics from running the unquantized model on a text.

The text is tokenized with the checkpoint's own tokenizer (an HF folder's tokenizer files, a
GGUF's tokenizer.ggml.* metadata, the embedded default's byte-level one), cut to --calibration_tokens
(only a prefix of the file is read and tokenized: ``read_tokens``; a FIFO or device is refused),
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
# Reading the text: a prefix of this many bytes (characters) a token to start with, doubled while it
# gives fewer than the tokens asked for plus TOKEN_MARGIN; never more than MAX_READ_BYTES in all.
PREFIX_BYTES_PER_TOKEN = 16
TOKEN_MARGIN = 64
MAX_READ_BYTES = 64 << 20


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
    """The first `limit` token ids of the text file at `path`, reading only a prefix of it.

    The prefix starts at PREFIX_BYTES_PER_TOKEN bytes a token and doubles until it gives `limit`
    tokens plus a margin (so the cut falls well inside the text and the first `limit` ids are
    those of the whole text), the file ends, or MAX_READ_BYTES were read. A FIFO, a device
    (/dev/zero) or a folder is refused before anything is read."""
    import torch

    from llmq.input_files import InputFileError, iter_text

    what = "--calibration_text"
    want = limit + TOKEN_MARGIN
    budget = max(limit * PREFIX_BYTES_PER_TOKEN, 1 << 16)
    pieces, read, ids = [], 0, []
    try:
        for piece in iter_text(path, what):
            pieces.append(piece)
            read += len(piece)
            if read >= budget or read >= MAX_READ_BYTES:
                ids = tokenizer.encode("".join(pieces))
                if len(ids) >= want or read >= MAX_READ_BYTES:
                    break
                budget *= 2
        else:
            ids = tokenizer.encode("".join(pieces))
    except InputFileError as e:
        raise UsageError(str(e)) from None
    if len(ids) < 2:
        raise UsageError(f"{what} {path}: {len(ids)} tokens; expected a text of at least a few hundred tokens")
    return torch.tensor(ids[:limit], dtype=torch.long)


def calibrate(arch: Architecture, config, source, model_stream: Callable, text_path: str, tokens: int,
              hessians: bool = False) -> Calibration:
    """Run the unquantized model on the first `tokens` tokens of the text; see the module docstring.
    hessians: also each linear's mean x x^T (Calibration.hessians, for method "gptq")."""
    try:
        tokenizer = load_tokenizer(tokenizer_source(source))
    except ValueError as e:
        raise UsageError(f"--calibration_text: {e}") from None
    ids = read_tokens(text_path, tokenizer, tokens)
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and int(ids.max()) >= vocab:
        raise UsageError(f"--calibration_text {text_path}: the tokenizer gives id {int(ids.max())}, outside the "
                         f"model's vocabulary of {vocab}")
    model = build_quantized_model(arch.build_model(config, device="meta"), dict(model_stream())).eval()
    calibration = collect_calibration(model, token_batches(ids, WINDOW), sample_rows=SAMPLE_ROWS, hessians=hessians)
    del model
    return calibration
