"""quantize_model and the quantized modules: replacement, report, forward numerics, export."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmq.quant import (
    QuantConfig,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantRecipe,
    QuantRule,
    dequantize,
    get_preset,
    quantize_model,
    quantize_weight,
)


class Block(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(d, d, bias=True)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.gate = nn.Linear(d, 4, bias=False)  # router: kept by the presets
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        h = self.norm(x)
        return x + self.self_attn.q_proj(h) + self.down_proj(F.silu(self.up_proj(h))) + self.gate(h).sum(-1, keepdim=True)


class Tiny(nn.Module):
    def __init__(self, vocab=50, d=64, f=128, n_layers=3):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d, f) for _ in range(n_layers)])
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def tiny(seed=0):
    torch.manual_seed(seed)
    return Tiny().eval()


def matmul_bound(x, qw, k):
    """|QuantizedLinear(x) - F.linear(x, dequantize(qw))| bound: forward's float32 dequant is off by
    <= 2^-24 (|s*q| + |w|) per weight, and the two float32 matmuls each round by <= k * 2^-24
    relative to |x| @ |w|; (k + 2) * 2^-23 * (|x| @ (|w| + |s*q|)) covers both."""
    w = dequantize(qw, torch.float32)
    sq = (w - qw.bias.repeat_interleave(qw.group_size, -1)).abs()
    return (k + 2) * 2.0**-23 * (x.abs() @ (w.abs() + sq).T)


def test_preset_replaces_the_right_modules_and_reports():
    m = tiny()
    report = quantize_model(m, get_preset("int4"))
    assert report.model is m
    quantized = {e.fqn for e in report.entries}
    projections = {f"layers.{i}.{p}" for i in range(3) for p in ("self_attn.q_proj", "up_proj", "down_proj")}
    assert quantized == projections | {"embed_tokens", "lm_head"}  # the embedding and the head at 8 bits
    assert set(report.kept) == {f"layers.{i}.gate" for i in range(3)}
    assert isinstance(m.layers[0].up_proj, QuantizedLinear) and isinstance(m.lm_head, QuantizedLinear)
    assert m.lm_head.quantized_weight().bits == 8
    assert type(m.layers[0].gate) is nn.Linear
    e = next(e for e in report.entries if e.fqn == "layers.0.up_proj")
    assert e.shape == (128, 64) and e.kind == "linear"
    assert e.bytes_before == 128 * 64 * 4
    assert e.bytes_after == 128 * 32 + 2 * 128 * 2 * 4  # packed nibbles + fp32 scale and bias per group
    assert report.bytes_after < report.bytes_before
    table = report.format_table()
    assert "layers.0.up_proj" in table and "11 modules quantized" in table


def test_forward_matches_dequantized_reference():
    torch.manual_seed(1)
    lin = nn.Linear(96, 40, bias=True)
    cfg = QuantConfig(bits=4, group_size=32, symmetric=False)
    ql = QuantizedLinear.from_linear(lin, cfg, name="lin")
    qw = quantize_weight(lin.weight, cfg)
    assert torch.equal(ql.quantized_weight().qdata, qw.qdata)
    x = torch.randn(5, 96)
    ref = F.linear(x, dequantize(qw, torch.float32), lin.bias)
    out = ql(x)
    assert bool(((out - ref).abs() <= matmul_bound(x, qw, 96)).all())
    # and it is a real approximation of the float layer
    assert F.cosine_similarity(out.flatten(), lin(x).flatten(), dim=0) > 0.99


@pytest.mark.parametrize("bits", [2, 3, 5, 8])
def test_forward_all_widths_bf16_input(bits):
    torch.manual_seed(bits)
    lin = nn.Linear(64, 16, bias=False).to(torch.bfloat16)
    ql = QuantizedLinear.from_linear(lin, QuantConfig(bits=bits, group_size=16))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    out = ql(x)
    assert out.dtype == torch.bfloat16
    qw = ql.quantized_weight()
    ref = F.linear(x.float(), dequantize(qw, torch.float32))
    # bf16 matmul of bf16-rounded weights: relative error a few bf16 ulps of |x| @ |w|
    assert bool(((out.float() - ref).abs() <= 2.0**-6 * (x.float().abs() @ dequantize(qw, torch.float32).abs().T) + 1e-6).all())


def test_not_inplace_leaves_the_model_alone():
    m = tiny()
    report = quantize_model(m, get_preset("int8"), inplace=False)
    assert report.model is not m and type(m.layers[0].up_proj) is nn.Linear
    assert isinstance(report.model.layers[0].up_proj, QuantizedLinear)
    ids = torch.randint(0, 50, (2, 7))
    ref, out = m(ids), report.model(ids)
    assert F.cosine_similarity(ref.flatten(), out.flatten(), dim=0) > 0.999


def test_mixed_preset_binds_layer_count_from_model():
    m = tiny()
    report = quantize_model(m, get_preset("int4-mixed"))
    bits = {e.fqn: e.config.bits for e in report.entries}
    assert bits["layers.0.up_proj"] == 8 and bits["layers.2.up_proj"] == 8 and bits["layers.1.up_proj"] == 4
    assert bits["layers.1.self_attn.q_proj"] == 8


def test_embedding_quantized_when_recipe_says_so():
    m = tiny()
    recipe = QuantRecipe([QuantRule("embed_tokens", QuantConfig(bits=8, group_size=32)), QuantRule(".*", None)])
    report = quantize_model(m, recipe)
    assert [e.kind for e in report.entries] == ["embedding"]
    emb = m.embed_tokens
    assert isinstance(emb, QuantizedEmbedding)
    ids = torch.tensor([[0, 3, 49, 3]])
    full = dequantize(emb.quantized_weight(), torch.float32)
    out = emb(ids)
    assert out.dtype == torch.float32 and out.shape == (1, 4, 64)
    bound = 2.0**-23 * (full.abs() + 256 * emb.weight_scale.repeat_interleave(32, -1))
    assert bool(((out[0] - full[ids[0]]).abs() <= bound[ids[0]]).all())


def test_state_dict_round_trip_into_fresh_module():
    torch.manual_seed(2)
    lin = nn.Linear(64, 8, bias=True)
    ql = QuantizedLinear.from_linear(lin, QuantConfig(bits=4, group_size=32))
    sd = ql.state_dict()
    assert set(sd) == {"weight_qdata", "weight_scale", "weight_bias", "bias"}
    assert sd["weight_qdata"].dtype == torch.uint8 and sd["weight_qdata"].shape == (8, 32)
    fresh = QuantizedLinear(64, 8, bits=4, group_size=32, bias=True, dtype=torch.float32)
    fresh.load_state_dict(sd)
    x = torch.randn(2, 64)
    assert torch.equal(fresh(x), ql(x))


def test_export_keeps_weights_quantized():
    torch.manual_seed(3)
    lin = nn.Linear(64, 32, bias=False)
    ql = QuantizedLinear.from_linear(lin, QuantConfig(bits=4, group_size=32)).eval()
    x = torch.randn(2, 64)
    ep = torch.export.export(ql, (x,))
    tensors = dict(ep.state_dict)
    tensors.update(ep.constants)
    assert tensors["weight_qdata"].dtype == torch.uint8
    # no float tensor the size of the weight is stored: the dequantize happens in the graph
    assert not any(t.is_floating_point() and t.numel() >= 64 * 32 for t in tensors.values())
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("bitwise_and" in t or "__rshift__" in t or "rshift" in t for t in targets), targets
    assert torch.equal(ep.module()(x), ql(x))


def test_tied_weights_and_non_linear_modules_untouched():
    m = tiny()
    m.lm_head.weight = m.embed_tokens.weight  # tied
    recipe = QuantRecipe([QuantRule(".*", QuantConfig(bits=4, group_size=32))])
    report = quantize_model(m, recipe)
    # every Linear and the Embedding are replaced; LayerNorms are not Linear-like and stay
    assert isinstance(m.lm_head, QuantizedLinear) and isinstance(m.embed_tokens, QuantizedEmbedding)
    assert type(m.layers[0].norm) is nn.LayerNorm
    assert len(report.entries) == 3 * 4 + 2


def test_bad_recipe_type():
    with pytest.raises(ValueError, match="QuantRecipe"):
        quantize_model(tiny(), "int4")


def test_bad_shape_error_names_module():
    m = tiny()
    recipe = QuantRecipe([QuantRule(r"layers\.0\.gate", QuantConfig(bits=4, group_size=48))])
    with pytest.raises(ValueError, match=r"layers\.0\.gate\.weight"):
        quantize_model(m, recipe)


def test_float_format_has_no_module_yet():
    recipe = QuantRecipe([QuantRule(r"layers\.0\.up_proj", QuantConfig(format="mxfp8", bits=8, group_size=32))])
    with pytest.raises(NotImplementedError, match=r"layers\.0\.up_proj"):
        quantize_model(tiny(), recipe)
