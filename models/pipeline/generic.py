"""Model-free quantization: an `Architecture` for any Hugging Face checkpoint, built from the checkpoint alone.

llmq's library needs no model to quantize (llmq.checkpoint readers + llmq.quant.quantize_stream, recipe
rules over tensor names); only the pipeline's checks and verification asked for one. `generic_architecture`
fills those parts from the checkpoint itself:

* the tensor list the stream is checked against is the checkpoint's own (names and shapes from its
  safetensors headers; every tensor kept, nothing renamed or stacked);
* the presets are llmq's generic ones (llmq.quant.presets: projections quantized, embeddings 8-bit,
  norms / routers / biases kept);
* verification goes through transformers' own class for the architecture when transformers knows
  it (models/pipeline/generic_verify.py), else compares each tensor with its original.

Backends that need model knowledge (`Backend.needs_model`) are refused with their reason, but GGUF for the
llama-family model_types whose llama.cpp names, transforms and metadata gguf-py's tables and llama.cpp's converter
conventions give (models/pipeline/generic_gguf.py); where llmq has its own code for the model_type
(models/architectures.py), the summary names that model's target.
"""

from __future__ import annotations

import dataclasses
import re
import types
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from models.pipeline.arch import Architecture, architecture_for_gguf, registered_architectures
from models.pipeline.usage_error import UsageError

TARGET = "//models:quantize"
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|layer)\.(\d+)\.")


class _Layout(nn.Module):
    """The checkpoint's own tensors as a model's state_dict: meta tensors of its names and shapes."""

    def __init__(self, shapes: Dict[str, Tuple[int, ...]]):
        super().__init__()
        self._shapes = dict(shapes)

    def state_dict(self, *args, **kwargs):  # type: ignore[override]
        return {name: torch.empty(shape, device="meta") for name, shape in self._shapes.items()}


@dataclasses.dataclass(frozen=True)
class GenericArchitecture(Architecture):
    """An Architecture read off one checkpoint (see the module docstring)."""

    # transformers' config for the architecture (None: transformers has no causal-LM class for it) and why not.
    transformers_config: Any = None
    transformers_missing: str = ""
    # The layer count recipes with negative layer indices bind to, counted from the tensor names.
    layers: int = 0
    # llmq's own Architecture for this model_type, if it has one (its target does more: MLX, .pte).
    own: Optional[Architecture] = None
    # Why --backend=gguf cannot be written ("" where gguf_import holds the checkpoint's GGUF export:
    # models/pipeline/generic_gguf.py).
    gguf_missing: str = ""

    def num_layers(self, config) -> int:
        return self.layers

    def refuses(self, writer) -> str:
        """Why model-free quantization cannot write `writer`'s output ("" where it can)."""
        if not writer.needs_model:
            return ""
        if writer.name == "gguf":  # llama.cpp's names, transforms and metadata: generic_gguf.py's table
            return self.gguf_missing
        why = f"it needs model knowledge: {writer.needs_model}"
        if self.own is not None:
            why += f"; llmq has model code for {self.name}: bazel run {self.own.target}"
        return why


def _layers_in(names) -> int:
    found = [int(m.group(1)) for n in names for m in [_LAYER.search(n)] if m]
    return max(found) + 1 if found else 0


def generic_architecture(checkpoint: str, hf_config: Dict[str, Any],
                         shapes: Optional[Dict[str, Tuple[int, ...]]] = None) -> GenericArchitecture:
    """The model-free Architecture of the HF folder `checkpoint` (its config.json dict `hf_config`; `shapes`:
    its tensors' names and shapes where they are not its safetensors headers', a GGUF's)."""
    from llmq.checkpoint import checkpoint_shapes
    from models.pipeline.arch import architecture_for_model_type
    from models.pipeline.generic_gguf import gguf_export
    from models.pipeline.generic_verify import verify
    from models.pipeline.transformers_model import transformers_model_class

    model_type = hf_config.get("model_type")
    name = model_type if isinstance(model_type, str) and model_type else "unknown"
    shapes = shapes or checkpoint_shapes(checkpoint)
    if not shapes:
        raise UsageError(f"--checkpoint {checkpoint}: no safetensors tensors (model-free quantization reads "
                         "*.safetensors; expected a Hugging Face checkpoint folder)")
    tf_config, missing = transformers_model_class(hf_config)
    config = tf_config if tf_config is not None else types.SimpleNamespace(**hf_config)
    export, gguf_missing = gguf_export(hf_config, shapes)
    return GenericArchitecture(
        name=name,
        tiny_hf_config=lambda: dict(hf_config),
        config_from_hf=lambda _dict: config,
        build_model=lambda _config, device="meta", dtype=None: _Layout(shapes),
        key_map=lambda key: key,
        hf_model_types=(model_type,),
        target=TARGET,
        verify=verify,
        transformers_config=tf_config,
        transformers_missing=missing,
        layers=_layers_in(shapes),
        own=architecture_for_model_type(model_type),
        gguf_import=export,
        gguf_missing=gguf_missing,
    )


def gguf_architecture(checkpoint: str) -> Architecture:
    """The registered architecture that imports the GGUF `checkpoint` (by general.architecture), else the
    model-free one of a llama-family GGUF (generic_gguf.py, read back through gguf-py's table); a GGUF of
    another architecture is one UsageError line naming what is supported."""
    from llmq.checkpoint import read_gguf_metadata
    from models.pipeline import generic_gguf

    found = read_gguf_metadata(checkpoint).get("general.architecture")
    arch = architecture_for_gguf(found)
    if arch is not None:
        return arch
    if found not in generic_gguf.GGUF_ARCHITECTURES:
        raise UsageError(f"--checkpoint {checkpoint}: a GGUF of general.architecture {found!r}, which no llmq "
                         f"model imports; {supported()}")
    return _generic_from_gguf(checkpoint, found)


def _generic_from_gguf(checkpoint: str, found: str) -> GenericArchitecture:
    """The model-free Architecture of a llama-family GGUF: its config.json and tensor names rebuilt from its
    metadata and gguf-py's table (generic_gguf.hf_config_from_gguf / hf_shapes)."""
    from llmq.checkpoint.gguf_import import GGUFFile
    from models.pipeline import generic_gguf, gguf_input

    with GGUFFile(checkpoint) as f:
        metadata, shapes = dict(f.metadata), {t.name: tuple(t.shape) for t in f.tensors}

    def no_read(name):
        raise ValueError(f"{name}: not read while rebuilding the config")

    try:
        hf_config = generic_gguf.hf_config_from_gguf(metadata, gguf_input.GGUFTensors(shapes=shapes, read=no_read))
        names = generic_gguf.hf_shapes(found, shapes)
    except ValueError as e:
        raise UsageError(f"--checkpoint {checkpoint}: {e}") from None
    arch = generic_architecture(checkpoint, hf_config, shapes=names)
    if arch.gguf_import is None:
        raise UsageError(f"--checkpoint {checkpoint}: {arch.gguf_missing}")
    return arch


def supported() -> str:
    """What the model-free target reads, in one clause."""
    gguf = sorted(a.gguf_architecture for a in registered_architectures() if a.gguf_architecture)
    from models.pipeline.generic_gguf import GGUF_ARCHITECTURES

    gguf += [a for a in GGUF_ARCHITECTURES if a not in gguf]
    return ("supported: a Hugging Face checkpoint folder (config.json + *.safetensors) of any architecture, "
            f"or a .gguf file of general.architecture {', '.join(gguf)}")


def _no_model(*_args, **_kwargs):
    raise UsageError(f"model-free quantization needs --checkpoint; {supported()}")


# --list_recipes without --checkpoint: llmq's generic presets only.
LISTING = Architecture(name="any", tiny_hf_config=_no_model, config_from_hf=_no_model, build_model=_no_model,
                       key_map=lambda key: key, target=TARGET)


def model_free_architecture(checkpoint: Optional[str], backend: str) -> Architecture:
    """The Architecture //models:quantize runs for `checkpoint`: a GGUF's registered architecture (llmq's
    model code imports it), else the model-free one of an HF folder or a llama-family GGUF; a backend that
    needs model knowledge is refused, one line, before any work."""
    import os

    from llmq.backend import backend_names, get_backend
    from models.pipeline import generic_gguf, gguf_input
    from models.pipeline.inputs import read_hf_config

    if checkpoint is None:
        _no_model()
    try:
        writer = get_backend(backend)
    except ValueError as e:
        raise UsageError(f"--backend: {e}") from None
    if gguf_input.is_gguf(checkpoint):
        if not os.path.isfile(checkpoint):
            raise UsageError(f"--checkpoint {checkpoint}: no such file")
        arch = gguf_architecture(checkpoint)
        if not isinstance(arch, GenericArchitecture):
            print(f"note: a {arch.gguf_architecture} GGUF: read by llmq's {arch.name} model code (its GGUF import), "
                  f"as {arch.target} does")
            return arch
        read_as = (f"a {arch.gguf_architecture} GGUF, read model-free as a {arch.name} checkpoint (names by gguf-py's "
                   "table, llama.cpp's q/k row order and expert stacks undone)")
    else:
        if not os.path.isdir(checkpoint):
            raise UsageError(f"--checkpoint {checkpoint}: {'no such folder' if not os.path.exists(checkpoint) else 'not a folder or a .gguf file'}; "
                             f"{supported()}")
        hf_config = read_hf_config(checkpoint)
        if not isinstance(hf_config, dict):
            raise UsageError(f"{checkpoint}/config.json: expected a JSON object")
        arch = generic_architecture(checkpoint, hf_config)
        read_as = f"a {arch.name} checkpoint"
    why = arch.refuses(writer)
    if why:
        free = [n for n in backend_names() if not get_backend(n).needs_model]
        raise UsageError(f"--backend {backend}: {why}; model-free quantization writes {', '.join(free)}"
                         + (f", and gguf for model_type {generic_gguf.supported()}" if backend != "gguf" else ""))
    own = (f"; llmq also has model code for it: bazel run {arch.own.target} (its MLX / GGUF / .pte outputs)"
           if arch.own is not None else "")
    print(f"note: model-free quantization of {read_as}: recipe rules over its tensor names{own}")
    return arch
