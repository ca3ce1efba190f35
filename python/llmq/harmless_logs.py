"""Drop the known-harmless log lines of llmq's optional dependencies, each matched by its exact message.

Importing torchao (llmq.quant's torchao converters, the .pte export) logs, on every CPU-only machine:
  * torchao: "Failed to load .../torchao/_C_cutlass_90a.abi3.so" (a CUDA sm_90a library) and
    ".../torchao/_C_mxfp8.cpython-310-...so" (built for CPython 3.10 only): torchao loads every `_C*.so`
    it ships and logs each that cannot load here; its CPU kernels are unaffected;
  * torchao.kernel.intmm: "Detected no triton" (Triton is a GPU compiler);
  * torch.utils._pytree: "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by
    torch.compile ..." (torchao 0.18 registers an Enum with pytree, a deprecation note for torchao).
They look like failures and are not. Only these messages are dropped: a torchao library that should load
here (its CPU kernels, a CUDA library where torch has CUDA) still logs its failure. Set
LLMQ_SHOW_HARMLESS_LOGS=1 to see them. Importing llmq.quant (which every torchao and ExecuTorch path of llmq
imports first) installs the filters (a logging.Filter per logger,
one `warnings` filter by message; no third-party import).
"""

from __future__ import annotations

import logging
import os
import re
import warnings

ENV_VAR = "LLMQ_SHOW_HARMLESS_LOGS"

_PATTERNS = {
    "torchao": re.compile(r"Failed to load \S*/torchao/(_C_cutlass_90a\.abi3|_C_mxfp8\.cpython-310-[^/ ]*)\.so: "
                          r"Could not load this library"),
    "torchao.kernel.intmm": re.compile(r"Warning: Detected no triton, on systems without Triton certain kernels will "
                                       r"not work$"),
    "torch.utils._pytree": re.compile(r"<enum '\w+'> is an Enum subclass and is now natively supported by "
                                      r"torch\.compile as an opaque value type\."),
}


class _DropKnownHarmless(logging.Filter):
    def __init__(self, pattern: "re.Pattern[str]"):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        return not self.pattern.search(message)


def install() -> None:
    """Add the filters (once per logger); a no-op with LLMQ_SHOW_HARMLESS_LOGS=1."""
    if os.environ.get(ENV_VAR, "") not in ("", "0"):
        return
    for name, pattern in _PATTERNS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownHarmless) for f in logger.filters):
            logger.addFilter(_DropKnownHarmless(pattern))
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
