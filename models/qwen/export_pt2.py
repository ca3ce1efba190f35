"""bazel run //models/qwen:export_pt2 -- [--bundle=DIR --checkpoint=DIR] [--recipe=int4] [--max_seq_len=128] [--out=DIR]

torch.export of the quantized Qwen3.5-MoE's prefill and decode steps (models/pipeline/export_pt2.py).
The cache is one fixed-shape tensor pair per layer: keys/values [1, H_kv, max_seq_len, head_dim] for
gated-attention layers, and for Gated DeltaNet layers the conv state [1, conv_dim, kernel - 1] (last
inputs of the causal conv) and the recurrent state [1, H_v, d_k, d_v] (float32, as in eager).

The prefill takes a fixed prompt length (--prompt_len): the chunked delta rule loops over
ceil(S / 64) chunks in Python, which torch.export cannot trace for a symbolic S.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
from torch import nn

from models.common.cache import StaticKVCache
from models.pipeline import export_pt2
from models.pipeline.export_pt2 import CacheEntry, StaticCacheLayout
from models.qwen.architecture import ARCHITECTURE
from models.qwen.model import DeltaNetState

DYNAMIC_PROMPT = False


class QwenCacheLayout(StaticCacheLayout):
    """Per layer, in order: `layers.N.keys`/`layers.N.values` (attention) or `layers.N.conv`/`layers.N.recurrent`."""

    def __init__(self, model: nn.Module, max_seq_len: int):
        self.max_seq_len = max_seq_len
        self.kinds: List[str] = []
        self.entries = []
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        for i, layer in enumerate(model.model.layers):
            self.kinds.append(layer.layer_type)
            if layer.layer_type == "linear_attention":
                mixer = layer.linear_attn
                self.entries += [
                    CacheEntry(f"layers.{i}.conv", (1, mixer.conv_dim, mixer.kernel - 1), dtype),
                    CacheEntry(f"layers.{i}.recurrent", (1, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim),
                               torch.float32),
                ]
            else:
                attn = layer.self_attn
                shape = (1, attn.num_kv_heads, max_seq_len, attn.head_dim)
                self.entries += [CacheEntry(f"layers.{i}.keys", shape, dtype),
                                 CacheEntry(f"layers.{i}.values", shape, dtype)]

    def prefill_states(self) -> list:
        states, it = [], iter(self.entries)
        for kind in self.kinds:
            first, second = next(it), next(it)
            if kind == "linear_attention":
                states.append(DeltaNetState())  # empty: the prefill starts from zeros, exactly as eager
            else:
                states.append(StaticKVCache(torch.zeros(first.shape, dtype=first.dtype),
                                            torch.zeros(second.shape, dtype=second.dtype), 0, attend_cached=False))
        return states

    def decode_states(self, tensors: Sequence[torch.Tensor], position: torch.Tensor) -> list:
        states = []
        for j, kind in enumerate(self.kinds):
            first, second = tensors[2 * j], tensors[2 * j + 1]
            if kind == "linear_attention":
                state = DeltaNetState()
                state.conv, state.recurrent = first, second
                states.append(state)
            else:
                states.append(StaticKVCache(first, second, position))
        return states

    def tensors_of(self, states: list):
        out = []
        for state in states:
            if isinstance(state, DeltaNetState):
                out += [state.conv, state.recurrent]
            else:
                out += [state.keys, state.values]
        return tuple(out)


def cache_layout(model: nn.Module, max_seq_len: int) -> QwenCacheLayout:
    return QwenCacheLayout(model, max_seq_len)


if __name__ == "__main__":
    export_pt2.main_for(ARCHITECTURE, cache_layout, dynamic_prompt=DYNAMIC_PROMPT)
