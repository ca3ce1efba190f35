"""Load a Gemma 3 Hugging Face checkpoint (folder or .safetensors file) into our text model."""

from __future__ import annotations

import os

import torch

from models.common.loading import load_hf_checkpoint, read_config
from models.gemma3.config import ModelConfig
from models.gemma3.keymap import hf_to_llmq_key
from models.gemma3.model import build_model


def load_model(path: str | os.PathLike, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """config.json -> ModelConfig -> model built on the meta device -> weights assigned on ``device``."""
    config = ModelConfig.from_hf_dict(read_config(path))
    model = build_model(config, device="meta", dtype=dtype)
    tied = config.tie_word_embeddings
    model = load_hf_checkpoint(model, path, key_map=hf_to_llmq_key, optional=lambda n: tied and n == "lm_head.weight")
    return model.to(device)
