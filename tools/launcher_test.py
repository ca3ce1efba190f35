"""tools/bazel run for real on a simulated machine.

Each test copies the launcher into a fresh workspace (tools/bazel + requirements_lock.txt)
and runs it with a clean environment whose PATH holds only basic tools plus fakes:
`apt-get` (installs a fake bazel-4 and rules_java into the searched dirs), `id`, `python3`
(creates a venv holding a copy of itself; `-m pip` records and succeeds or fails; `-c` is
answered by the real interpreter) and the fake Bazel. Every fake appends its argv to a log.
Bazel is never run for real. A failure of the launcher itself must end with exactly one
line "llmq: error: ..." on stderr.

LLMQ_LAUNCHER_UNDER_TEST=<path> runs these tests against another launcher file.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

LAUNCHER = Path(os.environ.get("LLMQ_LAUNCHER_UNDER_TEST") or Path(__file__).with_name("bazel"))

# What a bare Debian machine has (coreutils, bash); anything else is a fake below.
BASIC_TOOLS = ["bash", "cat", "cp", "cut", "dirname", "head", "ls", "mkdir", "printf",
               "readlink", "rm", "sed", "sha256sum", "sort", "tail", "touch", "tr"]

RECORD = 'printf "%s" "${0##*/}" >>"$SIM_LOG"; printf "\\x1f%s" "$@" >>"$SIM_LOG"; echo >>"$SIM_LOG"\n'

FAKE_BAZEL = r"""#!/bin/bash
printf 'bazel pid=%s cwd=%s stamp=%s' "$$" "$PWD" "${LLMQ_VENV_STAMP:-}" >>"$SIM_LOG"
printf '\x1f%s' "$@" >>"$SIM_LOG"; echo >>"$SIM_LOG"
# Debian's bazel-bootstrap has no release label: `--version` and `version` behave like this.
if [[ $1 == --version ]]; then echo "bazel ${SIM_BAZEL_LABEL:-no_version}"; exit 0; fi
if [[ $1 == version && -z ${SIM_BAZEL_LABEL:-} ]]; then
  echo "ERROR: Version information not available" >&2; exit 2
fi
exit "${SIM_BAZEL_RC:-0}"
"""

FAKE_APT_GET = "#!/bin/bash\n" + RECORD + r"""
echo "DEBIAN_FRONTEND=${DEBIAN_FRONTEND:-}" >>"$SIM_LOG"
if [[ -n ${SIM_APT_FAIL:-} ]]; then echo "E: Unable to locate package $SIM_APT_FAIL"; exit 100; fi
[[ $1 == install ]] || exit 0
for p in "$@"; do
  case $p in
    bazel-bootstrap) cp "$SIM/fake-bazel" "$SIM_BAZEL_DIR/bazel-4"; chmod +x "$SIM_BAZEL_DIR/bazel-4" ;;
    bazel-rules-java) mkdir -p "$SIM_RULES_JAVA"; touch "$SIM_RULES_JAVA/WORKSPACE" ;;
  esac
done
"""

FAKE_ID = "#!/bin/bash\n" + RECORD + 'if [[ $1 == -u ]]; then echo "$SIM_UID"; else echo "uid=$SIM_UID"; fi\n'

FAKE_PYTHON = "#!/bin/bash\n" + RECORD + r"""
if [[ $1 == -m && $2 == venv ]]; then
  mkdir -p "$3/bin"; cp "${BASH_SOURCE[0]}" "$3/bin/python3"
  # Debian's python3 without python3-venv leaves a venv without pip and fails.
  if [[ -n ${SIM_VENV_FAIL:-} ]]; then echo "Error: ensurepip is not available"; exit 1; fi
  exit 0
fi
if [[ $1 == -m && $2 == pip ]]; then
  if [[ -n ${SIM_PIP_FAIL:-} ]]; then echo "ERROR: No matching distribution found for $SIM_PIP_FAIL"; exit 1; fi
  exit 0
fi
exec "$SIM_REAL_PYTHON" "$@"
"""

LOCK = "absl-py==2.5.1\nnumpy==2.3.4\n"


class Sim:
    """A workspace with the launcher, a bin dir of fakes and a log of what they saw."""

    def __init__(self, root: Path):
        self.root = root
        self.ws = root / "ws"
        (self.ws / "tools").mkdir(parents=True)
        shutil.copy(LAUNCHER, self.ws / "tools" / "bazel")
        (self.ws / "tools" / "bazel").chmod(0o755)
        self.lock = self.ws / "requirements_lock.txt"
        self.lock.write_text(LOCK)
        self.venv = self.ws / ".venv"
        self.stamp = self.venv / ".llmq-lock-stamp"
        self.bazel_dir = root / "usr-bin"  # the only dir searched for bazel-N
        self.bazel_dir.mkdir()
        self.rules_java = root / "rules_java"
        self.basic = root / "basic-bin"
        self.basic.mkdir()
        for tool in BASIC_TOOLS:
            (self.basic / tool).symlink_to(shutil.which(tool))
        self.fakes = root / "fake-bin"
        self.fakes.mkdir()
        self.write(root / "fake-bazel", FAKE_BAZEL)
        for name, text in [("apt-get", FAKE_APT_GET), ("id", FAKE_ID), ("python3", FAKE_PYTHON)]:
            self.write(self.fakes / name, text)
        (root / "tmp").mkdir()
        self.log = root / "calls.log"
        self.env = {
            "PATH": f"{self.fakes}:{self.basic}",
            "HOME": str(root),
            "TMPDIR": str(root / "tmp"),
            "LLMQ_BAZEL_DIRS": str(self.bazel_dir),
            "LLMQ_RULES_JAVA": str(self.rules_java),
            "SIM": str(root),
            "SIM_LOG": str(self.log),
            "SIM_BAZEL_DIR": str(self.bazel_dir),
            "SIM_RULES_JAVA": str(self.rules_java),
            "SIM_REAL_PYTHON": sys.executable,
            "SIM_UID": "0",
        }

    @staticmethod
    def write(path: Path, text: str):
        path.write_text(text)
        path.chmod(0o755)

    def install_bazel_and_rules_java(self, via_bazels_launcher=True):
        """A machine with Bazel; by default run as /usr/bin/bazel runs us (BAZEL_REAL set)."""
        shutil.copy(self.root / "fake-bazel", self.bazel_dir / "bazel-4")
        self.rules_java.mkdir()
        (self.rules_java / "WORKSPACE").touch()
        if via_bazels_launcher:
            self.env["BAZEL_REAL"] = str(self.bazel_dir / "bazel-4")

    def run(self, *args, **env):
        self.log.write_text("")
        proc = subprocess.Popen(
            [str(self.ws / "tools" / "bazel"), *args],
            cwd=self.root, env={**self.env, **env},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=60)
        proc.stdout_text, proc.stderr_text = out, err
        return proc

    def calls(self, name):
        """argv lists of every call of the fake `name` during the last run."""
        rows = [line.split("\x1f") for line in self.log.read_text().splitlines()]
        return [row[1:] for row in rows if row[0].split(" ")[0] == name]

    def bazel_runs(self):
        rows = [line.split("\x1f") for line in self.log.read_text().splitlines()]
        return [(dict(kv.split("=", 1) for kv in row[0].split(" ")[1:]), row[1:])
                for row in rows if row[0].startswith("bazel ")]


def error_line(proc):
    """The launcher failed: non-zero status and exactly one "llmq: error:" line, the last one."""
    assert proc.returncode != 0, proc.stderr_text
    lines = proc.stderr_text.splitlines()
    errors = [line for line in lines if line.startswith("llmq: error:")]
    assert len(errors) == 1, f"want exactly one 'llmq: error:' line, got:\n{proc.stderr_text}"
    assert lines[-1] == errors[0], f"the error line must come last:\n{proc.stderr_text}"
    return errors[0]


@pytest.fixture
def sim(tmp_path):
    return Sim(tmp_path)


ARGS = ["run", "//models/qwen:quantize_and_save", "--", "--out=a dir/with space"]


# --- bare machine ----------------------------------------------------------------------

def test_bare_machine_as_root_installs_bazel_then_execs_it(sim):
    proc = sim.run(*ARGS, SIM_BAZEL_RC="7")
    assert sim.calls("apt-get") == [["update", "-q"],
                                    ["install", "-y", "-q", "bazel-bootstrap", "bazel-rules-java"]]
    assert "DEBIAN_FRONTEND=noninteractive" in sim.log.read_text()
    (info, argv), = sim.bazel_runs()
    assert argv == ARGS
    assert int(info["pid"]) == proc.pid, "Bazel must replace the launcher (exec), not run as a child"
    assert info["cwd"] == str(sim.ws)
    assert proc.returncode == 7, "after exec the exit status is Bazel's"
    assert "llmq: error" not in proc.stderr_text
    assert info["stamp"] == sim.stamp.read_text().strip()


def test_bare_machine_not_root_names_the_packages_to_install(sim):
    proc = sim.run(*ARGS, SIM_UID="1000")
    line = error_line(proc)
    assert "sudo apt-get install bazel-bootstrap bazel-rules-java" in line
    assert proc.stderr_text.count("llmq:") == 1
    assert sim.calls("apt-get") == [] and sim.bazel_runs() == []


def test_bare_machine_without_apt_get_names_the_packages(sim):
    (sim.fakes / "apt-get").unlink()
    proc = sim.run(*ARGS)
    line = error_line(proc)
    assert "bazel-bootstrap" in line and "bazel-rules-java" in line
    assert proc.stderr_text.count("llmq:") == 1
    assert sim.bazel_runs() == []


def test_apt_get_failure_shows_its_log_and_one_line(sim):
    proc = sim.run(*ARGS, SIM_APT_FAIL="bazel-bootstrap")
    line = error_line(proc)
    assert "E: Unable to locate package bazel-bootstrap" in proc.stderr_text
    assert "apt-get install bazel-bootstrap bazel-rules-java failed" in line
    assert sim.bazel_runs() == []


def test_apt_installing_no_bazel_is_one_line(sim):
    sim.write(sim.fakes / "apt-get", "#!/bin/bash\n" + RECORD)  # "succeeds", installs nothing
    line = error_line(sim.run(*ARGS))
    assert str(sim.bazel_dir) in line and "bazel-N" in line


def test_missing_rules_java_alone_is_installed(sim):
    shutil.copy(sim.root / "fake-bazel", sim.bazel_dir / "bazel-4")
    proc = sim.run("build", "//...")
    assert sim.calls("apt-get")[-1] == ["install", "-y", "-q", "bazel-rules-java"]
    assert (sim.rules_java / "WORKSPACE").exists()
    assert [argv for _, argv in sim.bazel_runs()] == [["build", "//..."]]
    assert proc.returncode == 0, proc.stderr_text


def test_newest_bazel_n_is_chosen_and_bazel_real_wins(sim):
    sim.install_bazel_and_rules_java(via_bazels_launcher=False)
    shutil.copy(sim.root / "fake-bazel", sim.bazel_dir / "bazel-4.10.0")
    (sim.bazel_dir / "bazel-4.9.0").write_text("#!/bin/bash\nexit 99\n")
    (sim.bazel_dir / "bazel-4.9.0").chmod(0o755)
    proc = sim.run("info")
    assert proc.returncode == 0, proc.stderr_text
    assert len(sim.bazel_runs()) == 1  # bazel-4.10.0 (version order, not text order)
    proc = sim.run("info", BAZEL_REAL=str(sim.bazel_dir / "bazel-4.9.0"))
    assert proc.returncode == 99 and sim.bazel_runs() == []


# --- `version` -------------------------------------------------------------------------

def test_version_on_a_label_less_bazel_prints_no_error(sim):
    sim.install_bazel_and_rules_java()
    proc = sim.run("version")
    assert proc.returncode == 0, proc.stderr_text
    assert proc.stdout_text.startswith("Build label: ")
    assert "ERROR" not in proc.stderr_text and "error" not in proc.stdout_text.lower()


def test_version_on_a_labelled_bazel_is_bazels_own(sim):
    sim.install_bazel_and_rules_java()
    proc = sim.run("version", SIM_BAZEL_LABEL="4.2.3")
    assert proc.returncode == 0, proc.stderr_text
    assert sim.bazel_runs()[-1][1] == ["version"]


# --- .venv from the lock -------------------------------------------------------------

def pip_installs(sim):
    return [argv for argv in sim.calls("python3") if argv[:2] == ["-m", "pip"]]


def venv_creations(sim):
    return [argv for argv in sim.calls("python3") if argv[:2] == ["-m", "venv"]]


def test_lock_changed_path(sim):
    sim.install_bazel_and_rules_java()
    pip_cmd = ["-m", "pip", "install", "-q", "--disable-pip-version-check", "-r", str(sim.lock)]

    first = sim.run("build", "//...")  # fresh machine: creates .venv, installs the lock
    assert first.returncode == 0, first.stderr_text
    assert venv_creations(sim) == [["-m", "venv", str(sim.venv)]]
    assert pip_installs(sim) == [pip_cmd]
    stamp1 = sim.stamp.read_text().strip()
    assert [info["stamp"] for info, _ in sim.bazel_runs()] == [stamp1]

    again = sim.run("build", "//...")  # nothing changed: no pip
    assert again.returncode == 0, again.stderr_text
    assert pip_installs(sim) == [] and venv_creations(sim) == []
    assert "llmq:" not in again.stderr_text
    assert [info["stamp"] for info, _ in sim.bazel_runs()] == [stamp1]

    sim.lock.write_text(LOCK + "safetensors==0.7.0\n")  # lock changed: pip again, same venv
    changed = sim.run("build", "//...")
    assert changed.returncode == 0, changed.stderr_text
    assert pip_installs(sim) == [pip_cmd] and venv_creations(sim) == []
    stamp2 = sim.stamp.read_text().strip()
    assert stamp2 != stamp1
    assert [info["stamp"] for info, _ in sim.bazel_runs()] == [stamp2]


def test_pip_failure_is_one_line_and_leaves_no_stamp(sim):
    sim.install_bazel_and_rules_java()
    assert sim.run("build", "//...").returncode == 0
    sim.lock.write_text(LOCK + "nosuchpackage==1.0\n")
    proc = sim.run("build", "//...", SIM_PIP_FAIL="nosuchpackage==1.0")
    line = error_line(proc)
    assert "No matching distribution found for nosuchpackage==1.0" in proc.stderr_text
    assert "pip install" in line and "requirements_lock.txt" in line
    assert not sim.stamp.exists() and sim.bazel_runs() == []

    retry = sim.run("build", "//...")  # no stamp: the next run installs again
    assert retry.returncode == 0, retry.stderr_text
    assert len(pip_installs(sim)) == 1 and sim.stamp.exists()


def test_venv_failure_is_one_line_and_leaves_no_half_venv(sim):
    sim.install_bazel_and_rules_java()
    proc = sim.run("build", "//...", SIM_VENV_FAIL="1")
    line = error_line(proc)
    assert "python3-venv" in line
    assert not sim.venv.exists() and sim.bazel_runs() == []


def test_no_python_is_one_line(sim):
    sim.install_bazel_and_rules_java()
    (sim.fakes / "python3").unlink()
    proc = sim.run("build", "//...")
    line = error_line(proc)
    assert "python3" in line
    assert proc.stderr_text.count("llmq:") == 1
    assert sim.bazel_runs() == []


def test_unexpected_failure_still_ends_with_one_line(sim):
    sim.install_bazel_and_rules_java()
    (sim.basic / "sha256sum").unlink()  # a broken machine: a step set -e stops on
    proc = sim.run("build", "//...")
    line = error_line(proc)
    assert "sha256sum" in line
    assert sim.bazel_runs() == []


def test_unrunnable_bazel_is_one_line(sim):
    sim.install_bazel_and_rules_java()
    (sim.bazel_dir / "bazel-4").write_bytes(b"\x7fELF\x02\x01\x01 not really a binary\x00")
    line = error_line(sim.run("build", "//..."))
    assert str(sim.bazel_dir / "bazel-4") in line


def test_bazel_with_a_missing_interpreter_is_one_line(sim):
    sim.install_bazel_and_rules_java()
    sim.write(sim.bazel_dir / "bazel-4", "#!/nonexistent/interpreter\n")
    line = error_line(sim.run("build", "//..."))
    assert str(sim.bazel_dir / "bazel-4") in line
