"""quantize_weight / dequantize against torchao 0.18's affine primitives, bit for bit.

torchao is called on the weight upcast to float32 (the canonical form computes in float32),
with block_size (1, ..., group_size). Bit-for-bit comparisons view float32 as int32 so that
-0.0 vs +0.0 would count as a difference.
"""


import pytest
import torch
from hypothesis import given, settings, strategies as st
from torchao.quantization.quant_primitives import (
    MappingType,
    choose_qparams_affine,
    dequantize_affine,
    quantize_affine,
)

from llmq.quant import GroupQuantizedWeight, QuantConfig, dequantize, quantize_weight
from llmq.quant.formats import int_affine, unpack_bits


def bits_of(t):
    return t.contiguous().view(torch.int32)


def make_weight(shape, dtype, seed):
    """Random weights with awkward groups mixed in: all-zero rows, constant rows, tiny values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 3
    flat = w.reshape(-1, shape[-1])
    if flat.shape[0] >= 4:
        flat[0] = 0.0  # all-zero groups -> scale clamps to eps
        flat[1] = 0.75  # constant positive groups
        flat[2] = -flat[2].abs() * 1e-3
        flat[3, :8] = 1e-40  # subnormal values
    return w.to(dtype)


def block_size(shape, gs):
    return tuple([1] * (len(shape) - 1) + [gs])


def q_unsigned(qw):
    return unpack_bits(qw.qdata, qw.bits, qw.shape[-1]).reshape(qw.shape).to(torch.int32)


def fields(qw, t):
    """qw.scale / qw.bias reshaped to torchao's (keepdim=False) qparam shape."""
    return t.reshape(tuple(qw.shape[:-1]) + (-1,))


CASES = [
    # shape, group_size (None = whole row)
    ((48,), 16),
    ((12, 64), 16),
    ((12, 64), 32),
    ((12, 64), None),
    ((3, 8, 128), 32),
    ((3, 8, 128), 128),
]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("shape,gs", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_symmetric_matches_torchao_bit_for_bit(bits, shape, gs, dtype):
    w = make_weight(shape, dtype, seed=bits * 100 + len(shape))
    qw = quantize_weight(w, QuantConfig(bits=bits, group_size=gs, symmetric=True), name="w")
    k = shape[-1]
    gs_eff = gs or k
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    x = w.float()
    blk = block_size(shape, gs_eff)
    scale, zero = choose_qparams_affine(x, MappingType.SYMMETRIC, blk, torch.int8, qmin, qmax, scale_dtype=torch.float32)
    assert torch.equal(bits_of(qw.scale).flatten(), bits_of(scale).flatten())
    q_ref = quantize_affine(x, blk, scale, zero, torch.int8, qmin, qmax)
    assert torch.equal(q_unsigned(qw) - (1 << (bits - 1)), q_ref.to(torch.int32))
    # bias = -2^(b-1) * scale exactly
    assert torch.equal(qw.bias.double(), -(2.0 ** (bits - 1)) * qw.scale.double())
    deq_ref = dequantize_affine(q_ref, blk, scale, zero, torch.int8, qmin, qmax, output_dtype=torch.float32)
    assert torch.equal(bits_of(dequantize(qw, torch.float32)), bits_of(deq_ref))
    assert qw.dtype == dtype and dequantize(qw).dtype == dtype


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("shape,gs", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_asymmetric_matches_torchao_with_our_qparams(bits, shape, gs, dtype):
    w = make_weight(shape, dtype, seed=bits * 7 + len(shape))
    qw = quantize_weight(w, QuantConfig(bits=bits, group_size=gs, symmetric=False), name="w")
    k = shape[-1]
    gs_eff = gs or k
    qmax = (1 << bits) - 1
    x = w.float()
    blk = block_size(shape, gs_eff)
    scale = fields(qw, qw.scale)
    bias = fields(qw, qw.bias)

    # The scale keeps at most 24-bits significant bits ...
    assert bool(((bits_of(scale) & ((1 << bits) - 1)) == 0).all())
    # ... and differs from torchao's own ASYMMETRIC scale (unsigned range) by <= 2^-(24-bits).
    ref_scale, _ = choose_qparams_affine(x, MappingType.ASYMMETRIC, blk, torch.uint8, 0, qmax, scale_dtype=torch.float32)
    rel = ((scale.double().flatten() - ref_scale.double().flatten()).abs() / ref_scale.double().flatten()).max().item()
    assert rel <= 2.0 ** -(24 - bits)

    # bias = -zero * scale with an integer zero in [0, 2^b) and exact in float32.
    zero = -bias.double() / scale.double()
    assert torch.equal(zero, zero.round()) and bool(((zero >= 0) & (zero <= qmax)).all())
    assert torch.equal(-(zero * scale.double()), bias.double())
    zero_i = zero.to(torch.int32)

    q_ref = quantize_affine(x, blk, scale, zero_i, torch.uint8, 0, qmax)
    assert torch.equal(q_unsigned(qw), q_ref.to(torch.int32))
    deq_ref = dequantize_affine(q_ref, blk, scale, zero_i, torch.uint8, 0, qmax, output_dtype=torch.float32)
    deq = dequantize(qw, torch.float32)
    assert torch.equal(bits_of(deq), bits_of(deq_ref))

    # Error bound for elements the clamp did not touch: rounding to the grid costs <= scale/2;
    # fl(w * fl(1/s)) adds <= 2 ulp relative (2^-23 |w/s|, i.e. 2^-23 |w| after scaling by s) and
    # the final fl(s * (q - z)) <= 2^-24 |w'|. Tolerance: s/2 + 2^-22 * max(|w|, |w'|).
    s_el = scale.unsqueeze(-1).expand(*scale.shape, gs_eff).reshape(shape).double()
    z_el = zero.unsqueeze(-1).expand(*zero.shape, gs_eff).reshape(shape)
    unclamped = torch.round(x * (1.0 / s_el.float())).double() + z_el
    inside = (unclamped >= 0) & (unclamped <= qmax)
    err = (x.double() - deq.double()).abs()
    tol = s_el / 2 + 2.0**-22 * torch.max(x.double().abs(), deq.double().abs())
    assert bool((err <= tol)[inside].all())
    # Clipped elements (only ever a group's extremes, after the scale/zero roundings) stay within one step.
    assert bool((err <= s_el + tol)[~inside].all())


def test_error_bound_symmetric_is_half_a_step():
    w = make_weight((16, 128), torch.float32, seed=3)
    qw = quantize_weight(w, QuantConfig(bits=4, group_size=32), name="w")
    s = qw.scale.repeat_interleave(32, dim=-1).double()
    err = (w.double() - dequantize(qw).double()).abs()
    # the group's amax maps to 7.5 steps, so only +amax is clipped (to 7): at most one step away.
    assert bool((err <= s + 2.0**-22 * w.abs().double()).all())
    assert float(err.mean() / s.mean()) < 0.3  # round-to-nearest: mean error ~ a quarter step


def test_4bit_layout_even_element_in_low_nibble():
    # Symmetric int4, group 8, row amax 7.5 -> scale 1, so q = w + 8 for integral w.
    w = torch.tensor([[-7.0, -6, 0, 1, 2, 3, 7, 7.5]])
    qw = quantize_weight(w, QuantConfig(bits=4, group_size=8), name="w")
    assert qw.scale.item() == 1.0 and qw.bias.item() == -8.0
    q = [1, 2, 8, 9, 10, 11, 15, 15]  # 7.5 rounds to 8 (half to even), clamps to 7
    assert qw.qdata.tolist() == [[q[0] | q[1] << 4, q[2] | q[3] << 4, q[4] | q[5] << 4, q[6] | q[7] << 4]]


def test_stacked_experts_equal_per_expert_quantization():
    w = make_weight((4, 16, 64), torch.bfloat16, seed=11)
    cfg = QuantConfig(bits=4, group_size=32, symmetric=False)
    qw = quantize_weight(w, cfg, name="experts")
    for e in range(4):
        one = quantize_weight(w[e], cfg, name="expert")
        assert torch.equal(qw.qdata[e], one.qdata)
        assert torch.equal(bits_of(qw.scale[e]), bits_of(one.scale))
        assert torch.equal(bits_of(qw.bias[e]), bits_of(one.bias))


def test_chunked_quantization_equals_one_shot(monkeypatch):
    w = make_weight((2, 24, 64), torch.float32, seed=5)
    cfg = QuantConfig(bits=3, group_size=16, symmetric=False)
    whole = quantize_weight(w, cfg)
    monkeypatch.setattr(int_affine, "_ROWS_ELEMENTS", 5 * 64)  # 5 rows at a time, ragged tail
    chunked = quantize_weight(w, cfg)
    assert torch.equal(whole.qdata, chunked.qdata)
    assert torch.equal(bits_of(whole.scale), bits_of(chunked.scale))
    assert torch.equal(bits_of(whole.bias), bits_of(chunked.bias))


@settings(max_examples=30, deadline=None, database=None)
@given(
    bits=st.integers(2, 8),
    n=st.integers(1, 6),
    groups=st.integers(1, 4),
    gs=st.sampled_from([16, 32]),
    log_mag=st.floats(-30, 30),
    offset=st.floats(-2, 2),
    symmetric=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_round_trip_error_bound_any_magnitude(bits, n, groups, gs, log_mag, offset, symmetric, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, groups * gs, generator=g) + offset) * (2.0**log_mag)
    qw = quantize_weight(w, QuantConfig(bits=bits, group_size=gs, symmetric=symmetric))
    s = qw.scale.repeat_interleave(gs, dim=-1).double()
    err = (w.double() - dequantize(qw).double()).abs()
    # within one quantization step everywhere (half a step unless clipped at a group extreme)
    assert bool((err <= s * (1 + 2.0**-20) + 2.0**-22 * w.abs().double()).all())


@pytest.mark.parametrize(
    "w,cfg,match",
    [
        (torch.tensor([1.0, float("nan")] * 16), QuantConfig(group_size=16), "NaN/Inf"),
        (torch.tensor([1.0, float("inf")] * 16), QuantConfig(group_size=16), "NaN/Inf"),
        (torch.tensor(1.0), QuantConfig(), "1-D, 2-D or 3-D"),
        (torch.zeros(2, 2, 2, 32), QuantConfig(), "1-D, 2-D or 3-D"),
        (torch.zeros(4, 48), QuantConfig(group_size=32), "does not divide"),
        (torch.zeros(4, 36), QuantConfig(bits=3, group_size=None), "packed"),
        (torch.zeros(4, 32, dtype=torch.int32), QuantConfig(), "float32/bfloat16/float16"),
        (torch.zeros(4, 0), QuantConfig(group_size=None), "empty"),
    ],
)
def test_bad_input_names_the_tensor(w, cfg, match):
    with pytest.raises(ValueError, match=match) as e:
        quantize_weight(w, cfg, name="model.layers.0.mlp.down_proj.weight")
    assert "model.layers.0.mlp.down_proj.weight" in str(e.value)


def test_float_formats_are_handed_to_fp_module():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    out = quantize_weight(w, QuantConfig(format="mxfp4", bits=4, group_size=32), name="w")
    assert not isinstance(out, GroupQuantizedWeight) and out.format == "mxfp4"
    assert isinstance(quantize_weight(w, QuantConfig(symmetric=False, method="hqq"), name="w"), GroupQuantizedWeight)


def test_dequantize_rejects_non_quantized():
    with pytest.raises(ValueError, match="GroupQuantizedWeight"):
        dequantize(torch.zeros(2, 2))


def test_dequantize_is_exact_then_rounded_once():
    # Hand-made canonical fields (HQQ-like float bias): dequantize rounds the exact
    # scale*q + bias once; the naive fl(fl(scale*q) + bias) differs on some elements.
    from llmq.quant.formats import pack_bits

    g = torch.Generator().manual_seed(0)
    scale = torch.rand(64, 4, generator=g) + 0.5
    bias = torch.randn(64, 4, generator=g) * 8
    q = torch.randint(0, 16, (64, 128), generator=g, dtype=torch.uint8)
    qw = GroupQuantizedWeight(pack_bits(q, 4), scale, bias, 4, 32, (64, 128), torch.float32)
    qg = q.reshape(64, 4, 32)
    exact = (qg.double() * scale.double().unsqueeze(-1) + bias.double().unsqueeze(-1)).float().reshape(64, 128)
    naive = (qg.float() * scale.unsqueeze(-1) + bias.unsqueeze(-1)).reshape(64, 128)
    assert torch.equal(bits_of(dequantize(qw)), bits_of(exact))
    assert not torch.equal(exact, naive)
