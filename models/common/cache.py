"""Decode-time state: per-layer KV caches (optionally a sliding window) and the position counter.

A model creates one ``ModelCache`` per generation (``model.new_cache()``); each layer owns
one entry of ``ModelCache.layers`` (a ``KVCache`` for attention, a model-specific state for
recurrent layers). Positions are absolute token indices, so masks are built from them rather
than from cache lengths, which keeps the sliding-window bookkeeping in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch


class KVCache:
    """Keys and values of one attention layer, [B, H_kv, L, hd], with the position of entry 0.

    With ``window`` set, only the last ``window - 1`` entries are kept after each step: a query
    at position p attends to positions p-window+1 .. p, so that is all a later step can need.
    """

    def __init__(self, window: Optional[int] = None):
        self.window = window
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None
        self.start = 0  # absolute position of keys[:, :, 0]

    def append(self, keys: torch.Tensor, values: torch.Tensor):
        """Add this step's keys/values; return (all keys, all values, position of the first) for attention."""
        if self.keys is None:
            all_k, all_v, start = keys, values, self.start
        else:
            all_k = torch.cat((self.keys, keys), dim=2)
            all_v = torch.cat((self.values, values), dim=2)
            start = self.start
        if self.window is not None and all_k.shape[2] > self.window - 1:
            drop = all_k.shape[2] - (self.window - 1)
            self.keys, self.values, self.start = all_k[:, :, drop:], all_v[:, :, drop:], start + drop
        else:
            self.keys, self.values, self.start = all_k, all_v, start
        return all_k, all_v, start


@dataclass
class ModelCache:
    """Everything a model needs to continue a sequence: one state per layer and the next position."""

    layers: List[Any]
    position: int = 0
    extra: dict = field(default_factory=dict)


def attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    query_start: int,
    key_start: int,
    scaling: float,
    window: Optional[int] = None,
) -> torch.Tensor:
    """Causal (optionally sliding-window) grouped-query attention.

    query [B, H, S, hd], keys/values [B, H_kv, L, hd_v]; H must be a multiple of H_kv (each kv head
    serves H/H_kv consecutive query heads). A query at position p sees key positions k with
    k <= p and, with a window W, k > p - W. Softmax in float32. Returns [B, S, H*hd_v].
    """
    batch, heads, seq, _ = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    if heads % kv_heads:
        raise ValueError(f"attention: {heads} query heads are not a multiple of {kv_heads} kv heads")
    group = heads // kv_heads
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scaling
    q_pos = torch.arange(seq, device=query.device) + query_start
    k_pos = torch.arange(length, device=query.device) + key_start
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, values)  # [B, H, S, hd_v]
    return out.transpose(1, 2).reshape(batch, seq, heads * values.shape[-1])


class StaticKVCache:
    """A ``KVCache`` stand-in over fixed-capacity buffers, for ``torch.export``.

    ``keys``/``values`` are [B, H_kv, capacity, hd]; slot i holds absolute position i, written with
    ``index_copy`` at ``position`` (a Python int or a 0-d int64 tensor), so shapes never change and
    nothing grows on the Python side. Slots that are empty or outside a sliding window are hidden by
    ``attention``'s position mask, so one buffer layout serves full and sliding layers.

    ``attend_cached=False`` (prefill from an empty cache) returns only this step's keys/values to
    attention, exactly what ``KVCache`` returns on its first call, while still filling the buffers.
    The caller keeps every written position below the capacity.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, position, attend_cached: bool = True):
        self.keys, self.values = keys, values
        self.position = position
        self.attend_cached = attend_cached

    def append(self, keys: torch.Tensor, values: torch.Tensor):
        slots = torch.arange(keys.shape[2], device=keys.device) + self.position
        self.keys = self.keys.index_copy(2, slots, keys.to(self.keys.dtype))
        self.values = self.values.index_copy(2, slots, values.to(self.values.dtype))
        if not self.attend_cached:
            return keys, values, self.position
        return self.keys.to(keys.dtype), self.values.to(values.dtype), 0
