"""Sharded safetensors output for the HF writers.

Tensors are written as they arrive, one at a time, into the open shard's file
(llmq.checkpoint.shard_file.StreamingShardFile: data after a reserved header gap, header
last), so memory holds only the tensor in flight whatever the shard size. A shard is closed
when the next tensor would pass `max_shard_bytes` (or break natural alignment, or outgrow the
header gap). Shards get their final Hugging Face names (model-0000i-of-0000N.safetensors, or
model.safetensors when there is one) and an index.json when the writer closes. A journal
(progress.json) lists the completed shards, so an interrupted export can resume:
`ShardWriter.resume` reloads it and `has(name)` tells the caller which tensors need not be
produced again.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch

from llmq.checkpoint.fileio import write_file_atomic
from llmq.checkpoint.shard_file import ShardRotation, StreamingShardFile, block_writes, hf_shard_names


class ShardWriter:
    """Collects (name, tensor) pairs into size-limited safetensors shards in `folder`."""

    def __init__(self, folder: str, max_shard_bytes: int = 5 << 30):
        self.rotation = ShardRotation(max_shard_bytes)
        self.folder = folder
        self._open: Optional[StreamingShardFile] = None
        self._shards: List[Dict[str, int]] = []  # per shard: name -> nbytes
        self._seen: Set[str] = set()
        self._done: Set[str] = set()  # names in shards completed by an earlier, interrupted run
        self.total_bytes = 0
        self.skipped = 0

    JOURNAL = "progress.json"

    @classmethod
    def resume(cls, folder: str, max_shard_bytes: int) -> "ShardWriter":
        """A writer that continues the shards journalled in `folder` (fresh if there is none)."""
        writer = cls(folder, max_shard_bytes)
        path = os.path.join(folder, cls.JOURNAL)
        if not os.path.exists(path):
            return writer
        with open(path) as f:
            journal = json.load(f)
        if journal.get("max_shard_bytes") != writer.rotation.max_shard_bytes:
            raise ValueError(f"{folder}: the interrupted export used max_shard_bytes={journal.get('max_shard_bytes')}, not {max_shard_bytes}"
                             "; resume with the same settings or start over")
        for i, shard in enumerate(journal["shards"]):
            if not os.path.exists(writer._shard_path(i)):
                raise ValueError(f"{folder}: journal lists shard {i} but its file is missing; start over")
            writer._shards.append(dict(shard))
            writer._done.update(shard)
            writer.total_bytes += sum(shard.values())
        return writer

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
        shard.close()
        os.replace(shard.path, self._shard_path(index))  # a shard is either complete or absent
        self._shards.append(dict(shard.sizes))
        write_file_atomic(os.path.join(self.folder, self.JOURNAL),
                          json.dumps({"max_shard_bytes": self.rotation.max_shard_bytes, "shards": self._shards}).encode(),
                          fsync=False)

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
        for i, final in enumerate(names):
            os.replace(self._shard_path(i), os.path.join(self.folder, final))
        os.remove(os.path.join(self.folder, self.JOURNAL))
        if count > 1:
            weight_map = {t: names[i] for i, shard in enumerate(self._shards) for t in sorted(shard)}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            write_file_atomic(os.path.join(self.folder, "model.safetensors.index.json"),
                              json.dumps(index, indent=2).encode(), fsync=False)
        return names
