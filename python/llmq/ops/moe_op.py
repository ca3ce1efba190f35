"""torch.ops.llmq.quantized_moe_ffn: schema, argument checks, CPU kernel and fake kernel.

The CPU kernel is C++ (cpp/moe/moe_torch_op.cc): loading the compiled extension
(llmq.ops.kernel_loader, at import) registers it with the dispatcher, so a call never runs
Python. Without the extension the CPU kernel is a stub that raises MoEKernelUnavailable
naming the missing library. The fake kernel only checks shapes and dtypes, so the op
traces and exports without the extension. Both run the same checks (check_moe_args here,
its C++ mirror there), so bad input fails the same way at trace time and at run time.

Numerical contract (docs/moe_kernel.md): router logits and scores in fp32; activations
(x and the SwiGLU output) quantized per row and per weight group to int8 with
scale = amax/127; each matmul is exactly W_deq . (scale * q) accumulated in fp32.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from llmq.ops.kernel_loader import MoEKernelUnavailable, load_kernel, moe_kernel_available
from llmq.ops.packing import check_kernel_layout

SCORE_FUNCS = ("softmax", "sigmoid")
_isa = os.environ.get("LLMQ_MOE_ISA", "auto")
_schedule = "auto"


def set_kernel_isa(name: str) -> str:
    """Force an instruction-set path ("auto", "scalar", "avx2", "avx512_vnni"); returns the
    old one. All paths compute bit-identical results; this exists for tests and benchmarks."""
    global _isa
    if name not in ("auto", "scalar", "avx2", "avx512_vnni"):
        raise ValueError(f"unknown isa {name!r}; expected auto, scalar, avx2 or avx512_vnni")
    if moe_kernel_available():
        load_kernel().set_op_isa(name)
    old, _isa = _isa, name
    return old


def set_kernel_schedule(name: str) -> str:
    """Force the w2 work split ("auto", "by_expert", "by_columns"; see moe_kernel.h);
    returns the old one. Results are bit-identical; this exists for tests and benchmarks."""
    global _schedule
    if name not in ("auto", "by_expert", "by_columns"):
        raise ValueError(f"unknown schedule {name!r}; expected auto, by_expert or by_columns")
    if moe_kernel_available():
        load_kernel().set_op_schedule(name)
    old, _schedule = _schedule, name
    return old


def _expect(t: torch.Tensor, name: str, dtype: torch.dtype, shape) -> None:
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise ValueError(f"quantized_moe_ffn: {name} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")


_SB_DTYPES = (torch.float32, torch.bfloat16)  # scale/bias: exact float32, or compact bfloat16


def _check_sb_pair(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"quantized_moe_ffn: {what} w13_sb and w2_sb must share a dtype (float32 or bfloat16), "
                         f"got {a.dtype} and {b.dtype}")


def _check_matrix(q: torch.Tensor, sb: torch.Tensor, name: str, e: int, n: int, k: int, bits: int, gs: int):
    check_kernel_layout(n, k, bits, gs, f"quantized_moe_ffn: {name}")
    _expect(q, f"{name}_qdata", torch.uint8, (e, n // 16, 16 * k * bits // 8))
    if sb.dtype not in _SB_DTYPES or tuple(sb.shape) != (e, n // 16, 32 * (k // gs)):
        raise ValueError(f"quantized_moe_ffn: {name}_sb must be float32 or bfloat16 {[e, n // 16, 32 * (k // gs)]}, "
                         f"got {sb.dtype} {list(sb.shape)}")


def check_moe_args(x, router_weight, expert_bias, w13_qdata, w13_sb, w2_qdata, w2_sb, top_k, bits, group_size,
                   score_func, shared_w13_qdata, shared_w13_sb, shared_w2_qdata, shared_w2_sb,
                   shared_gate_weight, shared_bits, shared_group_size, num_threads):
    """Shape/dtype checks of the fake kernel (and of kernel_route); returns (E, D, F, Fs).
    cpp/moe/moe_torch_op.cc makes the same checks with the same messages for the CPU kernel."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantized_moe_ffn: x must be float32 or bfloat16 [T, D], got {x.dtype} {list(x.shape)}")
    d = x.shape[1]
    if router_weight.dim() != 2 or router_weight.dtype != torch.float32:
        raise ValueError(
            f"quantized_moe_ffn: router_weight must be float32 [E, D], got {router_weight.dtype} {list(router_weight.shape)}"
        )
    e = router_weight.shape[0]
    _expect(router_weight, "router_weight", torch.float32, (e, d))
    if not 1 <= top_k <= e:
        raise ValueError(f"quantized_moe_ffn: top_k={top_k} must be in [1, num_experts={e}]")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"quantized_moe_ffn: score_func {score_func!r} unknown; expected one of {SCORE_FUNCS}")
    if expert_bias is not None:
        if score_func != "sigmoid":
            raise ValueError("quantized_moe_ffn: expert_bias (selection-only bias) is used with score_func='sigmoid'")
        _expect(expert_bias, "expert_bias", torch.float32, (e,))
    if w13_qdata.dim() != 3 or w13_qdata.shape[0] != e:
        raise ValueError(
            f"quantized_moe_ffn: w13_qdata must be uint8 [E={e}, 2F/16, 16*D*bits/8], got {list(w13_qdata.shape)}"
        )
    f = w13_qdata.shape[1] * 8
    for dim, what in ((d, "the hidden size D"), (f, "the expert intermediate size F")):
        if group_size > 0 and dim % group_size:
            raise ValueError(f"quantized_moe_ffn: group_size {group_size} does not divide {what}={dim}")
    _check_matrix(w13_qdata, w13_sb, "w13", e, 2 * f, d, bits, group_size)
    _check_matrix(w2_qdata, w2_sb, "w2", e, d, f, bits, group_size)
    _check_sb_pair(w13_sb, w2_sb, "routed")
    parts = (shared_w13_qdata, shared_w13_sb, shared_w2_qdata, shared_w2_sb)
    fs = 0
    if any(p is not None for p in parts):
        if any(p is None for p in parts):
            raise ValueError("quantized_moe_ffn: give all four shared expert tensors (w13/w2 qdata and sb) or none")
        if shared_w13_qdata.dim() != 3 or shared_w13_qdata.shape[0] != 1:
            raise ValueError(
                f"quantized_moe_ffn: shared_w13_qdata must be uint8 [1, 2Fs/16, ...], got {list(shared_w13_qdata.shape)}"
            )
        fs = shared_w13_qdata.shape[1] * 8
        _check_matrix(shared_w13_qdata, shared_w13_sb, "shared_w13", 1, 2 * fs, d, shared_bits, shared_group_size)
        _check_matrix(shared_w2_qdata, shared_w2_sb, "shared_w2", 1, d, fs, shared_bits, shared_group_size)
        _check_sb_pair(shared_w13_sb, shared_w2_sb, "shared")
        if shared_gate_weight is not None:
            _expect(shared_gate_weight, "shared_gate_weight", torch.float32, (1, d))
    elif shared_gate_weight is not None:
        raise ValueError("quantized_moe_ffn: shared_gate_weight given without a shared expert")
    if num_threads < 0:
        raise ValueError(f"quantized_moe_ffn: num_threads must be >= 0 (0 = torch.get_num_threads()), got {num_threads}")
    # (mixed meta and CPU tensors reach this fake kernel, which would return garbage)
    named = (("router_weight", router_weight), ("expert_bias", expert_bias), ("w13_qdata", w13_qdata),
             ("w13_sb", w13_sb), ("w2_qdata", w2_qdata), ("w2_sb", w2_sb), ("shared_w13_qdata", shared_w13_qdata),
             ("shared_w13_sb", shared_w13_sb), ("shared_w2_qdata", shared_w2_qdata), ("shared_w2_sb", shared_w2_sb),
             ("shared_gate_weight", shared_gate_weight))
    for name, t in named:
        if t is not None and t.device.type != x.device.type:
            raise ValueError(f"quantized_moe_ffn: {name} is on {t.device.type} but x on {x.device.type}; "
                             "all tensors must be on one device")
    return e, d, f, fs


# Registered with torch.library.Library rather than the custom_op decorator: the op is
# called once per MoE layer per decoded token, and custom_op's Python wrapper (autograd
# stub, argument re-binding) cost ~10 us of the ~40 us a small-shape call took end to end.
_SCHEMA = (
    "quantized_moe_ffn(Tensor x, Tensor router_weight, Tensor? expert_bias, Tensor w13_qdata, Tensor w13_sb, "
    "Tensor w2_qdata, Tensor w2_sb, int top_k, int bits, int group_size, str score_func='softmax', "
    "float route_scale=1.0, Tensor? shared_w13_qdata=None, Tensor? shared_w13_sb=None, "
    "Tensor? shared_w2_qdata=None, Tensor? shared_w2_sb=None, Tensor? shared_gate_weight=None, "
    "int shared_bits=4, int shared_group_size=32, int num_threads=0) -> Tensor"
)
_OP_NAME = "llmq::quantized_moe_ffn"
_LIB = torch.library.Library("llmq", "FRAGMENT")
_LIB.define(_SCHEMA)


_cpp_kernel_registered = False


def _missing_kernel_stub(problem: str):
    def kernel(*args, **kwargs):
        raise MoEKernelUnavailable(problem)

    return kernel


def _register_cpu_kernel() -> None:
    """Load the extension now: its C++ registrar adds the CPU kernel to the schema above.
    Without it (not built, or built before it registered the op) the CPU kernel is a stub
    that raises MoEKernelUnavailable, so the schema and fake kernel still work."""
    global _cpp_kernel_registered
    try:
        kernel = load_kernel()
    except MoEKernelUnavailable as e:  # names the library and how to build it
        _LIB.impl("quantized_moe_ffn", _missing_kernel_stub(str(e)), "CPU")
        return
    if not torch._C._dispatch_has_kernel_for_dispatch_key(_OP_NAME, "CPU"):
        _LIB.impl("quantized_moe_ffn", _missing_kernel_stub(
            f"{kernel.__file__} loaded but registered no CPU kernel for {_OP_NAME}; rebuild //cpp/moe:_moe_kernel.so"),
            "CPU")
        return
    _cpp_kernel_registered = True
    kernel.set_op_isa(_isa)  # LLMQ_MOE_ISA, if set
    kernel.set_op_schedule(_schedule)


_register_cpu_kernel()


# Not differentiable (an inference kernel on quantized weights): autograd falls through, as
# PyTorch prescribes for such ops, so the output never requires grad and a backward through
# it fails with "does not require grad" instead of silently returning no gradient. (A Python
# autograd kernel that raised in backward cost ~9 us per call, as much as custom_op did.)
_LIB.impl("quantized_moe_ffn", torch.library.fallthrough_kernel, "Autograd")


@torch.library.register_fake("llmq::quantized_moe_ffn", lib=_LIB)
def _(x, router_weight, expert_bias, w13_qdata, w13_sb, w2_qdata, w2_sb, top_k, bits, group_size,
      score_func="softmax", route_scale=1.0, shared_w13_qdata=None, shared_w13_sb=None, shared_w2_qdata=None,
      shared_w2_sb=None, shared_gate_weight=None, shared_bits=4, shared_group_size=32, num_threads=0):
    check_moe_args(x, router_weight, expert_bias, w13_qdata, w13_sb, w2_qdata, w2_sb, top_k, bits, group_size,
                   score_func, shared_w13_qdata, shared_w13_sb, shared_w2_qdata, shared_w2_sb, shared_gate_weight,
                   shared_bits, shared_group_size, num_threads)
    return torch.empty_like(x)


def quantized_moe_ffn(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    expert_bias: Optional[torch.Tensor],
    w13_qdata: torch.Tensor,
    w13_sb: torch.Tensor,
    w2_qdata: torch.Tensor,
    w2_sb: torch.Tensor,
    top_k: int,
    bits: int,
    group_size: int,
    score_func: str = "softmax",
    route_scale: float = 1.0,
    shared_w13_qdata: Optional[torch.Tensor] = None,
    shared_w13_sb: Optional[torch.Tensor] = None,
    shared_w2_qdata: Optional[torch.Tensor] = None,
    shared_w2_sb: Optional[torch.Tensor] = None,
    shared_gate_weight: Optional[torch.Tensor] = None,
    shared_bits: int = 4,
    shared_group_size: int = 32,
    num_threads: int = 0,
) -> torch.Tensor:
    """Fused MoE FFN on kernel-packed INT4/INT8 experts (see llmq.ops.packing); returns [T, D] in
    x's dtype. Calls torch.ops.llmq.quantized_moe_ffn (so it traces and exports as that op)."""
    return torch.ops.llmq.quantized_moe_ffn(
        x, router_weight, expert_bias, w13_qdata, w13_sb, w2_qdata, w2_sb, top_k, bits, group_size, score_func,
        route_scale, shared_w13_qdata, shared_w13_sb, shared_w2_qdata, shared_w2_sb, shared_gate_weight,
        shared_bits, shared_group_size, num_threads)


def _kernel_args(x, router_weight, expert_bias, w13_qdata, w13_sb, w2_qdata, w2_sb, top_k, bits, group_size,
                 score_func, route_scale, shared_w13_qdata, shared_w13_sb, shared_w2_qdata, shared_w2_sb,
                 shared_gate_weight, shared_bits, shared_group_size, num_threads):
    """Validated, contiguous float32 inputs and the address dict the extension takes.
    The returned dict "keep" entry holds the tensors alive while the kernel runs."""
    e, d, f, fs = check_moe_args(
        x, router_weight, expert_bias, w13_qdata, w13_sb, w2_qdata, w2_sb, top_k, bits, group_size, score_func,
        shared_w13_qdata, shared_w13_sb, shared_w2_qdata, shared_w2_sb, shared_gate_weight, shared_bits,
        shared_group_size, num_threads)
    keep = [x.to(torch.float32).contiguous()]

    def addr(t):
        if t is None:
            return 0
        t = t.contiguous()
        keep.append(t)
        return t.data_ptr()

    shared = shared_w13_qdata is not None
    info = {
        "x": keep[0].data_ptr(), "tokens": x.shape[0], "hidden": d,
        "router": addr(router_weight), "expert_bias": addr(expert_bias), "experts": e, "top_k": top_k,
        "score_func": score_func, "route_scale": float(route_scale), "intermediate": f,
        "bits": bits, "group_size": group_size,
        "w13_q": addr(w13_qdata), "w13_sb": addr(w13_sb), "w2_q": addr(w2_qdata), "w2_sb": addr(w2_sb),
        "shared_w13_q": addr(shared_w13_qdata) if shared else 0,
        "shared_w13_sb": addr(shared_w13_sb) if shared else 0,
        "shared_w2_q": addr(shared_w2_qdata) if shared else 0,
        "shared_w2_sb": addr(shared_w2_sb) if shared else 0,
        "shared_gate": addr(shared_gate_weight) if shared else 0,
        "shared_intermediate": fs, "shared_bits": shared_bits, "shared_group_size": shared_group_size,
        "sb_bf16": w13_sb.dtype == torch.bfloat16,
        "shared_sb_bf16": shared and shared_w13_sb.dtype == torch.bfloat16,
        "num_threads": num_threads or torch.get_num_threads(), "isa": _isa, "schedule": _schedule,
    }
    return {"dict": info, "keep": keep}


def kernel_route(x, router_weight, expert_bias, packed, top_k: int, score_func: str = "softmax",
                 route_scale: float = 1.0):
    """The kernel's own routing (expert indices int32 and weights float32, [T, top_k], sorted
    by score), so tests can check selection separately from the expert math."""
    args = _kernel_args(x, router_weight, expert_bias, packed.w13_qdata, packed.w13_sb, packed.w2_qdata,
                        packed.w2_sb, top_k, packed.bits, packed.group_size, score_func, route_scale,
                        None, None, None, None, None, 4, 32, 0)
    idx = torch.empty(x.shape[0], top_k, dtype=torch.int32)
    wts = torch.empty(x.shape[0], top_k, dtype=torch.float32)
    load_kernel().route(args["dict"], idx.data_ptr(), wts.data_ptr())
    return idx, wts


@torch.library.custom_op("llmq::quantized_moe_ffn_available", mutates_args=())
def quantized_moe_ffn_available() -> bool:
    """Registration probe as an op (torch.ops.llmq.quantized_moe_ffn_available()): True if
    the compiled kernel behind quantized_moe_ffn loaded and registered itself."""
    return _cpp_kernel_registered
