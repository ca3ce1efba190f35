"""A defensive safetensors reader (and the header encoder the bundle writer uses).

Why not ``safetensors.safe_open``: it validates headers well, but its errors name
neither our file nor what was expected, and a hostile file must be refused before
anything is allocated. So the 8-byte length and the JSON header are parsed and
checked here (sizes, dtypes, offsets inside the file, no overlaps, no holes, the
data section exactly filled -- the same rules the reference implementation
enforces), and each tensor is then read with positioned reads (``os.preadv``; one,
or for 16 MiB and more one per torch thread in parallel while cores are idle) straight from the page cache
into a freshly allocated tensor. That is the same
data path as copying out of an ``mmap`` without leaving the mapped pages resident
in the process, so memory stays bounded by the tensor being read.

File layout (https://github.com/huggingface/safetensors, format section):
``u64 little-endian N | N bytes of UTF-8 JSON | data``; the JSON maps each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to
the start of the data) plus an optional ``"__metadata__"`` str->str map.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import mmap
import os
import struct
import sys
import threading
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from llmq.checkpoint.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedCheckpointError,
)
from llmq.checkpoint.shapes import dims_problem

# Same cap as the reference implementation: a header larger than this is refused
# before it is read, so a hostile length cannot make us allocate gigabytes.
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_DIMS = 32

# safetensors dtype string -> torch dtype. Every one here has a whole-byte element.
DTYPES: Dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
DTYPE_NAMES: Dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

# Largest single positioned read Linux performs (0x7ffff000); longer reads loop.
_MAX_READ = 1 << 30


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in a safetensors file (offsets are absolute file offsets)."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class SafetensorsHeader:
    path: str
    entries: Dict[str, TensorEntry]  # in data order
    metadata: Dict[str, str]
    data_start: int
    file_size: int


def _reject_duplicate_keys(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def has_lone_surrogate(s: str) -> bool:
    """True when s holds a code point U+D800..U+DFFF: JSON's "\\ud800" escapes decode to one in
    Python but are not Unicode text (Rust's serde_json, and so safe_open, refuses them)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _lone_surrogate(value) -> Optional[str]:
    """The first string (object key or value, at any depth) holding a lone surrogate, or None."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if has_lone_surrogate(v):
                return v
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Parse and fully validate a safetensors header; reads at most the header bytes."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            if file_size < 8:
                raise CorruptCheckpointError(
                    f"file is {file_size} bytes; a safetensors file needs at least the 8-byte header length",
                    path=path)
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > MAX_HEADER_BYTES:
                raise CorruptCheckpointError(
                    f"header claims {header_len} bytes; refusing headers over {MAX_HEADER_BYTES} bytes", path=path)
            if 8 + header_len > file_size:
                raise CorruptCheckpointError(
                    f"header claims {header_len} bytes but the file has only {file_size - 8} after the length "
                    "(truncated?)", path=path)
            raw = f.read(header_len)
    except FileNotFoundError:
        raise CheckpointNotFoundError("no such file", path=path) from None
    except IsADirectoryError:
        raise CorruptCheckpointError("expected a .safetensors file, found a directory", path=path) from None
    except OSError as e:
        raise CheckpointNotFoundError(f"cannot read: {e.strerror or e}", path=path) from None
    if len(raw) != header_len:
        raise CorruptCheckpointError("file shrank while reading the header", path=path)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"header is not valid UTF-8 JSON ({e})", path=path) from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"header must be a JSON object, got {type(header).__name__}", path=path)
    data_start = 8 + header_len
    data_size = file_size - data_start
    bad = _lone_surrogate(header)
    if bad is not None:
        raise CorruptCheckpointError(f"header string {bad!r} holds a lone UTF-16 surrogate escape (not valid "
                                     "Unicode; the reference reader refuses it)"[:300], path=path)
    metadata = header.pop("__metadata__", None)  # absent or null: none
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CorruptCheckpointError(f"__metadata__ must be an object mapping strings to strings, got "
                                     f"{json.dumps(metadata)[:80]}", path=path)

    entries: List[TensorEntry] = []
    for name, info in header.items():
        entries.append(_parse_entry(path, name, info, data_start, data_size))
    entries.sort(key=lambda e: (e.start, e.end))
    cursor = data_start
    for e in entries:
        if e.start < cursor:
            raise CorruptCheckpointError(
                f"data [{e.start - data_start}, {e.end - data_start}) overlaps the previous tensor, which ends at "
                f"{cursor - data_start}", path=path, tensor=e.name)
        if e.start > cursor:
            raise CorruptCheckpointError(
                f"data starts at {e.start - data_start} but the previous tensor ends at {cursor - data_start}; "
                "safetensors data may not contain holes", path=path, tensor=e.name)
        cursor = e.end
    if cursor != file_size:
        raise CorruptCheckpointError(
            f"tensors cover {cursor - data_start} bytes of data but the file holds {data_size} "
            "(truncated or trailing garbage)", path=path)
    return SafetensorsHeader(path, {e.name: e for e in entries}, dict(metadata), data_start, file_size)


def _parse_entry(path: str, name: str, info, data_start: int, data_size: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise CorruptCheckpointError("header entry must be an object with dtype, shape, data_offsets",
                                     path=path, tensor=name)
    extra = set(info) - {"dtype", "shape", "data_offsets"}
    if extra:
        raise CorruptCheckpointError(f"unexpected header fields {sorted(extra)}", path=path, tensor=name)
    dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise UnsupportedCheckpointError(
            f"dtype {dtype_name!r} is not one of {sorted(DTYPES)}", path=path, tensor=name)
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(_is_int(d) and d >= 0 for d in shape)):
        raise CorruptCheckpointError(
            f"shape must be a list of at most {MAX_DIMS} non-negative integers, got {shape!r}"[:300],
            path=path, tensor=name)
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise CorruptCheckpointError(
            f"data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}"[:300],
            path=path, tensor=name)
    problem = dims_problem(shape)
    if problem:
        raise UnsupportedCheckpointError(problem[:300], path=path, tensor=name)
    dtype = DTYPES[dtype_name]
    nbytes = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
    if offsets[1] - offsets[0] != nbytes:
        raise CorruptCheckpointError(
            f"{dtype_name} {shape} needs {nbytes} bytes but data_offsets {offsets} span {offsets[1] - offsets[0]}",
            path=path, tensor=name)
    if offsets[1] > data_size:
        raise CorruptCheckpointError(
            f"data_offsets {offsets} point past the end of the data ({data_size} bytes; truncated?)",
            path=path, tensor=name)
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


_HUGE_PAGE_MIN_BYTES = 4 << 20


def alloc_bytes(nbytes: int) -> torch.Tensor:
    """Fresh, writable uint8 storage for one tensor read.

    Large buffers come from an anonymous mapping advised MADV_HUGEPAGE: filling fresh
    memory costs one page fault per 4 KiB page otherwise, which caps reads at ~1.5 GB/s
    here; with 2 MiB pages the same read runs at ~5 GB/s. The tensor keeps the mapping
    alive and unmaps it when freed.
    """
    if nbytes >= _HUGE_PAGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.frombuffer(_huge_mapping(nbytes), dtype=torch.uint8)
    return torch.empty(nbytes, dtype=torch.uint8)


def _huge_mapping(nbytes: int) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


_LIST_HELD_PROBE = [object()]


class ReadBuffers:
    """Read buffers of one reader, each reused once nothing references it any more.

    Every fresh mapping is zeroed by the kernel as the read first touches it (measured: 14%
    of the CPU time of an NVFP4 export read from tmpfs, as much as the quantization kernel).
    A buffer is handed out again only when no tensor, view or array of it is left: the
    tensor's storage holds the mapping object until its last view is freed, so the object's
    reference count says whether it is free. Buffers of at least 4 MiB only, at most
    ``max_bytes`` of them kept (a read that finds none free and no room gets a mapping of its
    own, freed with it); ``clear()`` forgets them all. The default, 40 MiB, serves nearly
    every read of the NVFP4 and FP8 exports with 16 MiB row blocks (NVFP4 holds q/k/v, 8 MiB
    each, until the group is complete), and all but the pass-through blocks the INT4 stream's
    write queue holds; each idle buffer adds to peak memory (1 GB INT4 stream: +15 MB peak RSS
    with 32 MiB, +35 MB with 48 MiB).
    """

    def __init__(self, max_bytes: int = 40 << 20):
        self._max_bytes = max_bytes
        self._bufs: List[mmap.mmap] = []
        self._lock = threading.Lock()

    def _free(self, i: int) -> bool:
        # Held by the list alone: counted as a probe held by a list alone is counted.
        return sys.getrefcount(self._bufs[i]) <= sys.getrefcount(_LIST_HELD_PROBE[0])

    def take(self, nbytes: int) -> torch.Tensor:
        """Writable uint8 tensor of nbytes; its contents are whatever the buffer held."""
        if nbytes < _HUGE_PAGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
            return alloc_bytes(nbytes)
        with self._lock:
            fits = [i for i in range(len(self._bufs)) if nbytes <= len(self._bufs[i]) and self._free(i)]
            if fits:
                i = min(fits, key=lambda j: len(self._bufs[j]))
                return torch.frombuffer(self._bufs[i], dtype=torch.uint8, count=nbytes)
            size = -(-nbytes // (2 << 20)) * (2 << 20)
            for i in reversed(range(len(self._bufs))):  # make room: forget free ones
                if sum(map(len, self._bufs)) + size <= self._max_bytes:
                    break
                if self._free(i):
                    del self._bufs[i]
            buf = _huge_mapping(size)
            if sum(map(len, self._bufs)) + size <= self._max_bytes:
                self._bufs.append(buf)
            return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)

    def clear(self) -> None:
        with self._lock:
            self._bufs.clear()


def _pread_range(fd: int, buf: memoryview, offset: int, begin: int, end: int, *, path: str, tensor: str) -> None:
    """Fill buf[begin:end] from fd at offset + begin, looping over short reads."""
    done = begin
    while done < end:
        n = os.preadv(fd, [buf[done:min(end, done + _MAX_READ)]], offset + done)
        if n <= 0:
            raise CorruptCheckpointError(
                f"file ended after {done} of {len(buf)} bytes (truncated while reading?)", path=path, tensor=tensor)
        done += n


# A large read is split into byte ranges read at once (each preadv releases the GIL, and the
# kernel's page-cache copy and the fresh pages' zeroing then run on several cores, as torch's
# own multi-threaded copy does for safe_open + clone): at most torch.get_num_threads() ranges
# (torch.set_num_threads(1) keeps reads on one core), and only as many as the 1-minute load
# average leaves cores idle, plus one. On a busy machine the split costs more than it gains
# (measured at load 14-19 on 2 cores: 1.20 GB/s split vs 1.82 GB/s in one range).
_PARALLEL_READ_MIN_BYTES = 16 << 20
_PARALLEL_READ_MAX_THREADS = 8
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def _read_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(_PARALLEL_READ_MAX_THREADS - 1,
                                                          thread_name_prefix="llmq-pread")
        return _pool


def _idle_cpus() -> int:
    """Cores this process may use that the 1-minute load average leaves idle (0 when unknown)."""
    try:
        usable = len(os.sched_getaffinity(0))
        return max(0, int(usable - os.getloadavg()[0]))
    except (AttributeError, OSError):
        return 0


def pread_exact(fd: int, buf: memoryview, offset: int, *, path: str, tensor: str) -> None:
    """Fill buf from fd at offset, looping over short reads; a short file is an error.

    Buffers of at least 16 MiB are read as up to torch.get_num_threads() (at most 8) ranges
    in parallel when cores are idle, aligned to 2 MiB so each thread faults in its own huge
    pages."""
    total = len(buf)
    parts = min(torch.get_num_threads(), _PARALLEL_READ_MAX_THREADS, total // (_PARALLEL_READ_MIN_BYTES // 2))
    if parts > 1:
        parts = min(parts, 1 + _idle_cpus())
    if parts <= 1:
        _pread_range(fd, buf, offset, 0, total, path=path, tensor=tensor)
        return
    step = (-(-total // parts) + (2 << 20) - 1) // (2 << 20) * (2 << 20)
    bounds = [(b, min(total, b + step)) for b in range(0, total, step)]
    pool = _read_pool()
    futures = [pool.submit(_pread_range, fd, buf, offset, b, e, path=path, tensor=tensor) for b, e in bounds[1:]]
    error: Optional[BaseException] = None
    try:
        _pread_range(fd, buf, offset, *bounds[0], path=path, tensor=tensor)
    except BaseException as exc:  # wait for the others before the buffer can be freed
        error = exc
    for f in futures:
        try:
            f.result()
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error


class OpenReadOnly:
    """Owns ``self._fd``, a read-only descriptor of ``self.path`` (what ``pread_exact`` reads):
    a context manager that closes it at exit, on ``close()`` or when collected."""

    _fd: Optional[int] = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class SafetensorsFile(OpenReadOnly):
    """An open, validated safetensors file; ``read(name)`` materialises one tensor."""

    def __init__(self, path: str | os.PathLike):
        self.header = read_header(path)
        self.path = self.header.path
        self._fd: Optional[int] = os.open(self.path, os.O_RDONLY)
        # A file replaced or truncated between parsing and reading is caught here or by pread.
        if os.fstat(self._fd).st_size != self.header.file_size:
            self.close()
            raise CorruptCheckpointError("file changed size after its header was read", path=self.path)

    @property
    def entries(self) -> Dict[str, TensorEntry]:
        return self.header.entries

    @property
    def metadata(self) -> Dict[str, str]:
        return self.header.metadata

    def names(self) -> List[str]:
        return list(self.header.entries)

    def read(self, name: str, *, buffers: Optional[ReadBuffers] = None) -> torch.Tensor:
        """The tensor, in fresh memory (or in one of ``buffers``, reused once unreferenced)."""
        try:
            e = self.header.entries[name]
        except KeyError:
            raise CheckpointNotFoundError("no such tensor in this file", path=self.path, tensor=name) from None
        if self._fd is None:
            raise CheckpointNotFoundError("file already closed", path=self.path, tensor=name)
        raw = buffers.take(e.nbytes) if buffers is not None else alloc_bytes(e.nbytes)
        if e.nbytes:
            pread_exact(self._fd, memoryview(raw.numpy()), e.start, path=self.path, tensor=name)
        return raw.view(e.dtype).reshape(e.shape)

    def read_rows(self, name: str, r0: int, r1: int, *, buffers: Optional[ReadBuffers] = None) -> torch.Tensor:
        """Rows r0:r1 (along the first dimension) of a tensor of at least one dimension; memory as read()."""
        e = self.header.entries[name]
        if self._fd is None:
            raise CheckpointNotFoundError("file already closed", path=self.path, tensor=name)
        row_bytes = e.nbytes // e.shape[0]
        nbytes = (r1 - r0) * row_bytes
        raw = buffers.take(nbytes) if buffers is not None else alloc_bytes(nbytes)
        if len(raw):
            pread_exact(self._fd, memoryview(raw.numpy()), e.start + r0 * row_bytes, path=self.path, tensor=name)
        return raw.view(e.dtype).reshape((r1 - r0,) + tuple(e.shape[1:]))

    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        for name in self.header.entries:
            yield name, self.read(name)


def _entry_json(name: str, dtype: torch.dtype, shape: Tuple[int, ...], begin: int, end: int) -> str:
    if dtype not in DTYPE_NAMES:
        raise UnsupportedCheckpointError(f"dtype {dtype} cannot be stored in safetensors", tensor=name)
    info = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [begin, end]}
    return json.dumps({name: info}, separators=(",", ":"), ensure_ascii=False)[1:-1]


def header_json_size(metadata: Optional[Dict[str, str]], entry_sizes: List[int]) -> int:
    """Byte length of the compact JSON encode_header builds, from per-entry fragment sizes
    (entry_fragment_size); lets a writer track its header size without re-encoding."""
    parts = list(entry_sizes)
    if metadata:
        parts.append(len(json.dumps({"__metadata__": dict(metadata)}, separators=(",", ":"),
                                    ensure_ascii=False).encode("utf-8")) - 2)
    return 2 + sum(parts) + max(0, len(parts) - 1)


def entry_fragment_size(name: str, dtype: torch.dtype, shape: Tuple[int, ...], begin: int, end: int) -> int:
    return len(_entry_json(name, dtype, shape, begin, end).encode("utf-8"))


def encode_header(entries: List[Tuple[str, torch.dtype, Tuple[int, ...], int]],
                  metadata: Optional[Dict[str, str]] = None, *, pad_to: Optional[int] = None) -> bytes:
    """The length prefix + JSON header for tensors laid out back to back in the given order.

    entries: (name, dtype, shape, nbytes). Keys appear in data order and the JSON is
    compact, so the same input always gives the same bytes. The JSON is padded with
    spaces (which JSON ignores, as the reference writer does) to a multiple of 8 bytes,
    or to exactly ``pad_to`` bytes so that data can be written before the header.
    """
    fragments = []
    if metadata:
        fragments.append(json.dumps({"__metadata__": dict(metadata)}, separators=(",", ":"),
                                    ensure_ascii=False)[1:-1])
    offset = 0
    for name, dtype, shape, nbytes in entries:
        fragments.append(_entry_json(name, dtype, shape, offset, offset + nbytes))
        offset += nbytes
    raw = ("{" + ",".join(fragments) + "}").encode("utf-8")
    if pad_to is None:
        raw += b" " * (-len(raw) % 8)
    elif len(raw) > pad_to:
        raise ValueError(f"header needs {len(raw)} bytes but only {pad_to} are reserved")
    else:
        raw += b" " * (pad_to - len(raw))
    return struct.pack("<Q", len(raw)) + raw
