"""Turn a user's path into a validated list of tensors to read, before reading any of them.

A *source* knows every tensor's name up front (all headers are parsed first, so a
corrupt last shard fails in a second, not after an hour) and reads one tensor on
demand. Supported inputs:

* a ``.safetensors`` file;
* a Hugging Face folder: ``model.safetensors.index.json`` + shards, or ``model.safetensors``
  (``pytorch_model.bin[.index.json]`` as a last resort, see below);
* a ``.gguf`` file (quantized tensors arrive in the canonical form, see gguf_import);
* an llmq bundle folder (quantized weights arrive whole, in canonical form);
* ``.bin`` / ``.pt`` / ``.pth``: read only through ``torch.load(weights_only=True)``,
  whose restricted unpickler builds tensors and containers and refuses everything
  else; the legacy (pre-zip) format is refused outright.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from llmq.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    TensorMismatchError,
    UnsupportedCheckpointError,
)
from llmq.checkpoint.gguf_import import GGUFFile
from llmq.checkpoint.safetensors_io import DTYPE_NAMES, ReadBuffers, SafetensorsFile, has_lone_surrogate
from llmq.checkpoint.side_files import allowed_root
from llmq.quant.formats import GroupQuantizedWeight

Value = Union[torch.Tensor, GroupQuantizedWeight]

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_SINGLE = "pytorch_model.bin"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
BUNDLE_MANIFEST = "llmq_manifest.json"  # bundle.MANIFEST
MAX_INDEX_BYTES = 64 * 1024 * 1024


class Source:
    """names() in the order they will be read; read(name) materialises one tensor."""

    path: str

    def names(self) -> List[str]:
        raise NotImplementedError

    def read(self, name: str, *, dtype: Optional[torch.dtype] = None) -> Value:
        raise NotImplementedError

    def shape(self, name: str) -> Optional[Tuple[int, ...]]:
        """The stored shape of `name` from the header alone (None where that needs a read)."""
        return None

    def nbytes(self, name: str) -> Optional[int]:
        """The stored bytes of `name` from the header alone (None where that needs a read)."""
        return None

    def stored_type(self, name: str) -> Optional[str]:
        """The type `name` is stored as, by the file format's name for it (safetensors "I32", GGUF
        "Q4_K"), from the header alone (None where that needs a read)."""
        return None

    def row_reader(self, name: str) -> Optional[Tuple[torch.dtype, Callable[[int, int], torch.Tensor]]]:
        """(stored dtype, read(r0, r1) -> rows r0:r1 along the first dimension) for a plain tensor
        this source can read a block of rows of at a time, or None (it is read whole)."""
        return None

    def close(self) -> None:
        pass


class SafetensorsSource(Source):
    def __init__(self, path: str, files: List[SafetensorsFile], owner: Dict[str, SafetensorsFile]):
        self.path, self._files, self._owner = path, files, owner
        self._buffers = ReadBuffers()  # one set for all shards: they are read one after another

    def names(self) -> List[str]:
        # Shard by shard, each in data order: one sequential pass over the disk.
        return list(self._owner)

    def read(self, name: str, *, dtype=None) -> torch.Tensor:
        return self._owner[name].read(name, buffers=self._buffers)

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._owner[name].entries[name].shape)

    def nbytes(self, name: str) -> int:
        return self._owner[name].entries[name].nbytes

    def stored_type(self, name: str) -> str:
        return DTYPE_NAMES[self._owner[name].entries[name].dtype]

    def row_reader(self, name: str):
        f = self._owner[name]
        entry = f.entries[name]
        if not entry.shape or not entry.shape[0]:
            return None
        return entry.dtype, lambda r0, r1: f.read_rows(name, r0, r1, buffers=self._buffers)

    def close(self) -> None:
        self._buffers.clear()
        for f in self._files:
            f.close()


class GGUFSource(Source):
    def __init__(self, path: str):
        self.path = path
        self._file = GGUFFile(path)
        self._infos = {t.name: t for t in sorted(self._file.tensors, key=lambda t: t.start)}

    @property
    def metadata(self):
        return self._file.metadata

    def names(self) -> List[str]:
        return list(self._infos)

    def read(self, name: str, *, dtype=None) -> Value:
        return self._file.read(self._infos[name], dtype=dtype or torch.float32)

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._infos[name].shape)

    def nbytes(self, name: str) -> int:
        return self._infos[name].nbytes

    def stored_type(self, name: str) -> str:
        return self._infos[name].type_name

    def close(self) -> None:
        self._file.close()


class TorchPickleSource(Source):
    """Zip-format torch checkpoints, loaded with weights_only=True and mmap=True (never a full unpickle)."""

    def __init__(self, path: str, files: List[str]):
        self.path = path
        self._owner: Dict[str, str] = {}
        self._files = files
        self._loaded: Tuple[Optional[str], Dict[str, torch.Tensor]] = (None, {})
        for f in files:
            for name in self._load(f):
                if name in self._owner:
                    raise CorruptCheckpointError(f"tensor also appears in {self._owner[name]}", path=f, tensor=name)
                self._owner[name] = f
        self._loaded = (None, {})

    def _load(self, f: str) -> Dict[str, torch.Tensor]:
        if self._loaded[0] == f:
            return self._loaded[1]
        with open(f, "rb") as fh:
            magic = fh.read(4)
        if magic != b"PK\x03\x04":
            raise UnsupportedCheckpointError(
                "not a zip-format torch checkpoint; legacy pickles are refused (convert it to safetensors)", path=f)
        try:
            sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # whatever an untrusted file makes torch.load raise is a refusal
            raise UnsupportedCheckpointError(
                f"torch.load(weights_only=True) refused it ({type(e).__name__}: {e})"[:500], path=f) from None
        if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
            sd = sd["state_dict"]
        if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                               for k, v in sd.items()):
            raise UnsupportedCheckpointError("expected a dict of name -> tensor (a state dict)", path=f)
        self._loaded = (f, sd)
        return sd

    def names(self) -> List[str]:
        return list(self._owner)

    def read(self, name: str, *, dtype=None) -> torch.Tensor:
        return self._load(self._owner[name])[name].clone()  # detach from the mmap


class BundleSource(Source):
    """An llmq bundle read through iter_checkpoint: quantized weights come back whole, in
    canonical form, instead of as their stored .qdata/.scale/.bias entries."""

    def __init__(self, path: str):
        from llmq.checkpoint import bundle_reader as bundle  # it does not import this module: no cycle

        self._bundle = bundle
        self.path = path
        self._manifest = bundle.read_manifest(path)
        self._shards = {s["file"]: s for s in self._manifest["shards"]}
        verify = sum(s["bytes"] for s in self._shards.values()) <= bundle.VERIFY_AUTO_LIMIT
        self._checksum = bundle.CHECKSUM_KEY[self._manifest["format_version"]] if verify else None
        self._open: Optional[SafetensorsFile] = None

    def names(self) -> List[str]:
        return list(self._manifest["tensors"])

    def read(self, name: str, *, dtype=None) -> Value:
        rec = self._manifest["tensors"][name]
        if self._open is None or os.path.basename(self._open.path) != rec["shard"]:
            self.close()
            self._open = self._bundle._open_shard(self.path, self._shards[rec["shard"]], self._checksum)
        return self._bundle._to_value(name, rec, self._open,
                                      mpath=os.path.join(self.path, self._bundle.MANIFEST))

    def close(self) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None


def _safe_member(folder: str, rel: object, *, index: str, tensor: Optional[str]) -> str:
    """Resolve a shard name from an index, refusing anything that escapes the folder."""
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise CorruptCheckpointError(f"shard name must be a non-empty string, got {rel!r}", path=index, tensor=tensor)
    if os.path.isabs(rel) or ".." in rel.replace("\\", "/").split("/"):
        raise CorruptCheckpointError(f"shard {rel!r} points outside the checkpoint folder", path=index, tensor=tensor)
    root = allowed_root(folder)
    full = os.path.realpath(os.path.join(folder, rel))
    if os.path.commonpath([root, full]) != root:
        where = "the checkpoint folder" if root == os.path.realpath(folder) else f"the hub cache folder {root}"
        raise CorruptCheckpointError(f"shard {rel!r} resolves outside {where} (symlink to {full})",
                                     path=index, tensor=tensor)
    if not os.path.isfile(full):
        raise CheckpointNotFoundError(f"shard {rel!r} named by the index does not exist", path=index, tensor=tensor)
    return full


def _read_index(index: str) -> Dict[str, str]:
    try:
        size = os.path.getsize(index)
        if size > MAX_INDEX_BYTES:
            raise CorruptCheckpointError(f"index is {size} bytes; refusing more than {MAX_INDEX_BYTES}", path=index)
        with open(index, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CorruptCheckpointError(f"index is not valid JSON ({e})"[:300], path=index) from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError('index must be a JSON object with a "weight_map" object', path=index)
    for k, v in weight_map.items():
        if not isinstance(k, str):
            raise CorruptCheckpointError(f"weight_map key {k!r} is not a string", path=index)
        for what, s in (("tensor name", k), ("shard name", v)):
            if isinstance(s, str) and has_lone_surrogate(s):
                raise CorruptCheckpointError(f"weight_map {what} {s!r} holds a lone UTF-16 surrogate escape "
                                             "(not valid Unicode)", path=index)
    return weight_map


def _safetensors_folder(folder: str, index: str) -> SafetensorsSource:
    weight_map = _read_index(index)
    by_shard: Dict[str, List[str]] = {}
    for name, rel in weight_map.items():
        full = _safe_member(folder, rel, index=index, tensor=name)
        by_shard.setdefault(full, []).append(name)
    files: List[SafetensorsFile] = []
    owner: Dict[str, SafetensorsFile] = {}
    try:
        for full in sorted(by_shard):
            f = SafetensorsFile(full)
            files.append(f)
            wanted = set(by_shard[full])
            missing = sorted(wanted - set(f.entries))
            if missing:
                raise TensorMismatchError(
                    f"the index maps {len(missing)} tensor(s) to {os.path.basename(full)} but it lacks them: "
                    f"{missing[:5]}", path=index, tensor=missing[0])
            for name in f.entries:  # data order
                if name in wanted:
                    owner[name] = f
    except BaseException:
        for f in files:
            f.close()
        raise
    return SafetensorsSource(folder, files, owner)


def _single_safetensors(path: str) -> SafetensorsSource:
    f = SafetensorsFile(path)
    return SafetensorsSource(path, [f], {name: f for name in f.entries})


def open_source(path: str | os.PathLike) -> Source:
    """Classify and validate the input; every problem becomes a CheckpointError."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointNotFoundError("no such file or folder", path=path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, BUNDLE_MANIFEST)):
            return BundleSource(path)
        index = os.path.join(path, SAFETENSORS_INDEX)
        if os.path.isfile(index):
            return _safetensors_folder(path, index)
        if os.path.isfile(os.path.join(path, SAFETENSORS_SINGLE)):
            return _single_safetensors(os.path.join(path, SAFETENSORS_SINGLE))
        index = os.path.join(path, TORCH_INDEX)
        if os.path.isfile(index):
            shards = sorted({_safe_member(path, rel, index=index, tensor=t) for t, rel in _read_index(index).items()})
            return TorchPickleSource(path, shards)
        if os.path.isfile(os.path.join(path, TORCH_SINGLE)):
            return TorchPickleSource(path, [os.path.join(path, TORCH_SINGLE)])
        found = sorted(os.listdir(path))[:10]
        raise CheckpointNotFoundError(
            f"no {SAFETENSORS_INDEX}, {SAFETENSORS_SINGLE} or {TORCH_SINGLE} in this folder (found {found})",
            path=path)
    lower = path.lower()
    if lower.endswith(".gguf"):
        return GGUFSource(path)
    if lower.endswith(".safetensors"):
        return _single_safetensors(path)
    if lower.endswith(PICKLE_SUFFIXES):
        return TorchPickleSource(path, [path])
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return GGUFSource(path)
    raise UnsupportedCheckpointError(
        "unknown checkpoint type; expected .safetensors, .gguf, a Hugging Face folder, or .bin/.pt", path=path)

