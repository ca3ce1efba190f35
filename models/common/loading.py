"""Minimal Hugging Face safetensors loader for the models (until ``llmq.checkpoint`` takes over).

The loader is deliberately dumb: it renames every tensor through the model's key map, lets the
model merge per-expert tensors (``merge``), then checks names and shapes against the model and
assigns. Everything architecture-specific lives in the model package's key map, so swapping this
loader for ``llmq.checkpoint.load_checkpoint(path, model, key_map=...)`` changes nothing else.
"""

from __future__ import annotations

import json
import re
import os
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from safetensors import safe_open


def checkpoint_files(path: str | os.PathLike) -> List[str]:
    """The safetensors files of an HF checkpoint: one file, an index's shards, or every *.safetensors."""
    path = os.fspath(path)
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise ValueError(f"{path}: expected a .safetensors file or a Hugging Face checkpoint folder")
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file or folder")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: expected a 'weight_map' object mapping tensor names to shard files")
        files = sorted(set(weight_map.values()))
        missing = [s for s in files if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise FileNotFoundError(f"{index}: shard(s) named by the index do not exist: {missing}")
        return [os.path.join(path, s) for s in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no model.safetensors.index.json and no *.safetensors files")
    return [os.path.join(path, f) for f in files]


def iter_hf_tensors(path: str | os.PathLike) -> Iterator[Tuple[str, str, torch.Tensor]]:
    """Yield (file, HF name, tensor) for every tensor of the checkpoint, one at a time."""
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield file, name, f.get_tensor(name)


def read_config(path: str | os.PathLike) -> dict:
    """config.json of an HF folder (the folder of a single .safetensors file also works)."""
    path = os.fspath(path)
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path}: missing (a Hugging Face checkpoint folder needs its config.json)")
    with open(config_path) as f:
        return json.load(f)


@torch.no_grad()
def load_hf_checkpoint(
    model: torch.nn.Module,
    path: str | os.PathLike,
    *,
    key_map: Callable[[str], Optional[str]],
    merge: Optional[Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]]] = None,
    optional: Callable[[str], bool] = lambda name: False,
) -> torch.nn.Module:
    """Fill ``model`` (meta or real) from the checkpoint at ``path``.

    ``key_map`` renames an HF tensor name to the model's state-dict name (None: skip it);
    ``merge`` turns the renamed dict into the model's layout (stacking per-expert tensors);
    ``optional(name)`` says which model tensors may be absent (tied output heads).
    Raises ValueError naming every missing, unexpected or mis-shaped tensor.
    """
    tensors: Dict[str, torch.Tensor] = {}
    origin: Dict[str, str] = {}
    for file, hf_name, tensor in iter_hf_tensors(path):
        name = key_map(hf_name)
        if name is None:
            continue
        if name in tensors:
            raise ValueError(f"{file}: tensor {hf_name!r} maps to {name!r}, which {origin[name]} already provided")
        tensors[name] = tensor
        origin[name] = f"{file}:{hf_name}"
    if merge is not None:
        tensors = merge(tensors)

    expected = model.state_dict()
    problems = []
    for name, tensor in tensors.items():
        if name not in expected:
            problems.append(f"unexpected tensor {name!r} (from {origin.get(name, 'merged experts')})")
        elif tuple(tensor.shape) != tuple(expected[name].shape):
            problems.append(
                f"tensor {name!r}: shape {tuple(tensor.shape)} in the checkpoint, model expects {tuple(expected[name].shape)}"
            )
    missing = [n for n in expected if n not in tensors and not optional(n)]
    problems += [f"missing tensor {n!r}" for n in missing]
    if problems:
        shown = "; ".join(problems[:10]) + (f"; ... ({len(problems)} problems)" if len(problems) > 10 else "")
        raise ValueError(f"{os.fspath(path)}: checkpoint does not match the model: {shown}")

    state = {n: t.to(dtype=expected[n].dtype) for n, t in tensors.items()}
    device = next(iter(expected.values())).device
    if device.type != "meta":
        state = {n: t.to(device) for n, t in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model




_LAYER_PREFIX = re.compile(r"^model\.layers\.(\d+)\.")


def decoder_layer_index(name: str) -> Optional[int]:
    """Decoder layer of a (renamed) state-dict name, None for embeddings / final norm / head: for bucketing keys by layer."""
    m = _LAYER_PREFIX.match(name)
    return None if m is None else int(m.group(1))
