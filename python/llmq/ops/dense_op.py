"""torch.ops.llmq.quantized_linear: y = x W^T on one INT4/INT8 matrix in the MoE kernel's tiles.

The dense sibling of quantized_moe_ffn, in the same compiled library (cpp/moe: `dense_linear`
in moe_kernel.cc, its dispatcher kernel in moe_torch_op.cc). Same numerical contract
(docs/moe_kernel.md): x is quantized per row and per weight group to int8 (scale amax/127),
the product is exactly W_deq . (scale * xq) accumulated in fp32; results are bit-identical
across ISA paths and thread counts. The fake kernel here and the C++ kernel make the same
checks with the same messages.

`install_dense_kernel()` puts the kernel into llmq.quant.modules (set_linear_kernel), so every
QuantizedLinear whose weight the kernel takes (INT4/INT8, group a multiple of 32 dividing K, any
N) computes with it in eager CPU inference; `llmq.quant.modules.reference_linears()` switches back
to the dequantize path for a block of code. Importing this module installs nothing: a process
opts in (a quantized model's eager run, e.g. verification or generation), so code that compares
eager against an exported dequantize graph keeps comparing like with like.
"""

from __future__ import annotations

from typing import Optional

import torch

from llmq.ops.kernel_loader import MoEKernelUnavailable, load_kernel
from llmq.ops.packing import PackedLinear, linear_layout_problem, pack_linear
from llmq.quant import modules
from llmq.quant.formats import GroupQuantizedWeight

_SCHEMA = ("quantized_linear(Tensor x, Tensor qdata, Tensor sb, int out_features, int bits, int group_size, "
           "int num_threads=0) -> Tensor")
_OP_NAME = "llmq::quantized_linear"
_LIB = torch.library.Library("llmq", "FRAGMENT")
_LIB.define(_SCHEMA)
_cpp_kernel_registered = False


def _fail(message: str) -> None:
    raise ValueError(f"quantized_linear: {message}")


def check_linear_args(x, qdata, sb, out_features: int, bits: int, group_size: int, num_threads: int) -> None:
    """Shape/dtype checks of the fake kernel; cpp/moe/moe_torch_op.cc makes the same, worded alike."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16):
        _fail(f"x must be float32 or bfloat16 [T, K], got {x.dtype} {list(x.shape)}")
    k = x.shape[1]
    if bits not in (4, 8):
        _fail(f"bits must be 4 or 8, got {bits}")
    if group_size <= 0 or group_size % 32 or k % group_size:
        _fail(f"group_size {group_size} must be a positive multiple of 32 dividing K={k}")
    row = 16 * k * bits // 8
    if qdata.dim() != 2 or qdata.dtype != torch.uint8 or qdata.shape[1] != row:
        _fail(f"qdata must be torch.uint8 [N/16, {row}], got {qdata.dtype} {list(qdata.shape)}")
    n = qdata.shape[0] * 16
    sb_shape = [n // 16, 32 * (k // group_size)]
    if sb.dtype not in (torch.float32, torch.bfloat16) or list(sb.shape) != sb_shape:
        _fail(f"sb must be float32 or bfloat16 {sb_shape}, got {sb.dtype} {list(sb.shape)}")
    if not n - 16 < out_features <= n:
        _fail(f"out_features={out_features} does not fit {n} packed rows")
    if num_threads < 0:
        _fail(f"num_threads must be >= 0 (0 = torch.get_num_threads()), got {num_threads}")


def _register_cpu_kernel() -> None:
    global _cpp_kernel_registered
    problem = None
    try:
        kernel = load_kernel()
        if not torch._C._dispatch_has_kernel_for_dispatch_key(_OP_NAME, "CPU"):
            problem = f"{kernel.__file__} loaded but registered no CPU kernel for {_OP_NAME}; rebuild it"
    except MoEKernelUnavailable as e:
        problem = str(e)
    if problem is not None:
        def stub(*args, **kwargs):
            raise MoEKernelUnavailable(problem)

        _LIB.impl("quantized_linear", stub, "CPU")
        return
    _cpp_kernel_registered = True


_register_cpu_kernel()
_LIB.impl("quantized_linear", torch.library.fallthrough_kernel, "Autograd")


@torch.library.register_fake(_OP_NAME, lib=_LIB)
def _(x, qdata, sb, out_features, bits, group_size, num_threads=0):
    check_linear_args(x, qdata, sb, out_features, bits, group_size, num_threads)
    return x.new_empty(x.shape[0], out_features)


def quantized_linear_available() -> bool:
    """True when the compiled CPU kernel of llmq::quantized_linear is registered."""
    return _cpp_kernel_registered


def quantized_linear(x: torch.Tensor, packed: PackedLinear, num_threads: int = 0) -> torch.Tensor:
    """x [..., K] (float32/bfloat16) @ W^T -> [..., N] in x's dtype, W packed by pack_linear."""
    lead = x.shape[:-1]
    y = torch.ops.llmq.quantized_linear(x.reshape(-1, x.shape[-1]), packed.qdata, packed.sb, packed.out_features,
                                        packed.bits, packed.group_size, num_threads)
    return y.reshape(*lead, packed.out_features)


class DenseKernel:
    """llmq.quant.modules.LinearKernel backed by llmq::quantized_linear."""

    def pack(self, qw: GroupQuantizedWeight) -> Optional[PackedLinear]:
        return None if linear_layout_problem(qw) else pack_linear(qw)

    def linear(self, x: torch.Tensor, packed: PackedLinear) -> torch.Tensor:
        return quantized_linear(x, packed)


def install_dense_kernel() -> bool:
    """Make QuantizedLinear compute with llmq::quantized_linear where it can; returns whether the
    compiled kernel is there (False: nothing installed, every linear keeps dequantizing)."""
    if not _cpp_kernel_registered:
        return False
    if not isinstance(modules.linear_kernel(), DenseKernel):
        modules.set_linear_kernel(DenseKernel())
    return True
