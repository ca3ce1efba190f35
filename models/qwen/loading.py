"""Load a Qwen3.5-MoE Hugging Face checkpoint (folder or .safetensors file) into our model."""

from __future__ import annotations

import os

import torch

from models.common.loading import load_hf_checkpoint, read_config
from models.qwen.config import ModelConfig
from models.qwen.keymap import hf_to_llmq_key, stack_experts
from models.qwen.model import Qwen35MoeForCausalLM, build_model


def load_weights(model: Qwen35MoeForCausalLM, path: str | os.PathLike) -> Qwen35MoeForCausalLM:
    """Fill an existing (meta or real) model from the checkpoint's tensors."""
    tied = model.config.tie_word_embeddings
    return load_hf_checkpoint(
        model, path, key_map=hf_to_llmq_key, merge=stack_experts, optional=lambda n: tied and n == "lm_head.weight"
    )


def load_model(path: str | os.PathLike, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """config.json -> ModelConfig -> model built on the meta device -> weights assigned on ``device``."""
    config = ModelConfig.from_hf_dict(read_config(path))
    model = build_model(config, device="meta", dtype=dtype)
    model = load_weights(model, path)
    return model.to(device)
