"""The one swap of a quantized model's MoE blocks for torch.ops.llmq.quantized_moe_ffn, behind every
flag that asks for it: --use_moe_quantized_op (verification and the .pt2 export) and --pte_experts=op
(the .pte export) call `swap_in_moe_op`.

The swap reuses the weights exactly as they were quantized (no re-quantization): the
canonical expert stacks are only repacked into the kernel's tile layout. The shared expert
and its sigmoid gate stay as they are (QuantizedLinear / Linear) next to the op. (A float
model is quantized and swapped by llmq.ops.transform.replace_moe_blocks instead.)
"""

from __future__ import annotations

from typing import List

from torch import nn

from llmq.quant import GroupQuantizedWeight
from models.pipeline.quantized_model import QuantizedExperts, _StackedQuantized
from models.pipeline.usage_error import UsageError

NO_BLOCK = ("no MoE block to swap; the kernel needs routed experts quantized INT4/INT8 with one group size "
            "(32/64/128) for gate_up and down, e.g. --recipe=int4 or mixed")


def _canonical(holder: nn.Module) -> GroupQuantizedWeight:
    return GroupQuantizedWeight(qdata=holder.qdata, scale=holder.scale, bias=holder.bias, bits=holder.bits,
                                group_size=holder.group_size, shape=tuple(holder.qdata.shape[:-1]) + (holder.k,))


def use_quantized_moe_op(model: nn.Module, num_threads: int = 0) -> List[str]:
    """Swap every MoE block whose experts are INT4/INT8 quantized stacks; returns their fqns.
    Raises MoEKernelUnavailable (naming the extension) if the compiled kernel is missing, ImportError
    where llmq.ops is not importable."""
    from llmq.ops import load_kernel, pack_moe_experts
    from llmq.ops.transform import QuantizedMoEBlock

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


def swap_in_moe_op(model: nn.Module, flag: str, *, required: bool = True, alternative: str = "") -> List[str]:
    """use_quantized_moe_op for the command line: its failures (llmq.ops not importable, the kernel missing
    and, where `required`, no block to swap) as one UsageError line naming `flag`, then `alternative`
    (e.g. "; or use --pte_experts=dense"). Returns the fqns swapped."""
    try:
        from llmq.ops.kernel_loader import MoEKernelUnavailable
    except ImportError as e:
        raise UsageError(f"{flag}: llmq.ops is not importable ({e}){alternative}") from None
    try:
        swapped = use_quantized_moe_op(model)
    except MoEKernelUnavailable as e:
        raise UsageError(f"{flag}: {e}{alternative}") from None
    if required and not swapped:
        raise UsageError(f"{flag}: {NO_BLOCK}{alternative}")
    return swapped
