"""The ExecuTorch kernel of llmq's MoE op: a shared library built against the installed executorch wheel.

`llmq_executorch_kernel` makes `name` (e.g. "_moe_executorch_kernel.so"): the kernel sources, linked with
`@llmq_platform//:executorch_runtime` (the wheel's runtime headers and libexecutorch.so, tools/platform_detect.bzl).
Where executorch is absent that library is incompatible, so the kernel and everything that depends on it is
SKIPPED by `bazel build|test //...`, never broken; with LLMQ_FORCE_EXECUTORCH=1 and no usable executorch the
repository rule fails with one line saying what to install.

`executorch_kernel_data(label)` is `[label]` where executorch is present and `[]` elsewhere: data for
targets that run without executorch too (a model's export_pte binary prints one error line there).
"""

load("//tools:cc.bzl", "llmq_shared_library")

def llmq_executorch_kernel(name, srcs, deps = [], **kwargs):
    llmq_shared_library(name, srcs, deps + ["@llmq_platform//:executorch_runtime"], **kwargs)

def executorch_kernel_data(label):
    return select({
        "@llmq_platform//:executorch_is_present": [label],
        "//conditions:default": [],
    })
