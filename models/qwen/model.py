"""Qwen3.5-MoE text model (``qwen3_5_moe_text``) in plain PyTorch, with prefill/decode caches.

Module and parameter names equal transformers' ``Qwen3_5MoeForCausalLM`` state-dict names
(``model.layers.N.linear_attn.in_proj_qkv.weight``, ``model.layers.N.mlp.experts.gate_up_proj``, ...),
so quantization recipes written against HF names apply unchanged.

Layers follow ``config.layer_types``: "linear_attention" (Gated DeltaNet) or "full_attention"
(gated softmax attention with partial RoPE); every layer ends in a sparse MoE block with a
sigmoid-gated shared expert. All RMSNorms but the DeltaNet output norm are zero-centred
(scale = 1 + weight). Text positions are the same on Qwen's three M-RoPE axes, so M-RoPE reduces
to ordinary RoPE over the first ``head_dim * partial_rotary_factor`` features.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from models.common.build import build_on_device
from models.common.cache import KVCache, attention
from models.common.causal_lm import CausalLM
from models.common.mlp import GatedMLP
from models.common.rope import apply_rope, default_inv_freq, rope_cos_sin
from models.qwen.config import ModelConfig
from models.qwen.delta_rule import delta_rule


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose stored weight is an offset from 1 (HF ``Qwen3_5MoeRMSNorm``); computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """DeltaNet output norm: plain-scale RMSNorm of x, times silu(gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(x.dtype)
        return (out * F.silu(gate.float())).to(x.dtype)


class DeltaNetState:
    """Decode state of one Gated DeltaNet layer: last (kernel-1) conv inputs and the recurrent matrix."""

    def __init__(self):
        self.conv: Optional[torch.Tensor] = None  # [B, conv_dim, kernel - 1]
        self.recurrent: Optional[torch.Tensor] = None  # [B, Hv, dk, dv] float32


class GatedDeltaNet(nn.Module):
    """Linear-attention token mixer: projections -> causal depthwise conv + silu -> gated delta rule -> gated norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = config.linear_conv_kernel_dim
        d = config.hidden_size
        self.in_proj_qkv = nn.Linear(d, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(d, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(d, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(d, self.num_v_heads, bias=False)
        # Depthwise causal conv, weight [conv_dim, 1, kernel] as in the checkpoint.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, d, bias=False)

    def _conv(self, mixed: torch.Tensor, state: Optional[DeltaNetState]) -> torch.Tensor:
        """silu(causal depthwise conv) over [B, C, S], continuing from the cached last inputs."""
        batch, channels, seq = mixed.shape
        history = None if state is None else state.conv
        if history is None:
            history = mixed.new_zeros(batch, channels, self.kernel - 1)
        full = torch.cat((history.to(mixed.dtype), mixed), dim=-1)
        if state is not None:
            state.conv = full[:, :, -(self.kernel - 1):].clone()
        out = F.conv1d(full, self.conv1d.weight.to(mixed.dtype), groups=channels)
        return F.silu(out)

    def forward(self, hidden: torch.Tensor, state: Optional[DeltaNetState] = None) -> torch.Tensor:
        batch, seq, _ = hidden.shape
        mixed = self._conv(self.in_proj_qkv(hidden).transpose(1, 2), state).transpose(1, 2)
        query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch, seq, self.num_k_heads, self.head_k_dim)
        key = key.reshape(batch, seq, self.num_k_heads, self.head_k_dim)
        value = value.reshape(batch, seq, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(hidden).sigmoid()
        # log of the per-token state decay: -exp(A_log) * softplus(a + dt_bias), computed in float32
        log_decay = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden).float() + self.dt_bias)
        initial = None if state is None else state.recurrent
        chunk_size = None if seq == 1 and initial is not None else 64
        core, final = delta_rule(query, key, value, log_decay, beta, initial, chunk_size)
        if state is not None:
            state.recurrent = final
        z = self.in_proj_z(hidden).reshape(batch, seq, self.num_v_heads, self.head_v_dim)
        core = self.norm(core, z).reshape(batch, seq, self.value_dim)
        return self.out_proj(core)


class GatedAttention(nn.Module):
    """Softmax attention whose output is gated per feature by sigmoid(gate), gate from a doubled q_proj."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        d, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, hidden, cos, sin, position: int, cache: Optional[KVCache] = None) -> torch.Tensor:
        batch, seq, _ = hidden.shape
        # q_proj rows are per head [query (head_dim) | gate (head_dim)]
        q_and_gate = self.q_proj(hidden).view(batch, seq, self.num_heads, 2 * self.head_dim)
        query, gate = q_and_gate.split(self.head_dim, dim=-1)
        query = self.q_norm(query).transpose(1, 2)
        key = self.k_norm(self.k_proj(hidden).view(batch, seq, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        value = self.v_proj(hidden).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
        key_start = position
        if cache is not None:
            key, value, key_start = cache.append(key, value)
        out = attention(query, key, value, query_start=position, key_start=key_start, scaling=self.head_dim**-0.5)
        out = out * torch.sigmoid(gate.reshape(batch, seq, -1))
        return self.o_proj(out)


class Router(nn.Module):
    """Top-k softmax router: probabilities over all experts, top-k kept and renormalised to sum 1."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, x: torch.Tensor):
        """x [T, D] -> (weights [T, k] in x's dtype, expert indices [T, k])."""
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        top_probs, top_index = torch.topk(probs, self.top_k, dim=-1)
        top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        return top_probs.to(x.dtype), top_index


class Experts(nn.Module):
    """Stacked expert weights in HF's fused layout: gate_up_proj [E, 2F, D] (gate rows first), down_proj [E, D, F]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        e, f, d = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, f))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """x [T, D], weights/index [T, k] -> sum_k weight * expert_k(x), [T, D].

        Eager runs only the experts that received tokens (data-dependent); under ``torch.export`` the
        loop runs over every expert with per-token weights (zero where not routed), which has static shapes.
        """
        if torch.compiler.is_exporting():
            return self.dense_forward(x, weights, index)
        out = torch.zeros_like(x)
        for expert in torch.unique(index).tolist():
            token, slot = torch.where(index == expert)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            # out[token] += ...: the tokens of one expert are distinct, so this is index_add_ bit for bit,
            # without CPU index_add_'s slow bfloat16 path (~40 ms a call)
            out[token] = out[token] + (y * weights[token, slot, None]).to(out.dtype)
        return out

    def dense_forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Same result as ``forward`` computing every expert on every token (static shapes, E times the work)."""
        per_expert = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        per_expert = per_expert.scatter_add(1, index, weights)
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out = out + y * per_expert[:, expert, None]
        return out


class SparseMoeBlock(nn.Module):
    """Routed experts plus a shared expert scaled by sigmoid(shared_expert_gate(x)).

    This is the unit the ``llmq.ops`` source transform swaps for ``torch.ops.llmq.quantized_moe_ffn``:
    parameters ``gate.weight``, ``experts.gate_up_proj``, ``experts.down_proj``, ``shared_expert.*``,
    ``shared_expert_gate.weight``; ``forward(hidden [B, S, D]) -> [B, S, D]``.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, config.hidden_act)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        weights, index = self.gate(x)
        routed = self.experts(x, weights, index)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return (routed + shared).reshape(shape)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config)
        self.mlp = SparseMoeBlock(config)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def new_state(self):
        return DeltaNetState() if self.layer_type == "linear_attention" else KVCache()

    def forward(self, hidden, cos, sin, position: int, state=None):
        normed = self.input_layernorm(hidden)
        if self.layer_type == "linear_attention":
            mixed = self.linear_attn(normed, state)
        else:
            mixed = self.self_attn(normed, cos, sin, position, state)
        hidden = hidden + mixed
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class TextModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen35MoeForCausalLM(CausalLM):
    """The text model plus LM head. ``forward(input_ids [B, S], cache=None) -> logits [B, S, V]``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Plain attribute, not a buffer: it is derived from the config, never loaded, and must exist on meta models.
        self.inv_freq = default_inv_freq(config.rotary_dim, config.rope_theta)
        self.tie_weights()

    def rope_for(self, positions: torch.Tensor, dtype: torch.dtype):
        table = rope_cos_sin(self.inv_freq, positions, dtype)  # the same for every attention layer
        return lambda layer: table


def build_model(config: ModelConfig, device: str | torch.device = "meta", dtype: torch.dtype = torch.float32):
    """Construct the model with uninitialised weights on ``device`` (meta: no memory) in ``dtype``.

    On a real device, parameters are filled with small deterministic-by-seed random values (normal,
    std 0.02) except norms and DeltaNet decay parameters, so an unloaded model is still runnable.
    """
    return build_on_device(Qwen35MoeForCausalLM, config, device, dtype, init_weights)


@torch.no_grad()
def init_weights(model: Qwen35MoeForCausalLM, std: float = 0.02) -> None:
    """Random init in the spirit of HF's (for tests and the embedded default model)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") and "linear_attn" not in name:
            p.zero_()
        elif name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
            p.fill_(1.0)
        elif name.endswith("A_log"):
            p.copy_(torch.empty_like(p).uniform_(0.01, 16).log())
        else:
            p.normal_(0.0, std)
