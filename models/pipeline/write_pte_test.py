"""The .pte file is written atomically (export_pte.write_pte -> llmq.checkpoint.workfolder.publish_file):
in `<out>.partial/`, fsynced, renamed; a failed or killed export leaves no file (an old one stays
whole), another export to the same path is refused at once. Needs no executorch: the program is
anything with executorch's `write_to_file(f)`."""

import os

import pytest

from llmq.checkpoint import OutputBusyError
from llmq.checkpoint.crash_points import check_every_crash_point
from models.pipeline.export_pte import write_pte

DATA = bytes(range(256)) * 64


class Program:
    """Stands for executorch's ExecutorchProgramManager: writes its bytes in chunks into `f`."""

    def __init__(self, data=DATA, fail_after=None, during=None):
        self.data, self.fail_after, self.during = data, fail_after, during

    def write_to_file(self, f):
        f.flush()
        for i in range(0, len(self.data), 4096):
            if self.fail_after is not None and i >= self.fail_after:
                raise RuntimeError("lowering died")
            if self.during is not None and i == 4096:
                self.during()
            os.write(f.fileno(), self.data[i:i + 4096])


def test_a_failed_export_leaves_the_old_file_whole_and_nothing_else(tmp_path):
    out = tmp_path / "model.pte"
    write_pte(Program(b"old" * 100), str(out))
    with pytest.raises(RuntimeError, match="lowering died"):
        write_pte(Program(fail_after=8192), str(out))
    assert out.read_bytes() == b"old" * 100 and os.listdir(tmp_path) == ["model.pte"]
    write_pte(Program(), str(out))
    assert out.read_bytes() == DATA and os.listdir(tmp_path) == ["model.pte"]


def test_a_second_export_to_the_same_path_is_refused(tmp_path):
    out = tmp_path / "model.pte"
    refused = []

    def second():
        with pytest.raises(OutputBusyError) as info:
            write_pte(Program(b"other"), str(out))
        refused.append(str(info.value))

    write_pte(Program(during=second), str(out))
    assert refused == [f"{out}: another llmq run is writing there (pid {os.getpid()})"]
    assert out.read_bytes() == DATA and os.listdir(tmp_path) == ["model.pte"]


def test_a_kill_or_failure_at_every_step_leaves_no_partial_file(tmp_path):
    seen = check_every_crash_point(lambda out: write_pte(Program(), out), str(tmp_path / "runs"),
                                   accept_refusal=lambda e: False)
    assert any(s.startswith("kill") for s in seen) and any(s.startswith("fail") for s in seen)
