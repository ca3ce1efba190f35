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
import functools
import math
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
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
    reader for small tensors (e.g. Gemma 4's rope_freqs). ``blocks`` and ``largest_dim`` are the
    bounds the metadata's counts and sizes are checked against (Metadata)."""

    shapes: Dict[str, Tuple[int, ...]]
    read: Callable[[str], Value]

    @functools.cached_property
    def blocks(self) -> int:
        """How many distinct ``blk.N`` blocks the file holds tensors of."""
        return len({name.split(".", 2)[1] for name in self.shapes
                    if name.startswith("blk.") and name.split(".", 2)[1].isdigit()})

    @functools.cached_property
    def largest_dim(self) -> int:
        """The largest dimension of any tensor in the file (0 if it holds none)."""
        return max((d for shape in self.shapes.values() for d in shape), default=0)


_INT_LIMIT = 1 << 31  # sizes with no tensor to bound them (context length, sliding window)
_Number = Union[int, float]


class Metadata:
    """GGUF KV metadata of one architecture, read through typed, bounded accessors.

    ``m.count("block_count", hi=tensors.blocks)`` reads ``<arch>.block_count`` and returns an int in
    the bounds; a missing key without a default, a value of the wrong type (an array where a number
    belongs, a string, a bool, NaN) or out of its bounds raises a one-line ValueError naming the
    key, the value and what was expected. Sizes (``dim``) are bounded by the largest dimension of
    any tensor the file holds, layer counts by the blocks it holds tensors of, so a hostile value
    (block_count = 2^40, head_count = 0) stops here instead of in a loop, an allocation or a division."""

    _REQUIRED = object()

    def __init__(self, metadata: Dict[str, Any], arch: str, tensors: Optional[GGUFTensors] = None):
        self.raw, self.arch, self.tensors = metadata, arch, tensors
        found = metadata.get("general.architecture")
        if found != arch:
            raise ValueError(f"GGUF general.architecture is {_short(found)}; expected {arch!r}")

    def full_key(self, key: str) -> str:
        return key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"

    def has(self, key: str) -> bool:
        return self.full_key(key) in self.raw

    def is_array(self, key: str) -> bool:
        return _is_sequence(self.raw.get(self.full_key(key)))

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        """The raw value (any type); prefer the typed accessors below."""
        full = self.full_key(key)
        if full in self.raw:
            return self.raw[full]
        if default is Metadata._REQUIRED:
            raise ValueError(f"GGUF metadata has no {full!r}; it is needed to rebuild the config")
        return default

    def _bad(self, key: str, value: Any, expected: str) -> ValueError:
        return ValueError(f"GGUF metadata {self.full_key(key)!r} = {_short(value)}: expected {expected}")

    def _int(self, key: str, value: Any, lo: int, hi: int, why: str) -> int:
        if not _is_int(value):
            raise self._bad(key, value, f"an integer in {lo}..{hi}{why}")
        value = int(value)
        if not lo <= value <= hi:
            raise self._bad(key, value, f"an integer in {lo}..{hi}{why}")
        return value

    def count(self, key: str, default: Any = _REQUIRED, *, lo: int = 1, hi: int = _INT_LIMIT, why: str = "") -> int:
        """An integer in lo..hi (``why`` says where hi comes from)."""
        if not self.has(key) and default is not Metadata._REQUIRED:
            return default
        return self._int(key, self.get(key), lo, hi, why)

    def layers(self, key: str = "block_count", *, extra: int = 0) -> int:
        """A layer count: 1..the blocks the file holds tensors of (+ extra)."""
        return self.count(key, hi=self._blocks() + extra,
                          why=f" (the file holds tensors of {self._blocks()} blk.N blocks)")

    def dim(self, key: str, default: Any = _REQUIRED, *, lo: int = 1) -> int:
        """A size or a head count: lo..the largest dimension of any tensor in the file."""
        largest = self._largest()
        return self.count(key, default, lo=lo, hi=max(largest, lo),
                          why=f" (the largest tensor dimension in the file is {largest})")

    def number(self, key: str, default: Any = _REQUIRED, *, lo: float = 0.0, hi: float = float("inf"),
               lo_open: bool = False) -> Optional[float]:
        """A finite number in [lo, hi] ((lo, hi] with lo_open); a None default passes through."""
        if not self.has(key) and default is not Metadata._REQUIRED:
            return default
        value = self.get(key)
        bound = f"a finite number {'>' if lo_open else '>='} {lo:g}" + ("" if hi == float("inf") else f" and <= {hi:g}")
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise self._bad(key, value, bound)
        value = float(value)
        if not (math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi):
            raise self._bad(key, value, bound)
        return value

    def text(self, key: str, default: Any = _REQUIRED) -> Optional[str]:
        if not self.has(key) and default is not Metadata._REQUIRED:
            return default
        value = self.get(key)
        if not isinstance(value, str):
            raise self._bad(key, value, "a string")
        return value

    def flags(self, key: str, n: int) -> List[bool]:
        """A per-layer array of n booleans (or 0/1 integers)."""
        value = self.get(key)
        if not _is_sequence(value) or len(value) != n:
            raise self._bad(key, value, f"an array of {n} booleans (one per block)")
        out = []
        for v in value:
            if not (isinstance(v, bool) or (_is_int(v) and int(v) in (0, 1))):
                raise self._bad(key, value, f"an array of {n} booleans (one per block)")
            out.append(bool(v))
        return out

    def scalar(self, key: str, default: Any = _REQUIRED, *, per_layer: Optional[Sequence[bool]] = None) -> Any:
        """A value llama.cpp may store per layer as an array: must be uniform (or uniform over the
        layers `per_layer` selects). Raw; ``dim_per_layer`` is the typed form."""
        value = self.get(key, default)
        if _is_sequence(value):
            chosen = list(value) if per_layer is None else [v for v, keep in zip(value, per_layer) if keep]
            if not chosen or not all(isinstance(v, collections.abc.Hashable) for v in chosen) or len(set(chosen)) != 1:
                raise ValueError(f"GGUF {self.full_key(key)} = {_short(value)} varies across layers (or is empty); "
                                 f"expected one value")
            return chosen[0]
        return value

    def dim_per_layer(self, key: str, *, per_layer: Optional[Sequence[bool]] = None, lo: int = 1) -> int:
        """``dim`` of a value llama.cpp may store per layer (see ``scalar``)."""
        value = self.scalar(key, per_layer=per_layer)
        largest = self._largest()
        return self._int(key, value, lo, max(largest, lo), f" (the largest tensor dimension in the file is {largest})")

    def token_id(self, key: str, vocab: int) -> Optional[int]:
        """A tokenizer.ggml.*_token_id: None when absent, else an integer in 0..vocab-1."""
        if not self.has(key):
            return None
        return self._int(key, self.get(key), 0, vocab - 1, " (the vocabulary)")

    def vocab_size(self, tensors: Optional[GGUFTensors] = None) -> int:
        tensors = tensors or self.tensors
        if self.has("vocab_size"):
            return self.dim("vocab_size") if tensors is not None else self.count("vocab_size")
        if tensors is not None and "token_embd.weight" in tensors.shapes:
            return int(tensors.shapes["token_embd.weight"][0])
        tokens = self.raw.get("tokenizer.ggml.tokens")  # len() does not decode a lazy GGUFArray
        if _is_sequence(tokens) and len(tokens):
            return len(tokens)
        raise ValueError("GGUF: vocabulary size unknown (no vocab_size key, token_embd.weight or token list)")

    def _blocks(self) -> int:
        return self.tensors.blocks if self.tensors is not None else _INT_LIMIT

    def _largest(self) -> int:
        return self.tensors.largest_dim if self.tensors is not None else _INT_LIMIT


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_sequence(value: Any) -> bool:
    return isinstance(value, collections.abc.Sequence) and not isinstance(value, (str, bytes))


def _short(value: Any, limit: int = 60) -> str:
    """repr of a metadata value, cut to one short line (a hostile array may be huge)."""
    if _is_sequence(value) and len(value) > 8:
        return f"an array of {len(value)} elements"
    text = repr(value).replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


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
