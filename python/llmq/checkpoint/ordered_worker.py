"""One background thread running jobs in submission order, with a bound on the bytes queued.

The bundle writer uses three (writes, hashing, fsync); a streaming safetensors shard
(`shard_file.StreamingShardFile`) one, for its writes. A job's bytes are counted from submit
until it has run, so a producer never holds more than the bound in queued work.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Optional


class OrderedWorker:
    """One background thread running jobs in submission order, with a bound on queued bytes.

    The first failure is kept and re-raised by ``check``/``join`` in the caller's thread;
    jobs queued after it are dropped (their bytes released), so nothing is written past
    an error.
    """

    def __init__(self, name: str, limit_bytes: float):
        self._limit = limit_bytes
        self._jobs: deque = deque()
        self._pending = 0
        self._submitted = self._finished = 0  # jobs submitted / run (or dropped), in order
        self._running = False
        self._cv = threading.Condition()
        self._stopping = False
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], nbytes: int = 0) -> None:
        with self._cv:
            # A job larger than the whole limit still goes in, once the queue is empty, and
            # submit returns when it has run: its bytes are never queued behind the caller.
            while self._pending and self._pending + nbytes > self._limit and self.error is None:
                self._cv.wait()
            self.check()
            self._jobs.append((job, nbytes))
            self._pending += nbytes
            self._submitted += 1
            ticket = self._submitted
            self._cv.notify_all()
            if nbytes > self._limit:
                while self._finished < ticket and self.error is None:
                    self._cv.wait()
                self.check()

    def idle(self) -> bool:
        with self._cv:
            return not self._jobs and not self._running

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def join(self) -> None:
        """Run every queued job, stop the thread, and re-raise its first error."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join()
        self.check()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stopping:
                    self._cv.wait()
                if not self._jobs:
                    return
                job, nbytes = self._jobs.popleft()
                self._running = True
            try:
                if self.error is None:
                    job()
            except BaseException as e:  # handed to the caller's thread
                self.error = e
            finally:
                job = None  # drop the tensor references before waking the producer
                with self._cv:
                    self._pending -= nbytes
                    self._finished += 1
                    self._running = False
                    self._cv.notify_all()
