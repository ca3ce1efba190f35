"""Tests for the floating-point format families (llmq.quant.formats.fp8 / mx / nvfp4 and the
shared codecs) against independent references:
torch's own float8_e4m3fn cast, torchao's MX quantizer (RCEIL = ceil(log2(amax/Emax))), and a
written-out NVFP4 reference of ModelOpt's documented formulas using a plain E2M1 table."""

import math

import pytest
import torch

from llmq.quant import QuantConfig, codecs as fp, dequantize, quantize_weight
from llmq.quant.formats.fp8 import FP8Weight, quantize_fp8
from llmq.quant.formats.mx import MXWeight, quantize_mx
from llmq.quant.formats.nvfp4 import NVFP4Weight, quantize_nvfp4

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def dequantize_fp(q):
    return dequantize(q, torch.float32)


def _weights(seed, shape, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    # Heavy-tailed rows with varied magnitudes exercise many scale exponents.
    w = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[:-1] + (1,), generator=g) * 2)
    return w.to(dtype)


def _reference_e2m1(x):
    """Nearest E2M1 magnitude by brute force over the table, ties to the even code."""
    mag = x.abs().clamp(max=6.0)
    dist = (mag.unsqueeze(-1) - E2M1).abs()
    best = dist.min(dim=-1, keepdim=True).values
    candidates = dist == best
    # Among equally near codes prefer the even one (the lower code if both are... never both even).
    even = candidates & (torch.arange(8) % 2 == 0)
    code = torch.where(even.any(-1), even.float().argmax(-1), candidates.float().argmax(-1))
    return torch.where(x < 0, -E2M1[code], E2M1[code])


# ------------------------------------------------------------------------------------------
# Element codecs
# ------------------------------------------------------------------------------------------


def test_e2m1_every_value_and_every_tie():
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    codes = fp.e2m1_encode(values)
    assert codes.tolist() == list(range(8))
    assert fp.e2m1_decode(fp.e2m1_encode(-values[1:])).tolist() == (-values[1:]).tolist()
    # Midpoints go to the even code (RNE): 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert fp.e2m1_decode(fp.e2m1_encode(mids)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert fp.e2m1_decode(fp.e2m1_encode(torch.tensor([7.0, -100.0]))).tolist() == [6.0, -6.0]
    assert fp.e2m1_encode(torch.tensor([-0.1])).item() == 0  # rounds to +0, not -0


def test_e2m1_matches_brute_force_and_torchao():
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked

    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(20000, generator=g) * 3, torch.arange(-70, 71) / 10.0])
    ours = fp.e2m1_decode(fp.e2m1_encode(x))
    assert torch.equal(ours, _reference_e2m1(x))
    assert torch.equal(ours, f4_unpacked_to_f32(f32_to_f4_unpacked(x.clamp(-6, 6))))


def test_pack_fp4_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    packed = fp.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0xF3]]
    assert torch.equal(fp.unpack_fp4(packed), codes)


def test_e8m0_decode_is_exact_power_of_two():
    b = torch.arange(0, 255, dtype=torch.uint8)
    expect = torch.tensor([math.ldexp(1.0, i - 127) for i in range(255)], dtype=torch.float64)
    assert torch.equal(fp.e8m0_decode(b).double(), expect)
    with pytest.raises(ValueError, match="0xFF"):
        fp.e8m0_decode(torch.tensor([255], dtype=torch.uint8))


def test_mx_exponent_exact_at_powers_of_two():
    # amax exactly Emax*2^k -> e = k; one float32 ulp above -> k+1 (a float32 log2 gets this wrong).
    amax = torch.tensor([6.0 * 2**-3, 6.0 * 2**5, 0.0, 1e-45])
    above = torch.nextafter(amax[:2], torch.tensor(float("inf")))
    e = fp.mx_exponent(torch.cat([amax, above]), 6.0)
    assert e.tolist() == [-3, 5, -127, -127, -2, 6]


# ------------------------------------------------------------------------------------------
# FP8
# ------------------------------------------------------------------------------------------


def _fp8_reference(w, scale_full):
    return (w.float() / scale_full).clamp(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("shape", [(96,), (24, 64), (3, 16, 32)])
def test_fp8_tensor_and_channel_match_torch_cast(shape):
    w = _weights(2, shape)
    x = w.float()
    q = quantize_fp8(w, "tensor", name="t")
    amax = x.abs().amax(dim=(-2, -1)) if w.dim() == 3 else x.abs().amax()
    assert torch.equal(q.scale, amax / 448.0)
    full = q.scale.reshape(q.scale.shape + (1,) * min(2, w.dim()))
    assert torch.equal(q.data.view(torch.uint8), _fp8_reference(w, full).view(torch.uint8))
    c = quantize_fp8(w, "channel")
    assert c.scale.shape == shape[:-1] + (1,)
    assert torch.equal(c.scale, x.abs().amax(dim=-1, keepdim=True) / 448.0)
    assert torch.equal(c.data.view(torch.uint8), _fp8_reference(w, c.scale).view(torch.uint8))
    for qw in (q, c):
        _check_fp8_round_trip(w, qw)


def _check_fp8_round_trip(w, qw):
    d = dequantize_fp(qw)
    # Exactness: one float32 product of the e4m3 value and its scale.
    assert d.dtype == torch.float32 and d.shape == w.shape
    # Error bound: half an e4m3 ulp, i.e. 2^-4 relative for normals, 2^-10 * scale absolute below.
    scale = _expand_fp8_scale(qw)
    bound = torch.maximum(w.float().abs() * 2.0**-4, scale * 2.0**-10) * (1 + 2.0**-20)
    assert bool(((d - w.float()).abs() <= bound).all())


def _expand_fp8_scale(qw):
    shape = qw.shape
    if qw.granularity == "block128":
        s = qw.scale.repeat_interleave(128, -1).repeat_interleave(128, -2)
        return s
    if qw.granularity == "channel":
        return qw.scale.expand(shape)
    return qw.scale.reshape(qw.scale.shape + (1,) * min(2, len(shape))).expand(shape)


def test_fp8_block128_tiles_and_dequant():
    w = _weights(3, (2, 256, 384), torch.float32)
    q = quantize_fp8(w, "block128")
    assert q.scale.shape == (2, 2, 3)
    for e in range(2):
        for i in range(2):
            for j in range(3):
                tile = w[e, i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
                assert q.scale[e, i, j].item() == (tile.abs().max() / 448.0).item()
    full = _expand_fp8_scale(q)
    assert torch.equal(q.data.view(torch.uint8), _fp8_reference(w, full).view(torch.uint8))
    d = dequantize_fp(q)
    assert torch.equal(d, (q.data.double() * full.double()).float())  # one rounding
    _check_fp8_round_trip(w, q)


def test_fp8_dequantize_is_one_rounding_of_the_exact_product():
    w = _weights(4, (32, 64))
    for gran in ("tensor", "channel"):
        q = quantize_fp8(w, gran)
        assert torch.equal(dequantize_fp(q), (q.data.double() * _expand_fp8_scale(q).double()).float())


def test_fp8_zero_tensor_and_shared_scale():
    q = quantize_fp8(torch.zeros(4, 16), "tensor")
    assert q.scale.item() == 1.0 and not bool(dequantize_fp(q).any())
    w = _weights(5, (8, 16))
    q = quantize_fp8(w, "tensor", scale=torch.tensor(1.0))
    assert torch.equal(q.data.view(torch.uint8), _fp8_reference(w, torch.tensor(1.0)).view(torch.uint8))
    with pytest.raises(ValueError, match="positive"):
        quantize_fp8(w, "tensor", scale=torch.tensor(0.0), name="x")


# ------------------------------------------------------------------------------------------
# MX
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("shape", [(64,), (16, 128), (2, 8, 96)])
def test_mx_matches_torchao_rceil(fmt, shape):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    w = _weights(6, shape)
    w.view(-1)[:32] = 0  # an all-zero block
    q = quantize_mx(w, fmt, name="w")
    elem = torch.float4_e2m1fn_x2 if fmt == "mxfp4" else torch.float8_e4m3fn
    scale_ref, data_ref = to_mx(w.float().reshape(-1, shape[-1]).contiguous(), elem, 32, ScaleCalculationMode.RCEIL)
    assert torch.equal(q.scale_e8m0.reshape(-1), scale_ref.view(torch.uint8).reshape(-1))
    assert q.scale_e8m0.reshape(-1)[0].item() == 0  # the zero block: 2^-127
    ours = dequantize_fp(q)
    if fmt == "mxfp4":
        from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32

        ref_vals = f4_unpacked_to_f32(fp.unpack_fp4(data_ref.view(torch.uint8)))
    else:
        ref_vals = data_ref.float()
    ref = (ref_vals.reshape(-1, shape[-1] // 32, 32) * fp.e8m0_decode(scale_ref.view(torch.uint8)).reshape(-1, shape[-1] // 32, 1))
    assert torch.equal(ours.reshape(-1), ref.reshape(-1))


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_round_trip_bound_and_exactness(fmt):
    w = _weights(7, (3, 16, 128), torch.float32)
    q = quantize_mx(w, fmt)
    d = dequantize_fp(q)
    x = w.reshape(3, 16, 4, 32)
    s = fp.e8m0_decode(q.scale_e8m0).unsqueeze(-1)
    emax = 6.0 if fmt == "mxfp4" else 448.0
    assert bool((x.abs().amax(-1, keepdim=True) <= emax * s).all())  # the ceil rule never clips
    assert bool((x.abs().amax(-1, keepdim=True) > emax * s / 2).all())  # ... and is the smallest such
    err = (d.reshape(x.shape) - x).abs()
    if fmt == "mxfp4":
        bound = s * 1.0  # half the widest E2M1 gap (4 -> 6)
    else:
        bound = torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10)
    assert bool((err <= bound).all())
    # Exact: value * 2^e needs no rounding, so float64 agrees.
    vals = fp.e2m1_decode(fp.unpack_fp4(q.codes)) if fmt == "mxfp4" else q.codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(d.double(), (vals.double().reshape(x.shape) * s.double()).reshape(d.shape))


# ------------------------------------------------------------------------------------------
# NVFP4
# ------------------------------------------------------------------------------------------


def _nvfp4_reference(w):
    """ModelOpt's documented NVFP4 rule, written out for a 2-D weight."""
    x = w.float()
    g = x.abs().max() / 2688.0
    blocks = x.reshape(x.shape[0], -1, 16)
    s = blocks.abs().amax(-1) / (6.0 * g)
    s[s == 0] = 1.0
    s8 = s.clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn)
    vals = _reference_e2m1(blocks / (s8.float() * g).unsqueeze(-1))
    return vals.reshape(x.shape), s8, g


@pytest.mark.parametrize("shape", [(32, 64), (5, 48)])
def test_nvfp4_matches_modelopt_formulas(shape):
    w = _weights(8, shape)
    w[0, :16] = 0  # an all-zero block -> scale 1.0
    q = quantize_nvfp4(w, name="w")
    vals, s8, g = _nvfp4_reference(w)
    assert q.global_scale.item() == g.item()
    assert torch.equal(q.block_scale.view(torch.uint8), s8.view(torch.uint8))
    assert q.block_scale[0, 0].float().item() == 1.0
    assert torch.equal(fp.e2m1_decode(fp.unpack_fp4(q.codes)), vals)
    # Dequantize in the readers' order: value * (float(s) * g).
    expect = (vals.reshape(shape[0], -1, 16) * (s8.float() * g).unsqueeze(-1)).reshape(shape)
    assert torch.equal(dequantize_fp(q), expect)


def test_nvfp4_round_trip_bound():
    w = _weights(9, (64, 128), torch.float32)
    q = quantize_nvfp4(w)
    d = dequantize_fp(q).reshape(64, 8, 16)
    x = w.reshape(64, 8, 16)
    step = (q.block_scale.float() * q.global_scale).unsqueeze(-1)
    amax = x.abs().amax(-1, keepdim=True)
    # Half the widest E2M1 gap, plus what clamping at 6 loses when the e4m3 scale rounded down.
    bound = step * 1.0 + (amax - 6.0 * step).clamp(min=0)
    assert bool(((d - x).abs() <= bound * (1 + 2.0**-20)).all())
    # The float64 exact value differs from the readers' order by at most one float32 rounding.
    vals = fp.e2m1_decode(fp.unpack_fp4(q.codes)).double().reshape(64, 8, 16)
    exact = vals * q.block_scale.double().unsqueeze(-1) * float(q.global_scale)
    assert bool(((d.double() - exact).abs() <= exact.abs() * 2.0**-23).all())


def test_nvfp4_stacked_experts_equal_per_expert_and_shared_global_scale():
    w = _weights(10, (3, 16, 32))
    q = quantize_nvfp4(w)
    assert q.global_scale.shape == (3,)
    for e in range(3):
        qe = quantize_nvfp4(w[e])
        assert torch.equal(qe.codes, q.codes[e]) and torch.equal(qe.global_scale, q.global_scale[e])
        assert torch.equal(qe.block_scale.view(torch.uint8), q.block_scale[e].view(torch.uint8))
    shared = torch.tensor(float(q.global_scale.max()))
    q1 = quantize_nvfp4(w[0], global_scale=shared)
    assert q1.global_scale.item() == shared.item()
    assert bool((q1.block_scale.float() <= 448).all())


def test_nvfp4_zero_tensor_and_1d():
    q = quantize_nvfp4(torch.zeros(2, 32))
    assert q.global_scale.item() == 1.0 and not bool(dequantize_fp(q).any())
    v = _weights(11, (4, 64))[1]
    q1 = quantize_nvfp4(v)
    assert q1.codes.shape == (32,) and q1.global_scale.shape == ()
    assert torch.equal(dequantize_fp(q1), dequantize_fp(quantize_nvfp4(v[None], global_scale=q1.global_scale))[0])


# ------------------------------------------------------------------------------------------
# Errors and the recipe adapter
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: quantize_nvfp4(torch.randn(4, 40), name="layers.0.q_proj"), r"layers\.0\.q_proj.*multiple of 16"),
        (lambda: quantize_mx(torch.randn(4, 48), "mxfp4", name="m.w"), r"m\.w.*multiple of 32"),
        (lambda: quantize_fp8(torch.randn(100, 128), "block128", name="b"), r"b: FP8 block128.*multiples of 128"),
        (lambda: quantize_fp8(torch.randn(128, 100), "block128", name="b"), r"b:.*multiple of 128"),
        (lambda: quantize_fp8(torch.tensor([1.0, float("nan")]), name="nanw"), r"nanw: weight has 1 NaN/Inf"),
        (lambda: quantize_mx(torch.tensor([float("inf")] * 32), "mxfp8", name="infw"), r"infw: weight has 32 NaN/Inf"),
        (lambda: quantize_nvfp4(torch.ones(4, 16, dtype=torch.int32), name="i"), r"i: NVFP4 needs a float32/bfloat16/float16"),
        (lambda: quantize_nvfp4(torch.ones(1, 2, 4, 16), name="d4"), r"d4: expected a 1-D, 2-D or 3-D"),
        (lambda: quantize_fp8(torch.ones(4, 16), "row"), r"granularity 'row' unknown"),
        (lambda: quantize_mx(torch.ones(4, 32), "mxfp6"), r"MX format 'mxfp6' unknown"),
    ],
)
def test_bad_input_errors_name_the_tensor(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_container_validation():
    with pytest.raises(ValueError, match="block_scale must be float8_e4m3fn"):
        NVFP4Weight(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1), torch.tensor(1.0), (2, 16))
    with pytest.raises(ValueError, match="scale_e8m0 must be uint8"):
        MXWeight(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8), "mxfp4", (2, 32))
    with pytest.raises(ValueError, match=r"scale must be float32 \[4, 1\]"):
        FP8Weight(torch.zeros(4, 16, dtype=torch.float8_e4m3fn), torch.ones(4), "channel")


def test_quantize_weight_reads_fp_configs():
    w = _weights(12, (128, 128))
    assert isinstance(quantize_weight(w, QuantConfig(format="nvfp4", bits=4, group_size=16)), NVFP4Weight)
    mx = quantize_weight(w, QuantConfig(format="mxfp4", bits=4, group_size=32))
    assert isinstance(mx, MXWeight) and mx.fmt == "mxfp4"
    assert quantize_weight(w, QuantConfig(format="mxfp8")).fmt == "mxfp8"
    assert quantize_weight(w, QuantConfig(format="fp8")).granularity == "channel"
    assert quantize_weight(w, QuantConfig(format="fp8", granularity="block128")).granularity == "block128"
    # recipe files that chose the FP8 granularity with group_size still read
    old = QuantConfig.from_dict({"format": "fp8", "bits": 8, "group_size": 128})
    assert quantize_weight(w, old).granularity == "block128"
