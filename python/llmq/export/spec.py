"""Per-weight export specs and per-call export state.

A `WeightExportSpec` is metadata only: which format a module's weight is exported in, for
which reader convention (``style``), and therefore which tensors (names, dtypes) appear in the
checkpoint. It is reusable and never holds weights. An `ExportState` holds what one export
call measured (the weight's absolute maximum, optional activation amax); it is computed
from the weight without touching any module, and states of fused siblings (q/k/v, gate/up)
are merged so they share one global scale, as ModelOpt and vLLM require. See docs/export.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch

from llmq.quant import _native_fp
from llmq.quant.fp import FP8_BLOCK, FP8_GRANULARITIES, fp8_granularity_for

STYLES = ("modelopt", "compressed-tensors")
FORMATS = ("fp8", "mxfp8", "mxfp4", "nvfp4", "int")
_FIXED_GROUP = {"mxfp8": 32, "mxfp4": 32, "nvfp4": 16}
_FIXED_BITS = {"fp8": 8, "mxfp8": 8, "mxfp4": 4, "nvfp4": 4}


@dataclasses.dataclass(frozen=True)
class WeightExportSpec:
    """How one module's weight is exported (metadata only; see module docstring).

    module: the module fqn, e.g. ``model.layers.0.self_attn.q_proj`` (no ``.weight``).
    format: "fp8" | "mxfp8" | "mxfp4" | "nvfp4" | "int".
    group_size: block along K (fixed for MX/NV; 128 for FP8 block; the int group size).
    granularity: FP8 only: "tensor" | "channel" | "block128".
    static_input_scale: write a static activation scale (needs an activation amax).
    """

    module: str
    format: str
    style: str = "modelopt"
    bits: int = 4
    group_size: Optional[int] = None
    granularity: Optional[str] = None
    symmetric: bool = True
    static_input_scale: bool = False

    def __post_init__(self):
        where = f"export spec for {self.module!r}"
        if self.style not in STYLES:
            raise ValueError(f"{where}: style {self.style!r} unknown; expected one of {STYLES}")
        if self.format not in FORMATS:
            raise ValueError(f"{where}: format {self.format!r} unknown; expected one of {FORMATS}")
        if self.format in _FIXED_BITS and self.bits != _FIXED_BITS[self.format]:
            object.__setattr__(self, "bits", _FIXED_BITS[self.format])
        if self.format in _FIXED_GROUP:
            if self.group_size not in (None, _FIXED_GROUP[self.format]):
                raise ValueError(f"{where}: {self.format} uses blocks of {_FIXED_GROUP[self.format]}, got group_size={self.group_size}")
            object.__setattr__(self, "group_size", _FIXED_GROUP[self.format])
        if self.format == "fp8":
            if self.granularity is None:
                object.__setattr__(self, "granularity", fp8_granularity_for(self.group_size))
            if self.granularity not in FP8_GRANULARITIES:
                raise ValueError(f"{where}: FP8 granularity {self.granularity!r} unknown; expected one of {FP8_GRANULARITIES}")
            object.__setattr__(self, "group_size", FP8_BLOCK if self.granularity == "block128" else None)
        elif self.granularity is not None:
            raise ValueError(f"{where}: granularity applies to fp8 only, got {self.granularity!r} for {self.format}")
        if self.format == "int":
            if self.style == "modelopt":
                raise ValueError(f"{where}: integer weights are exported in the compressed-tensors style (pack-quantized); ModelOpt's INT4 AWQ layout is not supported")
            if self.bits not in (2, 3, 4, 5, 6, 7, 8):
                raise ValueError(f"{where}: int bits={self.bits} unsupported; expected 2..8")
            if self.group_size is not None and self.group_size <= 0:
                raise ValueError(f"{where}: int group_size must be positive or None (per channel)")
        elif not self.symmetric:
            raise ValueError(f"{where}: {self.format} is symmetric only")
        if self.static_input_scale and self.format not in ("fp8", "nvfp4"):
            raise ValueError(f"{where}: static input scales exist for fp8 and nvfp4 only, not {self.format}")
        if self.style == "modelopt" and self.format == "fp8" and self.granularity == "tensor" and not self.static_input_scale:
            raise ValueError(f"{where}: ModelOpt's per-tensor FP8 (quant_algo FP8) needs a static input scale; give an activation amax, or use granularity 'channel' / 'block128' for weight-only FP8")
        if self.static_input_scale and self.format == "fp8" and self.granularity == "block128":
            raise ValueError(f"{where}: FP8 128x128 blocks use dynamic activation scales; static_input_scale is not supported")

    # ---- what the checkpoint holds -------------------------------------------------------

    @property
    def packs_into_bytes(self) -> bool:
        return self.format in ("mxfp4", "nvfp4")

    def tensor_names(self) -> Dict[str, str]:
        """role -> full checkpoint name. Roles: weight, scale, global_scale, input_scale,
        zero_point, shape (only those this spec writes)."""
        ct = self.style == "compressed-tensors"
        m = self.module
        names = {}
        if ct and (self.packs_into_bytes or self.format == "int"):
            names["weight"] = f"{m}.weight_packed"
        else:
            names["weight"] = f"{m}.weight"
        names["scale"] = f"{m}.weight_scale"
        if self.format == "nvfp4":
            names["global_scale"] = f"{m}.weight_global_scale" if ct else f"{m}.weight_scale_2"
        if self.static_input_scale:
            names["input_scale"] = f"{m}.input_global_scale" if (ct and self.format == "nvfp4") else f"{m}.input_scale"
        if self.format == "int":
            if not self.symmetric:
                names["zero_point"] = f"{m}.weight_zero_point"
            names["shape"] = f"{m}.weight_shape"
        return names

    def tensor_dtypes(self) -> Dict[str, torch.dtype]:
        """role -> dtype in the checkpoint."""
        d = {
            "fp8": {"weight": torch.float8_e4m3fn, "scale": torch.float32},
            "mxfp8": {"weight": torch.float8_e4m3fn, "scale": torch.uint8},
            "mxfp4": {"weight": torch.uint8, "scale": torch.uint8},
            "nvfp4": {"weight": torch.uint8, "scale": torch.float8_e4m3fn, "global_scale": torch.float32},
            "int": {"weight": torch.int32, "scale": torch.float32, "zero_point": torch.int32, "shape": torch.int64},
        }[self.format]
        d = {k: v for k, v in d.items() if k in self.tensor_names()}
        if self.static_input_scale:
            d["input_scale"] = torch.float32
        return d

    def tensor_shapes(self, out_features: int, in_features: int) -> Dict[str, Tuple[int, ...]]:
        """role -> shape for a 2-D weight [out_features, in_features]."""
        n, k = out_features, in_features
        ct = self.style == "compressed-tensors"
        scalar = (1,) if ct else ()
        if self.format == "fp8":
            weight = (n, k)
            scale = {"tensor": scalar, "channel": (n, 1) if ct else (n,), "block128": (n // FP8_BLOCK, k // FP8_BLOCK)}[self.granularity]
        elif self.format == "mxfp8":
            weight, scale = (n, k), (n, k // 32)
        elif self.format in ("mxfp4", "nvfp4"):
            weight, scale = (n, k // 2), (n, k // self.group_size)
        else:
            weight = (n, -(-k * self.bits // 32))
            scale = (n, k // (self.group_size or k))
        shapes = {"weight": weight, "scale": scale}
        if self.format == "nvfp4":
            shapes["global_scale"] = scalar
        if self.static_input_scale:
            shapes["input_scale"] = scalar
        if self.format == "int":
            if not self.symmetric:
                shapes["zero_point"] = (-(-n * self.bits // 32), scale[1])
            shapes["shape"] = (2,)
        return shapes

    # ---- how configs describe it ---------------------------------------------------------

    def modelopt_layer_config(self) -> Dict[str, Any]:
        """This layer's entry in ModelOpt's ``quantized_layers`` (quant_algo and group_size)."""
        if self.format == "nvfp4":
            return {"quant_algo": "NVFP4" if self.static_input_scale else "W4A16_NVFP4", "group_size": 16}
        if self.format == "mxfp8":
            return {"quant_algo": "MXFP8", "group_size": 32}
        if self.format == "mxfp4":
            return {"quant_algo": "MXFP4", "group_size": 32}
        if self.format == "fp8":
            if self.granularity == "tensor":
                return {"quant_algo": "FP8"}
            if self.granularity == "channel":
                return {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}
            return {"quant_algo": "FP8_PB_WO", "group_size": FP8_BLOCK}
        raise ValueError(f"export spec for {self.module!r}: {self.format} has no ModelOpt quant_algo")

    def compressed_tensors_scheme(self) -> Dict[str, Any]:
        """This layer's compressed-tensors scheme: {"format", "weights", "input_activations"}."""
        w: Dict[str, Any] = {"num_bits": self.bits, "symmetric": self.symmetric, "dynamic": False}
        act = None
        if self.format == "int":
            fmt = "pack-quantized"
            gs = self.group_size
            w.update(type="int", strategy="group" if gs else "channel", group_size=gs, block_structure=None)
        elif self.format == "fp8":
            fmt = "float-quantized"
            strategy = {"tensor": "tensor", "channel": "channel", "block128": "block"}[self.granularity]
            w.update(type="float", strategy=strategy, group_size=None, block_structure=[FP8_BLOCK, FP8_BLOCK] if strategy == "block" else None)
            if self.static_input_scale:
                act = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False, "group_size": None}
            elif strategy == "block":
                act = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": FP8_BLOCK, "dynamic": True}
            else:
                act = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True, "group_size": None}
        elif self.format == "nvfp4":
            fmt = "nvfp4-pack-quantized"
            w.update(type="float", strategy="tensor_group", group_size=16, scale_dtype="torch.float8_e4m3fn", block_structure=None)
            if self.static_input_scale:
                act = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16, "dynamic": "local", "scale_dtype": "torch.float8_e4m3fn"}
        else:
            fmt = "mxfp4-pack-quantized" if self.format == "mxfp4" else "mxfp8-quantized"
            w.update(type="float", strategy="group", group_size=32, scale_dtype="torch.uint8", block_structure=None)
        return {"format": fmt, "weights": w, "input_activations": act, "output_activations": None}


def make_spec(module: str, config: Any, *, style: str = "modelopt", static_input_scale: bool = False) -> WeightExportSpec:
    """A spec from a recipe config (anything with .format/.bits/.group_size/.symmetric, e.g.
    llmq.quant.QuantConfig, or a plain mapping with those keys)."""
    get = (lambda k, d=None: config.get(k, d)) if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
    fmt = get("format", "int")
    gs = get("group_size")
    if gs == -1:
        gs = None
    return WeightExportSpec(
        module=module,
        format=fmt,
        style=style,
        bits=get("bits", 4),
        group_size=gs,
        granularity=get("granularity"),
        symmetric=get("symmetric", True),
        static_input_scale=static_input_scale,
    )


# --------------------------------------------------------------------------------------------
# Export state: measured per call, merged for fused siblings, selected for split tensors
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExportState:
    """What one export call measured. weight_amax is float32, 0-dim for a 2-D weight or [E]
    for stacked experts; None where the format has no tensor-level scale. input_amax is
    the static activation amax (0-dim) or None."""

    weight_amax: Optional[torch.Tensor] = None
    input_amax: Optional[torch.Tensor] = None


def needs_tensor_amax(spec: WeightExportSpec) -> bool:
    """Formats with a per-tensor scale derived from the weight amax (the one siblings share)."""
    return spec.format == "nvfp4" or (spec.format == "fp8" and spec.granularity == "tensor")


def compute_export_state(weight: torch.Tensor, spec: WeightExportSpec, input_amax: Optional[float] = None) -> ExportState:
    """Measure the state one export needs from a float weight ([N, K] or stacked [E, N, K])."""
    amax = None
    if needs_tensor_amax(spec):
        amax = _native_fp.abs_max(weight, per_expert=True)  # compiled, no copy; None: torch below
        if amax is None:
            x = weight.detach().abs()  # exact in the weight's own dtype; one float32 copy saved
            amax = (x.amax(dim=(-2, -1)) if x.dim() == 3 else x.amax()).float()
    ia = None
    if spec.static_input_scale:
        if input_amax is None:
            raise ValueError(f"{spec.module}: static_input_scale needs an activation amax (input_amax)")
        ia = torch.as_tensor(float(input_amax), dtype=torch.float32)
        if not bool(torch.isfinite(ia)) or float(ia) <= 0:
            raise ValueError(f"{spec.module}: activation amax must be finite and positive, got {float(ia)}")
    return ExportState(weight_amax=amax, input_amax=ia)


def merge_export_states(states: Sequence[ExportState]) -> ExportState:
    """One state for fused siblings (q/k/v, gate/up): the elementwise max of their amaxes, so
    the shared global scale covers every sibling (ModelOpt's rule)."""
    if not states:
        raise ValueError("merge_export_states needs at least one state")

    def _max(values):
        present = [v for v in values if v is not None]
        if not present:
            return None
        if len(present) != len(values):
            raise ValueError("cannot merge export states where only some siblings have a tensor scale")
        out = present[0]
        for v in present[1:]:
            if v.shape != out.shape:
                raise ValueError(f"cannot merge export states of shapes {list(out.shape)} and {list(v.shape)}")
            out = torch.maximum(out, v)
        return out

    return ExportState(weight_amax=_max([s.weight_amax for s in states]), input_amax=_max([s.input_amax for s in states]))


def select_export_state(state: ExportState, index: int) -> ExportState:
    """The state of expert `index` of a stacked [E, ...] state (for writing per-expert tensors)."""
    amax = state.weight_amax
    if amax is not None and amax.dim() == 1:
        if not 0 <= index < amax.shape[0]:
            raise IndexError(f"expert index {index} out of range for {amax.shape[0]} experts")
        amax = amax[index]
    return ExportState(weight_amax=amax, input_amax=state.input_amax)
