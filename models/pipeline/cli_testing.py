"""Test helper: run a quantize_and_save entry point in a forked child and check how it failed."""

import os
import signal
import sys

import torch

from models.pipeline.quantize_and_save import main_for


def run_main(arch, args, tmp_path, *, timeout: int = 300, entry=None):
    """main_for(arch) (or `entry()`, e.g. main_model_free) with argv `args` in a forked child: (exit status,
    stdout, stderr). The child
    is killed by SIGALRM after `timeout` seconds (a hang fails the case instead of the whole target)."""
    out_file, err_file = tmp_path / "child.stdout", tmp_path / "child.stderr"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 70
        try:
            with open(out_file, "wb") as o, open(err_file, "wb") as e:
                os.dup2(o.fileno(), 1)
                os.dup2(e.fileno(), 2)
                sys.stdout = os.fdopen(1, "w", buffering=1)
                sys.stderr = os.fdopen(2, "w", buffering=1)
                sys.argv = ["quantize_and_save"] + list(args)
                # The parent's OpenMP team does not survive fork(): one intra-op thread in the child.
                torch.set_num_threads(1)
                signal.alarm(timeout)
                try:
                    entry() if entry is not None else main_for(arch)
                    code = 0
                except SystemExit as exit_info:
                    code = exit_info.code if isinstance(exit_info.code, int) else 1
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    code = 71
                sys.stdout.flush()
                sys.stderr.flush()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out_file.read_text(), err_file.read_text()


def assert_one_line_exit_2(result, *words):
    """The run failed as the CLI promises: exit status 2, one 'error: ...' line on stderr holding `words`."""
    code, _, stderr = result
    lines = stderr.splitlines()
    assert code == 2, (code, stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]
