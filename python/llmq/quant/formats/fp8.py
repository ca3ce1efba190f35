"""Format family "fp8": e4m3 elements with float32 multiplicative scales, per tensor, per channel
or per 128x128 tile; its container, quantizer, exact dequantize, Hugging Face export and registry entry.

``FP8Weight``: ``data`` float8_e4m3fn [..., N, K]; ``scale`` float32 (w = data * scale), one of

* "tensor":   shape[:-2] (0-dim for 1-D/2-D; one per expert for 3-D), scale = amax / 448
* "channel":  shape[:-1] + (1,)  ([N, 1] for 2-D), scale = row amax / 448
* "block128": shape[:-2] + (N/128, K/128), scale = 128x128 tile amax / 448 (DeepSeek-V3 /
  compressed-tensors "block" layout; N and K must be multiples of 128).

An all-zero tensor/row/tile gets scale 1.0 (so the stored scale is always positive, finite).
Codes are round-to-nearest-even of ``w.float() / scale`` in float32, saturated at +-448.
Dequantize ``data * scale`` is one correctly rounded float32 product.

A recipe picks the granularity with the config field ``granularity`` (default "channel"); recipe
files that chose it with ``group_size`` (0 per tensor, None/-1 per channel, 128 blocks) still read.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch

import llmq.quant._native_fp as _native_fp
from llmq.quant.codecs import FP8_E4M3_MAX, check_input, check_scale, fp8_cast, positive_or_one, row_ranges
from llmq.quant.formats.base import Format, Layout, RowQuantizer
from llmq.quant.formats.hf_export import HFExport, ct_weights, modelopt_raw_codes_warning, scalar_shape

BLOCK = 128
GRANULARITIES = ("tensor", "channel", "block128")
_DESCRIBE = {"tensor": "per tensor", "channel": "per channel", "block128": "128x128"}

# Quantize this many elements at a time: the temporaries stay in cache and peak memory stays a
# small multiple of the output instead of ~10x a large input.
_ROWS_ELEMENTS = 1 << 20


@dataclasses.dataclass(frozen=True)
class FP8Weight:
    """An e4m3 weight with float32 multiplicative scales (see module docstring for shapes)."""

    data: torch.Tensor  # float8_e4m3fn [..., N, K]
    scale: torch.Tensor  # float32, shape set by granularity
    granularity: str  # "tensor" | "channel" | "block128"
    dtype: torch.dtype = torch.bfloat16  # the original weight's dtype

    def __post_init__(self):
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"FP8Weight.granularity={self.granularity!r}; expected one of {GRANULARITIES}")
        if self.data.dtype != torch.float8_e4m3fn:
            raise ValueError(f"FP8Weight.data must be float8_e4m3fn, got {self.data.dtype}")
        expect = fp8_scale_shape(tuple(self.data.shape), self.granularity)
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != expect:
            raise ValueError(f"FP8Weight.scale must be float32 {list(expect)}, got {self.scale.dtype} {list(self.scale.shape)}")

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def format(self) -> str:
        return "fp8"


def fp8_scale_shape(shape: Tuple[int, ...], granularity: str) -> Tuple[int, ...]:
    """Shape of an FP8 scale for a weight of `shape` (see module docstring)."""
    if granularity == "tensor":
        return tuple(shape[:-2])
    if granularity == "channel":
        return tuple(shape[:-1]) + (1,)
    if granularity == "block128":
        return tuple(shape[:-2]) + (shape[-2] // BLOCK, shape[-1] // BLOCK)
    raise ValueError(f"FP8 granularity {granularity!r} unknown; expected one of {GRANULARITIES}")



def fp8_tensor_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """The per-tensor FP8 scale from a weight amax: amax / 448, 1.0 where amax == 0."""
    s = amax.float() / FP8_E4M3_MAX
    return torch.where(s > 0, s, torch.ones_like(s))


def quantize_fp8(w: torch.Tensor, granularity: str = "tensor", *, name: str = "<tensor>", scale: Optional[torch.Tensor] = None) -> FP8Weight:
    """FP8 e4m3 with scale = amax/448 per tensor (per expert for 3-D), per row or per 128x128 tile.

    `scale` overrides the computed one (e.g. a scale shared by fused q/k/v siblings); it must
    have the granularity's shape and be positive.
    """
    native = _native_fp.quantize_fp8(w, granularity, scale, block=BLOCK)  # same bytes, compiled; None: use the reference below
    if native is not None:
        return FP8Weight(data=native[0], scale=native[1], granularity=granularity, dtype=w.dtype)
    if granularity not in GRANULARITIES:
        raise ValueError(f"{name}: FP8 granularity {granularity!r} unknown; expected one of {GRANULARITIES}")
    check_input(w, name, BLOCK if granularity == "block128" else 1, f"FP8 {granularity}")
    k = w.shape[-1]
    rows = w.reshape(-1, k)
    data = torch.empty(rows.shape, dtype=torch.float8_e4m3fn)
    if granularity == "block128":
        if w.dim() < 2 or w.shape[-2] % BLOCK:
            raise ValueError(f"{name}: FP8 block128 needs a 2-D/3-D weight with N and K multiples of {BLOCK}, got shape {list(w.shape)} (pad the weight first)")
        n = w.shape[-2]
        bands = rows.reshape(-1, BLOCK, k // BLOCK, BLOCK)  # [bands, 128, K/128, 128]
        if scale is None:
            amax = bands.abs().amax(dim=(1, 3)).float()  # |bf16| and max are exact
            scale = positive_or_one(amax / FP8_E4M3_MAX).reshape(*w.shape[:-2], n // BLOCK, k // BLOCK)
        scale = check_scale(scale, fp8_scale_shape(tuple(w.shape), granularity), name)
        band_scale = scale.reshape(-1, k // BLOCK)
        step = max(1, _ROWS_ELEMENTS // (BLOCK * k))
        for a in range(0, bands.shape[0], step):
            x = bands[a : a + step].float()
            data.view(-1, BLOCK, k // BLOCK, BLOCK)[a : a + step] = fp8_cast(x / band_scale[a : a + step, None, :, None])
    else:
        if scale is None:
            if granularity == "channel":
                amax = w.abs().amax(dim=-1, keepdim=True)
            elif w.dim() == 3:
                amax = w.abs().amax(dim=(-2, -1))
            else:
                amax = w.abs().amax()
            scale = positive_or_one(amax.float() / FP8_E4M3_MAX)
        scale = check_scale(scale, fp8_scale_shape(tuple(w.shape), granularity), name)
        if granularity == "channel":
            row_scale = scale.reshape(-1)
        else:
            row_scale = scale.reshape(-1, 1).expand(-1, rows.shape[0] // scale.numel()).reshape(-1)
        for a, b in row_ranges(rows.shape[0], k, _ROWS_ELEMENTS):
            data[a:b] = fp8_cast(rows[a:b].float() / row_scale[a:b, None])
    data = data.reshape(w.shape)
    scale = check_scale(scale, fp8_scale_shape(tuple(w.shape), granularity), name)
    return FP8Weight(data=data, scale=scale, granularity=granularity, dtype=w.dtype)


def dequantize_fp8(w: FP8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The exact float32 value of an FP8Weight, then cast to dtype."""
    x = w.data.float()
    if w.granularity == "block128":
        n, k = w.shape[-2:]
        tiles = x.reshape(*w.shape[:-2], n // BLOCK, BLOCK, k // BLOCK, BLOCK)
        out = (tiles * w.scale[..., :, None, :, None]).reshape(w.shape)
    elif w.granularity == "channel":
        out = x * w.scale
    else:
        out = x * w.scale.reshape(w.scale.shape + (1,) * min(2, x.dim()))
    return out.to(dtype)


def granularity_from_group_size(group_size: Optional[int]) -> str:
    """Map a recipe's group_size to an FP8 granularity: None/-1 -> per channel, 0 -> per
    tensor, 128 -> 128x128 blocks (group_size is otherwise meaningless for FP8)."""
    if group_size in (None, -1):
        return "channel"
    if group_size == 0:
        return "tensor"
    if group_size == BLOCK:
        return "block128"
    raise ValueError(f"FP8 group_size={group_size} unsupported; use 0 (per tensor), None/-1 (per channel) or 128 (128x128 blocks)")


# granularity -> (ModelOpt quant_algo, compressed-tensors strategy)
_HF_NAMES = {"tensor": ("FP8", "tensor"), "channel": ("FP8_PER_CHANNEL_PER_TOKEN", "channel"), "block128": ("FP8_PB_WO", "block")}


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
            granularity = granularity_from_group_size(spec.group_size)
        if granularity not in GRANULARITIES:
            raise ValueError(f"{where}: FP8 granularity {granularity!r} unknown; expected one of {GRANULARITIES}")
        out.update(granularity=granularity, group_size=BLOCK if granularity == "block128" else None)
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
        b = BLOCK
        scale = {"tensor": scalar_shape(spec), "channel": (n, 1) if ct else (n,), "block128": (n // b, k // b)}[spec.granularity]
        return {"weight": (n, k), "scale": scale}

    def modelopt_layer_config(self, spec):
        out = {"quant_algo": _HF_NAMES[spec.granularity][0]}
        if spec.granularity == "block128":
            out["group_size"] = BLOCK
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
        b = BLOCK
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

    def row_block_rows(self, spec):
        return BLOCK if spec.granularity == "block128" else 1

    def rel_rms_bound(self, spec):
        return 0.1

    def known_misreads(self, fields, style, moe):
        if style != "modelopt":
            return ()
        return (modelopt_raw_codes_warning("FP8"),)

    def needs_tensor_amax(self, spec):
        return spec.granularity == "tensor"

    def input_scale(self, amax, spec):
        return amax / FP8_E4M3_MAX

    def quantize(self, weight, spec, state):
        scale = fp8_tensor_scale_from_amax(state.weight_amax) if spec.granularity == "tensor" else None
        return quantize_fp8(weight, spec.granularity, name=f"{spec.module}.weight", scale=scale)

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
            b = BLOCK
            tiles = x.reshape(*w.shape[:-2], n // b, b, k // b, b)
            return (tiles * s[..., :, None, :, None]).reshape(w.shape)
        if spec.granularity == "channel":
            return x * (s if spec.style == "compressed-tensors" else s.unsqueeze(-1))
        return x * s.reshape(s.shape[: w.dim() - 2] + (1, 1))


class FP8Format(Format):
    family = "fp8"
    names = ("fp8",)
    container = FP8Weight
    hf_export = FP8HFExport()
    config_fields = ("bits", "granularity")

    def default_config(self, name: str) -> Dict[str, Any]:
        return {"bits": 8, "granularity": "channel"}

    def read_old_config(self, name: str, fields: Dict[str, Any]) -> Dict[str, Any]:
        """Also reads recipe files that chose the granularity with group_size (0, None/-1 or 128)."""
        fields = dict(fields)
        if "group_size" in fields and "granularity" not in fields:
            fields["granularity"] = granularity_from_group_size(fields.pop("group_size"))
        return super().read_old_config(name, fields)

    def example_configs(self, name: str) -> Tuple[Dict[str, Any], ...]:
        return tuple({"granularity": g} for g in GRANULARITIES)

    def validate_config(self, config: Any) -> None:
        if config.granularity not in GRANULARITIES:
            raise ValueError(f"QuantConfig.granularity={config.granularity!r} unsupported for fp8; expected one of {GRANULARITIES}")
        if config.bits != 8:
            raise ValueError(f"format 'fp8' has 8-bit elements, got bits={config.bits}")

    def shape_problem(self, config: Any, shape: Tuple[int, ...]) -> Optional[str]:
        if config.granularity == "block128" and (len(shape) < 2 or shape[-2] % BLOCK or shape[-1] % BLOCK):
            return f"FP8 128x128 tiles need a 2-D/3-D weight with N and K multiples of {BLOCK}"
        return None

    def describe(self, config: Any) -> str:
        return f"fp8 {_DESCRIBE[config.granularity]}"

    def quantize(self, w: torch.Tensor, config: Any, *, name: str = "<tensor>") -> FP8Weight:
        return quantize_fp8(w, config.granularity, name=name)

    def dequantize(self, value: FP8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(value, dtype)

    def row_quantizer(self, config: Any, shape: Tuple[int, ...], *, name: str = "<tensor>"):
        """Per channel: row by row. 128x128 tiles: blocks of 128 rows. Per tensor: the scale from the
        whole weight's amax (fp8_tensor_scale_from_amax, what quantize_fp8 computes), then row by row."""
        if len(shape) != 2:
            return None
        granularity = config.granularity
        if granularity == "tensor":
            return RowQuantizer(lambda block, amax: quantize_fp8(block, "tensor", name=name,
                                                                 scale=fp8_tensor_scale_from_amax(amax)),
                                needs_amax=True)
        if granularity == "block128" and shape[0] % BLOCK:
            return None  # the whole-tensor path refuses it with its own message
        return RowQuantizer(lambda block, amax: quantize_fp8(block, granularity, name=name),
                            row_multiple=BLOCK if granularity == "block128" else 1)

    def params(self, value: FP8Weight) -> Dict[str, Any]:
        return {"granularity": value.granularity}

    def stored(self, value: FP8Weight) -> Dict[str, torch.Tensor]:
        return {"data": value.data, "scale": value.scale}

    def rebuild(self, name, params, shape, dtype, stored) -> FP8Weight:
        value = FP8Weight(data=stored["data"], scale=stored["scale"], granularity=params.get("granularity"), dtype=dtype)
        if value.shape != tuple(shape):
            raise ValueError(f"data has shape {list(value.shape)}, expected {list(shape)}")
        return value

    def layout(self, name, params, shape) -> Layout:
        return {"data": (torch.float8_e4m3fn, tuple(shape)),
                "scale": (torch.float32, fp8_scale_shape(tuple(shape), params["granularity"]))}
