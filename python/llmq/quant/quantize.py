"""The front door of quantization: `quantize_weight` and `dequantize` for every registered format.

Each format family (llmq/quant/formats/*) owns its math; this module finds the family of a config
or a quantized weight in the registry and hands it over, after the checks that hold for all of them.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import torch

from llmq.quant.formats import format_of, get_format
from llmq.quant.recipe import QuantConfig


def quantize_weight(w: torch.Tensor, config: QuantConfig, *, name: str = "<tensor>",
                    importance: Optional[torch.Tensor] = None, hessian: Optional[torch.Tensor] = None):
    """Quantize a 1-D, 2-D [out, in] or 3-D [experts, out, in] float weight along its last
    (input) dimension into the container of ``config.format`` (looked up in the format
    registry, llmq.quant.formats): a GroupQuantizedWeight for "int", FP8Weight, MXWeight or
    NVFP4Weight for the floating-point formats.

    importance: optional positive weights [K], one per input channel (e.g. the mean squared
    activation of each input feature over a calibration text, the imatrix idea); the methods in
    the format's `importance_methods` ("int" with "hqq" or "search") then minimise the
    importance-weighted error. Other methods refuse it.

    hessian: the layer's input second moment H [K, K] (the mean of x x^T over calibration tokens,
    llmq.quant.importance.Calibration.hessians) for method "gptq" (llmq.quant.gptq; formats "int"
    and the GGUF block types q4_0 .. q6_k), which needs it; other methods refuse it."""
    if not isinstance(config, QuantConfig):
        raise ValueError(f"{name}: expected a QuantConfig, got {type(config).__name__}")
    if hessian is not None or config.method == "gptq":
        if config.method != "gptq":
            raise ValueError(f"{name}: hessian= applies to method 'gptq' only, got {config.describe()!r}")
        if importance is not None:
            raise ValueError(f"{name}: method 'gptq' takes hessian=, not importance= (diag(H) is the importance)")
        if hessian is None:
            get_format(config.format).quantize(w, config, name=name)  # raises: gptq needs H
        from llmq.quant.gptq import gptq_quantize

        return gptq_quantize(w, config, hessian, name=name)
    if importance is not None:
        if not takes_importance(config):
            raise ValueError(f"{name}: importance weights apply to format 'int' with method 'hqq' or 'search' only, got {config.describe()!r}")
        return get_format(config.format).quantize(w, config, name=name, importance=importance)
    return get_format(config.format).quantize(w, config, name=name)


def quantize_layer(weights: Mapping[str, torch.Tensor], configs: Mapping[str, Any],
                   hessians: Mapping[str, torch.Tensor]) -> Dict[str, Any]:
    """Quantize the linears of one layer given their H: {name: quantized weight} for every name in
    `weights` whose config (configs[name]) is not None; gptq configs round against hessians[name],
    the others as quantize_weight does. What a sequential (layer by layer) calibration calls once
    a layer's inputs are known, before feeding the quantized layer's outputs to the next one."""
    out = {}
    for name, w in weights.items():
        config = configs.get(name)
        if config is None:
            continue
        hessian = hessians.get(name) if config.method == "gptq" else None
        out[name] = quantize_weight(w, config, name=name, hessian=hessian)
    return out


def takes_importance(config: QuantConfig) -> bool:
    """Whether quantize_weight(..., importance=) applies to `config`: its method is one of its
    format's `importance_methods` (format "int", method "hqq" or "search")."""
    return config.method in get_format(config.format).importance_methods


def dequantize(qw, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The float weight a quantized weight of any registered format stands for, exact in
    float32 (integer: scale*q + bias in float64, rounded once), then cast to `dtype` (default:
    the dtype the weight was quantized from)."""
    fmt = format_of(qw)
    if fmt is None:
        raise ValueError(f"dequantize expects a quantized weight (GroupQuantizedWeight, FP8Weight, MXWeight, NVFP4Weight, ...), got {type(qw).__name__}")
    return fmt.dequantize(qw, qw.dtype if dtype is None else dtype)
