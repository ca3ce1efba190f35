"""Canonical group-wise integer weights -> MLX "affine" quantized tensors.

MLX's affine mode stores, per quantized module, three tensors:

    weight  uint32 [..., N, K*bits/32]   q packed LSB-first, little-endian words
    scales  float  [..., N, K/group_size]
    biases  float  [..., N, K/group_size]      w = scales * q + biases

which is bit-for-bit the canonical convention of `llmq.quant.formats` (unsigned q,
LSB-first bit stream along K, additive bias). Packing is therefore a zero-copy *view*
of the canonical bytes as little-endian uint32 words, for every bit width MLX has
(2, 3, 4, 5, 6, 8), plus, where needed, regrouping (see `regroup.py`).

What MLX cannot represent is rejected loudly: 7-bit weights, group sizes other than
32/64/128 that are not an exact repetition of one, and K not divisible by 32.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Dict, Optional, Sequence, Tuple

import torch

from llmq.quant.formats import GroupQuantizedWeight, dequantize_canonical, first_of_alike, unpack_bits

from .regroup import (  # regroup imports nothing from here: no import cycle
    MLX_BITS,
    MLX_GROUP_SIZES,
    fallback_params,
    mlx_group_size_for,
    regroup,
    requantize_affine,
)

MLX_SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP_MODES = ("mxfp4", "mxfp8", "nvfp4")
# MLX's FP modes: (bits, group_size), each mode has exactly one.
FP_MODE_PARAMS = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}
# Why an nvfp4 weight with a global scale is not written (MLX's nvfp4 stores the block scales alone):
# the one line such a weight gets. The MLX backend quantizes nvfp4 with granularity "block" (g = 1).
NVFP4_GLOBAL_SCALE_REFUSAL = ("MLX's nvfp4 QuantizedLinear holds e4m3 scales per 16 but no per-tensor global "
                              "scale, so an nvfp4 weight is written only with global scale 1 (QuantConfig "
                              "granularity 'block', what --backend mlx quantizes nvfp4 with)")


@dataclasses.dataclass(frozen=True)
class MLXQuantizedWeight:
    """One MLX affine-quantized tensor, ready to be saved as `<module>.weight/.scales/.biases`.

    Leading dimensions are kept: stacked MoE experts are `[E, N, K*bits/32]` with
    `[E, N, K/group_size]` scales, the shape `mx.gather_qmm` and mlx-lm's
    `QuantizedSwitchLinear` take.
    """

    weight: torch.Tensor  # uint32 [..., N, K*bits/32]
    scales: torch.Tensor  # [..., N, K/group_size], float32 / float16 / bfloat16; uint8 (E8M0) in the FP modes
    biases: Optional[torch.Tensor]  # same shape and dtype as scales; None in the FP modes
    bits: int
    group_size: int
    shape: Tuple[int, ...]  # logical [..., N, K]
    mode: str = "affine"

    def __post_init__(self):
        if self.mode == "affine":
            _check_mlx_params(self.bits, self.group_size, self.shape[-1], what="MLXQuantizedWeight")
        elif (self.bits, self.group_size) != FP_MODE_PARAMS.get(self.mode):
            raise ValueError(f"MLXQuantizedWeight: mode {self.mode!r} takes (bits, group_size) "
                             f"{FP_MODE_PARAMS.get(self.mode)}, got {(self.bits, self.group_size)}")
        k = self.shape[-1]
        lead = tuple(self.shape[:-1])
        want_w = lead + (k * self.bits // 32,)
        want_s = lead + (k // self.group_size,)
        if self.weight.dtype != torch.uint32 or tuple(self.weight.shape) != want_w:
            raise ValueError(f"weight must be uint32 {list(want_w)}, got {self.weight.dtype} {list(self.weight.shape)}")
        if self.mode != "affine":
            if self.scales.dtype != torch.uint8 or tuple(self.scales.shape) != want_s or self.biases is not None:
                raise ValueError(f"mode {self.mode!r}: scales must be uint8 {list(want_s)} and no biases, got "
                                 f"{self.scales.dtype} {list(self.scales.shape)}")
            return
        for name in ("scales", "biases"):
            t = getattr(self, name)
            if t is None or t.dtype not in MLX_SCALE_DTYPES or tuple(t.shape) != want_s:
                raise ValueError(f"{name} must be a float tensor {list(want_s)}, got "
                                 f"{None if t is None else (t.dtype, list(t.shape))}")
        if self.scales.dtype != self.biases.dtype:
            raise ValueError("scales and biases must share a dtype")

    @property
    def quant_params(self) -> Dict[str, object]:
        """This tensor's entry for config.json "quantization"."""
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales, self.biases) if t is not None)

    def named_tensors(self, module_path: str) -> Dict[str, torch.Tensor]:
        """The safetensors entries mlx-lm expects for the module at `module_path`."""
        out = {f"{module_path}.weight": self.weight, f"{module_path}.scales": self.scales}
        if self.biases is not None:
            out[f"{module_path}.biases"] = self.biases
        return out

    def to_mx(self):
        """(weight, scales, biases) as mlx.core arrays (imports mlx lazily); biases None in the FP modes."""
        return tuple(None if t is None else torch_to_mx(t) for t in (self.weight, self.scales, self.biases))


def _check_mlx_params(bits: int, group_size: int, k: int, what: str) -> None:
    if bits not in MLX_BITS:
        raise ValueError(f"{what}: MLX affine has no {bits}-bit mode; supported bits are {MLX_BITS}")
    if group_size not in MLX_GROUP_SIZES:
        raise ValueError(f"{what}: MLX affine group_size must be one of {MLX_GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise ValueError(f"{what}: group_size={group_size} does not divide K={k}")


def pack_mlx_affine(
    w: GroupQuantizedWeight,
    *,
    group_size: Optional[int] = None,
    scale_dtype: torch.dtype = torch.float32,
    requantize_from: Optional[torch.Tensor] = None,
    name: str = "weight",
) -> MLXQuantizedWeight:
    """Canonical weight -> MLX affine, exactly (with the default float32 scales).

    `group_size` picks the MLX group (default: the largest legal one that the
    canonical group is an exact repetition of, see `regroup.mlx_group_size_for`).
    `scale_dtype` float16/bfloat16 halves the metadata but rounds scales and biases:
    the result is then no longer bit-exact (that is the caller's explicit choice).
    If MLX cannot represent `w` (7 bits, group 16, a group no legal size divides) this
    raises, unless the caller passes the high-precision weight as `requantize_from`:
    then it is re-quantized at the nearest legal (bits, group) (see
    `regroup.fallback_params`). `name` labels error messages.
    """
    if scale_dtype not in MLX_SCALE_DTYPES:
        raise ValueError(f"{name}: scale_dtype must be one of {MLX_SCALE_DTYPES}, got {scale_dtype}")
    try:
        if w.bits not in MLX_BITS:
            raise ValueError(
                f"{name}: MLX affine has no {w.bits}-bit mode (supported: {MLX_BITS}); pass requantize_from="
                f"<high-precision weight> to re-quantize, or choose another recipe"
            )
        target = mlx_group_size_for(w.group_size, w.shape[-1], name=name) if group_size is None else group_size
        w = regroup(w, target, name=name)
    except ValueError as err:
        if requantize_from is None:
            raise
        if tuple(requantize_from.shape) != tuple(w.shape):
            raise ValueError(
                f"{name}: requantize_from has shape {list(requantize_from.shape)}, the weight is {list(w.shape)}"
            ) from err
        bits, gs = fallback_params(w.bits, w.group_size, w.shape[-1], name=name)
        w = requantize_affine(requantize_from, bits, group_size if group_size is not None else gs, name=name)
    _check_mlx_params(w.bits, w.group_size, w.shape[-1], what=name)
    return MLXQuantizedWeight(
        weight=canonical_bytes_as_uint32(w.qdata, name=name),
        scales=w.scale.to(scale_dtype),
        biases=w.bias.to(scale_dtype),
        bits=w.bits,
        group_size=w.group_size,
        shape=tuple(w.shape),
    )


def canonical_bytes_as_uint32(qdata: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """View the canonical uint8 bit stream [..., B] as MLX's uint32 words [..., B/4] (no copy).

    MLX reads word j of a row as bytes 4j..4j+3 in little-endian order, which on a
    little-endian host is exactly what a dtype view does. On a big-endian host the
    words are byte-swapped explicitly.
    """
    if qdata.dtype != torch.uint8:
        raise ValueError(f"{name}: packed data must be uint8, got {qdata.dtype}")
    if qdata.shape[-1] % 4:
        raise ValueError(f"{name}: a packed row of {qdata.shape[-1]} bytes is not a whole number of uint32 words")
    q = qdata.contiguous()
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        q = q.reshape(*q.shape[:-1], -1, 4).flip(-1).reshape(q.shape).contiguous()
    return q.view(torch.uint32)


def unpack_mlx_affine(m: MLXQuantizedWeight) -> GroupQuantizedWeight:
    """MLX affine -> canonical (the inverse of pack_mlx_affine at the MLX group size)."""
    q = m.weight.contiguous()
    by = q.view(torch.uint8)
    if sys.byteorder != "little":  # pragma: no cover
        by = by.reshape(*by.shape[:-1], -1, 4).flip(-1).reshape(by.shape).contiguous()
    return GroupQuantizedWeight(
        qdata=by.clone(),
        scale=m.scales.to(torch.float32),
        bias=m.biases.to(torch.float32),
        bits=m.bits,
        group_size=m.group_size,
        shape=tuple(m.shape),
    )


def stack_experts(experts: Sequence[MLXQuantizedWeight]) -> MLXQuantizedWeight:
    """Stack per-expert MLX weights [N, K'] into one `[E, N, K']` switch-layer weight.

    Every expert must share shape, bits, group size and scale dtype: mlx-lm's
    `QuantizedSwitchLinear` has one set of quantization parameters per layer.
    """
    first = first_of_alike(experts, lambda e: {"shape": e.shape, "bits": e.bits, "group_size": e.group_size,
                                               "mode": e.mode, "scales": e.scales.dtype})
    return MLXQuantizedWeight(
        weight=torch.stack([e.weight for e in experts]),
        scales=torch.stack([e.scales for e in experts]),
        biases=None if first.biases is None else torch.stack([e.biases for e in experts]),
        bits=first.bits,
        group_size=first.group_size,
        shape=(len(experts),) + tuple(first.shape),
        mode=first.mode,
    )


def pack_mlx_fp(w, *, name: str = "weight") -> MLXQuantizedWeight:
    """llmq's MX weight (llmq.quant.formats.mx.MXWeight) -> MLX "mxfp4" / "mxfp8", and llmq's NVFP4 weight
    with global scale 1 (llmq.quant.formats.nvfp4, granularity "block") -> MLX "nvfp4", exactly.

    MLX stores the same bytes: E2M1 codes two per byte (element 2i in the low nibble) or e4m3 bytes,
    read LSB-first as little-endian uint32 words, and the scale bytes per group as uint8 `scales`, no
    biases: E8M0 exponents (value 2**(e-127)) per 32, or nvfp4's e4m3 block scales per 16;
    `mx.dequantize(..., mode=...)` gives llmq's value in float32 (code * scale, exact). An nvfp4 weight
    with any global scale other than 1 is refused (NVFP4_GLOBAL_SCALE_REFUSAL); so is anything else.
    """
    fmt = getattr(w, "format", None)
    if fmt == "nvfp4":
        if not bool((w.global_scale == 1).all()):
            raise ValueError(f"{name}: {NVFP4_GLOBAL_SCALE_REFUSAL}")
        scales = w.block_scale.contiguous().view(torch.uint8)
    elif fmt in ("mxfp4", "mxfp8"):
        scales = w.scale_e8m0.contiguous()
    else:
        raise ValueError(f"{name}: MLX FP modes take llmq's mxfp4/mxfp8/nvfp4 weights, got {type(w).__name__}")
    bits, group = FP_MODE_PARAMS[fmt]
    return MLXQuantizedWeight(weight=canonical_bytes_as_uint32(w.codes, name=name), scales=scales,
                              biases=None, bits=bits, group_size=group, shape=tuple(w.shape), mode=fmt)


def dequantize_like_mlx(m: MLXQuantizedWeight) -> torch.Tensor:
    """w = scales*q + biases evaluated the way MLX's CPU kernel does: in float32, the
    product rounded, then the sum rounded (two roundings, no fused multiply-add).

    `mx.dequantize` equals this bit for bit. It can differ from
    `llmq.quant.formats.dequantize_canonical` (exact, one rounding) by the rounding of
    the product: |difference| <= ulp(scale*q)/2 per element.
    """
    g = unpack_mlx_affine(m)
    k = m.shape[-1]
    q = unpack_bits(g.qdata, m.bits, k).to(torch.float32)
    q = q.reshape(*q.shape[:-1], k // m.group_size, m.group_size)
    s = m.scales.to(torch.float32).unsqueeze(-1)
    b = m.biases.to(torch.float32).unsqueeze(-1)
    return (s * q + b).reshape(m.shape)


def torch_to_mx(t: torch.Tensor):
    """torch tensor -> mlx.core array (via numpy; bfloat16 travels as its bits)."""
    import mlx.core as mx

    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return mx.array(t.view(torch.uint16).numpy()).view(mx.bfloat16)
    return mx.array(t.numpy())


def exact_dequantize(m: MLXQuantizedWeight) -> torch.Tensor:
    """The exact (float64, one rounding) dequantization of an MLX weight, via the canonical form."""
    return dequantize_canonical(unpack_mlx_affine(m))
