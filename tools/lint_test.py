"""tools/lint on a scratch workspace: each check fails on a planted violation, passes clean.

Each test copies tools/lint and the repository's three configurations (ruff.toml, mypy.ini,
.clang-format) into a fresh git repository with one small Python module under python/llmq and
one C++ file under cpp/, links .venv to the interpreter running the test (the .venv that
tools/bazel made, which holds the pinned ruff, mypy and clang-format), and runs tools/lint.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

CLEAN_PY = '''"""A module every check accepts."""

import os


def home() -> str:
    return os.environ.get("HOME", "")
'''

CLEAN_CC = """// A file clang-format leaves as it is.
#include <cstdint>

namespace llmq_lint_probe {

int64_t twice(int64_t x) { return 2 * x; }

}  // namespace llmq_lint_probe
"""


def _find(name: str) -> Path:
    """A file of the repository, from runfiles (Bazel) or the checkout (pytest)."""
    for base in (ROOT, Path(os.environ.get("TEST_SRCDIR", "/nonexistent")) / "__main__"):
        if (base / name).exists():
            return base / name
    raise FileNotFoundError(name)


@pytest.fixture
def workspace(tmp_path):
    ws = tmp_path / "ws"
    (ws / "tools").mkdir(parents=True)
    shutil.copy(_find("tools/lint"), ws / "tools" / "lint")
    (ws / "tools" / "lint").chmod(0o755)
    for name in ("ruff.toml", "mypy.ini", ".clang-format"):
        shutil.copy(_find(name), ws / name)
    (ws / "python" / "llmq").mkdir(parents=True)
    (ws / "python" / "llmq" / "__init__.py").write_text("")
    (ws / "python" / "llmq" / "probe.py").write_text(CLEAN_PY)
    (ws / "cpp").mkdir()
    (ws / "cpp" / "probe.cc").write_text(CLEAN_CC)
    (ws / ".venv").symlink_to(Path(sys.prefix))
    (ws / ".gitignore").write_text("/.venv\n.mypy_cache/\n.ruff_cache/\n")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q"], cwd=ws, check=True)
    subprocess.run(git + ["add", "-A"], cwd=ws, check=True)
    return ws


def lint(ws: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(ws)}
    return subprocess.run([str(ws / "tools" / "lint"), *args], cwd=ws, env=env, capture_output=True, text=True,
                          timeout=600)


def verdicts(out: str) -> dict:
    """{'ruff': 'ok' | 'FAILED', ...} from the one line each check prints."""
    found = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "lint:" and parts[1] in ("ruff", "clang-format", "mypy"):
            found[parts[1]] = parts[2]
    return found


def test_clean_tree_passes(workspace):
    r = lint(workspace)
    assert r.returncode == 0, r.stdout + r.stderr
    assert verdicts(r.stdout) == {"ruff": "ok", "clang-format": "ok", "mypy": "ok"}


@pytest.mark.parametrize("check, path, text", [
    ("ruff", "python/llmq/probe.py", CLEAN_PY.replace("import os\n", "import os\nimport sys\n")),  # unused import
    ("clang-format", "cpp/probe.cc", CLEAN_CC.replace("return 2 * x;", "return 2*x;")),
    ("mypy", "python/llmq/probe.py", CLEAN_PY.replace('os.environ.get("HOME", "")', "len(os.sep)")),
])
def test_each_check_fails_on_its_violation(workspace, check, path, text):
    (workspace / path).write_text(text)
    r = lint(workspace)
    assert r.returncode == 1, r.stdout + r.stderr
    got = verdicts(r.stdout)
    assert got[check] == "FAILED", r.stdout
    assert [c for c, v in got.items() if v == "FAILED"] == [check], r.stdout
    assert r.stdout.splitlines()[-1] == f"lint: 1 check(s) failed: {check}"


def test_fix_repairs_import_order_and_cpp_format(workspace):
    py = workspace / "python" / "llmq" / "probe.py"
    py.write_text(CLEAN_PY.replace("import os\n", "import sys\nimport os\n").replace('"")', '"") + sys.platform'))
    (workspace / "cpp" / "probe.cc").write_text(CLEAN_CC.replace("return 2 * x;", "return 2*x;"))
    assert lint(workspace).returncode == 1
    r = lint(workspace, "--fix")
    assert r.returncode == 0, r.stdout + r.stderr
    assert py.read_text().index("import os") < py.read_text().index("import sys")
    assert (workspace / "cpp" / "probe.cc").read_text() == CLEAN_CC


def test_missing_tools_is_one_line_and_status_2(workspace):
    (workspace / ".venv").unlink()
    r = lint(workspace)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("lint: error: .venv lacks"), r.stderr
