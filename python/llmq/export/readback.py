"""Read a written Hugging Face quantized folder back the way its consumer does, and check it.

`verify_export(folder, reference=None)` parses the folder's own description of itself -- the
``quantization_config`` of config.json (compressed-tensors ``config_groups`` with their
``targets`` / ``ignore``, or ModelOpt's ``quant_algo`` / ``quantized_layers`` /
``exclude_modules``, cross-checked with hf_quant_config.json) -- never the specs the writer
used. For every module the config quantizes it checks the tensors that reader loads (names,
dtypes, shapes), decodes them with the reader's documented formula (the format's HF export
hook, llmq/quant/formats/hf_export.py), and compares with `reference`:

* an llmq container (what was quantized): every stored tensor must equal the one that
  container exports to, byte for byte (a differing tensor is named), and the decoded weight
  must equal llmq's exact dequantization (bit-exact; NVFP4 in compressed-tensors style within
  one float32 rounding, since that reader divides by the stored 1/g);
* a float tensor (the weight before quantization): the relative RMS error of the decoded
  weight must stay within the format's bound (a corrupted scale breaks it by ~1).

`consumer_warnings(folder)` returns one line per known consumer that misreads the folder's
layout, naming one that reads it correctly (docs/export.md, "Consumers tried").
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch
from safetensors import safe_open

from llmq.export.spec import WeightExportSpec, export_hook, export_hooks
from llmq.quant.formats import format_of

Reference = Union[None, Mapping[str, Any], Callable[[str], Any]]


@dataclasses.dataclass
class ExportReport:
    """What verify_export found. modules: module -> llmq format name, for every module the
    config quantizes; max_error: module -> max |decoded - reference| (modules with a
    reference); problems: one line each, naming the tensor or module; warnings: known
    consumers that misread this layout (consumer_warnings)."""

    folder: str
    style: str
    modules: Dict[str, str] = dataclasses.field(default_factory=dict)
    max_error: Dict[str, float] = dataclasses.field(default_factory=dict)
    problems: List[str] = dataclasses.field(default_factory=list)
    warnings: List[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


# --------------------------------------------------------------------------------------------
# The folder: tensors and config
# --------------------------------------------------------------------------------------------


class _Folder:
    """name -> (shard file) for a folder's safetensors, read lazily one tensor at a time."""

    def __init__(self, folder: str):
        self.folder = folder
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self.where = {n: os.path.join(folder, s) for n, s in weight_map.items()}
        else:
            single = os.path.join(folder, "model.safetensors")
            if not os.path.exists(single):
                raise ValueError(f"{folder}: no model.safetensors or model.safetensors.index.json")
            with safe_open(single, "pt") as f:
                self.where = {n: single for n in f.keys()}
        self._meta: Dict[str, Tuple[str, Tuple[int, ...]]] = {}

    def meta(self, name: str) -> Tuple[str, Tuple[int, ...]]:
        """(safetensors dtype string, shape) from the header, without reading data."""
        if name not in self._meta:
            with safe_open(self.where[name], "pt") as f:
                sl = f.get_slice(name)
                self._meta[name] = (sl.get_dtype(), tuple(sl.get_shape()))
        return self._meta[name]

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self.where[name], "pt") as f:
            return f.get_tensor(name)


def _read_config(folder: str) -> Dict[str, Any]:
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read ({e})") from None
    if not isinstance(cfg.get("quantization_config"), Mapping):
        raise ValueError(f"{path}: no quantization_config; not a quantized folder")
    return cfg


def _ct_match(name: str, target: str) -> bool:
    """compressed-tensors' rule: "re:<regex>" matches from the start of the name; otherwise the
    module's name or its class name equals the target. Without the model, the class "Linear"
    stands for every 2-D weight of the folder (the layers llmq quantizes)."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target == "Linear"


def _scheme_lookup(cfg: Mapping[str, Any], folder: str, problems: List[str]) -> Tuple[str, Callable[[str], Optional[Dict[str, Any]]], Any]:
    """(style, module -> spec fields or None, model_moe) from the folder's quantization_config."""
    qc = cfg["quantization_config"]
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        groups = []
        for gid, group in (qc.get("config_groups") or {}).items():
            fields = _first(lambda h, group=group: h.from_compressed_tensors(group))
            if fields is None:
                problems.append(f"config.json: quantization_config group {gid} (format {group.get('format')!r}) is read by no registered format")
                continue
            groups.append((list(group.get("targets") or []), fields))
        ignore = list(qc.get("ignore") or [])

        def lookup(module: str):
            if any(_ct_match(module, t) for t in ignore):
                return None
            for targets, fields in groups:
                if any(_ct_match(module, t) for t in targets):
                    return fields
            return None

        return "compressed-tensors", lookup, qc
    if method == "modelopt":
        q = dict(qc)
        hf_path = os.path.join(folder, "hf_quant_config.json")
        if os.path.exists(hf_path):
            with open(hf_path) as f:
                hq = json.load(f).get("quantization", {})
            for key in ("quant_algo", "quantized_layers"):
                if hq.get(key) != qc.get(key):
                    problems.append(f"hf_quant_config.json: {key} {hq.get(key)!r} differs from config.json's {qc.get(key)!r}")
            q = {**qc, **hq}
        exclude = list(q.get("exclude_modules") or q.get("ignore") or [])
        algo = q.get("quant_algo")
        layers = q.get("quantized_layers") if algo == "MIXED_PRECISION" else None
        cache: Dict[str, Optional[Dict[str, Any]]] = {}

        def fields_of(layer_config):
            key = json.dumps(layer_config, sort_keys=True)
            if key not in cache:
                cache[key] = _first(lambda h: h.from_modelopt(layer_config))
                if cache[key] is None:
                    problems.append(f"config.json: ModelOpt quant_algo {layer_config.get('quant_algo')!r} is read by no registered format")
            return cache[key]

        def lookup(module: str):
            if any(fnmatch.fnmatchcase(module, p) for p in exclude):
                return None
            if layers is not None:
                return fields_of(layers[module]) if module in layers else None
            return fields_of({"quant_algo": algo, "group_size": q.get("group_size")}) if algo else None

        return "modelopt", lookup, q
    raise ValueError(f"{os.path.join(folder, 'config.json')}: quant_method {method!r} unknown; expected 'compressed-tensors' or 'modelopt'")


def _first(ask):
    for hook in export_hooks():
        fields = ask(hook)
        if fields is not None:
            return fields
    return None


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
           "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}


def _layers(files: "_Folder") -> Dict[str, List[str]]:
    """module -> its tensor leaf names, for modules holding a 2-D weight (the linear layers; a 3-D conv weight is not one)."""
    by_module: Dict[str, List[str]] = {}
    for n in files.where:
        module, _, leaf = n.rpartition(".")
        by_module.setdefault(module, []).append(leaf)
    return {m: leaves for m, leaves in by_module.items()
            if any(leaf in ("weight", "weight_packed") and len(files.meta(f"{m}.{leaf}")[1]) == 2 for leaf in leaves)}


# --------------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------------


def verify_export(folder: str, reference: Reference = None) -> ExportReport:
    """Check a written HF folder as its consumer reads it (module docstring).

    reference: None (structure, dtypes, shapes and finiteness only), or module fqn -> what was
    quantized: an llmq container (bit-exact comparison) or the float weight before
    quantization (error bound); a mapping or a callable returning None for modules to skip.
    Never raises for a bad folder: every finding is one line in report.problems.
    """
    folder = os.path.abspath(folder)
    report = ExportReport(folder=folder, style="?")
    try:
        cfg = _read_config(folder)
        files = _Folder(folder)
        style, lookup, _ = _scheme_lookup(cfg, folder, report.problems)
    except (ValueError, OSError, KeyError) as e:
        report.problems.append(str(e))
        return report
    report.style = style
    ref = (reference.get if isinstance(reference, Mapping) else reference) if reference is not None else (lambda m: None)
    for module, leaves in sorted(_layers(files).items()):
        fields = lookup(module)
        if fields is None:
            if "weight_scale" in leaves:
                report.problems.append(f"{module}.weight_scale: stored, but the quantization_config does not quantize {module}"
                                       " (the reader loads it unquantized)")
            continue
        try:
            spec = WeightExportSpec(module, style=style, **fields)
        except ValueError as e:
            report.problems.append(str(e))
            continue
        report.modules[module] = spec.format
        try:
            _verify_module(files, spec, ref(module), report)
        except Exception as e:  # noqa: BLE001 -- a damaged file is a finding, not a crash
            report.problems.append(f"{module}: cannot be read back ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    if isinstance(reference, Mapping):
        for module in sorted(set(reference) - set(report.modules)):
            if format_of(reference[module]) is not None:  # a float weight may stay unquantized
                report.problems.append(f"{module}: quantized by llmq but not quantized in the folder's quantization_config")
    report.warnings = consumer_warnings(folder)
    return report


def _verify_module(files: _Folder, spec: WeightExportSpec, reference: Any, report: ExportReport) -> None:
    names = spec.tensor_names()
    dtypes = spec.tensor_dtypes()
    missing = [n for n in names.values() if n not in files.where]
    if missing:
        report.problems.append(f"{missing[0]}: missing; the {spec.style} reader of {spec.format} loads {sorted(names.values())}")
        return
    bad_dtype = False
    for role, name in names.items():
        got = files.meta(name)[0]
        if _DTYPES.get(got) != dtypes[role]:
            report.problems.append(f"{name}: dtype {got}, the {spec.style} reader expects {dtypes[role]}")
            bad_dtype = True
    if bad_dtype:
        return
    stored = {role: files.get(name) for role, name in names.items()}
    try:
        decoded = spec.hook.dequantize({r: t for r, t in stored.items() if r != "input_scale"}, spec)
    except (ValueError, RuntimeError, IndexError) as e:
        report.problems.append(f"{spec.module}: cannot decode as {spec.format} ({e})")
        return
    n, k = decoded.shape[-2:]
    for role, shape in spec.tensor_shapes(n, k).items():
        if tuple(stored[role].shape) != tuple(shape):
            report.problems.append(f"{names[role]}: shape {list(stored[role].shape)}, expected {list(shape)} for a [{n}, {k}] weight")
    scales = [names[r] for r in names if r not in ("weight", "shape", "zero_point")]
    for role in ("scale", "global_scale", "input_scale"):
        if role in stored and not bool(torch.isfinite(stored[role].float()).all()):
            report.problems.append(f"{names[role]}: holds non-finite values")
    bad = int((~torch.isfinite(decoded)).sum())
    if bad:
        report.problems.append(f"{spec.module}: {bad} decoded values are not finite (scales: {', '.join(scales)})")
    if reference is None:
        return
    fmt = format_of(reference)
    if fmt is not None and fmt.name_of(reference) != spec.format:
        report.problems.append(f"{spec.module}: the folder stores {spec.format}, llmq quantized it as {fmt.name_of(reference)}")
        return
    if fmt is not None:  # what was quantized: the exact tensors and values
        expect_tensors = {names[r]: t for r, t in spec.hook.to_tensors(reference, spec, None, None).items()}
        for name, t in expect_tensors.items():
            got = stored[_role_of(names, name)]
            if got.shape != t.shape or not torch.equal(got.reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)):
                diff = ("shape" if got.shape != t.shape
                        else f"{int((got.reshape(-1).view(torch.uint8) != t.contiguous().reshape(-1).view(torch.uint8)).sum())} bytes")
                report.problems.append(f"{name}: differs from what was quantized ({diff})")
        expect = fmt.dequantize(reference, torch.float32)
        err = (decoded - expect).abs()
        report.max_error[spec.module] = float(err.max()) if err.numel() else 0.0
        tol = spec.hook.readback_rel_tolerance(spec)
        if not bool((err <= expect.abs() * tol).all()):
            report.problems.append(f"{spec.module}: decoded weight differs from llmq's dequantization by up to {report.max_error[spec.module]:.3g}"
                                   f" (scales: {', '.join(scales)})")
        return
    w = reference.detach().float()
    if tuple(w.shape) != tuple(decoded.shape):
        report.problems.append(f"{spec.module}: decodes to shape {list(decoded.shape)}, the reference weight is {list(w.shape)}")
        return
    err = decoded - w
    report.max_error[spec.module] = float(err.abs().max()) if err.numel() else 0.0
    rel = float(err.norm() / w.norm()) if float(w.norm()) > 0 else float(err.norm())
    bound = spec.hook.rel_rms_bound(spec)
    if not rel <= bound:
        report.problems.append(f"{spec.module}: relative RMS error {rel:.3g} against the original weight exceeds {spec.format}'s bound {bound:.3g}"
                               f" (scales: {', '.join(scales)})")


def read_export(folder: str, dtype: torch.dtype = torch.float32) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) of the folder as its consumer loads it, one tensor at a time: every module
    the quantization_config quantizes as ``<module>.weight`` decoded by the reader's formula
    (cast to dtype); every other tensor as stored. For running the reloaded model (--verify)."""
    folder = os.path.abspath(folder)
    cfg = _read_config(folder)
    files = _Folder(folder)
    problems: List[str] = []
    style, lookup, _ = _scheme_lookup(cfg, folder, problems)
    if problems:
        raise ValueError(problems[0])
    owned: Dict[str, WeightExportSpec] = {}
    for module in _layers(files):
        fields = lookup(module)
        if fields is not None:
            spec = WeightExportSpec(module, style=style, **fields)
            for name in spec.tensor_names().values():
                owned[name] = spec
    done = set()
    for name in files.where:
        spec = owned.get(name)
        if spec is None:
            yield name, files.get(name)
        elif spec.module not in done:
            done.add(spec.module)
            t = {role: files.get(n) for role, n in spec.tensor_names().items() if role != "input_scale"}
            yield f"{spec.module}.weight", spec.hook.dequantize(t, spec).to(dtype)


def _role_of(names: Mapping[str, str], name: str) -> str:
    return next(r for r, n in names.items() if n == name)


# --------------------------------------------------------------------------------------------
# Known consumers that misread a layout
# --------------------------------------------------------------------------------------------


def consumer_warnings(folder: str) -> List[str]:
    """One line per known consumer that loads this folder wrongly without an error, naming a
    loader that reads it correctly (measured cases: docs/export.md, "Consumers tried")."""
    try:
        cfg = _read_config(folder)
        files = _Folder(folder)
        problems: List[str] = []
        style, lookup, _ = _scheme_lookup(cfg, folder, problems)
    except (ValueError, OSError, KeyError):
        return []
    specs: Dict[Tuple, List[str]] = {}
    for module in _layers(files):
        fields = lookup(module)
        if fields is not None:
            specs.setdefault(tuple(sorted(fields.items())), []).append(module)
    moe = any(".experts." in m for ms in specs.values() for m in ms)
    out: List[str] = []
    for fields in specs:
        for line in export_hook(dict(fields)["format"]).known_misreads(dict(fields), style, moe):
            if line not in out:
                out.append(line)
    return out
