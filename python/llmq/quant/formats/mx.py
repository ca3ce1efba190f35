"""Format family "mx": OCP microscaling MXFP4 (E2M1) and MXFP8 (E4M3), one E8M0 scale per 32 along K.

The element math is llmq.quant.fp (quantize_mx / dequantize_fp); this module is its registry entry.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from llmq.quant import fp
from llmq.quant.formats._fixed import check_fixed
from llmq.quant.formats.base import Format, Layout

_BITS = {"mxfp4": 4, "mxfp8": 8}


class MXFormat(Format):
    family = "mx"
    names = fp.MX_FORMATS  # ("mxfp4", "mxfp8")
    container = fp.MXWeight

    def validate_config(self, config: Any) -> None:
        check_fixed(config, config.format, _BITS[config.format], fp.MX_BLOCK)

    def quantize(self, w: torch.Tensor, config: Any, *, name: str = "<tensor>") -> fp.MXWeight:
        return fp.quantize_mx(w, config.format, name=name)

    def dequantize(self, value: fp.MXWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return fp.dequantize_fp(value, dtype)

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
