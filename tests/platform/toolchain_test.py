"""Bazel runs tests with the repo's .venv interpreter and the pinned packages."""

import os
import sys
from pathlib import Path


def _lock_pins():
    lock = Path(os.environ["TEST_SRCDIR"]) / os.environ["TEST_WORKSPACE"] / "requirements_lock.txt"
    pins = {}
    for line in lock.read_text().splitlines():
        line = line.split(";")[0].strip()
        if line and not line.startswith("#") and "==" in line:
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_interpreter_is_the_venv():
    assert Path(sys.prefix).name == ".venv", sys.prefix


def test_installed_packages_match_the_lock():
    from importlib.metadata import version

    pins = _lock_pins()
    for name in ("torch", "torchao", "safetensors", "pybind11", "absl-py", "pytest"):
        assert version(name).split("+")[0] == pins[name], name


def test_llmq_importable():
    import llmq

    assert llmq.__version__
