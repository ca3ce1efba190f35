"""The one interface every weight format implements, and the registry that finds them by name.

A format family (one module under llmq/quant/formats) subclasses `Format` and registers one
instance with `register_format`; everything else (recipe validation, quantize_weight,
dequantize, the bundle writer and reader, backends that declare what they accept) asks the
registry instead of branching on format names. Contract and how to add one: docs/formats.md.

A format describes its weights in three ways:

* in memory: its container class (`container`), e.g. GroupQuantizedWeight or NVFP4Weight;
* on disk: `stored(value)` -> ordered ``{role: tensor}`` plus `params(value)` (small JSON
  values such as FP8's granularity) are what the bundle writes; `rebuild(...)` is the inverse
  and `layout(...)` says which roles, dtypes and shapes a weight of a given shape stores;
* as numbers: `quantize(w, config)` and the exact `dequantize(value, dtype)`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

Layout = Dict[str, Tuple[torch.dtype, Tuple[int, ...]]]

# What config dicts of earlier versions held for every format, used or not (see read_old_config).
_WRITTEN_FOR_ALL = {"symmetric": (True,), "scale_dtype": ("float32", torch.float32)}


@dataclasses.dataclass(frozen=True)
class RowQuantizer:
    """How a format quantizes a 2-D weight block of rows by block (`Format.row_quantizer`;
    llmq.quant.row_blocks drives it).

    quantize(block, amax) -> the format's container for that block; amax is the whole
    weight's float32 max |w| when needs_amax, else None. Blocks hold a multiple of
    row_multiple rows (but the last)."""

    quantize: Callable[[torch.Tensor, Optional[torch.Tensor]], Any]
    needs_amax: bool = False
    row_multiple: int = 1


def first_of_alike(experts: Sequence[Any], layout: Callable[[Any], Dict[str, Any]]) -> Any:
    """experts[0], after checking that every expert has its `layout` ({name: value}, e.g. shape
    and group size): what stacking per-expert weights into one [E, ...] weight (a backend's
    `stack_experts`) needs. ValueError naming the first expert that differs, or no experts."""
    if not experts:
        raise ValueError("stack_experts: no experts given")
    want = layout(experts[0])
    for i, e in enumerate(experts):
        got = layout(e)
        if got != want:
            def show(d):
                return " ".join(f"{k}={v}" for k, v in d.items())
            raise ValueError(f"stack_experts: expert {i} has {show(got)}; expert 0 has {show(want)}")
    return experts[0]


class Format(abc.ABC):
    """One format family. Subclasses set `family`, `names` and `container` and implement the
    abstract methods; the optional ones have working defaults."""

    family: str = ""  # the module's family name, e.g. "fp8"
    names: Tuple[str, ...] = ()  # the names a QuantConfig.format may use (one family may have several)
    container: type = object  # the in-memory class of a quantized weight
    can_quantize: bool = True  # False for import-only families (GGUF block types)
    has_quantized_module: bool = False  # QuantizedLinear / QuantizedEmbedding can hold it
    methods: Tuple[str, ...] = ("minmax",)  # the QuantConfig.method values its quantize takes
    # The methods whose quantize also takes importance= (positive weights [K], one per input
    # channel, that the method's error is weighted by); quantize_weight refuses importance elsewhere.
    importance_methods: Tuple[str, ...] = ()
    # True where quantizing a weight quantizes each row (along K) on its own: any subset of the rows,
    # quantized alone, gives exactly those rows of the whole result (no per-tensor scale), so the
    # budget may measure a large matrix on a sample of its rows (llmq.quant.budget.measure_options).
    rows_independent: bool = False
    # Optional: how the family is written into Hugging Face folders (an HFExport, hf_export.py);
    # None where it is not exportable.
    hf_export: Optional[Any] = None
    # Optional: the record kind a bundle keeps for this family in place of the generic
    # {"kind": "quantized", "format": ...} record ("int": "group_quantized", every bundle version's
    # record for it); None: the generic record (docs/checkpoint.md).
    bundle_kind: Optional[str] = None
    # The QuantConfig fields (besides format and method) this family reads; a config that sets any
    # other field is refused by name. default_config gives a value for each.
    config_fields: Tuple[str, ...] = ()

    # -- configuration ----------------------------------------------------------------------------
    def default_config(self, name: str) -> Dict[str, Any]:
        """field -> value for every field in `config_fields` a recipe may leave out (for format `name`),
        so that ``{"format": name}`` alone is a complete config."""
        return {}

    def read_old_config(self, name: str, fields: Dict[str, Any]) -> Dict[str, Any]:
        """A config dict as recipe files and bundle manifests of earlier llmq versions wrote it ->
        today's fields (QuantConfig.from_dict). Those wrote every field, so the values they held
        for a field this family does not use (symmetric true, scale_dtype float32) are dropped."""
        return {f: v for f, v in fields.items()
                if f in self.config_fields or f not in _WRITTEN_FOR_ALL or v not in _WRITTEN_FOR_ALL[f]}

    def example_configs(self, name: str) -> Tuple[Dict[str, Any], ...]:
        """Configs (fields beside the format) that between them produce every stored layout of format
        `name`: what tests write to a bundle and an HF folder for each registered format. Default: the
        default config alone."""
        return ({},)

    def complete_config(self, name: str, given: Dict[str, Any]) -> Dict[str, Any]:
        """The values of `config_fields` for a config of format `name` that set `given` (field ->
        value, unset fields left out): the defaults, overridden by `given`. ValueError naming a
        given field this family does not use."""
        unused = [f for f in given if f not in self.config_fields]
        if unused:
            raise ValueError(f"QuantConfig field(s) {unused} do not apply to format {name!r}; it takes "
                             f"{', '.join(self.config_fields + ('method',))}")
        return {**self.default_config(name), **given}

    @abc.abstractmethod
    def validate_config(self, config: Any) -> None:
        """Raise ValueError (one line, naming the field) if `config` is not valid for this format.
        Called by QuantConfig after the format-independent fields are checked."""

    def describe(self, config: Any) -> str:
        """Short human-readable form of a config of this family (QuantConfig.describe adds the
        method); default: the format name and its group size, e.g. 'nvfp4 g16'."""
        return f"{config.format} g{config.group_size}"

    # -- numbers ----------------------------------------------------------------------------------
    def shape_problem(self, config: Any, shape: Tuple[int, ...]) -> Optional[str]:
        """What stops `config` from quantizing a weight of `shape` (e.g. a group size that does not
        divide K), as a phrase, or None; checked for every tensor before a run writes anything."""
        return None

    @abc.abstractmethod
    def quantize(self, w: torch.Tensor, config: Any, *, name: str = "<tensor>") -> Any:
        """Quantize a 1-D, 2-D or 3-D float weight along its last dimension into `container`
        (formats with `importance_methods` also take ``importance=``, a tensor or None)."""

    @abc.abstractmethod
    def dequantize(self, value: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The exact float32 value of `value`, then cast to dtype."""

    # -- storage ----------------------------------------------------------------------------------
    def name_of(self, value: Any) -> str:
        """The config name of a stored value (families with several names override)."""
        return self.names[0]

    def params(self, value: Any) -> Dict[str, Any]:
        """JSON scalars besides shape and dtype needed to rebuild `value` (default: none)."""
        return {}

    @abc.abstractmethod
    def stored(self, value: Any) -> Dict[str, torch.Tensor]:
        """The tensors that represent `value` on disk, role -> tensor, in storage order."""

    @abc.abstractmethod
    def rebuild(self, name: str, params: Dict[str, Any], shape: Tuple[int, ...], dtype: torch.dtype,
                stored: Dict[str, torch.Tensor]) -> Any:
        """The container back from what `stored` gave (raises ValueError when the parts disagree)."""

    @abc.abstractmethod
    def layout(self, name: str, params: Dict[str, Any], shape: Tuple[int, ...]) -> Layout:
        """role -> (dtype, shape) of every tensor a weight of logical `shape` stores."""

    def nbytes(self, value: Any) -> int:
        return sum(t.numel() * t.element_size() for t in self.stored(value).values())

    def shape_of(self, value: Any) -> Tuple[int, ...]:
        return tuple(value.shape)

    # -- optional edges ---------------------------------------------------------------------------
    def to_torchao(self, value: Any):
        """The torchao tensor that dequantizes to the same values (NotImplementedError if none)."""
        raise NotImplementedError(f"format {self.name_of(value)!r} has no torchao conversion")

    def fuse_along_output(self, values: Sequence[Any]) -> Any:
        """One weight [..., sum N_i, K] from weights [..., N_i, K] of this family (sibling projections
        q|k|v, gate|up), exactly; ValueError where the family cannot (the default)."""
        raise ValueError(f"format family {self.family!r} cannot fuse weights along the output dimension")

    def native_kernel_available(self) -> bool:
        """Whether a compiled quantize kernel serves this family on this machine."""
        return False

    def row_quantizer(self, config: Any, shape: Tuple[int, ...], *, name: str = "<tensor>") -> Optional[RowQuantizer]:
        """How to quantize a 2-D weight of `shape` block of rows by block with exactly the bytes
        `quantize` gives for the whole weight, or None where this family or config cannot (the
        default): the weight is then quantized whole."""
        return None

    def __repr__(self) -> str:
        return f"<Format {self.family}: {', '.join(self.names)}>"


_BY_NAME: Dict[str, Format] = {}
_BY_TYPE: Dict[type, Format] = {}


def register_format(fmt: Format, *, overwrite: bool = False) -> Format:
    """Make `fmt` findable by each of its names and by its container type; returns it."""
    if not isinstance(fmt, Format):
        raise TypeError(f"register_format expects a Format instance, got {type(fmt).__name__}")
    if not fmt.names:
        raise ValueError(f"format family {fmt.family!r} declares no names")
    for name in fmt.names:
        if name in _BY_NAME and not overwrite and _BY_NAME[name] is not fmt:
            raise ValueError(f"format name {name!r} is already registered by family {_BY_NAME[name].family!r}")
    for name in fmt.names:
        _BY_NAME[name] = fmt
    if fmt.container is not object:
        _BY_TYPE[fmt.container] = fmt
    return fmt


def unregister_format(fmt: Format) -> None:
    """Remove `fmt` (its names and container) from the registry; for tests that add a family."""
    for name in fmt.names:
        if _BY_NAME.get(name) is fmt:
            del _BY_NAME[name]
    if _BY_TYPE.get(fmt.container) is fmt:
        del _BY_TYPE[fmt.container]


def get_format(name: str) -> Format:
    """The format registered under `name`; ValueError naming the known ones otherwise."""
    fmt = _BY_NAME.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ValueError(f"format {name!r} unknown; expected one of {format_names()}")
    return fmt


def format_of(value: Any) -> Optional[Format]:
    """The format whose container `value` is, or None (a plain tensor, or anything else)."""
    for cls in type(value).__mro__:
        fmt = _BY_TYPE.get(cls)
        if fmt is not None:
            return fmt
    return None


def format_names(*, quantizable: Optional[bool] = None) -> Tuple[str, ...]:
    """Registered names in registration order; quantizable=True keeps those a recipe may use."""
    return tuple(n for n, f in _BY_NAME.items() if quantizable is None or f.can_quantize == quantizable)


def is_quantized(value: Any) -> bool:
    """True for any registered container (a quantized weight of any format)."""
    return format_of(value) is not None


def nbytes_of(value: Any) -> int:
    """Bytes a tensor or a quantized weight of any format occupies (also a tensor or weight
    carried as row blocks, llmq.quant.row_blocks: its `nbytes`)."""
    fmt = format_of(value)
    if fmt is not None:
        return fmt.nbytes(value)
    return value.nbytes
