"""Helpers shared by the checkpoint tests (testonly; not part of the library)."""

import contextlib
import signal

from llmq.quant import QuantConfig

# One config per stored form the library quantizes to (integer widths and groupings, every FP format and
# FP8 granularity), for the tests that write each to a bundle or an HF folder.
FORMAT_CONFIGS = {
    "int4": QuantConfig(format="int", bits=4, group_size=32),  # asymmetric
    "int4_g64_sym": QuantConfig(bits=4, group_size=64, symmetric=True),
    "int5_asym": QuantConfig(format="int", bits=5, group_size=64, symmetric=False),
    "int8_row": QuantConfig(bits=8, group_size=None),
    "fp8_tensor": QuantConfig(format="fp8", bits=8, group_size=0),
    "fp8_channel": QuantConfig(format="fp8", bits=8, group_size=None),
    "fp8_block128": QuantConfig(format="fp8", bits=8, group_size=128),
    "mxfp4": QuantConfig(format="mxfp4", bits=4, group_size=32),
    "mxfp8": QuantConfig(format="mxfp8", bits=8, group_size=32),
    "nvfp4": QuantConfig(format="nvfp4", bits=4, group_size=16),
}


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise TimeoutError in the body after `seconds` (SIGALRM): a reader that loops on a bad
    count fails the test instead of hanging it."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"reader still running after {seconds} s (hang?)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
