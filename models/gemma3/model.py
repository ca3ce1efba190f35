"""Gemma 3 text model in plain PyTorch: the Gemma 4 modules (models/gemma4/model.py) under a Gemma 3 config.

Module and parameter names equal transformers' ``Gemma3ForCausalLM`` state-dict names. Where the
architectures differ the config says so (models/gemma3/config.py): RMSNorms scale by 1 + weight,
v is not normalised, attention scores are scaled by query_pre_attn_scalar^-0.5, there is no
per-layer output scalar, and global layers may use linear RoPE scaling. Everything else (sliding
and global layers, q/k RMSNorm, sandwich norms, GeGLU, sqrt(hidden)-scaled tied embeddings,
optional final soft-capping, the KV caches) is the shared code.
"""

from __future__ import annotations

import torch

from models.gemma3.config import ModelConfig
from models.gemma4 import model as gemma


class Gemma3ForCausalLM(gemma.Gemma4ForCausalLM):
    """``forward(input_ids [B, S], cache=None) -> logits [B, S, V]``; ``new_cache()`` for decoding."""


def build_model(config: ModelConfig, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32):
    """Construct the model on ``device`` (meta: no memory) in ``dtype``; on a real device, random-initialised
    (norm scales 1, i.e. stored weights 0)."""
    return gemma.build_model(config, device=device, dtype=dtype, model_class=Gemma3ForCausalLM)
