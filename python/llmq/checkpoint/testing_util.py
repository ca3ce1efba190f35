"""Helpers shared by the checkpoint tests (testonly; not part of the library)."""

import contextlib
import signal

from llmq.quant import QuantConfig, format_names, get_format


def format_configs():
    """label -> config: every stored form the library quantizes to (each registered quantizable
    format's `example_configs`), for the tests that write each to a bundle or an HF folder. Labels are
    the configs' describe() text, e.g. 'int4_g32_asym', 'fp8_128x128', 'nvfp4_g16'."""
    out = {}
    for name in format_names(quantizable=True):
        if get_format(name).family == "gguf-quant":
            continue  # canonical "int" values (stored as int): llmq/quant:gguf_quant_test, pipeline:gguf_backend_test
        for fields in get_format(name).example_configs(name):
            config = QuantConfig(format=name, **fields)
            out[config.describe().replace(" ", "_")] = config
    return out


FORMAT_CONFIGS = format_configs()


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
