"""bazel run //models/gemma4:export -- [--bundle=DIR --checkpoint=DIR] [--recipe=int4] [--max_seq_len=128] [--out=DIR]

torch.export of the quantized Gemma 4's prefill and decode steps (models/pipeline/export_pt2.py).
The cache is keys/values [1, H_kv, max_seq_len, head_dim] per layer, indexed by absolute position.
Sliding-window layers use the same full-length buffers: attention's position mask hides what lies
outside the window, so no ring-buffer bookkeeping is needed (at the cost of max_seq_len slots per
sliding layer rather than `sliding_window`). The prefill takes a dynamic prompt length.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from models.common.cache import StaticKVCache
from models.gemma4.spec import ARCHITECTURE
from models.pipeline import export_pt2
from models.pipeline.export_pt2 import CacheEntry, StaticCacheLayout

DYNAMIC_PROMPT = True


class GemmaCacheLayout(StaticCacheLayout):
    """`layers.N.keys`, `layers.N.values` for every layer N, in order."""

    def __init__(self, model: nn.Module, max_seq_len: int):
        self.max_seq_len = max_seq_len
        self.entries = []
        dtype = model.model.embed_tokens.weight_dtype if hasattr(model.model.embed_tokens, "weight_dtype") \
            else model.model.embed_tokens.weight.dtype
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            shape = (1, attn.num_kv_heads, max_seq_len, attn.head_dim)
            self.entries += [CacheEntry(f"layers.{i}.keys", shape, dtype), CacheEntry(f"layers.{i}.values", shape, dtype)]

    def prefill_states(self) -> list:
        return [StaticKVCache(torch.zeros(k.shape, dtype=k.dtype), torch.zeros(v.shape, dtype=v.dtype), 0,
                              attend_cached=False)
                for k, v in zip(self.entries[::2], self.entries[1::2])]

    def decode_states(self, tensors: Sequence[torch.Tensor], position: torch.Tensor) -> list:
        return [StaticKVCache(k, v, position) for k, v in zip(tensors[::2], tensors[1::2])]

    def tensors_of(self, states: list):
        return tuple(t for state in states for t in (state.keys, state.values))


def cache_layout(model: nn.Module, max_seq_len: int) -> GemmaCacheLayout:
    return GemmaCacheLayout(model, max_seq_len)


if __name__ == "__main__":
    export_pt2.main_for(ARCHITECTURE, cache_layout, dynamic_prompt=DYNAMIC_PROMPT)
