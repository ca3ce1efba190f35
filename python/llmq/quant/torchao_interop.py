"""Exact converters between the canonical form and torchao 0.18's IntxUnpackedToInt8Tensor.

torchao stores signed q_s in int8 (range of torch.intB), a scale and an integer zero point
per block, and dequantizes (q_s - zero_point) * scale. With offset = 2^(B-1):

    q_s = q - offset
    zero_point = -bias/scale - offset      (must be an integer; stored as int8)
    bias = -(zero_point + offset) * scale

Everything quantize_weight produces has an integral -bias/scale and a float32-exact
(zero_point + offset) * scale, so both directions are exact. torchao tensors whose
(zero_point + offset) * scale is not exactly representable in float32, or whose zero point
is a non-integral float, are refused unless allow_rounding=True (bias is then rounded to
nearest float32: at most 0.5 ulp of the bias per group).
"""

from __future__ import annotations

from typing import Optional

import torch

from llmq.quant.formats import SUPPORTED_BITS, GroupQuantizedWeight, pack_bits, unpack_bits


def _torchao_tensor_class():
    from torchao.quantization import IntxUnpackedToInt8Tensor

    return IntxUnpackedToInt8Tensor


ACTIVATION_QUANTIZATIONS = ("int8_asym_per_token",)


def to_torchao(qw: GroupQuantizedWeight, activation_quantization: Optional[str] = None):
    """The IntxUnpackedToInt8Tensor that dequantizes to the same values as qw.

    activation_quantization=None gives the weight-only tensor (IntxWeightOnlyConfig's form);
    "int8_asym_per_token" gives the form Int8DynamicActivationIntxWeightConfig produces (8da4w,
    8da8w): same codes, scales and zero points, with the activations of every linear quantized to
    int8 per token (asymmetric) at run time."""
    cls = _torchao_tensor_class()
    if activation_quantization is not None and activation_quantization not in ACTIVATION_QUANTIZATIONS:
        raise ValueError(f"to_torchao: activation_quantization {activation_quantization!r} unsupported; "
                         f"expected None or one of {ACTIVATION_QUANTIZATIONS}")
    if not isinstance(qw, GroupQuantizedWeight):
        raise ValueError(f"to_torchao expects a GroupQuantizedWeight, got {type(qw).__name__}")
    offset = 1 << (qw.bits - 1)
    k = qw.shape[-1]
    fields_shape = tuple(qw.shape[:-1]) + (k // qw.group_size,)
    scale = qw.scale.reshape(fields_shape)
    bias = qw.bias.reshape(fields_shape)
    s64, b64 = scale.double(), bias.double()
    zero_unsigned = -b64 / s64
    integral = torch.isfinite(zero_unsigned) & (zero_unsigned == torch.round(zero_unsigned))
    integral &= (zero_unsigned - offset >= -128) & (zero_unsigned - offset <= 127)  # int8 zero point
    if bool(integral.all()):
        zero_unsigned = torch.round(zero_unsigned)
        integral &= -(zero_unsigned * s64) == b64  # the division above may hide an inexact bias
    if not bool(integral.all()):
        raise ValueError(
            f"to_torchao: {int((~integral).sum())} group(s) have a bias that is not -zero*scale for an integer zero in "
            "int8 range (e.g. HQQ or GGUF K-quant weights); torchao's integer zero point cannot represent them exactly"
        )
    q = unpack_bits(qw.qdata, qw.bits, k).reshape(qw.shape).to(torch.int16) - offset
    return cls(
        qdata=q.to(torch.int8),
        scale=scale.clone(),
        zero_point=(zero_unsigned - offset).to(torch.int8),
        target_dtype=getattr(torch, f"int{qw.bits}"),
        block_size=tuple([1] * (len(qw.shape) - 1) + [qw.group_size]),
        dtype=qw.dtype,
        activation_quantization=_activation_enum(activation_quantization),
    )


def _activation_enum(name: Optional[str]):
    if name is None:
        return None
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
        IntxUnpackedToInt8TensorActivationQuantization,
    )

    return IntxUnpackedToInt8TensorActivationQuantization(name)


def from_torchao(t, *, allow_rounding: bool = False) -> GroupQuantizedWeight:
    """The canonical form of a weight-only IntxUnpackedToInt8Tensor grouped along its last dim."""
    cls = _torchao_tensor_class()
    if not isinstance(t, cls):
        raise ValueError(f"from_torchao expects an IntxUnpackedToInt8Tensor, got {type(t).__name__}")
    bits = int(str(t.target_dtype).replace("torch.int", ""))
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"from_torchao: target dtype {t.target_dtype} unsupported; expected int2..int8")
    if t.activation_quantization is not None:
        raise ValueError(f"from_torchao: activation quantization {t.activation_quantization} has no canonical form (weight-only)")
    shape = tuple(t.qdata.shape)
    block = tuple(t.block_size)
    if not 1 <= len(shape) <= 3 or any(b != 1 for b in block[:-1]):
        raise ValueError(f"from_torchao: block_size {list(block)} for shape {list(shape)} is not group-wise along the last dim")
    group_size = block[-1]
    offset = 1 << (bits - 1)
    q = t.qdata.to(torch.int16) + offset
    if bool((q < 0).any()) or bool((q >= (1 << bits)).any()):
        raise ValueError(f"from_torchao: qdata outside the int{bits} range [{-offset}, {offset - 1}]")
    s64 = t.scale.double()
    z64 = t.zero_point.double()
    bias64 = 0.0 - (z64 + offset) * s64  # +0.0, not -0.0, for a zero product (as quantize_weight)
    bias = bias64.to(torch.float32)
    if not allow_rounding:
        integral_zero = bool((z64 == torch.round(z64)).all())
        exact_bias = bool((bias.double() == bias64).all())
        if not (integral_zero and exact_bias):
            raise ValueError(
                "from_torchao: "
                + ("the zero point is not integral" if not integral_zero else "(zero_point + offset) * scale is not exact in float32")
                + "; pass allow_rounding=True to round the bias to the nearest float32 (<= 0.5 ulp per group)"
            )
    lead = shape[:-1] if len(shape) >= 2 else (1,)
    return GroupQuantizedWeight(
        qdata=pack_bits(q.reshape(*lead, shape[-1]), bits),
        scale=t.scale.to(torch.float32).reshape(*lead, -1).contiguous(),
        bias=bias.reshape(*lead, -1).contiguous(),
        bits=bits,
        group_size=group_size,
        shape=shape,
        dtype=t.dtype,
    )
