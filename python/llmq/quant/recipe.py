"""Recipes: which module gets which quantization, decided by its fully-qualified name.

A recipe is an ordered list of rules. Each rule is a regular expression that must match a
*module* fqn completely (``model.layers.3.mlp.down_proj``, never ``...down_proj.weight``),
optionally restricted to decoder-layer indices, and a `QuantConfig` (or ``None`` = keep the
module in high precision). The first matching rule wins; if no rule matches, the module is
kept. Recipes round-trip through plain dicts (for manifests) and load from JSON/YAML files;
the file format is documented in docs/formats.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from llmq.did_you_mean import did_you_mean
from llmq.quant.formats import format_names, get_format

# The canonical group-wise integer format (the default); every format name is looked up in the
# format registry (llmq.quant.formats), which also owns each format's fields, defaults and methods.
INT_FORMAT = "int"


class _Default:
    """The value of a QuantConfig field the caller left out: the format's default fills it."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = _Default()
# The fields a format may use (Format.config_fields), in the order to_dict writes them.
FORMAT_FIELDS = ("bits", "group_size", "symmetric", "scale_dtype", "granularity")

_DTYPE_NAMES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
# Largest recipe file read (a real one is a few KB).
MAX_RECIPE_BYTES = 1 << 20
# Longest rule pattern accepted (a real one is under 100 characters).
MAX_PATTERN_CHARS = 4096


def compile_pattern(pattern: str):
    """A rule's regular expression, compiled by RE2 (google-re2): matching a name takes time linear
    in its length whatever the pattern, so a catastrophic pattern such as ``(.+)+!`` cannot hang a
    run as it would with Python's backtracking ``re``. ``fullmatch`` means what it means in ``re``
    for the patterns recipes use; lookarounds and backreferences, which need backtracking, are
    refused (ValueError, one line, naming the pattern)."""
    import re2

    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"QuantRule.pattern {pattern[:60]!r}... is {len(pattern)} characters; at most "
                         f"{MAX_PATTERN_CHARS} are accepted")
    options = re2.Options()
    options.log_errors = False  # the error is ours to report, in one line
    try:
        return re2.compile(pattern, options)
    except re2.error as e:
        reason = e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else str(e)
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"QuantRule.pattern {pattern!r} is not a valid regular expression: {e}") from None
    raise ValueError(f"QuantRule.pattern {pattern!r} needs a backtracking construct (lookaround or "
                     f"backreference; {reason}); rule patterns are matched in linear time (RE2) and cannot use one")


def _dtype_from_name(value: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    name = str(value).replace("torch.", "")
    if name not in _DTYPE_NAMES:
        raise ValueError(f"scale_dtype {value!r} unknown; expected one of {sorted(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[name]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _all_methods() -> Tuple[str, ...]:
    """Every method some quantizable format takes, in registration order."""
    return tuple(dict.fromkeys(m for n in format_names(quantizable=True) for m in get_format(n).methods))


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How to quantize one weight. Only `format` is needed: every field the format uses and the
    config leaves out takes the format's default (`Format.default_config`), and a field the format
    does not use is refused by name (it stays None).

    bits: element width ("int": 2..8, default 4; fixed by the FP formats).
    group_size: elements of a row (along K, the input dimension) that share one scale/bias;
    ``None`` or ``-1`` means one group per row (per-channel). ``-1`` is normalised to ``None``.
    "int" default 32; fixed by MX (32) and NVFP4 (16).
    symmetric: "int" only: symmetric (zero maps to zero, signed range) or asymmetric (integer zero
    point) min-max quantization; see docs/formats.md for the exact rules. Default True.
    method: how scales are chosen, one of the format's `methods` (default "minmax").
    scale_dtype: "int" only: the dtype the scales (and biases) are written in: float32 (default), or
    float16 / bfloat16, where the method chooses scales and biases exactly representable in it
    (llmq.quant.scale_rounding; the canonical form still holds them as float32). A run sets it to
    its backend's (llmq.backend.Backend.storage).
    granularity: "fp8" only: "tensor", "channel" (default) or "block128" (128x128 tiles).
    options: the method's options, a mapping (held as a sorted tuple of (name, value) pairs), for
    the methods that take some: "gptq" ("damp", "block_size", "act_order", "fit";
    llmq.quant.gptq). None or empty: the method's defaults.
    """

    format: str = INT_FORMAT
    bits: Any = DEFAULT
    group_size: Any = DEFAULT
    symmetric: Any = DEFAULT
    method: str = "minmax"
    scale_dtype: Any = DEFAULT
    granularity: Any = DEFAULT
    options: Any = None

    def __post_init__(self):
        if not isinstance(self.format, str) or self.format not in format_names():
            raise ValueError(f"QuantConfig.format={self.format!r} unknown"
                             f"{did_you_mean(self.format, format_names(quantizable=True))}; expected one of "
                             f"{format_names(quantizable=True)}")
        fmt = get_format(self.format)
        if not fmt.can_quantize:
            raise ValueError(f"QuantConfig.format={self.format!r} is import-only; expected one of {format_names(quantizable=True)}")
        # None in a field the format does not use is how such a field is stored (dataclasses.replace
        # passes it back): unset, like DEFAULT.
        given = {f: getattr(self, f) for f in FORMAT_FIELDS
                 if getattr(self, f) is not DEFAULT and (getattr(self, f) is not None or f in fmt.config_fields)}
        values = fmt.complete_config(self.format, given)
        for f in FORMAT_FIELDS:
            object.__setattr__(self, f, values.get(f))
        used = fmt.config_fields
        if "bits" in used and (not isinstance(self.bits, int) or isinstance(self.bits, bool)):
            raise ValueError(f"QuantConfig.bits must be an int, got {self.bits!r}")
        if self.group_size == -1:
            object.__setattr__(self, "group_size", None)
        if "symmetric" in used and not isinstance(self.symmetric, bool):
            raise ValueError(f"QuantConfig.symmetric must be a bool, got {self.symmetric!r}")
        if self.method not in fmt.methods:
            if self.method not in _all_methods():
                raise ValueError(f"QuantConfig.method={self.method!r} unknown; expected one of {_all_methods()}")
            raise ValueError(f"QuantConfig.method={self.method!r} does not apply to format {self.format!r}; it takes {' or '.join(map(repr, fmt.methods))}")
        if "scale_dtype" in used:
            object.__setattr__(self, "scale_dtype", _dtype_from_name(self.scale_dtype))
        object.__setattr__(self, "options", _options(self.options))
        if self.options and self.method != "gptq":
            raise ValueError(f"QuantConfig.options apply to method 'gptq' only, got {dict(self.options)} with method "
                             f"{self.method!r}")
        fmt.validate_config(self)

    def group_size_for(self, k: int) -> int:
        """The group size to use for rows of length k (resolves 'whole row')."""
        return k if self.group_size is None else self.group_size

    def to_dict(self) -> Dict[str, Any]:
        """format, the fields its format uses and method, in field order (what from_dict reads back)."""
        used = get_format(self.format).config_fields
        d: Dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("format", "method") or f.name in used:
                value = getattr(self, f.name)
                d[f.name] = _dtype_name(value) if isinstance(value, torch.dtype) else value
        if self.options:
            d["options"] = dict(self.options)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QuantConfig":
        if not isinstance(d, Mapping):
            raise ValueError(f"a quantization config must be a mapping, got {type(d).__name__}: {d!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown QuantConfig field(s) {sorted(unknown)}; expected some of {sorted(known)}")
        name = d.get("format", INT_FORMAT)
        if isinstance(name, str) and name in format_names():
            d = get_format(name).read_old_config(name, dict(d))
        return cls(**d)

    def describe(self) -> str:
        """Short human-readable form, from the format (`Format.describe`): 'int4 g32 sym', 'int8 grow
        asym' (one group a row), 'nvfp4 g16', 'fp8 per channel'; a method other than minmax follows."""
        method = "" if self.method == "minmax" else f" {self.method}"
        if self.options:
            method += " " + ",".join(f"{k}={v}" for k, v in self.options)
        scales = "" if self.scale_dtype in (None, torch.float32) else f" {_dtype_name(self.scale_dtype)} scales"
        return get_format(self.format).describe(self) + method + scales


def _options(value: Any) -> Optional[Tuple[Tuple[str, Any], ...]]:
    """QuantConfig.options as a sorted tuple of (name, value) pairs (None when empty)."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        items = list(value)
    else:
        raise ValueError(f"QuantConfig.options must be a mapping of option names to values, got {value!r}")
    if not all(isinstance(k, str) for k, _ in items):
        raise ValueError(f"QuantConfig.options: option names must be strings, got {[k for k, _ in items]!r}")
    for k, v in items:
        if not isinstance(v, (bool, int, float, str)):
            raise ValueError(f"QuantConfig.options: option {k!r} must be a number, a bool or a string, got {v!r}")
    return tuple(sorted(items)) or None


def _one_line(e: Exception) -> str:
    """A JSON/YAML parse error in one line: YAML's problem and where (its message spans 4-8 lines,
    quoting the text), JSON's message as is."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if problem and mark is not None:
        text = f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
        context = getattr(e, "context", None)
        return f"{context}: {text}" if context else text
    return " ".join(str(e).split())


def layer_index(fqn: str) -> Optional[int]:
    """The decoder-layer index of an fqn (the N of its first ``layers.N`` segment), or None."""
    m = _LAYER_INDEX.search(fqn)
    return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True)
class QuantRule:
    """One recipe line: modules whose fqn fully matches `pattern` (and, if `layers` is given,
    whose decoder-layer index is in it) get `config`; config None keeps them unquantized.

    `layers` may hold negative indices counted from the end (-1 = last layer); they need the
    model's layer count, which `QuantRecipe.bind(num_layers)` supplies.
    """

    pattern: str
    config: Optional[QuantConfig] = None
    layers: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        if not isinstance(self.pattern, str):
            raise ValueError(f"QuantRule.pattern must be a string, got {self.pattern!r}")
        compile_pattern(self.pattern)
        if isinstance(self.config, Mapping):
            object.__setattr__(self, "config", QuantConfig.from_dict(self.config))
        elif self.config is not None and not isinstance(self.config, QuantConfig):
            raise ValueError(f"QuantRule.config must be a QuantConfig, a dict or None, got {self.config!r}")
        if self.layers is not None:
            if isinstance(self.layers, (str, bytes)) or not isinstance(self.layers, Iterable):
                raise ValueError(f"QuantRule.layers must be a list/set/range of ints, got {self.layers!r}")
            layers = tuple(self.layers)
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
                raise ValueError(f"QuantRule.layers must hold ints, got {list(layers)!r}")
            object.__setattr__(self, "layers", tuple(sorted(set(layers))))

    @property
    def regex(self):
        """The compiled pattern (RE2: ``fullmatch`` in time linear in the name; see compile_pattern)."""
        return compile_pattern(self.pattern)

    @property
    def has_relative_layers(self) -> bool:
        return self.layers is not None and any(i < 0 for i in self.layers)

    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"pattern": self.pattern, "config": None if self.config is None else self.config.to_dict()}
        if self.layers is not None:
            d["layers"] = list(self.layers)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QuantRule":
        if not isinstance(d, Mapping) or "pattern" not in d:
            raise ValueError(f"a recipe rule must be a mapping with a 'pattern', got {d!r}")
        unknown = set(d) - {"pattern", "config", "layers"}
        if unknown:
            raise ValueError(f"unknown recipe rule field(s) {sorted(unknown)} in {dict(d)!r}; expected pattern, config, layers")
        config = d.get("config")
        return cls(d["pattern"], None if config is None else QuantConfig.from_dict(config), d.get("layers"))


class QuantRecipe:
    """An ordered list of QuantRules; `get_config(module_fqn)` answers with the first match."""

    def __init__(self, rules: Sequence[Union[QuantRule, Mapping[str, Any]]], *, num_layers: Optional[int] = None):
        self.rules: List[QuantRule] = [r if isinstance(r, QuantRule) else QuantRule.from_dict(r) for r in rules]
        if num_layers is not None and (not isinstance(num_layers, int) or num_layers <= 0):
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        self.num_layers = num_layers
        self._compiled = [(r, r.regex) for r in self.rules]

    def __repr__(self) -> str:
        return f"QuantRecipe({self.rules!r}, num_layers={self.num_layers})"

    def __eq__(self, other) -> bool:
        return isinstance(other, QuantRecipe) and self.rules == other.rules and self.num_layers == other.num_layers

    @property
    def needs_num_layers(self) -> bool:
        """True if a rule counts layers from the end and no layer count is bound yet."""
        return self.num_layers is None and any(r.has_relative_layers for r in self.rules)

    def bind(self, num_layers: int) -> "QuantRecipe":
        """A copy that resolves negative layer indices against a model with num_layers layers."""
        return QuantRecipe(self.rules, num_layers=num_layers)

    def _layer_allowed(self, rule: QuantRule, fqn: str) -> bool:
        if rule.layers is None:
            return True
        idx = layer_index(fqn)
        if idx is None:
            return False
        if rule.has_relative_layers and self.num_layers is None:
            raise ValueError(
                f"recipe rule {rule.pattern!r} uses layers {list(rule.layers)} counted from the end, "
                f"but the model's layer count is unknown (matching {fqn!r}); call recipe.bind(num_layers) first"
            )
        n = self.num_layers
        allowed = {i if i >= 0 else n + i for i in rule.layers}
        return idx in allowed

    def formats(self) -> Tuple[str, ...]:
        """The format names the rules use, in rule order, each once."""
        return tuple(dict.fromkeys(r.config.format for r in self.rules if r.config is not None))

    def check_formats(self, accepted: Iterable[str], writer: str) -> None:
        """Refuse, before any work, a rule whose format `writer` cannot store: one-line
        ValueError naming the rule, the format and what the writer takes."""
        accepted = tuple(accepted)
        for rule in self.rules:
            if rule.config is not None and rule.config.format not in accepted:
                raise ValueError(f"recipe rule {rule.pattern!r}: format {rule.config.format!r} cannot be written by "
                                 f"{writer}; it takes {', '.join(accepted) or 'no quantized format'}")

    def get_config(self, fqn: str) -> Optional[QuantConfig]:
        """Config for the module `fqn` (no `.weight` suffix), or None to keep it as is."""
        for rule, regex in self._compiled:
            if regex.fullmatch(fqn) and self._layer_allowed(rule, fqn):
                return rule.config
        return None

    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"rules": [r.to_dict() for r in self.rules]}
        if self.num_layers is not None:
            d["num_layers"] = self.num_layers
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QuantRecipe":
        if not isinstance(d, Mapping) or not isinstance(d.get("rules"), list):
            raise ValueError("a recipe must be a mapping with a 'rules' list")
        unknown = set(d) - {"rules", "num_layers", "name", "description"}
        if unknown:
            raise ValueError(f"unknown recipe field(s) {sorted(unknown)}; expected rules, num_layers, name, description")
        return cls([QuantRule.from_dict(r) for r in d["rules"]], num_layers=d.get("num_layers"))

    def to_file(self, path: Union[str, os.PathLike], description: Optional[str] = None) -> None:
        """Write the recipe as JSON that from_file reads back equal: one rule per line, so a
        person can read and edit it (and an optional "description")."""
        d = self.to_dict()
        head = {"description": description} if description else {}
        lines = [json.dumps(r, sort_keys=False) for r in d["rules"]]
        body = ",\n  ".join(lines)
        text = "{" + "".join(f"{json.dumps(k)}: {json.dumps(v)}, " for k, v in head.items())
        if "num_layers" in d:
            text += f'"num_layers": {d["num_layers"]}, '
        text += '"rules": [\n  ' + body + "\n]}\n"
        with open(os.fspath(path), "w", encoding="utf-8") as f:
            f.write(text)

    @classmethod
    def from_file(cls, path: Union[str, os.PathLike]) -> "QuantRecipe":
        """Load a recipe from a .json, .yaml or .yml file (format: docs/formats.md)."""
        from llmq.input_files import read_text

        path = os.fspath(path)
        text = read_text(path, "recipe file", limit=MAX_RECIPE_BYTES)  # a FIFO or /dev/zero is refused
        try:
            if path.endswith(".json"):
                data = json.loads(text)
            else:
                import yaml  # YAML is a superset of JSON, so this also reads extension-less JSON

                data = yaml.safe_load(text)
        except Exception as e:  # json.JSONDecodeError, yaml.YAMLError
            raise ValueError(f"recipe file {path} is not valid JSON/YAML: {_one_line(e)}") from None
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"recipe file {path}: {e}") from None
