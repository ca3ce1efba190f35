"""The quantized output: a folder of safetensors shards, an index and a versioned manifest.

Written incrementally and crash-safely (format: docs/checkpoint.md):

* Tensors arrive one at a time and are written straight into the open shard's file,
  after a gap reserved for its header, so memory holds only the tensor in flight,
  whatever the shard size, and every byte is written once. When the next tensor would
  exceed ``max_shard_bytes`` (or break natural alignment, or outgrow the header gap),
  the shard's header is written into the gap (padded with spaces), the file is hashed
  (BLAKE3, ~3.5x faster than SHA-256 here; the last shard's hash is a serial tail) and
  renamed into place, and a journal records it. Every shard is fsynced
  before the rename that makes the bundle visible.
* The disk work runs on a background thread, so it overlaps reading and quantizing:
  the caller only decides where each tensor goes (the layout is therefore the same as
  a serial write) and queues its bytes; the queue is bounded (``write_queue_bytes``),
  so memory stays bounded. The writer thread writes each tensor with ``os.pwrite``
  straight from its buffer and the header of each full shard; a second thread hashes
  and renames full shards while the next one fills, and a third fsyncs them. An error
  on any of them is re-raised in the caller (naming the file) at the next ``add`` or at
  ``close``, and the bundle is then never renamed into place.
* Everything happens in ``<out>.partial``; only the finished folder is renamed to
  ``<out>``, so a run killed at any moment leaves no folder that looks complete.
* Rerunning resumes by default: finished shards named in the journal are kept, the
  matching head of the stream is skipped (items may be zero-argument callables so a
  skipped tensor is never even computed), and the result is byte-identical to an
  uninterrupted run. Nothing in the output depends on time, paths or hash order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import re
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import blake3
import torch

from llmq.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ResumeMismatchError,
    TensorMismatchError,
)
from llmq.checkpoint.fileio import copy_file, remove_partial, write_all, write_error, write_file_atomic
from llmq.checkpoint.ordered_worker import OrderedWorker
from llmq.checkpoint.safetensors_io import DTYPE_NAMES
from llmq.checkpoint.shard_file import ShardLayout, ShardRotation, block_writes, placeholder
from llmq.checkpoint.side_files import side_files
from llmq.checkpoint.workfolder import JOURNAL, PARTIAL_SUFFIX, WorkFolder
from llmq.quant.formats import Format, format_names, format_of, get_format
from llmq.quant.row_blocks import QuantizedRowBlocks, RowBlocks, is_row_blocks

Value = Any  # a torch.Tensor or a quantized weight of any registered format (llmq.quant.formats)

BUNDLE_FORMAT = "llmq.bundle"
BUNDLE_VERSION = 3  # the newest version this writer produces
# A bundle is written with the lowest version that can hold it: 2 unless a record is of kind
# "quantized" (a format family without a legacy record: fp8, mxfp4, mxfp8, nvfp4), so
# bundles of dense and integer weights are byte-identical to what version-2 writers wrote.
BASE_BUNDLE_VERSION = 2
READABLE_VERSIONS = (1, 2, 3)  # every version this project has ever written
# The per-shard checksum (whole file, hex); versions 1 -> 2 differ only in it, 2 -> 3 add "quantized" records.
CHECKSUM_KEY = {1: "sha256", 2: "blake3", 3: "blake3"}
_JOURNAL_VERSION = 2  # resume journals (private to one writer) kept at their version-2 layout
MANIFEST = "llmq_manifest.json"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024 ** 3
# What a bundle needs besides its weights to be used without the source folder; save_bundle's
# extra_files copies them in (source_files lists those a Hugging Face folder has).
SOURCE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "tokenizer.model")
_SHARD_NAME = re.compile(r"model-\d{5}\.safetensors")
VERIFY_AUTO_LIMIT = 4 * 1024 ** 3  # verify=None checks checksums up to this many bytes of shards
SHARD_METADATA = {"format": "pt"}  # transformers refuses safetensors files without it
_COPY_CHUNK = 16 * 1024 * 1024
_HASH_WINDOW = 16 * 1024 * 1024  # a multiple of the page size
# Tensor bytes queued for the writer thread, at most: two 16 MiB row blocks. 64 MiB was measured
# no faster (1 GB INT4 stream, tmpfs and disk, 2026-12-03) and held 34 MB more at peak.
DEFAULT_WRITE_QUEUE_BYTES = 32 * 1024 * 1024
# With fsync on, a shard's dirty pages are flushed (fdatasync on the fsync thread) every this
# many bytes, so the disk writes while the next tensors are read and quantized instead of
# all at the end (the kernel alone would start only at dirty_background_ratio, GBs later).
_FLUSH_EVERY = 128 * 1024 * 1024


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: object, *, path: str, tensor: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPE_NAMES:
        raise CorruptCheckpointError(f"unknown dtype {name!r} in the manifest", path=path, tensor=tensor)
    return dtype


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _normalised(obj: Any) -> Any:
    """obj as json.loads(canonical JSON) gives it back: sorted keys, lists for tuples."""
    return json.loads(_canonical_json(obj))


def _recipe_to_json(recipe: Any) -> Any:
    """Recipes are recorded as JSON; objects may offer to_dict()/to_json(), or be dataclasses."""
    if recipe is None or isinstance(recipe, (str, int, float, bool, list, dict)):
        value = recipe
    elif hasattr(recipe, "to_dict"):
        value = recipe.to_dict()
    elif hasattr(recipe, "to_json"):
        value = json.loads(recipe.to_json())
    elif dataclasses.is_dataclass(recipe):
        value = dataclasses.asdict(recipe)
    else:
        raise TypeError(f"cannot record a recipe of type {type(recipe).__name__}: give it to_dict() or pass a dict")
    try:
        return json.loads(_canonical_json(value))
    except TypeError as e:
        raise TypeError(f"recipe is not JSON-serialisable: {e}") from None


def _library_versions() -> Dict[str, str]:
    import llmq

    return {"llmq": getattr(llmq, "__version__", "unknown"), "torch": torch.__version__.split("+")[0]}


def _write_atomic(path: str, data: bytes, *, fsync: bool) -> None:
    write_file_atomic(path, data, fsync=fsync)


def _describe(fqn: str, value: Value) -> Tuple[Dict[str, Any], List[Tuple[str, torch.Tensor]]]:
    """The manifest record of one tensor and its (entry name, tensor) parts.

    A quantized weight is described by its format (llmq.quant.formats): the tensors it stores
    become entries ``<fqn>.<role>``; a family with a ``bundle_kind`` (the integer one) keeps its
    flat version-2 record, every other one is ``{"kind": "quantized", "format", "params", ...}``.
    An item that arrives in row blocks (llmq.quant.row_blocks) is described from its shape and
    dtype alone: its parts are placeholders whose bytes are written block by block."""
    fmt = format_of(value)
    if fmt is not None or isinstance(value, QuantizedRowBlocks):
        if fmt is not None:
            stored = fmt.stored(value)
            name, params, shape = fmt.name_of(value), fmt.params(value), fmt.shape_of(value)
        else:
            fmt, name, params, shape = value.fmt, value.name, value.params, value.shape
            stored = {role: placeholder(dtype, part_shape) for role, dtype, part_shape in value.parts_layout()}
        entries = {role: f"{fqn}.{role}" for role in stored}
        common = {"shape": list(shape), "dtype": _dtype_name(value.dtype), "entries": entries}
        kind = fmt.bundle_kind
        if kind is not None:
            record = {"kind": kind, **params, **common}
        else:
            record = {"kind": "quantized", "format": name, "params": params, **common}
        return record, [(entries[role], t) for role, t in stored.items()]
    if isinstance(value, RowBlocks):
        if value.dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor {fqn!r}: dtype {value.dtype} cannot be stored in a bundle")
        record = {"kind": "dense", "dtype": _dtype_name(value.dtype), "shape": list(value.shape),
                  "entries": {"data": fqn}}
        return record, [(fqn, placeholder(value.dtype, value.shape))]
    if isinstance(value, torch.Tensor):
        if value.dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor {fqn!r}: dtype {value.dtype} cannot be stored in a bundle")
        if value.is_sparse or value.layout != torch.strided or type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"tensor {fqn!r}: only plain dense tensors and quantized weights of a registered format "
                            f"can be saved, got {type(value).__name__} ({value.layout})")
        record = {"kind": "dense", "dtype": _dtype_name(value.dtype), "shape": list(value.shape),
                  "entries": {"data": fqn}}
        return record, [(fqn, value)]
    raise TypeError(f"tensor {fqn!r}: expected torch.Tensor or a quantized weight of a registered format "
                    f"({', '.join(format_names())}), got {type(value).__name__}")


def _record_format(rec: Dict[str, Any]) -> Optional[Format]:
    """The format a manifest record names (None for dense records or unknown names)."""
    kind = rec.get("kind")
    if kind == "quantized":
        try:
            fmt = get_format(rec.get("format"))
        except ValueError:
            return None
        return fmt if fmt.can_quantize else None  # import-only families (GGUF blocks) are never stored
    for name in format_names():
        fmt = get_format(name)
        if kind is not None and fmt.bundle_kind == kind:
            return fmt
    return None


def _written_version(tensors: Dict[str, Dict[str, Any]]) -> int:
    return BUNDLE_VERSION if any(r["kind"] == "quantized" for r in tensors.values()) else BASE_BUNDLE_VERSION


def source_files(folder: os.PathLike) -> List[str]:
    """The SOURCE_FILES a checkpoint folder has (config, tokenizer, generation config), as paths;
    one that links outside the folder or is not a regular file is refused (llmq.checkpoint.side_files)."""
    return side_files(folder, SOURCE_FILES)


def _check_extra_files(paths: Iterable[str | os.PathLike]) -> List[str]:
    paths = [os.fspath(p) for p in paths]
    names = set()
    for path in paths:
        name = os.path.basename(path)
        if not os.path.isfile(path):
            raise CheckpointNotFoundError("extra file does not exist (or is not a file)", path=path)
        if (name in (MANIFEST, INDEX, JOURNAL) or _SHARD_NAME.fullmatch(name) or name.endswith(".tmp")
                or name in names):
            raise CheckpointError(f"extra file name {name!r} is taken by the bundle's own files or another extra "
                                  "file", path=path)
        names.add(name)
    return paths


class _ShardBuilder:
    """One shard being filled: tensor bytes are written in arrival order after a reserved header gap.

    The layout (``place``, ``header``: a ShardLayout) is decided in the caller's thread;
    ``write``, ``end_writes``, ``seal`` and ``discard`` touch the file and run on background threads.
    """

    def __init__(self, folder: str, index: int, reserve: int):
        self.folder = folder
        self.file = f"model-{index:05d}.safetensors"
        self.tmp = os.path.join(folder, self.file + ".tmp")
        self.layout = ShardLayout(reserve, SHARD_METADATA)
        self.tensors: List[Tuple[str, Dict[str, Any]]] = []
        self._fd: Optional[int] = None
        self._unflushed = 0  # bytes written since the last fdatasync was queued

    def __len__(self) -> int:
        return len(self.tensors)

    @staticmethod
    def _ordered(parts: List[Tuple[str, torch.Tensor]]) -> List[Tuple[str, torch.Tensor]]:
        # Largest element first: every part then starts aligned to its element size
        # whenever the first one does (sizes are powers of two).
        return sorted(parts, key=lambda p: -p[1].element_size())

    def fits(self, parts: List[Tuple[str, torch.Tensor]], max_bytes: int) -> bool:
        """Whether the parts can join this shard: size limit, natural alignment, header room."""
        return self.layout.accepts(self._ordered(parts), max_bytes)

    def place(self, fqn: str, record: Dict[str, Any],
              parts: List[Tuple[str, torch.Tensor]]) -> List[Tuple[str, int, memoryview]]:
        """Reserve room for the parts; return (entry, file offset, bytes) for the writer thread."""
        writes = self.layout.place(self._ordered(parts))
        self.tensors.append((fqn, _normalised(dict(record, shard=self.file))))
        return writes

    def header_overflows(self) -> bool:
        return self.layout.header_overflows()

    def header(self) -> bytes:
        return self.layout.header()

    # -- writer thread ----------------------------------------------------------------------------------
    def _open(self) -> int:
        if self._fd is None:
            try:
                self._fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask decides
            except OSError as e:
                raise write_error(e, self.tmp, "creating the shard") from None
        return self._fd

    def write(self, writes: List[Tuple[str, int, memoryview]], sync: Optional["OrderedWorker"]) -> None:
        fd = self._open()
        for entry, offset, mv in writes:
            try:
                write_all(fd, mv, offset)
            except OSError as e:
                raise write_error(e, self.tmp, "writing", tensor=entry) from None
            self._unflushed += len(mv)
        if sync is not None and self._unflushed >= _FLUSH_EVERY and sync.idle():
            self._unflushed = 0
            dup = os.dup(fd)  # the fsync thread's own handle: closing it never races with ours
            sync.submit(lambda: _fsync_fd(dup, self.tmp, data_only=True))

    def end_writes(self, header: bytes, sync: Optional["OrderedWorker"]) -> None:
        """Write the header into the gap and let go of the file (to ``sync`` for an fsync that
        waits on the disk while the shard is hashed and the next one filled)."""
        fd = self._open()
        try:
            write_all(fd, header, 0)
        except OSError as e:
            raise write_error(e, self.tmp, "writing the header") from None
        self._fd = None
        if sync is None:
            os.close(fd)
        else:
            sync.submit(lambda: _fsync_fd(fd, self.tmp))

    def seal(self) -> Dict[str, Any]:
        """Hash the finished file and rename it into place; return its journal record."""
        final = os.path.join(self.folder, self.file)
        size = self.layout.reserve + self.layout.nbytes
        try:
            # Every byte was written (write_all) before this; a file of another size would hold a
            # hole that reading through mmap turns into SIGBUS on a full tmpfs, so it is refused.
            if os.path.getsize(self.tmp) != size:
                raise CheckpointError(f"is {os.path.getsize(self.tmp)} bytes after writing, expected {size}",
                                      path=self.tmp)
            digest = file_digest(self.tmp)  # read back from the page cache: cheaper than a second copy
            os.replace(self.tmp, final)
        except OSError as e:
            raise write_error(e, self.tmp, "hashing and renaming") from None
        return {"file": self.file, "bytes": size, "blake3": digest, "tensors": self.tensors}

    def discard(self) -> None:
        fd, self._fd = self._fd, None
        remove_partial(fd, self.tmp)


def _discard_on_error(shard: _ShardBuilder, fn: Callable[..., Any], *args: Any) -> Any:
    """Run a writer-thread step; if it fails, close and delete the shard's temporary file."""
    try:
        return fn(*args)
    except BaseException:
        try:
            shard.discard()
        except OSError:
            pass
        raise


def _fsync_fd(fd: int, path: str, data_only: bool = False) -> None:
    """fsync (or fdatasync) then close fd; runs on the fsync thread."""
    try:
        (os.fdatasync if data_only else os.fsync)(fd)
    except OSError as e:
        raise write_error(e, path, "fsync") from None
    finally:
        os.close(fd)


class BundleWriter:
    """Incremental bundle writer; use save_bundle() unless you need to feed it by hand.

    ``add(fqn, value)`` takes a tensor, a GroupQuantizedWeight, or a zero-argument
    callable producing one (only called when the tensor is not already on disk from
    an interrupted run). ``close()`` finishes the bundle and renames it into place;
    ``abort()`` stops it, keeping finished shards for a resume. One of the two must be
    called: the disk work runs on a background thread until then. Tensors handed to
    ``add`` must not be modified in place afterwards (their bytes may still be queued).
    """

    def __init__(self, out_dir: str | os.PathLike, *, recipe: Any = None, metadata: Optional[Dict[str, str]] = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, resume: bool = True, overwrite: bool = False,
                 fsync: bool = True, write_queue_bytes: int = DEFAULT_WRITE_QUEUE_BYTES,
                 extra_files: Iterable[str | os.PathLike] = ()):
        self.rotation = ShardRotation(max_shard_bytes)
        if write_queue_bytes < 0:
            raise ValueError(f"write_queue_bytes must be >= 0, got {write_queue_bytes}")
        self.out_dir = os.path.abspath(os.fspath(out_dir))
        self.partial = self.out_dir + PARTIAL_SUFFIX
        self.work: Optional[WorkFolder] = None
        self.fsync = fsync
        self.overwrite = overwrite
        self.extra_files = _check_extra_files(extra_files)
        # Round-tripped through canonical JSON so a resumed run's records match a fresh run's byte for byte.
        self.settings = _normalised({"max_shard_bytes": self.rotation.max_shard_bytes, "recipe": _recipe_to_json(recipe),
                                     "metadata": dict(metadata or {})})
        self.shards: List[Dict[str, Any]] = []  # appended by the writer thread once a shard is in place
        self._replay: List[Tuple[str, Dict[str, Any]]] = []
        self._pos = 0
        self._names: Dict[str, str] = {}  # entry name -> fqn, to refuse collisions
        # <out>.partial, locked until close/abort; its journal is the interrupted run's, if any
        self.work = WorkFolder(self.out_dir, writer="bundle", overwrite=overwrite, fsync=fsync)
        try:
            self._recover(resume)
            self._journal()
        except BaseException:
            self._unlock()
            raise
        self._resumed = len(self.shards)
        self._placed_shards = len(self.shards)  # shards closed in the caller's thread (maybe not yet on disk)
        self._shard = _ShardBuilder(self.partial, self._placed_shards + 1, self.rotation.reserve)
        self._writer = OrderedWorker("llmq-bundle-writer", write_queue_bytes)
        self._sealer = OrderedWorker("llmq-bundle-hash", float("inf"))
        self._syncer = OrderedWorker("llmq-bundle-fsync", float("inf")) if fsync else None
        self._stopped = False

    # -- resume --------------------------------------------------------------------------------------------
    def _unlock(self) -> None:
        self.work.release()

    def _recover(self, resume: bool) -> None:
        """Keep what an interrupted run left (finished shards named in its journal), or start over.
        (A folder without llmq's journal but with files in it is refused by WorkFolder.)"""
        journal = self.work.journal
        if self.work.other_writer is not None and resume:
            raise ResumeMismatchError(
                f"an interrupted run of another writer ({self.work.other_writer}) left this folder; "
                "delete it or pass resume=False", path=self.partial)
        if journal is None or not resume or journal.get("format_version") != _JOURNAL_VERSION:
            self.work.clear()
            return
        if journal.get("settings") != self.settings:
            raise ResumeMismatchError(
                "an interrupted run with a different recipe, metadata or shard size left this folder; "
                "delete it or pass resume=False", path=self.partial)
        keep = set()
        for shard in journal["shards"]:
            try:
                full = os.path.join(self.partial, os.path.basename(shard["file"]))
                intact = (os.path.isfile(full) and os.path.getsize(full) == shard["bytes"]
                          and file_digest(full) == shard["blake3"] and isinstance(shard["tensors"], list))
            except (KeyError, TypeError):
                intact = False
            if not intact:
                break  # this and later shards are redone
            keep.add(os.path.basename(shard["file"]))
            self.shards.append(shard)
            for fqn, record in shard["tensors"]:
                self._replay.append((fqn, record))
                for entry in record["entries"].values():
                    self._names[entry] = fqn
        self.work.clear(keep)

    def _journal(self) -> None:
        self.work.write_journal({"format_version": _JOURNAL_VERSION, "settings": self.settings,
                                 "shards": self.shards})

    def completed(self) -> List[str]:
        """fqns already on disk from an interrupted run (the producer may skip computing them)."""
        return [fqn for fqn, _ in self._replay]

    # -- writing --------------------------------------------------------------------------------------
    def add(self, fqn: str, value: Union[Value, Callable[[], Value]]) -> None:
        if self._stopped:
            raise CheckpointError("this writer was already closed or aborted", path=self.partial)
        self._writer.check()  # a failed background write or hash stops the run at the next tensor
        self._sealer.check()
        if self._syncer is not None:
            self._syncer.check()
        if not isinstance(fqn, str) or not fqn:
            raise TypeError(f"tensor names must be non-empty strings, got {fqn!r}")
        if self._pos < len(self._replay):
            want, record = self._replay[self._pos]
            if fqn != want:
                raise ResumeMismatchError(
                    f"the stream differs from the interrupted run: expected {want!r} at position {self._pos}",
                    path=self.partial, tensor=fqn)
            self._pos += 1
            if not callable(value):
                got, _ = _describe(fqn, value)
                if dict(got, shard=record["shard"]) != record:
                    raise ResumeMismatchError(f"differs from the interrupted run: {got} vs {record}",
                                              path=self.partial, tensor=fqn)
            return
        if self._pos != len(self._replay):
            raise AssertionError("unreachable")
        if callable(value) and not isinstance(value, torch.Tensor):
            value = value()
        record, parts = _describe(fqn, value)
        for entry, _ in parts:
            if entry in self._names:
                raise TensorMismatchError(f"stored name {entry!r} is already used by {self._names[entry]!r}",
                                          path=self.out_dir, tensor=fqn)
        if self.rotation.must_rotate(self._shard, parts):
            self._close_shard()
        for entry, _ in parts:
            self._names[entry] = fqn
        shard = self._shard
        writes = shard.place(fqn, record, parts)
        if shard.header_overflows():  # one item with more entries than the reserve holds
            raise TensorMismatchError(f"needs a header larger than the {self.rotation.reserve}-byte reserve; "
                                      "raise max_shard_bytes", path=self.out_dir, tensor=fqn)
        if is_row_blocks(value):
            self._add_row_blocks(shard, record["entries"], writes, value)
            return
        self._submit(shard, writes)

    def _submit(self, shard: "_ShardBuilder", writes: List[Tuple[str, int, memoryview]]) -> None:
        self._writer.submit(lambda: _discard_on_error(shard, shard.write, writes, self._syncer),
                            sum(len(mv) for _, _, mv in writes))

    def _add_row_blocks(self, shard: "_ShardBuilder", entries: Dict[str, str],
                        placed: List[Tuple[str, int, Any]], value: Any) -> None:
        """Queue an item's bytes block by block as it reads (and quantizes) them. The item is
        already placed in the shard, so a failure here (a read error, NaN/Inf in a later block)
        aborts the writer: the unfinished shard is dropped, finished ones kept for a resume."""
        offsets = {name: offset for name, offset, _ in placed}
        where = {role: (name, offsets[name], shard.layout.sizes[name]) for role, name in entries.items()}
        try:
            for r0, r1, parts in value.row_parts():
                self._submit(shard, block_writes(where, value.rows, r0, r1, parts))
                del parts
        except BaseException:
            self.abort()
            raise

    def _close_shard(self) -> None:
        shard, header = self._shard, self._shard.header()

        def seal() -> None:  # on the sealer thread, in shard order
            self.shards.append(_discard_on_error(shard, shard.seal))
            self._journal()

        def end_writes() -> None:  # on the writer thread, after the shard's last tensor
            _discard_on_error(shard, shard.end_writes, header, self._syncer)
            self._sealer.submit(seal)

        self._writer.submit(end_writes)
        self._placed_shards += 1
        self._shard = _ShardBuilder(self.partial, self._placed_shards + 1, self.rotation.reserve)

    def _drain(self) -> None:
        """Wait for the writer and fsync threads; re-raise the first error either had."""
        self._stopped = True
        try:
            self._writer.join()
        finally:
            try:
                self._sealer.join()
            finally:
                if self._syncer is not None:
                    self._syncer.join()

    def close(self, add_files: Optional[Callable[[str], None]] = None) -> str:
        """Finish the last shard, write index + manifest, and rename the folder into place;
        ``add_files(folder)`` (see save_bundle) runs just before the index and manifest."""
        try:
            return self._close(add_files)
        finally:
            self._unlock()

    def _close(self, add_files: Optional[Callable[[str], None]]) -> str:
        if self._stopped:
            raise CheckpointError("this writer was already closed or aborted", path=self.partial)
        if self._pos != len(self._replay):
            raise ResumeMismatchError(
                f"the stream ended after {self._pos} tensors but the interrupted run had already written "
                f"{len(self._replay)}", path=self.partial)
        try:
            if len(self._shard):
                self._close_shard()
            self._drain()
        except BaseException:
            self.abort()
            raise
        self._shard.discard()
        tensors: Dict[str, Any] = {}
        weight_map: Dict[str, str] = {}
        for shard in self.shards:
            for fqn, record in shard["tensors"]:
                tensors[fqn] = record
                for entry in record["entries"].values():
                    weight_map[entry] = shard["file"]
        files = []
        for src in self.extra_files:  # copied last: a resumed run copies them again
            name = os.path.basename(src)
            dst = os.path.join(self.partial, name)
            copy_file(src, dst, fsync=self.fsync)
            files.append({"file": name, "bytes": os.path.getsize(dst), "blake3": file_digest(dst)})
        if add_files is not None:
            add_files(self.partial)
        manifest = {
            "format": BUNDLE_FORMAT,
            "format_version": _written_version(tensors),
            "recipe": self.settings["recipe"],
            "metadata": self.settings["metadata"],
            "library_versions": _library_versions(),
            "max_shard_bytes": self.rotation.max_shard_bytes,
            "total_bytes": sum(s["bytes"] for s in self.shards),
            "shards": [{k: s[k] for k in ("file", "bytes", "blake3")} for s in self.shards],
            "files": sorted(files, key=lambda f: f["file"]),
            "tensors": tensors,
        }
        index = {"metadata": {"format": BUNDLE_FORMAT, "total_size": manifest["total_bytes"]},
                 "weight_map": weight_map}
        _write_atomic(os.path.join(self.partial, INDEX), json.dumps(index, indent=1).encode(), fsync=self.fsync)
        _write_atomic(os.path.join(self.partial, MANIFEST), json.dumps(manifest, indent=1).encode(),
                      fsync=self.fsync)
        # The shards this run wrote were fsynced on the fsync thread; publish fsyncs the rest (the
        # resumed shards, index, manifest, extra files), moves the journal out and renames the folder.
        return self.work.publish(synced=[shard["file"] for shard in self.shards[self._resumed:]])

    def abort(self) -> None:
        """Stop: queued writes and shard closes still finish (so a resume can keep them) unless
        the writer failed; the unfinished shard is dropped; finished shards stay for a resume."""
        try:
            self._drain()
        except BaseException:
            pass  # the caller is already handling an error; this one was (or will be) reported
        try:
            self._shard.discard()
            for name in os.listdir(self.partial):  # shards whose jobs were dropped after a failure
                if name.endswith(".safetensors.tmp"):
                    os.unlink(os.path.join(self.partial, name))
        except OSError:
            pass  # as above: the error being handled is the one to report
        finally:
            self._unlock()


def save_bundle(stream: Iterable[Tuple[str, Union[Value, Callable[[], Value]]]], out_dir: str | os.PathLike, *,
                recipe: Any = None, metadata: Optional[Dict[str, str]] = None,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, resume: bool = True, overwrite: bool = False,
                fsync: bool = True, write_queue_bytes: int = DEFAULT_WRITE_QUEUE_BYTES,
                extra_files: Iterable[os.PathLike] = (), add_files: Optional[Callable[[str], None]] = None) -> str:
    """Write ``(fqn, tensor | GroupQuantizedWeight | callable)`` items as a bundle; return its path.

    ``extra_files`` (e.g. ``source_files(hf_folder)``: config.json, tokenizer files) are copied
    into the bundle and recorded in the manifest's "files" with their size and BLAKE3 hash.
    ``add_files(folder)`` is called with the work folder before the publish (a run's error report):
    what it writes there is published with the bundle (not recorded in the manifest).

    Peak memory is the tensor in flight plus at most ``write_queue_bytes`` of tensors
    queued for the background writer (and a 16 MiB hashing buffer), not the shard or
    the model; an item larger than ``write_queue_bytes`` is written before ``add`` returns,
    so it is never queued while the stream reads the next one. A tensor larger than max_shard_bytes gets a shard of its own.
    """
    writer = BundleWriter(out_dir, recipe=recipe, metadata=metadata, max_shard_bytes=max_shard_bytes,
                          resume=resume, overwrite=overwrite, fsync=fsync, write_queue_bytes=write_queue_bytes,
                          extra_files=extra_files)
    try:
        for fqn, value in stream:
            writer.add(fqn, value)
            del value  # not held while the stream reads the next one
    except BaseException:
        writer.abort()
        raise
    return writer.close(add_files)


# -- reading -------------------------------------------------------------------------------------------

def file_digest(path: str, algorithm: str = "blake3") -> str:
    """Hex digest of a whole file: "blake3" (format 2) or "sha256" (format 1).

    BLAKE3 hashes memory-mapped windows of the file with all cores (the last shard's hash
    is a serial tail nothing else overlaps); one window is mapped at a time so the hash
    adds at most _HASH_WINDOW to the resident set, however large the shard."""
    if algorithm == "blake3":
        digest = blake3.blake3(max_threads=blake3.blake3.AUTO)
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            for offset in range(0, size, _HASH_WINDOW):
                with mmap.mmap(f.fileno(), min(_HASH_WINDOW, size - offset), access=mmap.ACCESS_READ,
                               offset=offset) as window:
                    digest.update(window)
        return digest.hexdigest()
    digest = hashlib.new(algorithm)
    buf = bytearray(_COPY_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            digest.update(view[:n])
    return digest.hexdigest()
