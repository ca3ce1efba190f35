"""Find and load the compiled MoE kernel (`_moe_kernel*.so`, Bazel target //cpp/moe:_moe_kernel.so).

The extension is loaded by file path, so the same code finds it in the installed wheel, a
Bazel runfiles tree, a source checkout, or wherever `LLMQ_MOE_KERNEL` points. Without it the op's
CPU kernel raises MoEKernelUnavailable naming what is missing (no fallback). Search order
(llmq/_extensions.py):
  1. $LLMQ_MOE_KERNEL (a path to the .so; an error if it is set but missing),
  2. llmq/_kernels/ (the pip wheel `llmq-quant`),
  3. cpp/moe/ relative to the repository root this file lives in (runfiles or checkout),
  4. bazel-bin/cpp/moe/ of that checkout,
  5. cpp/moe/ under every sys.path entry and under $RUNFILES_DIR / $TEST_SRCDIR workspaces.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import List, Optional

from llmq._extensions import candidate_dirs, find_extension, load_first

ENV_VAR = "LLMQ_MOE_KERNEL"
_TARGET = "//cpp/moe:_moe_kernel.so"

_module: Optional[ModuleType] = None
_error: Optional[str] = None


class MoEKernelUnavailable(RuntimeError):
    """The compiled extension _moe_kernel.so could not be found or loaded."""


def _find() -> List[str]:
    env = os.environ.get(ENV_VAR)
    if env:
        if not os.path.isfile(env):
            raise MoEKernelUnavailable(f"{ENV_VAR}={env} does not name a file (expected the built _moe_kernel.so)")
        return [env]
    return find_extension("moe", "_moe_kernel")


def load_kernel() -> ModuleType:
    """The loaded extension module; raises MoEKernelUnavailable naming what is missing."""
    global _module, _error
    if _module is not None:
        return _module
    if _error is not None:
        raise MoEKernelUnavailable(_error)
    try:
        paths = _find()
    except MoEKernelUnavailable as e:
        _error = str(e)
        raise
    module, problems = load_first("_moe_kernel", paths)
    if module is not None:
        _module = module
        return module
    detail = "; ".join(problems) if problems else "searched " + ", ".join(candidate_dirs("moe")[:4]) + ", ..."
    _error = (
        f"the compiled MoE kernel _moe_kernel.so ({_TARGET}) is not available: {detail}. "
        f"Build it with Bazel (depend on {_TARGET}), install the llmq-quant wheel (pip install .), "
        f"or set {ENV_VAR}=/path/to/_moe_kernel.so"
    )
    raise MoEKernelUnavailable(_error)


def moe_kernel_available() -> bool:
    """Cheap probe: True if the compiled kernel loads (callers pick a fallback otherwise)."""
    try:
        load_kernel()
        return True
    except MoEKernelUnavailable:
        return False
