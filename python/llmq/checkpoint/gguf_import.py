"""Read GGUF files and turn their quantized blocks into the canonical form, exactly.

``gguf_header`` parses and validates the header (metadata, tensor names, types, dims,
offsets; gguf-py's reader is not used); a plain tensor's bytes are then read with one
positioned read, a quantized tensor's in block-aligned chunks of ``CHUNK_BYTES`` into a
reused per-thread buffer (its memory is the result plus one chunk), and each supported
block type is rearranged -- never dequantized and requantized -- into a
``GroupQuantizedWeight`` (unsigned q, LSB-first, float32 scale and additive bias):

=========  =====  =====  ================================  =========================
type       bits   group  scale                             bias
=========  =====  =====  ================================  =========================
Q4_0       4      32     d                                 -8 d
Q4_1       4      32     d                                 m
Q5_0       5      32     d                                 -16 d
Q5_1       5      32     d                                 m
Q8_0       8      32     d                                 -128 d   (q = int8 + 128)
Q2_K       2      16     d * sc[j]   (4-bit sub-scale)     -dmin * m[j]   (4-bit)
Q3_K       3      16     d * (sc[j] - 32)  (6-bit)         -4 d (sc[j] - 32)   (q = low 2 bits + 4 * mask bit)
Q4_K       4      32     d * sc[j]   (6-bit sub-scale)     -dmin * m[j]
Q5_K       5      32     d * sc[j]                         -dmin * m[j]
Q6_K       6      16     d * sc[j]   (int8 sub-scale)      -32 d sc[j]
=========  =====  =====  ================================  =========================

d, m, dmin are float16 in the file, so every scale and bias above is an exact
float32 (an 11-bit significand times an integer of at most 8 bits), and
``scale*q + bias`` evaluated exactly and rounded once equals gguf-py's float32
arithmetic bit for bit (the sign of an exact zero aside: gguf-py's ``d*(q-8)``
can give -0.0 where the additive form gives +0.0). F32, F16, BF16 and the plain
integer types come back as ordinary tensors. Block layouts are from ggml's
``ggml-common.h`` / gguf-py's ``quants.py``. The rearrangement runs in the compiled,
multi-threaded decoder (cpp/quant/gguf_blocks.h) when the quantization kernel is loaded,
else in its numpy reference (llmq.quant.formats.gguf_blocks); both give the same bytes.

Shapes: GGUF lists dims innermost first (ne[0] = K); tensors come back in torch
order ``[..., N, K]``, so a stacked MoE tensor ``ne = [K, N, E]`` becomes ``[E, N, K]``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

from llmq.checkpoint.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedCheckpointError,
)
from llmq.checkpoint.gguf_header import GGUFHeader, parse_header_cached
from llmq.checkpoint.safetensors_io import _HUGE_PAGE_MIN_BYTES, OpenReadOnly, ReadBuffers, alloc_bytes, pread_exact
from llmq.quant.formats import GroupQuantizedWeight, get_format
from llmq.quant.formats.gguf_blocks import BLOCK_TYPES, decode_into

Value = Union[torch.Tensor, GroupQuantizedWeight]

# Quantized tensors are read and decoded in chunks of about this many bytes of blocks, so a
# tensor's memory is its canonical result plus one chunk, never its whole raw bytes as well.
CHUNK_BYTES = 4 << 20

_PLAIN = {  # GGML type name -> torch dtype
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
}
SUPPORTED_TYPES = tuple(_PLAIN) + tuple(BLOCK_TYPES)
# GGML tensor type ids (ggml.h's enum ggml_type; gguf.GGMLQuantizationType), for naming them.
GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4",
    41: "Q1_0",
}


_local = threading.local()


def _chunk_buffer(nbytes: int) -> torch.Tensor:
    """This thread's reused chunk buffer of at least nbytes (a fresh one per tensor would pay
    its page faults every time)."""
    buf = getattr(_local, "chunk", None)
    if buf is None or buf.numel() < nbytes:
        buf = _local.chunk = alloc_bytes(max(nbytes, _HUGE_PAGE_MIN_BYTES))
    return buf


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    type_name: str
    shape: Tuple[int, ...]  # torch order [..., N, K]
    start: int  # absolute file offset
    nbytes: int


def to_canonical(type_name: str, raw: torch.Tensor, shape: Tuple[int, ...], *,
                 dtype: torch.dtype = torch.float32) -> Value:
    """Convert one GGUF tensor's raw bytes (uint8, any shape) into a tensor or GroupQuantizedWeight.

    ``shape`` is the logical torch-order shape [..., N, K]. ``dtype`` is recorded on
    quantized weights as the dtype they dequantize to (GGUF does not say; gguf-py
    dequantizes to float32).
    """
    raw = raw.reshape(-1)
    if type_name in _PLAIN:
        return raw.view(_PLAIN[type_name]).reshape(shape)
    if type_name not in BLOCK_TYPES:
        raise UnsupportedCheckpointError(f"GGUF type {type_name} is not importable; supported: {SUPPORTED_TYPES}")
    return get_format(type_name).rebuild(type_name, {}, tuple(shape), dtype, {"blocks": raw})


class GGUFFile(OpenReadOnly):
    """A parsed, validated GGUF file: metadata, tensor table, and one-tensor-at-a-time reads.

    The header is parsed by ``gguf_header`` (once per process for an unchanged file; large
    metadata arrays stay on disk until used), never by gguf-py.
    """

    _buffers: Optional[ReadBuffers] = None  # set in __init__ (close() may run when __init__ failed first)

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise CheckpointNotFoundError("no such file", path=self.path)
        if os.path.isdir(self.path):
            raise CorruptCheckpointError("expected a .gguf file, found a directory", path=self.path)
        header = parse_header_cached(self.path)
        self.file_size = header.identity.size
        self.metadata: Dict[str, Any] = {k: list(v) if isinstance(v, list) else v for k, v in header.metadata.items()}
        self.tensors = self._tensor_table(header)
        self._buffers = ReadBuffers()  # what read() returns, reused once the caller drops it
        self._fd: Optional[int] = os.open(self.path, os.O_RDONLY)
        if not header.identity.matches(os.fstat(self._fd)):
            self.close()
            raise CorruptCheckpointError("the file changed after its header was read", path=self.path)

    def _tensor_table(self, header: GGUFHeader) -> List[GGUFTensorInfo]:
        out: List[GGUFTensorInfo] = []
        for rt in header.tensors:
            name, dims = rt.name, list(rt.dims)
            type_name = GGML_TYPES.get(rt.ggml_type)
            if type_name not in SUPPORTED_TYPES:
                known = f"GGUF type {type_name}" if type_name else f"GGML type id {rt.ggml_type} (unknown)"
                raise UnsupportedCheckpointError(
                    f"{known} cannot be imported exactly; importable types: {', '.join(SUPPORTED_TYPES)}",
                    path=self.path, tensor=name)
            shape = tuple(reversed(dims))
            n = math.prod(dims)
            if type_name in _PLAIN:
                nbytes = n * _PLAIN[type_name].itemsize
            else:
                block, block_bytes, _, _ = BLOCK_TYPES[type_name]
                if dims[0] % block:
                    raise CorruptCheckpointError(
                        f"{type_name} needs the innermost dim to be a multiple of {block}, got {dims[0]}",
                        path=self.path, tensor=name)
                nbytes = n // block * block_bytes
            start = rt.start
            if start + nbytes > self.file_size:
                raise CorruptCheckpointError(
                    f"{type_name} {list(shape)} needs bytes [{start}, {start + nbytes}) but the file has "
                    f"{self.file_size} (truncated?)", path=self.path, tensor=name)
            out.append(GGUFTensorInfo(name, type_name, shape, start, nbytes))
        by_offset = sorted(out, key=lambda t: (t.start, t.nbytes))
        for prev, cur in zip(by_offset, by_offset[1:]):
            if cur.start < prev.start + prev.nbytes:
                raise CorruptCheckpointError(f"data overlaps tensor {prev.name!r}", path=self.path, tensor=cur.name)
        return out

    def close(self) -> None:
        if self._buffers is not None:
            self._buffers.clear()
        super().close()

    def read_raw(self, info: GGUFTensorInfo, *, buffers: Optional[ReadBuffers] = None) -> torch.Tensor:
        """The tensor's stored bytes, in fresh memory (or in one of ``buffers``)."""
        raw = buffers.take(info.nbytes) if buffers is not None else alloc_bytes(info.nbytes)
        if info.nbytes:
            pread_exact(self._fd, memoryview(raw.numpy()), info.start, path=self.path, tensor=info.name)
        return raw

    def _read_blocks(self, info: GGUFTensorInfo, dtype: torch.dtype) -> GroupQuantizedWeight:
        """A quantized tensor read in block-aligned chunks of CHUNK_BYTES, each decoded into its slice of
        the result (gguf_blocks.decode_into: the compiled decoder when loaded, else the numpy reference)."""
        block, block_bytes, bits, group = BLOCK_TYPES[info.type_name]
        *lead, k = info.shape if len(info.shape) >= 2 else (1, *info.shape)
        n_blocks = info.nbytes // block_bytes
        qbytes, groups = block * bits // 8, block // group
        qdata = self._buffers.take(n_blocks * qbytes)
        scale = alloc_bytes(n_blocks * groups * 4).view(torch.float32)
        bias = alloc_bytes(n_blocks * groups * 4).view(torch.float32)
        per = max(1, CHUNK_BYTES // block_bytes)
        buf = _chunk_buffer(per * block_bytes)
        for b0 in range(0, n_blocks, per):
            nb = min(per, n_blocks - b0)
            chunk = buf[:nb * block_bytes]
            pread_exact(self._fd, memoryview(chunk.numpy()), info.start + b0 * block_bytes, path=self.path,
                        tensor=info.name)
            decode_into(info.type_name, chunk, qdata[b0 * qbytes:(b0 + nb) * qbytes],
                        scale[b0 * groups:(b0 + nb) * groups], bias[b0 * groups:(b0 + nb) * groups])
        return GroupQuantizedWeight(qdata=qdata.view(*lead, k * bits // 8), scale=scale.view(*lead, k // group),
                                    bias=bias.view(*lead, k // group), bits=bits, group_size=group,
                                    shape=tuple(info.shape), dtype=dtype)

    def read(self, info: GGUFTensorInfo, *, dtype: torch.dtype = torch.float32) -> Value:
        try:
            if info.type_name in BLOCK_TYPES:
                return self._read_blocks(info, dtype)
            return to_canonical(info.type_name, self.read_raw(info, buffers=self._buffers), info.shape, dtype=dtype)
        except ValueError as e:
            if isinstance(e, UnsupportedCheckpointError) and e.path:
                raise
            raise CorruptCheckpointError(str(e), path=self.path, tensor=info.name) from None

    def __iter__(self) -> Iterator[Tuple[str, Value]]:
        for info in sorted(self.tensors, key=lambda t: t.start):  # file order: sequential reads
            yield info.name, self.read(info)


def read_gguf_metadata(path: str | os.PathLike) -> Dict[str, Any]:
    """The key/value metadata of a GGUF file (architecture, hyper-parameters, tokenizer) as Python values.

    Arrays of more than gguf_header.EAGER_ARRAY_LIMIT elements (a tokenizer's vocabulary) come
    back as a lazy ``GGUFArray`` sequence: ``len()`` is free, ``list()`` / ``tolist()`` decode it."""
    with GGUFFile(path) as f:
        return dict(f.metadata)
