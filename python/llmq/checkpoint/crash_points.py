"""Fault injection at every file-system step of a writer, for the crash-point tests of every llmq
writer (the bundle, the HF export, the MLX folder, the .pte file). Testonly.

A run's steps are its calls of ``os.write``, ``os.pwrite``, ``os.fsync``, ``os.fdatasync``,
``os.replace``, ``os.rename``, ``os.unlink`` and ``os.rmdir`` (shutil.rmtree and every llmq helper
go through them), on any thread. ``count_steps`` counts them in a clean run; ``killed_at(run, n)``
runs it in a forked child that dies (``os._exit``, as SIGKILL: no handler, no cleanup) instead of
making its n-th step; ``failing_at(run, n)`` runs it here with the n-th step raising ``OSError(EIO)``.
``check_every_crash_point`` drives a writer through all of them and checks the contract
(docs/checkpoint.md): after a kill nothing complete-looking but the finished output is there, a
rerun gives the uninterrupted run's bytes or refuses in one line, and nothing is left over.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import threading
from typing import Callable, Dict, Iterator, List, Optional, Set

STEPS = ("write", "pwrite", "fsync", "fdatasync", "replace", "rename", "unlink", "rmdir")
KILLED = 97  # the child's exit status when it died at the chosen step


@contextlib.contextmanager
def _patched(on_step: Callable[[str], None]) -> Iterator[None]:
    real = {name: getattr(os, name) for name in STEPS}

    def wrap(name):
        fn = real[name]

        def step(*args, **kwargs):
            on_step(name)
            return fn(*args, **kwargs)
        return step

    for name in STEPS:
        setattr(os, name, wrap(name))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(os, name, fn)


def count_steps(run: Callable[[], object]) -> int:
    lock, count = threading.Lock(), [0]

    def on_step(name):
        with lock:
            count[0] += 1

    with _patched(on_step):
        run()
    return count[0]


def killed_at(run: Callable[[], object], n: int) -> int:
    """Run ``run`` in a forked child killed instead of making its n-th step; its exit status
    (KILLED, or 0 when it finished first)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            lock, count = threading.Lock(), [0]

            def on_step(name):
                with lock:
                    count[0] += 1
                    if count[0] == n:
                        os._exit(KILLED)

            with _patched(on_step):
                run()
        except BaseException:  # noqa: BLE001 - reported by the status
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def failing_at(run: Callable[[], object], n: int) -> Optional[BaseException]:
    """Run ``run`` here with its n-th step raising OSError(EIO); the exception it raised (None if
    it finished first)."""
    lock, count = threading.Lock(), [0]

    def on_step(name):
        with lock:
            count[0] += 1
            hit = count[0] == n
        if hit:
            raise OSError(errno.EIO, f"injected failure of os.{name}")

    try:
        with _patched(on_step):
            run()
    except BaseException as e:  # noqa: BLE001 - returned to the test
        return e
    return None


def digest(path: str) -> Dict[str, str]:
    """{relative file name: sha256} of a folder (or of one file: {"": sha256})."""
    if os.path.isfile(path):
        return {"": hashlib.sha256(open(path, "rb").read()).hexdigest()}
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, path)] = hashlib.sha256(open(full, "rb").read()).hexdigest()
    return dict(sorted(out.items()))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def check_every_crash_point(write: Callable[[str], object], parent: str, *, accept_refusal: Callable[[BaseException], bool],
                            stride: int = 1) -> List[str]:
    """Drive ``write(out)`` (resume on, overwrite off) through a kill and an injected failure at
    every ``stride``-th step; returns what was seen, one line per crash point.

    After each kill: ``<out>`` is absent or the complete reference. The rerun (``write(out)``
    again) gives the reference's bytes, or refuses with one line (``accept_refusal``; then a
    third run after removing the leftovers must give the reference). After each injected
    failure: the run raised one line, ``<out>`` does not exist, and a rerun gives the reference.
    In the end nothing is left in ``parent`` but ``<out>``.
    """
    os.makedirs(parent, exist_ok=True)
    reference_out = os.path.join(parent, "reference")
    write(reference_out)
    reference = digest(reference_out)
    total = count_steps(lambda: write(os.path.join(parent, "counted")))
    for name in ("reference", "counted"):
        _remove(os.path.join(parent, name))
    assert os.listdir(parent) == [], os.listdir(parent)
    seen: List[str] = []
    out = os.path.join(parent, "out")
    for n in range(1, total + 1, stride):
        code = killed_at(lambda: write(out), n)
        assert code in (KILLED, 0), f"step {n}: the child failed (status {code})"
        if os.path.lexists(out):
            assert digest(out) == reference, f"killed at step {n}: {out} exists but is not the complete output"
        try:
            write(out)
            outcome = "resumed"
        except BaseException as e:  # noqa: BLE001
            message = str(e)
            assert accept_refusal(e) and "\n" not in message, f"killed at step {n}: rerun failed: {e!r}"
            outcome = f"refused: {message}"
        assert digest(out) == reference, f"killed at step {n}: rerun is not the uninterrupted output"
        left = _leftovers(parent)
        assert left == set(), f"killed at step {n} ({outcome}): left {left}"
        seen.append(f"kill {n}: {outcome}")
        _remove(out)

        error = failing_at(lambda: write(out), n)
        if error is not None:
            assert "\n" not in str(error) and str(error), f"failure at step {n}: {error!r}"
            assert not os.path.lexists(out), f"failure at step {n}: {out} was published after an error"
            write(out)
            assert digest(out) == reference, f"failure at step {n}: rerun is not the uninterrupted output"
            assert _leftovers(parent) == set(), f"failure at step {n}: left {_leftovers(parent)}"
            seen.append(f"fail {n}: {type(error).__name__}: {error}")
        _remove(out)
    assert total > 0
    return seen


def _leftovers(parent: str) -> Set[str]:
    return set(os.listdir(parent)) - {"out"}
