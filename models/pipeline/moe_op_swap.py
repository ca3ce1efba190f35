"""--use_moe_quantized_op: run a reloaded model's MoE blocks through torch.ops.llmq.quantized_moe_ffn.

The swap reuses the weights exactly as they were quantized (no re-quantization): the
canonical expert stacks are only repacked into the kernel's tile layout. The shared expert
and its sigmoid gate stay as they are (QuantizedLinear / Linear) next to the op.
"""

from __future__ import annotations

from typing import List

from torch import nn

from llmq.ops import load_kernel, pack_moe_experts
from llmq.ops.transform import QuantizedMoEBlock
from llmq.quant import GroupQuantizedWeight
from models.pipeline.quantized_model import QuantizedExperts, _StackedQuantized


def _canonical(holder: nn.Module) -> GroupQuantizedWeight:
    return GroupQuantizedWeight(qdata=holder.qdata, scale=holder.scale, bias=holder.bias, bits=holder.bits,
                                group_size=holder.group_size, shape=tuple(holder.qdata.shape[:-1]) + (holder.k,))


def use_quantized_moe_op(model: nn.Module, num_threads: int = 0) -> List[str]:
    """Swap every MoE block whose experts are INT4/INT8 quantized stacks; returns their fqns.
    Raises MoEKernelUnavailable (naming the extension) if the compiled kernel is missing."""
    load_kernel()
    swapped = []
    for name, block in list(model.named_modules()):
        experts = getattr(block, "experts", None)
        if not isinstance(experts, QuantizedExperts):
            continue
        if not (isinstance(experts.gate_up, _StackedQuantized) and isinstance(experts.down, _StackedQuantized)):
            continue
        w13, w2 = _canonical(experts.gate_up), _canonical(experts.down)
        if w13.bits not in (4, 8) or (w13.bits, w13.group_size) != (w2.bits, w2.group_size):
            continue  # the kernel takes one INT4/INT8 config for both stacks; the eager path stays
        new = QuantizedMoEBlock(block.gate.weight, block.gate.top_k, pack_moe_experts(w13, w2),
                                dense_shared=getattr(block, "shared_expert", None),
                                dense_shared_gate=getattr(block, "shared_expert_gate", None), num_threads=num_threads)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        swapped.append(name)
    return swapped
