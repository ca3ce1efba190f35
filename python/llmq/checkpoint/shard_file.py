"""Safetensors shards written tensor by tensor. `ShardLayout` decides where every tensor goes
and what the header says, for every llmq shard writer (the bundle, which writes on background
threads; the Hugging Face export and the MLX folder, through `StreamingShardFile`).

Each tensor's bytes go to the file when it is added, after a gap reserved for the header
(`header_reserve`), so memory holds only the tensor in flight
whatever the shard size, and every byte is written once. `close` writes the header into the
gap, padded with spaces (which JSON, and every safetensors reader, ignores). The result is a
valid safetensors file: keys in data order, data back to back from offset 0. It is not
byte-identical to `safetensors.torch.save_file`, which orders tensors by dtype and name and
therefore needs the whole shard in memory first.

`accepts` (`fits` for one tensor) says whether a tensor can join the file: the size limit, natural alignment (the data
may not contain holes, so a tensor whose offset would not be a multiple of its element size
starts a new file) and room in the header gap.

A tensor that arrives in blocks of rows (llmq.quant.row_blocks: `RowBlocks`, `QuantizedRowBlocks`)
is placed from its shape and dtype alone (`placeholder`), and its bytes are written block by
block at the offsets `block_writes` computes, so only one block is in memory.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch

from llmq.checkpoint.fileio import remove_partial, write_all, write_error
from llmq.checkpoint.ordered_worker import OrderedWorker
from llmq.checkpoint.safetensors_io import encode_header, entry_fragment_size, header_json_size

__all__ = ["ShardLayout", "ShardRotation", "StreamingShardFile", "block_writes", "header_reserve", "hf_shard_names",
           "placeholder", "tensor_bytes"]


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


class ShardRotation:
    """The one rule every llmq shard writer (the bundle, the HF export, the MLX folder) starts a
    new shard by: a positive size limit, the header gap it implies (`reserve`), and
    `must_rotate`: the open shard closes when the next item would not fit it."""

    def __init__(self, max_shard_bytes: int):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.max_shard_bytes = int(max_shard_bytes)
        self.reserve = header_reserve(self.max_shard_bytes)

    def must_rotate(self, shard: Optional["ShardLayout"], *item) -> bool:
        """Whether the open `shard` (None: no shard open yet) cannot take `item` (the arguments
        of its `fits` before the size limit) within the limit."""
        return shard is not None and not shard.fits(*item, self.max_shard_bytes)


def hf_shard_names(count: int) -> List[str]:
    """Hugging Face's file names for `count` shards: model.safetensors when there is one, else
    model-0000i-of-0000N.safetensors."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes (row-major, on the CPU) without a copy where it already is so."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def placeholder(dtype: torch.dtype, shape) -> torch.Tensor:
    """A tensor of this dtype and shape without data (device "meta"), to place in a layout
    before its bytes exist; `ShardLayout.place` returns None for its bytes."""
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def block_writes(where: Dict[str, Tuple[str, int, int]], rows: int, r0: int, r1: int,
                 parts: Dict[str, torch.Tensor]) -> List[Tuple[str, int, memoryview]]:
    """(name, file offset, bytes) for one block of rows r0:r1 of an item of `rows` rows.

    where: role -> (stored name, file offset, total bytes) of each placed part. A part whose
    block holds its share of the rows ((r1 - r0) / rows of its bytes) goes at that share's
    offset; one whose block holds all of it (a per-tensor scale) is written with the first
    block only."""
    writes = []
    for role, t in parts.items():
        name, offset, total = where[role]
        mv = tensor_bytes(t)
        if len(mv) * rows == total * (r1 - r0) and (total * r0) % rows == 0:
            writes.append((name, offset + total * r0 // rows, mv))
        elif len(mv) == total:
            if r0 == 0:
                writes.append((name, offset, mv))
        else:
            raise ValueError(f"tensor {name!r}: rows {r0}:{r1} of {rows} gave {len(mv)} bytes, neither their share "
                             f"of its {total} bytes nor all of them")
    return writes


class ShardLayout:
    """Where each tensor goes in one safetensors file whose data follows a `reserve`-byte
    header gap: data back to back in placement order, and the header that describes it.
    Every llmq writer of safetensors shards (the bundle, the HF export, the MLX folder) lays
    its files out with this class; they differ only in how the bytes reach the disk."""

    def __init__(self, reserve: int, metadata: Optional[Dict[str, str]] = None):
        self.reserve = reserve
        self.metadata = dict(metadata or {"format": "pt"})
        self.nbytes = 0  # data bytes placed
        self.sizes: Dict[str, int] = {}  # name -> nbytes, in data order
        self._entries: List[Tuple[str, torch.dtype, Tuple[int, ...], int]] = []
        self._fragments: List[int] = []

    def __len__(self) -> int:
        return len(self._entries)

    def accepts(self, parts: List[Tuple[str, torch.Tensor]], max_bytes: int) -> bool:
        """Whether the parts, placed in this order, can join without passing max_bytes of data,
        breaking natural alignment (safetensors data may not contain holes) or outgrowing the
        header gap. An empty shard takes anything: one item too large for the header is
        reported by `header_overflows` after `place`."""
        if not self._entries:
            return True
        if self.nbytes % parts[0][1].element_size():
            return False
        offset, fragments = self.nbytes, list(self._fragments)
        for name, t in parts:
            n = t.numel() * t.element_size()
            fragments.append(entry_fragment_size(name, t.dtype, tuple(t.shape), offset, offset + n))
            offset += n
        return offset <= max_bytes and header_json_size(self.metadata, fragments) <= self.reserve - 8

    def place(self, parts: List[Tuple[str, torch.Tensor]]) -> List[Tuple[str, int, Optional[memoryview]]]:
        """Reserve room for the parts, in order; return (name, file offset, bytes) for each (bytes
        None for a `placeholder`)."""
        writes = []
        for name, t in parts:
            if name in self.sizes:
                raise ValueError(f"tensor {name!r} written twice")
            mv = None if t.device.type == "meta" else tensor_bytes(t)
            n = t.numel() * t.element_size()
            self._fragments.append(entry_fragment_size(name, t.dtype, tuple(t.shape), self.nbytes, self.nbytes + n))
            self._entries.append((name, t.dtype, tuple(t.shape), n))
            writes.append((name, self.reserve + self.nbytes, mv))
            self.sizes[name] = n
            self.nbytes += n
        return writes

    def header_overflows(self) -> bool:
        return header_json_size(self.metadata, self._fragments) > self.reserve - 8

    def header(self) -> bytes:
        """The header, padded with spaces to fill the gap exactly."""
        return encode_header(self._entries, self.metadata, pad_to=self.reserve - 8)


def _as_placed(t) -> torch.Tensor:
    """t itself, or for a dense item that arrives in row blocks a `placeholder` of its shape."""
    if isinstance(t, torch.Tensor):
        return t
    (_, dtype, shape), = t.parts_layout()
    return placeholder(dtype, shape)


# Bytes of tensor writes a StreamingShardFile queues for its writer thread, at most: one
# 16 MiB row block in flight while the caller reads and quantizes the next.
WRITE_QUEUE_BYTES = 16 << 20


class StreamingShardFile(ShardLayout):
    """A safetensors file at `path`, filled by `add` and finished by `close`.

    Tensor bytes go to the file on a writer thread (llmq.checkpoint.ordered_worker), at most
    `WRITE_QUEUE_BYTES` queued, so writing overlaps the caller's next read and quantization; a
    tensor given to `add` must not be modified in place until `close` returns. A failed write is
    raised, naming the file and tensor, by the next `add` or by `close`."""

    def __init__(self, path: str, reserve: int, metadata: Optional[Dict[str, str]] = None):
        super().__init__(reserve, metadata)
        self.path = path
        self._fd: Optional[int] = None
        self._worker: Optional[OrderedWorker] = None

    def fits(self, name: str, t: torch.Tensor, max_bytes: int) -> bool:
        """Whether `t` can be added (`accepts`); an empty file takes anything whose header fits."""
        t = _as_placed(t)
        if len(self):
            return self.accepts([(name, t)], max_bytes)
        n = t.numel() * t.element_size()
        return header_json_size(self.metadata, [entry_fragment_size(name, t.dtype, tuple(t.shape), 0, n)]) <= self.reserve - 8

    def fits_each(self, parts: List[Tuple[str, torch.Tensor]], max_bytes: int) -> bool:
        """Whether every part, added in this order, `fits` after the ones before it (none would
        start a new file)."""
        offset, fragments, count = self.nbytes, list(self._fragments), len(self)
        for name, t in parts:
            n = t.numel() * t.element_size()
            fragments.append(entry_fragment_size(name, t.dtype, tuple(t.shape), offset, offset + n))
            if header_json_size(self.metadata, fragments) > self.reserve - 8:
                return False
            if count and (offset % t.element_size() or offset + n > max_bytes):
                return False
            offset, count = offset + n, count + 1
        return True

    def add(self, name: str, t: torch.Tensor) -> None:
        """Place t and queue its bytes for the writer thread (the caller may drop t, not modify it).
        A dense `RowBlocks` is queued block by block as it is read."""
        if name in self.sizes:
            raise ValueError(f"tensor {name!r} written twice")
        placed = _as_placed(t)
        n = placed.numel() * placed.element_size()
        fragment = entry_fragment_size(name, placed.dtype, tuple(placed.shape), self.nbytes, self.nbytes + n)
        if header_json_size(self.metadata, self._fragments + [fragment]) > self.reserve - 8:
            raise ValueError(f"tensor {name!r}: the header of {self.path} would outgrow its {self.reserve}-byte reserve")
        [(_, offset, mv)] = self.place([(name, placed)])
        if mv is not None:
            self.write([(name, offset, mv)], name)
            return
        (role, _, _), = t.parts_layout()
        where = {role: (name, offset, n)}
        for r0, r1, parts in t.row_parts():
            self.write(block_writes(where, t.rows, r0, r1, parts), name)
            del parts

    def write(self, writes: List[Tuple[str, int, memoryview]], name: str) -> None:
        """Queue (name, file offset, bytes) of placed tensors for the writer thread (errors name
        `name`)."""
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask decides
        except OSError as e:
            raise write_error(e, self.path, "writing the shard", tensor=name) from None
        if self._worker is None:
            self._worker = OrderedWorker("llmq-shard-writer", WRITE_QUEUE_BYTES)
        fd, path = self._fd, self.path

        def job():
            try:
                for _, offset, mv in writes:
                    write_all(fd, mv, offset)
            except OSError as e:
                raise write_error(e, path, "writing the shard", tensor=name) from None

        self._worker.submit(job, sum(mv.nbytes for _, _, mv in writes))

    def _stop_writer(self) -> None:
        """Let the writer thread finish its queue and stop; re-raise its first error."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.join()

    def close(self, fsync: bool = False) -> None:
        """Write the header into the gap (after every queued write), fsync (if asked) and close the
        file."""
        try:
            self._stop_writer()
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
            write_all(self._fd, self.header(), 0)
            if fsync:
                os.fsync(self._fd)
        except OSError as e:
            raise write_error(e, self.path, "writing the shard header") from None
        finally:
            if self._fd is not None:
                os.close(self._fd)
            self._fd = None

    def discard(self) -> None:
        """Stop the writer thread (its error, if any, is the caller's to have raised already),
        close and delete an unfinished file."""
        try:
            self._stop_writer()
        except Exception:
            pass
        fd, self._fd = self._fd, None
        remove_partial(fd, self.path)
