"""The shared library never imports a backend or a model (data flows one way).

Bazel visibility already rejects a BUILD dependency from python/llmq on backends/ or
models/; this test also catches an import that would only fail at run time. The backends'
packages (llmq_<name>) are read from the backend registry: a new backend is covered without
editing this file.
"""

import ast
import os
from pathlib import Path

import backends.registered  # noqa: F401  every backend registered
from llmq.backend import backend_names, get_backend


def _backend_packages():
    """The top-level package of every registered backend that is not the core's own."""
    packages = {type(get_backend(name)).__module__.split(".")[0] for name in backend_names()}
    return packages - {"llmq"}


FORBIDDEN_TOP_LEVEL = {"backends", "models", "llmq_models"} | _backend_packages()


def _core_sources():
    root = Path(os.environ["TEST_SRCDIR"]) / os.environ["TEST_WORKSPACE"] / "python" / "llmq"
    files = sorted(root.rglob("*.py"))
    assert files, f"no sources found under {root}"
    return root, files


def _imported_modules(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_core_imports_no_backend_or_model():
    root, files = _core_sources()
    offenders = []
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for module in _imported_modules(tree):
            if module.split(".")[0] in FORBIDDEN_TOP_LEVEL:
                offenders.append(f"{path.relative_to(root)} imports {module}")
    assert not offenders, "python/llmq must not import backends or models:\n" + "\n".join(offenders)


def test_every_backend_package_is_forbidden():
    packages = _backend_packages()
    assert {"llmq_cuda", "llmq_hf", "llmq_mlx"} <= packages, packages
    assert packages <= FORBIDDEN_TOP_LEVEL


def test_the_check_sees_a_violation():
    for package in sorted(_backend_packages()):
        tree = ast.parse(f"import os\nfrom {package}.backend import register_backend\n")
        assert any(m.split(".")[0] in FORBIDDEN_TOP_LEVEL for m in _imported_modules(tree)), package
