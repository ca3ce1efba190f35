"""llmq.ops.executorch_kernel without executorch: the search places, the op scan of a .pte, and the error that
replaces ExecuTorch's `error: 0x14` when a program calls llmq's op and its kernel library is not loaded."""

import os

import pytest

from llmq import _extensions
from llmq.ops import executorch_kernel as ek


def test_search_covers_the_wheel_and_bazel_bin():
    dirs = _extensions.candidate_dirs("moe")
    root = os.path.normpath(os.path.join(os.path.dirname(_extensions.__file__), "..", ".."))
    assert dirs[0] == _extensions.wheel_dir()
    assert os.path.join(root, "bazel-bin", "cpp", "moe") in dirs


def test_env_var_naming_no_file_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv(ek.KERNEL_ENV_VAR, str(tmp_path / "missing.so"))
    with pytest.raises(ek.MoEExecuTorchKernelUnavailable, match="does not name a file"):
        ek.kernel_paths()


def _pte(tmp_path, calls_op: bool):
    path = tmp_path / "model.pte"
    body = b"ET12" + b"\0" * 64 + (b"llmq::quantized_moe_ffn\0\0\0\x03\0\0\0out" if calls_op else b"aten::add\0\0\0\x03\0\0\0out") + b"\0" * 64
    path.write_bytes(body)
    return str(path)


def test_program_calls_op_reads_the_operator_table(tmp_path):
    assert ek.program_calls_op(_pte(tmp_path, True))
    assert not ek.program_calls_op(_pte(tmp_path, False))


class _Program:
    def __init__(self, error):
        self.error = error

    def load_method(self, name):
        raise RuntimeError(self.error)


def test_operator_missing_on_llmqs_op_says_what_to_load(monkeypatch, tmp_path):
    monkeypatch.setattr(ek, "_registered", lambda: False)
    path = _pte(tmp_path, True)
    for message in ("Failed to load method prefill, error: 0x:14", "Failed to load method prefill, error: 0x14"):
        with pytest.raises(ek.MoEExecuTorchKernelUnavailable, match="load_executorch_kernel") as e:
            ek.load_method(_Program(message), "prefill", path)
        assert ek.OUT_OP in str(e.value) and path in str(e.value)


def test_other_load_failures_pass_through(monkeypatch, tmp_path):
    monkeypatch.setattr(ek, "_registered", lambda: False)
    with pytest.raises(RuntimeError, match="0x:14"):  # the program does not call llmq's op: not ours to explain
        ek.load_method(_Program("Failed to load method prefill, error: 0x:14"), "prefill", _pte(tmp_path, False))
    with pytest.raises(RuntimeError, match="0x:12"):
        ek.load_method(_Program("Failed to load method prefill, error: 0x:12"), "prefill", _pte(tmp_path, True))
