"""Where the pipeline's tensors come from: an HF checkpoint folder, a llama.cpp .gguf file, or the
embedded default (a tiny deterministic model written to a temporary folder).

`open_source` checks the input (one UsageError line naming it), reads its config, and returns a
`Source`: the HF config dict, the model's parsed config, the files to carry along, and a fresh
model-layout stream on each `stream()` call (renamed, experts stacked; not yet checked).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from llmq.checkpoint import CheckpointError, iter_checkpoint, read_gguf_metadata, source_files
from models.pipeline import gguf_input
from models.pipeline.arch import Architecture
from models.pipeline.default_model import write_default_checkpoint, write_tiny_tokenizer
from models.pipeline.streaming import merge_experts_stream
from models.pipeline.usage_error import UsageError

# Files a tokenizer loader may read (mlx-lm, transformers); carried from a real checkpoint when present.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "chat_template.json", "chat_template.jinja", "generation_config.json",
)


@dataclasses.dataclass
class Source:
    arch: Architecture
    kind: str  # "hf" | "gguf" | "embedded"
    path: str  # the checkpoint folder or .gguf file
    hf_config: Dict[str, Any]
    config: Any
    source_files: Tuple[str, ...]  # config.json, tokenizer...: what the bundle carries
    tokenizer_files: Tuple[str, ...]
    size_bytes: int

    @property
    def from_gguf(self) -> bool:
        return self.kind == "gguf"

    def stream(self, notes: Optional[List[str]] = None, chunk_bytes: Optional[int] = None) -> Iterator[Tuple[str, Any]]:
        """The checkpoint as model-layout tensors (GGUF: `notes` collects what the import did).
        chunk_bytes: an HF folder's tensors over this many bytes arrive as row blocks
        (``iter_checkpoint(chunk_bytes=)``); a GGUF's always arrive whole."""
        if self.from_gguf:
            return gguf_input.model_tensors(self.arch, self.path, self.config, notes=notes)
        return model_tensors(self.arch, self.path, self.config, chunk_bytes=chunk_bytes)


def model_tensors(arch: Architecture, folder: str, config, *,
                  chunk_bytes: Optional[int] = None) -> Iterator[Tuple[str, Any]]:
    """An HF folder as a stream of model-layout tensors (renamed, experts stacked per layer);
    with chunk_bytes, tensors over that size as row blocks (llmq.quant.chunked.RowBlocks)."""
    stream = iter_checkpoint(folder, key_map=arch.key_map, chunk_bytes=chunk_bytes)
    return merge_experts_stream(stream, arch, getattr(config, "num_experts", 0))


def read_hf_config(folder: str) -> Dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise UsageError(f"--checkpoint {folder}: no config.json (expected a Hugging Face checkpoint folder)")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not valid JSON ({e})") from None


def write_embedded(arch: Architecture, workdir: str, seed: int) -> str:
    """The embedded default's checkpoint folder under `workdir`."""
    checkpoint = write_default_checkpoint(arch, os.path.join(workdir, "checkpoint"), seed=seed)
    print(f"[embedded default] tiny deterministic {arch.name} model (seed {seed}) written to {checkpoint}")
    return checkpoint


def check_path(arch: Architecture, checkpoint: str) -> str:
    """The input's kind, "hf" or "gguf", after the checks that need no reading."""
    if gguf_input.is_gguf(checkpoint):
        if not os.path.isfile(checkpoint):
            raise UsageError(f"--checkpoint {checkpoint}: no such file")
        if arch.gguf_import is None:
            raise UsageError(f"--checkpoint {checkpoint}: {arch.name} has no GGUF import")
        return "gguf"
    if os.path.isfile(checkpoint):
        raise UsageError(f"--checkpoint {checkpoint}: is a file; expected a Hugging Face checkpoint folder "
                         "(config.json + safetensors) or a .gguf file")
    if not os.path.isdir(checkpoint):
        raise UsageError(f"--checkpoint {checkpoint}: no such folder")
    return "hf"


def open_source(arch: Architecture, checkpoint: str, kind: str, others: Sequence[Architecture] = (),
                workdir: Optional[str] = None) -> Source:
    """Read the input's config (GGUF: rebuilt from its metadata) and parse it as `arch`'s."""
    if kind == "gguf":
        _refuse_other_gguf(arch, others, checkpoint)
        try:  # config.json's place is taken by the GGUF metadata
            hf_config = gguf_input.hf_config(arch, checkpoint)
        except ValueError as e:
            if isinstance(e, CheckpointError):
                raise
            raise UsageError(f"{checkpoint}: cannot rebuild a {arch.name} config from its metadata ({e})") from None
    else:
        hf_config = read_hf_config(checkpoint)
        _refuse_other_config(arch, others, hf_config, checkpoint)
    try:
        config = arch.config_from_hf(hf_config)
    except (ValueError, KeyError, NotImplementedError) as e:
        source = checkpoint if kind == "gguf" else f"{checkpoint}/config.json"
        raise UsageError(f"{source}: not a supported {arch.name} config ({e})") from None
    if kind == "gguf":
        carried, tokenizer, size = (), (), os.path.getsize(checkpoint)
    else:
        carried = tuple(source_files(checkpoint))
        size = sum(os.path.getsize(os.path.join(checkpoint, f)) for f in os.listdir(checkpoint)
                   if f.endswith(".safetensors"))
        tokenizer = tuple(os.path.join(checkpoint, f) for f in TOKENIZER_FILES
                          if os.path.isfile(os.path.join(checkpoint, f)))
        if kind == "embedded" and workdir is not None and getattr(config, "vocab_size", 0) >= 257:
            # A random tiny model has no tokenizer: an offline byte-level one, outside the checkpoint folder
            # (so the bundle carries exactly what the checkpoint holds).
            tokenizer = tuple(write_tiny_tokenizer(os.path.join(workdir, "tokenizer"), config.vocab_size))
    return Source(arch=arch, kind=kind, path=checkpoint, hf_config=hf_config, config=config, source_files=carried,
                  tokenizer_files=tokenizer, size_bytes=size)


def gguf_tokenizer_files(checkpoint: str, folder: str) -> Tuple[str, ...]:
    """A GGUF file's tokenizer written into `folder` as the files transformers and mlx_lm load; () if
    the file carries no tokenizer."""
    from models.common.tokenizer import has_tokenizer, write_tokenizer_files

    if not has_tokenizer(checkpoint):
        return ()
    try:
        return tuple(os.path.join(folder, f) for f in write_tokenizer_files(checkpoint, folder))
    except ValueError as e:
        raise UsageError(f"--checkpoint {checkpoint}: its tokenizer cannot be rebuilt ({e})") from None


def _refuse_other_config(arch: Architecture, others: Sequence[Architecture], hf_config: Dict, checkpoint: str) -> None:
    if arch.reads(hf_config):
        return
    for other in others:
        if other.reads(hf_config):
            raise UsageError(f"--checkpoint {checkpoint}: a {other.name} checkpoint (model_type "
                             f"{hf_config.get('model_type')!r}); this binary quantizes {arch.name}: use "
                             f"`bazel run {other.target} -- --checkpoint=...`")


def _refuse_other_gguf(arch: Architecture, others: Sequence[Architecture], checkpoint: str) -> None:
    found = read_gguf_metadata(checkpoint).get("general.architecture")
    if found == arch.gguf_import.GGUF_ARCH:
        return
    for other in others:
        if other.gguf_import is not None and found == other.gguf_import.GGUF_ARCH:
            raise UsageError(f"--checkpoint {checkpoint}: a {other.name} GGUF (general.architecture {found!r}); "
                             f"this binary quantizes {arch.name}: use `bazel run {other.target} -- --checkpoint=...`")
