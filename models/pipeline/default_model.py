"""The embedded default: a deterministic tiny model of the architecture, written as an HF checkpoint.

It lets a person see in under a minute that the whole pipeline works, with nothing downloaded.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

import torch

from models.pipeline.arch import Architecture
from models.pipeline.hf_checkpoint import write_hf_checkpoint


def write_default_checkpoint(arch: Architecture, folder: str, *, seed: int = 0,
                             dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 2 << 20,
                             hf_config: Optional[Dict] = None) -> str:
    """config.json + sharded safetensors + index for the tiny model (or `hf_config`, e.g. a
    mid-size one for benchmarks); same seed, same bytes."""
    hf_config = hf_config or arch.tiny_hf_config()
    config = arch.config_from_hf(hf_config)
    torch.manual_seed(seed)
    model = arch.build_model(config, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        arch.prepare_default(model)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if getattr(config, "tie_word_embeddings", False) and name == "lm_head.weight":
            continue
        for hf_name, t in arch.to_hf_tensors(name, tensor).items():
            tensors[hf_name] = t.to(dtype).contiguous()
    os.makedirs(os.path.dirname(os.path.abspath(folder)), exist_ok=True)
    return write_hf_checkpoint(folder, hf_config, tensors, max_shard_bytes=max_shard_bytes)


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
    return [os.path.join(folder, f) for f in ("tokenizer.json", "tokenizer_config.json")]
