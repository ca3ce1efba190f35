"""Exact conversion to and from torchao's IntxUnpackedToInt8Tensor, incl. its safetensors I/O."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict, unflatten_tensor_state_dict
from torchao.quantization import IntxUnpackedToInt8Tensor
from torchao.quantization.quant_primitives import MappingType

from llmq.quant import QuantConfig, QuantizedLinear, dequantize, from_torchao, quantize_weight, to_torchao


def bits_of(t):
    return t.contiguous().view(torch.int32)


def same_fields(a, b):
    return (
        torch.equal(a.qdata, b.qdata)
        and torch.equal(bits_of(a.scale), bits_of(b.scale))
        and torch.equal(bits_of(a.bias), bits_of(b.bias))
        and (a.bits, a.group_size, tuple(a.shape), a.dtype) == (b.bits, b.group_size, tuple(b.shape), b.dtype)
    )


def same_values(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("shape,dtype", [((64,), torch.float32), ((16, 64), torch.bfloat16), ((3, 8, 64), torch.float32)])
def test_round_trip_is_exact(bits, symmetric, shape, dtype):
    g = torch.Generator().manual_seed(bits)
    w = (torch.randn(shape, generator=g) + (0.0 if symmetric else 0.7)).to(dtype)
    qw = quantize_weight(w, QuantConfig(bits=bits, group_size=16, symmetric=symmetric))
    t = to_torchao(qw)
    assert isinstance(t, IntxUnpackedToInt8Tensor) and t.target_dtype == getattr(torch, f"int{bits}")
    assert t.shape == shape and t.dtype == dtype
    assert t.zero_point.dtype == torch.int8
    if symmetric:
        assert not bool(t.zero_point.any())
    # torchao's own dequantize (in the weight's dtype) equals ours, bit for bit
    assert same_values(t.dequantize(), dequantize(qw))
    assert same_values(t.to(torch.float32).dequantize() if dtype == torch.float32 else t.dequantize().float(), dequantize(qw).float())
    assert same_fields(from_torchao(t), qw)


@pytest.mark.parametrize("bits", [4, 8])
def test_torchao_symmetric_from_hp_is_our_quantize(bits):
    # For float32 weights torchao's SYMMETRIC from_hp and quantize_weight are the same rule.
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(1))
    t = IntxUnpackedToInt8Tensor.from_hp(w, (1, 32), getattr(torch, f"int{bits}"), mapping_type=MappingType.SYMMETRIC)
    qw = from_torchao(t)
    assert same_fields(qw, quantize_weight(w, QuantConfig(bits=bits, group_size=32)))
    assert same_values(dequantize(qw), t.dequantize())


def test_torchao_asymmetric_needs_allow_rounding():
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(2)) + 0.5
    t = IntxUnpackedToInt8Tensor.from_hp(w, (1, 32), torch.int4, mapping_type=MappingType.ASYMMETRIC)
    with pytest.raises(ValueError, match="allow_rounding"):
        from_torchao(t)
    qw = from_torchao(t, allow_rounding=True)
    exact_bias = -(t.zero_point.double() + 8) * t.scale.double()
    # bias rounded to nearest: <= 0.5 ulp(bias) = 2^-24 * 2^ceil(log2|bias|) <= 2^-24 |bias| * 2
    assert bool(((qw.bias.double() - exact_bias).abs() <= 2.0**-24 * exact_bias.abs() * 2).all())
    assert not torch.equal(qw.bias.double(), exact_bias)  # it really was inexact
    # dequantized values move by at most that bias error plus one float32 rounding
    ref = t.dequantize().double()
    err = (dequantize(qw, torch.float32).double() - ref).abs()
    bound = 2.0**-23 * exact_bias.abs().repeat_interleave(32, -1) + 2.0**-23 * ref.abs()
    assert bool((err <= bound).all())


def test_float_zero_point_refused_unless_rounding_allowed():
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(3))
    t = IntxUnpackedToInt8Tensor.from_hp(w, (1, 32), torch.int4)
    t2 = IntxUnpackedToInt8Tensor(t.qdata, t.scale, t.zero_point.float() + 0.25, torch.int4, (1, 32), torch.float32, None)
    with pytest.raises(ValueError, match="not integral"):
        from_torchao(t2)
    assert from_torchao(t2, allow_rounding=True).bias.dtype == torch.float32


def test_non_integral_canonical_bias_is_refused():
    qw = quantize_weight(torch.randn(8, 32), QuantConfig(bits=4, group_size=32))
    hqq_like = type(qw)(qw.qdata, qw.scale, qw.bias + 0.1 * qw.scale, 4, 32, qw.shape, qw.dtype)
    with pytest.raises(ValueError, match="integer zero"):
        to_torchao(hqq_like)


def test_bad_inputs():
    with pytest.raises(ValueError, match="IntxUnpackedToInt8Tensor"):
        from_torchao(torch.zeros(4, 32))
    with pytest.raises(ValueError, match="GroupQuantizedWeight"):
        to_torchao(torch.zeros(4, 32))
    w = torch.randn(8, 32)
    t = IntxUnpackedToInt8Tensor.from_hp(w, (8, 32), torch.int4)  # one block over rows and columns
    with pytest.raises(ValueError, match="group-wise along the last dim"):
        from_torchao(t)


def test_torchao_safetensors_round_trip(tmp_path):
    g = torch.Generator().manual_seed(4)
    qw = quantize_weight(torch.randn(24, 64, generator=g).bfloat16(), QuantConfig(bits=4, group_size=32, symmetric=False))
    state = {"proj.weight": to_torchao(qw), "proj.bias": torch.randn(24, generator=g)}
    tensors, metadata = flatten_tensor_state_dict(state)
    path = os.path.join(tmp_path, "model.safetensors")
    save_file(tensors, path, metadata=metadata)
    with safe_open(path, framework="pt") as f:
        loaded_meta = f.metadata()
    assert json.loads(loaded_meta["tensor_names"]) == ["proj.weight", "proj.bias"]
    restored, leftover = unflatten_tensor_state_dict(load_file(path), loaded_meta)
    assert leftover == {}
    assert same_fields(from_torchao(restored["proj.weight"]), qw)
    assert torch.equal(restored["proj.bias"], state["proj.bias"])


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 32), (8, 128)])
def test_8da_form_equals_int8_dynamic_activation_config(bits, group_size):
    # torchao's own Int8DynamicActivationIntxWeightConfig (8da4w PerGroup(32), 8da8w) quantizes the
    # same float32 weight to exactly the codes, scales and zero points our conversion carries over.
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerGroup, quantize_

    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(bits))
    lin = nn.Linear(128, 48, bias=False)
    lin.weight = nn.Parameter(w.clone(), requires_grad=False)
    quantize_(lin, Int8DynamicActivationIntxWeightConfig(weight_dtype=getattr(torch, f"int{bits}"),
                                                         weight_granularity=PerGroup(group_size)))
    ref = lin.weight
    ours = to_torchao(quantize_weight(w, QuantConfig(bits=bits, group_size=group_size)),
                      activation_quantization="int8_asym_per_token")
    assert type(ours) is type(ref) and ours.activation_quantization == ref.activation_quantization is not None
    assert torch.equal(ours.qdata, ref.qdata) and torch.equal(ours.zero_point, ref.zero_point)
    assert same_values(ours.scale, ref.scale.to(torch.float32))
    assert (ours.target_dtype, tuple(ours.block_size)) == (ref.target_dtype, tuple(ref.block_size))
    # and it runs torchao's dynamic-activation linear: per-token int8 activations, not the float x
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(9))
    assert same_values(F.linear(x, ours), F.linear(x, ref))
    assert not torch.equal(F.linear(x, ours), F.linear(x, dequantize(quantize_weight(w, QuantConfig(bits=bits, group_size=group_size)))))


def test_unknown_activation_quantization_is_refused():
    qw = quantize_weight(torch.randn(8, 32), QuantConfig(bits=4, group_size=32))
    with pytest.raises(ValueError, match="activation_quantization 'int4_sym' unsupported"):
        to_torchao(qw, activation_quantization="int4_sym")


def test_linear_with_torchao_weight_matches_quantized_linear():
    torch.manual_seed(5)
    lin = nn.Linear(128, 48, bias=True)
    ql = QuantizedLinear.from_linear(lin, QuantConfig(bits=4, group_size=32, symmetric=False))
    ao = nn.Linear(128, 48, bias=True)
    ao.weight = nn.Parameter(to_torchao(ql.quantized_weight()), requires_grad=False)
    ao.bias = lin.bias
    x = torch.randn(6, 128)
    out_ao, out_ql = ao(x), ql(x)
    # torchao multiplies by its exact dequantized weight, ours by fl(fl(q*s) + b): per weight
    # <= 2^-24 (|s*q| + |w|) apart; each float32 matmul rounds by <= 128 * 2^-24 of |x| @ |w|.
    w = dequantize(ql.quantized_weight(), torch.float32)
    sq = (w - ql.weight_bias.repeat_interleave(32, -1)).abs()
    bound = (128 + 2) * 2.0**-23 * (x.abs() @ (w.abs() + sq).T)
    assert bool(((out_ao - out_ql).abs() <= bound).all())
    assert same_values(out_ao, F.linear(x, w, lin.bias))


def test_import_does_not_load_torchao():
    code = "import sys, llmq.quant as q; assert 'torchao' not in sys.modules; assert callable(q.to_torchao)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
