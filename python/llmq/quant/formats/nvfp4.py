"""Format family "nvfp4": E2M1 codes, an e4m3 scale per 16 along K and a float32 global scale.

The element math is llmq.quant.fp (quantize_nvfp4 / dequantize_fp, ModelOpt's rule byte for
byte); this module is its registry entry.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from llmq.quant import fp
from llmq.quant.formats._fixed import check_fixed
from llmq.quant.formats.base import Format, Layout


class NVFP4Format(Format):
    family = "nvfp4"
    names = ("nvfp4",)
    container = fp.NVFP4Weight

    def validate_config(self, config: Any) -> None:
        check_fixed(config, "nvfp4", 4, fp.NVFP4_BLOCK)

    def quantize(self, w: torch.Tensor, config: Any, *, name: str = "<tensor>") -> fp.NVFP4Weight:
        return fp.quantize_nvfp4(w, name=name)

    def dequantize(self, value: fp.NVFP4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return fp.dequantize_fp(value, dtype)

    def stored(self, value: fp.NVFP4Weight) -> Dict[str, torch.Tensor]:
        return {"codes": value.codes, "block_scale": value.block_scale, "global_scale": value.global_scale}

    def rebuild(self, name, params, shape, dtype, stored) -> fp.NVFP4Weight:
        return fp.NVFP4Weight(codes=stored["codes"], block_scale=stored["block_scale"],
                              global_scale=stored["global_scale"], shape=tuple(shape), dtype=dtype)

    def layout(self, name, params, shape) -> Layout:
        lead, k = tuple(shape[:-1]), shape[-1]
        return {"codes": (torch.uint8, lead + (k // 2,)),
                "block_scale": (torch.float8_e4m3fn, lead + (k // fp.NVFP4_BLOCK,)),
                "global_scale": (torch.float32, tuple(shape[:-2]))}
