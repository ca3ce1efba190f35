"""The gated delta rule of Gated DeltaNet, in two equivalent forms.

State S [B, H, dk, dv] (one matrix per value head). For each token t, with decay g_t = exp(log_g_t),
write strength b_t, L2-normalised key k_t, value v_t and query q_t (already scaled by dk^-1/2):

    S'   = g_t * S_{t-1}
    u_t  = b_t * (v_t - S'^T k_t)          # the delta: what the decayed state mispredicts
    S_t  = S' + k_t u_t^T
    o_t  = S_t^T q_t

``recurrent_delta_rule`` runs that loop (decode). ``chunked_delta_rule`` computes the same thing
C tokens at a time (prefill): inside a chunk, with cumulative log decay c_t and S0 the state at the
chunk start, unrolling gives

    u_t + sum_{s<t} b_t e^{c_t-c_s} (k_t.k_s) u_s = b_t v_t - b_t e^{c_t} S0^T k_t

a unit lower-triangular system (I + A) U = B V - diag(b e^c) K S0, solved once per chunk; then
o_t = e^{c_t} S0^T q_t + sum_{s<=t} e^{c_t-c_s} (q_t.k_s) u_s and S_C = e^{c_C} S0 + sum_s e^{c_C-c_s} k_s u_s^T.
Only differences c_t - c_s with s <= t and c_t itself are exponentiated, all <= 0, so nothing overflows.
Everything runs in float32.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def _prepare(query, key, value, log_decay, beta):
    """[B, S, H, d] inputs -> float32 [B, H, S, d]; keys/queries L2-normalised, queries scaled, k heads repeated."""
    k_heads, v_heads = key.shape[2], value.shape[2]
    if v_heads != k_heads:
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    query, key, value = (t.transpose(1, 2).to(torch.float32) for t in (query, key, value))
    log_decay, beta = (t.transpose(1, 2).to(torch.float32) for t in (log_decay, beta))
    query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6)
    key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    query = query * query.shape[-1] ** -0.5
    return query, key, value, log_decay, beta


def recurrent_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token form. query/key [B, S, Hk, dk], value [B, S, Hv, dv], log_decay/beta [B, S, Hv].

    Returns (output [B, S, Hv, dv] in value's dtype, final state [B, Hv, dk, dv] float32).
    """
    out_dtype = value.dtype
    q, k, v, log_g, b = _prepare(query, key, value, log_decay, beta)
    batch, heads, seq, dk = k.shape
    dv = v.shape[-1]
    s = torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=v.device) if state is None else state.float()
    outputs = []
    for t in range(seq):
        s = s * log_g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        predicted = torch.einsum("bhkv,bhk->bhv", s, k_t)
        delta = (v[:, :, t] - predicted) * b[:, :, t, None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, :, t]))
    out = torch.stack(outputs, dim=2)  # [B, H, S, dv]
    return out.transpose(1, 2).to(out_dtype), s


def chunked_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    state: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel form, same arguments and results as ``recurrent_delta_rule``."""
    out_dtype = value.dtype
    q, k, v, log_g, b = _prepare(query, key, value, log_decay, beta)
    batch, heads, seq, dk = k.shape
    dv = v.shape[-1]
    s = torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=v.device) if state is None else state.float()
    pad = (-seq) % chunk_size
    if pad:
        # Padded tokens have b = 0 (write nothing) and log decay 0 (keep the state): the final state is exact.
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        log_g, b = (torch.nn.functional.pad(t, (0, pad)) for t in (log_g, b))
    n = (seq + pad) // chunk_size
    q, k, v = (t.reshape(batch, heads, n, chunk_size, t.shape[-1]) for t in (q, k, v))
    log_g, b = (t.reshape(batch, heads, n, chunk_size) for t in (log_g, b))

    cum = log_g.cumsum(dim=-1)  # c_t, [B, H, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    # e^{c_t - c_s} for s <= t, 0 above the diagonal (masked before exp so no inf appears)
    pair_decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    strictly_lower = pair_decay * (~torch.eye(chunk_size, dtype=torch.bool, device=v.device))
    system = torch.eye(chunk_size, device=v.device) + b[..., :, None] * (k @ k.transpose(-1, -2)) * strictly_lower
    rhs_values = b[..., None] * v                       # B V
    rhs_state = (b * cum.exp())[..., None] * k          # diag(b e^c) K, multiplies S0
    solved_values = torch.linalg.solve_triangular(system, rhs_values, upper=False, unitriangular=True)
    solved_state = torch.linalg.solve_triangular(system, rhs_state, upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * pair_decay       # e^{c_t-c_s} (q_t.k_s), s <= t
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()

    outputs = []
    for i in range(n):
        u = solved_values[:, :, i] - solved_state[:, :, i] @ s
        outputs.append(q_decayed[:, :, i] @ s + intra[:, :, i] @ u)
        s = s * chunk_decay[:, :, i, None, None] + k_to_end[:, :, i].transpose(-1, -2) @ u
    out = torch.cat(outputs, dim=2)[:, :, :seq]
    return out.transpose(1, 2).to(out_dtype), s
