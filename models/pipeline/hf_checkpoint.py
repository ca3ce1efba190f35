"""Write a Hugging Face style checkpoint folder (config.json, sharded safetensors, index).

Used for the embedded default model, so the pipeline reads it back exactly as it would read
a downloaded checkpoint. The folder appears only when complete (temporary name, rename).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict, List

import torch
from safetensors.torch import save_file


def write_hf_checkpoint(folder: str, config: Dict, tensors: Dict[str, torch.Tensor], *, max_shard_bytes: int) -> str:
    if os.path.exists(folder):
        raise FileExistsError(f"{folder}: already exists; refusing to overwrite a checkpoint")
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    tmp = folder + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(tmp, file), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    os.rename(tmp, folder)
    return folder
