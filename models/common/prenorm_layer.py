"""The pre-norm decoder layer of the llama family (Llama, Mistral, Qwen2/3, ...), for a dense model
that is its config and its name map:

    h = h + self_attn(input_layernorm(h));   h = h + mlp(post_attention_layernorm(h))

``post_attention_layernorm`` is transformers' llama name for the norm *before* the MLP (Gemma's
layer, models/gemma4/model.py, uses the same name for a norm *after* attention: a sandwich norm;
that layer also normalises q and k unconditionally). Here q/k norms are an option (Qwen3 has them,
Llama does not) and there are no sandwich norms. Attention: grouped-query, scale head_dim^-0.5,
rotate-half RoPE (cos/sin from the model), optional sliding window. Module and parameter names are
transformers' (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``input_layernorm``,
``post_attention_layernorm``), so a llama-family checkpoint loads with the identity name map.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from models.common.cache import KVCache, attention
from models.common.mlp import GatedMLP
from models.common.norm import RMSNorm
from models.common.rope import apply_rope


@dataclass(frozen=True)
class PreNormLayerShape:
    """What one layer needs from a model's config (the fields carry transformers' names).

    head_dim: per head (llama: hidden_size // num_attention_heads). hidden_act: GatedMLP's activation
    ("silu" for llama). attention_bias: biases on q/k/v/o (Qwen2: q/k/v only, ``o_bias=False``).
    qk_norm: RMSNorm over each head's q and k before RoPE (Qwen3). sliding_window: the layer's
    window (None: full causal attention).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str = "silu"
    attention_bias: bool = False
    o_bias: Optional[bool] = None  # None: as attention_bias
    qk_norm: bool = False
    sliding_window: Optional[int] = None


class PreNormAttention(nn.Module):
    def __init__(self, shape: PreNormLayerShape):
        super().__init__()
        d, hd, bias = shape.hidden_size, shape.head_dim, shape.attention_bias
        self.head_dim, self.window, self.scaling = hd, shape.sliding_window, hd**-0.5
        self.q_proj = nn.Linear(d, shape.num_attention_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, shape.num_key_value_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, shape.num_key_value_heads * hd, bias=bias)
        self.o_proj = nn.Linear(shape.num_attention_heads * hd, d,
                                bias=bias if shape.o_bias is None else shape.o_bias)
        self.q_norm = RMSNorm(hd, shape.rms_norm_eps) if shape.qk_norm else None
        self.k_norm = RMSNorm(hd, shape.rms_norm_eps) if shape.qk_norm else None

    def forward(self, hidden, cos, sin, position: int, cache: Optional[KVCache] = None) -> torch.Tensor:
        batch, seq, _ = hidden.shape
        shape = (batch, seq, -1, self.head_dim)
        query, key = self.q_proj(hidden).view(shape), self.k_proj(hidden).view(shape)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query = apply_rope(query.transpose(1, 2), cos, sin)
        key = apply_rope(key.transpose(1, 2), cos, sin)
        value = self.v_proj(hidden).view(shape).transpose(1, 2)
        key_start = position
        if cache is not None:
            key, value, key_start = cache.append(key, value)
        out = attention(query, key, value, query_start=position, key_start=key_start, scaling=self.scaling,
                        window=self.window)
        return self.o_proj(out)


class PreNormDecoderLayer(nn.Module):
    """``layer(hidden, cos, sin, position, state)`` as models.common.causal_lm.CausalLM calls it;
    ``new_state()`` is its KVCache."""

    def __init__(self, shape: PreNormLayerShape):
        super().__init__()
        self.window = shape.sliding_window
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = PreNormAttention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = GatedMLP(shape.hidden_size, shape.intermediate_size, shape.hidden_act)

    def new_state(self) -> KVCache:
        return KVCache(window=self.window)

    def forward(self, hidden, cos, sin, position: int, cache: Optional[KVCache] = None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, position, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
