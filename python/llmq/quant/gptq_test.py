"""Method "gptq" against the published update rule written plainly in float64, against plain
search on the same weights, on singular and dead-column inputs, and its refusals."""

import dataclasses

import pytest
import torch

from llmq.quant import QuantConfig, dequantize, quantize_weight
from llmq.quant.budget import output_error
from llmq.quant.codecs import round_scale_mantissa, unpack_bits
from llmq.quant.gptq import gptq_quantize, without_hessian
from llmq.quant.quantize import quantize_layer
from llmq.quant.storage import holds_scales


def _correlated_inputs(tokens, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5
    x = torch.randn(tokens, k, generator=g) @ mix + 0.3 * torch.randn(tokens, k, generator=g)
    return x * torch.exp(torch.randn(k, generator=g))  # columns of very different scale, as real activations


def _hessian(x):
    return (x.T @ x / x.shape[0]).float()


def _reference(w, h, bits, gs, symmetric, damp, act_order):
    """Frantar et al. (2022), Algorithm 1, column by column in float64 (no lazy blocks), with the
    group's minmax (scale, bias) fitted when its first column comes up, from its current values."""
    n, k = w.shape
    h = h.double().clone()
    w = w.double().clone()
    dead = h.diagonal() == 0
    h[dead, :] = 0
    h[:, dead] = 0
    h[dead, dead] = 1
    h += damp * h.diagonal()[~dead].mean() * torch.eye(k, dtype=torch.float64)
    order = torch.argsort(h.diagonal().masked_fill(dead, -1), descending=True, stable=True) if act_order \
        else torch.arange(k)
    hinv = torch.linalg.inv(h[order][:, order])
    u = torch.linalg.cholesky(hinv).mT  # upper: H^-1 = U^T U
    w = w[:, order]
    qmax = (1 << bits) - 1
    codes = torch.zeros(n, k, dtype=torch.long)
    scale = torch.zeros(n, k // gs)
    bias = torch.zeros(n, k // gs)
    fitted = set()
    position = torch.argsort(order)
    for i in range(k):
        g = int(order[i]) // gs
        if g not in fitted:
            cur = w[:, position[g * gs:(g + 1) * gs]].float()  # the group's current values, original order
            lo, hi = cur.amin(1).clamp(max=0), cur.amax(1).clamp(min=0)
            if symmetric:
                s = torch.max(-lo, hi) / (qmax / 2)
                b = s * -float(1 << (bits - 1))
            else:
                s = round_scale_mantissa((hi - lo) / qmax, 24 - bits)
                b = 0.0 - torch.clamp(-torch.round(lo / s), 0, qmax) * s
            scale[:, g], bias[:, g] = s, b
            fitted.add(g)
        s, b = scale[:, g].double(), bias[:, g].double()
        q = torch.clamp(torch.round((w[:, i] - b) / s), 0, qmax)
        codes[:, order[i]] = q.long()
        err = (w[:, i] - (q * s + b)) / u[i, i]
        w[:, i + 1:] -= err[:, None] * u[i, i + 1:][None, :]
    return codes, scale, bias


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("block_size", [3, 8, 64])
def test_matches_the_published_rule_in_float64(symmetric, act_order, block_size):
    torch.manual_seed(1)
    n, k, gs, bits = 6, 24, 8, 4
    w = torch.randn(n, k)
    h = _hessian(_correlated_inputs(40, k, seed=2))
    config = QuantConfig(bits=bits, group_size=gs, symmetric=symmetric, method="gptq",
                         options={"damp": 0.05, "act_order": act_order, "block_size": block_size, "fit": "minmax"})
    got = gptq_quantize(w, config, h, compute_dtype=torch.float64)
    codes, scale, bias = _reference(w, h, bits, gs, symmetric, 0.05, act_order)
    assert torch.equal(unpack_bits(got.qdata, bits, k).long(), codes)
    torch.testing.assert_close(got.scale, scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(got.bias, bias, rtol=1e-6, atol=0)
    # the float32 compute path takes nearly every code the float64 rule takes
    f32 = gptq_quantize(w, config, h)
    assert (unpack_bits(f32.qdata, bits, k).long() == codes).float().mean() > 0.97


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_lower_output_error_than_search_on_correlated_inputs(symmetric, scale_dtype):
    torch.manual_seed(0)
    k = 128
    x = _correlated_inputs(1024, k)
    h = _hessian(x)
    w = torch.randn(64, k)
    plain = QuantConfig(bits=4, group_size=32, symmetric=symmetric, method="search", scale_dtype=scale_dtype)
    gptq = dataclasses.replace(plain, method="gptq")
    q_plain = quantize_weight(w, plain)
    q_gptq = quantize_weight(w, gptq, hessian=h)
    err_plain = output_error(w, dequantize(q_plain, torch.float32), h)
    err_gptq = output_error(w, dequantize(q_gptq, torch.float32), h)
    assert err_gptq < err_plain / 1.5, (err_gptq, err_plain)
    # measured on held-out inputs of the same distribution, not only on the calibration ones
    xt = _correlated_inputs(1024, k, seed=0)[512:]
    out = lambda q: float((xt @ (w - dequantize(q, torch.float32)).T).pow(2).sum())  # noqa: E731
    assert out(q_gptq) < out(q_plain)
    assert holds_scales(q_gptq, scale_dtype)  # 16-bit scales and biases: exactly what the backend writes
    if symmetric:
        assert torch.equal(q_gptq.bias, -8 * q_gptq.scale)  # the canonical symmetric form


def test_singular_hessian_and_dead_columns():
    torch.manual_seed(3)
    k = 64
    x = _correlated_inputs(16, k)  # 16 tokens for 64 columns: H has rank 16
    x[:, [5, 40]] = 0  # two columns no token excites
    h = _hessian(x)
    w = torch.randn(32, k)
    for damp in (0.01, 0.0):  # damp 0: the factorisation fails and the dampening is raised until it holds
        config = QuantConfig(bits=4, group_size=16, symmetric=True, method="gptq", options={"damp": damp})
        q = quantize_weight(w, config, hessian=h)
        approx = dequantize(q, torch.float32)
        assert bool(torch.isfinite(approx).all())
        # a dead column keeps its weight, rounded to nearest with its group's scale
        codes = unpack_bits(q.qdata, 4, k).float()
        for col in (5, 40):
            s, b = q.scale[:, col // 16], q.bias[:, col // 16]
            assert torch.equal(codes[:, col], torch.clamp(torch.round((w[:, col] - b) / s), 0, 15))
    # an all-zero H: every column dead, plain rounding
    q = quantize_weight(w, QuantConfig(bits=4, group_size=16, method="gptq"), hessian=torch.zeros(k, k))
    assert bool(torch.isfinite(q.scale).all())


def test_refusals_are_one_line():
    w = torch.randn(8, 32)
    config = QuantConfig(bits=4, group_size=16, method="gptq")
    with pytest.raises(ValueError, match=r"w: method 'gptq' rounds against the layer's inputs: .*--calibration_text"):
        quantize_weight(w, config, name="w")
    with pytest.raises(ValueError, match=r"w: method 'gptq' needs the layer's input second moment H of shape \[32, 32\]"):
        quantize_weight(w, config, name="w", hessian=torch.eye(16))
    bad = torch.eye(32)
    bad[3, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        quantize_weight(w, config, name="w", hessian=bad)
    with pytest.raises(ValueError, match="hessian= applies to method 'gptq' only"):
        quantize_weight(w, QuantConfig(bits=4, group_size=16), hessian=torch.eye(32))
    with pytest.raises(ValueError, match="rounds 2-D"):
        quantize_weight(torch.randn(2, 8, 32), config, hessian=torch.eye(32))
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['dampening'\]"):
        QuantConfig(method="gptq", options={"dampening": 0.1})
    with pytest.raises(ValueError, match="'block_size' must be a positive int"):
        QuantConfig(method="gptq", options={"block_size": 0})
    with pytest.raises(ValueError, match="options apply to method 'gptq' only"):
        QuantConfig(method="search", options={"damp": 0.1})


def test_options_round_trip_through_recipes():
    from llmq.quant import QuantRecipe

    config = QuantConfig(bits=3, group_size=64, symmetric=False, method="gptq",
                         options={"act_order": False, "damp": 0.1})
    assert config.to_dict()["options"] == {"act_order": False, "damp": 0.1}
    recipe = QuantRecipe([{"pattern": ".*proj", "config": config.to_dict()}])
    assert QuantRecipe.from_dict(recipe.to_dict()).get_config("q_proj") == config
    assert "gptq act_order=False,damp=0.1" in config.describe()
    assert without_hessian(config) == QuantConfig(bits=3, group_size=64, symmetric=False, method="search")


def test_quantize_layer_and_stream_pass_each_linears_hessian():
    from llmq.quant import QuantRecipe
    from llmq.quant.importance import Calibration
    from llmq.quant.stream import quantize_stream

    torch.manual_seed(4)
    x = _correlated_inputs(256, 32)
    hs = {"a": _hessian(x), "b": _hessian(x[:, torch.randperm(32)])}
    ws = {"a": torch.randn(16, 32), "b": torch.randn(8, 32)}
    config = QuantConfig(bits=4, group_size=16, method="gptq")
    layer = quantize_layer(ws, {"a": config, "b": config}, hs)
    for m in "ab":
        direct = quantize_weight(ws[m], config, hessian=hs[m])
        assert torch.equal(layer[m].qdata, direct.qdata) and torch.equal(layer[m].scale, direct.scale)
    calibration = Calibration(importance={}, inputs={}, tokens=256, hessians={"a": hs["a"]})
    missing = []
    out = dict(quantize_stream([(f"{m}.weight", ws[m]) for m in "ab"], QuantRecipe([{"pattern": ".*", "config": config.to_dict()}]),
                               calibration=calibration, without_hessian=missing))
    assert torch.equal(out["a.weight"].qdata, layer["a"].qdata)
    plain = quantize_weight(ws["b"], without_hessian(config))  # no H for b: its group fit alone
    assert torch.equal(out["b.weight"].qdata, plain.qdata) and missing == ["b.weight"]
