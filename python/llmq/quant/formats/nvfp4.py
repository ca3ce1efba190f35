"""Format family "nvfp4": E2M1 codes, an e4m3 scale per 16 along K and a float32 global scale.

The element math is llmq.quant.fp (quantize_nvfp4 / dequantize_fp, ModelOpt's rule byte for
byte); this module is its registry entry.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from llmq.quant import fp
from llmq.quant.formats._fixed import check_fixed
from llmq.quant.formats.base import Format, Layout, RowQuantizer
from llmq.quant.formats.hf_export import HFExport, ct_weights, scalar_shape


def nvfp4_global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's weight_scale_2 from a weight amax: amax / (6*448), 1.0 where amax == 0."""
    g = amax.float() / (fp.FP4_E2M1_MAX * fp.FP8_E4M3_MAX)
    return torch.where(g > 0, g, torch.ones_like(g))


class NVFP4HFExport(HFExport):
    """NVFP4 in HF folders. ModelOpt: ``weight`` (packed E2M1), ``weight_scale`` (e4m3 per 16),
    ``weight_scale_2`` = g, value * (s * g). compressed-tensors: ``weight_packed``,
    ``weight_scale``, ``weight_global_scale`` = 1/g, value * (s / weight_global_scale)."""

    bits, group_size = 4, fp.NVFP4_BLOCK
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
        return {"quant_algo": "NVFP4" if spec.static_input_scale else "W4A16_NVFP4", "group_size": fp.NVFP4_BLOCK}

    def modelopt_groups(self):
        fp4 = lambda gs: {"dynamic": False, "num_bits": 4, "type": "float", "group_size": gs}  # noqa: E731
        return {"NVFP4": lambda gs: {"input_activations": fp4(gs), "weights": fp4(gs)},
                "W4A16_NVFP4": lambda gs: {"weights": fp4(gs)}}

    def compressed_tensors_scheme(self, spec) -> Dict[str, Any]:
        w = ct_weights(spec, type="float", strategy="tensor_group", group_size=fp.NVFP4_BLOCK,
                       scale_dtype="torch.float8_e4m3fn", block_structure=None)
        act = None
        if spec.static_input_scale:
            act = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": fp.NVFP4_BLOCK,
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
        return True

    def readback_rel_tolerance(self, spec) -> float:
        # compressed-tensors divides by the stored 1/g instead of multiplying by g: a few float32
        # roundings (1/g, s/(1/g), the product) apart from llmq's value * (s * g).
        return 2.0 ** -21 if spec.style == "compressed-tensors" else 0.0

    def rel_rms_bound(self, spec) -> float:
        return 0.35

    def known_misreads(self, fields, style, moe):
        if style != "compressed-tensors" or not moe:
            return ()
        return ("transformers 5.x from_pretrained loads this compressed-tensors NVFP4 MoE folder without error but its experts "
                "do not match the stored values and the outputs are wrong (docs/export.md, 'Consumers tried'); decompress it "
                "with compressed-tensors' ModelCompressor or serve it with vLLM",)

    def input_scale(self, amax, spec):
        s = amax / (fp.FP4_E2M1_MAX * fp.FP8_E4M3_MAX)
        return 1.0 / s if spec.style == "compressed-tensors" else s

    def quantize(self, weight, spec, state):
        return fp.quantize_nvfp4(weight, name=f"{spec.module}.weight", global_scale=nvfp4_global_scale_from_amax(state.weight_amax))

    def to_tensors(self, q, spec, state, dtype):
        g = q.global_scale
        g = (1.0 / g).reshape(g.shape + (1,)) if spec.style == "compressed-tensors" else g
        return {"weight": q.codes, "scale": q.block_scale, "global_scale": g}

    def dequantize(self, t, spec):
        w, s = t["weight"], t["scale"]
        k = w.shape[-1] * 2
        vals = fp.e2m1_decode(fp.unpack_fp4(w)).reshape(*w.shape[:-1], k // 16, 16)
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
    container = fp.NVFP4Weight
    hf_export = NVFP4HFExport()

    def validate_config(self, config: Any) -> None:
        check_fixed(config, "nvfp4", 4, fp.NVFP4_BLOCK)

    def quantize(self, w: torch.Tensor, config: Any, *, name: str = "<tensor>") -> fp.NVFP4Weight:
        return fp.quantize_nvfp4(w, name=name)

    def dequantize(self, value: fp.NVFP4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return fp.dequantize_fp(value, dtype)

    def row_quantizer(self, config: Any, shape: Tuple[int, ...], *, name: str = "<tensor>"):
        """Blocks of 16 along K inside a row, under the global scale of the whole weight's amax
        (nvfp4_global_scale_from_amax, what quantize_nvfp4 computes)."""
        if len(shape) != 2:
            return None
        return RowQuantizer(lambda block, amax: fp.quantize_nvfp4(block, name=name,
                                                                  global_scale=nvfp4_global_scale_from_amax(amax)),
                            needs_amax=True)

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
