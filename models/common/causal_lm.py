"""The decoder-only skeleton both model families share: embed -> layers (with their cache states) -> norm -> head.

A model's ``*ForCausalLM`` sets ``self.config``, ``self.model`` (``embed_tokens``, ``layers``, ``norm``) and
``self.lm_head``, and says what differs: ``embed(input_ids)``, ``rope_for(positions, dtype)`` (a function
layer -> (cos, sin)) and ``logits(hidden)`` (the head, e.g. with soft-capping). Each layer is called as
``layer(hidden, cos, sin, position, state)`` and gives its decode state with ``layer.new_state()``.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import nn

from models.common.cache import ModelCache


class CausalLM(nn.Module):
    """``forward(input_ids [B, S], cache=None) -> logits [B, S, V]``; ``new_cache()`` for decoding."""

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def new_cache(self, batch_size: int = 1) -> ModelCache:
        return ModelCache(layers=[layer.new_state() for layer in self.model.layers])

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def rope_for(self, positions: torch.Tensor, dtype: torch.dtype) -> Callable[[nn.Module], Tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor, cache: Optional[ModelCache] = None) -> torch.Tensor:
        position = 0 if cache is None else cache.position
        hidden = self.embed(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device) + position
        rope = self.rope_for(positions, hidden.dtype)
        for i, layer in enumerate(self.model.layers):
            cos, sin = rope(layer)
            hidden = layer(hidden, cos, sin, position, None if cache is None else cache.layers[i])
        if cache is not None:
            cache.position += input_ids.shape[1]
        return self.logits(self.model.norm(hidden))
