"""The embedded default: a deterministic tiny model of the architecture, written as an HF checkpoint.

It lets a person see in under a minute that the whole pipeline works, with nothing downloaded.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

import torch

from models.pipeline.arch import Architecture
from models.pipeline.hf_checkpoint import write_hf_checkpoint


def write_default_checkpoint(arch: Architecture, folder: str, *, seed: int = 0,
                             dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 2 << 20,
                             hf_config: Optional[Dict] = None) -> str:
    """config.json + sharded safetensors + index for the tiny model (or `hf_config`, e.g. a
    mid-size one for benchmarks); same seed, same bytes."""
    hf_config = hf_config or arch.tiny_hf_config()
    config = arch.config_from_hf(hf_config)
    torch.manual_seed(seed)
    model = arch.build_model(config, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        arch.prepare_default(model)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if getattr(config, "tie_word_embeddings", False) and name == "lm_head.weight":
            continue
        for hf_name, t in arch.to_hf_tensors(name, tensor).items():
            tensors[hf_name] = t.to(dtype).contiguous()
    os.makedirs(os.path.dirname(os.path.abspath(folder)), exist_ok=True)
    return write_hf_checkpoint(folder, hf_config, tensors, max_shard_bytes=max_shard_bytes)
