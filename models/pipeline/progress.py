"""Progress of a long step a person waits for: counts, rate and ETA on stderr, and the step's time.

``Progress(what, total)``; ``advance(n=1)`` after each unit prints ``<what>: i/total <unit>, <s> s
each, ETA <s> s`` (at most one line every `interval` seconds, and the last where the step took longer); ``seconds`` is the
time so far (the summary's row for the step); ``wrap(items)`` advances once per item.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class Progress:
    def __init__(self, what: str, total: int, unit: str = "layers", *, stream: Optional[TextIO] = None,
                 enabled: bool = True, done: int = 0, interval: float = 1.0):
        self.what, self.total, self.unit = what, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.done = self.first = done  # resumed work counts as done but not in the rate
        self.start = time.perf_counter()
        self._last_print = time.perf_counter()
        self.interval = interval

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def eta(self) -> Optional[float]:
        ran = self.done - self.first
        if ran <= 0:
            return None
        return self.seconds / ran * (self.total - self.done)

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if not self.enabled or now - self._last_print < self.interval and (
                self.done < self.total or now - self.start < self.interval):
            return  # the last line too, unless the step took under one interval
        self._last_print = now
        ran = self.done - self.first
        each = f", {self.seconds / ran:.2f} s each" if ran else ""
        eta = self.eta()
        tail = f", ETA {eta:.0f} s" if eta is not None and self.done < self.total else f", {self.seconds:.1f} s"
        print(f"{self.what}: {self.done}/{self.total} {self.unit}{each}{tail}", file=self.stream, flush=True)

    def wrap(self, items):
        for item in items:
            yield item
            self.advance()
