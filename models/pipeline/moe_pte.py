"""Qwen3.5-MoE experts in a .pte: llmq's quantized_moe_ffn op as an ExecuTorch kernel.

* The op keeps its torch form through export: `torch.ops.llmq.quantized_moe_ffn` is a custom op with
  no decomposition, so torch.export, to_edge and XNNPACK's partitioner leave it as one node.
  `to_executorch` swaps every op for its out variant; this module defines that variant,
  `llmq::quantized_moe_ffn.out(..., *, Tensor(a!) out) -> Tensor(a!)`, with an eager kernel (the
  functional op, copied into `out`) and a fake kernel, so the pass finds it.
* At run time the .pte calls the kernel registered under `llmq::quantized_moe_ffn.out` by
  //cpp/moe:_moe_executorch_kernel.so (cpp/moe/moe_executorch_op.cc: the same torch-free C++ kernel as
  the torch op, so the same numbers). `load_executorch_kernel()` loads that library into the process
  after executorch's Python runtime, whose libexecutorch.so it links; its static initializer registers
  the kernel there.

The MoE blocks are swapped as for `--use_moe_quantized_op` (models/pipeline/moe_op_swap.py): the bundle's
expert stacks repacked into the kernel's tile layout, never re-quantized; the shared expert stays
next to the op (and becomes 8da linears with the rest of the model).
"""

from __future__ import annotations

import ctypes
import os
from typing import List, Optional

import torch

from llmq._extensions import find_extension

OUT_OP = "llmq::quantized_moe_ffn.out"
KERNEL_ENV_VAR = "LLMQ_MOE_EXECUTORCH_KERNEL"
KERNEL_TARGET = "//cpp/moe:_moe_executorch_kernel.so"

_OUT_SCHEMA = (
    "quantized_moe_ffn.out(Tensor x, Tensor router_weight, Tensor? expert_bias, Tensor w13_qdata, Tensor w13_sb, "
    "Tensor w2_qdata, Tensor w2_sb, int top_k, int bits, int group_size, str score_func='softmax', "
    "float route_scale=1.0, Tensor? shared_w13_qdata=None, Tensor? shared_w13_sb=None, "
    "Tensor? shared_w2_qdata=None, Tensor? shared_w2_sb=None, Tensor? shared_gate_weight=None, "
    "int shared_bits=4, int shared_group_size=32, int num_threads=0, *, Tensor(a!) out) -> Tensor(a!)"
)


class MoEExecuTorchKernelUnavailable(RuntimeError):
    """//cpp/moe:_moe_executorch_kernel.so is not built or does not load into executorch's runtime."""


def _define_out_variant() -> None:
    import llmq.ops  # noqa: F401  (defines llmq::quantized_moe_ffn: schema, fake and CPU kernels)

    if hasattr(torch.ops.llmq.quantized_moe_ffn, "out"):
        return
    lib = torch.library.Library("llmq", "FRAGMENT")
    lib.define(_OUT_SCHEMA)

    def eager(*args, out, **kwargs):
        out.copy_(torch.ops.llmq.quantized_moe_ffn.default(*args, **kwargs))
        return out

    def fake(*args, out, **kwargs):
        torch.ops.llmq.quantized_moe_ffn.default(*args, **kwargs)  # the functional fake kernel's checks
        return out

    lib.impl("quantized_moe_ffn.out", eager, "CPU")
    torch.library.register_fake("llmq::quantized_moe_ffn.out", fake, lib=lib)
    _LIBS.append(lib)  # a Library unregisters its definitions when collected


_LIBS: List[torch.library.Library] = []
_define_out_variant()

_loaded: Optional[str] = None


def kernel_paths() -> List[str]:
    env = os.environ.get(KERNEL_ENV_VAR)
    if env:
        if not os.path.isfile(env):
            raise MoEExecuTorchKernelUnavailable(f"{KERNEL_ENV_VAR}={env} does not name a file "
                                                 "(expected the built _moe_executorch_kernel.so)")
        return [env]
    return find_extension("moe", "_moe_executorch_kernel")


def load_executorch_kernel() -> str:
    """Register llmq::quantized_moe_ffn.out with executorch's runtime (once); returns the library's path.
    Raises MoEExecuTorchKernelUnavailable naming what is missing."""
    global _loaded
    if _loaded is not None:
        return _loaded
    from executorch.extension.pybindings import portable_lib  # loads the runtime (libexecutorch.so) first

    problems = []
    for path in kernel_paths():
        try:
            ctypes.CDLL(path)
        except OSError as e:
            problems.append(f"{path}: {e}")
            continue
        if OUT_OP not in portable_lib._get_operator_names():
            problems.append(f"{path} loaded but {OUT_OP} is not in executorch's operator registry (a second "
                            "libexecutorch.so? build it against the installed executorch)")
            continue
        _loaded = path
        return path
    detail = "; ".join(problems) or "not found under cpp/moe in the runfiles or the checkout"
    raise MoEExecuTorchKernelUnavailable(f"the ExecuTorch MoE kernel {KERNEL_TARGET} is not available: {detail}. "
                                         f"Build it with Bazel (needs executorch installed) or set {KERNEL_ENV_VAR}")


def op_nodes(program) -> int:
    """How many calls of the op (functional or out variant) a program's graph holds."""
    return sum(1 for n in program.graph.nodes if n.op == "call_function" and "quantized_moe_ffn" in str(n.target))
