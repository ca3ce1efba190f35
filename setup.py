"""The pip build of llmq (distribution `llmq-quant`, import name `llmq`): docs/build.md, "The wheel".

Bazel stays the build of record; this file mirrors what it builds for the library, from the same sources
with the same flags (tools/cc.bzl's KERNEL_COPTS, the per-library copts of cpp/*/BUILD):

* `llmq/_kernels/_quant_kernel*.so`: //cpp/quant:_quant_kernel.so (torch-free, pybind11),
* `llmq/_kernels/_moe_kernel*.so`: //cpp/moe:_moe_kernel.so (pybind11 + the op's torch CPU kernel, linked
  against the build environment's libtorch, found at run time next to the installed torch),
* `llmq/_kernels/_moe_executorch_kernel.so`: //cpp/moe:_moe_executorch_kernel.so, only where executorch is
  importable at build time (LLMQ_WHEEL_EXECUTORCH=0 leaves it out, =1 makes its absence an error).

llmq._extensions finds them there first. The wheel holds the core library and the backends' packages
(llmq_hf, llmq_gguf, llmq_mlx, llmq_cuda); the model pipelines (models/, their CLIs) stay Bazel targets.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from typing import List, Tuple

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
# tools/cc.bzl: KERNEL_COPTS (+ -fvisibility=hidden of llmq_shared_library); -g0 keeps the wheel small
KERNEL_COPTS = ["-std=c++17", "-O3", "-fno-math-errno", "-ffp-contract=off", "-Wall", "-Wno-uninitialized",
                "-Wno-maybe-uninitialized", "-fvisibility=hidden", "-fPIC", "-g0"]
NO_TRAP = ["-fno-trapping-math"]  # cpp/quant/BUILD: fp_quant, hqq_quant
CXX20 = ["-std=c++20"]  # cpp/moe/BUILD: moe_torch_op (torch's headers)
EXECUTORCH_ENV = "LLMQ_WHEEL_EXECUTORCH"


def _src(*names: str) -> List[str]:
    return [os.path.join("cpp", n) for n in names]


class Kernel(Extension):
    """A shared library from groups of (sources, extra compile flags), linked with `link` flags."""

    def __init__(self, name: str, groups: List[Tuple[List[str], List[str]]], include_dirs=(), link=(), defines=()):
        super().__init__(name, sources=[s for srcs, _ in groups for s in srcs])
        self.groups = groups
        self.includes = [ROOT, *include_dirs]
        self.link = list(link)
        self.defines = list(defines)


def _pybind_includes() -> List[str]:
    import pybind11

    return [pybind11.get_include(), sysconfig.get_paths()["include"]]


def _torch() -> Tuple[List[str], str, str]:
    import torch
    import torch.utils.cpp_extension as cpp

    return cpp.include_paths(), cpp.library_paths()[0], torch.__version__


def _executorch_paths():
    """(include dir, lib dir) of an importable executorch wheel, else None (tools/platform_detect.bzl)."""
    want = os.environ.get(EXECUTORCH_ENV, "")
    if want == "0":
        return None
    try:
        import executorch

        root = os.path.abspath(list(executorch.__path__)[0])
    except ImportError:
        if want == "1":
            sys.exit(f"{EXECUTORCH_ENV}=1 but executorch is not importable by {sys.executable} (docs/executorch.md)")
        return None
    include, lib = os.path.join(root, "include"), os.path.join(root, "lib")
    if not os.path.isfile(os.path.join(lib, "libexecutorch.so")):
        if want == "1":
            sys.exit(f"{EXECUTORCH_ENV}=1 but {lib}/libexecutorch.so is missing")
        return None
    return include, lib


def kernels() -> List[Kernel]:
    torch_includes, torch_lib, _ = _torch()
    quant = Kernel(
        "llmq._kernels._quant_kernel",
        [(_src("quant/quant_pybind.cc", "quant/quant_kernel.cc", "quant/search_quant.cc", "quant/int4_tiles.cc",
               "quant/gguf_blocks.cc"), []),
         (_src("quant/fp_quant.cc", "quant/hqq_quant.cc"), NO_TRAP)],
        include_dirs=_pybind_includes(),
        link=["-lpthread"],
    )
    moe = Kernel(
        "llmq._kernels._moe_kernel",
        [(_src("moe/moe_pybind.cc", "moe/moe_kernel.cc", "moe/thread_pool.cc"), []),
         (_src("moe/moe_torch_op.cc"), CXX20)],
        include_dirs=_pybind_includes() + torch_includes,
        # the installed torch's libraries: site-packages/torch/lib from site-packages/llmq/_kernels
        link=["-lpthread", "-L" + torch_lib, "-Wl,-rpath,$ORIGIN/../../torch/lib", "-lc10", "-ltorch", "-ltorch_cpu"],
    )
    out = [quant, moe]
    et = _executorch_paths()
    if et is not None:
        include, lib = et
        out.append(Kernel(
            "llmq._kernels._moe_executorch_kernel",
            [(_src("moe/moe_executorch_op.cc", "moe/moe_kernel.cc", "moe/thread_pool.cc"), [])],
            include_dirs=[include, os.path.join(include, "executorch/runtime/core/portable_type/c10")],
            defines=["C10_USING_CUSTOM_GENERATED_MACROS", "ET_EVENT_TRACER_ENABLED"],
            link=["-lpthread", "-L" + lib, "-Wl,-rpath,$ORIGIN/../../executorch/lib", "-lexecutorch"],
        ))
    return out


class BuildKernels(build_ext):
    """Compiles each Kernel's groups with their own flags (in parallel), then links one shared library."""

    def build_extension(self, ext) -> None:
        if not isinstance(ext, Kernel):
            return super().build_extension(ext)
        cxx = shlex.split(os.environ.get("CXX", "c++"))
        tmp = os.path.join(self.build_temp, ext.name)
        os.makedirs(tmp, exist_ok=True)
        jobs = []
        for sources, flags in ext.groups:
            for src in sources:
                obj = os.path.join(tmp, os.path.basename(src) + ".o")
                jobs.append((obj, cxx + KERNEL_COPTS + flags + [f"-I{d}" for d in ext.includes]
                             + [f"-D{d}" for d in ext.defines] + ["-c", os.path.join(ROOT, src), "-o", obj]))
        workers = max(1, min(len(jobs), int(os.environ.get("LLMQ_WHEEL_JOBS", os.cpu_count() or 1))))
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda job: self._run(job[1]), jobs))
        target = self.get_ext_fullpath(ext.name)
        if ext.name.endswith("_moe_executorch_kernel"):  # not a Python module: a plain library, loaded by ctypes
            target = os.path.join(os.path.dirname(target), "_moe_executorch_kernel.so")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        self._run(cxx + ["-shared", "-o", target] + [obj for obj, _ in jobs] + ext.link)

    @staticmethod
    def _run(cmd: List[str]) -> None:
        print(" ".join(shlex.quote(c) for c in cmd), flush=True)
        subprocess.run(cmd, check=True)


class BuildPy(build_py):
    """Leaves tests, test helpers and benchmarks out of the wheel."""

    def find_package_modules(self, package, package_dir):
        def keep(name: str) -> bool:
            return not (name.endswith("_test") or name.endswith("testutil") or name.startswith("bench_"))

        return [m for m in super().find_package_modules(package, package_dir) if keep(m[1])]


def _packages():
    out, dirs = [], {}
    for top, where in (("llmq", "python"), ("llmq_hf", "backends/hf"), ("llmq_gguf", "backends/gguf"),
                       ("llmq_mlx", "backends/mlx"), ("llmq_cuda", "backends/cuda")):
        for d, _, files in os.walk(os.path.join(ROOT, where, top)):
            if "__init__.py" in files:
                pkg = os.path.relpath(d, os.path.join(ROOT, where)).replace(os.sep, ".")
                out.append(pkg)
                dirs[pkg] = os.path.relpath(d, ROOT)
    return out, dirs


def _torch_requirement() -> str:
    """The moe kernel links the build's libtorch (C++ ABI): the same torch minor version at run time."""
    version = _torch()[2].split("+")[0]
    major, minor = version.split(".")[:2]
    return f"torch>={major}.{minor},<{major}.{int(minor) + 1}"


packages, package_dir = _packages()
setup(
    packages=packages,
    package_dir=package_dir,
    ext_modules=kernels(),
    cmdclass={"build_ext": BuildKernels, "build_py": BuildPy},
    install_requires=[_torch_requirement(), "numpy", "safetensors", "blake3", "google-re2", "PyYAML"],
)
