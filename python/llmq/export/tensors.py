"""The tensors one quantized weight becomes in a Hugging Face checkpoint, and back.

`export_quantized_weight_tensors(weight, spec, state)` turns a float weight (or an already
quantized llmq container) into the named tensors of `spec.style` (ModelOpt or
compressed-tensors). `dequantize_exported_tensors` reads them back with each reader's own
formula, which is how the tests check that what we write means what we intended. The
per-format work is the format's HF export hook (llmq/quant/formats/hf_export.py).
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch

from llmq.export.spec import ExportState, WeightExportSpec, compute_export_state
from llmq.quant.formats import format_of
from llmq.quant.formats.fp8 import fp8_tensor_scale_from_amax  # noqa: F401  (public helpers, kept importable here)
from llmq.quant.formats.hf_export import scalar_shape
from llmq.quant.formats.nvfp4 import nvfp4_global_scale_from_amax  # noqa: F401


def _check_weight(weight, spec: WeightExportSpec) -> None:
    if isinstance(weight, torch.Tensor):
        if weight.dim() not in (2, 3):
            raise ValueError(f"{spec.module}: expected a 2-D [out, in] or stacked 3-D [experts, out, in] weight, got shape {list(weight.shape)}")
        if not spec.hook.stacked and weight.dim() != 2:
            raise ValueError(f"{spec.module}: {spec.format} export takes 2-D weights; split stacked experts first (got shape {list(weight.shape)})")
        return
    fmt = format_of(weight)  # the format registry names what a container holds
    got = fmt.name_of(weight) if fmt is not None else None
    if got != spec.format:
        raise ValueError(f"{spec.module}: spec says {spec.format}, got a {type(weight).__name__}{' ' + got if got else ''}")


def quantize_for_spec(weight: torch.Tensor, spec: WeightExportSpec, state: ExportState):
    """Quantize a float weight as `spec` says, using the (possibly merged) state's scales."""
    return spec.hook.quantize(weight, spec, state)


def export_quantized_weight_tensors(weight, spec: WeightExportSpec, state: Optional[ExportState] = None,
                                    dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    """name -> tensor for one module's quantized weight, in spec.style's names/dtypes/shapes.

    weight: a float tensor [N, K] (or stacked [E, N, K] for the FP formats: every output then
    gains a leading E), or an llmq container (FP8Weight, MXWeight, NVFP4Weight,
    GroupQuantizedWeight) that is converted without requantizing.
    state: the export state (from compute_export_state / merge_export_states); computed
    from the weight when omitted.
    dtype: dtype of the integer formats' weight_scale (default float32, which keeps the
    canonical scales exact).
    """
    _check_weight(weight, spec)
    if isinstance(weight, torch.Tensor):
        if state is None:
            state = compute_export_state(weight, spec)
        q = quantize_for_spec(weight, spec, state)
    else:
        q = weight
        if state is None:
            state = ExportState()
        if spec.static_input_scale and state.input_amax is None:
            raise ValueError(f"{spec.module}: static_input_scale needs state.input_amax")
    hook = spec.hook
    names = spec.tensor_names()
    out: Dict[str, torch.Tensor] = {names[role]: t for role, t in hook.to_tensors(q, spec, state, dtype).items()}
    if spec.static_input_scale:
        s = hook.input_scale(state.input_amax.float(), spec)
        out[names["input_scale"]] = s.reshape(scalar_shape(spec))
    return {k: v.contiguous() for k, v in out.items()}


def dequantize_exported_tensors(tensors: Mapping[str, torch.Tensor], spec: WeightExportSpec) -> torch.Tensor:
    """float32 weight from a module's exported tensors, by the formula the spec's reader uses.

    ModelOpt / vLLM / TensorRT-LLM: NVFP4 value * (float(weight_scale) * weight_scale_2);
    compressed-tensors: value * (float(weight_scale) / weight_global_scale). FP8, MX and int
    are single exact products, identical in both styles.
    """
    names = spec.tensor_names()
    try:
        t = {role: tensors[name] for role, name in names.items() if role != "input_scale"}
    except KeyError as e:
        raise ValueError(f"{spec.module}: exported tensor {e.args[0]!r} missing") from None
    return spec.hook.dequantize(t, spec)
