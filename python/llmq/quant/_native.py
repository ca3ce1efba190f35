"""Optional compiled fast path for `quantize_weight` (Bazel target //cpp/quant:_quant_kernel.so).

The kernel reproduces the torch reference in `llmq.quant.quantize` bit for bit (same float32
operations in the same order; docs/formats.md, "Performance"), so using it or not changes
speed only. It is torch-free and loaded by file path; when it cannot be found or loaded,
`quantize_weight` uses the torch path and says so once per process (a `NativeKernelFallback` warning
naming the reason; `native_kernel_error()` returns it). LLMQ_QUANT_KERNEL=off chooses the torch path
without the warning; LLMQ_QUANT_KERNEL=required makes a missing kernel an error. Search order
(llmq/_extensions.py):
  1. $LLMQ_QUANT_KERNEL: a path to the .so, or "off" / "0" to disable the kernel,
  2. llmq/_kernels/ (the pip wheel `llmq-quant`),
  3. cpp/quant/ relative to the repository root this file lives in (runfiles or checkout),
  4. bazel-bin/cpp/quant/ of that checkout,
  5. cpp/quant/ under every sys.path entry and under $RUNFILES_DIR / $TEST_SRCDIR workspaces.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType
from typing import Optional, Tuple

import torch

from llmq._extensions import find_extension, load_first

ENV_VAR = "LLMQ_QUANT_KERNEL"
_DISABLED = ("off", "0", "none", "false")
_REQUIRED = "required"
_INPUT_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

_module: Optional[ModuleType] = None
_error: Optional[str] = None
_threads = 0  # 0 = all hardware threads


class NativeKernelFallback(RuntimeWarning):
    """The compiled quantization kernel did not load; llmq.quant runs its torch reference (same results)."""


class NativeKernelMissing(RuntimeError):
    """LLMQ_QUANT_KERNEL=required and the compiled quantization kernel did not load."""


def _load() -> Optional[ModuleType]:
    """The extension module, or None (the reason is kept for native_kernel_error() and stated once)."""
    global _module, _error
    env = os.environ.get(ENV_VAR, "")
    if _module is not None or _error is not None:
        if _module is None and env.lower() == _REQUIRED:
            raise NativeKernelMissing(f"{ENV_VAR}=required: the compiled quantization kernel did not load: {_error}")
        return _module
    if env.lower() in _DISABLED and env:
        _error = f"disabled by {ENV_VAR}={env}"
        return None
    if env and env.lower() != _REQUIRED:
        paths = [env] if os.path.isfile(env) else []
        if not paths:
            _error = f"{ENV_VAR}={env} does not name a file (expected the built _quant_kernel.so)"
    else:
        paths = find_extension("quant", "_quant_kernel")
    module, problems = load_first("_quant_kernel", paths) if paths else (None, [])
    if module is not None:
        _module = module
        return module
    if _error is None:
        _error = "; ".join(problems) if problems else "no _quant_kernel*.so found in llmq/_kernels, cpp/quant or bazel-bin/cpp/quant"
    how = ("build //cpp/quant:_quant_kernel.so with Bazel or install the llmq-quant wheel (pip install .), "
           f"or set {ENV_VAR}=/path/to/_quant_kernel.so")
    if env.lower() == _REQUIRED:
        raise NativeKernelMissing(f"{ENV_VAR}=required: the compiled quantization kernel did not load: {_error}; {how}")
    warnings.warn(f"llmq: the compiled quantization kernel did not load ({_error}); using the torch reference "
                  f"(same results, slower). To use the kernel, {how}; {ENV_VAR}=off silences this.",
                  NativeKernelFallback, stacklevel=3)
    return None


def native_kernel_available() -> bool:
    """True if the compiled quantization kernel loads (quantize_weight then uses it)."""
    return _load() is not None


def native_kernel_error() -> Optional[str]:
    """Why the kernel is not in use (None when it is)."""
    _load()
    return _error


def best_isa() -> Optional[str]:
    """The ISA path the kernel picks on this CPU ('avx512', 'avx2', 'scalar'), or None."""
    m = _load()
    return m.best_isa() if m is not None else None


def set_num_threads(threads: int) -> None:
    """Threads the kernel splits rows over; 0 (the default) means all hardware threads."""
    global _threads
    if not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads must be an int >= 0, got {threads!r}")
    _threads = threads


def get_num_threads() -> int:
    return _threads


def applicable(w: torch.Tensor) -> bool:
    """Whether the kernel can take this tensor directly (a plain CPU tensor of a float type)."""
    return (
        type(w) in (torch.Tensor, torch.nn.Parameter)
        and w.device.type == "cpu"
        and w.dtype in _INPUT_NAMES
        and _load() is not None
    )


def quantize_rows(
    rows: torch.Tensor, bits: int, group_size: int, symmetric: bool, *, threads: Optional[int] = None, isa: str = "auto"
) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """rows[R, K] (CPU float) -> (qdata [R, K*bits/8], scale [R, G], bias [R, G]), or None if
    the kernel met a NaN/Inf or an overflowing group range (the caller's reference path then
    raises its error, naming the tensor). The caller has validated the configuration."""
    m = _load()
    if m is None:
        raise RuntimeError(f"the quantization kernel is not available: {_error}")
    rows = rows.detach().contiguous()
    r, k = rows.shape
    qdata = torch.empty(r, k * bits // 8, dtype=torch.uint8)
    scale = torch.empty(r, k // group_size, dtype=torch.float32)
    bias = torch.empty(r, k // group_size, dtype=torch.float32)
    status = m.quantize(
        rows.data_ptr(), _INPUT_NAMES[rows.dtype], r, k, bits, group_size, bool(symmetric),
        qdata.data_ptr(), scale.data_ptr(), bias.data_ptr(),
        _threads if threads is None else threads, isa,
    )
    return (qdata, scale, bias) if status == "ok" else None


def search_available() -> bool:
    """Whether the loaded kernel has method "search" (an older .so picked by LLMQ_QUANT_KERNEL may not)."""
    m = _load()
    return m is not None and hasattr(m, "search_qparams")


def _qparams_buffers(g: torch.Tensor, group_size: int, *, with_zero: bool):
    """(loaded module, g as contiguous float32, scale [R, G], zero [R, G] or None) for a per-group
    parameter search; RuntimeError when the kernel is not available."""
    m = _load()
    if m is None:
        raise RuntimeError(f"the quantization kernel is not available: {_error}")
    g = g.detach().to(torch.float32).contiguous()
    groups = (g.shape[0], g.shape[1] // group_size)
    zero = torch.empty(groups, dtype=torch.float32) if with_zero else None
    return m, g, torch.empty(groups, dtype=torch.float32), zero


def _importance(importance: Optional[torch.Tensor], k: int) -> Optional[torch.Tensor]:
    imp = None if importance is None else importance.detach().to(torch.float32).contiguous()
    if imp is not None and imp.numel() != k:
        raise ValueError(f"importance has {imp.numel()} values; expected K={k}")
    return imp


def search_qparams(g: torch.Tensor, group_size: int, bits: int, symmetric: bool, *,
                   importance: Optional[torch.Tensor] = None, threads: Optional[int] = None, isa: str = "auto"):
    """Method "search" on float32 CPU rows g[R, K]: (scale [R, G], zero [R, G] or None when
    symmetric), bit-identical to llmq.quant.search.search_qparams_torch. The caller has
    checked that g is finite and the configuration valid. importance: optional positive
    float32 [K]. isa "scalar" forces the portable path (tests: both give the same bits)."""
    m, g, scale, zero = _qparams_buffers(g, group_size, with_zero=not symmetric)
    r, k = g.shape
    imp = _importance(importance, k)
    m.search_qparams(g.data_ptr(), r, k, group_size, bits, bool(symmetric), scale.data_ptr(),
                     0 if zero is None else zero.data_ptr(), _threads if threads is None else threads,
                     0 if imp is None else imp.data_ptr(), isa)
    return scale, zero


def search_quantize_available() -> bool:
    """Whether the loaded kernel has method "search" end to end (codes and packing included)."""
    m = _load()
    return m is not None and hasattr(m, "search_quantize")


def search_quantize_rows(
    rows: torch.Tensor, bits: int, group_size: int, symmetric: bool, *, importance: Optional[torch.Tensor] = None,
    threads: Optional[int] = None, isa: str = "auto",
) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Method "search" end to end, like quantize_rows: rows[R, K] (CPU float) -> (qdata, scale,
    bias) bit-identical to the torch reference, or None on NaN/Inf or an overflowing range.
    importance: optional positive float32 [K] (validated by the caller)."""
    m = _load()
    if m is None or not hasattr(m, "search_quantize"):
        raise RuntimeError(f"the quantization kernel has no search_quantize: {_error or 'an older build'}")
    rows = rows.detach().contiguous()
    r, k = rows.shape
    imp = _importance(importance, k)
    qdata = torch.empty(r, k * bits // 8, dtype=torch.uint8)
    scale = torch.empty(r, k // group_size, dtype=torch.float32)
    bias = torch.empty(r, k // group_size, dtype=torch.float32)
    status = m.search_quantize(
        rows.data_ptr(), _INPUT_NAMES[rows.dtype], r, k, bits, group_size, bool(symmetric),
        qdata.data_ptr(), scale.data_ptr(), bias.data_ptr(), _threads if threads is None else threads, isa,
        0 if imp is None else imp.data_ptr(),
    )
    return (qdata, scale, bias) if status == "ok" else None


def int4_mma_tiles_available() -> bool:
    """Whether the loaded kernel has pack_int4_mma_tiles (an older .so picked by LLMQ_QUANT_KERNEL may not)."""
    m = _load()
    return m is not None and hasattr(m, "pack_int4_mma_tiles")


def pack_int4_mma_tiles(qdata: torch.Tensor, inner_k_tiles: int, *, threads: Optional[int] = None,
                        out: Optional[torch.Tensor] = None, simd: bool = True) -> torch.Tensor:
    """Canonical 4-bit bytes uint8 [..., N, K/2] -> int32 m16n8k16 B-fragment tiles
    [..., ceil(N/8), K/(16T), 32, T/2] (cpp/quant/int4_tiles.h); rows past N are zero. The
    caller has checked T and K (tinygemm.py, whose torch path this equals bit for bit).
    out: optional contiguous int32 CPU tensor of that shape to write into (e.g. huge-page
    backed memory: fresh 4 KiB pages cost more to fault in than the packing itself).
    simd=False forces the portable path (for tests: both give the same bytes)."""
    m = _load()
    if m is None or not hasattr(m, "pack_int4_mma_tiles"):
        raise RuntimeError(f"the quantization kernel has no pack_int4_mma_tiles: {_error or 'an older build'}")
    q = qdata.detach().contiguous()
    *lead, n, kb = q.shape
    batch = 1
    for d in lead:
        batch *= d
    t = inner_k_tiles
    shape = (*lead, -(-n // 8), 2 * kb // (16 * t), 32, t // 2)
    if out is None:
        out = torch.empty(shape, dtype=torch.int32)
    elif (out.dtype != torch.int32 or tuple(out.shape) != shape or not out.is_contiguous()
          or out.device.type != "cpu"):
        raise ValueError(f"out must be a contiguous CPU int32 tensor {list(shape)}, got {out.dtype} "
                         f"{list(out.shape)} on {out.device}")
    m.pack_int4_mma_tiles(q.data_ptr(), batch, n, kb, t, out.data_ptr(),
                          (_threads or torch.get_num_threads()) if threads is None else threads, bool(simd))
    return out


def gguf_decode_available() -> bool:
    """Whether the loaded kernel has the GGUF block decoder (an older .so picked by LLMQ_QUANT_KERNEL may not)."""
    m = _load()
    return m is not None and hasattr(m, "gguf_decode")


def gguf_decode(type_name: str, geometry: Tuple[int, int, int, int], blocks: torch.Tensor, qdata: torch.Tensor,
                scale: torch.Tensor, bias: torch.Tensor, *, threads: Optional[int] = None) -> None:
    """Whole GGUF blocks (contiguous CPU uint8, n_blocks * block_bytes) -> the canonical codes, scales and
    biases written into qdata (uint8, n_blocks*block*bits/8), scale and bias (float32, n_blocks*block/group
    each), all contiguous CPU tensors (cpp/quant/gguf_blocks.h). geometry: the type's (elements per block,
    bytes per block, canonical bits, canonical group size), from its format module (formats.gguf_blocks)."""
    m = _load()
    if m is None or not hasattr(m, "gguf_decode"):
        raise RuntimeError(f"the quantization kernel has no gguf_decode: {_error or 'an older build'}")
    for t, dtype in ((blocks, torch.uint8), (qdata, torch.uint8), (scale, torch.float32), (bias, torch.float32)):
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"gguf_decode needs contiguous CPU {dtype} buffers, got {t.dtype} on {t.device}")
    block, block_bytes, bits, group = geometry
    n_blocks = blocks.numel() // block_bytes
    if (blocks.numel() % block_bytes or qdata.numel() != n_blocks * block * bits // 8
            or scale.numel() != n_blocks * block // group or bias.numel() != scale.numel()):
        raise ValueError(f"gguf_decode: {blocks.numel()} bytes of {type_name} blocks do not match the outputs")
    m.gguf_decode(type_name, blocks.data_ptr(), n_blocks, qdata.data_ptr(), scale.data_ptr(), bias.data_ptr(),
                  (_threads or torch.get_num_threads()) if threads is None else threads)


def count_nonfinite(t: torch.Tensor) -> Optional[Tuple[int, int]]:
    """(NaN count, Inf count) of a contiguous CPU float32/bfloat16/float16 tensor from its bit
    patterns on the calling thread, or None when the kernel is not loaded or the tensor is
    not such a tensor (the caller then uses torch)."""
    m = _load()
    if (m is None or type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu"
            or t.dtype not in _INPUT_NAMES or not t.is_contiguous()):
        return None
    nan, inf = m.count_nonfinite(t.data_ptr(), _INPUT_NAMES[t.dtype], t.numel())
    return int(nan), int(inf)



def hqq_available() -> bool:
    """Whether the loaded kernel has method "hqq" (an older .so picked by LLMQ_QUANT_KERNEL may not)."""
    m = _load()
    return m is not None and hasattr(m, "hqq_qparams")


def hqq_qparams(g: torch.Tensor, group_size: int, bits: int, *, importance: Optional[torch.Tensor] = None,
                threads: Optional[int] = None):
    """Method "hqq" on finite float32 CPU rows g[R, K]: (scale [R, G], float zero [R, G]),
    bit-identical to llmq.quant.hqq.hqq_qparams_torch with its default parameters.
    importance: optional positive float32 [K] weighting each input channel (validated by the caller)."""
    m, g, scale, zero = _qparams_buffers(g, group_size, with_zero=True)
    r, k = g.shape
    imp = None if importance is None else importance.detach().to(torch.float32).contiguous()
    if imp is not None and imp.numel() != k:
        raise ValueError(f"importance has {imp.numel()} values; expected K={k}")
    m.hqq_qparams(g.data_ptr(), r, k, group_size, bits, scale.data_ptr(), zero.data_ptr(),
                  _threads if threads is None else threads, 0 if imp is None else imp.data_ptr())
    return scale, zero
