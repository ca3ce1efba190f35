"""Reading a bundle back (format: docs/checkpoint.md): its manifest, its tensors one at a time
(`iter_bundle`) or all at once (`load_bundle`), checked against the manifest's shapes, dtypes
and per-shard checksums; every version this project has written (`READABLE_VERSIONS`) reads.
The writer is llmq.checkpoint.bundle."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterable, Iterator, Optional, Tuple

import torch

from llmq.checkpoint.bundle import (
    BUNDLE_FORMAT,
    CHECKSUM_KEY,
    MANIFEST,
    PARTIAL_SUFFIX,
    READABLE_VERSIONS,
    VERIFY_AUTO_LIMIT,
    Value,
    _parse_dtype,
    _record_format,
    file_digest,
)
from llmq.checkpoint.errors import (
    BundleVersionError,
    CheckpointError,
    CheckpointNotFoundError,
    ChecksumError,
    CorruptCheckpointError,
    TensorMismatchError,
    UnsupportedCheckpointError,
)
from llmq.checkpoint.safetensors_io import SafetensorsFile
from llmq.quant.formats import format_of


def read_manifest(path: str | os.PathLike) -> Dict[str, Any]:
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
    checksum = CHECKSUM_KEY[version]
    names = set()
    for s in shards:
        if (not isinstance(s, dict) or not isinstance(s.get("file"), str) or not isinstance(s.get("bytes"), int)
                or not isinstance(s.get(checksum), str)):
            raise CorruptCheckpointError(f"bad shard record {s!r}"[:300], path=mpath)
        if os.path.basename(s["file"]) != s["file"] or s["file"] in ("", ".", ".."):
            raise CorruptCheckpointError(f"shard {s['file']!r} must be a plain file name inside the bundle",
                                         path=mpath)
        names.add(s["file"])
    files = manifest.get("files", [])
    if not isinstance(files, list):
        raise CorruptCheckpointError('manifest "files" must be a list', path=mpath)
    for s in files:
        if (not isinstance(s, dict) or not isinstance(s.get("file"), str) or not isinstance(s.get("bytes"), int)
                or not isinstance(s.get(checksum), str) or os.path.basename(s["file"]) != s["file"]
                or s["file"] in ("", ".", "..") or s["file"] in names):
            raise CorruptCheckpointError(f"bad file record {s!r}"[:300], path=mpath)
    for fqn, rec in tensors.items():
        if (not isinstance(rec, dict) or (rec.get("kind") != "dense" and _record_format(rec) is None)
                or (rec.get("kind") == "quantized" and version < 3)
                or (rec.get("kind") == "quantized" and not isinstance(rec.get("params"), dict))
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
    fmt = _record_format(rec)
    if rec["kind"] == "quantized":
        name, params = rec["format"], rec["params"]
    else:  # a family's flat legacy record (version 1/2 integer weights): its params are top-level fields
        name, params = fmt.names[0], rec
    try:
        stored = {role: entry(role) for role in rec["entries"]}
        return fmt.rebuild(name, params, tuple(rec["shape"]), dtype, stored)
    except (ValueError, TypeError, KeyError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise TensorMismatchError(f"stored parts disagree with the manifest: {e}", path=mpath, tensor=fqn) from None


def iter_bundle(path: str | os.PathLike, *, verify: Optional[bool] = None, output: str = "canonical",
                names: Optional[Iterable[str]] = None) -> Iterator[Tuple[str, Any]]:
    """Yield ``(fqn, value)`` from a bundle in the order it was written, one shard open at a time.

    verify: check each shard's checksum (BLAKE3; SHA-256 in format 1) before its first tensor is read; None means
        "only if the bundle is at most 4 GiB". Shard sizes are always checked.
    output: "canonical" (torch.Tensor / GroupQuantizedWeight) or "torchao" (quantized
        weights converted by their format's to_torchao (the integer one: llmq.quant.torchao_interop), for transformers'
        TorchAoConfig / torchao.prototype.safetensors).
    names: only these fqns (all of them must exist).
    """
    if output not in ("canonical", "torchao"):
        raise ValueError(f"output must be 'canonical' or 'torchao', got {output!r}")
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
    for record in manifest.get("files", []):  # config and tokenizer files: size always, hash if verify
        _check_file(folder, record, CHECKSUM_KEY[manifest["format_version"]] if verify else None)
    current: Optional[SafetensorsFile] = None
    try:
        for fqn, rec in manifest["tensors"].items():
            if wanted is not None and fqn not in wanted:
                continue
            if current is None or os.path.basename(current.path) != rec["shard"]:
                if current is not None:
                    current.close()
                current = None
                current = _open_shard(folder, shards[rec["shard"]],
                                      CHECKSUM_KEY[manifest["format_version"]] if verify else None)
            value = _to_value(fqn, rec, current, mpath=mpath)
            fmt = format_of(value) if output == "torchao" else None
            if fmt is not None:
                try:
                    value = fmt.to_torchao(value)
                except (ValueError, NotImplementedError) as e:
                    raise UnsupportedCheckpointError(f"has no exact torchao form: {e}", path=folder,
                                                     tensor=fqn) from None
            yield fqn, value
    finally:
        if current is not None:
            current.close()


def _open_shard(folder: str, shard: Dict[str, Any], checksum: Optional[str]) -> SafetensorsFile:
    """Open one shard after checking its size and, if ``checksum`` names the algorithm, its digest."""
    return SafetensorsFile(_check_file(folder, shard, checksum))


def _check_file(folder: str, shard: Dict[str, Any], checksum: Optional[str]) -> str:
    """A manifest record's file path, after checking its size and, if ``checksum`` names the algorithm, its digest."""
    full = os.path.join(folder, shard["file"])
    if not os.path.isfile(full):
        raise CheckpointNotFoundError("file listed in the manifest is missing", path=full)
    size = os.path.getsize(full)
    if size != shard["bytes"]:
        raise ChecksumError(f"is {size} bytes, manifest says {shard['bytes']}", path=full)
    if checksum:
        got = file_digest(full, checksum)
        if got != shard[checksum]:
            raise ChecksumError(f"{checksum} checksum {got} differs from the manifest's {shard[checksum]}",
                                path=full)
    return full


def load_bundle(path: str | os.PathLike, *, verify: Optional[bool] = None, output: str = "canonical",
                names: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """Every tensor of a bundle as a dict (see iter_bundle for the options)."""
    return dict(iter_bundle(path, verify=verify, output=output, names=names))
