"""Format family "int": the one canonical in-memory form of group-wise integer weights.

Every reader (GGUF, torchao, our own quantizer) converts *into* this form and every
packer (MLX, CUDA, the MoE kernel) converts *out of* it, so conversions are written
once per edge instead of once per pair. See docs/formats.md for the full contract.

    w[..., n, k] = scale[..., n, k // group_size] * q[..., n, k] + bias[..., n, k // group_size]

* q is unsigned, in [0, 2**bits).
* qdata is uint8 [..., N, K * bits / 8]: each row is a little-endian, LSB-first bit
  stream, element k occupying bits [k*bits, (k+1)*bits). For 4-bit this puts element 2i
  in the low nibble of byte i (MLX, ModelOpt and compressed-tensors order); for 2-, 3-,
  5-, 6-bit it is MLX's packing.
* scale and bias are float32 [..., N, K / group_size]. The bias is *additive* (not a
  zero point), so symmetric, asymmetric, float-zero (HQQ) and GGUF K-quant blocks all
  fit exactly.
* dequantize evaluates scale*q + bias exactly (float64) and rounds once to float32.

Quantization (`quantize_int`; the config's method "minmax", "search" or "hqq"):

The arithmetic follows torchao 0.18's `choose_qparams_affine` / `quantize_affine` so that
results can be checked bit-for-bit against it (docs/formats.md, "Quantization rules"):

* symmetric: signed range [-2^(b-1), 2^(b-1)-1], scale = max(|min|, |max|) / ((qmax-qmin)/2)
  clamped below at float32's smallest normal, q_signed = clamp(round(w * (1/scale))), stored
  as q = q_signed + 2^(b-1) with bias = -2^(b-1) * scale (exact in float32).
* asymmetric: scale = (max(max,0) - min(min,0)) / (2^b - 1) clamped the same way, then rounded
  to at most 24-b significant bits so that bias = -zero * scale is exact in float32; integer
  zero = clamp(-round(min(min,0) / scale), 0, 2^b-1); q = clamp(round(w * (1/scale)) + zero).

All arithmetic runs in float32 on the weight upcast to float32 (exact for bf16/fp16 inputs).
Rounding is torch.round (half to even), as in torchao.

When the compiled kernel (cpp/quant, loaded by llmq.quant._native) is available, integer
weights on the CPU go through it instead: it performs the same float32 operations in the
same order and returns identical bytes, ~20x faster (docs/formats.md, "Performance"). The
torch code below is the reference (`quantize_weight_torch`) and the fallback.

The torchao converters (`to_torchao`, `from_torchao`; torchao is imported on first use):
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

import dataclasses
import math
import sys
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

import llmq.quant._native as _native
import llmq.quant.hqq as hqq
import llmq.quant.scale_rounding as scale_rounding
import llmq.quant.search as search
from llmq.quant.codecs import (
    SUPPORTED_BITS,
    check_weight,
    pack_bits,
    packed_row_bytes,
    qparams_asymmetric,
    qparams_symmetric,
    raise_not_finite,
    row_ranges,
    unpack_bits,
)
from llmq.quant.formats.base import Format, Layout, RowQuantizer
from llmq.quant.formats.hf_export import HFExport, ct_weights


@dataclasses.dataclass(frozen=True)
class GroupQuantizedWeight:
    """A group-wise integer weight in the canonical convention (see module docstring).

    Not a torch.Tensor subclass on purpose: it is a plain, inspectable container that
    converters and packers read field by field. Leading dimensions (e.g. stacked
    experts [E, N, K]) are carried through unchanged.
    """

    qdata: torch.Tensor  # uint8 [..., N, K*bits/8]
    scale: torch.Tensor  # float32 [..., N, K/group_size]
    bias: torch.Tensor  # float32 [..., N, K/group_size]
    bits: int
    group_size: int
    shape: Tuple[int, ...]  # logical (unpacked) shape [..., N, K]
    dtype: torch.dtype = torch.bfloat16  # dtype of the original high-precision weight

    def __post_init__(self):
        validate_layout(self)

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    @property
    def out_features(self) -> int:
        return self.shape[-2] if len(self.shape) >= 2 else 1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qdata, self.scale, self.bias))


def validate_layout(w: GroupQuantizedWeight) -> None:
    """Raise ValueError if the fields disagree with each other (cheap, shape-only)."""
    if w.bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={w.bits} unsupported; expected one of {SUPPORTED_BITS}")
    if len(w.shape) < 1:
        raise ValueError("a quantized weight needs at least one dimension")
    k = w.shape[-1]
    lead = tuple(w.shape[:-1]) if len(w.shape) >= 2 else (1,)
    if w.group_size <= 0 or k % w.group_size:
        raise ValueError(f"group_size={w.group_size} does not divide K={k}")
    expect_q = lead + (packed_row_bytes(k, w.bits),)
    expect_s = lead + (k // w.group_size,)
    if w.qdata.dtype != torch.uint8 or tuple(w.qdata.shape) != expect_q:
        raise ValueError(f"qdata must be uint8 {list(expect_q)}, got {w.qdata.dtype} {list(w.qdata.shape)}")
    for name in ("scale", "bias"):
        t = getattr(w, name)
        if t.dtype != torch.float32 or tuple(t.shape) != expect_s:
            raise ValueError(f"{name} must be float32 {list(expect_s)}, got {t.dtype} {list(t.shape)}")


# Rows are dequantized this many elements at a time: the exact float64 evaluation needs
# ~25 bytes of scratch per element, so a block costs ~25 MiB whatever the tensor's size
# (a 262k x 5.4k embedding would otherwise need ~30 GB on top of its output).
DEQUANT_BLOCK_ELEMENTS = 1 << 20


def dequantize_canonical(w: GroupQuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """scale*q + bias evaluated exactly in float64, rounded once to float32 (then to dtype).

    Works through whole rows in blocks of about DEQUANT_BLOCK_ELEMENTS elements, so transient
    memory is bounded by the block, not the tensor; the result is identical either way."""
    k, g = w.shape[-1], w.group_size
    rows = math.prod(w.shape[:-1]) if len(w.shape) >= 2 else 1
    out = torch.empty((rows, k), dtype=dtype)
    if rows == 0 or k == 0:
        return out.reshape(w.shape)
    qdata = w.qdata.reshape(rows, -1)
    scale, bias = w.scale.reshape(rows, -1, 1), w.bias.reshape(rows, -1, 1)
    step = max(1, DEQUANT_BLOCK_ELEMENTS // k)
    for r in range(0, rows, step):
        q = unpack_bits(qdata[r:r + step], w.bits, k).to(torch.float64).reshape(-1, k // g, g)
        q.mul_(scale[r:r + step].to(torch.float64)).add_(bias[r:r + step].to(torch.float64))
        out[r:r + step] = q.to(torch.float32).reshape(-1, k).to(dtype)
    return out.reshape(w.shape)


# --------------------------------------------------------------------------------------------
# Quantization
# --------------------------------------------------------------------------------------------

# Quantize this many elements at a time so that peak memory stays a small multiple of the
# input (a stacked-expert tensor can be gigabytes) instead of ~10x it.
_ROWS_ELEMENTS = 1 << 24
# Methods "search" and "hqq" keep a few float64 copies of their rows: fewer at a time.
_SEARCH_ROWS_ELEMENTS = 1 << 20


def _check_weight(w: torch.Tensor, bits: int, group_size: Optional[int], name: str) -> int:
    """Validate w for `bits` / `group_size` (None: one group a row); return the group size."""
    check_weight(w, name)
    k = w.shape[-1]
    gs = k if group_size is None else group_size
    if k % gs:
        raise ValueError(f"{name}: group_size={gs} does not divide the input dimension K={k} (shape {list(w.shape)})")
    if (k * bits) % 8 or (bits not in (2, 4, 8) and k % 8):
        raise ValueError(f"{name}: K={k} cannot be packed at {bits} bits (rows must fill whole bytes; K % 8 == 0 for 3/5/6/7-bit)")
    return gs


class _NotFinite(Exception):
    """Rows held NaN/Inf; quantize_rows_torch reports it against the whole weight."""


def _group_importance(importance: Optional[torch.Tensor], k: int, gs: int) -> Optional[torch.Tensor]:
    return None if importance is None else importance.reshape(k // gs, gs)


@dataclasses.dataclass(frozen=True)
class _Params:
    """The config fields llmq.quant.scale_rounding reads."""

    bits: int
    symmetric: bool
    method: str
    scale_dtype: torch.dtype


def _quantize_rows(x: torch.Tensor, bits: int, gs: int, symmetric: bool, method: str, name: str,
                   importance: Optional[torch.Tensor] = None, scale_dtype: torch.dtype = torch.float32):
    """Quantize float32 rows x[R, K] -> (packed qdata [R, K*b/8], scale [R, G], bias [R, G])."""
    rows, k = x.shape
    g = x.reshape(rows, k // gs, gs)
    xmin, xmax = g.amin(-1), g.amax(-1)  # both propagate NaN, and +-Inf shows up in one of them
    if not (bool(torch.isfinite(xmin).all()) and bool(torch.isfinite(xmax).all())):
        raise _NotFinite()
    if scale_dtype != torch.float32:  # 16-bit scales: the rounding is part of the choice
        q, scale, bias = scale_rounding.quantize_groups(g, _Params(bits, symmetric, method, scale_dtype),
                                                        _group_importance(importance, k, gs), name)
        return pack_bits(q.reshape(rows, k), bits), scale, bias
    if symmetric:
        offset = 1 << (bits - 1)
        scale = qparams_symmetric(xmin, xmax, bits)
        if method == "search":
            scale, _ = search.search_qparams(g, xmin, xmax, bits, True, _group_importance(importance, k, gs))
        q = torch.mul(g, (1.0 / scale).unsqueeze(-1)).round_().clamp_(-offset, offset - 1).add_(offset)
        bias = scale * -float(offset)
    else:
        scale, zero = qparams_asymmetric(xmin, xmax, bits, name)  # also rejects an overflowing range
        if method == "hqq":  # float zero: codes round after adding it, bias = -z*s
            scale, zero = hqq.hqq_qparams(g, bits, None if importance is None else importance.reshape(k // gs, gs))
            q = torch.mul(g, (1.0 / scale).unsqueeze(-1)).add_(zero.unsqueeze(-1)).round_().clamp_(0, (1 << bits) - 1)
            return pack_bits(q.reshape(rows, k).to(torch.uint8), bits), scale, 0.0 - zero * scale
        if method == "search":
            found_scale, found_zero = search.search_qparams(g, xmin, xmax, bits, False, _group_importance(importance, k, gs))
            assert found_zero is not None  # an asymmetric search returns its zero
            scale, zero = found_scale, found_zero
        q = torch.mul(g, (1.0 / scale).unsqueeze(-1)).round_().add_(zero.unsqueeze(-1)).clamp_(0, (1 << bits) - 1)
        bias = 0.0 - zero * scale  # exact; +0.0 (not -0.0) when zero == 0
    q = q.reshape(rows, k).to(torch.uint8)
    return pack_bits(q, bits), scale, bias


def _check_importance(importance, k: int, name: str) -> torch.Tensor:
    if not isinstance(importance, torch.Tensor) or importance.dim() != 1 or importance.shape[0] != k:
        got = list(importance.shape) if isinstance(importance, torch.Tensor) else type(importance).__name__
        raise ValueError(f"{name}: importance must be a 1-D tensor of K={k} values (one per input channel), got {got}")
    imp = importance.detach().to(device="cpu", dtype=torch.float32)
    if not bool((torch.isfinite(imp) & (imp > 0)).all()):
        raise ValueError(f"{name}: importance must be finite and > 0 everywhere (add a small floor to zero channels)")
    return imp.contiguous()


def quantize_int(w: torch.Tensor, bits: int, group_size: Optional[int], symmetric: bool, method: str = "minmax", *,
                 name: str = "<tensor>", importance: Optional[torch.Tensor] = None,
                 scale_dtype: torch.dtype = torch.float32) -> GroupQuantizedWeight:
    """Group-wise along the last dimension into the canonical GroupQuantizedWeight (group_size None:
    one group a row), through the compiled kernel when it applies (same bytes). importance: optional
    positive weights [K] that methods "search" and "hqq" weight the error by."""
    gs = _check_weight(w, bits, group_size, name)
    if importance is not None:
        importance = _check_importance(importance, w.shape[-1], name)
    parts = None
    # None from the kernel means a NaN/Inf or an overflowing range: the reference path below
    # raises the matching error, naming the tensor and the first bad element. The kernels choose
    # float32 scales; 16-bit ones go the torch way (llmq.quant.scale_rounding).
    kernel = scale_dtype == torch.float32 and _native.applicable(w)
    if method == "minmax" and importance is None and kernel:
        parts = _native.quantize_rows(w.detach().reshape(-1, w.shape[-1]), bits, gs, symmetric)
    elif method == "search" and kernel and _native.search_quantize_available():
        parts = _native.search_quantize_rows(w.detach().reshape(-1, w.shape[-1]), bits, gs, symmetric,
                                             importance=importance)
    if parts is None:
        parts = quantize_rows_torch(w, bits, gs, symmetric, method, name, importance, scale_dtype)
    return _assemble(w, bits, gs, parts)


def quantize_weight_torch(w: torch.Tensor, config: Any, *, name: str = "<tensor>") -> GroupQuantizedWeight:
    """quantize_int for a config of format "int" by the torch reference path only (never the
    compiled kernel): what the kernel is tested against, bit for bit."""
    if config.format != "int":
        raise ValueError(f"{name}: quantize_weight_torch handles integer formats only, got {config.format!r}")
    gs = _check_weight(w, config.bits, config.group_size, name)
    return _assemble(w, config.bits, gs, quantize_rows_torch(w, config.bits, gs, config.symmetric, config.method, name,
                                                             scale_dtype=config.scale_dtype))


def quantize_rows_torch(w: torch.Tensor, bits: int, gs: int, symmetric: bool, method: str, name: str,
                        importance: Optional[torch.Tensor] = None, scale_dtype: torch.dtype = torch.float32):
    """The torch reference over all rows of w, a bounded number of rows at a time: (qdata, scale,
    bias) as [R, ...]."""
    k = w.shape[-1]
    rows = w.detach().reshape(-1, k)
    small = method != "minmax" or scale_dtype != torch.float32
    elements = _SEARCH_ROWS_ELEMENTS if small else _ROWS_ELEMENTS
    try:
        parts = [_quantize_rows(rows[a:b].to(device="cpu", dtype=torch.float32), bits, gs, symmetric, method, name,
                                importance, scale_dtype)
                 for a, b in row_ranges(rows.shape[0], k, elements)]
    except _NotFinite:
        parts = None
    if parts is None:  # raised outside the except block, so the traceback stays clean
        raise_not_finite(w, name)
    assert parts is not None
    return tuple(torch.cat([p[j] for p in parts]) if len(parts) > 1 else parts[0][j] for j in range(3))


def _assemble(w: torch.Tensor, bits: int, gs: int, parts) -> GroupQuantizedWeight:
    """Reshape row-major (qdata, scale, bias) back to w's leading dimensions."""
    shape = tuple(w.shape)
    lead = shape[:-1] if len(shape) >= 2 else (1,)
    qdata, scale, bias = parts
    return GroupQuantizedWeight(
        qdata=qdata.reshape(*lead, -1).contiguous(),
        scale=scale.reshape(*lead, -1).contiguous(),
        bias=bias.reshape(*lead, -1).contiguous(),
        bits=bits,
        group_size=gs,
        shape=shape,
        dtype=w.dtype,
    )


# --------------------------------------------------------------------------------------------
# torchao IntxUnpackedToInt8Tensor
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Hugging Face export: compressed-tensors "pack-quantized"
# --------------------------------------------------------------------------------------------


def _bytes_to_int32_words(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [R, B] LSB-first bit stream -> int32 [R, ceil(B/4)] little-endian words."""
    pad = (-rows.shape[-1]) % 4
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    words = rows.contiguous().view(torch.int32)
    if sys.byteorder != "little":
        raise RuntimeError("compressed-tensors packing assumes a little-endian machine")
    return words


class IntAffineHFExport(HFExport):
    """Integer weights as compressed-tensors pack-quantized: ``weight_packed`` int32 words of the
    LSB-first stream of q_signed + 2**(b-1) (our unsigned q), ``weight_scale``, optional
    ``weight_zero_point`` (packed along N), ``weight_shape``; w = (q_signed - zp) * scale.

    Exact only when the additive bias is -2**(b-1)*scale (symmetric) or -zero*scale with an
    integer zero (asymmetric); otherwise (e.g. HQQ float zeros) the weight is refused."""

    styles = ("compressed-tensors",)
    asymmetric = True
    stacked = False

    def normalize(self, spec, where):
        if spec.style != "compressed-tensors":
            raise ValueError(f"{where}: integer weights are exported in the compressed-tensors style (pack-quantized)"
                             "; ModelOpt's INT4 AWQ layout is not supported")
        out = super().normalize(spec, where)
        if spec.bits not in SUPPORTED_BITS:
            raise ValueError(f"{where}: int bits={spec.bits} unsupported; expected 2..8")
        if spec.group_size is not None and spec.group_size <= 0:
            raise ValueError(f"{where}: int group_size must be positive or None (per channel)")
        return out

    def roles(self, spec):
        roles = {"weight": "weight_packed", "scale": "weight_scale"}
        if not spec.symmetric:
            roles["zero_point"] = "weight_zero_point"
        roles["shape"] = "weight_shape"
        return roles

    def dtypes(self, spec):
        return {"weight": torch.int32, "scale": torch.float32, "zero_point": torch.int32, "shape": torch.int64}

    def shapes(self, spec, n, k):
        scale = (n, k // (spec.group_size or k))
        shapes = {"weight": (n, -(-k * spec.bits // 32)), "scale": scale}
        if not spec.symmetric:
            shapes["zero_point"] = (-(-n * spec.bits // 32), scale[1])
        shapes["shape"] = (2,)
        return shapes

    def compressed_tensors_scheme(self, spec):
        gs = spec.group_size
        w = ct_weights(spec, type="int", strategy="group" if gs else "channel", group_size=gs, block_structure=None)
        return {"format": "pack-quantized", "weights": w, "input_activations": None, "output_activations": None}

    def from_compressed_tensors(self, scheme):
        w = scheme.get("weights") or {}
        if scheme.get("format") != "pack-quantized" or w.get("type") != "int" or w.get("strategy") not in ("group", "channel"):
            return None
        return {"format": "int", "bits": w.get("num_bits"), "group_size": w.get("group_size") if w.get("strategy") == "group" else None,
                "symmetric": bool(w.get("symmetric", True))}

    def quantize(self, weight, spec, state):
        return quantize_int(weight, spec.bits, spec.group_size, spec.symmetric, name=f"{spec.module}.weight")

    def to_tensors(self, q, spec, state, dtype):
        where = f"{spec.module}.weight"
        if len(q.shape) != 2:
            raise ValueError(f"{where}: pack-quantized export takes 2-D weights, got shape {list(q.shape)}")
        if q.bits != spec.bits or q.group_size != (spec.group_size or q.shape[-1]):
            raise ValueError(f"{where}: quantized with bits={q.bits} group_size={q.group_size}, spec says bits={spec.bits} group_size={spec.group_size}")
        n, k = q.shape
        half = 1 << (q.bits - 1)
        out = {"weight": _bytes_to_int32_words(q.qdata)}
        if spec.symmetric:
            if not torch.equal(q.bias, -half * q.scale):
                raise ValueError(f"{where}: bias is not -{half}*scale, so the weight is not symmetric; export it with symmetric=False")
        else:
            zero = -(q.bias.double() / q.scale.double())
            zr = zero.round()
            if not (torch.equal(zero, zr) and bool(((zr >= 0) & (zr < 2 * half)).all()) and torch.equal((-zr * q.scale.double()).float(), q.bias)):
                raise ValueError(f"{where}: bias/scale is not an integer zero point in [0, {2 * half})"
                                 "; the weight (e.g. HQQ float zeros) has no exact pack-quantized form")
            zp = zr.to(torch.uint8).t().contiguous()  # [G, N]: packed along the output dimension
            padded = torch.nn.functional.pad(zp, (0, (-n) % 32))
            words = _bytes_to_int32_words(pack_bits(padded, q.bits))[:, : -(-n * q.bits // 32)]
            out["zero_point"] = words.t().contiguous()
        out["scale"] = q.scale.to(dtype or torch.float32)
        out["shape"] = torch.tensor([n, k], dtype=torch.int64)
        return out

    def dequantize(self, t, spec):
        w, s = t["weight"], t["scale"]
        n, k = (int(v) for v in t["shape"].tolist())
        half = 1 << (spec.bits - 1)
        row_bytes = k * spec.bits // 8
        qdata = w.contiguous().view(torch.uint8)[:, :row_bytes]
        scale = s.float()
        if spec.symmetric:
            bias = -half * scale
        else:
            if (n * spec.bits) % 8:
                raise ValueError(f"{spec.module}: zero points of {n} rows at {spec.bits} bits do not fill whole bytes")
            zbytes = t["zero_point"].t().contiguous().view(torch.uint8)[:, : n * spec.bits // 8]
            zero = unpack_bits(zbytes, spec.bits, n).t()
            bias = -(zero.float() * scale)
        gq = GroupQuantizedWeight(qdata=qdata, scale=scale, bias=bias, bits=spec.bits, group_size=k // scale.shape[1], shape=(n, k))
        return dequantize_canonical(gq)


class IntAffineFormat(Format):
    """Group-wise integer affine weights (w = scale*q + bias)."""

    family = "int"
    names = ("int",)
    container = GroupQuantizedWeight
    has_quantized_module = True
    # quantize_int / llmq.quant.search / llmq.quant.hqq / llmq.quant.gptq (needs the layer's H)
    methods = ("minmax", "search", "hqq", "gptq")
    importance_methods = ("hqq", "search")
    rows_independent = True  # groups (and K-quant super-blocks) run along a row
    hf_export = IntAffineHFExport()
    # Bundles store this family as {"kind": "group_quantized", "bits", "group_size", ...}, the
    # record every bundle version has used for it (so integer bundles stay byte-identical).
    bundle_kind = "group_quantized"
    config_fields = ("bits", "group_size", "symmetric", "scale_dtype")

    def default_config(self, name: str) -> Dict[str, Any]:
        return {"bits": 4, "group_size": 32, "symmetric": True, "scale_dtype": torch.float32}

    def example_configs(self, name: str) -> Tuple[Dict[str, Any], ...]:
        """Both zero conventions, an odd width and one group a row."""
        return ({"bits": 4, "group_size": 32, "symmetric": False}, {"bits": 4, "group_size": 64},
                {"bits": 5, "group_size": 64, "symmetric": False}, {"bits": 8, "group_size": None})

    def validate_config(self, config: Any) -> None:
        if config.method == "hqq" and config.symmetric:
            raise ValueError("QuantConfig.method='hqq' optimises the zero point: it needs symmetric=False (asymmetric)")
        if config.method == "gptq":
            from llmq.quant.gptq_options import check_options

            check_options(dict(config.options or ()))
        gs = config.group_size
        if gs is not None and (not isinstance(gs, int) or isinstance(gs, bool) or gs <= 0):
            raise ValueError(f"QuantConfig.group_size must be a positive int, -1 or None (whole row), got {gs!r}")
        if config.bits not in SUPPORTED_BITS:
            raise ValueError(f"QuantConfig.bits={config.bits} unsupported for format 'int'; expected one of {SUPPORTED_BITS}")
        if config.scale_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"QuantConfig.scale_dtype={config.scale_dtype} unsupported for format 'int'; expected "
                             "float32, float16 or bfloat16")

    def shape_problem(self, config: Any, shape: Tuple[int, ...]) -> Optional[str]:
        k = shape[-1]
        gs = config.group_size_for(k)
        return None if gs > 0 and k % gs == 0 else f"group_size={gs} does not divide the input dimension K={k}"

    def describe(self, config: Any) -> str:
        group = "row" if config.group_size is None else str(config.group_size)
        return f"int{config.bits} g{group} {'sym' if config.symmetric else 'asym'}"

    def quantize(self, w: torch.Tensor, config: Any, *, name: str = "<tensor>",
                 importance: Optional[torch.Tensor] = None) -> GroupQuantizedWeight:
        if config.method == "gptq":
            raise ValueError(f"{name}: method 'gptq' rounds against the layer's inputs: it needs their second moment "
                             "H (quantize_weight(..., hessian=); in a run, --calibration_text)")
        return quantize_int(w, config.bits, config.group_size, config.symmetric, config.method, name=name,
                            importance=importance, scale_dtype=config.scale_dtype)

    def dequantize(self, value: GroupQuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_canonical(value, dtype)

    def params(self, value: GroupQuantizedWeight) -> Dict[str, Any]:
        return {"bits": value.bits, "group_size": value.group_size}

    def stored(self, value: GroupQuantizedWeight) -> Dict[str, torch.Tensor]:
        return {"qdata": value.qdata, "scale": value.scale, "bias": value.bias}

    def rebuild(self, name, params, shape, dtype, stored) -> GroupQuantizedWeight:
        return GroupQuantizedWeight(qdata=stored["qdata"], scale=stored["scale"], bias=stored["bias"],
                                    bits=params.get("bits"), group_size=params.get("group_size"),
                                    shape=tuple(shape), dtype=dtype)

    def layout(self, name, params, shape) -> Layout:
        lead = tuple(shape[:-1]) if len(shape) >= 2 else (1,)
        k, bits, gs = shape[-1], params["bits"], params["group_size"]
        return {"qdata": (torch.uint8, lead + (packed_row_bytes(k, bits),)),
                "scale": (torch.float32, lead + (k // gs,)), "bias": (torch.float32, lead + (k // gs,))}

    def to_torchao(self, value: GroupQuantizedWeight):
        return to_torchao(value)

    def fuse_along_output(self, weights: Sequence[GroupQuantizedWeight]) -> GroupQuantizedWeight:
        """Groups run along K, so rows are independent and concatenating the fields along N is exact."""
        weights = list(weights)
        if not weights:
            raise ValueError("fuse_along_output needs at least one weight")
        for i, w in enumerate(weights):
            if not isinstance(w, GroupQuantizedWeight):
                raise ValueError(f"fuse_along_output: item {i} is a {type(w).__name__}, expected GroupQuantizedWeight")
            if len(w.shape) not in (2, 3):
                raise ValueError(f"fuse_along_output: item {i} has shape {list(w.shape)}; expected [N, K] or [E, N, K]")
        first = weights[0]
        for i, w in enumerate(weights[1:], start=1):
            mismatches = []
            if w.bits != first.bits:
                mismatches.append(f"bits {w.bits} != {first.bits}")
            if w.group_size != first.group_size:
                mismatches.append(f"group_size {w.group_size} != {first.group_size}")
            if len(w.shape) != len(first.shape) or w.shape[:-2] != first.shape[:-2] or w.shape[-1] != first.shape[-1]:
                mismatches.append(f"shape {list(w.shape)} incompatible with {list(first.shape)} (all but N must agree)")
            if w.dtype != first.dtype:
                mismatches.append(f"dtype {w.dtype} != {first.dtype}")
            if mismatches:
                raise ValueError(f"fuse_along_output: item {i} does not match item 0: " + "; ".join(mismatches))
        n = sum(w.shape[-2] for w in weights)
        return GroupQuantizedWeight(
            qdata=torch.cat([w.qdata for w in weights], dim=-2),
            scale=torch.cat([w.scale for w in weights], dim=-2),
            bias=torch.cat([w.bias for w in weights], dim=-2),
            bits=first.bits,
            group_size=first.group_size,
            shape=tuple(first.shape[:-2]) + (n, first.shape[-1]),
            dtype=first.dtype,
        )

    def row_quantizer(self, config: Any, shape: Tuple[int, ...], *, name: str = "<tensor>"):
        """Method "minmax" (the default) is group-wise inside each row: any block of rows gives its
        rows of the whole result. The search and hqq methods are quantized whole."""
        if config.method != "minmax" or len(shape) != 2:
            return None
        return RowQuantizer(lambda block, amax: self.quantize(block, config, name=name))

    def native_kernel_available(self) -> bool:
        return _native.native_kernel_available()
