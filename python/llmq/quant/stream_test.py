"""quantize_stream: what is quantized, what passes through, and that it stays lazy."""

import pytest
import torch

from llmq.quant import (
    GroupQuantizedWeight,
    QuantConfig,
    QuantRecipe,
    QuantRule,
    dequantize,
    get_preset,
    quantize_stream,
    quantize_weight,
)

CFG = QuantConfig(bits=4, group_size=32)


def items():
    g = torch.Generator().manual_seed(0)
    yield "model.embed_tokens.weight", torch.randn(10, 64, generator=g)
    yield "model.layers.0.input_layernorm.weight", torch.ones(64)
    yield "model.layers.0.mlp.gate_proj.weight", torch.randn(32, 64, generator=g)
    yield "model.layers.0.mlp.gate_proj.bias", torch.randn(32, generator=g)
    yield "model.layers.0.mlp.experts.down_proj.weight", torch.randn(4, 64, 32, generator=g, dtype=torch.float32).bfloat16()
    yield "model.layers.0.mlp.gate.weight", torch.randn(4, 64, generator=g)
    yield "lm_head.weight", torch.randn(10, 64, generator=g)


def test_quantizes_mapped_weights_and_passes_the_rest():
    src = dict(items())
    out = dict(quantize_stream(iter(src.items()), get_preset("int4")))
    assert list(out) == list(src)  # order preserved, nothing dropped
    quantized = {k for k, v in out.items() if isinstance(v, GroupQuantizedWeight)}
    eight_bit = {"model.embed_tokens.weight", "lm_head.weight"}  # the presets' 8-bit embedding and head
    assert quantized == {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.experts.down_proj.weight"} | eight_bit
    assert all(out[k].bits == 8 for k in eight_bit)
    for k in src:
        if k in eight_bit:
            continue
        if k in quantized:
            ref = quantize_weight(src[k], CFG)
            assert torch.equal(out[k].qdata, ref.qdata) and torch.equal(out[k].scale, ref.scale)
            assert out[k].shape == tuple(src[k].shape) and out[k].dtype == src[k].dtype
        else:
            assert out[k] is src[k]
    assert dequantize(out["model.layers.0.mlp.experts.down_proj.weight"]).shape == (4, 64, 32)


def test_is_lazy():
    pulled = []

    def source():
        for name, t in items():
            pulled.append(name)
            yield name, t

    stream = quantize_stream(source(), get_preset("int4"))
    assert pulled == []  # nothing read before the first item is asked for
    for i, (name, _) in enumerate(stream, start=1):
        assert len(pulled) == i and pulled[-1] == name


def test_custom_suffix_and_already_quantized_items_pass():
    qw = quantize_weight(torch.randn(8, 32), CFG)
    recipe = QuantRecipe([QuantRule(".*", CFG)])
    out = list(quantize_stream([("a.w", torch.randn(8, 32)), ("b.w", qw), ("c.weight", torch.randn(8, 32))], recipe, weight_suffix=".w"))
    assert isinstance(out[0][1], GroupQuantizedWeight)
    assert out[1][1] is qw
    assert isinstance(out[2][1], torch.Tensor)


def test_num_layers_binds_relative_layers():
    recipe = get_preset("int4-mixed")
    named = [("model.layers.3.mlp.up_proj.weight", torch.randn(16, 32))]
    with pytest.raises(ValueError, match="bind"):
        list(quantize_stream(named, recipe))
    (_, qw), = quantize_stream(named, recipe, num_layers=4)
    assert qw.bits == 8


def test_errors_name_the_tensor():
    recipe = QuantRecipe([QuantRule(".*", QuantConfig(bits=4, group_size=32))])
    with pytest.raises(ValueError, match=r"model\.bad\.weight"):
        list(quantize_stream([("model.bad.weight", torch.randn(4, 48))], recipe))


def test_module_of_selects_non_weight_tensors_and_vetoes_others():
    from llmq.quant import GroupQuantizedWeight, QuantConfig, QuantRecipe, QuantRule, quantize_stream

    recipe = QuantRecipe([QuantRule(".*", QuantConfig(bits=4, group_size=16))])
    g = torch.Generator().manual_seed(0)
    items = [
        ("layers.0.mlp.experts.gate_up_proj", torch.randn(2, 8, 32, generator=g)),
        ("layers.0.mlp.down_proj.weight", torch.randn(8, 32, generator=g)),
    ]

    def module_of(name):
        return name if name.endswith("_proj") else None  # experts yes, .weight tensors no

    out = dict(quantize_stream(iter(items), recipe, module_of=module_of))
    assert isinstance(out["layers.0.mlp.experts.gate_up_proj"], GroupQuantizedWeight)
    assert out["layers.0.mlp.experts.gate_up_proj"].shape == (2, 8, 32)
    assert isinstance(out["layers.0.mlp.down_proj.weight"], torch.Tensor)
