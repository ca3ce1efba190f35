"""The MoE op's ExecuTorch kernel library: find it, load it into executorch's runtime, explain its absence.

A .pte made with `--pte_experts=op` calls `llmq::quantized_moe_ffn.out`, registered with ExecuTorch's
operator registry by the shared library `_moe_executorch_kernel.so` (cpp/moe/moe_executorch_op.cc) when it
is loaded. A plain ExecuTorch user needs two lines before loading such a program:

    from llmq.ops.executorch_kernel import load_executorch_kernel
    load_executorch_kernel()        # then executorch.runtime.Runtime.get().load_program("model.pte")

Without them ExecuTorch says only `Failed to load method prefill, error: 0x:14` (0x14 is its
Error::OperatorMissing); `load_program` here says which operator and what to load. Search order for the
library (llmq/_extensions.py): $LLMQ_MOE_EXECUTORCH_KERNEL, llmq/_kernels/ (the wheel, when it was built
with executorch installed), cpp/moe/ (Bazel runfiles, a checkout), bazel-bin/cpp/moe/ (what
`tools/bazel build //cpp/moe:_moe_executorch_kernel.so` made), cpp/moe/ under sys.path.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from typing import List, Optional

from llmq._extensions import candidate_dirs, find_extension

OUT_OP = "llmq::quantized_moe_ffn.out"
OP_NAME = "llmq::quantized_moe_ffn"  # a .pte's operator table holds the name and the overload ("out") apart
KERNEL_ENV_VAR = "LLMQ_MOE_EXECUTORCH_KERNEL"
KERNEL_TARGET = "//cpp/moe:_moe_executorch_kernel.so"

# executorch 1.5.1 prints "Failed to load method prefill, error: 0x:14" (Error::OperatorMissing)
_OPERATOR_MISSING = re.compile(r"error: 0x:?14\b")

_loaded: Optional[str] = None


class MoEExecuTorchKernelUnavailable(RuntimeError):
    """_moe_executorch_kernel.so is not built or does not load into executorch's runtime."""


def kernel_paths() -> List[str]:
    env = os.environ.get(KERNEL_ENV_VAR)
    if env:
        if not os.path.isfile(env):
            raise MoEExecuTorchKernelUnavailable(f"{KERNEL_ENV_VAR}={env} does not name a file "
                                                 "(expected the built _moe_executorch_kernel.so)")
        return [env]
    return find_extension("moe", "_moe_executorch_kernel")


def _registered() -> bool:
    from executorch.extension.pybindings import portable_lib

    return OUT_OP in portable_lib._get_operator_names()


def load_executorch_kernel() -> str:
    """Register llmq::quantized_moe_ffn.out with executorch's runtime (once); returns the library's path.
    Raises MoEExecuTorchKernelUnavailable naming what is missing."""
    global _loaded
    if _loaded is not None:
        return _loaded
    # executorch's runtime first: the library links its libexecutorch.so and registers into it
    from executorch.extension.pybindings import portable_lib  # noqa: F401

    problems = []
    for path in kernel_paths():
        try:
            ctypes.CDLL(path)
        except OSError as e:
            problems.append(f"{path}: {e}")
            continue
        if not _registered():
            problems.append(f"{path} loaded but {OUT_OP} is not in executorch's operator registry (a second "
                            "libexecutorch.so? build it against the installed executorch)")
            continue
        _loaded = path
        return path
    detail = "; ".join(problems) or "not found in " + ", ".join(candidate_dirs("moe")[:3])
    raise MoEExecuTorchKernelUnavailable(
        f"the ExecuTorch MoE kernel {KERNEL_TARGET} is not available: {detail}. Build it with "
        f"`tools/bazel build {KERNEL_TARGET}` (needs executorch installed; docs/executorch.md), install the "
        f"llmq-quant wheel built where executorch is installed, or set {KERNEL_ENV_VAR}=/path/to/_moe_executorch_kernel.so")


def program_calls_op(path: str) -> bool:
    """Whether the .pte at `path` names llmq's MoE op (its operator table holds the name as a string)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return False
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return m.find(OP_NAME.encode()) >= 0


def load_program(path: str):
    """executorch.runtime's Program for `path`, with llmq's MoE kernel loaded first when the program calls it
    (a missing kernel is one clear error, not ExecuTorch's `error: 0x14` at load_method)."""
    from executorch.runtime import Runtime

    if program_calls_op(path):
        load_executorch_kernel()
    return Runtime.get().load_program(path)


def load_method(program, name: str, path: str = "<program>"):
    """program.load_method(name); an OperatorMissing failure on llmq's op becomes an error that says what to load."""
    try:
        return program.load_method(name)
    except RuntimeError as e:
        if _OPERATOR_MISSING.search(str(e)) and os.path.isfile(path) and program_calls_op(path) and not _registered():
            raise MoEExecuTorchKernelUnavailable(
                f"{path}: method {name} calls {OUT_OP}, which is not registered with executorch's runtime "
                "(ExecuTorch: error 0x14, OperatorMissing); call llmq.ops.executorch_kernel.load_executorch_kernel() "
                "before loading the program") from e
        raise
