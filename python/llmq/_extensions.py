"""Find and load llmq's torch-free compiled extensions (`cpp/<dir>/_<name>*.so`) by file path.

One search for every extension, so the same code finds a .so in the installed wheel, in a Bazel
runfiles tree, in a source checkout, or wherever the extension's environment variable points:
  1. $ENV_VAR, a path to the .so (callers decide what an unusable value means),
  2. llmq/_kernels/ next to this file (the pip wheel, `llmq-quant`: setup.py builds every kernel there),
  3. cpp/<dir>/ relative to the repository root this file lives in (runfiles or checkout),
  4. bazel-bin/cpp/<dir>/ of that checkout (what `tools/bazel build //cpp/<dir>:...` made),
  5. cpp/<dir>/ under every sys.path entry and under $RUNFILES_DIR / $TEST_SRCDIR workspaces.
"""

from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import os
import sys
import threading
from types import ModuleType
from typing import Dict, List, Tuple

_load_lock = threading.Lock()
_loaded: Dict[Tuple[str, str], ModuleType] = {}  # (module name, real path) -> the module


def wheel_dir() -> str:
    """Where the pip wheel puts every compiled kernel (setup.py)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_kernels")


def candidate_dirs(subdir: str) -> List[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    repo_root = os.path.normpath(os.path.join(here, "..", ".."))
    dirs = [wheel_dir(), os.path.join(repo_root, "cpp", subdir), os.path.join(repo_root, "bazel-bin", "cpp", subdir)]
    dirs += [os.path.join(entry, "cpp", subdir) for entry in sys.path if entry]
    for var in ("RUNFILES_DIR", "TEST_SRCDIR"):
        root = os.environ.get(var)
        if root and os.path.isdir(root):
            dirs += [os.path.join(root, ws, "cpp", subdir) for ws in sorted(os.listdir(root))]
    return list(dict.fromkeys(dirs))


def find_extension(subdir: str, module_name: str) -> List[str]:
    """Every `<module_name>*.so` in the candidate folders, in search order."""
    return [p for d in candidate_dirs(subdir) for p in sorted(glob.glob(os.path.join(d, module_name + "*.so")))]


def load_first(module_name: str, paths: List[str]) -> Tuple[ModuleType | None, List[str]]:
    """Import the first of `paths` that loads; returns (module or None, one problem per failure).

    One load at a time, and a path loaded before gives the same module object: the first use
    of a kernel can come from two threads at once (a reader's read-ahead thread and the
    consumer), and two initialisations of one extension must not overlap (the likely cause of
    "module '_quant_kernel' has no attribute 'count_nonfinite'", seen twice in about twenty 4 GB
    NVFP4 exports from tmpfs, never since the lock)."""
    problems: List[str] = []
    with _load_lock:
        for path in paths:
            key = (module_name, os.path.realpath(path))
            if key in _loaded:
                return _loaded[key], problems
            try:
                loader = importlib.machinery.ExtensionFileLoader(module_name, path)
                spec = importlib.util.spec_from_file_location(module_name, path, loader=loader)
                assert spec is not None  # a loader was given
                module = importlib.util.module_from_spec(spec)
                loader.exec_module(module)
            except ImportError as e:  # wrong Python ABI, missing symbols, ...
                problems.append(f"{path}: {e}")
                continue
            _loaded[key] = module
            return module, problems
    return None, problems
