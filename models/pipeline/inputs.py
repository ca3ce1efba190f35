"""Where the pipeline's tensors come from: an HF checkpoint folder, a llama.cpp .gguf file, or the
embedded default (a tiny deterministic model written to a temporary folder).

`open_input` checks the input (one UsageError line naming it), reads its config, and returns a
`ModelInput`: the HF config dict, the model's parsed config, the files to carry along, and a fresh
model-layout stream on each `stream()` call (renamed, experts stacked; not yet checked).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from llmq.checkpoint import (
    TOKENIZER_FILES,
    CheckpointError,
    iter_checkpoint,
    read_gguf_metadata,
    side_file,
    side_files,
    source_files,
)
from models.pipeline import gguf_input
from models.pipeline.arch import Architecture, architecture_for_gguf, architecture_for_model_type
from models.pipeline.default_model import write_default_checkpoint, write_tiny_tokenizer
from models.pipeline.streaming import merge_experts_stream
from models.pipeline.usage_error import UsageError


@dataclasses.dataclass
class ModelInput:
    """One input of a run: its kind and path, its configs, the files it carries and its tensors (stream())."""

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

    def stream(self, notes: Optional[List[str]] = None, chunk_bytes: Optional[int] = None,
               only: Optional[Callable[[str], bool]] = None) -> Iterator[Tuple[str, Any]]:
        """The checkpoint as model-layout tensors (GGUF: `notes` collects what the import did).
        chunk_bytes: an HF folder's tensors over this many bytes arrive as row blocks
        (``iter_checkpoint(chunk_bytes=)``); a GGUF's always arrive whole. only: the model names to
        give (an HF folder's others are never read; see `reads_selectively`)."""
        if self.from_gguf:
            stream = gguf_input.model_tensors(self.arch, self.path, self.config, notes=notes)
            return stream if only is None else ((n, v) for n, v in stream if only(n))
        return model_tensors(self.arch, self.path, self.config, chunk_bytes=chunk_bytes, only=only)

    @property
    def reads_selectively(self) -> bool:
        """Whether stream(only=) skips reading the tensors it leaves out (an HF folder: yes)."""
        return not self.from_gguf


def model_tensors(arch: Architecture, folder: str, config, *, chunk_bytes: Optional[int] = None,
                  only: Optional[Callable[[str], bool]] = None) -> Iterator[Tuple[str, Any]]:
    """An HF folder as a stream of model-layout tensors (renamed, experts stacked per layer);
    with chunk_bytes, tensors over that size as row blocks (llmq.quant.row_blocks.RowBlocks);
    with only, just the tensors whose (renamed) name it accepts (the others are never read)."""
    key_map = arch.key_map
    if only is not None:
        def key_map(name: str, _map=arch.key_map) -> Optional[str]:
            out = _map(name)
            return out if out is not None and only(out) else None
    stream = iter_checkpoint(folder, key_map=key_map, chunk_bytes=chunk_bytes)
    return merge_experts_stream(stream, arch, getattr(config, "num_experts", 0))


def read_hf_config(folder: str) -> Dict:
    path = side_file(folder, "config.json")  # a link out of the folder is refused (llmq.checkpoint.side_files)
    if path is None:
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


def open_input(arch: Architecture, checkpoint: str, kind: str, workdir: Optional[str] = None) -> ModelInput:
    """Read the input's config (GGUF: rebuilt from its metadata) and parse it as `arch`'s; a checkpoint
    another registered architecture reads (by model_type / general.architecture) names its target."""
    if kind == "gguf":
        _refuse_other_gguf(arch, checkpoint)
        try:  # config.json's place is taken by the GGUF metadata
            hf_config = gguf_input.hf_config(arch, checkpoint)
        except ValueError as e:
            if isinstance(e, CheckpointError):
                raise
            raise UsageError(f"{checkpoint}: cannot rebuild a {arch.name} config from its metadata ({e})") from None
    else:
        hf_config = read_hf_config(checkpoint)
        _refuse_other_config(arch, hf_config, checkpoint)
    try:
        config = arch.config_from_hf(hf_config)
    except (ValueError, KeyError, NotImplementedError) as e:
        where = checkpoint if kind == "gguf" else f"{checkpoint}/config.json"
        raise UsageError(f"{where}: not a supported {arch.name} config ({e})") from None
    if kind == "gguf":
        carried, tokenizer, size = (), (), os.path.getsize(checkpoint)
    else:
        carried = tuple(source_files(checkpoint))
        size = sum(os.path.getsize(os.path.join(checkpoint, f)) for f in os.listdir(checkpoint)
                   if f.endswith(".safetensors"))
        tokenizer = tuple(side_files(checkpoint, TOKENIZER_FILES))
        if kind == "embedded" and workdir is not None and getattr(config, "vocab_size", 0) >= 257:
            # A random tiny model has no tokenizer: an offline byte-level one, outside the checkpoint folder
            # (so the bundle carries exactly what the checkpoint holds).
            tokenizer = tuple(write_tiny_tokenizer(os.path.join(workdir, "tokenizer"), config.vocab_size))
    return ModelInput(arch=arch, kind=kind, path=checkpoint, hf_config=hf_config, config=config, source_files=carried,
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


def gguf_side_files(model_input: "ModelInput", folder: str, *, tokenizer_required: bool) -> None:
    """A GGUF input's side files, made in `folder`: config.json (the HF config rebuilt from its metadata,
    what the run parses) and its tokenizer (gguf_tokenizer_files), set as what the outputs carry
    (model_input.source_files, taken from `folder` by llmq.checkpoint.source_files) and as its tokenizer
    files: a bundle or HF folder written from a GGUF file then loads in transformers as one from an HF
    folder does. A tokenizer that cannot be rebuilt is an error where the output needs one
    (`tokenizer_required`), else a note and the output carries config.json alone."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(model_input.hf_config), f, indent=2, sort_keys=True)
    try:
        model_input.tokenizer_files = gguf_tokenizer_files(model_input.path, folder)
    except UsageError as e:
        if tokenizer_required:
            raise
        print(f"note: the output carries no tokenizer: {e}")
    model_input.source_files = tuple(source_files(folder))


def _refuse_other_config(arch: Architecture, hf_config: Dict, checkpoint: str) -> None:
    if arch.reads(hf_config):
        return
    other = architecture_for_model_type(hf_config.get("model_type"))
    if other is not None:
        raise UsageError(f"--checkpoint {checkpoint}: a {other.name} checkpoint (model_type "
                         f"{hf_config.get('model_type')!r}); this binary quantizes {arch.name}: use "
                         f"`bazel run {other.target} -- --checkpoint=...`")


def _refuse_other_gguf(arch: Architecture, checkpoint: str) -> None:
    found = read_gguf_metadata(checkpoint).get("general.architecture")
    if found == arch.gguf_architecture:
        return
    other = architecture_for_gguf(found)
    if other is not None:
        raise UsageError(f"--checkpoint {checkpoint}: a {other.name} GGUF (general.architecture {found!r}); "
                         f"this binary quantizes {arch.name}: use `bazel run {other.target} -- --checkpoint=...`")
