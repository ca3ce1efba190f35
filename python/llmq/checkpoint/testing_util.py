"""Helpers shared by the checkpoint tests (testonly; not part of the library)."""

import contextlib
import signal


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
