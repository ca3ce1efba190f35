"""Format family "mx": OCP microscaling MXFP4 (E2M1) and MXFP8 (E4M3), one E8M0 scale per 32 along K.

The element math is llmq.quant.fp (quantize_mx / dequantize_fp); this module is its registry entry.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from llmq.quant import fp
from llmq.quant.formats._fixed import check_fixed
from llmq.quant.formats.base import Format, Layout, RowQuantizer
from llmq.quant.formats.hf_export import HFExport, ct_weights, modelopt_raw_codes_warning

_BITS = {"mxfp4": 4, "mxfp8": 8}
# name -> (ModelOpt quant_algo, compressed-tensors format)
_HF_NAMES = {"mxfp4": ("MXFP4", "mxfp4-pack-quantized"), "mxfp8": ("MXFP8", "mxfp8-quantized")}


class MXHFExport(HFExport):
    """MX in HF folders: E2M1 codes packed two per byte (``weight_packed`` in compressed-tensors,
    ``weight`` in ModelOpt) or e4m3 bytes as float8_e4m3fn ``weight``; ``weight_scale`` the
    E8M0 exponents (uint8). value * 2**(scale - 127) in both styles."""

    group_size = fp.MX_BLOCK

    def fixed_bits(self, spec):
        return _BITS[spec.format]

    def roles(self, spec) -> Dict[str, str]:
        packed = spec.style == "compressed-tensors" and _BITS[spec.format] == 4
        return {"weight": "weight_packed" if packed else "weight", "scale": "weight_scale"}

    def dtypes(self, spec):
        return {"weight": torch.uint8 if _BITS[spec.format] == 4 else torch.float8_e4m3fn, "scale": torch.uint8}

    def shapes(self, spec, n, k):
        return {"weight": (n, k * _BITS[spec.format] // 8), "scale": (n, k // spec.group_size)}

    def modelopt_layer_config(self, spec):
        return {"quant_algo": _HF_NAMES[spec.format][0], "group_size": fp.MX_BLOCK}

    def modelopt_groups(self):
        def group(bits):
            return lambda gs: {"weights": {"dynamic": False, "num_bits": bits, "type": "float", "group_size": gs, "scale_dtype": "e8m0"}}
        return {_HF_NAMES[name][0]: group(bits) for name, bits in _BITS.items()}

    def compressed_tensors_scheme(self, spec):
        w = ct_weights(spec, type="float", strategy="group", group_size=fp.MX_BLOCK, scale_dtype="torch.uint8", block_structure=None)
        return {"format": _HF_NAMES[spec.format][1], "weights": w, "input_activations": None, "output_activations": None}

    def from_compressed_tensors(self, scheme):
        names = [n for n, (_, ct) in _HF_NAMES.items() if ct == scheme.get("format")]
        return {"format": names[0]} if names else None

    def from_modelopt(self, layer_config):
        names = [n for n, (algo, _) in _HF_NAMES.items() if algo == layer_config.get("quant_algo")]
        return {"format": names[0]} if names else None

    def rel_rms_bound(self, spec):
        return 0.35 if _BITS[spec.format] == 4 else 0.1

    def known_misreads(self, fields, style, moe):
        # Packed MXFP4 fails to load loudly (shape mismatch); unpacked MXFP8 loads as raw codes.
        if style == "modelopt" and _BITS[fields["format"]] == 8:
            return (modelopt_raw_codes_warning("MXFP8"),)
        return ()

    def quantize(self, weight, spec, state):
        return fp.quantize_mx(weight, spec.format, name=f"{spec.module}.weight")

    def to_tensors(self, q, spec, state, dtype):
        codes = q.codes if _BITS[spec.format] == 4 else q.codes.view(torch.float8_e4m3fn)
        return {"weight": codes, "scale": q.scale_e8m0}

    def dequantize(self, t, spec):
        w = t["weight"]
        shape = tuple(w.shape[:-1]) + (w.shape[-1] * 8 // _BITS[spec.format],)
        return fp.dequantize_fp(fp.MXWeight(codes=w.view(torch.uint8), scale_e8m0=t["scale"], fmt=spec.format, shape=shape))


class MXFormat(Format):
    family = "mx"
    names = fp.MX_FORMATS  # ("mxfp4", "mxfp8")
    container = fp.MXWeight
    hf_export = MXHFExport()

    def validate_config(self, config: Any) -> None:
        check_fixed(config, config.format, _BITS[config.format], fp.MX_BLOCK)

    def quantize(self, w: torch.Tensor, config: Any, *, name: str = "<tensor>") -> fp.MXWeight:
        return fp.quantize_mx(w, config.format, name=name)

    def dequantize(self, value: fp.MXWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return fp.dequantize_fp(value, dtype)

    def row_quantizer(self, config: Any, shape: Tuple[int, ...], *, name: str = "<tensor>"):
        """One E8M0 scale per 32 along K inside a row: row by row."""
        if len(shape) != 2:
            return None
        return RowQuantizer(lambda block, amax: fp.quantize_mx(block, config.format, name=name))

    def name_of(self, value: fp.MXWeight) -> str:
        return value.fmt

    def stored(self, value: fp.MXWeight) -> Dict[str, torch.Tensor]:
        return {"codes": value.codes, "scale_e8m0": value.scale_e8m0}

    def rebuild(self, name, params, shape, dtype, stored) -> fp.MXWeight:
        return fp.MXWeight(codes=stored["codes"], scale_e8m0=stored["scale_e8m0"], fmt=name, shape=tuple(shape), dtype=dtype)

    def layout(self, name, params, shape) -> Layout:
        lead, k = tuple(shape[:-1]), shape[-1]
        return {"codes": (torch.uint8, lead + (k * _BITS[name] // 8,)),
                "scale_e8m0": (torch.uint8, lead + (k // fp.MX_BLOCK,))}
