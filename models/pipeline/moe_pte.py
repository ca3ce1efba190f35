"""Qwen3.5-MoE experts in a .pte: llmq's quantized_moe_ffn op as an ExecuTorch kernel.

* The op keeps its torch form through export: `torch.ops.llmq.quantized_moe_ffn` is a custom op with
  no decomposition, so torch.export, to_edge and XNNPACK's partitioner leave it as one node.
  `to_executorch` swaps every op for its out variant; this module defines that variant,
  `llmq::quantized_moe_ffn.out(..., *, Tensor(a!) out) -> Tensor(a!)`, with an eager kernel (the
  functional op, copied into `out`) and a fake kernel, so the pass finds it.
* At run time the .pte calls the kernel registered under `llmq::quantized_moe_ffn.out` by
  //cpp/moe:_moe_executorch_kernel.so (cpp/moe/moe_executorch_op.cc: the same torch-free C++ kernel as
  the torch op, so the same numbers). `load_executorch_kernel()` (llmq/ops/executorch_kernel.py) loads
  that library into the process after executorch's Python runtime, whose libexecutorch.so it links; its
  static initializer registers the kernel there.

The MoE blocks are swapped as for `--use_moe_quantized_op` (models/pipeline/moe_op_swap.py): the bundle's
expert stacks repacked into the kernel's tile layout, never re-quantized; the shared expert stays
next to the op (and becomes 8da linears with the rest of the model).
"""

from __future__ import annotations

from typing import List

import torch

# the kernel library's loader lives with the op (llmq.ops); re-exported for the pipeline's callers
from llmq.ops.executorch_kernel import (  # noqa: F401
    KERNEL_ENV_VAR,
    KERNEL_TARGET,
    OUT_OP,
    MoEExecuTorchKernelUnavailable,
    kernel_paths,
    load_executorch_kernel,
)

_OUT_SCHEMA = (
    "quantized_moe_ffn.out(Tensor x, Tensor router_weight, Tensor? expert_bias, Tensor w13_qdata, Tensor w13_sb, "
    "Tensor w2_qdata, Tensor w2_sb, int top_k, int bits, int group_size, str score_func='softmax', "
    "float route_scale=1.0, Tensor? shared_w13_qdata=None, Tensor? shared_w13_sb=None, "
    "Tensor? shared_w2_qdata=None, Tensor? shared_w2_sb=None, Tensor? shared_gate_weight=None, "
    "int shared_bits=4, int shared_group_size=32, int num_threads=0, *, Tensor(a!) out) -> Tensor(a!)"
)


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

def op_nodes(program) -> int:
    """How many calls of the op (functional or out variant) a program's graph holds."""
    return sum(1 for n in program.graph.nodes if n.op == "call_function" and "quantized_moe_ffn" in str(n.target))
