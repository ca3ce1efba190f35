"""Format family "gguf-quant": llmq quantizers that produce GGUF (llama.cpp) block types exactly.

A recipe may name q4_0, q4_1, q5_0, q5_1, q8_0 (blocks of 32) and the K-quants q2_k (super-blocks of
256: sixteen sub-blocks of 16 with 4-bit scales and mins), q3_k (sixteen sub-blocks of 16 with signed 6-bit
scales), q4_k, q5_k (eight sub-blocks of 32 with 6-bit scales and mins) and q6_k (sixteen sub-blocks of 16
with int8 scales). The quantized weight is the ordinary canonical GroupQuantizedWeight ("int": unsigned q, float32
scale, additive bias; everything downstream reads it unchanged), chosen under the block type's
constraints so that it *is* a GGUF block bit for bit. The table of what each type stores, and the
methods (minmax: llama.cpp's reference rounding, byte for byte for the blocks of 32; search; hqq; the
last two importance-weighted) are in llmq.quant.formats.gguf_fit, which fits the stored parameters and
then rounds the codes against them. Method "gptq" (llmq.quant.gptq, with the layer's H:
quantize_weight(..., hessian=), or a run's --calibration_text) rounds column by column, fitting each
block's stored parameters by gguf_fit when its first column comes up. Rows must be a whole number of
blocks (32, or 256 for the K-quants): `shape_problem` refuses the others before any work.

`encode_blocks(type, weight)` writes any canonical weight whose values a block type holds as that
type's bytes (ggml-common.h's layouts, the inverse of llmq.quant.formats.gguf_blocks), and raises
ValueError where it does not hold them exactly -- so a GGUF import (already exact) can be written
back too. gguf-py's `gguf.quants.dequantize` of those bytes equals `dequantize_canonical(weight)`.
"""

from __future__ import annotations

from typing import Any, Dict, NoReturn, Optional, Tuple

import numpy as np
import torch

from llmq.quant.formats.base import Format
from llmq.quant.formats.gguf_fit import BLOCK_TYPES, METHODS, BlockType, quantize_rows, signed_extreme
from llmq.quant.formats.int_affine import GroupQuantizedWeight, dequantize_canonical, pack_bits, unpack_bits

__all__ = ["BLOCK_TYPES", "BY_GGML", "BlockType", "GGUFQuantFormat", "NotExact", "encode_blocks", "quantize"]

BY_GGML = {t.ggml: name for name, t in BLOCK_TYPES.items()}


def quantize(w: torch.Tensor, kind: str, *, name: str = "<tensor>", method: str = "minmax",
             importance: Optional[torch.Tensor] = None) -> GroupQuantizedWeight:
    """A 1-D, 2-D or 3-D float weight -> the canonical weight of block type `kind` (method minmax,
    search or hqq; importance: positive weights [K] weighting search's and hqq's error, see gguf_fit)."""
    t = BLOCK_TYPES[kind]
    if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: expected a float32/bfloat16/float16 weight, got dtype {w.dtype}")
    if not 1 <= w.dim() <= 3 or w.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty 1-D, 2-D or 3-D weight, got shape {list(w.shape)}")
    k = w.shape[-1]
    if k % t.block:
        raise ValueError(f"{name}: {kind} needs rows of a multiple of {t.block} elements, got K={k}")
    x = w.detach().reshape(-1, k).to(device="cpu", dtype=torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name}: weight has NaN/Inf values")
    step = max(1, (1 << 22) // k)
    if importance is not None:
        importance = importance.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
        if importance.numel() != k or not bool((torch.isfinite(importance) & (importance > 0)).all()):
            raise ValueError(f"{name}: importance must be K={k} finite values > 0 (one per input channel)")
    parts = [quantize_rows(x[i:i + step], kind, name, method, importance) for i in range(0, x.shape[0], step)]
    q, scale, bias = (torch.cat([p[j] for p in parts]) for j in range(3))
    lead = tuple(w.shape[:-1]) if w.dim() >= 2 else (1,)
    return GroupQuantizedWeight(qdata=pack_bits(q, t.bits).reshape(*lead, -1).contiguous(),
                                scale=scale.reshape(*lead, -1).contiguous(), bias=bias.reshape(*lead, -1).contiguous(),
                                bits=t.bits, group_size=t.group, shape=tuple(w.shape), dtype=w.dtype)


# --------------------------------------------------------------------------------------------
# Canonical weight -> GGUF block bytes (exact, or ValueError)
# --------------------------------------------------------------------------------------------


def _half_bytes(v: np.ndarray) -> np.ndarray:
    """float32 values float16 holds exactly [n] -> their little-endian float16 bytes [n, 2]."""
    return v.astype("<f2").view(np.uint8).reshape(-1, 2)


def _is_f16(v: torch.Tensor) -> bool:
    return bool((v.to(torch.float16).to(torch.float32) == v).all()) and bool(torch.isfinite(v).all())


def _factor(v: torch.Tensor, lo: int, hi: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """v [N, n] float32 -> (d [N] float16-exact, c [N, n] integers in [lo, hi]) with d * c == v exactly,
    or None where some row has no such factorisation. Tries each integer for the entry of largest
    magnitude (c = v_max / d), most negative first, then largest."""
    n_rows = v.shape[0]
    d_out = torch.zeros(n_rows, dtype=torch.float32)
    c_out = torch.zeros_like(v)
    vmax = signed_extreme(v)
    todo = vmax != 0
    for c in list(range(lo, 0)) + list(range(hi, 0, -1)):  # ggml's own choice first (-128 for Q6_K, 63 else)
        if not bool(todo.any()):
            break
        idx = todo.nonzero().squeeze(-1)
        d = vmax[idx] / float(c)
        ci = v[idx] / d.unsqueeze(-1)
        cr = ci.round()
        ok = ((d.to(torch.float16).to(torch.float32) == d) & (d * float(c) == vmax[idx])
              & (cr >= lo).all(-1) & (cr <= hi).all(-1) & (d.unsqueeze(-1) * cr == v[idx]).all(-1))
        good = idx[ok]
        d_out[good], c_out[good] = d[ok], cr[ok]
        todo[good] = False
    return None if bool(todo.any()) else (d_out, c_out)


def _k_scales_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per super-block [N, 8] -> ggml's packed 12 bytes [N, 12]."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return out


def _nibbles(q: np.ndarray, chunk: int) -> np.ndarray:
    """Codes [N, n] (low 4 bits used) -> bytes [N, n/2]: per chunk of `chunk` elements, byte j holds element
    j (low nibble) and j + chunk/2 (high nibble)."""
    n_rows, n = q.shape
    c = (q & 0x0F).reshape(n_rows, n // chunk, 2, chunk // 2)
    return (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).reshape(n_rows, n // 2).astype(np.uint8)


def _two_bit_fields(q: np.ndarray) -> np.ndarray:
    """Codes [N, 256] (low 2 bits used) -> Q2_K/Q3_K's 64 bytes: per half of 128 elements (32 bytes), bits
    2s..2s+1 of byte j hold element 128 h + 32 s + j."""
    f = (q & 3).astype(np.uint8).reshape(q.shape[0], 2, 4, 32)
    return np.bitwise_or.reduce([f[:, :, s, :] << (2 * s) for s in range(4)]).astype(np.uint8).reshape(q.shape[0], 64)


def _q3_k_scales_bytes(u: np.ndarray) -> np.ndarray:
    """Sixteen unsigned 6-bit scales per block [N, 16] -> Q3_K's 12 bytes: bytes 0-7 hold the low nibbles of
    scales 0-7 (low) and 8-15 (high), bytes 8-11 the top two bits of scale 4 t + b at shift 2 t of byte b."""
    u = u.astype(np.uint8)
    low = (u[:, 0:8] & 0x0F) | ((u[:, 8:16] & 0x0F) << 4)
    top = np.bitwise_or.reduce([((u[:, 4 * t:4 * t + 4] >> 4) & 3) << (2 * t) for t in range(4)])
    return np.concatenate([low, top], axis=1).astype(np.uint8)


def _bit_planes(bits: np.ndarray) -> np.ndarray:
    """bits [N, 32 * m] (0/1) -> bytes [N, 32]: bit i of byte j is bits[32 i + j] (m <= 8 planes)."""
    n_rows, n = bits.shape
    planes = bits.reshape(n_rows, n // 32, 32).astype(np.uint8)
    return np.bitwise_or.reduce([planes[:, i, :] << i for i in range(n // 32)]).astype(np.uint8)


class NotExact(ValueError):
    """The weight's values are not those of the block type asked for."""


def encode_blocks(kind: str, w: GroupQuantizedWeight, *, name: str = "<tensor>") -> np.ndarray:
    """The GGUF blocks of `w` as block type `kind` (a name of BLOCK_TYPES): uint8 [..., N, K / block *
    bytes per block]. NotExact (a ValueError, one line) where the type cannot hold w's values exactly."""
    t = BLOCK_TYPES[kind]
    k = w.shape[-1]
    if w.bits != t.bits or w.group_size != t.group or k % t.block:
        raise NotExact(f"{name}: {w.bits}-bit groups of {w.group_size} along K={k} are not {t.ggml} blocks "
                       f"({t.bits}-bit groups of {t.group}, rows a multiple of {t.block})")
    lead = tuple(w.shape[:-1]) if len(w.shape) >= 2 else (1,)
    rows = int(np.prod(lead))
    q = unpack_bits(w.qdata.reshape(rows, -1), t.bits, k).numpy().reshape(-1, t.block)  # [B, block]
    scale = w.scale.reshape(-1, t.block // t.group)  # [B, groups per block]
    bias = w.bias.reshape(-1, t.block // t.group)
    n_blocks = q.shape[0]

    def refuse(why: str) -> NoReturn:
        raise NotExact(f"{name}: not exactly {t.ggml}: {why}")

    if t.block == 32:
        d = scale[:, 0]
        if not _is_f16(d):
            refuse("a scale is not a float16 value")
        if t.symmetric and not torch.equal(bias[:, 0], d * -float(t.offset)):
            refuse(f"a bias is not -{t.offset} * scale")
        parts = [_half_bytes(d.numpy())]
        if not t.symmetric:
            if not _is_f16(bias[:, 0]):
                refuse("a bias is not a float16 value")
            parts.append(_half_bytes(bias[:, 0].numpy()))
        if t.bits == 8:
            parts.append((q.astype(np.int16) - 128).astype(np.int8).view(np.uint8))
        else:
            if t.bits == 5:
                parts.append(_u32_bits(q >> 4))  # qh: bit j of a little-endian uint32 = element j's 5th bit
            parts.append(_nibbles(q, 32))
        return np.concatenate(parts, axis=1).reshape(*lead, -1)

    if kind == "q6_k":
        if not torch.equal(bias, scale * -32.0):
            refuse("a bias is not -32 * scale")
        f = _factor(scale, -128, 127)
        if f is None:
            refuse("the sub-block scales are not one float16 d times int8 scales")
        d, sc = f
        ql = _nibbles(q, 128)  # per half of 128: low nibbles 0..63, high 64..127
        hi2 = (q >> 4).reshape(n_blocks, 2, 4, 32)  # per half: 2-bit field at shift 2s -> element 32 s + j
        qh = np.bitwise_or.reduce([hi2[:, :, s, :] << (2 * s) for s in range(4)]).astype(np.uint8).reshape(n_blocks, 64)
        return np.concatenate([ql, qh, sc.numpy().astype(np.int8).view(np.uint8), _half_bytes(d.numpy())],
                              axis=1).reshape(*lead, -1)

    if kind == "q3_k":
        if not torch.equal(bias, scale * -4.0):
            refuse("a bias is not -4 * scale")
        f = _factor(scale, -32, 31)
        if f is None:
            refuse("the sub-block scales are not one float16 d times integers in -32..31")
        d, sc = f
        hmask = _bit_planes(q >> 2)  # bit i of byte j: the high bit of element 32 i + j
        return np.concatenate([hmask, _two_bit_fields(q), _q3_k_scales_bytes(sc.numpy().astype(np.int16) + 32),
                               _half_bytes(d.numpy())], axis=1).reshape(*lead, -1)

    assert t.sub is not None
    top = t.sub[1]
    fs = _factor(scale, 0, top)
    fm = _factor(0.0 - bias, 0, top)
    if fs is None:
        refuse(f"the sub-block scales are not one float16 d times integers in 0..{top}")
    if fm is None:
        refuse(f"the sub-block biases are not one float16 -dmin times integers in 0..{top}")
    (d, sc), (dmin, mn) = fs, fm
    if kind == "q2_k":  # scales (low nibble) and mins (high) per sub-block, 2-bit fields, d, dmin
        packed = (sc.numpy().astype(np.uint8) | (mn.numpy().astype(np.uint8) << 4)).astype(np.uint8)
        return np.concatenate([packed, _two_bit_fields(q), _half_bytes(d.numpy()), _half_bytes(dmin.numpy())],
                              axis=1).reshape(*lead, -1)
    parts = [_half_bytes(d.numpy()), _half_bytes(dmin.numpy()),
             _k_scales_bytes(sc.numpy().astype(np.uint8), mn.numpy().astype(np.uint8))]
    if kind == "q5_k":
        parts.append(_bit_planes(q >> 4))  # bit i of byte j: the 5th bit of element 32 i + j
    parts.append(_nibbles(q, 64))  # 4 chunks of 64: low nibbles 0..31, high 32..63
    return np.concatenate(parts, axis=1).reshape(*lead, -1)


def _u32_bits(bits: np.ndarray) -> np.ndarray:
    """bits [N, 32] (0/1) -> little-endian uint32 bytes [N, 4] with bit j = bits[j]."""
    word = (bits.astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return word.astype("<u4").view(np.uint8).reshape(-1, 4)


class GGUFQuantFormat(Format):
    """Recipe formats q4_0 .. q6_k (see the module docstring); values are canonical GroupQuantizedWeights
    (the "int" family stores, dequantizes and packs them), so this family has no container of its own."""

    family = "gguf-quant"
    names = tuple(BLOCK_TYPES)
    has_quantized_module = True
    # gguf_fit's methods, and llmq.quant.gptq (needs the layer's H; it fits the blocks by gguf_fit)
    methods = METHODS + ("gptq",)
    importance_methods = ("search", "hqq")
    rows_independent = True  # groups (and K-quant super-blocks) run along a row
    config_fields = ("bits", "group_size", "symmetric")

    def default_config(self, name: str) -> Dict[str, Any]:
        t = BLOCK_TYPES[name]
        return {"bits": t.bits, "group_size": t.group, "symmetric": t.symmetric}

    def validate_config(self, config: Any) -> None:
        t = BLOCK_TYPES[config.format]
        if (config.bits, config.group_size, config.symmetric) != (t.bits, t.group, t.symmetric):
            raise ValueError(f"format {config.format!r} ({t.ggml}) is bits={t.bits}, group_size={t.group}, "
                             f"symmetric={t.symmetric}; got bits={config.bits}, group_size={config.group_size}, "
                             f"symmetric={config.symmetric}")
        if getattr(config, "scale_dtype", None) not in (None, torch.float32):
            raise ValueError(f"QuantConfig.scale_dtype for {config.format!r}: the scales are float16 inside the "
                             "canonical float32; leave scale_dtype at float32")
        if config.method == "gptq":
            from llmq.quant.gptq_options import check_options

            check_options(dict(config.options or ()))

    def shape_problem(self, config: Any, shape: Tuple[int, ...]) -> Optional[str]:
        t = BLOCK_TYPES[config.format]
        k = shape[-1]
        return None if k % t.block == 0 else (f"{config.format} ({t.ggml}) needs rows of a multiple of {t.block} "
                                              f"elements, got K={k}")

    def quantize(self, w: torch.Tensor, config: Any, *, name: str = "<tensor>",
                 importance: Optional[torch.Tensor] = None) -> GroupQuantizedWeight:
        if config.method == "gptq":
            raise ValueError(f"{name}: method 'gptq' rounds against the layer's inputs: it needs their second moment "
                             "H (quantize_weight(..., hessian=); in a run, --calibration_text)")
        return quantize(w, config.format, name=name, method=config.method, importance=importance)

    def dequantize(self, value: GroupQuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_canonical(value, dtype)

    def stored(self, value):
        raise NotImplementedError("a gguf-quant weight is a canonical 'int' weight: it is stored as 'int'")

    def rebuild(self, name, params, shape, dtype, stored):
        raise NotImplementedError("a gguf-quant weight is stored and rebuilt as 'int'")

    def layout(self, name, params, shape):
        raise NotImplementedError("a gguf-quant weight is stored as 'int'")

    def packed_bits(self, value: GroupQuantizedWeight, config: Any) -> int:
        """Exactly the GGUF blocks' bits (gguf.GGML_QUANT_SIZES): scales and mins included."""
        import gguf

        block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[BLOCK_TYPES[config.format].ggml]]
        return int(np.prod(value.shape)) // block * nbytes * 8
