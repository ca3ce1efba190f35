"""Compiled fast path for the FP quantizers of formats/fp8.py, mx.py and nvfp4.py (the same
extension as `_native`, //cpp/quant:_quant_kernel.so, functions quantize_fp8 / quantize_mx /
quantize_nvfp4). The caller passes the geometry (block sizes, element width); the kernel serves
the ones it was built for (FP8 tiles of 128, MX blocks of 32, NVFP4 blocks of 16) and returns None
for any other.

The kernel reproduces the families' torch references bit for bit (cpp/quant/fp_quant.h), so using it
or not changes speed only. Each function returns the raw output tensors, or None whenever the
kernel is not loaded or the input is anything but the plain case (a contiguous-able CPU float
tensor of 1-3 dims, block-aligned, valid override scales) or holds a NaN/Inf: the caller then
runs its reference path, which raises the exact error message.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

import llmq.quant._native as _native

_INPUT_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _plain(w, block: int) -> bool:
    return (
        isinstance(w, torch.Tensor)
        and _native.applicable(w)
        and 1 <= w.dim() <= 3
        and w.numel() > 0
        and w.shape[-1] % block == 0
    )


def _scale_buffer(scale, expect: Tuple[int, ...]) -> Optional[torch.Tensor]:
    """Where the kernel reads or writes the scale: a new float32 buffer of shape `expect` when the
    caller gave none (the kernel computes it), else the caller's scale as the reference keeps it
    (float32, contiguous), or None if it is not one the reference would accept."""
    if scale is None:
        return torch.empty(expect, dtype=torch.float32)
    try:
        scale = torch.as_tensor(scale, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        return None
    if scale.device.type != "cpu" or tuple(scale.shape) != expect or not bool((torch.isfinite(scale) & (scale > 0)).all()):
        return None
    return scale.contiguous()


def _rows(w: torch.Tensor) -> torch.Tensor:
    w = w.detach()
    return w.reshape(-1, w.shape[-1]).contiguous()


# The geometry the kernel implements.
_FP8_TILE, _MX_BLOCK, _NVFP4_BLOCK = 128, 32, 16


def quantize_fp8(w, granularity: str, scale=None, *, block: int, threads: Optional[int] = None,
                 isa: str = "auto"):
    """(data float8_e4m3fn shaped like w, scale float32) as formats.fp8.quantize_fp8, or None.
    block: the tile edge of granularity "block128"."""
    m = _native._load()
    multiple = block if granularity == "block128" else 1
    if (m is None or granularity not in ("tensor", "channel", "block128") or block != _FP8_TILE
            or not _plain(w, multiple)):
        return None
    shape = tuple(w.shape)
    if granularity == "tensor":
        expect = shape[:-2]
        rows_per_scale = shape[-2] if len(shape) == 3 else (shape[0] if len(shape) == 2 else 1)
    elif granularity == "channel":
        expect, rows_per_scale = shape[:-1] + (1,), 1
    else:
        if len(shape) < 2 or shape[-2] % block:
            return None
        expect, rows_per_scale = shape[:-2] + (shape[-2] // block, shape[-1] // block), 1
    compute = scale is None
    scale = _scale_buffer(scale, expect)
    if scale is None:
        return None
    rows = _rows(w)
    out = torch.empty(rows.shape, dtype=torch.uint8)
    status = m.quantize_fp8(
        rows.data_ptr(), _INPUT_NAMES[rows.dtype], rows.shape[0], rows.shape[1], granularity, rows_per_scale,
        compute, scale.data_ptr(), out.data_ptr(), _threads(threads), isa,
    )
    return (out.view(torch.float8_e4m3fn).reshape(shape), scale) if status == "ok" else None


def quantize_mx(w, element_bits: int, *, block: int, threads: Optional[int] = None, isa: str = "auto"):
    """(codes uint8, scale_e8m0 uint8) shaped as formats.mx.quantize_mx's, or None. element_bits:
    4 for E2M1 elements (packed two per byte), 8 for E4M3; block: elements per E8M0 scale."""
    m = _native._load()
    if m is None or element_bits not in (4, 8) or block != _MX_BLOCK or not _plain(w, block):
        return None
    lead, k = tuple(w.shape[:-1]), w.shape[-1]
    fp4 = element_bits == 4  # the kernel's two element types: E2M1 or E4M3
    rows = _rows(w)
    codes = torch.empty(lead + (k * element_bits // 8,), dtype=torch.uint8)
    scales = torch.empty(lead + (k // block,), dtype=torch.uint8)
    status = m.quantize_mx(
        rows.data_ptr(), _INPUT_NAMES[rows.dtype], rows.shape[0], k, fp4, codes.data_ptr(), scales.data_ptr(),
        _threads(threads), isa,
    )
    return (codes, scales) if status == "ok" else None


def quantize_nvfp4(w, global_scale=None, *, block: int, threads: Optional[int] = None,
                   isa: str = "auto"):
    """(codes uint8, block_scale float8_e4m3fn, global_scale float32) as formats.nvfp4.quantize_nvfp4's,
    or None. block: elements per e4m3 block scale."""
    m = _native._load()
    if m is None or block != _NVFP4_BLOCK or not _plain(w, block):
        return None
    shape = tuple(w.shape)
    lead, k = shape[:-1], shape[-1]
    expect = shape[:-2]
    compute = global_scale is None
    g = _scale_buffer(global_scale, expect)
    if g is None:
        return None
    rows = _rows(w)
    codes = torch.empty(lead + (k // 2,), dtype=torch.uint8)
    block_scale = torch.empty(lead + (k // block,), dtype=torch.uint8)
    rows_per_global = rows.shape[0] // max(1, g.numel())
    status = m.quantize_nvfp4(
        rows.data_ptr(), _INPUT_NAMES[rows.dtype], rows.shape[0], k, rows_per_global, compute, g.data_ptr(),
        codes.data_ptr(), block_scale.data_ptr(), _threads(threads), isa,
    )
    return (codes, block_scale.view(torch.float8_e4m3fn), g) if status == "ok" else None


def abs_max(w, per_expert: bool, *, threads: Optional[int] = None, isa: str = "auto") -> Optional[torch.Tensor]:
    """float32 max |w| (one per expert of a 3-D w when per_expert, else a 0-dim tensor), equal
    to torch's w.abs().amax(...).float() without its full-size copy; None as above."""
    m = _native._load()
    if m is None or not _plain(w, 1):
        return None
    rows = _rows(w)
    shape = (w.shape[0],) if per_expert and w.dim() == 3 else ()
    amax = torch.empty(shape, dtype=torch.float32)
    status = m.abs_max(rows.data_ptr(), _INPUT_NAMES[rows.dtype], rows.shape[0], rows.shape[1],
                       rows.shape[0] // max(1, amax.numel()), amax.data_ptr(), _threads(threads), isa)
    return amax if status == "ok" else None


def _threads(threads: Optional[int]) -> int:
    return _native.get_num_threads() if threads is None else threads
