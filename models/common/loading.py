"""Load a Hugging Face checkpoint into a model through ``llmq.checkpoint``.

Tensors are read with ``llmq.checkpoint.iter_checkpoint`` (validated headers, errors naming file
and tensor) and renamed by the model's key map; the model then merges per-expert tensors
(``merge``), the names and shapes are checked against the model, and the tensors are assigned.
Everything architecture-specific lives in the model's Architecture (``models/<m>/architecture.py``'s
``ARCHITECTURE``): its config reader, module builder, key map and expert merge; ``load_model`` is
the one loader every model uses.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Dict, Optional

import torch

from llmq.checkpoint import iter_checkpoint


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
    # llmq.checkpoint validates every header before reading and names file and tensor on error.
    for name, tensor in iter_checkpoint(path, key_map=key_map):
        if name in tensors:
            raise ValueError(f"{os.fspath(path)}: two checkpoint tensors map to {name!r}")
        tensors[name] = tensor
        origin[name] = "the checkpoint"
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


def load_model(arch, path: str | os.PathLike, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """config.json -> ``arch.config_from_hf`` -> ``arch.build_model`` on the meta device -> the checkpoint's
    tensors (``arch.key_map``, ``arch.merge_experts``) assigned, then moved to ``device``. With tied
    embeddings a stored lm_head.weight is optional."""
    config = arch.config_from_hf(read_config(path))
    model = arch.build_model(config, device="meta", dtype=dtype)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    model = load_hf_checkpoint(model, path, key_map=arch.key_map, merge=arch.merge_experts,
                               optional=lambda n: tied and n == "lm_head.weight")
    return model.to(device)


_LAYER_PREFIX = re.compile(r"^model\.layers\.(\d+)\.")


def decoder_layer_index(name: str) -> Optional[int]:
    """Decoder layer of a (renamed) state-dict name, None for embeddings / final norm / head: for bucketing keys by layer."""
    m = _LAYER_PREFIX.match(name)
    return None if m is None else int(m.group(1))
