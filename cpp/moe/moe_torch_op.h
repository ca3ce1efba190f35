// The C++ CPU kernel of torch.ops.llmq.quantized_moe_ffn (moe_torch_op.cc), registered with
// the dispatcher when the extension is loaded. The schema and the fake kernel are defined
// in Python (python/llmq/ops/moe_op.py), so the op traces and exports without this library.
#pragma once

#include "moe_kernel.h"

namespace llmq_moe {

// Process-wide path and schedule the op uses (tests and benchmarks force them; results are
// bit-identical either way). Set through the pybind module (set_op_isa / set_op_schedule).
void set_op_isa(Isa isa);
void set_op_schedule(Schedule schedule);
Isa op_isa();
Schedule op_schedule();

}  // namespace llmq_moe
