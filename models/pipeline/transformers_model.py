"""A checkpoint's model through transformers' own class for its architecture, weights streamed in.

`transformers_model_class(hf_config)` says whether transformers knows the architecture (its causal-LM
class for config.json's model_type; None, with the reason, where it does not). `build_streamed` builds
that class with its parameters on the meta device (buffers such as RoPE tables are computed as usual)
and assigns the checkpoint's tensors one at a time, so memory holds the model once and nothing else.
Names are the checkpoint's: a parameter of the model, or a per-expert matrix
(`<p>.experts.<e>.{gate_proj,up_proj,down_proj}.weight`, Mixtral's `w1/w3/w2`) that transformers
holds in fused stacks (`<p>.experts.gate_up_proj` [E, 2F, D], `<p>.experts.down_proj` [E, D, F]).
Names are first renamed by transformers' own conversion mapping for the class (e.g. Mixtral's
`block_sparse_moe` -> `mlp`). A name the class has no place for is a `NoPlace` error naming it. Nothing from the checkpoint is executed.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Dict, Iterable, Optional, Tuple

import torch
from torch import nn


class NoPlace(ValueError):
    """A tensor transformers' model class has no parameter for (or a parameter no tensor filled)."""


def transformers_model_class(hf_config: Dict[str, Any]) -> Tuple[Optional[Any], str]:
    """(the PretrainedConfig transformers builds from `hf_config`, "") where transformers has a causal-LM
    class for its model_type, else (None, why not)."""
    model_type = hf_config.get("model_type")
    try:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError as e:  # pragma: no cover - transformers is in requirements_lock.txt
        return None, f"transformers is not importable ({e})"
    import transformers

    if not isinstance(model_type, str) or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None, (f"transformers {transformers.__version__} has no causal-LM class for model_type "
                      f"{model_type!r}")
    fields = {k: v for k, v in hf_config.items() if k not in ("model_type", "auto_map")}
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError, KeyError) as e:
        return None, f"transformers cannot read this config.json as a {model_type} config ({e})"
    return config, ""


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters are created on the meta device (no memory); buffers as usual (RoPE inv_freq)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=False)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def empty_model(config) -> nn.Module:
    """transformers' causal-LM class for `config`, parameters on meta, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<leaf>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def _set(model: nn.Module, name: str, value: torch.Tensor) -> None:
    path, _, leaf = name.rpartition(".")
    module = model.get_submodule(path) if path else model
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def _expert_slot(model: nn.Module, params: Dict[str, torch.Tensor], m: "re.Match", shape) -> Tuple[str, Any]:
    """The fused stack a per-expert matrix goes into, and the view of its slot."""
    part = _PART[m["leaf"]]
    stack = f"{m['prefix']}.{'down_proj' if part == 'down' else 'gate_up_proj'}"
    if stack not in params:
        raise NoPlace(f"{m.string}: transformers' {type(model).__name__} has neither it nor a fused {stack}")
    current = params[stack]
    if current.is_meta:
        current = torch.zeros(current.shape, dtype=torch.float32)
        _set(model, stack, current)
        params[stack] = current
    e, rows, cols = int(m["e"]), shape[0], shape[1]
    if current.shape[1:] == (rows * (1 if part == "down" else 2), cols):  # [E, 2F, D] / [E, D, F]
        slot = current[e] if part == "down" else current[e, (0 if part == "gate" else rows):][:rows]
    elif current.shape[1:] == (cols, rows * (1 if part == "down" else 2)):  # transposed stacks
        slot = current[e].T if part == "down" else current[e, :, (0 if part == "gate" else rows):][:, :rows].T
    else:
        raise NoPlace(f"{m.string}: shape {list(shape)} does not fit {stack} {list(current.shape)}")
    return stack, slot


def _renamer(model: nn.Module):
    """transformers' own renamings of checkpoint keys for this class (its conversion mapping's
    WeightRenaming entries, e.g. Mixtral's block_sparse_moe -> mlp); the identity where it has none."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings

        renamings = [t for t in get_model_conversion_mapping(model) if type(t) is WeightRenaming]
    except (ImportError, AttributeError, TypeError):  # an older transformers: checkpoint keys are model keys
        return lambda name: name
    return lambda name: apply_renamings(name, renamings) if renamings else name


@torch.no_grad()
def load_streamed(model: nn.Module, items: Iterable[Tuple[str, torch.Tensor]]) -> nn.Module:
    """Assign each (checkpoint name, float tensor) to `model` (from `empty_model`) as it arrives;
    NoPlace for a tensor without a place, or for parameters left empty at the end."""
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers()))
    rename = _renamer(model)
    for name, value in items:
        name = rename(name)
        if name in params:
            want = tuple(params[name].shape)
            if tuple(value.shape) != want:
                raise NoPlace(f"{name}: shape {list(value.shape)}, transformers' {type(model).__name__} expects {list(want)}")
            value = value.to(torch.float32)
            _set(model, name, value)
            params[name] = value
            continue
        m = _PER_EXPERT.match(name)
        if m is None:
            raise NoPlace(f"{name}: transformers' {type(model).__name__} has no such parameter")
        _, slot = _expert_slot(model, params, m, tuple(value.shape))
        slot.copy_(value)
    if getattr(model.config, "tie_word_embeddings", False) or getattr(
            model.config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    empty = [n for n, p in model.named_parameters() if p.is_meta]
    if empty:
        raise NoPlace(f"no checkpoint tensor for {len(empty)} of transformers' parameters, e.g. {empty[:3]}")
    return model
