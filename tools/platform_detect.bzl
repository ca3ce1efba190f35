"""Repository rule: detects the backend runtimes this machine has, for test gating.

Tests tagged with a backend get target_compatible_with one of the constraint values
below. The constraint settings default to whatever was detected, so on a machine without
the runtime such a test is SKIPPED by `bazel test //...` (incompatible), never failed and
never silently passed. Override with LLMQ_FORCE_CUDA=0/1, LLMQ_FORCE_MLX=0/1 or
LLMQ_FORCE_EXECUTORCH=0/1 (executorch is an optional package, not in the lock: docs/executorch.md).
"""

load(":local_python.bzl", "ENV_VAR", "find_python")

def _has_cuda(ctx):
    forced = ctx.os.environ.get("LLMQ_FORCE_CUDA")
    if forced != None:
        return forced == "1"
    if not ctx.path("/dev/nvidiactl").exists:
        return False
    smi = ctx.which("nvidia-smi")
    if smi == None:
        return False
    return ctx.execute([smi, "-L"]).return_code == 0

def _has_mlx(ctx, python):
    forced = ctx.os.environ.get("LLMQ_FORCE_MLX")
    if forced != None:
        return forced == "1"
    res = ctx.execute([python, "-c", "import mlx.core as mx; mx.eval(mx.ones(2) + 1)"], timeout = 120)
    return res.return_code == 0

def _has_executorch(ctx, python):
    forced = ctx.os.environ.get("LLMQ_FORCE_EXECUTORCH")
    if forced != None:
        return forced == "1"
    code = "import executorch.runtime, executorch.exir; from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner"
    return ctx.execute([python, "-c", code], timeout = 300).return_code == 0

_EXECUTORCH_PATHS = """
import os, executorch
root = os.path.abspath(list(executorch.__path__)[0])  # a namespace package: no __file__
print(os.path.join(root, "include"))
print(os.path.join(root, "lib"))
"""

# What the ExecuTorch kernel of the MoE op (cpp/moe:_moe_executorch_kernel.so) builds against: the wheel's
# runtime headers and the libexecutorch.so its Python runtime links (so the kernel registers into that runtime).
_EXECUTORCH_RUNTIME_PRESENT = """
cc_library(
    name = "executorch_runtime",
    hdrs = glob(["executorch_include/**/*.h"]),
    # the wheel's own CMake package (share/cmake/executorch-config.cmake) sets these: the vendored c10 headers,
    # and the definitions its libraries were compiled with
    includes = ["executorch_include", "executorch_include/executorch/runtime/core/portable_type/c10"],
    defines = ["C10_USING_CUSTOM_GENERATED_MACROS", "ET_EVENT_TRACER_ENABLED"],
    srcs = ["executorch_lib/libexecutorch.so"],
    linkopts = ["-Wl,-rpath,{lib}"],
)
"""

# Without executorch, anything built on the runtime is incompatible: SKIPPED by `bazel test //...`, never broken.
_EXECUTORCH_RUNTIME_ABSENT = """
cc_library(
    name = "executorch_runtime",
    target_compatible_with = [":executorch_present"],
)
"""

def _executorch_runtime(ctx, python, present):
    """The BUILD text of :executorch_runtime; symlinks the wheel's include/ and lib/ when present."""
    if not present:
        return _EXECUTORCH_RUNTIME_ABSENT
    forced = ctx.os.environ.get("LLMQ_FORCE_EXECUTORCH") == "1"
    res = ctx.execute([python, "-c", _EXECUTORCH_PATHS], timeout = 120)
    lines = res.stdout.strip().split("\n") if res.return_code == 0 else []
    include, lib = (lines + ["", ""])[:2]
    missing = [p for p in [include + "/executorch/runtime/kernel/operator_registry.h", lib + "/libexecutorch.so"]
               if not include or not ctx.path(p).exists]
    if res.return_code != 0 or missing:
        why = res.stderr.strip().replace("\n", " | ") if res.return_code != 0 else "missing " + ", ".join(missing)
        fail("llmq: %sexecutorch's runtime headers and libexecutorch.so are not usable from %s (%s); install it with: %s -m pip install executorch==1.5.1 (docs/executorch.md)%s" % (
            "LLMQ_FORCE_EXECUTORCH=1 but " if forced else "",
            python,
            why,
            python,
            ", or unset LLMQ_FORCE_EXECUTORCH" if forced else "",
        ))
    ctx.symlink(include, "executorch_include")
    ctx.symlink(lib, "executorch_lib")
    return _EXECUTORCH_RUNTIME_PRESENT.format(lib = lib)

def _llmq_platform_impl(ctx):
    ctx.read(Label("//:requirements_lock.txt"))
    python, _ = find_python(ctx)  # the interpreter local_python uses
    cuda = _has_cuda(ctx)
    mlx = _has_mlx(ctx, python)
    executorch = _has_executorch(ctx, python)
    executorch_runtime = _executorch_runtime(ctx, python, executorch)
    ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

constraint_setting(name = "cuda", default_constraint_value = ":{cuda}")
constraint_value(name = "cuda_present", constraint_setting = ":cuda")
constraint_value(name = "cuda_absent", constraint_setting = ":cuda")

constraint_setting(name = "mlx", default_constraint_value = ":{mlx}")
constraint_value(name = "mlx_present", constraint_setting = ":mlx")
constraint_value(name = "mlx_absent", constraint_setting = ":mlx")

constraint_setting(name = "executorch", default_constraint_value = ":{executorch}")
constraint_value(name = "executorch_present", constraint_setting = ":executorch")
constraint_value(name = "executorch_absent", constraint_setting = ":executorch")

# true where executorch is present (select() on it: e.g. data that exists only then)
config_setting(name = "executorch_is_present", constraint_values = [":executorch_present"])
""".format(
        cuda = "cuda_present" if cuda else "cuda_absent",
        mlx = "mlx_present" if mlx else "mlx_absent",
        executorch = "executorch_present" if executorch else "executorch_absent",
    ) + executorch_runtime)
    ctx.file("defs.bzl", "HAS_CUDA = %s\nHAS_MLX = %s\nHAS_EXECUTORCH = %s\n" % (cuda, mlx, executorch))

llmq_platform = repository_rule(
    implementation = _llmq_platform_impl,
    local = True,
    attrs = {
        "python_interpreter": attr.string(doc = "As local_python's attribute (MLX is probed with it)."),
    },
    environ = ["LLMQ_FORCE_CUDA", "LLMQ_FORCE_MLX", "LLMQ_FORCE_EXECUTORCH", "LLMQ_VENV_STAMP", ENV_VAR],
)
