"""The codecs every format family shares, one copy each: bit packing, the E2M1 and E8M0 element
codes, scale rounding and the checks a weight passes before it is quantized.

A leaf: it imports torch only, so any family module (llmq/quant/formats/*) and any method module
(search, hqq) can use it without an import cycle.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

# Weights a quantizer takes.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
E8M0_BIAS = 127

# --------------------------------------------------------------------------------------------
# Integer bit streams
# --------------------------------------------------------------------------------------------

SUPPORTED_BITS = (2, 3, 4, 5, 6, 7, 8)


def packed_row_bytes(k: int, bits: int) -> int:
    """Bytes one packed row of k elements occupies; k*bits must be a whole number of bytes."""
    if (k * bits) % 8:
        raise ValueError(f"{k} elements of {bits} bits do not fill whole bytes")
    return k * bits // 8


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned integers q[..., K] (any integer dtype, values < 2**bits) into the
    canonical LSB-first uint8 bit stream [..., K*bits/8]."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} unsupported; expected one of {SUPPORTED_BITS}")
    k = q.shape[-1]
    nbytes = packed_row_bytes(k, bits)
    if bits == 8:
        return q.to(torch.uint8).contiguous()
    if bits in (2, 4):
        per = 8 // bits
        v = q.to(torch.uint8).reshape(*q.shape[:-1], k // per, per)
        out = torch.zeros(v.shape[:-1], dtype=torch.uint8)
        for j in range(per):
            out |= v[..., j] << (j * bits)
        return out
    # General widths: lay out 8 elements (= `bits` bytes) at a time as one 64-bit word.
    if k % 8:
        raise ValueError(f"{bits}-bit packing needs K divisible by 8, got K={k}")
    v = q.to(torch.int64).reshape(*q.shape[:-1], k // 8, 8)
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for j in range(8):
        word |= v[..., j] << (j * bits)
    out = torch.stack([((word >> (8 * b)) & 0xFF) for b in range(bits)], dim=-1)
    return out.to(torch.uint8).reshape(*q.shape[:-1], nbytes)


def unpack_bits(qdata: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8 [..., K*bits/8] -> uint8 [..., K]."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} unsupported; expected one of {SUPPORTED_BITS}")
    if qdata.shape[-1] != packed_row_bytes(k, bits):
        raise ValueError(f"packed rows hold {qdata.shape[-1]} bytes, expected {packed_row_bytes(k, bits)} for K={k}")
    if bits == 8:
        return qdata.to(torch.uint8)
    mask = (1 << bits) - 1
    if bits in (2, 4):
        per = 8 // bits
        parts = [(qdata >> (j * bits)) & mask for j in range(per)]
        return torch.stack(parts, dim=-1).reshape(*qdata.shape[:-1], k)
    b = qdata.to(torch.int64).reshape(*qdata.shape[:-1], k // 8, bits)
    word = torch.zeros(b.shape[:-1], dtype=torch.int64)
    for j in range(bits):
        word |= b[..., j] << (8 * j)
    parts = [(word >> (j * bits)) & mask for j in range(8)]
    return torch.stack(parts, dim=-1).reshape(*qdata.shape[:-1], k).to(torch.uint8)


# --------------------------------------------------------------------------------------------
# Floating-point element codes
# --------------------------------------------------------------------------------------------

# E2M1 magnitudes by 3-bit code (bit 3 of a 4-bit code is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive magnitudes; a tie rounds to the even code.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


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


def fp8_cast(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn, saturating at +-448 (torch's cast would give NaN above it)."""
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


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
# Scales
# --------------------------------------------------------------------------------------------


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


def qparams_symmetric(xmin: torch.Tensor, xmax: torch.Tensor, bits: int) -> torch.Tensor:
    """torchao MappingType.SYMMETRIC scale from float32 group minima / maxima."""
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    min_neg = torch.clamp(xmin, max=0.0)
    max_pos = torch.clamp(xmax, min=0.0)
    amax = torch.max(-min_neg, max_pos)
    scale = amax / (float(qmax - qmin) / 2)
    return torch.clamp(scale, min=torch.finfo(torch.float32).smallest_normal)


def qparams_asymmetric(xmin: torch.Tensor, xmax: torch.Tensor, bits: int, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
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


def round_to_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 `t` rounded (to nearest, ties to even) to `dtype` and back to float32."""
    return t if dtype == torch.float32 else t.to(dtype).to(torch.float32)



def smallest_scale(dtype: torch.dtype) -> float:
    """The smallest positive scale written in `dtype` (float16: its smallest subnormal, 2^-24;
    bfloat16: its smallest normal, as float32's clamp)."""
    if dtype == torch.float16:
        return 2.0 ** -24
    return float(torch.finfo(dtype).tiny)


def positive_or_one(scale: torch.Tensor) -> torch.Tensor:
    """`scale` with 1.0 where it is not positive (an all-zero tensor, row or block)."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def check_scale(scale, expect: Tuple[int, ...], name: str) -> torch.Tensor:
    """A caller's scale as float32 of shape `expect`, finite and positive; ValueError naming `name`."""
    scale = torch.as_tensor(scale, dtype=torch.float32)
    if tuple(scale.shape) != expect:
        raise ValueError(f"{name}: scale must have shape {list(expect)}, got {list(scale.shape)}")
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise ValueError(f"{name}: scales must be finite and positive")
    return scale.contiguous()


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------


def check_weight(w, name: str, what: Optional[str] = None) -> None:
    """A float tensor of 1-3 dims ([experts, out, in] at most), not empty; ValueError naming `name`
    (and `what` needs it, e.g. "NVFP4")."""
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in FLOAT_DTYPES:
        need = f"{what} needs" if what else "expected"
        raise ValueError(f"{name}: {need} a float32/bfloat16/float16 weight, got dtype {w.dtype}")
    if not 1 <= w.dim() <= 3:
        raise ValueError(f"{name}: expected a 1-D, 2-D or 3-D ([experts, out, in]) weight, got shape {list(w.shape)}")
    if w.numel() == 0:
        raise ValueError(f"{name}: cannot quantize an empty weight of shape {list(w.shape)}")


def raise_not_finite(w: torch.Tensor, name: str) -> None:
    """Raise the error for a weight holding NaN/Inf: the first offending element (its index in
    w's own shape) and how many there are."""
    finite = torch.isfinite(w.detach())
    bad = (~finite).nonzero()[0].tolist()
    raise ValueError(f"{name}: weight has {int((~finite).sum())} NaN/Inf value(s), first at index {bad}")


def check_finite(w: torch.Tensor, name: str) -> None:
    """raise_not_finite unless every element of w is finite."""
    if not bool(torch.isfinite(w).all()):
        raise_not_finite(w, name)


def check_input(w, name: str, multiple: int, what: str) -> None:
    """What the FP quantizers check: a finite float weight of 1-3 dims whose K is a multiple of `multiple`."""
    check_weight(w, name, what)
    if w.shape[-1] % multiple:
        raise ValueError(f"{name}: {what} needs the input dimension K={w.shape[-1]} to be a multiple of {multiple} (shape {list(w.shape)})")
    check_finite(w, name)


def row_ranges(rows: int, k: int, elements: int):
    """(start, end) row ranges of about `elements` elements each (at least one row): how the
    quantizers bound their temporaries whatever the weight's size."""
    step = max(1, elements // k)
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


class BestPerGroup:
    """The running choice, per group, among candidate (codes, scale, bias) triples: `offer` each
    with its error per group [..., G]; the least error wins, the earlier candidate on a tie."""

    def __init__(self) -> None:
        self.err: Optional[torch.Tensor] = None
        self.codes = self.scale = self.bias = torch.empty(0)

    def offer(self, err: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> None:
        if self.err is None:
            self.err, self.codes, self.scale, self.bias = err, codes, scale, bias
            return
        win = err < self.err
        self.err = torch.where(win, err, self.err)
        self.codes = torch.where(win.unsqueeze(-1), codes, self.codes)
        self.scale = torch.where(win, scale, self.scale)
        self.bias = torch.where(win, bias, self.bias)

    def chosen(self, name: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scale, bias) of the winners; a ValueError naming `name` when nothing was offered."""
        if self.err is None:
            raise ValueError(f"{name}: no candidate scales to choose from")
        return self.codes, self.scale, self.bias
