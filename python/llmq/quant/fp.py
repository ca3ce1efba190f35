"""Floating-point weight formats: FP8 (e4m3), MXFP8, MXFP4 and NVFP4, and their exact dequantize.

These sit beside the canonical integer form (formats.py): a float code cannot be written as
``scale*q + bias`` with integer q, so each FP format has its own small, inspectable container.
Every container keeps the logical shape [..., N, K] (1-D [K], 2-D [N, K] and stacked experts
[E, N, K]); K is the input dimension, along which blocks run. See docs/export.md.

Canonical forms
---------------
* ``FP8Weight``: ``data`` float8_e4m3fn [..., N, K]; ``scale`` float32, multiplicative
  (w = data * scale), one of
    - "tensor":   shape[:-2] (0-dim for 1-D/2-D; one per expert for 3-D), scale = amax / 448
    - "channel":  shape[:-1] + (1,)  ([N, 1] for 2-D), scale = row amax / 448
    - "block128": shape[:-2] + (N/128, K/128), scale = 128x128 tile amax / 448 (DeepSeek-V3 /
      compressed-tensors "block" layout; N and K must be multiples of 128).
  An all-zero tensor/row/tile gets scale 1.0 (so the stored scale is always positive, finite).
* ``MXWeight`` (OCP microscaling, block 32 along K): ``scale_e8m0`` uint8 [..., K/32] holding the
  biased exponent e+127 (value 2**e); ``codes`` uint8: for "mxfp4" E2M1 codes packed two per byte
  [..., K/2] (element 2i in the low nibble, sign in bit 3), for "mxfp8" the e4m3 bytes [..., K].
  e = ceil(log2(amax / Emax)) with Emax = 6 (E2M1) or 448 (E4M3), computed exactly (the rule
  ModelOpt and MLX share; it never clips, unlike the OCP floor rule), clamped to [-127, 127];
  an all-zero block gets e = -127 (byte 0).
* ``NVFP4Weight`` (block 16 along K): ``codes`` uint8 [..., K/2] as for MXFP4; ``block_scale``
  float8_e4m3fn [..., K/16]; ``global_scale`` float32 shape[:-2] (ModelOpt's ``weight_scale_2``):
  g = amax / (6*448), s = e4m3(clamp(block_amax / (6*g), 2**-9, 448)), all-zero blocks s = 1.0,
  an all-zero tensor g = 1.0. This is ModelOpt's rule byte for byte (compressed-tensors stores
  1/g as ``weight_global_scale``).

Rounding: element codes are round-to-nearest, ties-to-even (OCP), on ``w.float() / scale``
computed in float32 then clamped to +-Emax. Values that round to zero get code +0.

Dequantize (``dequantize_fp``) returns float32 and is exact: FP8 ``data * scale`` and the MX
``value * 2**e`` are single correctly-rounded (MX: exact) float32 products; NVFP4 is evaluated
in the order every reader uses (ModelOpt, vLLM, TensorRT-LLM): ``value * (float(s) * g)``, two
float32 roundings, so our numbers equal theirs bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import torch

from llmq.quant import _native_fp

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
MX_BLOCK = 32
NVFP4_BLOCK = 16
FP8_BLOCK = 128
FP8_GRANULARITIES = ("tensor", "channel", "block128")
E8M0_BIAS = 127

# E2M1 magnitudes by 3-bit code (bit 3 of a 4-bit code is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive magnitudes; a tie rounds to the even code.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# Containers
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FP8Weight:
    """An e4m3 weight with float32 multiplicative scales (see module docstring for shapes)."""

    data: torch.Tensor  # float8_e4m3fn [..., N, K]
    scale: torch.Tensor  # float32, shape set by granularity
    granularity: str  # "tensor" | "channel" | "block128"
    dtype: torch.dtype = torch.bfloat16  # the original weight's dtype

    def __post_init__(self):
        if self.granularity not in FP8_GRANULARITIES:
            raise ValueError(f"FP8Weight.granularity={self.granularity!r}; expected one of {FP8_GRANULARITIES}")
        if self.data.dtype != torch.float8_e4m3fn:
            raise ValueError(f"FP8Weight.data must be float8_e4m3fn, got {self.data.dtype}")
        expect = fp8_scale_shape(tuple(self.data.shape), self.granularity)
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != expect:
            raise ValueError(f"FP8Weight.scale must be float32 {list(expect)}, got {self.scale.dtype} {list(self.scale.shape)}")

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def format(self) -> str:
        return "fp8"


@dataclasses.dataclass(frozen=True)
class MXWeight:
    """An OCP microscaling weight: E2M1 (mxfp4) or E4M3 (mxfp8) codes, E8M0 scale per 32."""

    codes: torch.Tensor  # uint8 [..., K/2] (mxfp4) or [..., K] (mxfp8)
    scale_e8m0: torch.Tensor  # uint8 [..., K/32], biased exponent
    fmt: str  # "mxfp4" | "mxfp8"
    shape: Tuple[int, ...]  # logical [..., N, K]
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        if self.fmt not in MX_FORMATS:
            raise ValueError(f"MXWeight.fmt={self.fmt!r}; expected one of {MX_FORMATS}")
        lead, k = tuple(self.shape[:-1]), self.shape[-1]
        row = k * MX_ELEMENTS[self.fmt].bits // 8
        if k % MX_BLOCK or self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != lead + (row,):
            raise ValueError(f"MXWeight.codes must be uint8 {list(lead + (row,))} for shape {list(self.shape)}"
                             f", got {self.codes.dtype} {list(self.codes.shape)}")
        if self.scale_e8m0.dtype != torch.uint8 or tuple(self.scale_e8m0.shape) != lead + (k // MX_BLOCK,):
            raise ValueError(f"MXWeight.scale_e8m0 must be uint8 {list(lead + (k // MX_BLOCK,))}, got {self.scale_e8m0.dtype} {list(self.scale_e8m0.shape)}")

    @property
    def format(self) -> str:
        return self.fmt


@dataclasses.dataclass(frozen=True)
class NVFP4Weight:
    """NVIDIA FP4: E2M1 codes, e4m3 scale per 16, float32 global scale (ModelOpt weight_scale_2)."""

    codes: torch.Tensor  # uint8 [..., K/2]
    block_scale: torch.Tensor  # float8_e4m3fn [..., K/16]
    global_scale: torch.Tensor  # float32 shape[:-2] (0-dim for 1-D/2-D)
    shape: Tuple[int, ...]
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        lead, k = tuple(self.shape[:-1]), self.shape[-1]
        if k % NVFP4_BLOCK or self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != lead + (k // 2,):
            raise ValueError(f"NVFP4Weight.codes must be uint8 {list(lead + (k // 2,))} for shape {list(self.shape)}"
                             f", got {self.codes.dtype} {list(self.codes.shape)}")
        if self.block_scale.dtype != torch.float8_e4m3fn or tuple(self.block_scale.shape) != lead + (k // NVFP4_BLOCK,):
            raise ValueError(f"NVFP4Weight.block_scale must be float8_e4m3fn {list(lead + (k // NVFP4_BLOCK,))}"
                             f", got {self.block_scale.dtype} {list(self.block_scale.shape)}")
        expect = tuple(self.shape[:-2])
        if self.global_scale.dtype != torch.float32 or tuple(self.global_scale.shape) != expect:
            raise ValueError(f"NVFP4Weight.global_scale must be float32 {list(expect)}, got {self.global_scale.dtype} {list(self.global_scale.shape)}")

    @property
    def format(self) -> str:
        return "nvfp4"


# --------------------------------------------------------------------------------------------
# Element codecs
# --------------------------------------------------------------------------------------------


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round float32 x (already scaled) to 4-bit E2M1 codes: nearest value, ties to the even
    code (OCP), magnitudes above 6 saturate to 6, and values that round to zero get +0.

    The code of |x| is the number of midpoints it lies above; a tie counts as "above" only
    when the upper neighbour has the even code (0.75, 1.75, 3.5), which is round-half-even.
    """
    mag = x.abs()
    code = (mag > _E2M1_MIDPOINTS[0]).to(torch.uint8)
    for i, mid in enumerate(_E2M1_MIDPOINTS[1:], start=1):
        code += (mag >= mid) if i % 2 else (mag > mid)
    sign = ((x < 0) & (code != 0)).to(torch.uint8) << 3
    return code | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8 values 0..15) -> float32 values."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    return table[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> [..., K/2], element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_fp4: [..., K/2] -> [..., K]."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e8m0_decode(scale_e8m0: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponent bytes -> float32 powers of two (0xFF, NaN in OCP, is rejected)."""
    if bool((scale_e8m0 == 0xFF).any()):
        raise ValueError("E8M0 scale byte 0xFF (NaN) found")
    # Byte b in 1..254 is the float32 bit pattern b << 23; byte 0 is the subnormal 2**-127.
    bits = torch.where(scale_e8m0 == 0, torch.tensor(0x00400000, dtype=torch.int32), scale_e8m0.to(torch.int32) << 23)
    return bits.view(torch.float32)


def mx_exponent(amax: torch.Tensor, emax: float) -> torch.Tensor:
    """Exact ceil(log2(amax / emax)) clamped to [-127, 127]; -127 where amax == 0.

    Evaluated in float64 with frexp (amax/emax is then exact or safely away from a power of
    two), instead of a float32 log2 that can land on an integer just above a power of two.
    """
    ratio = amax.to(torch.float64) / emax
    mant, exp = torch.frexp(ratio)  # ratio = mant * 2**exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)
    e = torch.where(amax > 0, e, torch.full_like(e, -E8M0_BIAS))
    return e.clamp(-E8M0_BIAS, E8M0_BIAS)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _check_input(w: torch.Tensor, name: str, block: int, what: str) -> None:
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: {what} needs a float32/bfloat16/float16 weight, got dtype {w.dtype}")
    if not 1 <= w.dim() <= 3:
        raise ValueError(f"{name}: expected a 1-D, 2-D or 3-D ([experts, out, in]) weight, got shape {list(w.shape)}")
    if w.numel() == 0:
        raise ValueError(f"{name}: cannot quantize an empty weight of shape {list(w.shape)}")
    if w.shape[-1] % block:
        raise ValueError(f"{name}: {what} needs the input dimension K={w.shape[-1]} to be a multiple of {block} (shape {list(w.shape)})")
    finite = torch.isfinite(w)
    if not bool(finite.all()):
        first = (~finite).nonzero()[0].tolist()
        raise ValueError(f"{name}: weight has {int((~finite).sum())} NaN/Inf value(s), first at index {first}")


def fp8_scale_shape(shape: Tuple[int, ...], granularity: str) -> Tuple[int, ...]:
    """Shape of an FP8 scale for a weight of `shape` (see module docstring)."""
    if granularity == "tensor":
        return tuple(shape[:-2])
    if granularity == "channel":
        return tuple(shape[:-1]) + (1,)
    if granularity == "block128":
        return tuple(shape[:-2]) + (shape[-2] // FP8_BLOCK, shape[-1] // FP8_BLOCK)
    raise ValueError(f"FP8 granularity {granularity!r} unknown; expected one of {FP8_GRANULARITIES}")


# --------------------------------------------------------------------------------------------
# Quantizers
# --------------------------------------------------------------------------------------------


# Quantize this many elements at a time: the temporaries of a chunk stay in cache and peak
# memory stays a small multiple of the output instead of ~10x a large input.
_CHUNK_ELEMENTS = 1 << 20


def _row_chunks(rows: int, k: int):
    step = max(1, _CHUNK_ELEMENTS // k)
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _fp8_cast(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


@dataclasses.dataclass(frozen=True)
class MXElement:
    """What an MX format's element type decides: its width, its largest magnitude (Emax) and how
    values already divided by their block scale become uint8 codes [..., K*bits/8] and back."""

    bits: int
    emax: float
    encode: Callable[[torch.Tensor], torch.Tensor]
    decode: Callable[[torch.Tensor], torch.Tensor]  # codes -> float32 [..., K]


MX_ELEMENTS = {
    "mxfp4": MXElement(4, FP4_E2M1_MAX, lambda x: pack_fp4(e2m1_encode(x)), lambda c: e2m1_decode(unpack_fp4(c))),
    "mxfp8": MXElement(8, FP8_E4M3_MAX, lambda x: _fp8_cast(x).view(torch.uint8),
                       lambda c: c.view(torch.float8_e4m3fn).float()),
}
MX_FORMATS = tuple(MX_ELEMENTS)  # ("mxfp4", "mxfp8")


def _positive(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_fp8(w: torch.Tensor, granularity: str = "tensor", *, name: str = "<tensor>", scale: Optional[torch.Tensor] = None) -> FP8Weight:
    """FP8 e4m3 with scale = amax/448 per tensor (per expert for 3-D), per row or per 128x128 tile.

    `scale` overrides the computed one (e.g. a scale shared by fused q/k/v siblings); it must
    have the granularity's shape and be positive.
    """
    native = _native_fp.quantize_fp8(w, granularity, scale)  # same bytes, compiled; None: use the reference below
    if native is not None:
        return FP8Weight(data=native[0], scale=native[1], granularity=granularity, dtype=w.dtype)
    if granularity not in FP8_GRANULARITIES:
        raise ValueError(f"{name}: FP8 granularity {granularity!r} unknown; expected one of {FP8_GRANULARITIES}")
    _check_input(w, name, FP8_BLOCK if granularity == "block128" else 1, f"FP8 {granularity}")
    k = w.shape[-1]
    rows = w.reshape(-1, k)
    data = torch.empty(rows.shape, dtype=torch.float8_e4m3fn)
    if granularity == "block128":
        if w.dim() < 2 or w.shape[-2] % FP8_BLOCK:
            raise ValueError(f"{name}: FP8 block128 needs a 2-D/3-D weight with N and K multiples of {FP8_BLOCK}, got shape {list(w.shape)}"
                             " (pad the weight first)")
        n = w.shape[-2]
        bands = rows.reshape(-1, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)  # [bands, 128, K/128, 128]
        if scale is None:
            amax = bands.abs().amax(dim=(1, 3)).float()  # |bf16| and max are exact
            scale = _positive(amax / FP8_E4M3_MAX).reshape(*w.shape[:-2], n // FP8_BLOCK, k // FP8_BLOCK)
        scale = _check_scale(scale, fp8_scale_shape(tuple(w.shape), granularity), name)
        band_scale = scale.reshape(-1, k // FP8_BLOCK)
        step = max(1, _CHUNK_ELEMENTS // (FP8_BLOCK * k))
        for a in range(0, bands.shape[0], step):
            x = bands[a : a + step].float()
            data.view(-1, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)[a : a + step] = _fp8_cast(x / band_scale[a : a + step, None, :, None])
    else:
        if scale is None:
            if granularity == "channel":
                amax = w.abs().amax(dim=-1, keepdim=True)
            elif w.dim() == 3:
                amax = w.abs().amax(dim=(-2, -1))
            else:
                amax = w.abs().amax()
            scale = _positive(amax.float() / FP8_E4M3_MAX)
        scale = _check_scale(scale, fp8_scale_shape(tuple(w.shape), granularity), name)
        if granularity == "channel":
            row_scale = scale.reshape(-1)
        else:
            row_scale = scale.reshape(-1, 1).expand(-1, rows.shape[0] // scale.numel()).reshape(-1)
        for a, b in _row_chunks(rows.shape[0], k):
            data[a:b] = _fp8_cast(rows[a:b].float() / row_scale[a:b, None])
    data = data.reshape(w.shape)
    scale = _check_scale(scale, fp8_scale_shape(tuple(w.shape), granularity), name)
    return FP8Weight(data=data, scale=scale, granularity=granularity, dtype=w.dtype)


def _check_scale(scale: torch.Tensor, expect: Tuple[int, ...], name: str) -> torch.Tensor:
    scale = torch.as_tensor(scale, dtype=torch.float32)
    if tuple(scale.shape) != expect:
        raise ValueError(f"{name}: scale must have shape {list(expect)}, got {list(scale.shape)}")
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise ValueError(f"{name}: scales must be finite and positive")
    return scale.contiguous()


def quantize_mx(w: torch.Tensor, fmt: str, *, name: str = "<tensor>") -> MXWeight:
    """MXFP4 / MXFP8: E8M0 scale 2**ceil(log2(amax/Emax)) per 32 elements along K."""
    native = _native_fp.quantize_mx(w, fmt)  # same bytes, compiled; None: use the reference below
    if native is not None:
        return MXWeight(codes=native[0], scale_e8m0=native[1], fmt=fmt, shape=tuple(w.shape), dtype=w.dtype)
    element = MX_ELEMENTS.get(fmt)
    if element is None:
        raise ValueError(f"{name}: MX format {fmt!r} unknown; expected one of {MX_FORMATS}")
    _check_input(w, name, MX_BLOCK, fmt.upper())
    k = w.shape[-1]
    rows = w.reshape(-1, k)
    codes = torch.empty((rows.shape[0], k * element.bits // 8), dtype=torch.uint8)
    scales = torch.empty((rows.shape[0], k // MX_BLOCK), dtype=torch.uint8)
    for a, b in _row_chunks(rows.shape[0], k):
        x = rows[a:b].float().reshape(b - a, k // MX_BLOCK, MX_BLOCK)
        e8 = (mx_exponent(x.abs().amax(dim=-1), element.emax) + E8M0_BIAS).to(torch.uint8)
        scaled = (x / e8m0_decode(e8).unsqueeze(-1)).reshape(b - a, k)  # exact: a power of two
        codes[a:b] = element.encode(scaled)
        scales[a:b] = e8
    lead = tuple(w.shape[:-1])
    return MXWeight(codes=codes.reshape(lead + (codes.shape[-1],)), scale_e8m0=scales.reshape(lead + (k // MX_BLOCK,)),
                    fmt=fmt, shape=tuple(w.shape), dtype=w.dtype)


def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """ModelOpt's weight_scale_2: amax / (6*448) in float32, per expert for 3-D; 1.0 if amax == 0."""
    x = w.abs()  # exact in the weight's own dtype
    amax = (x.amax(dim=(-2, -1)) if w.dim() == 3 else x.amax()).float()
    return _positive(amax / (FP4_E2M1_MAX * FP8_E4M3_MAX))


def quantize_nvfp4(w: torch.Tensor, *, name: str = "<tensor>", global_scale: Optional[torch.Tensor] = None) -> NVFP4Weight:
    """NVFP4 by ModelOpt's rule. `global_scale` overrides g (fused siblings share one, the
    max of their own); blocks whose scale would exceed 448 are clamped, never NaN."""
    native = _native_fp.quantize_nvfp4(w, global_scale)  # same bytes, compiled; None: use the reference below
    if native is not None:
        codes, block_scale, g = native
        return NVFP4Weight(codes=codes, block_scale=block_scale, global_scale=g, shape=tuple(w.shape), dtype=w.dtype)
    _check_input(w, name, NVFP4_BLOCK, "NVFP4")
    g = nvfp4_global_scale(w) if global_scale is None else _check_scale(global_scale, tuple(w.shape[:-2]), name)
    k = w.shape[-1]
    rows = w.reshape(-1, k)
    # The global scale of each row (one per expert for stacked [E, N, K] weights).
    per_row = g.reshape(-1, 1).expand(-1, rows.shape[0] // g.numel()).reshape(-1) if g.dim() else g.expand(rows.shape[0])
    codes = torch.empty((rows.shape[0], k // 2), dtype=torch.uint8)
    block_scale = torch.empty((rows.shape[0], k // NVFP4_BLOCK), dtype=torch.float8_e4m3fn)
    for a, b in _row_chunks(rows.shape[0], k):
        x = rows[a:b].float().reshape(b - a, k // NVFP4_BLOCK, NVFP4_BLOCK)
        gr = per_row[a:b].reshape(-1, 1)
        s = x.abs().amax(dim=-1) / (FP4_E2M1_MAX * gr)
        s = torch.where(s == 0, torch.ones_like(s), s)
        s8 = s.clamp(2.0**-9, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        scaled = x / (s8.float() * gr).unsqueeze(-1)
        codes[a:b] = pack_fp4(e2m1_encode(scaled.reshape(b - a, k)))
        block_scale[a:b] = s8
    lead = tuple(w.shape[:-1])
    return NVFP4Weight(
        codes=codes.reshape(lead + (k // 2,)),
        block_scale=block_scale.reshape(lead + (k // NVFP4_BLOCK,)),
        global_scale=g.contiguous(),
        shape=tuple(w.shape),
        dtype=w.dtype,
    )


# --------------------------------------------------------------------------------------------
# Dequantize
# --------------------------------------------------------------------------------------------


def dequantize_fp(w, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact float32 values of an FP8Weight / MXWeight / NVFP4Weight (see module docstring),
    then cast to dtype."""
    if isinstance(w, FP8Weight):
        x = w.data.float()
        if w.granularity == "block128":
            n, k = w.shape[-2:]
            tiles = x.reshape(*w.shape[:-2], n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
            out = (tiles * w.scale[..., :, None, :, None]).reshape(w.shape)
        elif w.granularity == "channel":
            out = x * w.scale
        else:
            out = x * w.scale.reshape(w.scale.shape + (1,) * min(2, x.dim()))
    elif isinstance(w, MXWeight):
        k = w.shape[-1]
        values = MX_ELEMENTS[w.fmt].decode(w.codes).reshape(*w.shape[:-1], k // MX_BLOCK, MX_BLOCK)
        out = (values * e8m0_decode(w.scale_e8m0).unsqueeze(-1)).reshape(w.shape)
    elif isinstance(w, NVFP4Weight):
        k = w.shape[-1]
        values = e2m1_decode(unpack_fp4(w.codes)).reshape(*w.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK)
        g = w.global_scale.reshape(w.global_scale.shape + (1,) * (len(w.shape) - 1 if len(w.shape) >= 2 else 1))
        out = (values * (w.block_scale.float() * g).unsqueeze(-1)).reshape(w.shape)
    else:
        raise TypeError(f"dequantize_fp: expected FP8Weight, MXWeight or NVFP4Weight, got {type(w).__name__}")
    return out.to(dtype)


# --------------------------------------------------------------------------------------------
# Recipe adapter
# --------------------------------------------------------------------------------------------

FP_FORMATS = ("fp8", "mxfp8", "mxfp4", "nvfp4")


def fp8_granularity_for(group_size: Optional[int]) -> str:
    """Map a recipe's group_size to an FP8 granularity: None/-1 -> per channel, 0 -> per
    tensor, 128 -> 128x128 blocks (group_size is otherwise meaningless for FP8)."""
    if group_size in (None, -1):
        return "channel"
    if group_size == 0:
        return "tensor"
    if group_size == FP8_BLOCK:
        return "block128"
    raise ValueError(f"FP8 group_size={group_size} unsupported; use 0 (per tensor), None/-1 (per channel) or 128 (128x128 blocks)")


def quantize_fp_weight(w: torch.Tensor, config, *, name: str = "<tensor>"):
    """Quantize w per a recipe config (anything with .format and .group_size; FP8 also reads
    an optional .granularity) through the format registry. Returns FP8Weight, MXWeight or
    NVFP4Weight."""
    fmt = getattr(config, "format", None)
    if fmt not in FP_FORMATS:
        raise ValueError(f"{name}: format {fmt!r} is not a floating-point format; expected one of {FP_FORMATS}")
    from llmq.quant.formats import get_format  # the registry imports this module

    return get_format(fmt).quantize(w, config, name=name)
