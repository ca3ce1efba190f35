"""Format family "fp8": e4m3 elements with float32 scales per tensor, per channel or per 128x128 tile.

The element math is llmq.quant.fp (quantize_fp8 / dequantize_fp); this module is its entry in
the registry: config rules, the tensors a bundle stores, and the way back.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from llmq.quant import fp
from llmq.quant.formats.base import Format, Layout, RowQuantizer
from llmq.quant.formats.hf_export import HFExport, ct_weights, modelopt_raw_codes_warning, scalar_shape

# granularity -> (ModelOpt quant_algo, compressed-tensors strategy)
_HF_NAMES = {"tensor": ("FP8", "tensor"), "channel": ("FP8_PER_CHANNEL_PER_TOKEN", "channel"), "block128": ("FP8_PB_WO", "block")}


def fp8_tensor_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """The per-tensor FP8 scale from a weight amax: amax / 448, 1.0 where amax == 0."""
    s = amax.float() / fp.FP8_E4M3_MAX
    return torch.where(s > 0, s, torch.ones_like(s))


class FP8HFExport(HFExport):
    """FP8 e4m3 in HF folders: ``weight`` float8_e4m3fn and ``weight_scale`` float32 (per tensor:
    0-dim / [1]; per channel: [N] in ModelOpt, [N, 1] in compressed-tensors; 128x128 blocks:
    [N/128, K/128]); value * scale in both styles."""

    bits = 8
    static_input_scale = True

    def normalize(self, spec, where):
        out = {"bits": 8} if spec.bits != 8 else {}
        granularity = spec.granularity
        if granularity is None:
            granularity = fp.fp8_granularity_for(spec.group_size)
        if granularity not in fp.FP8_GRANULARITIES:
            raise ValueError(f"{where}: FP8 granularity {granularity!r} unknown; expected one of {fp.FP8_GRANULARITIES}")
        out.update(granularity=granularity, group_size=fp.FP8_BLOCK if granularity == "block128" else None)
        return out

    def check(self, spec, where):
        if spec.style == "modelopt" and spec.granularity == "tensor" and not spec.static_input_scale:
            raise ValueError(f"{where}: ModelOpt's per-tensor FP8 (quant_algo FP8) needs a static input scale"
                             "; give an activation amax, or use granularity 'channel' / 'block128' for weight-only FP8")
        if spec.static_input_scale and spec.granularity == "block128":
            raise ValueError(f"{where}: FP8 128x128 blocks use dynamic activation scales; static_input_scale is not supported")

    def roles(self, spec):
        return {"weight": "weight", "scale": "weight_scale"}

    def dtypes(self, spec):
        return {"weight": torch.float8_e4m3fn, "scale": torch.float32}

    def shapes(self, spec, n, k):
        ct = spec.style == "compressed-tensors"
        b = fp.FP8_BLOCK
        scale = {"tensor": scalar_shape(spec), "channel": (n, 1) if ct else (n,), "block128": (n // b, k // b)}[spec.granularity]
        return {"weight": (n, k), "scale": scale}

    def modelopt_layer_config(self, spec):
        out = {"quant_algo": _HF_NAMES[spec.granularity][0]}
        if spec.granularity == "block128":
            out["group_size"] = fp.FP8_BLOCK
        return out

    def modelopt_groups(self):
        fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
        return {
            "FP8": lambda gs: {"input_activations": dict(fp8), "weights": dict(fp8)},
            "FP8_PER_CHANNEL_PER_TOKEN": lambda gs: {"input_activations": {**fp8, "dynamic": True}, "weights": {**fp8, "strategy": "channel"}},
            "FP8_PB_WO": lambda gs: {"weights": {**fp8, "strategy": "block", "block_structure": [gs, gs]}},
        }

    def compressed_tensors_scheme(self, spec):
        strategy = _HF_NAMES[spec.granularity][1]
        b = fp.FP8_BLOCK
        w = ct_weights(spec, type="float", strategy=strategy, group_size=None, block_structure=[b, b] if strategy == "block" else None)
        act = {"num_bits": 8, "type": "float", "symmetric": True}
        if spec.static_input_scale:
            act.update(strategy="tensor", dynamic=False, group_size=None)
        elif strategy == "block":
            act.update(strategy="group", group_size=b, dynamic=True)
        else:
            act.update(strategy="token", dynamic=True, group_size=None)
        return {"format": "float-quantized", "weights": w, "input_activations": act, "output_activations": None}

    def from_compressed_tensors(self, scheme):
        w = scheme.get("weights") or {}
        if scheme.get("format") != "float-quantized" or w.get("num_bits") != 8 or w.get("type") != "float":
            return None
        granularity = {ct: g for g, (_, ct) in _HF_NAMES.items()}.get(w.get("strategy"))
        if granularity is None:
            return None
        act = scheme.get("input_activations")
        return {"format": "fp8", "granularity": granularity, "static_input_scale": bool(act) and act.get("dynamic") is False}

    def from_modelopt(self, layer_config):
        granularity = {algo: g for g, (algo, _) in _HF_NAMES.items()}.get(layer_config.get("quant_algo"))
        if granularity is None:
            return None
        return {"format": "fp8", "granularity": granularity, "static_input_scale": granularity == "tensor"}

    def rel_rms_bound(self, spec):
        return 0.1

    def known_misreads(self, fields, style, moe):
        if style != "modelopt":
            return ()
        return (modelopt_raw_codes_warning("FP8"),)

    def needs_tensor_amax(self, spec):
        return spec.granularity == "tensor"

    def input_scale(self, amax, spec):
        return amax / fp.FP8_E4M3_MAX

    def quantize(self, weight, spec, state):
        scale = fp8_tensor_scale_from_amax(state.weight_amax) if spec.granularity == "tensor" else None
        return fp.quantize_fp8(weight, spec.granularity, name=f"{spec.module}.weight", scale=scale)

    def to_tensors(self, q, spec, state, dtype):
        ct = spec.style == "compressed-tensors"
        scale = q.scale
        if spec.granularity == "tensor" and ct:
            scale = scale.reshape(scale.shape + (1,))
        elif spec.granularity == "channel" and not ct:
            scale = scale.squeeze(-1)
        return {"weight": q.data, "scale": scale}

    def dequantize(self, t, spec):
        w, s = t["weight"], t["scale"]
        x = w.float()
        if spec.granularity == "block128":
            n, k = w.shape[-2:]
            b = fp.FP8_BLOCK
            tiles = x.reshape(*w.shape[:-2], n // b, b, k // b, b)
            return (tiles * s[..., :, None, :, None]).reshape(w.shape)
        if spec.granularity == "channel":
            return x * (s if spec.style == "compressed-tensors" else s.unsqueeze(-1))
        return x * s.reshape(s.shape[: w.dim() - 2] + (1, 1))


class FP8Format(Format):
    family = "fp8"
    names = ("fp8",)
    container = fp.FP8Weight
    hf_export = FP8HFExport()

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

    def row_quantizer(self, config: Any, shape: Tuple[int, ...], *, name: str = "<tensor>"):
        """Per channel: row by row. 128x128 tiles: blocks of 128 rows. Per tensor: the scale from the
        whole weight's amax (fp8_tensor_scale_from_amax, what quantize_fp8 computes), then row by row."""
        if len(shape) != 2:
            return None
        granularity = getattr(config, "granularity", None) or fp.fp8_granularity_for(getattr(config, "group_size", None))
        if granularity == "tensor":
            return RowQuantizer(lambda block, amax: fp.quantize_fp8(block, "tensor", name=name,
                                                                    scale=fp8_tensor_scale_from_amax(amax)),
                                needs_amax=True)
        if granularity == "block128" and shape[0] % fp.FP8_BLOCK:
            return None  # the whole-tensor path refuses it with its own message
        return RowQuantizer(lambda block, amax: fp.quantize_fp8(block, granularity, name=name),
                            row_multiple=fp.FP8_BLOCK if granularity == "block128" else 1)

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
