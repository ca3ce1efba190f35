"""Checked output I/O shared by llmq's writers (bundle, HF export, MLX).

Every write is completed or fails: ``os.write``/``os.pwrite`` may write fewer bytes than
asked (a nearly full disk does exactly that before it fails with ENOSPC), so the helpers
loop until everything is written and turn any ``OSError`` into one ``OutputWriteError``
naming the file. A full disk (ENOSPC, EDQUOT) reads ``<path>: No space left on device``.
Files are created with mode 0666 & ~umask, as ``open()`` does.
"""

from __future__ import annotations

import errno
import os
import re
from typing import Dict, Mapping, Optional

import torch

from llmq.checkpoint.errors import OutputWriteError

_MAX_WRITE = 1 << 30  # Linux writes at most 0x7ffff000 bytes per call; longer writes loop
_COPY_CHUNK = 16 * 1024 * 1024
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def write_error(e: OSError, path: str, what: str, tensor: Optional[str] = None) -> OutputWriteError:
    """One line naming the file: ``<path>: No space left on device`` for a full disk,
    ``<path>: <what> failed: <reason>`` otherwise."""
    if getattr(e, "errno", None) in DISK_FULL:
        err = OutputWriteError(os.strerror(errno.ENOSPC), path=path)
        err.tensor = tensor  # kept for callers; the line stays "<path>: No space left on device"
        return err
    return OutputWriteError(f"{what} failed: {e.strerror or e}", path=path, tensor=tensor)


def write_all(fd: int, data, offset: Optional[int] = None) -> None:
    """Write every byte of ``data`` (at ``offset`` with pwrite, else at the file position).

    Loops on short writes; a write that accepts no bytes is a full disk (ENOSPC). Raises
    ``OSError``; callers name the file (``write_error``)."""
    mv = memoryview(data).cast("B")
    done = 0
    while done < len(mv):
        chunk = mv[done:done + _MAX_WRITE]
        n = os.write(fd, chunk) if offset is None else os.pwrite(fd, chunk, offset + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n


def umask_mode(mode: int = 0o666) -> int:
    """``mode`` less the process umask (what ``open()`` gives a new file)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def fsync_path(path: str) -> None:
    """fsync a file or a folder by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: str, data: bytes, *, fsync: bool) -> None:
    """``path`` holds ``data`` completely or keeps its old content: written to ``path.tmp``,
    (fsynced,) then renamed over it. Raises OutputWriteError naming ``path``."""
    tmp = path + ".tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            write_all(fd, data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        _unlink_quietly(tmp)
        raise write_error(e, path, "writing") from None


def copy_file(src: str, dst: str, *, fsync: bool) -> None:
    """Copy ``src``'s bytes (following symlinks) to a new ``dst`` with checked writes."""
    try:
        fin = open(src, "rb", buffering=0)
    except OSError as e:
        raise OutputWriteError(f"cannot read: {e.strerror or e}", path=src) from None
    with fin:
        try:
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        except OSError as e:
            raise write_error(e, dst, "creating") from None
        try:
            buf = bytearray(_COPY_CHUNK)
            view = memoryview(buf)
            while True:
                try:
                    n = fin.readinto(buf)
                except OSError as e:
                    raise OutputWriteError(f"cannot read: {e.strerror or e}", path=src) from None
                if not n:
                    break
                write_all(fd, view[:n])
            if fsync:
                os.fsync(fd)
        except OSError as e:
            _unlink_quietly(dst)
            raise write_error(e, dst, "writing") from None
        finally:
            os.close(fd)


def publish_mode(path: str) -> None:
    """Give a file written through a private temporary file (safetensors' save_file makes 0600
    files) the permissions ``open()`` would have: 0666 & ~umask."""
    try:
        os.chmod(path, umask_mode())
    except OSError as e:
        raise write_error(e, path, "setting permissions") from None


def save_safetensors(path: str, tensors: Mapping[str, torch.Tensor], metadata: Optional[Dict[str, str]]) -> None:
    """safetensors' ``save_file`` (the reference byte layout), with its I/O errors as one
    OutputWriteError line naming ``path`` and the file given the umask's permissions."""
    from safetensors.torch import save_file

    try:
        save_file(dict(tensors), path, metadata=metadata)
    except OSError as e:
        raise write_error(e, path, "writing") from None
    except Exception as e:  # SafetensorError("... I/O error: No space left on device (os error 28)")
        if type(e).__name__ != "SafetensorError":
            raise
        code = re.search(r"os error (\d+)", str(e))
        if code:
            raise write_error(OSError(int(code.group(1)), os.strerror(int(code.group(1)))), path, "writing") from None
        raise OutputWriteError(f"writing failed: {e}", path=path) from None
    publish_mode(path)


def remove_partial(fd: Optional[int], path: str) -> None:
    """Drop an unfinished output file: close `fd` (where open) and delete `path` (where it is)."""
    if fd is not None:
        os.close(fd)
    if os.path.exists(path):
        os.unlink(path)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
