"""Sharded safetensors output for the HF writers.

Tensors are written as they arrive, one at a time, into the open shard's file
(llmq.checkpoint.shard_file.StreamingShardFile: data after a reserved header gap, header
last), so memory holds only the tensor in flight whatever the shard size. A shard is closed
when the next tensor would pass `max_shard_bytes` (or break natural alignment, or outgrow the
header gap). Shards get their final Hugging Face names (model-0000i-of-0000N.safetensors, or
model.safetensors when there is one) and an index.json when the writer closes; the final names
are journalled before the first rename, so a run killed while renaming resumes too. A journal
(the HF writer's WorkFolder journal; progress.json when used alone) lists the completed shards
with their sizes, so an interrupted export can resume: `ShardWriter.resume` reloads it and
`has(name)` tells the caller which tensors need not be produced again.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch

from llmq.checkpoint.errors import ResumeMismatchError
from llmq.checkpoint.fileio import write_error, write_file_atomic
from llmq.checkpoint.shard_file import ShardRotation, StreamingShardFile, block_writes, hf_shard_names


class ShardWriter:
    """Collects (name, tensor) pairs into size-limited safetensors shards in `folder`.

    record(journal dict): where progress goes (the HF writer: its WorkFolder's journal); by default
    `progress.json` in the folder. fsync: each shard is fsynced before it is renamed into place."""

    JOURNAL = "progress.json"

    def __init__(self, folder: str, max_shard_bytes: int = 5 << 30, *,
                 record: Optional[Callable[[Dict[str, Any]], None]] = None, fsync: bool = False):
        self.rotation = ShardRotation(max_shard_bytes)
        self.folder = folder
        self.fsync = fsync
        self._record = record
        self._open: Optional[StreamingShardFile] = None
        self._shards: List[Dict[str, Any]] = []  # per shard: {"tensors": {name: nbytes}, "bytes": file size}
        self._seen: Set[str] = set()
        self._done: Set[str] = set()  # names in shards completed by an earlier, interrupted run
        self.total_bytes = 0
        self.skipped = 0

    @classmethod
    def resume(cls, folder: str, max_shard_bytes: int, journal: Optional[Dict[str, Any]] = None, *,
               record: Optional[Callable[[Dict[str, Any]], None]] = None, fsync: bool = False) -> "ShardWriter":
        """A writer that continues the shards `journal` lists (by default the folder's progress.json;
        fresh if there is none). Shards are kept up to the first one that is missing or of another
        size (the rest are redone); shards already given their final names by a run killed while
        closing are given back their working names. A different shard size is refused."""
        writer = cls(folder, max_shard_bytes, record=record, fsync=fsync)
        if journal is None:
            path = os.path.join(folder, cls.JOURNAL)
            if not os.path.exists(path):
                return writer
            with open(path) as f:
                journal = json.load(f)
        if journal.get("max_shard_bytes") != writer.rotation.max_shard_bytes:
            raise ResumeMismatchError(
                f"the interrupted export used max_shard_bytes={journal.get('max_shard_bytes')}, not {max_shard_bytes}; "
                "resume with the same settings or start over", path=folder)
        final = journal.get("final") or []
        for i, shard in enumerate(journal.get("shards") or []):
            tmp = writer._shard_path(i)
            if not os.path.exists(tmp) and i < len(final) and os.path.exists(os.path.join(folder, final[i])):
                os.replace(os.path.join(folder, final[i]), tmp)  # named by a close that was killed
            try:
                intact = os.path.getsize(tmp) == shard["bytes"] and isinstance(shard["tensors"], dict)
            except (OSError, KeyError, TypeError):
                intact = False
            if not intact:
                break  # this shard and the later ones are redone
            writer._shards.append({"tensors": dict(shard["tensors"]), "bytes": shard["bytes"]})
            writer._done.update(shard["tensors"])
            writer.total_bytes += sum(shard["tensors"].values())
        return writer

    def kept_files(self) -> List[str]:
        """The file names of the shards kept from an interrupted run (everything else in the folder
        may go)."""
        return [os.path.basename(self._shard_path(i)) for i in range(len(self._shards))]

    def record_progress(self, final: Optional[List[str]] = None) -> None:
        data: Dict[str, Any] = {"max_shard_bytes": self.rotation.max_shard_bytes, "shards": self._shards}
        if final is not None:
            data["final"] = final
        if self._record is not None:
            self._record(data)
        else:
            write_file_atomic(os.path.join(self.folder, self.JOURNAL), json.dumps(data).encode(), fsync=self.fsync)

    def has(self, name: str) -> bool:
        """True if `name` is already in a completed shard (of an interrupted run)."""
        return name in self._done

    def _shard_path(self, index: int) -> str:
        return os.path.join(self.folder, f"shard-{index:05d}.tmp.safetensors")

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._done:
            self._done.discard(name)
            self._seen.add(name)
            self.skipped += 1
            return
        if name in self._seen:
            raise ValueError(f"tensor {name!r} written twice")
        self._seen.add(name)
        if self.rotation.must_rotate(self._open, name, tensor):
            self._flush()
        if self._open is None:
            self._open = StreamingShardFile(self._shard_path(len(self._shards)) + ".part", self.rotation.reserve)
        self._open.add(name, tensor)
        self.total_bytes += tensor.numel() * tensor.element_size()

    def add_row_blocks(self, placed: List[Tuple[str, torch.Tensor]], rows: int,
                       row_parts: Callable[[], Iterator[Tuple[int, int, Dict[str, torch.Tensor]]]]) -> bool:
        """Write several tensors whose bytes arrive together block of rows by block: `placed` are
        (name, shard_file.placeholder) in the order `add` would take them, `row_parts()` yields
        (r0, r1, {name: that block's tensor}). Returns False, having written nothing, where the
        result would not be what `add` one by one gives: a name written before (or by an
        interrupted run), or a shard boundary falling between them; the caller then adds them
        whole."""
        if any(name in self._done or name in self._seen for name, _ in placed):
            return False
        if self.rotation.must_rotate(self._open, *placed[0]):
            self._flush()
        if self._open is None:
            self._open = StreamingShardFile(self._shard_path(len(self._shards)) + ".part", self.rotation.reserve)
        shard = self._open
        if not shard.fits_each(placed, self.rotation.max_shard_bytes):
            return False
        where = {}
        for name, t in placed:
            [(_, offset, _)] = shard.place([(name, t)])
            where[name] = (name, offset, shard.sizes[name])
            self._seen.add(name)
            self.total_bytes += shard.sizes[name]
        for r0, r1, parts in row_parts():
            shard.write(block_writes(where, rows, r0, r1, parts), placed[0][0])
            del parts
        return True

    def _flush(self) -> None:
        shard, self._open = self._open, None
        if shard is None or not len(shard):
            return
        index = len(self._shards)
        try:
            shard.close(fsync=self.fsync)
        except BaseException:
            shard.discard()  # no unusable partial shard is left (a full disk, say)
            raise
        final = self._shard_path(index)
        try:
            os.replace(shard.path, final)  # a shard is either complete or absent
        except OSError as e:
            raise write_error(e, shard.path, "renaming the shard") from None
        self._shards.append({"tensors": dict(shard.sizes), "bytes": shard.reserve + shard.nbytes})
        self.record_progress()

    def abort(self) -> None:
        """Drop the open (unfinished) shard file; finished shards stay for a resume."""
        shard, self._open = self._open, None
        if shard is not None:
            shard.discard()

    def close(self) -> List[str]:
        """Write the last shard, give shards their final names, write the index. Returns the
        shard file names."""
        if self._done:
            raise ValueError(f"{len(self._done)} tensor(s) of the interrupted export were not produced again (e.g. {sorted(self._done)[0]!r})"
                             "; the input or recipe changed - start over")
        self._flush()
        count = len(self._shards)
        if count == 0:
            raise ValueError("no tensors were written")
        names = hf_shard_names(count)
        self.record_progress(final=names)  # a run killed while renaming resumes from either name
        for i, final in enumerate(names):
            try:
                os.replace(self._shard_path(i), os.path.join(self.folder, final))
            except OSError as e:
                raise write_error(e, self._shard_path(i), "renaming the shard") from None
        if self._record is None:
            os.remove(os.path.join(self.folder, self.JOURNAL))
        if count > 1:
            weight_map = {t: names[i] for i, shard in enumerate(self._shards) for t in sorted(shard["tensors"])}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            write_file_atomic(os.path.join(self.folder, "model.safetensors.index.json"),
                              json.dumps(index, indent=2).encode(), fsync=self.fsync)
        return names
