"""One safetensors file written tensor by tensor: the streaming shard writer of the Hugging Face
export (llmq.export.shards) and the MLX folder writer (backends/mlx).

Each tensor's bytes go to the file when it is added, after a gap reserved for the header
(`header_reserve`, as in the bundle writer), so memory holds only the tensor in flight
whatever the shard size, and every byte is written once. `close` writes the header into the
gap, padded with spaces (which JSON, and every safetensors reader, ignores). The result is a
valid safetensors file: keys in data order, data back to back from offset 0. It is not
byte-identical to `safetensors.torch.save_file`, which orders tensors by dtype and name and
therefore needs the whole shard in memory first.

`fits` says whether a tensor can join the file: the size limit, natural alignment (the data
may not contain holes, so a tensor whose offset would not be a multiple of its element size
starts a new file) and room in the header gap.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch

from llmq.checkpoint.bundle import header_reserve
from llmq.checkpoint.fileio import write_all, write_error
from llmq.checkpoint.safetensors_io import encode_header, entry_fragment_size, header_json_size

__all__ = ["StreamingShardFile", "header_reserve"]



def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


class StreamingShardFile:
    """A safetensors file at `path`, filled by `add` and finished by `close`."""

    def __init__(self, path: str, reserve: int, metadata: Optional[Dict[str, str]] = None):
        self.path = path
        self.reserve = reserve
        self.metadata = dict(metadata or {"format": "pt"})
        self.nbytes = 0  # data bytes written
        self.sizes: Dict[str, int] = {}  # name -> nbytes, in data order
        self._entries: List[Tuple[str, torch.dtype, Tuple[int, ...], int]] = []
        self._fragments: List[int] = []
        self._fd: Optional[int] = None

    def __len__(self) -> int:
        return len(self._entries)

    def fits(self, name: str, t: torch.Tensor, max_bytes: int) -> bool:
        """Whether `t` can be added without passing max_bytes of data, breaking alignment or
        outgrowing the header gap (an empty file takes anything that fits its header)."""
        n = t.numel() * t.element_size()
        fragment = entry_fragment_size(name, t.dtype, tuple(t.shape), self.nbytes, self.nbytes + n)
        header_ok = header_json_size(self.metadata, self._fragments + [fragment]) <= self.reserve - 8
        if not self._entries:
            return header_ok
        return header_ok and self.nbytes + n <= max_bytes and self.nbytes % t.element_size() == 0

    def add(self, name: str, t: torch.Tensor) -> None:
        """Write t's bytes now (the caller may drop t afterwards)."""
        if name in self.sizes:
            raise ValueError(f"tensor {name!r} written twice")
        mv = _tensor_bytes(t)
        fragment = entry_fragment_size(name, t.dtype, tuple(t.shape), self.nbytes, self.nbytes + len(mv))
        if header_json_size(self.metadata, self._fragments + [fragment]) > self.reserve - 8:
            raise ValueError(f"tensor {name!r}: the header of {self.path} would outgrow its {self.reserve}-byte reserve")
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask decides
            write_all(self._fd, mv, self.reserve + self.nbytes)
        except OSError as e:
            raise write_error(e, self.path, "writing the shard", tensor=name) from None
        self._fragments.append(fragment)
        self._entries.append((name, t.dtype, tuple(t.shape), len(mv)))
        self.sizes[name] = len(mv)
        self.nbytes += len(mv)

    def close(self) -> None:
        """Write the header into the gap and close the file."""
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
            write_all(self._fd, encode_header(self._entries, self.metadata, pad_to=self.reserve - 8), 0)
        except OSError as e:
            raise write_error(e, self.path, "writing the shard header") from None
        finally:
            if self._fd is not None:
                os.close(self._fd)
            self._fd = None

    def discard(self) -> None:
        """Close and delete an unfinished file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if os.path.exists(self.path):
            os.unlink(self.path)
