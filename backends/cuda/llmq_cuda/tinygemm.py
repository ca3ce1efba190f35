"""Canonical 4-bit weights -> the tinygemm tile-packed layout of `torch.ops.aten._weight_int4pack_mm`.

The layout (written out in docs/backends.md, checked against an independent spec in
tinygemm_test.py) for a weight of N output rows and K inputs, inner_k_tiles = T in {2, 4, 8}:

    qdata           int32 [ceil(N/8), K/(16*T), 32, T/2]
    scale_and_zero  [K/group, ceil(N/8)*8, 2]   (..., 0) = scale, (..., 1) = zero
    w[n, k]         = (q[n, k] - 8) * scale[k // group, n] + zero[k // group, n]

Word qdata[nt, ks, t, i] holds 8 nibbles; nibble j (bits 4j..4j+3) is q[n, k] with

    n = 8*nt + t // 4
    k = 16*(T*ks + 2*i) + 16*((j >> 1) & 1) + 8*(j & 1) + 2*(t % 4) + (j >> 2)

i.e. one m16n8k16 B fragment per lane for two consecutive k-tiles. Rows past N are
zero (q = 0, scale = zero = 0, so they contribute nothing); K must be a multiple of
16*T (the kernel does not pad K: the activations would have to be padded too).

Conversion from the canonical (q, scale, bias) form: same q, same scale,
zero = bias + 8*scale. scale_and_zero is bfloat16 for the CUDA kernel, so scale and
zero each round once to bf16: this is lossy (|dw| <= |q-8| ulp_bf16(scale)/2 +
ulp_bf16(zero)/2) and documented as such; float32 scale_and_zero is exact up to one
rounding of zero and is what the CPU kernel takes with float32 activations.

Only 4-bit weights fit; anything else raises. MoE experts use the per-expert layout:
the same tensors with a leading expert dimension, each expert a contiguous slice
that `_weight_int4pack_mm` takes as is.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Optional, Sequence, Tuple

import torch

from llmq.checkpoint.safetensors_io import alloc_bytes
from llmq.quant import _native
from llmq.quant.formats import GroupQuantizedWeight, first_of_alike, pack_bits, unpack_bits

TINYGEMM_GROUP_SIZES = (32, 64, 128, 256)
TINYGEMM_INNER_K_TILES = (2, 4, 8)
N_TILE = 8
K_TILE = 16
ZERO_POINT = 8  # tinygemm's unsigned int4 midpoint


@dataclasses.dataclass(frozen=True)
class TinygemmInt4Weight:
    """A weight in tinygemm's tile-packed int4 layout (optionally with leading expert dims)."""

    qdata: torch.Tensor  # int32 [..., ceil(N/8), K/(16*T), 32, T/2]
    scale_and_zero: torch.Tensor  # [..., K/group, ceil(N/8)*8, 2]
    group_size: int
    inner_k_tiles: int
    shape: Tuple[int, ...]  # logical [..., N, K]

    def __post_init__(self):
        *lead, n, k = self.shape
        lead = tuple(lead)
        t = self.inner_k_tiles
        want_q = lead + (_ceil_div(n, N_TILE), k // (K_TILE * t), 32, t // 2)
        want_s = lead + (k // self.group_size, padded_out_features(n), 2)
        if self.qdata.dtype != torch.int32 or tuple(self.qdata.shape) != want_q:
            raise ValueError(f"qdata must be int32 {list(want_q)}, got {self.qdata.dtype} {list(self.qdata.shape)}")
        if not self.scale_and_zero.dtype.is_floating_point or tuple(self.scale_and_zero.shape) != want_s:
            raise ValueError(
                f"scale_and_zero must be float {list(want_s)}, got {self.scale_and_zero.dtype} "
                f"{list(self.scale_and_zero.shape)}"
            )

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.qdata, self.scale_and_zero))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def padded_out_features(n: int) -> int:
    """N rounded up to the 8-row tile; the kernel's output (and scale_and_zero) has this many columns."""
    return _ceil_div(n, N_TILE) * N_TILE


def _check(w: GroupQuantizedWeight, inner_k_tiles: int, name: str) -> int:
    if w.bits != 4:
        raise ValueError(f"{name}: tinygemm holds 4-bit weights only, got bits={w.bits}")
    if inner_k_tiles not in TINYGEMM_INNER_K_TILES:
        raise ValueError(f"{name}: inner_k_tiles must be one of {TINYGEMM_INNER_K_TILES}, got {inner_k_tiles}")
    k = w.shape[-1]
    if len(w.shape) < 2:
        raise ValueError(f"{name}: expected a weight [..., N, K], got shape {list(w.shape)}")
    if k % (K_TILE * inner_k_tiles):
        raise ValueError(
            f"{name}: K={k} is not a multiple of 16*inner_k_tiles={K_TILE * inner_k_tiles}; "
            f"use a smaller inner_k_tiles (valid: {TINYGEMM_INNER_K_TILES}) or pad K (and the activations)"
        )
    for g in sorted(TINYGEMM_GROUP_SIZES, reverse=True):
        if w.group_size % g == 0:
            return g
    raise ValueError(
        f"{name}: group_size={w.group_size} cannot be represented by tinygemm (groups {TINYGEMM_GROUP_SIZES}, "
        f"or an exact multiple of one)"
    )


def tinygemm_scale_and_zero(
    w: GroupQuantizedWeight, *, group_size: Optional[int] = None, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Canonical scale/bias [..., N, K/g] -> tinygemm scale_and_zero [..., K/g', ceil8(N), 2].

    zero = bias + 8*scale is formed exactly (float64) and rounded once to `dtype`; a
    coarse canonical group is repeated into groups of `group_size` (exact).
    """
    g = w.group_size if group_size is None else group_size
    if w.group_size % g:
        raise ValueError(f"cannot regroup group_size={w.group_size} into {g}")
    rep = w.group_size // g
    *lead, n, groups = w.shape[:-1] + (w.scale.shape[-1] * rep,)
    n8 = padded_out_features(n)
    # Flat over the leading (expert) dims; huge-page backed output (see tile_pack).
    sz = alloc_bytes(math.prod(lead) * groups * n8 * 2 * dtype.itemsize).view(dtype).view(-1, groups, n8, 2)
    if n8 != n:
        sz[:, :, n:, :].zero_()  # padding rows hold scale = zero = 0
    scale_all = w.scale.reshape(-1, n, w.scale.shape[-1])
    bias_all = w.bias.reshape(-1, n, w.bias.shape[-1])
    # A block of leading rows at a time keeps the float64 temporaries cache-sized (and their
    # memory reused) instead of whole-tensor page-faulted allocations.
    step = max(1, (1 << 16) // max(1, n * groups))
    for b0 in range(0, scale_all.shape[0], step):
        scale, bias = scale_all[b0:b0 + step], bias_all[b0:b0 + step]
        if rep > 1:  # a coarse group repeated into groups of g (exact)
            scale, bias = scale.repeat_interleave(rep, dim=-1), bias.repeat_interleave(rep, dim=-1)
        out = sz[b0:b0 + step, :, :n]
        # The scale rounds once to dtype; zero is formed in float64 (8*scale exact, one rounding
        # of the sum) and rounded to dtype, both written straight into the transposed layout.
        out[..., 0].copy_(scale.transpose(-1, -2))
        zero = torch.add(bias.to(torch.float64), scale.to(torch.float64), alpha=ZERO_POINT).to(dtype)
        out[..., 1].copy_(zero.transpose(-1, -2))  # (a strided float64 source is 10x slower)
    return sz.view(*lead, groups, n8, 2)


def pack_tinygemm_int4(
    w: GroupQuantizedWeight,
    *,
    inner_k_tiles: int = 8,
    scale_dtype: torch.dtype = torch.bfloat16,
    name: str = "weight",
) -> TinygemmInt4Weight:
    """Canonical 4-bit weight [..., N, K] -> tinygemm int4 tiles, computed on CPU.

    Leading dimensions (stacked experts) are kept: the per-expert layout.
    """
    group = _check(w, inner_k_tiles, name)
    return TinygemmInt4Weight(
        qdata=tile_pack(w.qdata, inner_k_tiles),
        scale_and_zero=tinygemm_scale_and_zero(w, group_size=group, dtype=scale_dtype),
        group_size=group,
        inner_k_tiles=inner_k_tiles,
        shape=tuple(w.shape),
    )


def tile_pack_int4(q: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """q uint8 [..., N, K] (values 0..15) -> int32 [..., ceil(N/8), K/(16T), 32, T/2]."""
    return tile_pack(pack_bits(q, 4), inner_k_tiles)


def tile_pack(qdata: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """Canonical 4-bit bytes [..., N, K/2] -> tinygemm tiles: the compiled one-pass kernel
    (llmq's cpp/quant int4_tiles, bit-identical, tested) when it is loaded, otherwise the
    torch reference tile_pack_canonical_bytes."""
    if _native.int4_mma_tiles_available() and qdata.device.type == "cpu" and sys.byteorder == "little":
        *lead, n, kb = qdata.shape
        shape = (*lead, _ceil_div(n, N_TILE), 2 * kb // (K_TILE * inner_k_tiles), 32, inner_k_tiles // 2)
        out = alloc_bytes(4 * math.prod(shape)).view(torch.int32).view(shape)  # huge pages when large
        return _native.pack_int4_mma_tiles(qdata, inner_k_tiles, out=out)
    return tile_pack_canonical_bytes(qdata, inner_k_tiles)


def _i32(x: int) -> int:
    """A 32-bit mask as the signed int32 torch stores it."""
    return x - (1 << 32) if x >= 1 << 31 else x


_LO_NIBBLES, _HI_NIBBLES = _i32(0x0F0F0F0F), _i32(0xF0F0F0F0)
_EVEN_BYTES, _ODD_BYTES = _i32(0x00FF00FF), _i32(0xFF00FF00)
_LO_HALF, _HI_HALF = _i32(0x0000FFFF), _i32(0xFFFF0000)


def tile_pack_canonical_bytes(qdata: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """Canonical 4-bit bytes [..., N, K/2] (k=2m in the low nibble of byte m) -> tinygemm tiles.

    Works on whole 32-bit words of the canonical stream, never on single nibbles. k
    decomposes as (ks, i, tile, half, tq, odd) with sizes (K/16T, T/2, 2, 2, 4, 2):
    canonical word (ks, i, tile, half) holds, in byte tq, the nibbles odd = 0 (low) and
    odd = 1 (high). Output lane t = 4*nr + tq needs, in byte 2*odd + tile of its word,
    nibble `half` = the element from word `half`. Nibble merges build, per (odd, tile),
    a word X whose byte tq is that output byte for lane tq; a 4x4 byte transpose of
    (X[0,0], X[0,1], X[1,0], X[1,1]) then gives the four lanes' words, and one permute
    puts (nt, nr, ks, i) into the (nt, ks, lane, i) order.
    """
    *lead, n, kb = qdata.shape
    t = inner_k_tiles
    if sys.byteorder != "little":  # pragma: no cover - the word arithmetic assumes little-endian words
        raise NotImplementedError("tinygemm packing assumes a little-endian host")
    npad = padded_out_features(n) - n
    q = qdata.contiguous()
    if npad:
        q = torch.nn.functional.pad(q, (0, 0, 0, npad))
    nt, ks = (n + npad) // N_TILE, (2 * kb) // (K_TILE * t)
    # 8-row tiles are independent (also across experts): pack them in cache-sized blocks.
    tiles = q.reshape(-1, 8 * kb)
    out = torch.empty(tiles.shape[0], ks, 8, 4, t // 2, dtype=torch.int32)  # tile ks nr tq i
    block = max(1, _BLOCK_BYTES // (8 * kb))
    for start in range(0, tiles.shape[0], block):
        _pack_tiles(tiles[start : start + block], out[start : start + block], ks, t)
    return out.reshape(*lead, nt, ks, 32, t // 2)


_BLOCK_BYTES = 1 << 20  # input bytes per block: bounds the temporaries (each 1/4 of a block) near L2 size


def _pack_tiles(tiles: torch.Tensor, out: torch.Tensor, ks: int, t: int) -> None:
    """Pack row tiles [B, 8*K/2] (uint8) into out [B, ks, 8, 4, T/2] (int32)."""
    w = tiles.view(torch.int32).reshape(-1, 8, ks, t // 2, 4)  # tile nr ks i (tile half)
    w = w.permute(4, 0, 1, 2, 3).contiguous()  # (tile half) first: the slices below are contiguous

    def merge(tile: int):
        lo, hi = w[2 * tile], w[2 * tile + 1]
        odd0 = (lo & _LO_NIBBLES) | ((hi & _LO_NIBBLES) << 4)
        odd1 = ((lo >> 4) & _LO_NIBBLES) | (hi & _HI_NIBBLES)
        return odd0, odd1

    x00, x10 = merge(0)  # x[odd][tile]
    x01, x11 = merge(1)
    # rows r = 2*odd + tile: (x00, x01, x10, x11); transpose bytes so word tq holds byte tq of each row
    t0 = (x00 & _EVEN_BYTES) | ((x01 & _EVEN_BYTES) << 8)
    t1 = ((x00 >> 8) & _EVEN_BYTES) | (x01 & _ODD_BYTES)
    t2 = (x10 & _EVEN_BYTES) | ((x11 & _EVEN_BYTES) << 8)
    t3 = ((x10 >> 8) & _EVEN_BYTES) | (x11 & _ODD_BYTES)
    lanes = (
        (t0 & _LO_HALF) | (t2 << 16),
        (t1 & _LO_HALF) | (t3 << 16),
        ((t0 >> 16) & _LO_HALF) | (t2 & _HI_HALF),
        ((t1 >> 16) & _LO_HALF) | (t3 & _HI_HALF),
    )
    for tq, word in enumerate(lanes):  # (tile nr ks i) -> (tile ks nr i)
        out[:, :, :, tq, :].copy_(word.permute(0, 2, 1, 3))


def tile_unpack_int4(qdata: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of tile_pack_int4: int32 tiles -> uint8 q [..., n, k] (padding rows dropped)."""
    *lead, nt, ks, lanes, half_t = qdata.shape
    t = 2 * half_t
    d = len(lead)
    byte = qdata.contiguous().view(torch.uint8).reshape(*lead, nt, ks, 32, half_t, 4)
    if sys.byteorder != "little":  # pragma: no cover
        byte = byte.flip(-1)
    nib = torch.stack([byte & 0xF, byte >> 4], dim=-1)  # [..., nt, ks, 32, T/2, 4, 2]
    v = nib.reshape(*lead, nt, ks, 8, 4, half_t, 2, 2, 2)  # nt, ks, nr, tq, i, odd, tile, half
    inverse = [d + x for x in (0, 2, 1, 4, 6, 7, 3, 5)]  # back to nt, nr, ks, i, tile, half, tq, odd
    q = v.permute(*range(d), *inverse).reshape(*lead, nt * 8, ks * K_TILE * t)
    if ks * K_TILE * t != k:
        raise ValueError(f"tiles hold K={ks * K_TILE * t}, expected {k}")
    return q[..., :n, :].contiguous()


def unpack_tinygemm_int4(t: TinygemmInt4Weight) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [..., N, K], scale [..., N, K/g], zero [..., N, K/g]) in scale_and_zero's dtype."""
    *_, n, k = t.shape
    q = tile_unpack_int4(t.qdata, n, k)
    sz = t.scale_and_zero[..., :n, :].transpose(-3, -2)  # [..., N, K/g, 2]
    return q, sz[..., 0].contiguous(), sz[..., 1].contiguous()


def dequantize_tinygemm(t: TinygemmInt4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q - 8)*scale + zero from the stored (possibly bf16-rounded) parameters, exact in float64."""
    q, scale, zero = unpack_tinygemm_int4(t)
    *lead, n, k = t.shape
    qf = q.to(torch.float64).reshape(*lead, n, k // t.group_size, t.group_size)
    w = (qf - ZERO_POINT) * scale.to(torch.float64).unsqueeze(-1) + zero.to(torch.float64).unsqueeze(-1)
    return w.reshape(t.shape).to(dtype)


def stack_experts(experts: Sequence[TinygemmInt4Weight]) -> TinygemmInt4Weight:
    """Per-expert layout: stack experts that share shape and packing along a new dim 0."""
    first = first_of_alike(experts, lambda e: {"shape": e.shape, "group_size": e.group_size,
                                               "inner_k_tiles": e.inner_k_tiles, "scales": e.scale_and_zero.dtype})
    return TinygemmInt4Weight(
        qdata=torch.stack([e.qdata for e in experts]),
        scale_and_zero=torch.stack([e.scale_and_zero for e in experts]),
        group_size=first.group_size,
        inner_k_tiles=first.inner_k_tiles,
        shape=(len(experts),) + tuple(first.shape),
    )


def expert(t: TinygemmInt4Weight, e: int) -> TinygemmInt4Weight:
    """Expert e of a per-expert stack, as a 2-D tinygemm weight (views, no copy)."""
    if len(t.shape) != 3:
        raise ValueError(f"expected a stacked [E, N, K] weight, got shape {t.shape}")
    return TinygemmInt4Weight(t.qdata[e], t.scale_and_zero[e], t.group_size, t.inner_k_tiles, tuple(t.shape[1:]))


def pack_int4_for_cpu(
    w: GroupQuantizedWeight, *, scale_dtype: torch.dtype = torch.float32, name: str = "weight"
) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """The CPU equivalent of the tinygemm weight, for `torch.ops.aten._weight_int4pack_mm_for_cpu`.

    Returns (packed, scale_and_zero [K/g, N, 2], group_size). The CPU kernel has its own
    byte layout ([N, K/2] uint8, made by torch's `_convert_weight_to_int4pack_for_cpu`
    from int32 q) and takes N unpadded; the numerics, (q - 8)*scale + zero, are the same.
    """
    if len(w.shape) != 2:
        raise ValueError(f"{name}: the CPU int4 kernel takes one [N, K] weight, got shape {list(w.shape)}")
    group = _check(w, 2, name)
    n = w.shape[0]
    if n % 16:
        raise ValueError(f"{name}: torch's CPU int4 packing needs N divisible by 16, got N={n}")
    q = unpack_bits(w.qdata, 4, w.shape[-1])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
    sz = tinygemm_scale_and_zero(w, group_size=group, dtype=scale_dtype)[:, :n, :].contiguous()
    return packed, sz, group
