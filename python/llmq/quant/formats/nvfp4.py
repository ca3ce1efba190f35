"""Format family "nvfp4": E2M1 codes, an e4m3 scale per 16 along K and a float32 global scale; its
container, quantizer (ModelOpt's rule byte for byte), exact dequantize, Hugging Face export and
registry entry.

``NVFP4Weight``: ``codes`` uint8 [..., K/2] (E2M1 packed two per byte, element 2i in the low
nibble); ``block_scale`` float8_e4m3fn [..., K/16]; ``global_scale`` float32 shape[:-2]
(ModelOpt's ``weight_scale_2``): g = amax / (6*448), s = e4m3(clamp(block_amax / (6*g), 2**-9,
448)), all-zero blocks s = 1.0, an all-zero tensor g = 1.0 (compressed-tensors stores 1/g as
``weight_global_scale``). A config's ``granularity`` says where the global scale comes from: "tensor"
(default, the rule above) or "block" (block scales only: g = 1, s = e4m3(clamp(block_amax / 6, 2**-9,
448)); what a consumer that stores no global scale holds exactly: MLX's nvfp4 mode, transformers'
compressed-tensors MoE experts). Dequantize is evaluated in the order every reader uses (ModelOpt, vLLM,
TensorRT-LLM): ``value * (float(s) * g)``, two float32 roundings, so the numbers equal theirs bit for bit.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, Optional, Tuple

import torch

import llmq.quant._native_fp as _native_fp
from llmq.quant.codecs import (
    FP4_E2M1_MAX,
    FP8_E4M3_MAX,
    check_input,
    check_scale,
    e2m1_decode,
    e2m1_encode,
    pack_fp4,
    positive_or_one,
    row_ranges,
    unpack_fp4,
)
from llmq.quant.formats._fixed import check_fixed
from llmq.quant.formats.base import Format, Layout, RowQuantizer
from llmq.quant.formats.hf_export import HFExport, ct_weights, scalar_shape

BLOCK = 16
# Where the global scale comes from (QuantConfig.granularity): the weight's amax, or none (g = 1).
GRANULARITIES = ("tensor", "block")
# A per-expert module of an HF MoE checkpoint (transformers fuses these into 3-D experts on load).
_PER_EXPERT = re.compile(r"\.experts\.\d+\.")
# Quantize this many elements at a time (bounded temporaries whatever the weight's size).
_ROWS_ELEMENTS = 1 << 20


@dataclasses.dataclass(frozen=True)
class NVFP4Weight:
    """NVIDIA FP4: E2M1 codes, e4m3 scale per 16, float32 global scale (ModelOpt weight_scale_2)."""

    codes: torch.Tensor  # uint8 [..., K/2]
    block_scale: torch.Tensor  # float8_e4m3fn [..., K/16]
    global_scale: torch.Tensor  # float32 shape[:-2] (0-dim for 1-D/2-D)
    shape: Tuple[int, ...]
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        lead, k = tuple(self.shape[:-1]), self.shape[-1]
        if k % BLOCK or self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != lead + (k // 2,):
            raise ValueError(f"NVFP4Weight.codes must be uint8 {list(lead + (k // 2,))} for shape {list(self.shape)}, "
                             f"got {self.codes.dtype} {list(self.codes.shape)}")
        if self.block_scale.dtype != torch.float8_e4m3fn or tuple(self.block_scale.shape) != lead + (k // BLOCK,):
            raise ValueError(f"NVFP4Weight.block_scale must be float8_e4m3fn {list(lead + (k // BLOCK,))}, "
                             f"got {self.block_scale.dtype} {list(self.block_scale.shape)}")
        expect = tuple(self.shape[:-2])
        if self.global_scale.dtype != torch.float32 or tuple(self.global_scale.shape) != expect:
            raise ValueError(f"NVFP4Weight.global_scale must be float32 {list(expect)}, got {self.global_scale.dtype} {list(self.global_scale.shape)}")

    @property
    def format(self) -> str:
        return "nvfp4"


def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """ModelOpt's weight_scale_2: amax / (6*448) in float32, per expert for 3-D; 1.0 if amax == 0."""
    x = w.abs()  # exact in the weight's own dtype
    amax = (x.amax(dim=(-2, -1)) if w.dim() == 3 else x.amax()).float()
    return positive_or_one(amax / (FP4_E2M1_MAX * FP8_E4M3_MAX))


def quantize_nvfp4(w: torch.Tensor, *, name: str = "<tensor>", global_scale: Optional[torch.Tensor] = None) -> NVFP4Weight:
    """NVFP4 by ModelOpt's rule. `global_scale` overrides g (fused siblings share one, the
    max of their own); blocks whose scale would exceed 448 are clamped, never NaN."""
    native = _native_fp.quantize_nvfp4(w, global_scale, block=BLOCK)  # same bytes, compiled; None: use the reference below
    if native is not None:
        codes, block_scale, g = native
        return NVFP4Weight(codes=codes, block_scale=block_scale, global_scale=g, shape=tuple(w.shape), dtype=w.dtype)
    check_input(w, name, BLOCK, "NVFP4")
    g = nvfp4_global_scale(w) if global_scale is None else check_scale(global_scale, tuple(w.shape[:-2]), name)
    k = w.shape[-1]
    rows = w.reshape(-1, k)
    # The global scale of each row (one per expert for stacked [E, N, K] weights).
    per_row = g.reshape(-1, 1).expand(-1, rows.shape[0] // g.numel()).reshape(-1) if g.dim() else g.expand(rows.shape[0])
    codes = torch.empty((rows.shape[0], k // 2), dtype=torch.uint8)
    block_scale = torch.empty((rows.shape[0], k // BLOCK), dtype=torch.float8_e4m3fn)
    for a, b in row_ranges(rows.shape[0], k, _ROWS_ELEMENTS):
        x = rows[a:b].float().reshape(b - a, k // BLOCK, BLOCK)
        gr = per_row[a:b].reshape(-1, 1)
        s = x.abs().amax(dim=-1) / (FP4_E2M1_MAX * gr)
        s = torch.where(s == 0, torch.ones_like(s), s)
        s8 = s.clamp(2.0**-9, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        scaled = x / (s8.float() * gr).unsqueeze(-1)
        codes[a:b] = pack_fp4(e2m1_encode(scaled.reshape(b - a, k)))
        block_scale[a:b] = s8
    lead = tuple(w.shape[:-1])
    return NVFP4Weight(
        codes=codes.reshape(lead + (k // 2,)),
        block_scale=block_scale.reshape(lead + (k // BLOCK,)),
        global_scale=g.contiguous(),
        shape=tuple(w.shape),
        dtype=w.dtype,
    )


def dequantize_nvfp4(w: NVFP4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float32 value of an NVFP4Weight as its readers compute it, then cast to dtype."""
    k = w.shape[-1]
    values = e2m1_decode(unpack_fp4(w.codes)).reshape(*w.shape[:-1], k // BLOCK, BLOCK)
    g = w.global_scale.reshape(w.global_scale.shape + (1,) * (len(w.shape) - 1 if len(w.shape) >= 2 else 1))
    out = (values * (w.block_scale.float() * g).unsqueeze(-1)).reshape(w.shape)
    return out.to(dtype)


def no_global_scale(w: torch.Tensor) -> torch.Tensor:
    """The global scale of granularity "block": 1.0 (per expert for 3-D), the block scales alone."""
    return torch.ones(tuple(w.shape[:-2]), dtype=torch.float32)


def nvfp4_global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's weight_scale_2 from a weight amax: amax / (6*448), 1.0 where amax == 0."""
    g = amax.float() / (FP4_E2M1_MAX * FP8_E4M3_MAX)
    return torch.where(g > 0, g, torch.ones_like(g))


class _WithoutGranularity:
    """A spec seen without its granularity (HFExport.normalize refuses one from other families)."""

    def __init__(self, spec):
        self._spec = spec

    granularity = None

    def __getattr__(self, name):
        return getattr(self._spec, name)


class NVFP4HFExport(HFExport):
    """NVFP4 in HF folders. ModelOpt: ``weight`` (packed E2M1), ``weight_scale`` (e4m3 per 16),
    ``weight_scale_2`` = g, value * (s * g). compressed-tensors: ``weight_packed``,
    ``weight_scale``, ``weight_global_scale`` = 1/g, value * (s / weight_global_scale)."""

    bits, group_size = 4, BLOCK
    static_input_scale = True

    def roles(self, spec) -> Dict[str, str]:
        ct = spec.style == "compressed-tensors"
        return {"weight": "weight_packed" if ct else "weight", "scale": "weight_scale",
                "global_scale": "weight_global_scale" if ct else "weight_scale_2"}

    def input_scale_suffix(self, spec) -> str:
        return "input_global_scale" if spec.style == "compressed-tensors" else "input_scale"

    def dtypes(self, spec) -> Dict[str, torch.dtype]:
        return {"weight": torch.uint8, "scale": torch.float8_e4m3fn, "global_scale": torch.float32}

    def shapes(self, spec, n, k):
        return {"weight": (n, k // 2), "scale": (n, k // spec.group_size), "global_scale": scalar_shape(spec)}

    def modelopt_layer_config(self, spec) -> Dict[str, Any]:
        return {"quant_algo": "NVFP4" if spec.static_input_scale else "W4A16_NVFP4", "group_size": BLOCK}

    def modelopt_groups(self):
        fp4 = lambda gs: {"dynamic": False, "num_bits": 4, "type": "float", "group_size": gs}  # noqa: E731
        return {"NVFP4": lambda gs: {"input_activations": fp4(gs), "weights": fp4(gs)},
                "W4A16_NVFP4": lambda gs: {"weights": fp4(gs)}}

    def compressed_tensors_scheme(self, spec) -> Dict[str, Any]:
        w = ct_weights(spec, type="float", strategy="tensor_group", group_size=BLOCK,
                       scale_dtype="torch.float8_e4m3fn", block_structure=None)
        act = None
        if spec.static_input_scale:
            act = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": BLOCK,
                   "dynamic": "local", "scale_dtype": "torch.float8_e4m3fn"}
        return {"format": "nvfp4-pack-quantized", "weights": w, "input_activations": act, "output_activations": None}

    def from_compressed_tensors(self, scheme):
        if scheme.get("format") != "nvfp4-pack-quantized":
            return None
        return {"format": "nvfp4", "static_input_scale": scheme.get("input_activations") is not None}

    def from_modelopt(self, layer_config):
        algo = layer_config.get("quant_algo")
        return {"format": "nvfp4", "static_input_scale": algo == "NVFP4"} if algo in ("NVFP4", "W4A16_NVFP4") else None

    def needs_tensor_amax(self, spec) -> bool:
        return spec.granularity != "block"

    def normalize(self, spec, where):
        # the generic checks, but a granularity is this family's own field (where g comes from)
        if spec.granularity not in (None,) + GRANULARITIES:
            raise ValueError(f"{where}: nvfp4 granularity {spec.granularity!r} unknown; expected one of {GRANULARITIES}")
        out = super().normalize(_WithoutGranularity(spec), where)
        if spec.style == "compressed-tensors" and _PER_EXPERT.search(spec.module):
            # transformers (5.x) decompresses fused MoE experts without their weight_global_scale
            # (integrations/compressed_tensors.py: CompressedTensorsDequantize builds each expert's module
            # from weight_packed, weight_scale and weight_shape only), so an expert is written with g = 1:
            # its block scales alone give its values, read alike by every reader
            out["granularity"] = "block"
        return out

    def readback_rel_tolerance(self, spec) -> float:
        # compressed-tensors divides by the stored 1/g instead of multiplying by g: a few float32
        # roundings (1/g, s/(1/g), the product) apart from llmq's value * (s * g).
        return 2.0 ** -21 if spec.style == "compressed-tensors" else 0.0

    def row_block_rows(self, spec) -> int:
        return 1

    def rel_rms_bound(self, spec) -> float:
        return 0.35

    def input_scale(self, amax, spec):
        s = amax / (FP4_E2M1_MAX * FP8_E4M3_MAX)
        return 1.0 / s if spec.style == "compressed-tensors" else s

    def quantize(self, weight, spec, state):
        g = (no_global_scale(weight) if spec.granularity == "block"
             else nvfp4_global_scale_from_amax(state.weight_amax))
        return quantize_nvfp4(weight, name=f"{spec.module}.weight", global_scale=g)

    def to_tensors(self, q, spec, state, dtype):
        g = q.global_scale
        g = (1.0 / g).reshape(g.shape + (1,)) if spec.style == "compressed-tensors" else g
        return {"weight": q.codes, "scale": q.block_scale, "global_scale": g}

    def dequantize(self, t, spec):
        w, s = t["weight"], t["scale"]
        k = w.shape[-1] * 2
        vals = e2m1_decode(unpack_fp4(w)).reshape(*w.shape[:-1], k // 16, 16)
        g = t["global_scale"].float()
        if spec.style == "compressed-tensors":
            g = g.reshape(g.shape[:-1])
            scale = s.float() / g.reshape(g.shape + (1, 1))
        else:
            scale = s.float() * g.reshape(g.shape + (1, 1))
        return (vals * scale.unsqueeze(-1)).reshape(*w.shape[:-1], k)


class NVFP4Format(Format):
    family = "nvfp4"
    names = ("nvfp4",)
    container = NVFP4Weight
    hf_export = NVFP4HFExport()
    config_fields = ("bits", "group_size", "granularity")

    def default_config(self, name: str) -> Dict[str, Any]:
        return {"bits": 4, "group_size": BLOCK, "granularity": "tensor"}

    def validate_config(self, config: Any) -> None:
        check_fixed(config, "nvfp4", 4, BLOCK)
        if config.granularity not in GRANULARITIES:
            raise ValueError(f"QuantConfig.granularity={config.granularity!r} does not apply to nvfp4; expected one of "
                             f"{GRANULARITIES} (a global scale from the weight's amax, or block scales only)")

    def describe(self, config: Any) -> str:
        return f"nvfp4 g{BLOCK}" + (" block scales only" if config.granularity == "block" else "")

    def shape_problem(self, config: Any, shape: Tuple[int, ...]) -> Optional[str]:
        return None if shape[-1] % BLOCK == 0 else f"nvfp4 needs the input dimension K to be a multiple of {BLOCK}"

    def quantize(self, w: torch.Tensor, config: Any, *, name: str = "<tensor>") -> NVFP4Weight:
        return quantize_nvfp4(w, name=name, global_scale=no_global_scale(w) if config.granularity == "block" else None)

    def dequantize(self, value: NVFP4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_nvfp4(value, dtype)

    def row_quantizer(self, config: Any, shape: Tuple[int, ...], *, name: str = "<tensor>"):
        """Blocks of 16 along K inside a row, under the global scale of the whole weight's amax
        (nvfp4_global_scale_from_amax, what quantize_nvfp4 computes)."""
        if len(shape) != 2:
            return None
        if config.granularity == "block":
            return RowQuantizer(lambda block, amax: quantize_nvfp4(block, name=name, global_scale=no_global_scale(block)),
                                needs_amax=False)
        return RowQuantizer(lambda block, amax: quantize_nvfp4(block, name=name,
                                                                  global_scale=nvfp4_global_scale_from_amax(amax)),
                            needs_amax=True)

    def stored(self, value: NVFP4Weight) -> Dict[str, torch.Tensor]:
        return {"codes": value.codes, "block_scale": value.block_scale, "global_scale": value.global_scale}

    def rebuild(self, name, params, shape, dtype, stored) -> NVFP4Weight:
        return NVFP4Weight(codes=stored["codes"], block_scale=stored["block_scale"],
                              global_scale=stored["global_scale"], shape=tuple(shape), dtype=dtype)

    def layout(self, name, params, shape) -> Layout:
        lead, k = tuple(shape[:-1]), shape[-1]
        return {"codes": (torch.uint8, lead + (k // 2,)),
                "block_scale": (torch.float8_e4m3fn, lead + (k // BLOCK,)),
                "global_scale": (torch.float32, tuple(shape[:-2]))}
