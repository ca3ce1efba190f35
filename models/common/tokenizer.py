"""A checkpoint's tokenizer: text -> ids -> text, from an HF folder or a GGUF file, built once per run.

    tok = load_tokenizer(source)            # None-safe check first: has_tokenizer(source)
    ids = tok.encode("The capital of France is")   # with BOS when the tokenizer adds one
    text = tok.decode(ids)                         # special tokens dropped
    write_tokenizer_files(source, folder)          # tokenizer.json + tokenizer_config.json

Sources:

* an HF checkpoint folder with ``tokenizer.json`` or ``tokenizer.model``: transformers'
  ``AutoTokenizer`` reads it;
* a llama.cpp ``.gguf`` file with ``tokenizer.ggml.*`` metadata: the metadata is read by llmq's
  GGUF header parser (parsed once per process; the vocabulary arrays are decoded once, on first
  use) and converted by transformers' own GGUF tokenizer builders
  (``transformers.integrations.gguf.convert_gguf_tokenizer``: SentencePiece / byte-level BPE /
  Unigram, merges recovered from the vocabulary where the file has none). transformers' own
  ``AutoTokenizer.from_pretrained(gguf_file=...)`` builds the same tokenizer but re-reads the
  file with its own reader; on the real Gemma 3 270M file (262,144 tokens) that path took minutes
  on the loaded 2-core machine, this one under 30 s (docs/models.md has the numbers).

``write_tokenizer_files`` saves what ``AutoTokenizer.from_pretrained(folder)`` and
``mlx_lm.load`` read, so an MLX folder written from a GGUF input has a working tokenizer.
A built tokenizer is kept per source (keyed by the file's identity), so verification, the
MLX writer and the text check share one build.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import os
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# What write_tokenizer_files leaves in the folder (transformers may add special_tokens_map.json or
# chat_template.jinja next to these).
WRITTEN_FILES = ("tokenizer.json", "tokenizer_config.json")

# GGUF metadata key -> transformers' name for it (the keys transformers' GGUF tokenizer reader uses).
_GGUF_TOKENIZER_KEYS = {
    "tokenizer.ggml.model": "tokenizer_type",
    "tokenizer.ggml.pre": "pre_tokenizer_type",
    "tokenizer.ggml.tokens": "tokens",
    "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.token_type": "token_type",
    "tokenizer.ggml.merges": "merges",
    "tokenizer.ggml.precompiled_charsmap": "precompiled_charsmap",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
    "tokenizer.ggml.add_space_prefix": "add_prefix_space",
}
_GGUF_CONFIG_KEYS = {
    "tokenizer.chat_template": "chat_template",
    "tokenizer.ggml.add_bos_token": "add_bos_token",
    "tokenizer.ggml.add_eos_token": "add_eos_token",
}
_GGUF_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                     "pad_token": "padding_token_id"}


def _is_gguf(source: str) -> bool:
    return source.lower().endswith(".gguf") and os.path.isfile(source)


def has_tokenizer(source: Optional[str]) -> bool:
    """Whether `source` (an HF folder or a .gguf file) carries a tokenizer this module can load (a GGUF:
    its vocabulary and the tokenizer kind, tokenizer.ggml.model)."""
    if not source:
        return False
    if os.path.isdir(source):
        return any(os.path.isfile(os.path.join(source, f)) for f in HF_TOKENIZER_FILES)
    if _is_gguf(source):
        from llmq.checkpoint import read_gguf_metadata

        metadata = read_gguf_metadata(source)  # membership only: the vocabulary stays on disk
        return "tokenizer.ggml.tokens" in metadata and "tokenizer.ggml.model" in metadata
    return False


@dataclasses.dataclass
class Tokenizer:
    """encode / decode over a transformers tokenizer (``.hf``), with where it came from."""

    hf: Any  # transformers.PreTrainedTokenizerBase
    source: str

    def encode(self, text: str) -> List[int]:
        """Token ids of `text`, with the BOS/EOS the tokenizer's config adds (Gemma: BOS)."""
        return list(self.hf(text).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens (BOS, EOS, padding) dropped."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.hf.eos_token_id

    @property
    def bos_token_id(self) -> Optional[int]:
        return self.hf.bos_token_id

    def __len__(self) -> int:
        return len(self.hf)

    def save(self, folder: str) -> List[str]:
        """Write tokenizer.json + tokenizer_config.json (and what transformers adds) into `folder`."""
        os.makedirs(folder, exist_ok=True)
        return [os.path.basename(p) for p in self.hf.save_pretrained(folder)]


_cache: Dict[Tuple, Tokenizer] = {}
_cache_lock = threading.Lock()


def _identity(source: str) -> Tuple:
    if os.path.isdir(source):
        stats = []
        for name in HF_TOKENIZER_FILES + ("tokenizer_config.json", "special_tokens_map.json"):
            path = os.path.join(source, name)
            if os.path.isfile(path):
                st = os.stat(path)
                stats.append((name, st.st_size, st.st_mtime_ns))
        return (os.path.realpath(source), tuple(stats))
    st = os.stat(source)
    return (os.path.realpath(source), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def load_tokenizer(source: str) -> Tokenizer:
    """The tokenizer of an HF folder or a GGUF file (built once per process per unchanged source).

    Raises ValueError (naming the source and what was expected) when it has none."""
    source = os.fspath(source)
    if not (os.path.isdir(source) or _is_gguf(source)):
        raise ValueError(f"{source}: expected an HF checkpoint folder or a .gguf file to read a tokenizer from")
    key = _identity(source)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    if os.path.isdir(source):
        hf = _from_hf_folder(source)
    else:
        hf = _from_gguf(source)
    tokenizer = Tokenizer(hf, source)
    with _cache_lock:
        _cache[key] = tokenizer
    return tokenizer


def write_tokenizer_files(source: str, folder: str) -> List[str]:
    """Write `source`'s tokenizer into `folder` as tokenizer.json + tokenizer_config.json, the files
    transformers' AutoTokenizer and mlx_lm.load read. Returns the file names written."""
    return load_tokenizer(source).save(folder)


def _from_hf_folder(folder: str):
    if not any(os.path.isfile(os.path.join(folder, f)) for f in HF_TOKENIZER_FILES):
        raise ValueError(f"{folder}: no tokenizer (expected {' or '.join(HF_TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


# The most tokens (and merges) a GGUF vocabulary may hold (the largest real ones hold 262,144).
MAX_GGUF_TOKENS = 1 << 22


def _check_list(metadata: Dict[str, Any], key: str, path: str, kinds: Tuple[type, ...], what: str,
                length: Optional[int] = None) -> Optional[List[Any]]:
    """metadata[key] as a list whose elements are all `kinds` (bools never count as numbers), of
    `length` elements when given; None when absent; ValueError naming the key otherwise."""
    if key not in metadata:
        return None
    value = metadata[key]
    if isinstance(value, (str, bytes)) or not isinstance(value, collections.abc.Sequence):
        raise ValueError(f"{path}: GGUF {key} is a {type(value).__name__}; expected an array of {what}")
    if len(value) > MAX_GGUF_TOKENS:
        raise ValueError(f"{path}: GGUF {key} has {len(value)} elements; at most {MAX_GGUF_TOKENS} are read")
    if length is not None and len(value) != length:
        raise ValueError(f"{path}: GGUF {key} has {len(value)} elements; expected {length} (one per token)")
    values = list(value)
    for i, v in enumerate(values):
        if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
            raise ValueError(f"{path}: GGUF {key} element {i} is {_short(v)}; expected {what}")
    return values


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def check_gguf_tokenizer(metadata: Dict[str, Any], path: str = "GGUF") -> None:
    """Refuse (ValueError, one line naming the key) tokenizer metadata no tokenizer can be built
    from: a tokenizer kind that is not a string, tokens that are not distinct strings, merges that
    are not "left right" string pairs, scores / token types that are not one number per token,
    special token ids outside the vocabulary, flags that are not booleans."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind is not None and not isinstance(kind, str):
        raise ValueError(f"{path}: GGUF tokenizer.ggml.model is {_short(kind)}; expected a string")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is not None and hasattr(tokens, "__len__") and not 0 < len(tokens) <= MAX_GGUF_TOKENS:
        raise ValueError(f"{path}: GGUF tokenizer.ggml.tokens has {len(tokens)} tokens; expected 1..{MAX_GGUF_TOKENS}")
    tokens = _check_list(metadata, "tokenizer.ggml.tokens", path, (str,), "strings (the tokens)")
    if tokens is None:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens in the GGUF metadata; the file carries no tokenizer")
    if len(set(tokens)) != len(tokens):
        seen: Dict[str, int] = {}
        for i, token in enumerate(tokens):
            if token in seen:
                raise ValueError(f"{path}: GGUF tokenizer.ggml.tokens holds {token!r} twice (ids {seen[token]} and "
                                 f"{i}); expected distinct tokens")
            seen[token] = i
    merges = _check_list(metadata, "tokenizer.ggml.merges", path, (str,), "strings 'left right'")
    for i, merge in enumerate(merges or ()):
        parts = merge.split(" ")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"{path}: GGUF tokenizer.ggml.merges element {i} is {_short(merge)}; expected two "
                             f"tokens separated by one space")
    _check_list(metadata, "tokenizer.ggml.scores", path, (int, float), "numbers (one score per token)", len(tokens))
    _check_list(metadata, "tokenizer.ggml.token_type", path, (int,), "integers (one type per token)", len(tokens))
    _check_list(metadata, "tokenizer.ggml.precompiled_charsmap", path, (int,), "bytes")
    for key in _GGUF_SPECIAL_IDS.values():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and (isinstance(token_id, bool) or not isinstance(token_id, int)
                                     or not 0 <= token_id < len(tokens)):
            raise ValueError(f"{path}: tokenizer.ggml.{key} = {_short(token_id)} is outside the vocabulary "
                             f"(0..{len(tokens) - 1})")
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix"):
        if key in metadata and not isinstance(metadata[key], bool):
            raise ValueError(f"{path}: GGUF {key} is {_short(metadata[key])}; expected a boolean")
    for key in ("tokenizer.ggml.pre", "tokenizer.chat_template"):
        if key in metadata and not isinstance(metadata[key], str):
            raise ValueError(f"{path}: GGUF {key} is {_short(metadata[key])}; expected a string")


def gguf_tokenizer_fields(metadata: Dict[str, Any], path: str = "GGUF") -> Tuple[str, Dict, Dict]:
    """(architecture, tokenizer fields, tokenizer_config kwargs) from GGUF metadata, in the shape
    transformers' GGUF tokenizer builders take (``get_gguf_tokenizer``'s result); the metadata is
    checked first (``check_gguf_tokenizer``)."""
    check_gguf_tokenizer(metadata, path)
    fields: Dict[str, Any] = {}
    for key, name in _GGUF_TOKENIZER_KEYS.items():
        if key in metadata:
            value = metadata[key]
            fields[name] = value if isinstance(value, (str, int, float, bool)) else list(value)
    config = {name: metadata[key] for key, name in _GGUF_CONFIG_KEYS.items() if key in metadata}
    if fields.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp's default for SentencePiece vocabularies
    tokens = fields["tokens"]
    for name, key in _GGUF_SPECIAL_IDS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None:
            config[name] = tokens[token_id]
    arch = metadata.get("general.architecture", "")
    return arch if isinstance(arch, str) else "", fields, config


def _from_gguf(path: str):
    from llmq.checkpoint import read_gguf_metadata

    return tokenizer_from_gguf_metadata(read_gguf_metadata(path), path)


def tokenizer_from_gguf_metadata(metadata: Dict[str, Any], path: str = "GGUF"):
    """The transformers tokenizer built from GGUF metadata (ValueError, one line naming `path` and the
    key, when it cannot be)."""
    arch, fields, config = gguf_tokenizer_fields(metadata, path)
    from transformers.integrations.gguf import gguf_tokenizer_mapping as gguf_tokenizers

    if fields.get("tokenizer_type") == "gemma4":
        config["add_bos_token"] = False  # as transformers: Gemma 4's chat template writes <bos> itself
    # transformers' convert_gguf_tokenizer, keeping the tokenizer object it builds: wrapping its
    # backend in a new PreTrainedTokenizerFast deep-copies it (12 s for a 262k vocabulary).
    # transformers' builders raise what they meet (TypeError, a bare Exception for a missing <unk>)
    # on metadata the checks above let through: one ValueError naming the file either way.
    try:
        tokenizer = gguf_tokenizers.select_tokenizer_builder(arch, fields.get("tokenizer_type"))(fields)
        tokenizer = gguf_tokenizers.add_gguf_special_tokens(tokenizer, fields)
        tokenizer = gguf_tokenizers.set_split_regex(tokenizer, fields)
        for name in _GGUF_SPECIAL_IDS:
            if name in config:
                setattr(tokenizer, name, config[name])
        if "chat_template" in config:
            tokenizer.chat_template = config["chat_template"]
        tokenizer.add_bos_token = bool(config.get("add_bos_token", False))
        tokenizer.add_eos_token = bool(config.get("add_eos_token", False))
        tokenizer.decode(tokenizer("The capital of France is").input_ids)  # some failures wait for the first use
    except Exception as e:  # noqa: BLE001  a third-party builder on untrusted metadata
        reason = " ".join(str(e).split())[:200]
        raise ValueError(f"{path}: its tokenizer cannot be built from the GGUF metadata ({type(e).__name__}: "
                         f"{reason})") from None
    tokenizer.init_kwargs.update(config)
    return tokenizer
