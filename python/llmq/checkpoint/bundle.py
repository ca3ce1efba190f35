"""The quantized output: a folder of safetensors shards, an index and a versioned manifest.

Written incrementally and crash-safely (format: docs/checkpoint.md):

* Tensors arrive one at a time and are written straight into the open shard's file,
  after a gap reserved for its header, so memory holds only the tensor in flight,
  whatever the shard size, and every byte is written once. When the next tensor would
  exceed ``max_shard_bytes`` (or break natural alignment, or outgrow the header gap),
  the shard's header is written into the gap (padded with spaces), the file is hashed
  (SHA-256) and renamed into place, and a journal records it. All shards are fsynced
  once at the end, before the rename that makes the bundle visible.
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
import os
import shutil
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch

from llmq.checkpoint.errors import (
    BundleVersionError,
    CheckpointError,
    CheckpointNotFoundError,
    ChecksumError,
    CorruptCheckpointError,
    ResumeMismatchError,
    TensorMismatchError,
    UnsupportedCheckpointError,
)
from llmq.checkpoint.safetensors_io import (
    DTYPE_NAMES,
    SafetensorsFile,
    encode_header,
    entry_fragment_size,
    header_json_size,
)
from llmq.quant.formats import GroupQuantizedWeight

Value = Union[torch.Tensor, GroupQuantizedWeight]

BUNDLE_FORMAT = "llmq.bundle"
BUNDLE_VERSION = 1
READABLE_VERSIONS = (1,)  # every version this project has ever written
MANIFEST = "llmq_manifest.json"
INDEX = "model.safetensors.index.json"
JOURNAL = "journal.json"
PARTIAL_SUFFIX = ".partial"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024 ** 3
VERIFY_AUTO_LIMIT = 4 * 1024 ** 3  # verify=None checks checksums up to this many bytes of shards
SHARD_METADATA = {"format": "pt"}  # transformers refuses safetensors files without it
_COPY_CHUNK = 16 * 1024 * 1024
_QUANT_PARTS = ("qdata", "scale", "bias")


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


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, data: bytes, *, fsync: bool) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _describe(fqn: str, value: Value) -> Tuple[Dict[str, Any], List[Tuple[str, torch.Tensor]]]:
    """The manifest record of one tensor and its (entry name, tensor) parts."""
    if isinstance(value, GroupQuantizedWeight):
        entries = {p: f"{fqn}.{p}" for p in _QUANT_PARTS}
        record = {"kind": "group_quantized", "bits": value.bits, "group_size": value.group_size,
                  "shape": list(value.shape), "dtype": _dtype_name(value.dtype), "entries": entries}
        return record, [(entries[p], getattr(value, p)) for p in _QUANT_PARTS]
    if isinstance(value, torch.Tensor):
        if value.dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor {fqn!r}: dtype {value.dtype} cannot be stored in a bundle")
        if value.is_sparse or value.layout != torch.strided or type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"tensor {fqn!r}: only plain dense tensors and GroupQuantizedWeight can be saved, "
                            f"got {type(value).__name__} ({value.layout})")
        record = {"kind": "dense", "dtype": _dtype_name(value.dtype), "shape": list(value.shape),
                  "entries": {"data": fqn}}
        return record, [(fqn, value)]
    raise TypeError(f"tensor {fqn!r}: expected torch.Tensor or GroupQuantizedWeight, got {type(value).__name__}")


def header_reserve(max_shard_bytes: int) -> int:
    """Bytes kept free at the start of each shard for its header (length prefix included).

    Data is written straight after this gap and the header, padded with spaces to fill
    it exactly, goes in last: no second copy of the shard. 1/2048 of the shard size
    (a power of two between 4 KiB and 1 MiB) holds thousands of entries; a shard whose
    header would outgrow it is closed early.
    """
    reserve = 4096
    while reserve < 1 << 20 and reserve * 2048 < max_shard_bytes:
        reserve *= 2
    return reserve


class _ShardBuilder:
    """One shard being filled: tensor bytes are written in arrival order after a reserved header gap."""

    def __init__(self, folder: str, index: int, reserve: int):
        self.folder = folder
        self.file = f"model-{index:05d}.safetensors"
        self.tmp = os.path.join(folder, self.file + ".tmp")
        self.reserve = reserve
        self.nbytes = 0  # data bytes written
        self.tensors: List[Tuple[str, Dict[str, Any]]] = []
        self._entries: List[Tuple[str, torch.dtype, Tuple[int, ...], int]] = []
        self._fragment_sizes: List[int] = []
        self._out = None

    def __len__(self) -> int:
        return len(self.tensors)

    @staticmethod
    def _ordered(parts: List[Tuple[str, torch.Tensor]]) -> List[Tuple[str, torch.Tensor]]:
        # Largest element first: every part then starts aligned to its element size
        # whenever the first one does (sizes are powers of two).
        return sorted(parts, key=lambda p: -p[1].element_size())

    def fits(self, parts: List[Tuple[str, torch.Tensor]], max_bytes: int) -> bool:
        """Whether the parts can join this shard: size limit, natural alignment, header room."""
        if not self.tensors:
            return True
        parts = self._ordered(parts)
        if self.nbytes % parts[0][1].element_size():
            return False  # safetensors data may not contain holes, so misaligned data opens a new shard
        offset, sizes = self.nbytes, list(self._fragment_sizes)
        for name, t in parts:
            n = t.numel() * t.element_size()
            sizes.append(entry_fragment_size(name, t.dtype, tuple(t.shape), offset, offset + n))
            offset += n
        return (offset <= max_bytes
                and header_json_size(SHARD_METADATA, sizes) <= self.reserve - 8)

    def add(self, fqn: str, record: Dict[str, Any], parts: List[Tuple[str, torch.Tensor]]) -> None:
        if self._out is None:
            self._out = open(self.tmp, "w+b", buffering=0)
            self._out.seek(self.reserve)
        for entry, t in self._ordered(parts):
            mv = _tensor_bytes(t)
            self._fragment_sizes.append(
                entry_fragment_size(entry, t.dtype, tuple(t.shape), self.nbytes, self.nbytes + len(mv)))
            done = 0
            while done < len(mv):
                done += self._out.write(mv[done:])
            self._entries.append((entry, t.dtype, tuple(t.shape), len(mv)))
            self.nbytes += len(mv)
        self.tensors.append((fqn, _normalised(dict(record, shard=self.file))))

    def header_overflows(self) -> bool:
        return header_json_size(SHARD_METADATA, self._fragment_sizes) > self.reserve - 8

    def finish(self) -> Dict[str, Any]:
        # No fsync here: the kernel writes the shard back while the next one fills, and a
        # resume re-verifies every journaled shard's SHA-256 anyway. close() fsyncs all
        # shards once, before the bundle is renamed into place.
        header = encode_header(self._entries, SHARD_METADATA, pad_to=self.reserve - 8)
        out, self._out = self._out, None
        os.pwrite(out.fileno(), header, 0)
        out.close()
        final = os.path.join(self.folder, self.file)
        digest = _sha256(self.tmp)  # read back from the page cache: cheaper than a second copy
        os.replace(self.tmp, final)
        return {"file": self.file, "bytes": self.reserve + self.nbytes, "sha256": digest, "tensors": self.tensors}

    def discard(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


class BundleWriter:
    """Incremental bundle writer; use save_bundle() unless you need to feed it by hand.

    ``add(fqn, value)`` takes a tensor, a GroupQuantizedWeight, or a zero-argument
    callable producing one (only called when the tensor is not already on disk from
    an interrupted run). ``close()`` finishes the bundle and renames it into place.
    """

    def __init__(self, out_dir: os.PathLike, *, recipe: Any = None, metadata: Optional[Dict[str, str]] = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, resume: bool = True, overwrite: bool = False,
                 fsync: bool = True):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.out_dir = os.path.abspath(os.fspath(out_dir))
        self.partial = self.out_dir + PARTIAL_SUFFIX
        self.fsync = fsync
        self.max_shard_bytes = int(max_shard_bytes)
        self.reserve = header_reserve(self.max_shard_bytes)
        self.overwrite = overwrite
        if os.path.exists(self.out_dir) and not overwrite:
            raise CheckpointError("output already exists; pass overwrite=True to replace it", path=self.out_dir)
        # Round-tripped through canonical JSON so a resumed run's records match a fresh run's byte for byte.
        self.settings = _normalised({"max_shard_bytes": self.max_shard_bytes, "recipe": _recipe_to_json(recipe),
                                     "metadata": dict(metadata or {})})
        self.shards: List[Dict[str, Any]] = []
        self._replay: List[Tuple[str, Dict[str, Any]]] = []
        self._pos = 0
        self._names: Dict[str, str] = {}  # entry name -> fqn, to refuse collisions
        os.makedirs(os.path.dirname(self.out_dir) or ".", exist_ok=True)
        if os.path.isdir(self.partial):
            self._recover(resume)
        else:
            os.makedirs(self.partial)
        self._journal()
        self._shard = _ShardBuilder(self.partial, len(self.shards) + 1, self.reserve)

    # -- resume ---------------------------------------------------------------------------------------
    def _recover(self, resume: bool) -> None:
        journal_path = os.path.join(self.partial, JOURNAL)
        journal = None
        if resume and os.path.isfile(journal_path):
            try:
                with open(journal_path, "rb") as f:
                    journal = json.loads(f.read())
            except ValueError:
                journal = None  # torn journal: start over
        if (not resume or not isinstance(journal, dict) or journal.get("format_version") != BUNDLE_VERSION
                or not isinstance(journal.get("shards"), list)):
            shutil.rmtree(self.partial)
            os.makedirs(self.partial)
            return
        if journal.get("settings") != self.settings:
            raise ResumeMismatchError(
                "an interrupted run with a different recipe, metadata or shard size left this folder; "
                "delete it or pass resume=False", path=self.partial)
        keep = {JOURNAL}
        for shard in journal["shards"]:
            try:
                full = os.path.join(self.partial, os.path.basename(shard["file"]))
                intact = (os.path.isfile(full) and os.path.getsize(full) == shard["bytes"]
                          and _sha256(full) == shard["sha256"] and isinstance(shard["tensors"], list))
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
        for name in os.listdir(self.partial):
            if name not in keep:
                full = os.path.join(self.partial, name)
                shutil.rmtree(full) if os.path.isdir(full) else os.unlink(full)

    def _journal(self) -> None:
        data = {"format_version": BUNDLE_VERSION, "settings": self.settings, "shards": self.shards}
        _write_atomic(os.path.join(self.partial, JOURNAL), _canonical_json(data), fsync=self.fsync)

    def completed(self) -> List[str]:
        """fqns already on disk from an interrupted run (the producer may skip computing them)."""
        return [fqn for fqn, _ in self._replay]

    # -- writing --------------------------------------------------------------------------------------
    def add(self, fqn: str, value: Union[Value, Callable[[], Value]]) -> None:
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
        if not self._shard.fits(parts, self.max_shard_bytes):
            self._close_shard()
        for entry, _ in parts:
            self._names[entry] = fqn
        self._shard.add(fqn, record, parts)
        if self._shard.header_overflows():  # one item with more entries than the reserve holds
            raise TensorMismatchError(f"needs a header larger than the {self.reserve}-byte reserve; "
                                      "raise max_shard_bytes", path=self.out_dir, tensor=fqn)

    def _close_shard(self) -> None:
        self.shards.append(self._shard.finish())
        self._journal()
        self._shard = _ShardBuilder(self.partial, len(self.shards) + 1, self.reserve)

    def close(self) -> str:
        """Finish the last shard, write index + manifest, and rename the folder into place."""
        if self._pos != len(self._replay):
            raise ResumeMismatchError(
                f"the stream ended after {self._pos} tensors but the interrupted run had already written "
                f"{len(self._replay)}", path=self.partial)
        if len(self._shard):
            self._close_shard()
        else:
            self._shard.discard()
        tensors: Dict[str, Any] = {}
        weight_map: Dict[str, str] = {}
        for shard in self.shards:
            for fqn, record in shard["tensors"]:
                tensors[fqn] = record
                for entry in record["entries"].values():
                    weight_map[entry] = shard["file"]
        manifest = {
            "format": BUNDLE_FORMAT,
            "format_version": BUNDLE_VERSION,
            "recipe": self.settings["recipe"],
            "metadata": self.settings["metadata"],
            "library_versions": _library_versions(),
            "max_shard_bytes": self.max_shard_bytes,
            "total_bytes": sum(s["bytes"] for s in self.shards),
            "shards": [{k: s[k] for k in ("file", "bytes", "sha256")} for s in self.shards],
            "tensors": tensors,
        }
        index = {"metadata": {"format": BUNDLE_FORMAT, "total_size": manifest["total_bytes"]},
                 "weight_map": weight_map}
        _write_atomic(os.path.join(self.partial, INDEX), json.dumps(index, indent=1).encode(), fsync=self.fsync)
        _write_atomic(os.path.join(self.partial, MANIFEST), json.dumps(manifest, indent=1).encode(),
                      fsync=self.fsync)
        os.unlink(os.path.join(self.partial, JOURNAL))
        if self.fsync:  # everything durable before the folder can look complete
            for shard in self.shards:
                _fsync_file(os.path.join(self.partial, shard["file"]))
            _fsync_dir(self.partial)
        old = None
        if os.path.exists(self.out_dir):  # overwrite=True: move the old one aside, then swap
            old = self.out_dir + ".old"
            if os.path.exists(old):
                shutil.rmtree(old)
            os.rename(self.out_dir, old)
        os.rename(self.partial, self.out_dir)
        if self.fsync:
            _fsync_dir(os.path.dirname(self.out_dir))
        if old:
            shutil.rmtree(old)
        return self.out_dir

    def abort(self) -> None:
        """Drop the unfinished shard; finished shards stay for a resume."""
        self._shard.discard()


def save_bundle(stream: Iterable[Tuple[str, Union[Value, Callable[[], Value]]]], out_dir: os.PathLike, *,
                recipe: Any = None, metadata: Optional[Dict[str, str]] = None,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, resume: bool = True, overwrite: bool = False,
                fsync: bool = True) -> str:
    """Write ``(fqn, tensor | GroupQuantizedWeight | callable)`` items as a bundle; return its path.

    Peak memory is the tensor in flight (plus a 16 MiB hashing buffer), not the shard
    or the model. A tensor larger than max_shard_bytes gets a shard of its own.
    """
    writer = BundleWriter(out_dir, recipe=recipe, metadata=metadata, max_shard_bytes=max_shard_bytes,
                          resume=resume, overwrite=overwrite, fsync=fsync)
    try:
        for fqn, value in stream:
            writer.add(fqn, value)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


# -- reading -------------------------------------------------------------------------------------------

def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    buf = bytearray(_COPY_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            digest.update(view[:n])
    return digest.hexdigest()


def read_manifest(path: os.PathLike) -> Dict[str, Any]:
    """Load and validate a bundle's manifest, refusing versions this reader does not know."""
    folder = os.fspath(path)
    mpath = os.path.join(folder, MANIFEST)
    if not os.path.isfile(mpath):
        hint = " (an unfinished run? see the .partial folder)" if os.path.isdir(folder + PARTIAL_SUFFIX) else ""
        raise CheckpointNotFoundError(f"not a finished llmq bundle: no {MANIFEST}{hint}", path=folder)
    try:
        with open(mpath, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"manifest is not valid JSON ({e})"[:300], path=mpath) from None
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        raise CorruptCheckpointError(f'manifest lacks "format": "{BUNDLE_FORMAT}"', path=mpath)
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise BundleVersionError(f"format_version must be an integer, got {version!r}", path=mpath)
    if version > max(READABLE_VERSIONS):
        raise BundleVersionError(
            f"bundle format version {version} is newer than this llmq reads (up to {max(READABLE_VERSIONS)}); "
            "upgrade llmq", path=mpath)
    if version not in READABLE_VERSIONS:
        raise BundleVersionError(f"unknown bundle format version {version}; this llmq reads {READABLE_VERSIONS}",
                                 path=mpath)
    shards, tensors = manifest.get("shards"), manifest.get("tensors")
    if not isinstance(shards, list) or not isinstance(tensors, dict):
        raise CorruptCheckpointError('manifest needs a "shards" list and a "tensors" object', path=mpath)
    names = set()
    for s in shards:
        if (not isinstance(s, dict) or not isinstance(s.get("file"), str) or not isinstance(s.get("bytes"), int)
                or not isinstance(s.get("sha256"), str)):
            raise CorruptCheckpointError(f"bad shard record {s!r}"[:300], path=mpath)
        if os.path.basename(s["file"]) != s["file"] or s["file"] in ("", ".", ".."):
            raise CorruptCheckpointError(f"shard {s['file']!r} must be a plain file name inside the bundle",
                                         path=mpath)
        names.add(s["file"])
    for fqn, rec in tensors.items():
        if (not isinstance(rec, dict) or rec.get("kind") not in ("dense", "group_quantized")
                or rec.get("shard") not in names or not isinstance(rec.get("entries"), dict)
                or not isinstance(rec.get("shape"), list)):
            raise CorruptCheckpointError(f"bad tensor record {rec!r}"[:300], path=mpath, tensor=fqn)
    return manifest


def _to_value(fqn: str, rec: Dict[str, Any], f: SafetensorsFile, *, mpath: str) -> Value:
    def entry(role: str) -> torch.Tensor:
        name = rec["entries"].get(role)
        if name not in f.entries:
            raise TensorMismatchError(f"manifest says {role} is stored as {name!r} in {rec['shard']}, "
                                      "but that shard lacks it", path=mpath, tensor=fqn)
        return f.read(name)

    dtype = _parse_dtype(rec.get("dtype"), path=mpath, tensor=fqn)
    if rec["kind"] == "dense":
        t = entry("data")
        if t.dtype != dtype or list(t.shape) != rec["shape"]:
            raise TensorMismatchError(f"stored as {t.dtype} {list(t.shape)}, manifest says {dtype} {rec['shape']}",
                                      path=mpath, tensor=fqn)
        return t
    try:
        return GroupQuantizedWeight(qdata=entry("qdata"), scale=entry("scale"), bias=entry("bias"),
                                    bits=rec.get("bits"), group_size=rec.get("group_size"),
                                    shape=tuple(rec["shape"]), dtype=dtype)
    except (ValueError, TypeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise TensorMismatchError(f"stored parts disagree with the manifest: {e}", path=mpath, tensor=fqn) from None


def iter_bundle(path: os.PathLike, *, verify: Optional[bool] = None, output: str = "canonical",
                names: Optional[Iterable[str]] = None) -> Iterator[Tuple[str, Any]]:
    """Yield ``(fqn, value)`` from a bundle in the order it was written, one shard open at a time.

    verify: check each shard's SHA-256 before its first tensor is read; None means
        "only if the bundle is at most 4 GiB". Shard sizes are always checked.
    output: "canonical" (torch.Tensor / GroupQuantizedWeight) or "torchao" (quantized
        weights converted by llmq.quant.torchao_interop.to_torchao, for transformers'
        TorchAoConfig / torchao.prototype.safetensors).
    names: only these fqns (all of them must exist).
    """
    if output not in ("canonical", "torchao"):
        raise ValueError(f"output must be 'canonical' or 'torchao', got {output!r}")
    to_torchao = None
    if output == "torchao":
        from llmq.quant.torchao_interop import to_torchao  # lazy: torchao is optional here
    folder = os.fspath(path)
    manifest = read_manifest(folder)
    mpath = os.path.join(folder, MANIFEST)
    shards = {s["file"]: s for s in manifest["shards"]}
    if verify is None:
        verify = sum(s["bytes"] for s in shards.values()) <= VERIFY_AUTO_LIMIT
    wanted = None
    if names is not None:
        wanted = set(names)
        unknown = sorted(wanted - set(manifest["tensors"]))
        if unknown:
            raise CheckpointNotFoundError(f"bundle has no tensors {unknown[:10]}", path=folder, tensor=unknown[0])
    current: Optional[SafetensorsFile] = None
    try:
        for fqn, rec in manifest["tensors"].items():
            if wanted is not None and fqn not in wanted:
                continue
            if current is None or os.path.basename(current.path) != rec["shard"]:
                if current is not None:
                    current.close()
                current = None
                current = _open_shard(folder, shards[rec["shard"]], verify)
            value = _to_value(fqn, rec, current, mpath=mpath)
            if to_torchao is not None and isinstance(value, GroupQuantizedWeight):
                try:
                    value = to_torchao(value)
                except ValueError as e:
                    raise UnsupportedCheckpointError(f"has no exact torchao form: {e}", path=folder,
                                                     tensor=fqn) from None
            yield fqn, value
    finally:
        if current is not None:
            current.close()


def _open_shard(folder: str, shard: Dict[str, Any], verify: bool) -> SafetensorsFile:
    full = os.path.join(folder, shard["file"])
    if not os.path.isfile(full):
        raise CheckpointNotFoundError("shard listed in the manifest is missing", path=full)
    size = os.path.getsize(full)
    if size != shard["bytes"]:
        raise ChecksumError(f"shard is {size} bytes, manifest says {shard['bytes']}", path=full)
    if verify:
        got = _sha256(full)
        if got != shard["sha256"]:
            raise ChecksumError(f"SHA-256 {got} differs from the manifest's {shard['sha256']}", path=full)
    return SafetensorsFile(full)


def load_bundle(path: os.PathLike, *, verify: Optional[bool] = None, output: str = "canonical",
                names: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """Every tensor of a bundle as a dict (see iter_bundle for the options)."""
    return dict(iter_bundle(path, verify=verify, output=output, names=names))
