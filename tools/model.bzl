"""llmq_model: every Bazel target of one model package (models/<name>/), from one call;
llmq_tool: a runnable module and the library its tests import (used here and by model BUILD files).

A model package holds its module code (config.py, model.py, keymap.py, ...), gguf_checkpoint.py,
architecture.py (`ARCHITECTURE`, the models.pipeline.arch.Architecture), quantize_and_save.py, recipes/*.json, and the standard tests
model_test.py (parity with transformers) and keymap_test.py. The macro declares:

  :model              py_library   the module code (every *.py but the files below and tests)
  :gguf_checkpoint    py_library   gguf_checkpoint.py (--checkpoint=model.gguf), where the package has one
  :mlx_export         py_library   mlx_export.py            (mlx_export = True)
  :architecture       py_library   architecture.py + recipes/*.json
  :quantize_and_save  py_binary    the main job (over //models:architectures: another model's checkpoint
                                   given to it names that model's target)
  :export_pt2, :export_pt2_lib, :export_pte                   (torch_export = True: export_pt2.py, export_pte.py)
  :param_count, :param_count_lib, :param_count_test           (param_count = True: param_count.py)
  :model_test, :keymap_test, and one llmq_py_test per name in `tests` (<name>.py)
"""

load("//cpp/moe:executorch_kernel.bzl", "executorch_kernel_data")
load("//tools:pytest.bzl", "llmq_py_test")

def llmq_tool(name, deps, srcs = None, binary_deps = []):
    """A runnable module <name>.py and the library its tests import, in the calling package:
    :<name>_lib (py_library of `srcs`, default [<name>.py], over `deps`) and :<name> (py_binary
    of <name>.py over :<name>_lib and `binary_deps`, what only the command line imports)."""
    native.py_library(name = name + "_lib", srcs = srcs or [name + ".py"], deps = deps)
    native.py_binary(
        name = name,
        srcs = [name + ".py"],
        python_version = "PY3",
        deps = [":" + name + "_lib"] + binary_deps,
    )

_PACKAGE_FILES = ["architecture.py", "export_pt2.py", "export_pte.py", "gguf_checkpoint.py", "mlx_export.py",
                  "param_count.py", "quantize_and_save.py"]

def llmq_model(
        model_deps = [],
        gguf_import = None,
        gguf_deps = [],
        mlx_export = False,
        torch_export = False,
        torch_export_deps = [],
        param_count = False,
        tests = [],
        exclude = []):
    """Declares the targets above in the calling package.

    Args:
      model_deps: extra deps of :model (another model's :model whose modules it reuses).
      gguf_import: the package has gguf_checkpoint.py (GGUF input); default: whether the file exists.
      gguf_deps: extra deps of :gguf_checkpoint (another model's converter it extends).
      mlx_export: the package has mlx_export.py.
      torch_export: the package has export_pt2.py (torch.export .pt2) and export_pte.py (ExecuTorch .pte).
      torch_export_deps: extra deps of those targets (another model's :export_pt2_lib whose cache layout it reuses,
        or what only some flag imports).
      param_count: the package has param_count.py and param_count_test.py.
      tests: further test files (names without .py) depending on :architecture.
      exclude: further *.py files that are not module code (binaries declared in the BUILD file).
    """
    native.py_library(
        name = "model",
        srcs = native.glob(["*.py"], exclude = ["*_test.py"] + _PACKAGE_FILES + exclude),
        data = native.glob(["configs/*.json"]),
        deps = ["//models:init", "//models/common"] + model_deps,
    )
    architecture_deps = [":model", "//models/pipeline"]
    if gguf_import == None:
        gguf_import = len(native.glob(["gguf_checkpoint.py"], allow_empty = True)) > 0
    if gguf_import:
        native.py_library(
            name = "gguf_checkpoint",
            srcs = ["gguf_checkpoint.py"],
            deps = [":model", "//models/pipeline", "//python/llmq/quant"] + gguf_deps,
        )
        architecture_deps.append(":gguf_checkpoint")
    if mlx_export:
        native.py_library(
            name = "mlx_export",
            srcs = ["mlx_export.py"],
            deps = [":model", "//python/llmq/quant"],
        )
        architecture_deps.append(":mlx_export")
    native.py_library(
        name = "architecture",
        srcs = ["architecture.py"],
        data = native.glob(["recipes/*.json"]),
        deps = architecture_deps,
    )
    native.py_binary(
        name = "quantize_and_save",
        srcs = ["quantize_and_save.py"],
        python_version = "PY3",
        deps = [":architecture", "//models:architectures"],
    )
    if torch_export:
        llmq_tool(name = "export_pt2", deps = [":model", ":architecture", "//models/pipeline"] + torch_export_deps)
        native.py_binary(
            name = "export_pte",
            srcs = ["export_pte.py"],
            # a model exporting through llmq.ops (the MoE op) runs it in the .pte through its ExecuTorch kernel,
            # built where executorch is installed (cpp/moe/executorch_kernel.bzl)
            data = executorch_kernel_data("//cpp/moe:_moe_executorch_kernel.so") if "//python/llmq/ops" in torch_export_deps else [],
            python_version = "PY3",
            deps = [":export_pt2_lib", "//models/pipeline"] + torch_export_deps,
        )
    if param_count:
        llmq_tool(name = "param_count", deps = [":model"])
        llmq_py_test(
            name = "param_count_test",
            srcs = ["param_count_test.py"],
            size = "medium",
            deps = [":param_count_lib"],
        )
    for test in ["model_test", "keymap_test"] + tests:
        llmq_py_test(
            name = test,
            srcs = [test + ".py"],
            size = "medium",
            deps = [":architecture"],
        )
