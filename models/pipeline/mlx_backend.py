"""--backend=mlx: the quantized stream -> a folder that `mlx_lm.load(folder)` runs, and its logits.

The model packages own the HF -> mlx-lm maps (`models/<m>/mlx_export.py`: `mlx_tensors(name,
value)` and `mlx_config(hf_config)`); `llmq_mlx.write_mlx_lm_folder` packs canonical weights to
MLX affine tensors, writes "quantization" (per-layer overrides, `false` for kept layers) and
flushes shards as they fill. This module joins the two and checks the result through mlx-lm
itself, so what is verified is what a user of the folder gets.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from llmq.quant import GroupQuantizedWeight
from models.pipeline.arch import Architecture
from models.pipeline.report import verification_prompt

Value = Union[torch.Tensor, GroupQuantizedWeight]

# Formats a recipe may use with --backend=mlx (checked before any work): MLX affine weights are integer.
ACCEPTS_FORMATS = ("int",)

# Files mlx-lm's tokenizer loader may read; copied through from a real checkpoint when present.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "chat_template.json", "chat_template.jinja", "generation_config.json",
)


def tokenizer_files(folder: str) -> List[str]:
    """The tokenizer files present in a checkpoint folder (possibly none)."""
    return [os.path.join(folder, f) for f in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, f))]


def has_tokenizer(folder: str) -> bool:
    """Whether the folder holds a tokenizer proper (not just its config files)."""
    return any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))


END_OF_TEXT = "<|endoftext|>"


def _byte_symbols() -> List[str]:
    """The byte-level BPE alphabet: byte b -> one printable character (GPT-2's convention: printable
    Latin-1 bytes stand for themselves, the others are shifted to code points from 256 up)."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols, shifted = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def write_tiny_tokenizer(folder: str, vocab_size: int) -> List[str]:
    """An offline byte-level BPE tokenizer for the embedded default model (mlx_lm.load needs one; a
    tiny random model has no real one): token id b is byte b, id 256 is <|endoftext|>, the rest are
    unused fillers up to vocab_size.

    Byte-level BPE with no merges, because transformers may ignore tokenizer_class and rebuild the
    tokenizer with the model type's own class (Qwen3.5's is a byte-level BPE made from tokenizer.json's
    vocab and merges): then both the generic and the model's class encode text to the same ids.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < 257:
        raise ValueError(f"the tiny byte-level tokenizer needs vocab_size >= 257, got {vocab_size}")
    vocab = {symbol: b for b, symbol in enumerate(_byte_symbols())}
    vocab[END_OF_TEXT] = 256
    vocab.update({f"<unused_{i}>": i for i in range(257, vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([END_OF_TEXT])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": END_OF_TEXT, "eos_token": END_OF_TEXT,
                   "pad_token": END_OF_TEXT}, f, indent=2)
        f.write("\n")
    return tokenizer_files(folder)


def mlx_stream(items: Iterable[Tuple[str, Value]], arch: Architecture,
               float_dtype: Optional[torch.dtype] = None) -> Iterator[Tuple[str, Value]]:
    """Pipeline (name, value) pairs -> mlx-lm (name, value) pairs, one tensor at a time.

    `float_dtype` casts the tensors kept in high precision (None: as the checkpoint stores them).
    Quantized weights stay canonical; the writer packs them (exactly, float32 scales).
    """
    for name, value in items:
        for mlx_name, mlx_value in arch.mlx_export.mlx_tensors(name, value):
            if float_dtype is not None and isinstance(mlx_value, torch.Tensor) and mlx_value.is_floating_point():
                mlx_value = mlx_value.to(float_dtype)
            yield mlx_name, mlx_value


def write_mlx_folder(out: str, items: Iterable[Tuple[str, Value]], arch: Architecture, hf_config: dict, *,
                     tokenizer: Sequence[str] = (), max_shard_bytes: int = 5 << 30,
                     float_dtype: Optional[torch.dtype] = None, overwrite: bool = False) -> Path:
    """Write the mlx-lm folder for `arch` from the pipeline's quantized stream; returns its path."""
    from llmq_mlx import write_mlx_lm_folder

    if arch.mlx_export is None:
        raise ValueError(f"architecture {arch.name} has no MLX export (Architecture.mlx_export is None)")
    config = arch.mlx_export.mlx_config(hf_config)
    return write_mlx_lm_folder(out, mlx_stream(items, arch, float_dtype), config, tokenizer_files=tokenizer,
                               max_shard_bytes=max_shard_bytes, overwrite=overwrite)


def load_mlx_model(folder: Union[str, Path]):
    """`mlx_lm.load(folder)` (model, tokenizer); without tokenizer files only the model (tokenizer None)."""
    import mlx_lm
    from mlx_lm.utils import load_model

    if has_tokenizer(str(folder)):
        return mlx_lm.load(str(folder))
    model, _ = load_model(Path(folder))
    return model, None


def mlx_logits(model, prompt: torch.Tensor) -> torch.Tensor:
    """Prefill logits [T, V] (float32) of an mlx-lm model for one prompt [1, T], through its own cache
    (rotating caches for sliding windows, as generation uses them)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    ids = mx.array(prompt.to(torch.int64).numpy().astype(np.int32))
    out = model(ids, cache=make_prompt_cache(model))
    return torch.from_numpy(np.array(out[0].astype(mx.float32)))


def agreement(reference: torch.Tensor, got: torch.Tensor) -> dict:
    """cosine, SQNR (dB) and max |difference| of two logit arrays."""
    import math

    ref, got = reference.double().flatten(), got.double().flatten()
    noise = (ref - got).pow(2).sum().item()
    return {
        "cosine": torch.nn.functional.cosine_similarity(ref, got, dim=0).item(),
        "sqnr_db": math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise),
        "max_abs_error": (ref - got).abs().max().item(),
    }


@torch.no_grad()
def compare_with_mlx(folder: Union[str, Path], reference: torch.nn.Module, quantized: torch.nn.Module, *,
                     vocab_size: int, seed: int = 0, float32: bool = True) -> dict:
    """mlx-lm's logits for the folder vs our quantized model (same tensors) and vs the unquantized one.

    With `float32` (default) every model is evaluated in float32 (mlx-lm's float parameters cast with
    `set_dtype`, ours with `.float()`, in place): bf16-compute noise then no longer hides a difference
    between what the folder holds and our quantized model, so "mlx vs ours" checks the export itself.
    """
    prompt = verification_prompt(vocab_size, seed)
    model, _ = load_mlx_model(folder)
    if float32:
        import mlx.core as mx

        model.set_dtype(mx.float32)
        reference, quantized = reference.float(), quantized.float()
    got = mlx_logits(model, prompt)
    ours = quantized(prompt)[0].float()
    ref = reference(prompt)[0].float()
    return {"mlx_vs_quantized": agreement(ours, got), "mlx_vs_reference": agreement(ref, got), "float32": float32}
