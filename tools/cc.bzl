"""Compiler flags shared by llmq's C++ kernels (cpp/moe, cpp/quant).

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
