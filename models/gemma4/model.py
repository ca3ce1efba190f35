"""Gemma 4 text model (dense, ``gemma4_text``) in plain PyTorch, with prefill/decode caches.

Module and parameter names equal transformers' ``Gemma4ForCausalLM`` state-dict names, so recipes
written against HF names apply unchanged. Per layer (``config.layer_types``): sliding-window or full
causal attention with RMS-normalised q and k (and scale-free-normalised v), attention scale 1, RoPE
per layer type ("default" on sliding layers; "proportional" - only the first fraction of frequency
pairs rotate, exponents over the full head - on full layers); full layers may use a wider head, fewer
KV heads and K=V (no v_proj: values are the raw k_proj output). Sandwich norms around attention and
the GeGLU MLP, a learned per-layer output scalar, embeddings scaled by sqrt(hidden), a tied LM head
and tanh soft-capping of the final logits.

Gemma 3 (models/gemma3) runs on these same modules: its config answers the questions they ask
(``norm_offset``: RMSNorm scales by 1 + weight; ``value_norm``: no v_norm; ``layer_scalar``: none;
``attention_scaling``: query_pre_attn_scalar^-0.5; "linear" RoPE scaling on global layers).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from models.common.build import build_on_device
from models.common.cache import KVCache, attention
from models.common.causal_lm import CausalLM
from models.common.mlp import GatedMLP
from models.common.norm import RMSNorm
from models.common.rope import apply_rope, rope_cos_sin
from models.gemma4.config import ModelConfig


def rope_inv_freq(rope: dict, head_dim: int) -> torch.Tensor:
    """Inverse frequencies (length head_dim/2, float32, CPU) for one layer type's rope parameters."""
    theta = float(rope["rope_theta"])
    rope_type = rope.get("rope_type", "default")
    if rope_type in ("default", "linear"):  # linear (Gemma 3's global layers): positions divided by `factor`
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
        return inv / float(rope.get("factor", 1.0)) if rope_type == "linear" else inv
    # proportional: int(p * head_dim // 2) rotating pairs with exponents over the whole head, the rest frozen (0)
    rotated = int(float(rope.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    inv = torch.zeros(head_dim // 2, dtype=torch.float32, device="cpu")
    inv[:rotated] = 1.0 / (theta ** (torch.arange(0, 2 * rotated, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    return inv / float(rope.get("factor", 1.0))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        geometry = config.layer_geometry[layer_idx]
        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.window = config.sliding_window if self.is_sliding else None
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = geometry.num_key_value_heads
        self.head_dim = geometry.head_dim
        d, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias) if geometry.has_v_proj else None
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=bias)
        self.scaling = config.attention_scaling
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=config.norm_offset)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset=config.norm_offset)
        self.v_norm = RMSNorm(self.head_dim, config.rms_norm_eps, with_scale=False) if config.value_norm else None

    def forward(self, hidden, cos, sin, position: int, cache: Optional[KVCache] = None) -> torch.Tensor:
        batch, seq, _ = hidden.shape
        shape = (batch, seq, -1, self.head_dim)
        query = apply_rope(self.q_norm(self.q_proj(hidden).view(shape)).transpose(1, 2), cos, sin)
        raw_key = self.k_proj(hidden).view(shape)
        raw_value = self.v_proj(hidden).view(shape) if self.v_proj is not None else raw_key
        key = apply_rope(self.k_norm(raw_key).transpose(1, 2), cos, sin)
        value = (raw_value if self.v_norm is None else self.v_norm(raw_value)).transpose(1, 2)
        key_start = position
        if cache is not None:
            key, value, key_start = cache.append(key, value)
        out = attention(query, key, value, query_start=position, key_start=key_start, scaling=self.scaling, window=self.window)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.window = config.sliding_window if self.layer_type == "sliding_attention" else None
        d, eps, offset = config.hidden_size, config.rms_norm_eps, config.norm_offset
        self.self_attn = Attention(config, layer_idx)
        self.mlp = GatedMLP(d, config.intermediate_size, config.hidden_activation)
        self.input_layernorm = RMSNorm(d, eps, offset=offset)
        self.post_attention_layernorm = RMSNorm(d, eps, offset=offset)
        self.pre_feedforward_layernorm = RMSNorm(d, eps, offset=offset)
        self.post_feedforward_layernorm = RMSNorm(d, eps, offset=offset)
        # Gemma 4: a learned scalar in the checkpoint (HF keeps it as a persistent buffer; so do we, same name).
        self.register_buffer("layer_scalar", torch.ones(1) if config.layer_scalar else None)

    def new_state(self) -> KVCache:
        return KVCache(window=self.window)

    def forward(self, hidden, cos, sin, position: int, cache: Optional[KVCache] = None):
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, position, cache)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        hidden = hidden + self.post_feedforward_layernorm(mlp)
        return hidden if self.layer_scalar is None else hidden * self.layer_scalar


class TextModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=config.norm_offset)


class Gemma4ForCausalLM(CausalLM):
    """The text model plus (tied) LM head. ``forward(input_ids [B, S], cache=None) -> logits [B, S, V]``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.embed_scale = config.hidden_size**0.5
        # Plain attributes (not buffers): derived from the config, never loaded, valid on meta models.
        self.inv_freq = {}
        for i, layer_type in enumerate(config.layer_types):
            if layer_type not in self.inv_freq:
                head_dim = config.layer_geometry[i].head_dim
                self.inv_freq[layer_type] = rope_inv_freq(config.rope_parameters[layer_type], head_dim)
        self.tie_weights()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # The scale is rounded to the embedding's dtype first, as in the reference (sqrt(5376) -> 73.5 in bf16);
        # a quantized embedding's rows come out in the dtype it was quantized from.
        rows = self.model.embed_tokens(input_ids)
        return rows * torch.tensor(self.embed_scale, dtype=rows.dtype)

    def rope_for(self, positions: torch.Tensor, dtype: torch.dtype):
        tables = {t: rope_cos_sin(f, positions, dtype) for t, f in self.inv_freq.items()}
        return lambda layer: tables[layer.layer_type]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def build_model(config: ModelConfig, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32,
                model_class: type = Gemma4ForCausalLM):
    """Construct the model on ``device`` (meta: no memory) in ``dtype``; on a real device, random-initialised."""
    return build_on_device(model_class, config, device, dtype, init_weights)


@torch.no_grad()
def init_weights(model: Gemma4ForCausalLM, std: float = 0.02) -> None:
    """Random init (norm scales and layer scalars 1, the rest normal(0, std)) for tests and the embedded default."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0 - model.config.norm_offset)
        else:
            p.normal_(0.0, std)
    for layer in model.model.layers:
        if layer.layer_scalar is not None:
            layer.layer_scalar.fill_(1.0)


@torch.no_grad()
def prepare_default(model: Gemma4ForCausalLM) -> None:
    """Make a random (embedded-default) Gemma 4 or Gemma 3 behave like a trained one in two known ways.

    - Each block's output passes a post-norm, so with unit scales every block adds a unit-RMS random
      vector to the residual stream and errors of all 2L blocks add up undamped. Use the scaled residual
      init of GPT-2/Megatron: post-norm scales 1/sqrt(2L) (stored as scale - norm_offset), and embeddings
      of unit RMS after Gemma's sqrt(hidden) input scaling (std 1/sqrt(hidden)), as in trained Gemmas.
    - Where attention is unscaled (Gemma 4: scaling 1.0 after q/k RMSNorms), unit q/k gains give attention
      logits of variance head_dim, softmax is near one-hot and any perturbation flips it. Trained models
      learn small q/k gains; use head_dim**-0.25 each (1/sqrt(head_dim) overall).
    """
    config = model.config
    residual_gain = (2 * len(model.model.layers)) ** -0.5
    embed = model.model.embed_tokens.weight
    embed.normal_(0.0, embed.shape[1] ** -0.5)
    for name, module in model.named_modules():
        if name.endswith(("q_norm", "k_norm")) and config.attention_scaling == 1.0:
            module.weight.mul_(module.weight.shape[0] ** -0.25)
        elif name.endswith(("post_attention_layernorm", "post_feedforward_layernorm")):
            module.weight.fill_(residual_gain - config.norm_offset)
