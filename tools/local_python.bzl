"""Repository rule: a Python toolchain and C/C++ headers taken from the repo's .venv.

tools/bazel creates .venv from requirements_lock.txt before Bazel starts, so this rule
only has to look at it. The rule re-runs when the lock changes (it reads the lock).
"""

_PROBE = """
import json, sysconfig
info = {"include": sysconfig.get_paths()["include"], "version": sysconfig.get_python_version()}
try:
    import pybind11
    info["pybind11"] = pybind11.get_include()
except ImportError:
    pass
try:
    import torch.utils.cpp_extension as ext
    info["torch_include"] = ext.include_paths()
    info["torch_lib"] = ext.library_paths()[0]
except Exception:
    pass
print(json.dumps(info))
"""

def _local_python_impl(ctx):
    workspace = ctx.path(Label("//:WORKSPACE")).dirname
    ctx.read(Label("//:requirements_lock.txt"))  # makes the lock an input of this rule
    python = workspace.get_child(".venv").get_child("bin").get_child("python3")
    if not python.exists:
        fail("llmq: %s is missing; run tools/bazel (it creates .venv from requirements_lock.txt)" % python)
    res = ctx.execute([str(python), "-c", _PROBE], environment = {"PYTHONNOUSERSITE": "1"})
    if res.return_code != 0:
        fail("llmq: probing %s failed:\n%s" % (python, res.stderr))
    info = json.decode(res.stdout)

    ctx.symlink(info["include"], "python_include")
    if "pybind11" in info:
        ctx.symlink(info["pybind11"], "pybind11_include")
    else:
        ctx.file("pybind11_include/README", "pybind11 is not installed in .venv\n")
    torch_includes = info.get("torch_include", [])
    for i, path in enumerate(torch_includes):
        ctx.symlink(path, "torch_include_%d" % i)
    torch_lib = info.get("torch_lib", "")
    if torch_lib:
        ctx.symlink(torch_lib, "torch_lib")

    ctx.file("BUILD.bazel", """
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

py_runtime(
    name = "venv_python3",
    interpreter_path = "{python}",
    python_version = "PY3",
    stub_shebang = "#!{python}",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":venv_python3",
)

toolchain(
    name = "python_toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)

cc_library(
    name = "python_headers",
    hdrs = glob(["python_include/**/*.h"]),
    includes = ["python_include"],
)

cc_library(
    name = "pybind11_headers",
    hdrs = glob(["pybind11_include/**/*.h"]),
    includes = ["pybind11_include"],
    deps = [":python_headers"],
)

cc_library(
    name = "torch_headers",
    hdrs = glob(["torch_include_*/**/*.h", "torch_include_*/**/*.cuh"], allow_empty = True),
    includes = {torch_inc},
    linkopts = {torch_link},
    deps = [":python_headers"],
)

exports_files(["python_version.txt"])
""".format(
        python = str(python),
        torch_inc = repr(["torch_include_%d" % i for i in range(len(torch_includes))]),
        torch_link = repr(["-L" + torch_lib, "-Wl,-rpath," + torch_lib, "-lc10", "-ltorch", "-ltorch_cpu"] if torch_lib else []),
    ))
    ctx.file("python_version.txt", info["version"] + "\n")

local_python = repository_rule(
    implementation = _local_python_impl,
    local = True,
    environ = ["LLMQ_VENV_STAMP"],
    doc = "Python toolchain + headers from <workspace>/.venv.",
)
