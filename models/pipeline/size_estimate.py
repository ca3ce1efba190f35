"""The output's size before any work: bytes and real bits per weight per backend, from the headers alone.

Each tensor of the input (names, shapes and stored types from its headers) is counted as the backend
writes it: a tensor the recipe quantizes by the backend's Storage (codes, scales, per-tensor extras:
llmq.quant.storage); a tensor a GGUF stores quantized, which the import keeps as it is, in its own
block class (a GGUF writer: the same blocks; the others: the block's bits and group, with the scales in
the backend's scale dtype, widened where the backend widens to hold the block's scales exactly:
float16 for the blocks of 32, float32 for the K-quants); any other tensor at the width the run
receives it in (a GGUF's float tensors and the tensors its import dequantizes, e.g. Gemma's
embedding, in the import's one model dtype). The result is the bytes of the tensors the backend
writes, exactly where shapes and formats determine them (a storage that needs values is measured on
zeros); it leaves out file headers (safetensors JSON, GGUF header and metadata) and side files
(config, tokenizer). `--dry_run` prints the table for every backend and exits; a real run prints its
backend's line first.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from llmq.quant import QuantConfig, quantize_weight
from llmq.quant.storage import element_bits

Shape = Tuple[int, ...]
_STORED_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
# A GGUF block type as the integer config of the same size class: (bits, group size).
GGUF_CLASS = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q5_0": (5, 32), "Q5_1": (5, 32), "Q8_0": (8, 32),
              "Q2_K": (2, 16), "Q3_K": (3, 16), "Q4_K": (4, 32), "Q5_K": (5, 32), "Q6_K": (6, 16)}
# The narrowest scale dtype that holds a block type's scales and biases exactly: float16 (d, m and
# d x a power of two) for the blocks of 32; float32 for the K-quants, whose scales are a float16
# super-scale times a 4- to 8-bit sub-scale (up to 19 significant bits).
_GGUF_SCALES = {t: torch.float16 if not t.endswith("_K") else torch.float32 for t in GGUF_CLASS}


@dataclasses.dataclass(frozen=True)
class Estimate:
    backend: str
    bytes_out: int
    bytes_in: int
    quantized_weights: int
    quantized_bits: int

    @property
    def bits_per_weight(self) -> float:
        return self.quantized_bits / self.quantized_weights if self.quantized_weights else 0.0

    def line(self) -> str:
        ratio = self.bytes_out / self.bytes_in if self.bytes_in else math.nan
        text = f"{self.bytes_out:,} bytes ({_human(self.bytes_out)}, {ratio:.3f}x the input's tensors)"
        if self.quantized_weights:
            text += (f"; quantized weights {self.bits_per_weight:.3f} bits per weight as written "
                     f"(scales included, {self.quantized_weights:,} weights)")
        return text


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _bits(storage: Callable[[QuantConfig], Any], config: QuantConfig, shape: Shape, cache: Dict) -> int:
    """Bits `storage` writes for a weight of `shape` quantized with `config` (rows counted exactly;
    a storage that needs the value is measured on a few rows of zeros and scaled)."""
    stored = storage(config)
    try:
        return int(stored.bits(tuple(shape)))
    except ValueError:
        pass
    k = shape[-1]
    rows = math.prod(shape[:-1])
    key = (config, k)
    if key not in cache:
        probe = dataclasses.replace(config, scale_dtype=stored.scale_dtype, method="minmax") \
            if config.format == "int" else config
        sample = min(rows, 16)
        value = quantize_weight(torch.zeros(sample, k), probe)
        cache[key] = (stored.bits((sample, k), value), sample)
    bits, sample = cache[key]
    return int(bits * rows // sample)


def _kept_bits(storage: Callable[[QuantConfig], Any], block_type: str, shape: Shape, cache: Dict) -> int:
    """Bits a backend writes for a GGUF block kept as it is (the canonical weight of its class)."""
    bits, group = GGUF_CLASS[block_type]
    config = QuantConfig(bits=bits, group_size=group, symmetric=False)
    stored = storage(config)
    if stored.tensors is None or not stored.widen_to:
        return _bits(storage, config, shape, cache)
    need = _GGUF_SCALES[block_type]
    chain = (stored.scale_dtype,) + tuple(stored.widen_to)
    dtype = next((d for d in chain if d in (need, torch.float32)), chain[-1])  # bfloat16 holds no float16
    return sum(element_bits(d) * math.prod(s) for d, s in stored.tensors(dtype, tuple(shape)).values())


def estimate(backend: str, tensors: Dict[str, Tuple[Shape, str]], config_of: Callable[[str], Optional[QuantConfig]],
             storage: Callable[[QuantConfig], Any], accepts, *, gguf: bool,
             received: Optional[Dict[str, str]] = None) -> Estimate:
    """`tensors`: name -> (shape, stored type name); config_of(name) -> the recipe's config (or None).
    gguf: the input's block-quantized tensors reach the backend as they are (counted in their class).
    received: name -> the type the run receives a tensor in where it is not the stored one (a GGUF's
    import: its model dtype, and "F32" for the tensors it dequantizes)."""
    out = bytes_in = weights = qbits = 0
    cache: Dict = {}
    for name, (shape, stored) in tensors.items():
        numel = math.prod(shape)
        bytes_in += _stored_nbytes(stored, numel)
        kind = (received or {}).get(name, stored)
        config = config_of(name) if len(shape) >= 2 else None
        if gguf and kind in GGUF_CLASS:  # kept as the GGUF stores it, in its size class
            if "int" not in accepts:  # a GGUF writer: the same blocks
                b = _stored_nbytes(kind, numel) * 8
            else:
                b = _kept_bits(storage, kind, shape, cache)
            out, qbits, weights = out + b // 8, qbits + b, weights + numel
            continue
        if config is not None and config.format in accepts:
            try:
                b = _bits(storage, config, shape, cache)
            except ValueError:  # a shape the format cannot hold: the run refuses it; count it unquantized
                b = None
            if b is not None:
                out += b // 8
                qbits += b
                weights += numel
                continue
        out += numel * _STORED_BYTES.get(kind, 4)
    return Estimate(backend, out, bytes_in, weights, qbits)


def _stored_nbytes(stored: str, numel: int) -> int:
    if stored in _STORED_BYTES:
        return numel * _STORED_BYTES[stored]
    try:
        import gguf

        block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[stored]]
        return numel // block * nbytes
    except (ImportError, KeyError):
        return numel * 4


def table(estimates: List[Tuple[str, Any]]) -> str:
    """One line per backend: its Estimate, or why it cannot write the recipe."""
    width = max(len(b) for b, _ in estimates)
    return "\n".join(f"  {b:<{width}}  {e.line() if isinstance(e, Estimate) else e}" for b, e in estimates)


# GGUF names whose recipe rules are written for the model's names (the rest match by their pattern).
_GGUF_MODULES = {"token_embd": "model.embed_tokens", "output": "lm_head"}


def input_tensors(checkpoint: str, key_map, from_gguf: bool) -> Dict[str, Tuple[Shape, str]]:
    """name -> (shape, stored type) from the input's headers ({} where a format needs reading)."""
    from llmq.checkpoint import checkpoint_shapes, checkpoint_stored_types

    key_map = None if from_gguf else key_map
    shapes = checkpoint_shapes(checkpoint, key_map=key_map) or {}
    types = checkpoint_stored_types(checkpoint, key_map=key_map) or {}
    return {n: (tuple(s), types.get(n, "F32")) for n, s in shapes.items()}


def gguf_received(checkpoint: str, tensors: Dict[str, Tuple[Shape, str]], dequantized=()) -> Dict[str, str]:
    """name -> the type the run receives a GGUF's tensor in, where it differs from the stored one:
    float tensors in the import's one model dtype (models.pipeline.gguf_input.model_dtype), and
    `dequantized` (the GGUF names the model's import always dequantizes) as float32."""
    from llmq.checkpoint.gguf_import import GGUFFile
    from models.pipeline.gguf_input import model_dtype

    with GGUFFile(checkpoint) as f:
        dtype = model_dtype(f.tensors)
    name = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}.get(dtype, "F32")
    out = {n: name for n, (_, stored) in tensors.items() if stored in _STORED_BYTES and stored != name}
    out.update({n: "F32" for n in dequantized if n in tensors})
    return out


def for_backend(writer, recipe, tensors: Dict[str, Tuple[Shape, str]], num_layers: int,
                module_of: Callable[[str], Optional[str]], *, job=None, gguf: bool = False,
                received: Optional[Dict[str, str]] = None):
    # gguf: a GGUF input whose blocks are kept (not --requantize_gguf)
    """The Estimate of `writer` for `recipe` (as loaded), or one line saying why it cannot write it."""
    from llmq.backend import storage_of, with_scale_dtypes

    try:
        fitted = writer.recipe_for(recipe)
        fitted.check_formats(writer.accepts_formats, f"--backend {writer.name}")
    except ValueError as e:
        return f"cannot write this recipe ({e})"
    storage = storage_of(writer, job)
    bound = with_scale_dtypes(fitted, storage).bind(num_layers)

    def config_of(name: str) -> Optional[QuantConfig]:
        module = module_of(name)
        if module is None:
            return None
        if gguf:
            module = _GGUF_MODULES.get(module, module)
        return bound.get_config(module)

    # a backend that quantizes by itself gets a GGUF's blocks dequantized: the recipe decides them all
    return estimate(writer.name, tensors, config_of, storage, writer.accepts_formats,
                    gguf=gguf and not writer.takes_float, received=received)
