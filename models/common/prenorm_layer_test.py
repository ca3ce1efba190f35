"""The shared pre-norm decoder layer against transformers' LlamaForCausalLM on a tiny random config:
a llama model built from it (embed -> PreNormDecoderLayer x N -> norm -> head) loads the HF state dict
by the identity name map and gives its logits within float32 rounding, for a prefill and for
token-by-token decoding with the KV cache."""

import pytest
import torch
from torch import nn

from models.common.causal_lm import CausalLM
from models.common.norm import RMSNorm
from models.common.prenorm_layer import PreNormDecoderLayer, PreNormLayerShape
from models.common.rope import default_inv_freq, rope_cos_sin


class _TinyLlama(CausalLM):
    """A llama model as a config and a name map would make it (the name map here is the identity)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        head_dim = config.hidden_size // config.num_attention_heads
        shape = PreNormLayerShape(
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
            head_dim=head_dim, rms_norm_eps=config.rms_norm_eps, hidden_act=config.hidden_act,
            attention_bias=config.attention_bias)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(PreNormDecoderLayer(shape) for _ in range(config.num_hidden_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.inv_freq = default_inv_freq(head_dim, config.rope_parameters["rope_theta"])
        self.tie_weights()

    def rope_for(self, positions, dtype):
        cos_sin = rope_cos_sin(self.inv_freq, positions, dtype)
        return lambda layer: cos_sin


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied-bias"])
def pair(request):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=64,
                         tie_word_embeddings=request.param, attention_bias=request.param,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    reference = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a swapped or missing norm shows
        for name, p in reference.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    ours = _TinyLlama(config).eval()
    state = reference.state_dict()
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return reference, ours


def test_prefill_logits_match_transformers(pair):
    reference, ours = pair
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids).logits
        got = ours(ids)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_decoding_with_the_cache_matches_the_prefill(pair):
    reference, ours = pair
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = reference(ids).logits
        cache = ours.new_cache()
        steps = [ours(ids[:, :4], cache)] + [ours(ids[:, i:i + 1], cache) for i in range(4, 10)]
    got = torch.cat(steps, dim=1)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_a_wrong_norm_order_is_seen(pair):
    """The comparison can fail: the same weights with the MLP's pre-norm skipped differ from transformers."""
    reference, ours = pair
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    layer = ours.model.layers[0]
    saved = layer.post_attention_layernorm
    layer.post_attention_layernorm = nn.Identity()
    try:
        with torch.no_grad():
            assert not torch.allclose(ours(ids), reference(ids).logits, atol=1e-3)
    finally:
        layer.post_attention_layernorm = saved
