"""The model-layout stream checked against the model's own parameter list (names and shapes).

`expected_tensors` builds the model from its config on the meta device (no memory) and lists
what a checkpoint must provide. Two checks use it:

* `check_headers`: before anything is written, the checkpoint's header shapes (renamed and
  expert-stacked exactly as the stream will be, on meta tensors) against that list;
* `checked_stream`: the same check on the real stream, item by item and at its end, so a
  mismatch stops the run before the output is published (inputs whose shapes need a read,
  e.g. GGUF, are checked only this way).

A mismatch raises `StreamMismatchError`, one line naming the tensor(s), expected and found.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Iterator, List, Tuple

import torch

from llmq.checkpoint import CheckpointError
from models.pipeline.arch import Architecture
from models.pipeline.streaming import merge_experts_stream

Shape = Tuple[int, ...]


class StreamMismatchError(CheckpointError):
    """The checkpoint's tensors are not the ones the model built from its config has."""


@dataclasses.dataclass(frozen=True)
class ExpectedTensors:
    shapes: Dict[str, Shape]  # every tensor the model has, in its state_dict order
    optional: frozenset  # names a checkpoint may omit (a tied lm_head)

    def required(self) -> List[str]:
        return [n for n in self.shapes if n not in self.optional]


def expected_tensors(arch: Architecture, config) -> ExpectedTensors:
    model = arch.build_model(config, device="meta")
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    optional = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    return ExpectedTensors(shapes, frozenset(optional & set(shapes)))


def _names(names: List[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _check_one(name: str, shape: Shape, expected: ExpectedTensors, source: str) -> None:
    want = expected.shapes.get(name)
    if want is None:
        raise StreamMismatchError("the model built from its config has no such tensor (a checkpoint of another "
                                  "model or size?)", path=source, tensor=name)
    if tuple(shape) != want:
        raise StreamMismatchError(f"expected shape {list(want)} (the model built from its config), found "
                                  f"{list(shape)}: config and weights disagree", path=source, tensor=name)


def _check_complete(seen: Iterable[str], expected: ExpectedTensors, source: str) -> None:
    seen = set(seen)
    missing = [n for n in expected.required() if n not in seen]
    if not seen:
        raise StreamMismatchError(f"holds none of the model's {len(expected.required())} tensors (an empty "
                                  "weight_map?)", path=source)
    if missing:
        raise StreamMismatchError(f"lacks {len(missing)} of the model's {len(expected.required())} tensors: "
                                  f"{_names(missing)}", path=source)


def check_headers(arch: Architecture, shapes: Dict[str, Shape], experts_per_layer: int, expected: ExpectedTensors,
                  source: str) -> List[str]:
    """Check an HF checkpoint's header shapes (names after the key map); returns the model-layout
    names the stream will yield, in order."""
    metas = ((name, torch.empty(shape, device="meta")) for name, shape in shapes.items())
    names = []
    try:
        for name, tensor in merge_experts_stream(metas, arch, experts_per_layer):
            _check_one(name, tuple(tensor.shape), expected, source)
            names.append(name)
    except (ValueError, RuntimeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise StreamMismatchError(str(e), path=source) from None  # experts incomplete or of unequal shapes
    _check_complete(names, expected, source)
    return names


# What a model weight may be stored as: floats the reader converts exactly (safetensors and GGUF
# names); GGUF's block-quantized types are imported exactly too. Integers, booleans and 8-bit
# floats are not weights this pipeline reads (they would fail mid-stream).
FLOAT_TYPES = frozenset({"F64", "F32", "F16", "BF16"})
_NOT_WEIGHTS = ("BOOL", "U8", "U16", "U32", "U64", "I8", "I16", "I32", "I64")


def check_stored_types(types: Dict[str, str], source: str) -> None:
    """Before anything is written: every tensor is stored as a float (or a GGUF quantized block type);
    raise StreamMismatchError naming the first that is not."""
    for name, stored in types.items():
        if stored in _NOT_WEIGHTS or stored.startswith("F8_"):
            raise StreamMismatchError(f"stored as {stored}; model weights must be {', '.join(sorted(FLOAT_TYPES))}"
                                      f" (or GGUF quantized blocks)", path=source, tensor=name)


def checked_stream(items: Iterable[Tuple[str, object]], expected: ExpectedTensors,
                   source: str) -> Iterator[Tuple[str, object]]:
    """Pass the stream through, raising at the first unknown or misshapen tensor and, at its end,
    when a tensor never came."""
    seen = set()
    for name, value in items:
        _check_one(name, tuple(value.shape), expected, source)
        if name in seen:
            raise StreamMismatchError("appears twice in the stream", path=source, tensor=name)
        seen.add(name)
        yield name, value
    _check_complete(seen, expected, source)

