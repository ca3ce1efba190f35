"""Shared pieces: sliding-window KV cache + attention against a per-query loop, RoPE, greedy generate."""

import math

import torch

from models.common.cache import KVCache, ModelCache, attention
from models.common.generation import generate
from models.common.rope import apply_rope, default_inv_freq, rope_cos_sin


def _reference_attention(q, k, v, window):
    """Per-query loop in float64: softmax over the visible keys only."""
    b, h, s, d = q.shape
    group = h // k.shape[1]
    out = torch.zeros(b, s, h, v.shape[-1], dtype=torch.float64)
    for t in range(s):
        lo = 0 if window is None else max(0, t - window + 1)
        for head in range(h):
            kk, vv = k[:, head // group, lo : t + 1].double(), v[:, head // group, lo : t + 1].double()
            w = torch.softmax((q[:, head, t : t + 1].double() @ kk.transpose(-1, -2)) / math.sqrt(d), dim=-1)
            out[:, t, head] = (w @ vv)[:, 0]
    return out.reshape(b, s, -1)


def test_cached_sliding_attention_matches_reference():
    g = torch.Generator().manual_seed(0)
    b, h, hk, s, d, window = 2, 4, 2, 13, 8, 5
    q, k, v = torch.randn(b, h, s, d, generator=g), torch.randn(b, hk, s, d, generator=g), torch.randn(b, hk, s, d, generator=g)
    expected = _reference_attention(q, k, v, window)
    full = attention(q, k, v, query_start=0, key_start=0, scaling=d**-0.5, window=window)
    torch.testing.assert_close(full.double(), expected, rtol=1e-5, atol=1e-6)
    # prefill 6 tokens, then one at a time: the cache never holds more than window - 1 entries between steps
    cache, pieces = KVCache(window=window), []
    for lo, hi in [(0, 6)] + [(t, t + 1) for t in range(6, s)]:
        kk, vv, start = cache.append(k[:, :, lo:hi], v[:, :, lo:hi])
        pieces.append(attention(q[:, :, lo:hi], kk, vv, query_start=lo, key_start=start, scaling=d**-0.5, window=window))
        assert cache.keys.shape[2] <= window - 1
    torch.testing.assert_close(torch.cat(pieces, dim=1).double(), expected, rtol=1e-5, atol=1e-6)


def test_partial_rope_rotates_only_the_leading_features():
    x = torch.randn(1, 2, 5, 16)
    cos, sin = rope_cos_sin(default_inv_freq(8, 10000.0), torch.arange(5), torch.float32)
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[..., 8:], x[..., 8:])
    torch.testing.assert_close(y[..., :8].norm(dim=-1), x[..., :8].norm(dim=-1))  # a rotation keeps lengths
    assert torch.equal(y[:, :, 0], x[:, :, 0])  # position 0: identity


class _CountingModel(torch.nn.Module):
    """Emits (last token + 1) mod V; checks the cache position advances by the tokens fed."""

    def new_cache(self, batch_size=1):
        return ModelCache(layers=[])

    def forward(self, input_ids, cache=None):
        cache.position += input_ids.shape[1]
        return torch.nn.functional.one_hot((input_ids + 1) % 10, 10).float()


def test_generate_greedy_and_eos():
    out = generate(_CountingModel(), torch.tensor([[1, 2]]), 4)
    assert out.tolist() == [[1, 2, 3, 4, 5, 6]]
    out = generate(_CountingModel(), torch.tensor([[1, 2], [5, 6]]), 6, eos_token_id=8)
    assert out.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8], [5, 6, 7, 8, 8, 8, 8, 8]]  # a finished row repeats EOS
    out = generate(_CountingModel(), torch.tensor([[6]]), 5, eos_token_id=8)
    assert out.tolist() == [[6, 7, 8]]  # stops once every row has produced EOS


def test_decoder_layer_index():
    from models.common.loading import decoder_layer_index

    assert decoder_layer_index("model.layers.12.mlp.experts.gate_up_proj") == 12
    assert decoder_layer_index("model.embed_tokens.weight") is None
    assert decoder_layer_index("lm_head.weight") is None
