"""The gated delta rule of Gated DeltaNet, in two equivalent forms.

State S [B, H, dk, dv] (one matrix per value head). For each token t, with decay g_t = exp(log_g_t),
write strength b_t, L2-normalised key k_t, value v_t and query q_t (already scaled by dk^-1/2):

    S'   = g_t * S_{t-1}
    u_t  = b_t * (v_t - S'^T k_t)          # the delta: what the decayed state mispredicts
    S_t  = S' + k_t u_t^T
    o_t  = S_t^T q_t

``delta_rule(..., chunk_size=None)`` runs that loop (decode); with a chunk size it computes the same
thing C tokens at a time (prefill): inside a chunk, with cumulative log decay c_t and S0 the state at the
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


def _prepare(query, key, value, log_decay, beta, state):
    """[B, S, H, d] inputs -> float32 [B, H, S, d]; keys/queries L2-normalised, queries scaled, k heads repeated;
    and the float32 state [B, H, dk, dv] to start from (zeros where `state` is None)."""
    k_heads, v_heads = key.shape[2], value.shape[2]
    if v_heads != k_heads:
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    query, key, value = (t.transpose(1, 2).to(torch.float32) for t in (query, key, value))
    log_decay, beta = (t.transpose(1, 2).to(torch.float32) for t in (log_decay, beta))
    query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6)
    key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    query = query * query.shape[-1] ** -0.5
    batch, heads, _, dk = key.shape
    if state is None:
        state = torch.zeros(batch, heads, dk, value.shape[-1], dtype=torch.float32, device=value.device)
    return query, key, value, log_decay, beta, state.float()


def delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    state: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = 64,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """query/key [B, S, Hk, dk], value [B, S, Hv, dv], log_decay/beta [B, S, Hv]; `chunk_size` tokens at
    a time (prefill), or token by token where it is None (decode, and the reference form).

    Returns (output [B, S, Hv, dv] in value's dtype, final state [B, Hv, dk, dv] float32).
    """
    prepared = _prepare(query, key, value, log_decay, beta, state)
    out, final = _recurrent(*prepared) if chunk_size is None else _chunked(*prepared, chunk_size)
    return out.transpose(1, 2).to(value.dtype), final


def _recurrent(q, k, v, log_g, b, s):
    """The token loop on _prepare's tensors: (output [B, H, S, dv], final state)."""
    outputs = []
    for t in range(k.shape[2]):
        s = s * log_g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        predicted = torch.einsum("bhkv,bhk->bhv", s, k_t)
        delta = (v[:, :, t] - predicted) * b[:, :, t, None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, :, t]))
    return torch.stack(outputs, dim=2), s


def _chunked(q, k, v, log_g, b, s, chunk_size):
    """The chunk-parallel form on _prepare's tensors: (output [B, H, S, dv], final state)."""
    batch, heads, seq, _ = k.shape
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
    return torch.cat(outputs, dim=2)[:, :, :seq], s
