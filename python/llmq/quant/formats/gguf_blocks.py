"""Format family "gguf": the GGUF (llama.cpp) block types llmq imports, rearranged exactly into "int".

Import only: a block type is never a recipe's target. Each registered name is a GGML type name
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K); the tensor a GGUF file stores for one weight
is its raw blocks (``layout``), and ``rebuild`` / ``decode`` turn them -- never dequantized and
requantized -- into a GroupQuantizedWeight (unsigned q, LSB-first, float32 scale, additive bias). The numpy
code here is the reference; the compiled decoder (cpp/quant/gguf_blocks.h, through
llmq.quant._native) gives the same bytes, multi-threaded, and is used whenever it is loaded.
The scale/bias table and the value-exactness argument are in llmq/checkpoint/gguf_import.py's
docstring; block layouts are from ggml's ``ggml-common.h`` / gguf-py's ``quants.py``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from llmq.quant.formats.base import Format, Layout
from llmq.quant.formats.int_affine import GroupQuantizedWeight, dequantize_canonical

# GGML type name -> (block size, bytes per block, canonical bits, canonical group size)
BLOCK_TYPES = {
    "Q4_0": (32, 18, 4, 32),
    "Q4_1": (32, 20, 4, 32),
    "Q5_0": (32, 22, 5, 32),
    "Q5_1": (32, 24, 5, 32),
    "Q8_0": (32, 34, 8, 32),
    "Q2_K": (256, 84, 2, 16),
    "Q3_K": (256, 110, 3, 16),
    "Q4_K": (256, 144, 4, 32),
    "Q5_K": (256, 176, 5, 32),
    "Q6_K": (256, 210, 6, 16),
}
_PACKED_BY_DECODER = ("Q4_0", "Q4_1", "Q4_K")


# Bit manipulation runs on 64-bit words ("SWAR": eight bytes per operation), because
# numpy and torch shift uint8 arrays an element at a time; this keeps the import near
# memory speed. Every helper below is checked against formats.pack_bits and gguf-py.
_M0F = np.uint64(0x0F0F0F0F0F0F0F0F)
_M01 = np.uint64(0x0101010101010101)
_M03 = np.uint64(0x0303030303030303)
_SPREAD_BITS = np.array([sum(((b >> i) & 1) << (8 * i) for i in range(8)) for b in range(256)], dtype=np.uint64)


def _u64(a: np.ndarray) -> np.ndarray:
    """A (copied if strided) uint8 [n, 8m] array viewed as uint64 [n, m]."""
    if not a.flags.c_contiguous:
        out = np.empty(a.shape, np.uint8)
        np.copyto(out, a)
        a = out
    return a.view(np.uint64)


def _half(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 stored in byte columns [n, 2] -> float32 [n]."""
    return np.ascontiguousarray(b).view("<f2")[:, 0].astype(np.float32)


def swar_pack(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [..., K] (values < 2**bits, K % 8 == 0) -> the canonical LSB-first stream [..., K*bits/8].

    Eight elements (one byte each) form a 64-bit word; three merge steps pack them into
    the word's low 8*bits bits: neighbouring fields are joined in 16-, then 32-, then
    64-bit lanes. Same result as llmq.quant.formats.pack_bits, much faster for 5/6-bit.
    """
    *lead, k = q.shape
    w = np.empty((q.size // k, k), np.uint8)  # a private copy, updated in place
    np.copyto(w, q.reshape(-1, k))
    w = w.view(np.uint64)
    tmp = np.empty(w.shape, np.uint64)
    width = bits
    for lane in (16, 32, 64):
        half = lane // 2
        low = sum(((1 << width) - 1) << (i * lane) for i in range(64 // lane))
        np.right_shift(w, np.uint64(half - width), out=tmp)
        np.bitwise_and(tmp, np.uint64(low << width), out=tmp)
        np.bitwise_and(w, np.uint64(low), out=w)
        np.bitwise_or(w, tmp, out=w)
        width *= 2
    if bits == 4:  # the low half of every word: a uint32 view with stride 2
        src = w.view(np.uint32)[:, 0::2]
    else:
        src = w.view(np.uint8).reshape(-1, k // 8, 8)[:, :, :bits]
    out = np.empty(src.shape, src.dtype)
    np.copyto(out, src)
    return out.view(np.uint8).reshape(*lead, k * bits // 8)


def _nibble_halves(qs: np.ndarray, n_chunks: int) -> np.ndarray:
    """GGUF 4-bit chunks (low nibbles = first half of the elements, high = second half) ->
    one element per byte, in element order, as uint64 words [nb, ...]."""
    w = _u64(qs).reshape(qs.shape[0], n_chunks, -1)
    out = np.empty((w.shape[0], n_chunks, 2, w.shape[2]), np.uint64)
    np.bitwise_and(w, _M0F, out=out[:, :, 0, :])
    np.right_shift(w, np.uint64(4), out=out[:, :, 1, :])
    np.bitwise_and(out[:, :, 1, :], _M0F, out=out[:, :, 1, :])
    return out.reshape(qs.shape[0], -1)


def _pack_nibble_halves(qs: np.ndarray, n_chunks: int) -> np.ndarray:
    """GGUF 4-bit chunks straight to canonical packed bytes (no one-element-per-byte detour).

    Within a chunk of m bytes, the low nibbles hold elements 0..m-1 and the high nibbles
    m..2m-1; canonical byte i holds elements 2i (low) and 2i+1 (high). Isolating each set
    of nibbles and merging neighbouring bytes pairwise does this eight bytes at a time.
    """
    nb = qs.shape[0]
    w = _u64(qs).reshape(nb, n_chunks, -1)
    out = np.empty((nb, n_chunks, 2, w.shape[2]), np.uint32)
    x, tmp = np.empty_like(w), np.empty_like(w)  # reused in place: fewer fresh allocations
    for half in range(2):
        np.right_shift(w, np.uint64(4 * half), out=x)
        np.bitwise_and(x, _M0F, out=x)
        for shift, mask in ((4, 0x00FF00FF00FF00FF), (8, 0x0000FFFF0000FFFF), (16, 0x00000000FFFFFFFF)):
            np.right_shift(x, np.uint64(shift), out=tmp)
            np.bitwise_or(x, tmp, out=x)
            np.bitwise_and(x, np.uint64(mask), out=x)
        out[:, :, half, :] = x
    return out.view(np.uint8).reshape(nb, -1)


def _k_scale_min(s: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The 12-byte K-quant field -> eight 6-bit scales and eight 6-bit mins per block (float32).

    Bytes 0-3: low 6 bits = sc[0..3], top 2 bits = high bits of sc[4..7];
    bytes 4-7: the same for m; bytes 8-11: low nibble = low 4 bits of sc[4..7],
    high nibble = low 4 bits of m[4..7].
    """
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _two_bit_fields(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K's 64 bytes of 2-bit fields -> one element per byte, as uint64 words [nb, 32].

    Per half of 128 elements (32 bytes), bits 2s..2s+1 of byte j hold element 128 h + 32 s + j."""
    w = _u64(qs).reshape(qs.shape[0], 2, 4)
    return np.stack([(w >> np.uint64(2 * s)) & _M03 for s in range(4)], axis=2).reshape(qs.shape[0], 32)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's 12-byte field -> sixteen 6-bit scales per block (unsigned, before the -32).

    Low nibbles: bytes 0-7 hold scales 0-7 (low nibble) and 8-15 (high nibble); bytes 8-11
    hold the top two bits, at shift 2t of byte b for scale 4t + b."""
    lo, hi = s[:, 0:8], s[:, 8:12]
    top = [(hi >> (2 * t)) & 3 for t in range(4)]
    return np.concatenate([(lo[:, 0:4] & 0x0F) | (top[0] << 4), (lo[:, 4:8] & 0x0F) | (top[1] << 4),
                           (lo[:, 0:4] >> 4) | (top[2] << 4), (lo[:, 4:8] >> 4) | (top[3] << 4)], axis=1)


def _decode_blocks(type_name: str, blocks: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """uint8 [nb, bytes_per_block] -> (q, scale float32 [nb, groups], bias float32 [nb, groups]).

    q is already packed (uint8 [nb, block/2]) for the 4-bit types, otherwise uint64 words
    [nb, block/8] holding one element per byte, for swar_pack."""
    nb = blocks.shape[0]
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        head = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[type_name]
        d = _half(blocks[:, 0:2])
        if type_name in ("Q4_0", "Q4_1"):
            q = _pack_nibble_halves(blocks[:, head:head + 16], 1)  # byte j: element j (low), j+16 (high)
        else:  # 32 high bits, element j = bit j (little-endian)
            high = _SPREAD_BITS[blocks[:, head - 4:head]]
            q = _nibble_halves(blocks[:, head:head + 16], 1) | (high << np.uint64(4))
        if type_name in ("Q4_0", "Q5_0"):
            bias = np.float32(-8.0 if type_name == "Q4_0" else -16.0) * d
        else:
            bias = _half(blocks[:, 2:4])
        return q, d[:, None], bias[:, None]
    if type_name == "Q8_0":
        d = _half(blocks[:, 0:2])
        q = _u64(blocks[:, 2:34]) ^ np.uint64(0x8080808080808080)  # int8 + 128 == flip the sign bit
        return q, d[:, None], (np.float32(-128.0) * d)[:, None]
    if type_name == "Q2_K":  # scales (low nibble) and mins (high) per 16, 2-bit fields, d, dmin
        sc = blocks[:, 0:16]
        d, dmin = _half(blocks[:, 80:82]), _half(blocks[:, 82:84])
        scale = d[:, None] * (sc & 0x0F).astype(np.float32)
        return _two_bit_fields(blocks[:, 16:80]), scale, -(dmin[:, None] * (sc >> 4).astype(np.float32))
    if type_name == "Q3_K":  # high-bit mask, 2-bit fields, 6-bit scales, d; value d * (sc - 32) * (q - 4)
        hm = _u64(blocks[:, 0:32])  # bit i of byte j: the high bit of element 32 i + j
        high = np.stack([(hm >> np.uint64(i)) & _M01 for i in range(8)], axis=1).reshape(blocks.shape[0], 32)
        d = _half(blocks[:, 108:110])
        scale = d[:, None] * (_q3_k_scales(blocks[:, 96:108]).astype(np.float32) - np.float32(32.0))
        return _two_bit_fields(blocks[:, 32:96]) | (high << np.uint64(2)), scale, np.float32(-4.0) * scale
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])
        sc, mn = _k_scale_min(blocks[:, 4:16])
        if type_name == "Q4_K":  # 4 chunks of 64: low nibbles 0..31, high 32..63
            q = _pack_nibble_halves(blocks[:, -128:], 4)
        else:
            q = _nibble_halves(blocks[:, -128:], 4)
            qh = _u64(blocks[:, 16:48])  # bit i of byte j is the high bit of element 32*i + j
            high = np.stack([(qh >> np.uint64(i)) & _M01 for i in range(8)], axis=1).reshape(nb, 32)
            q = q | (high << np.uint64(4))
        return q, d[:, None] * sc, -(dmin[:, None] * mn)
    if type_name == "Q6_K":
        low = _nibble_halves(blocks[:, 0:128], 2)  # per half of 128: low nibbles 0..63, high 64..127
        qh = _u64(blocks[:, 128:192]).reshape(nb, 2, 4)  # per half: 2-bit fields at shift 2s -> 32*s + j
        high = np.stack([(qh >> np.uint64(2 * s)) & _M03 for s in range(4)], axis=2).reshape(nb, 32)
        sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
        d = _half(blocks[:, 208:210])
        scale = d[:, None] * sc
        return low | (high << np.uint64(4)), scale, np.float32(-32.0) * scale
    raise AssertionError(type_name)


def _native_decoder():
    """llmq.quant._native when the compiled decoder (cpp/quant/gguf_blocks.h) is loaded, else None."""
    import llmq.quant._native as _native

    return _native if _native.gguf_decode_available() else None


def expected_nbytes(type_name: str, shape: Tuple[int, ...]) -> int:
    """Bytes of blocks a tensor of logical shape [..., N, K] takes."""
    block, block_bytes, _, _ = BLOCK_TYPES[type_name]
    k = shape[-1]
    if k % block:
        raise ValueError(f"{type_name} needs the innermost dim to be a multiple of {block}, got {k}")
    return int(np.prod(shape)) // block * block_bytes


def decode_reference_flat(type_name: str, blocks: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The Python reference on whole blocks uint8 [nb, bytes_per_block] -> flat (qdata uint8, scale, bias float32).

    Every block's packed codes are whole bytes and its groups consecutive, so the flat result of a run of
    blocks is the same bytes whatever rows they belong to (what lets a tensor be decoded in chunks)."""
    block, _, bits, _ = BLOCK_TYPES[type_name]
    with np.errstate(all="ignore"):
        q, scale, bias = _decode_blocks(type_name, blocks)
    if type_name not in _PACKED_BY_DECODER:
        q = q.view(np.uint8).reshape(-1, block)
        q = q if bits == 8 else swar_pack(q, bits)
    return q.reshape(-1), scale.reshape(-1), bias.reshape(-1)


def decode_into(type_name: str, raw: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, *,
                native: Optional[bool] = None) -> None:
    """Whole blocks (flat contiguous uint8) -> canonical codes / scales / biases written into the flat
    contiguous ``qdata`` (uint8), ``scale`` and ``bias`` (float32) of matching sizes. ``native``: None uses
    the compiled decoder when it is loaded, True requires it, False runs the Python reference."""
    block, block_bytes, bits, group = BLOCK_TYPES[type_name]
    if raw.numel() % block_bytes:
        raise ValueError(f"{type_name} block data of {raw.numel()} bytes is not a whole number of "
                         f"{block_bytes}-byte blocks (truncated?)")
    kernel = _native_decoder() if native is not False else None
    if native and kernel is None:
        raise RuntimeError("the compiled GGUF block decoder is not available (build //cpp/quant:_quant_kernel.so)")
    if kernel is not None:
        kernel.gguf_decode(type_name, BLOCK_TYPES[type_name], raw, qdata, scale, bias)
        return
    q, s, b = decode_reference_flat(type_name, raw.numpy().reshape(-1, block_bytes))
    qdata.numpy()[:] = q
    scale.numpy()[:] = s
    bias.numpy()[:] = b


def decode(type_name: str, raw: torch.Tensor, shape: Tuple[int, ...], *,
           dtype: torch.dtype = torch.float32, native: Optional[bool] = None) -> GroupQuantizedWeight:
    """One GGUF tensor's raw blocks (uint8, any shape) -> GroupQuantizedWeight of logical torch-order
    ``shape`` [..., N, K]; ``dtype`` is recorded as the dtype it dequantizes to. ``native``: None uses the
    compiled decoder when it is loaded, True requires it, False runs the Python reference (whole tensor)."""
    raw = raw.reshape(-1)
    block, block_bytes, bits, group = BLOCK_TYPES[type_name]
    k = shape[-1]
    lead = tuple(shape[:-1]) if len(shape) >= 2 else (1,)
    need = expected_nbytes(type_name, tuple(shape))
    if raw.numel() != need:
        raise ValueError(f"{type_name} {list(shape)} needs {need} bytes of blocks, got {raw.numel()} (truncated?)")
    if native is not False and (native or _native_decoder() is not None):
        qdata = torch.empty(*lead, k * bits // 8, dtype=torch.uint8)
        scale = torch.empty(*lead, k // group, dtype=torch.float32)
        bias = torch.empty(*lead, k // group, dtype=torch.float32)
        decode_into(type_name, raw.contiguous(), qdata.view(-1), scale.view(-1), bias.view(-1), native=True)
        return GroupQuantizedWeight(qdata=qdata, scale=scale, bias=bias, bits=bits, group_size=group,
                                    shape=tuple(shape), dtype=dtype)
    with np.errstate(all="ignore"):  # NaN/Inf scales from a hostile file are caught by the nonfinite check
        q, scale, bias = _decode_blocks(type_name, raw.numpy().reshape(-1, block_bytes))
    if type_name in _PACKED_BY_DECODER:
        qdata = q.reshape(*lead, k // 2)
    else:
        q = q.view(np.uint8).reshape(*lead, k)
        qdata = q if bits == 8 else swar_pack(q, bits)
    return GroupQuantizedWeight(
        qdata=torch.from_numpy(np.ascontiguousarray(qdata)),
        scale=torch.from_numpy(np.ascontiguousarray(scale.reshape(*lead, k // group))),
        bias=torch.from_numpy(np.ascontiguousarray(bias.reshape(*lead, k // group))),
        bits=bits,
        group_size=group,
        shape=tuple(shape),
        dtype=dtype,
    )


class GGUFBlockFormat(Format):
    """The importable GGUF block types (import only: converted into the "int" family on read)."""

    family = "gguf"
    names = tuple(BLOCK_TYPES)
    can_quantize = False

    def validate_config(self, config: Any) -> None:
        raise ValueError(f"format {config.format!r} is a GGUF block type: import only, not a recipe target")

    def quantize(self, w, config, *, name: str = "<tensor>"):
        raise NotImplementedError(f"{name}: GGUF block types are import only")

    def dequantize(self, value: GroupQuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_canonical(value, dtype)

    def stored(self, value) -> Dict[str, torch.Tensor]:
        raise NotImplementedError("GGUF blocks are read, never written: a decoded weight is stored as 'int'")

    def rebuild(self, name, params, shape, dtype, stored) -> GroupQuantizedWeight:
        return decode(name, stored["blocks"], tuple(shape), dtype=dtype)

    def layout(self, name, params, shape) -> Layout:
        block, block_bytes, _, _ = BLOCK_TYPES[name]
        rows = int(np.prod(shape[:-1])) if len(shape) >= 2 else 1
        if shape[-1] % block:
            raise ValueError(f"{name} needs the innermost dim to be a multiple of {block}, got {shape[-1]}")
        return {"blocks": (torch.uint8, (rows * shape[-1] // block * block_bytes,))}
