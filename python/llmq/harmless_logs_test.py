"""The known-harmless third-party lines are dropped by exact message; anything else still shows."""

import logging
import warnings

import pytest

import llmq.quant  # noqa: F401  (installs the filters)
from llmq import harmless_logs

SITE = "/venv/lib/python3.11/site-packages"
DROPPED = [
    ("torchao", f"Failed to load {SITE}/torchao/_C_cutlass_90a.abi3.so: Could not load this library: "
                f"{SITE}/torchao/_C_cutlass_90a.abi3.so"),
    ("torchao", f"Failed to load {SITE}/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load this "
                f"library: {SITE}/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"),
    ("torchao.kernel.intmm", "Warning: Detected no triton, on systems without Triton certain kernels will not work"),
    ("torch.utils._pytree", "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by "
                            "torch.compile as an opaque value type. Calling register_constant() on Enum subclasses "
                            "is deprecated and will be an error in a future release."),
]
KEPT = [
    ("torchao", f"Failed to load {SITE}/torchao/_C.abi3.so: undefined symbol: foo"),  # torchao's CPU kernels
    ("torchao", f"Failed to load {SITE}/torchao/_C_mxfp8.cpython-311-x86_64-linux-gnu.so: Could not load this library"),
    ("torchao.kernel.intmm", "something else"),
    ("torch.utils._pytree", "<class 'Foo'> is not registered"),
]


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("logger,message", DROPPED + KEPT)
def test_only_the_known_messages_are_dropped(logger, message):
    handler = _Collect()
    log = logging.getLogger(logger)
    log.addHandler(handler)
    try:
        log.warning(message)
    finally:
        log.removeHandler(handler)
    assert handler.messages == ([] if (logger, message) in DROPPED else [message])


def test_leafspec_future_warning_is_dropped_other_future_warnings_are_not():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning shows ...
        harmless_logs.install()  # ... but the one this drops
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning, stacklevel=1)
        warnings.warn("something else is deprecated", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else is deprecated"]
