"""Repository rule: a Python toolchain and C/C++ headers taken from one Python interpreter.

Which interpreter (the first that applies):
  1. $LLMQ_PYTHON_INTERPRETER,
  2. the `python_interpreter` attribute (llmq_dependencies(python_interpreter = ...)),
  3. <main workspace>/.venv/bin/python3 when it exists (llmq's own checkout: tools/bazel
     creates it from requirements_lock.txt),
  4. python3 on PATH.
A value with no "/" is looked up on PATH; a relative path is taken from the main workspace.
The interpreter must import torch and pybind11 (llmq's requirements_lock.txt); otherwise the
rule fails with one line naming the interpreter, what is missing and the pip command.
The rule re-runs when the lock, $LLMQ_PYTHON_INTERPRETER or $LLMQ_VENV_STAMP changes.
"""

ENV_VAR = "LLMQ_PYTHON_INTERPRETER"

_PROBE = """
import json, sys, sysconfig
info = {"include": sysconfig.get_paths()["include"], "version": sysconfig.get_python_version(), "missing": []}
try:
    import pybind11
    info["pybind11"] = pybind11.get_include()
except ImportError:
    info["missing"].append("pybind11")
try:
    import torch.utils.cpp_extension as ext
    info["torch_include"] = ext.include_paths()
    info["torch_lib"] = ext.library_paths()[0]
except Exception:
    info["missing"].append("torch")
print(json.dumps(info))
"""

def _main_workspace(ctx):
    """The main workspace's folder: as Bazel finds it, the nearest folder above the client's
    working directory ($PWD) holding a WORKSPACE file (a label of the main workspace would need
    a BUILD file at its root, which a consumer need not have)."""
    pwd = ctx.os.environ.get("PWD", "")
    if pwd.startswith("/"):
        d = ctx.path(pwd)
        for _ in range(pwd.count("/")):
            if d.get_child("WORKSPACE").exists or d.get_child("WORKSPACE.bazel").exists:
                return d
            if d.dirname == None:
                break
            d = d.dirname
    return ctx.path(Label("@//:WORKSPACE")).dirname

def find_python(ctx):
    """(path string of the chosen interpreter, how it was chosen); fails with one line if none."""
    ws = _main_workspace(ctx)
    for value, how in [
        (ctx.os.environ.get(ENV_VAR, ""), "$" + ENV_VAR),
        (ctx.attr.python_interpreter, "python_interpreter attribute"),
    ]:
        if not value:
            continue
        if "/" not in value:
            found = ctx.which(value)
            if found == None:
                fail("llmq: %s=%s: no such program on PATH" % (how, value))
            return str(found), how
        path = ctx.path(value if value.startswith("/") else "%s/%s" % (ws, value))
        if not path.exists:
            fail("llmq: %s=%s: %s does not exist" % (how, value, path))
        return str(path), how
    venv = ws.get_child(".venv").get_child("bin").get_child("python3")
    if venv.exists:
        return str(venv), "%s/.venv" % ws
    found = ctx.which("python3")
    if found == None:
        fail("llmq: no Python interpreter: set %s, pass llmq_dependencies(python_interpreter = ...), create %s/.venv, or put python3 on PATH" % (ENV_VAR, ws))
    return str(found), "python3 on PATH"

def _local_python_impl(ctx):
    lock = ctx.path(Label("//:requirements_lock.txt"))
    ctx.read(lock)  # makes the lock an input of this rule
    python, how = find_python(ctx)
    res = ctx.execute([python, "-c", _PROBE], environment = {"PYTHONNOUSERSITE": "1"})
    if res.return_code != 0:
        fail("llmq: probing %s (%s) failed: %s" % (python, how, res.stderr.strip().replace("\n", " | ")))
    info = json.decode(res.stdout)
    if info["missing"]:
        fail("llmq: %s not importable by %s (%s); install llmq's requirements: %s -m pip install -r %s" % (
            " and ".join(info["missing"]),
            python,
            how,
            python,
            lock,
        ))

    ctx.symlink(info["include"], "python_include")
    ctx.symlink(info["pybind11"], "pybind11_include")
    torch_includes = info["torch_include"]
    for i, path in enumerate(torch_includes):
        ctx.symlink(path, "torch_include_%d" % i)
    torch_lib = info["torch_lib"]
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

exports_files(["python_version.txt", "python_path.txt"])
""".format(
        python = python,
        torch_inc = repr(["torch_include_%d" % i for i in range(len(torch_includes))]),
        torch_link = repr(["-L" + torch_lib, "-Wl,-rpath," + torch_lib, "-lc10", "-ltorch", "-ltorch_cpu"]),
    ))
    ctx.file("python_version.txt", info["version"] + "\n")
    ctx.file("python_path.txt", python + "\n")

local_python = repository_rule(
    implementation = _local_python_impl,
    attrs = {
        "python_interpreter": attr.string(doc = "Interpreter path or program name; see the module docstring."),
    },
    local = True,
    environ = [ENV_VAR, "LLMQ_VENV_STAMP"],
    doc = "Python toolchain + headers from the chosen interpreter (see the module docstring).",
)
