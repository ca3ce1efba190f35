"""--checkpoint=model.gguf: a llama.cpp GGUF file as the pipeline's input.

The GGUF file replaces both halves of an HF checkpoint folder:

* config.json  <- the GGUF key/value metadata, through the model's ``hf_config_from_gguf``;
* safetensors  <- ``iter_checkpoint(file.gguf)`` (quantized blocks arrive as exact canonical
  ``GroupQuantizedWeight``s), through the model's ``GGUFConverter``, which renames to our
  module names and undoes the value transforms llama.cpp's converter applied.

Each model package provides the per-architecture part as a module (``models/<m>/gguf_checkpoint.py``;
not ``gguf.py``, which would shadow gguf-py for a script run from that folder) named by
``Architecture.gguf_import``, with:

    GGUF_ARCH: str                                   -- general.architecture it reads
    hf_config_from_gguf(metadata, tensors) -> dict   -- an HF config.json dict
    GGUFConverter(config)                            -- .convert(name, value) -> [(name, value)], .close()

This module also holds the helpers those share: typed metadata lookups that say which key is
missing, exact permutations of quantized rows / column blocks, and the gate|up expert fuser.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from llmq.checkpoint import UnsupportedCheckpointError, iter_checkpoint
from llmq.checkpoint.gguf_import import GGUFFile, GGUFTensorInfo
from llmq.quant import GroupQuantizedWeight, fuse_along_output
from llmq.quant.formats import dequantize_canonical, pack_bits, unpack_bits

Value = Union[torch.Tensor, GroupQuantizedWeight]


def is_gguf(path: Optional[str]) -> bool:
    return path is not None and path.lower().endswith(".gguf")


@dataclasses.dataclass(frozen=True)
class GGUFTensors:
    """What a config reader may look at besides the metadata: tensor shapes (torch order) and a
    reader for small tensors (e.g. Gemma 4's rope_freqs)."""

    shapes: Dict[str, Tuple[int, ...]]
    read: Callable[[str], Value]


class Metadata:
    """GGUF KV metadata of one architecture: ``m.get("block_count")`` reads ``<arch>.block_count``
    and raises a ValueError naming the key when it is missing and has no default."""

    _REQUIRED = object()

    def __init__(self, metadata: Dict[str, Any], arch: str):
        self.raw, self.arch = metadata, arch
        found = metadata.get("general.architecture")
        if found != arch:
            raise ValueError(f"GGUF general.architecture is {found!r}; expected {arch!r}")

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.raw

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        full = key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"
        if full in self.raw:
            return self.raw[full]
        if default is Metadata._REQUIRED:
            raise ValueError(f"GGUF metadata has no {full!r}; it is needed to rebuild the config")
        return default

    def scalar(self, key: str, default: Any = _REQUIRED, *, per_layer: Optional[Sequence[bool]] = None) -> Any:
        """A value llama.cpp may store per layer as an array: must be uniform (or uniform over the
        layers `per_layer` selects)."""
        value = self.get(key, default)
        if isinstance(value, collections.abc.Sequence) and not isinstance(value, str):
            chosen = list(value) if per_layer is None else [v for v, keep in zip(value, per_layer) if keep]
            if len(set(chosen)) != 1:
                raise ValueError(f"GGUF {self.arch}.{key} varies across layers ({list(value)}); not supported")
            return chosen[0]
        return value

    def vocab_size(self, tensors: GGUFTensors) -> int:
        if self.has("vocab_size"):
            return int(self.get("vocab_size"))
        if "token_embd.weight" in tensors.shapes:
            return int(tensors.shapes["token_embd.weight"][0])
        tokens = self.raw.get("tokenizer.ggml.tokens")  # len() does not decode a lazy GGUFArray
        if tokens is not None and len(tokens):
            return len(tokens)
        raise ValueError("GGUF: vocabulary size unknown (no vocab_size key, token_embd.weight or token list)")


# ---- exact rearrangements of (possibly quantized) weights ------------------------------------


def permute_rows(value: Value, perm: torch.Tensor) -> Value:
    """value[..., perm, :] -- exact on quantized weights (each row carries its own groups)."""
    if isinstance(value, GroupQuantizedWeight):
        return dataclasses.replace(value, qdata=value.qdata.index_select(-2, perm),
                                   scale=value.scale.index_select(-2, perm), bias=value.bias.index_select(-2, perm))
    if value.dim() == 1:
        return value.index_select(0, perm)
    return value.index_select(-2, perm)


def permute_column_blocks(value: Value, block_perm: torch.Tensor, block: int, *, name: str,
                          notes: Optional[List[str]] = None) -> Value:
    """Reorder the input dimension K in whole blocks of `block` columns: out block i = in block
    block_perm[i]. Exact on quantized weights when a block is a whole number of groups. When
    blocks split groups (moving part of a group would change its scale), the weight is
    dequantized exactly (float32) and reordered, with a note in `notes`: the recipe then
    quantizes it like any float tensor."""
    k = value.shape[-1]
    if torch.equal(block_perm, torch.arange(len(block_perm))):
        return value
    cols = (block_perm[:, None] * block + torch.arange(block)[None, :]).reshape(-1)
    if not isinstance(value, GroupQuantizedWeight):
        return value.index_select(-1, cols)
    if block % value.group_size:
        if notes is not None:
            notes.append(f"{name}: GGUF reorders its input columns in blocks of {block}, which split its "
                         f"{value.bits}-bit quantization groups of {value.group_size}; dequantized (exactly), "
                         f"reordered, and left to the recipe to quantize")
        return dequantize_canonical(value).index_select(-1, cols)
    q = unpack_bits(value.qdata, value.bits, k).index_select(-1, cols)
    groups = (block_perm[:, None] * (block // value.group_size)
              + torch.arange(block // value.group_size)[None, :]).reshape(-1)
    return dataclasses.replace(value, qdata=pack_bits(q, value.bits), scale=value.scale.index_select(-1, groups),
                               bias=value.bias.index_select(-1, groups))


def refuse_quantized(name: str, value: Value, why: str) -> torch.Tensor:
    """A transform that is not exact on quantized data: refuse it by name."""
    if isinstance(value, GroupQuantizedWeight):
        raise ValueError(f"{name}: stored quantized ({value.bits}-bit) in the GGUF, but importing it needs {why}, "
                         f"which is not exact on quantized data")
    return value


class ExpertPairFuser:
    """Buffers GGUF's separate gate and up expert stacks [E, F, D] per layer and emits our fused
    ``gate_up`` [E, 2F, D] once both halves are seen: exactly (fuse_along_output) when both are
    quantized alike, by concatenation when both are dense, else both dequantized (exact) and
    concatenated, with a note, for the recipe to quantize."""

    def __init__(self):
        self._pending: Dict[str, Dict[str, Value]] = {}
        self.notes: List[str] = []

    def add(self, target: str, half: str, value: Value) -> List[Tuple[str, Value]]:
        parts = self._pending.setdefault(target, {})
        if half in parts:
            raise ValueError(f"{target}: GGUF holds its {half} half twice")
        parts[half] = value
        if len(parts) < 2:
            return []
        del self._pending[target]
        gate, up = parts["gate"], parts["up"]
        if gate.shape[:-2] != up.shape[:-2] or gate.shape[-1] != up.shape[-1]:
            raise ValueError(f"{target}: gate {list(gate.shape)} and up {list(up.shape)} expert stacks do not match")
        quantized = [isinstance(v, GroupQuantizedWeight) for v in (gate, up)]
        if all(quantized) and (gate.bits, gate.group_size) == (up.bits, up.group_size):
            return [(target, fuse_along_output([gate, up]))]
        if not any(quantized):
            return [(target, torch.cat([gate, up], dim=-2))]
        self.notes.append(f"{target}: gate and up are stored in different formats; dequantized (exactly) "
                          f"and concatenated, so the recipe quantizes them")
        dense = [dequantize_canonical(v) if isinstance(v, GroupQuantizedWeight) else v.float() for v in (gate, up)]
        return [(target, torch.cat(dense, dim=-2))]

    def close(self) -> None:
        if self._pending:
            target, parts = next(iter(self._pending.items()))
            raise ValueError(f"GGUF ended with only the {list(parts)} half of {target} (expected gate and up)")


# ---- the pipeline hooks ----------------------------------------------------------------------


def _module(arch):
    if arch.gguf_import is None:
        raise ValueError(f"{arch.name} has no GGUF import")
    return arch.gguf_import


def hf_config(arch, path: str) -> Dict[str, Any]:
    """The HF config.json dict of a GGUF file (raises ValueError naming what cannot be recovered)."""
    gguf_file = GGUFFile(path)
    try:
        infos = {t.name: t for t in gguf_file.tensors}
        tensors = GGUFTensors(shapes={n: t.shape for n, t in infos.items()},
                              read=lambda name: gguf_file.read(infos[name]))
        return _module(arch).hf_config_from_gguf(dict(gguf_file.metadata), tensors)
    finally:
        gguf_file.close()


_FLOAT_TYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
_INT_TYPES = {"I8", "I16", "I32", "I64"}


def model_dtype(tensors: Iterable[GGUFTensorInfo]) -> torch.dtype:
    """The one float dtype the import gives every tensor (our models need one dtype throughout).

    llama.cpp's converter mixes them: with ``--outtype auto`` on a bf16 checkpoint it writes
    matrices as BF16 but norms, routers, ``ssm_a`` and conv1d as F32. When nothing is
    quantized and the float tensors are one 16-bit type plus F32 (the type llama.cpp keeps
    small tensors in), the model dtype is that 16-bit type; otherwise it is float32, gguf-py's
    dequantization dtype, to which every GGUF type converts exactly.
    """
    infos = list(tensors)
    if any(t.type_name not in _FLOAT_TYPES and t.type_name not in _INT_TYPES for t in infos):
        return torch.float32  # block-quantized tensors dequantize to float32
    half = {t.type_name for t in infos if t.type_name in _FLOAT_TYPES} - {"F32"}
    if len(half) == 1 and half <= {"F16", "BF16"}:
        return _FLOAT_TYPES[half.pop()]
    return torch.float32


def _as_dtype(value: Value, dtype: torch.dtype) -> Value:
    if isinstance(value, GroupQuantizedWeight):
        return value if value.dtype == dtype else dataclasses.replace(value, dtype=dtype)
    return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value


def model_tensors(arch, path: str, config, *, notes: Optional[List[str]] = None) -> Iterator[Tuple[str, Value]]:
    """The GGUF file as a stream of model-layout tensors (renamed, transforms undone, gate|up fused),
    every float tensor in one dtype (``model_dtype``)."""
    with GGUFFile(path) as gguf_file:  # the header is parsed once per process (gguf_header's cache)
        dtype = model_dtype(gguf_file.tensors)
        stored = sorted({t.type_name for t in gguf_file.tensors if t.type_name in _FLOAT_TYPES})
    converter = _module(arch).GGUFConverter(config)
    for name, value in iter_checkpoint(path):
        try:
            converted = converter.convert(name, value)
        except UnsupportedCheckpointError:
            raise
        except ValueError as e:  # reported like any other bad input: file and tensor named
            raise UnsupportedCheckpointError(str(e), path=path, tensor=name) from None
        for out_name, out_value in converted:
            yield out_name, _as_dtype(out_value, dtype)
    try:
        converter.close()
    except ValueError as e:
        raise UnsupportedCheckpointError(str(e), path=path) from None
    if notes is not None:
        if len(stored) > 1 or (stored and _FLOAT_TYPES[stored[0]] != dtype):
            notes.append(f"the GGUF stores float tensors as {', '.join(stored)}; imported as {dtype} "
                         f"throughout, so the model has one dtype")
        notes.extend(converter.notes)
