"""Format family "fp8": e4m3 elements with float32 scales per tensor, per channel or per 128x128 tile.

The element math is llmq.quant.fp (quantize_fp8 / dequantize_fp); this module is its entry in
the registry: config rules, the tensors a bundle stores, and the way back.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from llmq.quant import fp
from llmq.quant.formats.base import Format, Layout


class FP8Format(Format):
    family = "fp8"
    names = ("fp8",)
    container = fp.FP8Weight

    def validate_config(self, config: Any) -> None:
        gs = config.group_size
        if gs not in (None, 0, fp.FP8_BLOCK) or isinstance(gs, bool):
            raise ValueError(f"QuantConfig.group_size={gs!r} unsupported for fp8; expected 0 (per tensor), -1/None (per channel) or 128 (128x128 blocks)")
        if config.bits != 8:
            raise ValueError(f"format 'fp8' has 8-bit elements, got bits={config.bits}")

    def quantize(self, w: torch.Tensor, config: Any, *, name: str = "<tensor>") -> fp.FP8Weight:
        granularity = getattr(config, "granularity", None) or fp.fp8_granularity_for(getattr(config, "group_size", None))
        return fp.quantize_fp8(w, granularity, name=name)

    def dequantize(self, value: fp.FP8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return fp.dequantize_fp(value, dtype)

    def params(self, value: fp.FP8Weight) -> Dict[str, Any]:
        return {"granularity": value.granularity}

    def stored(self, value: fp.FP8Weight) -> Dict[str, torch.Tensor]:
        return {"data": value.data, "scale": value.scale}

    def rebuild(self, name, params, shape, dtype, stored) -> fp.FP8Weight:
        value = fp.FP8Weight(data=stored["data"], scale=stored["scale"], granularity=params.get("granularity"), dtype=dtype)
        if value.shape != tuple(shape):
            raise ValueError(f"data has shape {list(value.shape)}, expected {list(shape)}")
        return value

    def layout(self, name, params, shape) -> Layout:
        return {"data": (torch.float8_e4m3fn, tuple(shape)),
                "scale": (torch.float32, fp.fp8_scale_shape(tuple(shape), params["granularity"]))}
