"""Parse and validate a GGUF file's header (metadata and tensor table), lazily, once per process.

Layout (GGUF versions 2 and 3, little-endian; ggml's ``docs/gguf.md``)::

    "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x     key: string | value_type u32 | value
    tensor_count x name: string | n_dims u32 | dims u64 x n_dims | ggml_type u32 | offset u64
    zero padding to general.alignment (default 32) | tensor data (offsets are relative to here)

    string = length u64 + that many UTF-8 bytes
    array  = element_type u32 + count u64 + count elements (strings or scalars)

Every count and length is compared with the bytes left in the file *before* it is used,
so a corrupted count (a metadata array of 2^35 elements in a 1.6 KB file) fails at once
with a ``CorruptCheckpointError`` naming the file and the field, instead of looping or
allocating. The header is read through one read-only ``mmap`` that is closed again
before this module returns.

Large metadata arrays (more than ``EAGER_ARRAY_LIMIT`` elements, e.g. a 262,144-entry
``tokenizer.ggml.tokens``) are not decoded: the parser only walks their string lengths
and keeps a ``GGUFArray`` that reads and decodes them on first use. Smaller arrays
become Python lists, scalars Python ints/floats/bools/strs.

Parsing is bounded whatever the file holds: at most ``MAX_METADATA_ENTRIES`` metadata
entries and ``MAX_TENSORS`` tensors (more is refused in one line), and at most
``EAGER_TOTAL_LIMIT`` array elements decoded in all (later arrays stay on disk), so a
metadata-heavy file costs a bounded amount of memory and time, not a multiple of its size.

``parse_header_cached`` keeps the last few parsed headers keyed by (real path, device,
inode, size, mtime, ctime), so the pipeline's several opens of one file (config, names,
tensor stream, verification) parse it once. A file modified within ``RACY_NS`` of being
parsed is not cached (its times could miss a rewrite).
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import mmap
import os
import struct
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from llmq.checkpoint.errors import CorruptCheckpointError, UnsupportedCheckpointError
from llmq.checkpoint.shapes import dims_problem

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
EAGER_ARRAY_LIMIT = 4096  # arrays longer than this stay on disk until used
# Bounds on what parsing a header may cost, whatever the file's size (a real GGUF has under 100
# metadata entries and a few thousand tensors): entries and tensors beyond these are refused;
# once EAGER_TOTAL_LIMIT array elements were decoded, further arrays stay on disk too.
MAX_METADATA_ENTRIES = 1 << 16
MAX_TENSORS = 1 << 16
EAGER_TOTAL_LIMIT = 1 << 16
CACHE_ENTRIES = 4
# A file modified less than this long before it was parsed is not cached: file times are
# coarse (a few ms), so a same-size rewrite within one tick would otherwise look unchanged
# (git's "racy" index entries, same remedy).
RACY_NS = 2_000_000_000

# GGUF metadata value types (gguf.GGUFValueType): id -> (name, numpy dtype or None)
_STRING, _ARRAY = 8, 9
_SCALARS: Dict[int, Tuple[str, str]] = {
    0: ("UINT8", "<u1"), 1: ("INT8", "<i1"), 2: ("UINT16", "<u2"), 3: ("INT16", "<i2"),
    4: ("UINT32", "<u4"), 5: ("INT32", "<i4"), 6: ("FLOAT32", "<f4"), 7: ("BOOL", "<u1"),
    10: ("UINT64", "<u8"), 11: ("INT64", "<i8"), 12: ("FLOAT64", "<f8"),
}
_BOOL = 7


def _type_name(value_type: int) -> str:
    if value_type == _STRING:
        return "STRING"
    if value_type == _ARRAY:
        return "ARRAY"
    return _SCALARS[value_type][0] if value_type in _SCALARS else f"type {value_type}"


@dataclasses.dataclass(frozen=True)
class FileIdentity:
    """What must not change between parsing a header and reading from the file."""

    path: str  # os.path.realpath
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @staticmethod
    def of(path: str, st: Optional[os.stat_result] = None) -> "FileIdentity":
        st = st or os.stat(path)
        return FileIdentity(os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def matches(self, st: os.stat_result) -> bool:
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) == (
            self.device, self.inode, self.size, self.mtime_ns, self.ctime_ns)


@dataclasses.dataclass(frozen=True)
class RawTensorInfo:
    """One tensor-info record as stored: dims innermost first (GGUF's ne order), offset absolute."""

    name: str
    ggml_type: int
    dims: Tuple[int, ...]
    start: int


@dataclasses.dataclass(frozen=True)
class GGUFHeader:
    path: str
    identity: FileIdentity
    version: int
    metadata: Dict[str, Any]  # key -> Python value or GGUFArray, in file order
    tensors: Tuple[RawTensorInfo, ...]  # in header order
    alignment: int
    data_start: int


class GGUFArray(collections.abc.Sequence):
    """A large metadata array left on disk: ``len()`` is free; indexing, iteration, ``list()``
    and ``tolist()`` read and decode it once (then keep the list)."""

    def __init__(self, identity: FileIdentity, key: str, element_type: int, count: int, start: int, end: int):
        self._identity, self.key = identity, key
        self.element_type, self._count, self._start, self._end = element_type, count, start, end
        self._values: Optional[List[Any]] = None
        self._lock = threading.Lock()

    @property
    def element_type_name(self) -> str:
        return _type_name(self.element_type)

    @property
    def loaded(self) -> bool:
        return self._values is not None

    def __len__(self) -> int:
        return self._count

    def tolist(self) -> List[Any]:
        with self._lock:
            if self._values is None:
                self._values = self._load()
            return self._values

    def __getitem__(self, index):
        return self.tolist()[index]

    def __iter__(self):
        return iter(self.tolist())

    def __eq__(self, other) -> bool:
        if isinstance(other, GGUFArray):
            other = other.tolist()
        return isinstance(other, (list, tuple)) and self.tolist() == list(other)

    __hash__ = None  # type: ignore[assignment]  # mutable-looking sequence: unhashable, like list

    def __repr__(self) -> str:
        return f"GGUFArray({self.key!r}, {self.element_type_name} x {self._count})"

    def _load(self) -> List[Any]:
        path = self._identity.path
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise CorruptCheckpointError(f"metadata {self.key!r}: cannot reopen the file ({e.strerror or e})",
                                         path=path) from None
        try:
            if not self._identity.matches(os.fstat(fd)):
                raise CorruptCheckpointError(f"metadata {self.key!r}: the file changed after its header was read",
                                             path=path)
            data = os.pread(fd, self._end - self._start, self._start)
        finally:
            os.close(fd)
        if len(data) != self._end - self._start:
            raise CorruptCheckpointError(f"metadata {self.key!r}: the file ended early (truncated?)", path=path)
        if self.element_type == _STRING:
            return _decode_strings(data, self._count, path=path, key=self.key)
        return _decode_scalars(data, 0, self.element_type, self._count)


def _decode_scalars(buf, offset: int, value_type: int, count: int) -> List[Any]:
    values = np.frombuffer(buf, dtype=_SCALARS[value_type][1], count=count, offset=offset)
    if value_type == _BOOL:
        return (values != 0).tolist()
    return values.tolist()


def _decode_strings(buf: bytes, count: int, *, path: str, key: str) -> List[str]:
    out, pos, unpack = [], 0, struct.Struct("<Q").unpack_from
    for i in range(count):
        (n,) = unpack(buf, pos)
        try:
            out.append(buf[pos + 8:pos + 8 + n].decode("utf-8"))
        except UnicodeDecodeError:
            raise CorruptCheckpointError(f"metadata {key!r}: element {i} is not valid UTF-8", path=path) from None
        pos += 8 + n
    return out


class _Cursor:
    """Reads little-endian fields from the mapped header, checking every length against the file's end."""

    _U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")

    def __init__(self, buf, path: str):
        self.buf, self.path, self.pos, self.end = buf, path, 0, len(buf)

    @property
    def left(self) -> int:
        return self.end - self.pos

    def fail(self, what: str, **kw) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{what} (corrupt or truncated GGUF header)", path=self.path, **kw)

    def need(self, nbytes: int, what: str, **kw) -> None:
        if nbytes > self.left:
            raise self.fail(f"{what} needs {nbytes} bytes at offset {self.pos}, but only {self.left} are left "
                            f"in the file", **kw)

    def u32(self, what: str, **kw) -> int:
        self.need(4, what, **kw)
        (v,) = self._U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str, **kw) -> int:
        self.need(8, what, **kw)
        (v,) = self._U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str, **kw) -> str:
        n = self.u64(f"{what} length", **kw)
        self.need(n, f"{what} ({n} bytes)", **kw)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8", **kw) from None

    def skip_strings(self, count: int, what: str) -> None:
        unpack, buf, pos, end = self._U64.unpack_from, self.buf, self.pos, self.end
        for i in range(count):
            if end - pos < 8:
                self.pos = pos
                raise self.fail(f"{what}: element {i} of {count} starts past the end of the file")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > end - pos:
                self.pos = pos
                raise self.fail(f"{what}: element {i} claims {n} bytes but only {end - pos} are left in the file")
            pos += n
        self.pos = pos


def _read_value(cur: _Cursor, value_type: int, key: str, identity: FileIdentity, eager_left: List[int]) -> Any:
    what = f"metadata {key!r}"
    if value_type == _STRING:
        return cur.string(what)
    if value_type in _SCALARS:
        size = np.dtype(_SCALARS[value_type][1]).itemsize
        cur.need(size, what)
        value = _decode_scalars(cur.buf, cur.pos, value_type, 1)[0]
        cur.pos += size
        return value
    if value_type != _ARRAY:
        raise cur.fail(f"{what} has unknown value type {value_type} (expected 0..12)")
    element_type = cur.u32(f"{what} array element type")
    count = cur.u64(f"{what} array length")
    if element_type == _ARRAY:
        raise UnsupportedCheckpointError(f"{what} is an array of arrays, which GGUF readers do not support",
                                         path=cur.path)
    if element_type != _STRING and element_type not in _SCALARS:
        raise cur.fail(f"{what} is an array of unknown value type {element_type} (expected 0..12)")
    min_size = 8 if element_type == _STRING else np.dtype(_SCALARS[element_type][1]).itemsize
    if count * min_size > cur.left:
        raise cur.fail(f"{what}: an array of {count} {_type_name(element_type)} elements needs at least "
                       f"{count * min_size} bytes, but only {cur.left} are left in the file")
    start = cur.pos
    eager = count <= min(EAGER_ARRAY_LIMIT, eager_left[0])
    if eager:
        eager_left[0] -= count
    if element_type == _STRING:
        if not eager:
            cur.skip_strings(count, what)
            return GGUFArray(identity, key, element_type, count, start, cur.pos)
        values = []
        for i in range(count):
            values.append(cur.string(f"{what} element {i}"))
        return values
    cur.pos += count * min_size
    if not eager:
        return GGUFArray(identity, key, element_type, count, start, cur.pos)
    return _decode_scalars(cur.buf, start, element_type, count)


def parse_header(path: str) -> GGUFHeader:
    """Parse and validate the header of the GGUF file at ``path`` (no tensor data is read)."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        from llmq.checkpoint.errors import CheckpointNotFoundError

        raise CheckpointNotFoundError("no such file", path=path) from None
    except OSError as e:
        raise CorruptCheckpointError(f"cannot open: {e.strerror or e}", path=path) from None
    try:
        st = os.fstat(fd)
        identity = FileIdentity.of(path, st)
        if st.st_size < 24:
            raise CorruptCheckpointError(
                f"file is {st.st_size} bytes; a GGUF header alone needs 24 (truncated?)", path=path)
        with mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ) as mapped:
            buf = memoryview(mapped)
            try:
                return _parse(buf, path, identity)
            finally:
                buf.release()
    finally:
        os.close(fd)


def _parse(buf, path: str, identity: FileIdentity) -> GGUFHeader:
    cur = _Cursor(buf, path)
    if bytes(buf[:4]) != MAGIC:
        raise CorruptCheckpointError(f"not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')", path=path)
    cur.pos = 4
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and (version >> 24) in SUPPORTED_VERSIONS:
            raise UnsupportedCheckpointError("a big-endian GGUF file; only little-endian files are supported",
                                             path=path)
        raise UnsupportedCheckpointError(f"GGUF version {version}; supported: {SUPPORTED_VERSIONS}", path=path)
    tensor_count = cur.u64("tensor count")
    kv_count = cur.u64("metadata count")
    # Smallest records: a key/value is 8 (key length) + 4 (type) + 1 (a u8 value) bytes;
    # a tensor info is 8 (name length) + 4 (n_dims) + 8 (one dim) + 4 (type) + 8 (offset).
    if kv_count * 13 + tensor_count * 32 > cur.left:
        raise cur.fail(f"header claims {kv_count} metadata entries and {tensor_count} tensors, which need at "
                       f"least {kv_count * 13 + tensor_count * 32} bytes, but the file has {cur.left} left")
    if kv_count > MAX_METADATA_ENTRIES:
        raise UnsupportedCheckpointError(f"header claims {kv_count} metadata entries; at most {MAX_METADATA_ENTRIES} "
                                         f"are read (a real GGUF has under 100)", path=path)
    if tensor_count > MAX_TENSORS:
        raise UnsupportedCheckpointError(f"header claims {tensor_count} tensors; at most {MAX_TENSORS} are read",
                                         path=path)
    metadata: Dict[str, Any] = {}
    eager_left = [EAGER_TOTAL_LIMIT]
    for i in range(kv_count):
        key = cur.string(f"metadata entry {i} key")
        if key in metadata:
            raise cur.fail(f"metadata key {key!r} appears twice")
        value_type = cur.u32(f"metadata {key!r} value type")
        if key == "general.alignment" and value_type != 4:
            raise cur.fail(f"general.alignment must be a UINT32, got a {_type_name(value_type)}")
        metadata[key] = _read_value(cur, value_type, key, identity, eager_left)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment must be a power of two, got {alignment}")
    records = []
    names = set()
    for i in range(tensor_count):
        name = cur.string(f"tensor info {i} name")
        n_dims = cur.u32("dimension count", tensor=name)
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"has {n_dims} dims; GGUF allows 1..{MAX_DIMS}", tensor=name)
        dims = tuple(cur.u64(f"dim {d}", tensor=name) for d in range(n_dims))
        problem = dims_problem(dims)
        if problem:
            raise UnsupportedCheckpointError(problem, path=path, tensor=name)
        ggml_type = cur.u32("type", tensor=name)
        offset = cur.u64("data offset", tensor=name)
        if name in names:
            raise cur.fail("tensor name appears twice", tensor=name)
        names.add(name)
        records.append((name, ggml_type, dims, offset))
    data_start = cur.pos + (-cur.pos % alignment)
    tensors = tuple(RawTensorInfo(n, t, d, data_start + o) for n, t, d, o in records)
    return GGUFHeader(path, identity, version, metadata, tensors, alignment, data_start)


_cache: "collections.OrderedDict[FileIdentity, GGUFHeader]" = collections.OrderedDict()
_cache_lock = threading.Lock()


def parse_header_cached(path: str) -> GGUFHeader:
    """parse_header, remembered for the last CACHE_ENTRIES files (keyed by real path, inode, size, mtime)."""
    path = os.fspath(path)
    try:
        key = FileIdentity.of(path)
    except OSError:
        return parse_header(path)  # reports the missing/unreadable file
    with _cache_lock:
        header = _cache.get(key)
        if header is not None:
            _cache.move_to_end(key)
            return dataclasses.replace(header, path=path)
    header = parse_header(path)
    if time.time_ns() - header.identity.mtime_ns > RACY_NS:
        with _cache_lock:
            _cache[header.identity] = header
            while len(_cache) > CACHE_ENTRIES:
                _cache.popitem(last=False)
    return header


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()
