"""The one way every llmq writer (the bundle, the HF export, the MLX folder, the .pte file) puts an
output in place: a locked work folder, a journal, fsync, one atomic rename (docs/checkpoint.md,
"Writing").

* **Work folder.** Everything a run writes goes into ``<out>.partial/`` (a file output: the file
  ``<out>.partial/<name>``). Nothing is ever written at ``<out>`` but by the final rename.
* **Lock.** The run holds an exclusive ``flock`` on the work folder from start to end; a second
  run into the same ``<out>`` is refused at once, touching nothing: ``<out>: another llmq run is
  writing there (pid N)`` (``OutputBusyError``). A lock dies with its process.
* **Journal.** ``journal.json`` in the work folder names the writer (``"writer"``), the holder's
  pid and whatever the writer needs to resume. A work folder with files in it but no llmq journal
  is somebody else's: refused in one line, never deleted. One left by another kind of writer is
  llmq's: ``start`` says so and the writer starts over.
* **Publish.** The payload files and the folder are fsynced; the journal is moved out of the
  folder to ``<out>.partial.journal``; the folder (or file) is renamed to ``<out>``; the parent is
  fsynced; the moved journal is deleted. So a published output never holds the journal, and
  nothing after the rename fails the run (a step that fails there is a warning). A kill
  before the rename leaves a work folder the next run resumes (the moved journal is moved back);
  a kill after it leaves a complete output and at most the small ``<out>.partial.journal``, which
  the next run into that ``<out>`` deletes. An ``<out>`` that did not exist when the run started
  is never deleted or replaced (``overwrite`` replaces only the one that was there at start).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import warnings
from typing import Any, BinaryIO, Callable, Dict, Iterable, Optional, Tuple

from llmq.checkpoint.errors import CheckpointError, OutputBusyError
from llmq.checkpoint.fileio import fsync_path, write_error, write_file_atomic

PARTIAL_SUFFIX = ".partial"
JOURNAL = "journal.json"
MOVED_JOURNAL_SUFFIX = ".partial.journal"  # <out>.partial.journal: the journal while publishing
REPLACED_SUFFIX = ".llmq-replaced"  # overwrite=True moves the old output here, then deletes it


def checked(fn: Callable[..., Any], path: str, *args: Any, what: str, **kwargs: Any) -> Any:
    """fn(path, *args, **kwargs); an OSError becomes one OutputWriteError line naming ``path``."""
    try:
        return fn(path, *args, **kwargs)
    except OSError as e:
        raise write_error(e, path, what) from None


def fsync_checked(path: str) -> None:
    checked(fsync_path, path, what="fsync")


def _identity(path: str) -> Optional[Tuple[int, int]]:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _read_json(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def _is_journal(data: Any) -> bool:
    """An llmq journal: a dict naming its writer (bundle journals from before "writer" existed
    carry "settings" and "shards")."""
    return isinstance(data, dict) and (isinstance(data.get("writer"), str)
                                       or (isinstance(data.get("shards"), list) and "settings" in data))


class WorkFolder:
    """``<out>.partial``, locked by this run until ``publish`` or ``release``.

    ``journal``: what an interrupted run of the same writer left (a dict), else None.
    ``file_name``: for a single-file output, the payload's name inside the folder (publish renames
    that file to ``<out>``); None for a folder output (the folder itself is renamed).
    """

    def __init__(self, out: os.PathLike, *, writer: str, overwrite: bool, fsync: bool = True,
                 file_name: Optional[str] = None):
        self.out = os.path.abspath(os.fspath(out))
        self.path = self.out + PARTIAL_SUFFIX
        self.writer = writer
        self.overwrite = overwrite
        self.fsync = fsync
        self.file_name = file_name
        self.journal: Optional[Dict[str, Any]] = None
        self.other_writer: Optional[str] = None  # an interrupted run of another writer left the folder
        self._lock_fd: Optional[int] = None
        checked(os.makedirs, os.path.dirname(self.out) or ".", exist_ok=True, what="creating the folder")
        if os.path.lexists(self.out) and not overwrite:
            self._tidy_after_publish()
        self._refuse_existing()
        self._lock_fd = self._lock()
        try:
            self._refuse_existing()  # published while we waited for the lock
            self._out_at_start = _identity(self.out)
            self._recover_journal()
        except BaseException:
            self.release()
            raise

    # -- start -----------------------------------------------------------------------------------------
    def _refuse_existing(self) -> None:
        if os.path.lexists(self.out) and not self.overwrite:
            raise CheckpointError("output already exists; pass overwrite=True to replace it", path=self.out)

    def _tidy_after_publish(self) -> None:
        """A run killed right after publishing ``<out>`` may have left its moved journal (and, for
        a file output, the empty work folder): removed here, under the lock, when nothing else is
        in the work folder."""
        moved = self.out + MOVED_JOURNAL_SUFFIX
        if not _is_journal(_read_json(moved)):
            return
        try:
            fd = self._lock()
        except CheckpointError:
            return  # another run holds it: its business
        try:
            if not os.listdir(self.path):
                os.rmdir(self.path)
                os.unlink(moved)
        except OSError:
            pass  # best effort: the refusal that follows is the message
        finally:
            os.close(fd)

    def _lock(self) -> int:
        checked(os.makedirs, self.path, exist_ok=True, what="creating the folder")
        fd = checked(os.open, self.path, os.O_RDONLY | os.O_DIRECTORY, what="opening the folder")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            same = os.path.isdir(self.path) and os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise write_error(e, self.path, "locking") from None
            same = False
        if not same:  # held by another run, or that run published it while we looked
            os.close(fd)
            raise OutputBusyError(f"another llmq run is writing there ({self._holder()})", path=self.out)
        return fd

    def _holder(self) -> str:
        for path in (os.path.join(self.path, JOURNAL), self.out + MOVED_JOURNAL_SUFFIX):
            data = _read_json(path)
            pid = data.get("pid") if isinstance(data, dict) else None
            if isinstance(pid, int):
                return f"pid {pid}"
        return "pid not recorded yet"

    def _recover_journal(self) -> None:
        """Find the journal an interrupted run left (in the folder, or moved out by a publish that
        was killed); refuse a folder with files but no llmq journal."""
        inside = os.path.join(self.path, JOURNAL)
        moved = self.out + MOVED_JOURNAL_SUFFIX
        names = [n for n in os.listdir(self.path) if n != JOURNAL + ".tmp"]
        if _is_journal(_read_json(moved)):
            if names and JOURNAL not in names:  # killed between moving the journal and the rename
                checked(os.rename, moved, inside, what="restoring the journal")
            else:  # the rename happened: the output is complete, this is a leftover
                checked(os.unlink, moved, what="removing a finished run's journal")
            names = [n for n in os.listdir(self.path) if n != JOURNAL + ".tmp"]
        journal = _read_json(inside) if JOURNAL in names else None
        if not _is_journal(journal):
            if names:
                raise CheckpointError(
                    f"exists without an llmq journal (holds {sorted(names)[0]!r}{' ...' if len(names) > 1 else ''}), "
                    "so it is not an interrupted llmq run; move it away or delete it", path=self.path)
            return
        assert journal is not None  # _is_journal(None) is False
        kind = journal.get("writer", "bundle")
        if kind == self.writer:
            self.journal = journal
        else:
            self.other_writer = kind

    # -- while writing ---------------------------------------------------------------------------------
    def write_journal(self, data: Dict[str, Any]) -> None:
        """Record ``data`` (with the writer's name and this run's pid) atomically."""
        body = dict(data, writer=self.writer, pid=os.getpid())
        write_file_atomic(os.path.join(self.path, JOURNAL),
                          json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), fsync=self.fsync)

    def clear(self, keep: Iterable[str] = ()) -> None:
        """Delete everything in the (locked, llmq-owned) work folder but ``keep`` and the journal."""
        keep = set(keep) | {JOURNAL}
        for name in os.listdir(self.path):
            if name not in keep:
                full = os.path.join(self.path, name)
                checked(shutil.rmtree if os.path.isdir(full) and not os.path.islink(full) else os.unlink, full,
                        what="removing")

    def payload(self) -> str:
        """Where the output is built: the folder itself, or the file inside it."""
        return self.path if self.file_name is None else os.path.join(self.path, self.file_name)

    # -- end -------------------------------------------------------------------------------------------
    def publish(self, synced: Iterable[str] = ()) -> str:
        """fsync the payload (every file in the folder but those in ``synced``, already fsynced by
        the writer) and the folder, then rename it into place (see the module docstring)."""
        if self._lock_fd is None:
            raise CheckpointError("this output was already published or released", path=self.out)
        inside = os.path.join(self.path, JOURNAL)
        moved = self.out + MOVED_JOURNAL_SUFFIX
        parent = os.path.dirname(self.out)
        if self.fsync:
            done = set(synced) | {JOURNAL}
            for name in sorted(os.listdir(self.path)):
                full = os.path.join(self.path, name)
                if name not in done and os.path.isfile(full):
                    fsync_checked(full)
        journal = os.path.exists(inside)
        if journal:
            checked(os.rename, inside, moved, what="moving the journal out")
        if self.fsync:
            fsync_checked(self.path)
            fsync_checked(parent)
        old = self.out + REPLACED_SUFFIX  # only ever made here: a leftover is an interrupted swap's
        now = _identity(self.out)
        if now is not None:
            if not self.overwrite or now != self._out_at_start:
                if journal:
                    checked(os.rename, moved, inside, what="restoring the journal")
                raise CheckpointError(
                    "appeared while this run was writing; it is left alone and the finished output stays in "
                    f"{self.path} (rerun to publish it)", path=self.out)
            if os.path.lexists(old):
                checked(shutil.rmtree, old, what="removing")
            checked(os.rename, self.out, old, what="moving the old output aside")
        try:
            checked(os.rename, self.payload(), self.out, what="renaming into place")
        except BaseException:
            if now is not None:  # the old output goes back where it was
                os.rename(old, self.out)
            raise
        self.release()
        # The output is in place and complete: nothing after this fails the run (a failure would
        # report an error next to a finished output); what it could not tidy, the next run does.
        steps = [(fsync_path, parent, "fsync")] if self.fsync else []
        if self.file_name is not None:  # the folder held the file: only a moved journal is left
            steps.append((os.rmdir, self.path, "removing the work folder"))
        if journal:
            steps.append((os.unlink, moved, "removing the journal"))
        if os.path.lexists(old):
            steps.append((shutil.rmtree if os.path.isdir(old) and not os.path.islink(old) else os.unlink, old,
                          "removing the replaced output"))
        for fn, path, what in steps:
            try:
                fn(path)
            except FileNotFoundError:
                pass  # a run that found <out> tidied it
            except OSError as e:
                warnings.warn(str(write_error(e, path, what)) + " (the output is complete)", stacklevel=2)
        return self.out

    def release(self) -> None:
        """Let go of the lock (the folder stays for a resume)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def discard(self) -> None:
        """Delete the work folder (a failed run that does not resume), then let go of the lock."""
        try:
            if self._lock_fd is not None and os.path.isdir(self.path):
                shutil.rmtree(self.path, ignore_errors=True)
                moved = self.out + MOVED_JOURNAL_SUFFIX
                if os.path.lexists(moved):
                    os.unlink(moved)
        finally:
            self.release()


def publish_file(out: os.PathLike, fill: Callable[[BinaryIO], None], *, writer: str, overwrite: bool,
                 fsync: bool = True) -> str:
    """Write a single-file output atomically: ``fill(f)`` writes it into ``<out>.partial/<name>``
    (locked, journalled), which is fsynced and renamed to ``<out>``. A failed or killed run
    leaves no file at ``<out>`` (nor a partial one); the next run clears its work folder."""
    work = WorkFolder(out, writer=writer, overwrite=overwrite, fsync=fsync,
                      file_name=os.path.basename(os.path.abspath(os.fspath(out))))
    try:
        work.clear()
        work.write_journal({})
        path = work.payload()
        try:
            with open(path, "wb") as f:
                fill(f)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
        except OSError as e:
            raise write_error(e, path, "writing") from None
        return work.publish(synced=[os.path.basename(path)])
    except BaseException:
        work.discard()
        raise
