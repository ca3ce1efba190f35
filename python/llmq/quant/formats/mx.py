"""Format family "mx": OCP microscaling MXFP4 (E2M1) and MXFP8 (E4M3) elements with one E8M0 scale
per 32 along K; its container, quantizer, exact dequantize, Hugging Face export and registry entry.

``MXWeight``: ``scale_e8m0`` uint8 [..., K/32] holding the biased exponent e+127 (value 2**e);
``codes`` uint8: for "mxfp4" E2M1 codes packed two per byte [..., K/2] (element 2i in the low
nibble, sign in bit 3), for "mxfp8" the e4m3 bytes [..., K]. e = ceil(log2(amax / Emax)) with
Emax = 6 (E2M1) or 448 (E4M3), computed exactly (the rule ModelOpt and MLX share; it never clips,
unlike the OCP floor rule), clamped to [-127, 127]; an all-zero block gets e = -127 (byte 0).
Element codes are round-to-nearest-even of the scaled value in float32, saturated at +-Emax.
Dequantize ``value * 2**e`` is exact in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

import torch

import llmq.quant._native_fp as _native_fp
from llmq.quant.codecs import (
    E8M0_BIAS,
    FP4_E2M1_MAX,
    FP8_E4M3_MAX,
    check_input,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    fp8_cast,
    mx_exponent,
    pack_fp4,
    row_ranges,
    unpack_fp4,
)
from llmq.quant.formats._fixed import check_fixed
from llmq.quant.formats.base import Format, Layout, RowQuantizer
from llmq.quant.formats.hf_export import HFExport, ct_weights, modelopt_raw_codes_warning

BLOCK = 32
# Quantize this many elements at a time (bounded temporaries whatever the weight's size).
_ROWS_ELEMENTS = 1 << 20


@dataclasses.dataclass(frozen=True)
class Element:
    """What an MX format's element type decides: its width, its largest magnitude (Emax) and how
    values already divided by their block scale become uint8 codes [..., K*bits/8] and back."""

    bits: int
    emax: float
    encode: Callable[[torch.Tensor], torch.Tensor]
    decode: Callable[[torch.Tensor], torch.Tensor]  # codes -> float32 [..., K]


ELEMENTS = {
    "mxfp4": Element(4, FP4_E2M1_MAX, lambda x: pack_fp4(e2m1_encode(x)), lambda c: e2m1_decode(unpack_fp4(c))),
    "mxfp8": Element(8, FP8_E4M3_MAX, lambda x: fp8_cast(x).view(torch.uint8),
                       lambda c: c.view(torch.float8_e4m3fn).float()),
}
NAMES = tuple(ELEMENTS)  # ("mxfp4", "mxfp8")


@dataclasses.dataclass(frozen=True)
class MXWeight:
    """An OCP microscaling weight: E2M1 (mxfp4) or E4M3 (mxfp8) codes, E8M0 scale per 32."""

    codes: torch.Tensor  # uint8 [..., K/2] (mxfp4) or [..., K] (mxfp8)
    scale_e8m0: torch.Tensor  # uint8 [..., K/32], biased exponent
    fmt: str  # "mxfp4" | "mxfp8"
    shape: Tuple[int, ...]  # logical [..., N, K]
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        if self.fmt not in NAMES:
            raise ValueError(f"MXWeight.fmt={self.fmt!r}; expected one of {NAMES}")
        lead, k = tuple(self.shape[:-1]), self.shape[-1]
        row = k * ELEMENTS[self.fmt].bits // 8
        if k % BLOCK or self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != lead + (row,):
            raise ValueError(f"MXWeight.codes must be uint8 {list(lead + (row,))} for shape {list(self.shape)}, "
                             f"got {self.codes.dtype} {list(self.codes.shape)}")
        if self.scale_e8m0.dtype != torch.uint8 or tuple(self.scale_e8m0.shape) != lead + (k // BLOCK,):
            raise ValueError(f"MXWeight.scale_e8m0 must be uint8 {list(lead + (k // BLOCK,))}, got {self.scale_e8m0.dtype} {list(self.scale_e8m0.shape)}")

    @property
    def format(self) -> str:
        return self.fmt


def quantize_mx(w: torch.Tensor, fmt: str, *, name: str = "<tensor>") -> MXWeight:
    """MXFP4 / MXFP8: E8M0 scale 2**ceil(log2(amax/Emax)) per 32 elements along K."""
    native = _native_fp.quantize_mx(w, ELEMENTS[fmt].bits, block=BLOCK) if fmt in ELEMENTS else None  # same bytes, compiled; None: use the reference below
    if native is not None:
        return MXWeight(codes=native[0], scale_e8m0=native[1], fmt=fmt, shape=tuple(w.shape), dtype=w.dtype)
    element = ELEMENTS.get(fmt)
    if element is None:
        raise ValueError(f"{name}: MX format {fmt!r} unknown; expected one of {NAMES}")
    check_input(w, name, BLOCK, fmt.upper())
    k = w.shape[-1]
    rows = w.reshape(-1, k)
    codes = torch.empty((rows.shape[0], k * element.bits // 8), dtype=torch.uint8)
    scales = torch.empty((rows.shape[0], k // BLOCK), dtype=torch.uint8)
    for a, b in row_ranges(rows.shape[0], k, _ROWS_ELEMENTS):
        x = rows[a:b].float().reshape(b - a, k // BLOCK, BLOCK)
        e8 = (mx_exponent(x.abs().amax(dim=-1), element.emax) + E8M0_BIAS).to(torch.uint8)
        scaled = (x / e8m0_decode(e8).unsqueeze(-1)).reshape(b - a, k)  # exact: a power of two
        codes[a:b] = element.encode(scaled)
        scales[a:b] = e8
    lead = tuple(w.shape[:-1])
    return MXWeight(codes=codes.reshape(lead + (codes.shape[-1],)), scale_e8m0=scales.reshape(lead + (k // BLOCK,)),
                   fmt=fmt, shape=tuple(w.shape), dtype=w.dtype)



def dequantize_mx(w: MXWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The exact float32 value of an MXWeight, then cast to dtype."""
    k = w.shape[-1]
    values = ELEMENTS[w.fmt].decode(w.codes).reshape(*w.shape[:-1], k // BLOCK, BLOCK)
    return (values * e8m0_decode(w.scale_e8m0).unsqueeze(-1)).reshape(w.shape).to(dtype)


# name -> (ModelOpt quant_algo, compressed-tensors format)
_HF_NAMES = {"mxfp4": ("MXFP4", "mxfp4-pack-quantized"), "mxfp8": ("MXFP8", "mxfp8-quantized")}


class MXHFExport(HFExport):
    """MX in HF folders: E2M1 codes packed two per byte (``weight_packed`` in compressed-tensors,
    ``weight`` in ModelOpt) or e4m3 bytes as float8_e4m3fn ``weight``; ``weight_scale`` the
    E8M0 exponents (uint8). value * 2**(scale - 127) in both styles."""

    group_size = BLOCK

    def fixed_bits(self, spec):
        return ELEMENTS[spec.format].bits

    def roles(self, spec) -> Dict[str, str]:
        packed = spec.style == "compressed-tensors" and ELEMENTS[spec.format].bits == 4
        return {"weight": "weight_packed" if packed else "weight", "scale": "weight_scale"}

    def dtypes(self, spec):
        return {"weight": torch.uint8 if ELEMENTS[spec.format].bits == 4 else torch.float8_e4m3fn, "scale": torch.uint8}

    def shapes(self, spec, n, k):
        return {"weight": (n, k * ELEMENTS[spec.format].bits // 8), "scale": (n, k // spec.group_size)}

    def modelopt_layer_config(self, spec):
        return {"quant_algo": _HF_NAMES[spec.format][0], "group_size": BLOCK}

    def modelopt_groups(self):
        def group(bits):
            return lambda gs: {"weights": {"dynamic": False, "num_bits": bits, "type": "float", "group_size": gs, "scale_dtype": "e8m0"}}
        return {_HF_NAMES[name][0]: group(bits) for name, bits in ((n, e.bits) for n, e in ELEMENTS.items())}

    def compressed_tensors_scheme(self, spec):
        w = ct_weights(spec, type="float", strategy="group", group_size=BLOCK, scale_dtype="torch.uint8", block_structure=None)
        return {"format": _HF_NAMES[spec.format][1], "weights": w, "input_activations": None, "output_activations": None}

    def from_compressed_tensors(self, scheme):
        names = [n for n, (_, ct) in _HF_NAMES.items() if ct == scheme.get("format")]
        return {"format": names[0]} if names else None

    def from_modelopt(self, layer_config):
        names = [n for n, (algo, _) in _HF_NAMES.items() if algo == layer_config.get("quant_algo")]
        return {"format": names[0]} if names else None

    def row_block_rows(self, spec):
        return 1

    def rel_rms_bound(self, spec):
        return 0.35 if ELEMENTS[spec.format].bits == 4 else 0.1

    def known_misreads(self, fields, style, moe):
        # Packed MXFP4 fails to load loudly (shape mismatch); unpacked MXFP8 loads as raw codes.
        if style == "modelopt" and ELEMENTS[fields["format"]].bits == 8:
            return (modelopt_raw_codes_warning("MXFP8"),)
        return ()

    def quantize(self, weight, spec, state):
        return quantize_mx(weight, spec.format, name=f"{spec.module}.weight")

    def to_tensors(self, q, spec, state, dtype):
        codes = q.codes if ELEMENTS[spec.format].bits == 4 else q.codes.view(torch.float8_e4m3fn)
        return {"weight": codes, "scale": q.scale_e8m0}

    def dequantize(self, t, spec):
        w = t["weight"]
        shape = tuple(w.shape[:-1]) + (w.shape[-1] * 8 // ELEMENTS[spec.format].bits,)
        return dequantize_mx(MXWeight(codes=w.view(torch.uint8), scale_e8m0=t["scale"], fmt=spec.format, shape=shape))


class MXFormat(Format):
    family = "mx"
    names = NAMES  # ("mxfp4", "mxfp8")
    container = MXWeight
    hf_export = MXHFExport()
    config_fields = ("bits", "group_size")

    def default_config(self, name: str) -> Dict[str, Any]:
        return {"bits": ELEMENTS[name].bits, "group_size": BLOCK}

    def validate_config(self, config: Any) -> None:
        check_fixed(config, config.format, ELEMENTS[config.format].bits, BLOCK)

    def shape_problem(self, config: Any, shape: Tuple[int, ...]) -> Optional[str]:
        return None if shape[-1] % BLOCK == 0 else f"{config.format} needs the input dimension K to be a multiple of {BLOCK}"

    def quantize(self, w: torch.Tensor, config: Any, *, name: str = "<tensor>") -> MXWeight:
        return quantize_mx(w, config.format, name=name)

    def dequantize(self, value: MXWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mx(value, dtype)

    def row_quantizer(self, config: Any, shape: Tuple[int, ...], *, name: str = "<tensor>"):
        """One E8M0 scale per 32 along K inside a row: row by row."""
        if len(shape) != 2:
            return None
        return RowQuantizer(lambda block, amax: quantize_mx(block, config.format, name=name))

    def name_of(self, value: MXWeight) -> str:
        return value.fmt

    def stored(self, value: MXWeight) -> Dict[str, torch.Tensor]:
        return {"codes": value.codes, "scale_e8m0": value.scale_e8m0}

    def rebuild(self, name, params, shape, dtype, stored) -> MXWeight:
        return MXWeight(codes=stored["codes"], scale_e8m0=stored["scale_e8m0"], fmt=name, shape=tuple(shape), dtype=dtype)

    def layout(self, name, params, shape) -> Layout:
        lead, k = tuple(shape[:-1]), shape[-1]
        return {"codes": (torch.uint8, lead + (k * ELEMENTS[name].bits // 8,)),
                "scale_e8m0": (torch.uint8, lead + (k // BLOCK,))}
