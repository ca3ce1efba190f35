"""llmq.ops: torch.library custom ops and the source transforms that use them.

Importing this package registers `torch.ops.llmq.quantized_moe_ffn` and
`torch.ops.llmq.quantized_linear` (schema + fake kernel always; the CPU kernels need the compiled
extension, see `moe_kernel_available`); `install_dense_kernel()` makes every QuantizedLinear
compute with the latter (llmq.ops.dense_op).
"""

from llmq.ops.dense_op import install_dense_kernel, quantized_linear, quantized_linear_available
from llmq.ops.kernel_loader import MoEKernelUnavailable, load_kernel, moe_kernel_available
from llmq.ops.moe_op import kernel_route, quantized_moe_ffn, set_kernel_isa, set_kernel_schedule
from llmq.ops.moe_reference import moe_reference, route_reference
from llmq.ops.packing import PackedExperts, PackedLinear, pack_linear, pack_moe_experts

__all__ = [
    "quantized_moe_ffn",
    "quantized_linear",
    "quantized_linear_available",
    "install_dense_kernel",
    "pack_linear",
    "PackedLinear",
    "moe_kernel_available",
    "load_kernel",
    "MoEKernelUnavailable",
    "pack_moe_experts",
    "PackedExperts",
    "moe_reference",
    "route_reference",
    "kernel_route",
    "set_kernel_isa",
    "set_kernel_schedule",
]
