"""The bundle writer under hostile conditions: short writes, a full disk, crashes inside close(),
foreign .partial folders, concurrent runs, extra files."""

import errno
import hashlib
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from llmq.checkpoint import (
    BundleWriter,
    CheckpointError,
    OutputWriteError,
    bundle as bundle_module,
    load_bundle,
    read_manifest,
    save_bundle,
    workfolder,
)
from llmq.quant.formats import GroupQuantizedWeight, pack_bits

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_ROOT = os.path.dirname(os.path.dirname(HERE))
SHARD = 3000


def gqw(seed, n=8, k=64, bits=4, gs=32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2 ** bits, (n, k), generator=g)
    return GroupQuantizedWeight(qdata=pack_bits(q, bits), scale=torch.rand(n, k // gs, generator=g),
                                bias=-torch.rand(n, k // gs, generator=g), bits=bits, group_size=gs, shape=(n, k))


def stream(n_layers=6):
    g = torch.Generator().manual_seed(1)
    yield "model.embed_tokens.weight", torch.randn(32, 64, generator=g).to(torch.bfloat16)
    for i in range(n_layers):
        yield f"model.layers.{i}.mlp.up_proj.weight", gqw(10 + i)
        yield f"model.layers.{i}.norm.weight", torch.ones(64) * i
    yield "lm_head.weight", gqw(99, bits=8, gs=16)


def lazy(computed):
    """stream() with every value a callable that records its name when the writer computes it."""
    for name, value in stream():
        yield name, (lambda v=value, n=name: computed.append(n) or v)


def folder_digest(path):
    return {name: hashlib.sha256(open(os.path.join(path, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(path))}


def settled_digest(path, timeout=60.0):
    """folder_digest of a folder another process's writer thread may still be finishing (it
    renames shard files when they complete): two equal readings 0.2 s apart."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            now = folder_digest(path)
        except FileNotFoundError:  # a shard renamed between listing and reading
            now = None
        if now is not None and now == last:
            return now
        last = now
        time.sleep(0.2)
    raise AssertionError(f"{path} kept changing for {timeout} s")


@pytest.fixture
def reference(tmp_path):
    return folder_digest(save_bundle(stream(), tmp_path / "ref", max_shard_bytes=SHARD, fsync=False))


# -- 1. every write completed or failed with one line ----------------------------------------------------

def test_short_writes_are_completed(tmp_path, monkeypatch, reference):
    """The kernel may write fewer bytes than asked (a nearly full disk does): every write loops."""
    real_pwrite, real_write = os.pwrite, os.write
    calls = []

    def short_pwrite(fd, data, offset):
        calls.append(len(data))
        return real_pwrite(fd, bytes(memoryview(data)[:97]), offset)

    def short_write(fd, data):
        return real_write(fd, bytes(memoryview(data)[:97]))

    monkeypatch.setattr(os, "pwrite", short_pwrite)
    monkeypatch.setattr(os, "write", short_write)
    out = save_bundle(stream(), tmp_path / "out", max_shard_bytes=SHARD, fsync=True)
    monkeypatch.undo()
    assert max(calls) > 97  # writes were really cut short
    assert folder_digest(out) == reference
    load_bundle(out, verify=True)


class DiskFull:
    """os.pwrite/os.write that accept `budget` bytes in all, then behave like a full disk: a short
    write first (what Linux does when part of the buffer fits), ENOSPC afterwards."""

    def __init__(self, budget):
        self.left = budget
        self.real_pwrite, self.real_write = os.pwrite, os.write

    def _take(self, data):
        data = memoryview(data).cast("B")
        if self.left <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = min(len(data), self.left)
        self.left -= n
        return bytes(data[:n])

    def pwrite(self, fd, data, offset):
        return self.real_pwrite(fd, self._take(data), offset)

    def write(self, fd, data):
        return self.real_write(fd, self._take(data))


def bytes_written(tmp_path, monkeypatch):
    disk = DiskFull(1 << 40)
    monkeypatch.setattr(os, "pwrite", disk.pwrite)
    monkeypatch.setattr(os, "write", disk.write)
    save_bundle(stream(), tmp_path / "measure", max_shard_bytes=SHARD, fsync=True)
    monkeypatch.undo()
    return (1 << 40) - disk.left


@pytest.mark.parametrize("budget", [0, 600, 2500, 4096 + 1800, 9000, -1000])
def test_a_full_disk_fails_with_one_line_and_leaves_a_resumable_partial(tmp_path, monkeypatch, reference, budget):
    """Budgets land in journal writes, tensor data, shard headers (the 4 KiB gap) and (-1000: all
    but the last 1000 bytes of the run) the manifest, written last."""
    if budget < 0:
        budget += bytes_written(tmp_path, monkeypatch)
    disk = DiskFull(budget)
    monkeypatch.setattr(os, "pwrite", disk.pwrite)
    monkeypatch.setattr(os, "write", disk.write)
    out = tmp_path / "out"
    with pytest.raises(OutputWriteError) as info:
        save_bundle(stream(), out, max_shard_bytes=SHARD, fsync=True)
    monkeypatch.undo()
    message = str(info.value)
    assert message == f"{info.value.path}: No space left on device" and "\n" not in message
    assert info.value.path.startswith(str(out) + ".partial" + os.sep)
    assert not out.exists()  # nothing published
    partial = out.parent / "out.partial"
    left = set(os.listdir(partial))
    assert "llmq_manifest.json" not in left
    assert not [n for n in left if n.endswith(".tmp")]  # no torn file kept
    assert budget < 600 or "journal.json" in left
    computed = []
    save_bundle(lazy(computed), out, max_shard_bytes=SHARD, fsync=False)  # the same run, with room
    assert folder_digest(out) == reference
    if budget > 20000:  # every shard was finished and journalled before the manifest failed
        assert computed == []


# -- 2. a .partial folder llmq did not make is never deleted ---------------------------------------------

@pytest.mark.parametrize("resume", [True, False])
@pytest.mark.parametrize("journal", [None, b"not json", b'{"some": "other tool"}'])
def test_a_partial_folder_without_an_llmq_journal_is_refused_untouched(tmp_path, resume, journal):
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / "notes.txt").write_text("mine")
    if journal is not None:
        (partial / "journal.json").write_bytes(journal)
    before = folder_digest(partial)
    with pytest.raises(CheckpointError) as info:
        save_bundle(stream(), tmp_path / "out", max_shard_bytes=SHARD, resume=resume, fsync=False)
    message = str(info.value)
    assert message.startswith(f"{partial}: exists without an llmq journal") and "\n" not in message
    assert folder_digest(partial) == before and not (tmp_path / "out").exists()


def test_an_empty_partial_folder_is_used(tmp_path, reference):
    (tmp_path / "out.partial").mkdir()  # what a run killed before its first journal write leaves
    assert folder_digest(save_bundle(stream(), tmp_path / "out", max_shard_bytes=SHARD, fsync=False)) == reference


# -- 3. a kill at any step of close() loses no finished shard --------------------------------------------

class Crash(BaseException):
    """Stands for SIGKILL: nothing after it runs (close() has no handler for it after the drain)."""


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_crash_at_each_step_of_close_keeps_every_finished_shard(tmp_path, monkeypatch, reference, overwrite):
    import shutil
    import threading

    main = threading.current_thread()
    steps = {"os.rename": (os, "rename"), "os.unlink": (os, "unlink"), "os.replace": (os, "replace"),
             "shutil.rmtree": (shutil, "rmtree"), "fsync": (workfolder, "fsync_checked"),
             "_write_atomic": (bundle_module, "_write_atomic")}
    seen_steps = []
    for k in range(100):
        out = tmp_path / f"out{k}"
        if overwrite:
            save_bundle([("old", torch.ones(3))], out, fsync=False)
        writer = BundleWriter(out, max_shard_bytes=SHARD, fsync=True, overwrite=overwrite)
        for name, value in stream():
            writer.add(name, value)
        calls = []

        def wrap(label, real, calls=calls, k=k):
            def step(*args, **kwargs):
                if threading.current_thread() is main:
                    calls.append(label)
                    if len(calls) == k + 1:
                        raise Crash(label)
                return real(*args, **kwargs)
            return step

        for label, (owner, attr) in steps.items():
            monkeypatch.setattr(owner, attr, wrap(label, getattr(owner, attr)))
        try:
            writer.close()
            crashed = False
        except Crash:
            crashed = True
        finally:
            monkeypatch.undo()
            getattr(writer, "_unlock", lambda: None)()  # the killed process's lock dies with it
        if not crashed:
            break
        seen_steps.append(calls[-1])
        if not (tmp_path / f"out{k}.partial").exists():  # crashed after the rename: the bundle is complete
            assert folder_digest(out) == reference, (k, calls)  # the journal never reaches the output
            load_bundle(out, verify=True)
            continue
        computed = []
        save_bundle(lazy(computed), out, max_shard_bytes=SHARD, fsync=False, overwrite=overwrite)
        assert computed == [], f"crash at step {k} ({calls[-1]}) lost finished shards"
        assert folder_digest(out) == reference
        assert not (tmp_path / f"out{k}.llmq-replaced").exists()
    else:
        raise AssertionError("close() never completed")
    assert {"_write_atomic", "os.rename", "os.unlink", "fsync"} <= set(seen_steps), seen_steps


# -- 4. two runs into the same output ----------------------------------------------------------------------

def test_a_second_run_into_the_same_output_is_refused_without_touching_anything(tmp_path, reference):
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {PYTHON_ROOT!r}); sys.path.insert(0, {HERE!r})
        from bundle_safety_test import SHARD, stream
        from llmq.checkpoint import BundleWriter
        writer = BundleWriter({str(out)!r}, max_shard_bytes=SHARD, fsync=False)
        for name, value in stream():
            writer.add(name, value)
        print("holding", flush=True)
        sys.stdin.readline()
        writer.close()
    """)
    first = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert first.stdout.readline() == b"holding\n"
        partial = tmp_path / "out.partial"
        before = settled_digest(partial)
        for resume in (True, False):
            with pytest.raises(CheckpointError) as info:
                save_bundle(stream(), out, max_shard_bytes=SHARD, resume=resume, fsync=False)
            assert str(info.value) == f"{out}: another llmq run is writing there (pid {first.pid})"
        assert folder_digest(partial) == before
        first.stdin.write(b"\n")
        first.stdin.close()
        assert first.wait(timeout=120) == 0
    finally:
        first.kill()
    assert folder_digest(out) == reference and not (tmp_path / "out.partial").exists()
    with pytest.raises(CheckpointError, match="already exists"):
        save_bundle(stream(), out, max_shard_bytes=SHARD, fsync=False)


# -- 7. config and tokenizer files travel with the bundle ------------------------------------------------

def test_source_files_are_copied_and_recorded_with_their_hashes(tmp_path):
    from llmq.checkpoint import SOURCE_FILES, ChecksumError, source_files
    from llmq.checkpoint.bundle import file_digest

    src = tmp_path / "hf"
    src.mkdir()
    contents = {"config.json": b'{"model_type": "x"}', "tokenizer.json": b'{"v": 1}',
                "tokenizer.model": bytes(range(256)) * 5, "notes.md": b"not a source file"}
    for name, data in contents.items():
        (src / name).write_bytes(data)
    os.chmod(src / "tokenizer.json", 0o600)
    found = source_files(src)
    assert [os.path.basename(p) for p in found] == [n for n in SOURCE_FILES if n in contents]
    out = save_bundle(stream(), tmp_path / "out", max_shard_bytes=SHARD, fsync=False, extra_files=found)
    files = read_manifest(out)["files"]
    assert [f["file"] for f in files] == ["config.json", "tokenizer.json", "tokenizer.model"]
    for record in files:
        copy = os.path.join(out, record["file"])
        assert open(copy, "rb").read() == contents[record["file"]]
        assert record["bytes"] == len(contents[record["file"]]) and record["blake3"] == file_digest(copy)
        assert os.stat(copy).st_mode & 0o777 == 0o666 & ~_umask()
    assert not os.path.exists(os.path.join(out, "notes.md"))
    load_bundle(out, verify=True)
    with open(os.path.join(out, "tokenizer.json"), "r+b") as f:
        f.write(b"[")
    with pytest.raises(ChecksumError, match="tokenizer.json: blake3 checksum"):
        load_bundle(out, verify=True)


def test_extra_files_that_would_shadow_the_bundle_are_refused(tmp_path):
    for name in ("llmq_manifest.json", "model.safetensors.index.json", "model-00001.safetensors"):
        bad = tmp_path / name
        bad.write_text("{}")
        with pytest.raises(CheckpointError, match=f"{name}: extra file name"):
            save_bundle(stream(), tmp_path / "out", fsync=False, extra_files=[bad])
    with pytest.raises(CheckpointError, match="missing.json: extra file does not exist"):
        save_bundle(stream(), tmp_path / "out", fsync=False, extra_files=[tmp_path / "missing.json"])
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


# -- 8. a kill or a failure at every file-system step --------------------------------------------------------

def test_a_kill_or_failure_at_every_step_resumes_byte_identically_and_leaves_nothing(tmp_path):
    """Every os.write/pwrite/fsync/fdatasync/replace/rename/unlink/rmdir of a run (llmq.checkpoint.
    crash_points): killed there (a forked child, os._exit), the rerun gives the uninterrupted
    bundle or, killed after publishing, refuses in one line; failed there, the run raises one line
    and publishes nothing. Nothing is left next to the output either way."""
    from llmq.checkpoint.crash_points import check_every_crash_point

    def write(out):
        save_bundle(stream(n_layers=3), out, max_shard_bytes=SHARD, fsync=True,
                    extra_files=[tmp_path / "config.json"])

    (tmp_path / "config.json").write_text('{"model_type": "x"}')
    seen = check_every_crash_point(write, str(tmp_path / "runs"),
                                   accept_refusal=lambda e: "output already exists" in str(e))
    assert any(s.endswith(": resumed") for s in seen) and any("refused" in s for s in seen), seen
    assert any(s.startswith("fail") for s in seen)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_every_file_of_the_bundle_follows_the_umask(tmp_path, mask):
    (tmp_path / "config.json").write_text("{}")
    old = os.umask(mask)
    try:
        out = save_bundle(stream(), tmp_path / "out", max_shard_bytes=SHARD, fsync=False,
                          extra_files=[tmp_path / "config.json"])
    finally:
        os.umask(old)
    modes = {name: os.stat(os.path.join(out, name)).st_mode & 0o777 for name in os.listdir(out)}
    assert sum(name.endswith(".safetensors") for name in modes) > 1
    assert modes == {name: 0o666 & ~mask for name in modes}, modes
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~mask
