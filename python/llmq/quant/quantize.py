"""Weight-only group-wise integer quantization into the canonical form, and back.

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
same order and returns identical bytes, ~20x faster (docs/formats.md, "Performance"). The torch code below is the
reference (`quantize_weight_torch`) and the fallback.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from llmq.quant import _native, hqq, scale_rounding, search
from llmq.quant.formats import GroupQuantizedWeight, IntAffineFormat, format_of, get_format, pack_bits
from llmq.quant.recipe import QuantConfig

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Quantize this many elements at a time so that peak memory stays a small multiple of the
# input (a stacked-expert tensor can be gigabytes) instead of ~10x it.
_CHUNK_ELEMENTS = 1 << 24
# Methods "search" and "hqq" keep a few float64 copies of their chunk: smaller chunks.
_SEARCH_CHUNK_ELEMENTS = 1 << 20


def _check_weight(w: torch.Tensor, config: QuantConfig, name: str) -> int:
    """Validate w against config; return the group size. Errors name the tensor."""
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
    if not isinstance(config, QuantConfig):
        raise ValueError(f"{name}: expected a QuantConfig, got {type(config).__name__}")
    if w.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: expected a float32/bfloat16/float16 weight, got dtype {w.dtype}")
    if not 1 <= w.dim() <= 3:
        raise ValueError(f"{name}: expected a 1-D, 2-D or 3-D ([experts, out, in]) weight, got shape {list(w.shape)}")
    k = w.shape[-1]
    if k == 0 or w.numel() == 0:
        raise ValueError(f"{name}: cannot quantize an empty weight of shape {list(w.shape)}")
    gs = config.group_size_for(k)
    if k % gs:
        raise ValueError(f"{name}: group_size={gs} does not divide the input dimension K={k} (shape {list(w.shape)})")
    if (k * config.bits) % 8 or (config.bits not in (2, 4, 8) and k % 8):
        raise ValueError(f"{name}: K={k} cannot be packed at {config.bits} bits (rows must fill whole bytes; K % 8 == 0 for 3/5/6/7-bit)")
    return gs


class _NotFinite(Exception):
    """A chunk held NaN/Inf; _quantize_torch reports it against the whole weight."""


def _raise_not_finite(w: torch.Tensor, name: str) -> None:
    """Called once a group's min/max came out NaN/Inf: name the first offending element
    (its index in w's own shape) and count them all."""
    finite = torch.isfinite(w.detach())
    bad = (~finite).nonzero()[0].tolist()
    raise ValueError(f"{name}: weight has {int((~finite).sum())} NaN/Inf value(s), first at index {bad}")


def round_scale_mantissa(scale: torch.Tensor, significant_bits: int) -> torch.Tensor:
    """Round positive normal float32 values to `significant_bits` significant bits (nearest,
    ties to even), by integer arithmetic on their bit patterns."""
    drop = 24 - significant_bits
    if drop <= 0:
        return scale
    bits = scale.contiguous().view(torch.int32)
    lsb = (bits >> drop) & 1
    bits = (bits + ((1 << (drop - 1)) - 1) + lsb) & ~((1 << drop) - 1)
    return bits.view(torch.float32)


def _qparams_symmetric(xmin: torch.Tensor, xmax: torch.Tensor, bits: int) -> torch.Tensor:
    """torchao MappingType.SYMMETRIC scale from float32 group minima / maxima."""
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    min_neg = torch.clamp(xmin, max=0.0)
    max_pos = torch.clamp(xmax, min=0.0)
    amax = torch.max(-min_neg, max_pos)
    scale = amax / (float(qmax - qmin) / 2)
    return torch.clamp(scale, min=torch.finfo(torch.float32).smallest_normal)


def _qparams_asymmetric(xmin: torch.Tensor, xmax: torch.Tensor, bits: int, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """torchao MappingType.ASYMMETRIC qparams (unsigned range) from float32 group minima /
    maxima, with the scale mantissa rounded to 24-bits significant bits; (scale, zero)."""
    qmax = (1 << bits) - 1
    min_neg = torch.clamp(xmin, max=0.0)
    max_pos = torch.clamp(xmax, min=0.0)
    scale = (max_pos - min_neg) / float(qmax)
    scale = torch.clamp(scale, min=torch.finfo(torch.float32).smallest_normal)
    scale = round_scale_mantissa(scale, 24 - bits)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"{name}: a group's value range (max - min) overflows float32; cannot quantize")
    zero = torch.clamp(0.0 - torch.round(min_neg / scale), 0, qmax)
    return scale, zero


def _group_importance(importance: Optional[torch.Tensor], k: int, gs: int) -> Optional[torch.Tensor]:
    return None if importance is None else importance.reshape(k // gs, gs)


def _quantize_rows(x: torch.Tensor, config: QuantConfig, gs: int, name: str, importance: Optional[torch.Tensor] = None):
    """Quantize float32 rows x[R, K] -> (packed qdata [R, K*b/8], scale [R, G], bias [R, G])."""
    bits = config.bits
    rows, k = x.shape
    g = x.reshape(rows, k // gs, gs)
    xmin, xmax = g.amin(-1), g.amax(-1)  # both propagate NaN, and +-Inf shows up in one of them
    if not (bool(torch.isfinite(xmin).all()) and bool(torch.isfinite(xmax).all())):
        raise _NotFinite()
    if config.scale_dtype != torch.float32:  # 16-bit scales: the rounding is part of the choice
        q, scale, bias = scale_rounding.quantize_groups(g, config, _group_importance(importance, k, gs), name)
        return pack_bits(q.reshape(rows, k), bits), scale, bias
    if config.symmetric:
        offset = 1 << (bits - 1)
        scale = _qparams_symmetric(xmin, xmax, bits)
        if config.method == "search":
            scale, _ = search.search_qparams(g, xmin, xmax, bits, True, _group_importance(importance, k, gs))
        q = torch.mul(g, (1.0 / scale).unsqueeze(-1)).round_().clamp_(-offset, offset - 1).add_(offset)
        bias = scale * -float(offset)
    else:
        scale, zero = _qparams_asymmetric(xmin, xmax, bits, name)  # also rejects an overflowing range
        if config.method == "hqq":  # float zero: codes round after adding it, bias = -z*s
            scale, zero = hqq.hqq_qparams(g, bits, None if importance is None else importance.reshape(k // gs, gs))
            q = torch.mul(g, (1.0 / scale).unsqueeze(-1)).add_(zero.unsqueeze(-1)).round_().clamp_(0, (1 << bits) - 1)
            return pack_bits(q.reshape(rows, k).to(torch.uint8), bits), scale, 0.0 - zero * scale
        if config.method == "search":
            scale, zero = search.search_qparams(g, xmin, xmax, bits, False, _group_importance(importance, k, gs))
        q = torch.mul(g, (1.0 / scale).unsqueeze(-1)).round_().add_(zero.unsqueeze(-1)).clamp_(0, (1 << bits) - 1)
        bias = 0.0 - zero * scale  # exact; +0.0 (not -0.0) when zero == 0
    q = q.reshape(rows, k).to(torch.uint8)
    return pack_bits(q, bits), scale, bias


def quantize_weight(w: torch.Tensor, config: QuantConfig, *, name: str = "<tensor>",
                    importance: Optional[torch.Tensor] = None):
    """Quantize a 1-D, 2-D [out, in] or 3-D [experts, out, in] float weight along its last
    (input) dimension into the container of ``config.format`` (looked up in the format
    registry, llmq.quant.formats): a GroupQuantizedWeight for "int", FP8Weight, MXWeight or
    NVFP4Weight for the floating-point formats.

    importance: optional positive weights [K], one per input channel (e.g. the mean squared
    activation of each input feature over a calibration text, the imatrix idea); methods "hqq"
    and "search" then minimise the importance-weighted error (llmq.quant.hqq,
    llmq.quant.search). Other methods refuse it."""
    if not isinstance(config, QuantConfig):
        raise ValueError(f"{name}: expected a QuantConfig, got {type(config).__name__}")
    if importance is not None:
        if not takes_importance(config):
            raise ValueError(f"{name}: importance weights apply to format 'int' with method 'hqq' or 'search' only, got {config.describe()!r}")
        return get_format(config.format).quantize(w, config, name=name, importance=importance)
    return get_format(config.format).quantize(w, config, name=name)


def takes_importance(config: QuantConfig) -> bool:
    """Whether quantize_weight(..., importance=) applies to `config`: its method is one of its
    format's `importance_methods` (format "int", method "hqq" or "search")."""
    return config.method in get_format(config.format).importance_methods


def _check_importance(importance, k: int, name: str) -> torch.Tensor:
    if not isinstance(importance, torch.Tensor) or importance.dim() != 1 or importance.shape[0] != k:
        got = list(importance.shape) if isinstance(importance, torch.Tensor) else type(importance).__name__
        raise ValueError(f"{name}: importance must be a 1-D tensor of K={k} values (one per input channel), got {got}")
    imp = importance.detach().to(device="cpu", dtype=torch.float32)
    if not bool((torch.isfinite(imp) & (imp > 0)).all()):
        raise ValueError(f"{name}: importance must be finite and > 0 everywhere (add a small floor to zero channels)")
    return imp.contiguous()


def quantize_int_weight(w: torch.Tensor, config: QuantConfig, *, name: str = "<tensor>",
                        importance: Optional[torch.Tensor] = None) -> GroupQuantizedWeight:
    """The "int" family's quantizer: group-wise along the last dimension into the canonical
    GroupQuantizedWeight, through the compiled kernel when it applies (same bytes)."""
    gs = _check_weight(w, config, name)
    if importance is not None:
        importance = _check_importance(importance, w.shape[-1], name)
    parts = None
    # None from the kernel means a NaN/Inf or an overflowing range: the reference path below
    # raises the matching error, naming the tensor and the first bad element. The kernels choose
    # float32 scales; 16-bit ones go the torch way (llmq.quant.scale_rounding).
    kernel = config.scale_dtype == torch.float32 and _native.applicable(w)
    if config.method == "minmax" and importance is None and kernel:
        parts = _native.quantize_rows(w.detach().reshape(-1, w.shape[-1]), config.bits, gs, config.symmetric)
    elif config.method == "search" and kernel and _native.search_quantize_available():
        parts = _native.search_quantize_rows(w.detach().reshape(-1, w.shape[-1]), config.bits, gs,
                                             config.symmetric, importance=importance)
    if parts is None:
        parts = _quantize_torch(w, config, gs, name, importance)
    return _assemble(w, config, gs, parts)


def quantize_weight_torch(w: torch.Tensor, config: QuantConfig, *, name: str = "<tensor>") -> GroupQuantizedWeight:
    """quantize_weight for integer formats by the torch reference path only (never the
    compiled kernel): what the kernel is tested against, bit for bit."""
    if isinstance(config, QuantConfig) and not isinstance(get_format(config.format), IntAffineFormat):
        raise ValueError(f"{name}: quantize_weight_torch handles integer formats only, got {config.format!r}")
    gs = _check_weight(w, config, name)
    return _assemble(w, config, gs, _quantize_torch(w, config, gs, name))


def _quantize_torch(w: torch.Tensor, config: QuantConfig, gs: int, name: str, importance: Optional[torch.Tensor] = None):
    """The torch reference over all rows of w, chunk by chunk: (qdata, scale, bias) as [R, ...]."""
    k = w.shape[-1]
    rows = w.detach().reshape(-1, k)
    small = config.method != "minmax" or config.scale_dtype != torch.float32
    step = max(1, (_SEARCH_CHUNK_ELEMENTS if small else _CHUNK_ELEMENTS) // k)
    try:
        parts = [_quantize_rows(rows[i : i + step].to(device="cpu", dtype=torch.float32), config, gs, name, importance) for i in range(0, rows.shape[0], step)]
    except _NotFinite:
        parts = None
    if parts is None:  # raised outside the except block, so the traceback stays clean
        _raise_not_finite(w, name)
    return tuple(torch.cat([p[j] for p in parts]) if len(parts) > 1 else parts[0][j] for j in range(3))


def _assemble(w: torch.Tensor, config: QuantConfig, gs: int, parts) -> GroupQuantizedWeight:
    """Reshape row-major (qdata, scale, bias) back to w's leading dimensions."""
    shape = tuple(w.shape)
    lead = shape[:-1] if len(shape) >= 2 else (1,)
    qdata, scale, bias = parts
    return GroupQuantizedWeight(
        qdata=qdata.reshape(*lead, -1).contiguous(),
        scale=scale.reshape(*lead, -1).contiguous(),
        bias=bias.reshape(*lead, -1).contiguous(),
        bits=config.bits,
        group_size=gs,
        shape=shape,
        dtype=w.dtype,
    )


def dequantize(qw, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The float weight a quantized weight of any registered format stands for, exact in
    float32 (integer: scale*q + bias in float64, rounded once), then cast to `dtype` (default:
    the dtype the weight was quantized from)."""
    fmt = format_of(qw)
    if fmt is None:
        raise ValueError(f"dequantize expects a quantized weight (GroupQuantizedWeight, FP8Weight, MXWeight, NVFP4Weight, ...), got {type(qw).__name__}")
    return fmt.dequantize(qw, qw.dtype if dtype is None else dtype)
