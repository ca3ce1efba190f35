"""Compiler flags and target macros shared by llmq's C++ kernels (cpp/moe, cpp/quant).

ISA paths are chosen at run time (functions carry target attributes), so nothing is built
with -march=native; -ffp-contract=off keeps every path rounding like its reference.
"""

KERNEL_COPTS = [
    "-std=c++17",
    "-O3",
    "-fno-math-errno",
    # scalar, AVX2 and AVX-512 paths must agree bit for bit: no implicit fma contraction
    # (and never -ffast-math)
    "-ffp-contract=off",
    "-Wall",
    # GCC 12's own AVX-512 headers trip these
    "-Wno-uninitialized",
    "-Wno-maybe-uninitialized",
]

def llmq_kernel_library(name, srcs, hdrs, deps = [], copts = [], **kwargs):
    """A public torch-free kernel library built with KERNEL_COPTS (+ `copts`), linked with pthreads."""
    native.cc_library(
        name = name,
        srcs = srcs,
        hdrs = hdrs,
        copts = KERNEL_COPTS + copts,
        linkopts = ["-lpthread"],
        visibility = ["//visibility:public"],
        deps = deps,
        **kwargs
    )

def llmq_shared_library(name, srcs, deps = [], **kwargs):
    """A shared library `name` loaded by file path; hidden visibility: it exports nothing, it
    registers what it offers (a Python module, an ExecuTorch kernel)."""
    native.cc_binary(
        name = name,
        srcs = srcs,
        copts = KERNEL_COPTS + ["-fvisibility=hidden"],
        linkopts = ["-lpthread"],
        linkshared = 1,
        deps = deps,
        **kwargs
    )

def llmq_pybind_extension(name, srcs, deps = [], **kwargs):
    """A pybind11 extension `name` (e.g. "_quant_kernel.so"), loaded by file path (llmq/_extensions.py)."""
    llmq_shared_library(name, srcs, deps + ["@local_python//:pybind11_headers", "@local_python//:python_headers"], **kwargs)

def llmq_kernel_test(name, deps):
    """cc_test `name` from `<name>.cc`, with the shared CHECK macro (cpp/common/check.h)."""
    native.cc_test(
        name = name,
        size = "small",
        srcs = [name + ".cc"],
        copts = KERNEL_COPTS,
        deps = deps + ["//cpp/common:check"],
    )
