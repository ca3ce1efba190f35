"""Quantization configs for Hugging Face folders: ModelOpt's hf_quant_config.json and the
``quantization_config`` entry of config.json, in the ModelOpt or compressed-tensors form.

The field names and values are the ones ModelOpt 0.47 and compressed-tensors 0.20 write
(docs/export.md lists them); the code that builds them is ours.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from llmq.export.spec import STYLES, WeightExportSpec, export_hooks

PRODUCER = {"name": "llmq", "version": "0.1"}


def _check_specs(specs: Mapping[str, WeightExportSpec], style: str) -> None:
    if style not in STYLES:
        raise ValueError(f"style {style!r} unknown; expected one of {STYLES}")
    for fqn, spec in specs.items():
        if not isinstance(spec, WeightExportSpec):
            raise ValueError(f"{fqn}: expected a WeightExportSpec, got {type(spec).__name__}")
        if spec.module != fqn:
            raise ValueError(f"{fqn}: spec is for module {spec.module!r}")
        if spec.style != style:
            raise ValueError(f"{fqn}: spec style {spec.style!r} differs from the folder's style {style!r}")


# --------------------------------------------------------------------------------------------
# ModelOpt
# --------------------------------------------------------------------------------------------


def build_modelopt_hf_quant_config(
    specs: Mapping[str, WeightExportSpec],
    *,
    exclude_modules: Iterable[str] = (),
    kv_cache_quant_algo: Optional[str] = None,
) -> Dict[str, Any]:
    """hf_quant_config.json: {"producer", "quantization": {"quant_algo", "kv_cache_quant_algo",
    ["group_size"], "exclude_modules", ["quantized_layers" when MIXED_PRECISION]}}."""
    _check_specs(specs, "modelopt")
    layers = {fqn: spec.modelopt_layer_config() for fqn, spec in sorted(specs.items())}
    distinct = {json.dumps(c, sort_keys=True) for c in layers.values()}
    quant: Dict[str, Any] = {"quant_algo": None, "kv_cache_quant_algo": kv_cache_quant_algo}
    if len(distinct) == 1:
        quant.update(next(iter(layers.values())))
    elif len(distinct) > 1:
        quant["quant_algo"] = "MIXED_PRECISION"
        quant["quantized_layers"] = layers
    quant["exclude_modules"] = sorted(set(exclude_modules))
    return {"producer": dict(PRODUCER), "quantization": quant}


def _modelopt_group(layer_config: Mapping[str, Any]) -> Dict[str, Any]:
    """A compressed-tensors-like description of one ModelOpt quant_algo (what ModelOpt puts
    in config.json's config_groups), from the hook of the format family that writes it."""
    algo, gs = layer_config["quant_algo"], layer_config.get("group_size")
    for hook in export_hooks():
        group = hook.modelopt_groups().get(algo)
        if group is not None:
            return group(gs)
    raise ValueError(f"ModelOpt quant_algo {algo!r} is written by no registered format")


def modelopt_config_json_entry(hf_quant_config: Mapping[str, Any]) -> Dict[str, Any]:
    """config.json's quantization_config for a ModelOpt folder (quant_method "modelopt")."""
    q = hf_quant_config["quantization"]
    out: Dict[str, Any] = {"quant_method": "modelopt", "quant_algo": q["quant_algo"]}
    if q["quant_algo"] == "MIXED_PRECISION":
        by_algo: Dict[str, List[str]] = {}
        configs: Dict[str, Dict[str, Any]] = {}
        for layer, cfg in q["quantized_layers"].items():
            key = json.dumps(cfg, sort_keys=True)
            by_algo.setdefault(key, []).append(layer)
            configs[key] = cfg
        out["config_groups"] = {f"group_{i}": {**_modelopt_group(configs[k]), "targets": sorted(v)} for i, (k, v) in enumerate(by_algo.items())}
        out["quantized_layers"] = q["quantized_layers"]
    elif q["quant_algo"] is not None:
        out["config_groups"] = {"group_0": {**_modelopt_group(q), "targets": ["Linear"]}}
        if "group_size" in q:
            out["group_size"] = q["group_size"]
    out["ignore"] = list(q["exclude_modules"])
    out["exclude_modules"] = list(q["exclude_modules"])
    if q.get("kv_cache_quant_algo"):
        out["kv_cache_quant_algo"] = q["kv_cache_quant_algo"]
        if q["kv_cache_quant_algo"] == "FP8":
            out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    out["producer"] = dict(hf_quant_config["producer"])
    return out


# --------------------------------------------------------------------------------------------
# compressed-tensors
# --------------------------------------------------------------------------------------------


def _generalize_targets(names: Sequence[str], owner: Mapping[str, str], group: str) -> List[str]:
    """Targets for one config group: ``re:`` patterns with layer/expert indices as \\d+ where
    such a pattern matches no module outside the group, else the exact module name."""
    out: List[str] = []
    for name in sorted(names):
        parts = re.split(r"(\.\d+)(?=\.|$)", name)
        regex = "^" + "".join(r"\.\d+" if re.fullmatch(r"\.\d+", p) else re.escape(p) for p in parts) + "$"
        compiled = re.compile(regex)
        if regex != "^" + re.escape(name) + "$" and all(owner.get(m) == group for m in owner if compiled.match(m)):
            target = "re:" + regex
        else:
            target = name
        if target not in out:
            out.append(target)
    return out


def build_compressed_tensors_config(
    specs: Mapping[str, WeightExportSpec],
    *,
    exclude_modules: Iterable[str] = (),
    kv_cache_scheme: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Any]:
    """config.json's quantization_config for a compressed-tensors folder: one config group
    per distinct scheme, "format" per group (top level "mixed-precision" when they differ)."""
    _check_specs(specs, "compressed-tensors")
    schemes: Dict[str, Dict[str, Any]] = {}
    members: Dict[str, List[str]] = {}
    for fqn, spec in sorted(specs.items()):
        scheme = spec.compressed_tensors_scheme()
        key = json.dumps(scheme, sort_keys=True)
        schemes[key] = scheme
        members.setdefault(key, []).append(fqn)
    keys = list(schemes)
    owner = {fqn: f"group_{i}" for i, k in enumerate(keys) for fqn in members[k]}
    excluded = sorted(set(exclude_modules))
    owner.update({m: "__excluded__" for m in excluded})
    groups = {}
    for i, key in enumerate(keys):
        gid = f"group_{i}"
        groups[gid] = {"targets": _generalize_targets(members[key], owner, gid), **schemes[key]}
    formats = sorted({s["format"] for s in schemes.values()})
    return {
        "quant_method": "compressed-tensors",
        "format": formats[0] if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": excluded,
        "kv_cache_scheme": dict(kv_cache_scheme) if kv_cache_scheme else None,
        "global_compression_ratio": None,
        "producer": dict(PRODUCER),
    }


def build_hf_quantization_config(
    specs: Mapping[str, WeightExportSpec],
    *,
    style: Optional[str] = None,
    exclude_modules: Iterable[str] = (),
    kv_cache_quant_algo: Optional[str] = None,
) -> Dict[str, Any]:
    """config.json's ``quantization_config`` for {fqn: spec} (style taken from the specs
    when not given). For ModelOpt, hf_quant_config.json comes from
    build_modelopt_hf_quant_config with the same arguments."""
    if style is None:
        styles = {s.style for s in specs.values()}
        if len(styles) != 1:
            raise ValueError(f"specs mix styles {sorted(styles)}; pass style=")
        style = styles.pop()
    if style == "modelopt":
        return modelopt_config_json_entry(build_modelopt_hf_quant_config(specs, exclude_modules=exclude_modules, kv_cache_quant_algo=kv_cache_quant_algo))
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True} if kv_cache_quant_algo == "FP8" else None
    if kv_cache_quant_algo not in (None, "FP8"):
        raise ValueError(f"kv_cache_quant_algo {kv_cache_quant_algo!r} unsupported for compressed-tensors; expected None or 'FP8'")
    return build_compressed_tensors_config(specs, exclude_modules=exclude_modules, kv_cache_scheme=kv)
