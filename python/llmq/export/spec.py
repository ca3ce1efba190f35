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
from llmq.quant.formats import format_names, get_format
from llmq.quant.formats.hf_export import STYLES, HFExport, scalar_shape
from llmq.quant.recipe import INT_FORMAT


def export_format_names() -> Tuple[str, ...]:
    """Registered format names whose family declares an HF export hook (Format.hf_export)."""
    return tuple(n for n in format_names() if get_format(n).hf_export is not None)


def export_hooks() -> Tuple[HFExport, ...]:
    """Every registered HF export hook once, in registration order (a family may have several names)."""
    out: list = []
    for name in export_format_names():
        hook = get_format(name).hf_export
        if all(hook is not h for h in out):
            out.append(hook)
    return tuple(out)


def export_hook(name: str) -> HFExport:
    """The HF export hook of format `name` (ValueError naming the exportable ones)."""
    fmt = get_format(name) if isinstance(name, str) and name in format_names() else None
    if fmt is None or fmt.hf_export is None:
        raise ValueError(f"format {name!r} unknown; expected one of {export_format_names()}")
    return fmt.hf_export


@dataclasses.dataclass(frozen=True)
class WeightExportSpec:
    """How one module's weight is exported (metadata only; see module docstring).

    module: the module fqn, e.g. ``model.layers.0.self_attn.q_proj`` (no ``.weight``).
    format: a registered format whose family has an HF export hook (export_format_names():
        "int", "fp8", "mxfp4", "mxfp8", "nvfp4").
    group_size: block along K (fixed for MX/NV; 128 for FP8 block; the int group size).
    granularity: FP8 only: "tensor" | "channel" | "block128".
    static_input_scale: write a static activation scale (needs an activation amax).

    Everything format-specific (names, dtypes, shapes, config entries, checks) comes from the
    format's hook, `self.hook` (llmq/quant/formats/hf_export.py).
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
        try:
            hook = export_hook(self.format)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        for field, value in hook.normalize(self, where).items():
            object.__setattr__(self, field, value)
        if not self.symmetric and not hook.asymmetric:
            raise ValueError(f"{where}: {self.format} is symmetric only")
        if self.static_input_scale and not hook.static_input_scale:
            have = tuple(n for n in export_format_names() if export_hook(n).static_input_scale)
            raise ValueError(f"{where}: static input scales exist for {', '.join(have)} only, not {self.format}")
        hook.check(self, where)

    @property
    def hook(self) -> HFExport:
        return export_hook(self.format)

    # ---- what the checkpoint holds -------------------------------------------------------

    def tensor_names(self) -> Dict[str, str]:
        """role -> full checkpoint name. Roles: weight, scale, global_scale, input_scale,
        zero_point, shape (only those this spec writes)."""
        hook = self.hook
        names = {role: f"{self.module}.{suffix}" for role, suffix in hook.roles(self).items()}
        if self.static_input_scale:
            names["input_scale"] = f"{self.module}.{hook.input_scale_suffix(self)}"
        return names

    def tensor_dtypes(self) -> Dict[str, torch.dtype]:
        """role -> dtype in the checkpoint."""
        roles = self.hook.roles(self)
        d = {k: v for k, v in self.hook.dtypes(self).items() if k in roles}
        if self.static_input_scale:
            d["input_scale"] = torch.float32
        return d

    def tensor_shapes(self, out_features: int, in_features: int) -> Dict[str, Tuple[int, ...]]:
        """role -> shape for a 2-D weight [out_features, in_features]."""
        shapes = dict(self.hook.shapes(self, out_features, in_features))
        if self.static_input_scale:
            shapes["input_scale"] = scalar_shape(self)
        return shapes

    # ---- how configs describe it ---------------------------------------------------------

    def modelopt_layer_config(self) -> Dict[str, Any]:
        """This layer's entry in ModelOpt's ``quantized_layers`` (quant_algo and group_size)."""
        return self.hook.modelopt_layer_config(self)

    def compressed_tensors_scheme(self) -> Dict[str, Any]:
        """This layer's compressed-tensors scheme: {"format", "weights", "input_activations"}."""
        return self.hook.compressed_tensors_scheme(self)


def make_spec(module: str, config: Any, *, style: str = "modelopt", static_input_scale: bool = False) -> WeightExportSpec:
    """A spec from a recipe config (anything with .format/.bits/.group_size/.symmetric, e.g.
    llmq.quant.QuantConfig, or a plain mapping with those keys)."""
    get = (lambda k, d=None: config.get(k, d)) if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
    fmt = get("format", INT_FORMAT)
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
        symmetric=get("symmetric") is not False,  # None: a format without the field (FP: symmetric)
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
    return spec.hook.needs_tensor_amax(spec)


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
