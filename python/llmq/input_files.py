"""Small text inputs (a recipe file, a calibration text): regular files only, read only as far as needed.

A FIFO, a character device (``/dev/zero``), a socket or a folder is refused in one line before
anything is read (opening a FIFO for reading would block until a writer appears, so the file is
opened non-blocking and checked with ``fstat`` before the first read). Reads are bounded: a recipe
is read whole up to a size limit, a calibration text incrementally, as far as the caller asks.
Errors are ``InputFileError`` (a ValueError): one line naming what the file is for and its path.
"""

from __future__ import annotations

import codecs
import os
import stat
from typing import Iterator

CHUNK_BYTES = 1 << 16


class InputFileError(ValueError):
    """An input file that is missing, not a regular file, too large or not UTF-8 text."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str, what: str) -> int:
    """A read-only descriptor of `path`, refused (InputFileError) unless it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise InputFileError(f"{what} {path}: {e.strerror or e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InputFileError(f"{what} {path}: {_kind(st.st_mode)}; expected a regular file")
    os.set_blocking(fd, True)
    return fd


def read_text(path: str, what: str, *, limit: int) -> str:
    """The whole UTF-8 text of a regular file of at most `limit` bytes."""
    fd = open_regular(path, what)
    try:
        data = b""
        while len(data) <= limit:
            chunk = os.read(fd, min(CHUNK_BYTES, limit + 1 - len(data)))
            if not chunk:
                break
            data += chunk
    except OSError as e:
        raise InputFileError(f"{what} {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise InputFileError(f"{what} {path}: larger than {limit:,} bytes; expected a small text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(f"{what} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def iter_text(path: str, what: str, *, chunk_bytes: int = CHUNK_BYTES) -> Iterator[str]:
    """The UTF-8 text of a regular file in pieces of about `chunk_bytes` bytes, decoded
    incrementally: a caller that stops early has read only that far."""
    fd = open_regular(path, what)
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    try:
        while True:
            try:
                chunk = os.read(fd, chunk_bytes)
            except OSError as e:
                raise InputFileError(f"{what} {path}: {e.strerror or e}") from None
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                raise InputFileError(f"{what} {path}: not UTF-8 text ({e.reason} at byte {offset + e.start})") from None
            offset += len(chunk)
            if text:
                yield text
            if not chunk:
                return
    finally:
        os.close(fd)
