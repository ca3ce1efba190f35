"""Load a Gemma 4 Hugging Face checkpoint (folder or .safetensors file) into our text model."""

from __future__ import annotations

import os

import torch

from models.common.loading import load_hf_checkpoint, read_config
from models.gemma4.config import ModelConfig
from models.gemma4.keymap import hf_to_llmq_key
from models.gemma4.model import Gemma4ForCausalLM, build_model


def load_weights(model: Gemma4ForCausalLM, path: str | os.PathLike) -> Gemma4ForCausalLM:
    """Fill an existing (meta or real) model; with tied embeddings a stored lm_head.weight is optional."""
    tied = model.config.tie_word_embeddings
    return load_hf_checkpoint(model, path, key_map=hf_to_llmq_key, optional=lambda n: tied and n == "lm_head.weight")


def load_model(path: str | os.PathLike, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """config.json -> ModelConfig -> model built on the meta device -> weights assigned on ``device``."""
    config = ModelConfig.from_hf_dict(read_config(path))
    model = build_model(config, device="meta", dtype=dtype)
    model = load_weights(model, path)
    return model.to(device)
