"""Read GGUF files and turn their quantized blocks into the canonical form, exactly.

``gguf_header`` parses and validates the header (metadata, tensor names, types, dims,
offsets; gguf-py's reader is not used); the
tensor bytes are then read with one positioned read per tensor, and each supported
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
``ggml-common.h`` / gguf-py's ``quants.py``.

Shapes: GGUF lists dims innermost first (ne[0] = K); tensors come back in torch
order ``[..., N, K]``, so a stacked MoE tensor ``ne = [K, N, E]`` becomes ``[E, N, K]``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np
import torch

from llmq.checkpoint.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedCheckpointError,
)
from llmq.checkpoint.gguf_header import GGUFHeader, parse_header_cached
from llmq.checkpoint.safetensors_io import alloc_bytes, pread_exact
from llmq.quant.formats import GroupQuantizedWeight

Value = Union[torch.Tensor, GroupQuantizedWeight]

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
# GGML type name -> (block size, bytes per block, canonical bits, canonical group size)
_QUANT = {
    "Q4_0": (32, 18, 4, 32),
    "Q4_1": (32, 20, 4, 32),
    "Q5_0": (32, 22, 5, 32),
    "Q5_1": (32, 24, 5, 32),
    "Q8_0": (32, 34, 8, 32),
    "Q4_K": (256, 144, 4, 32),
    "Q5_K": (256, 176, 5, 32),
    "Q6_K": (256, 210, 6, 16),
}
SUPPORTED_TYPES = tuple(_PLAIN) + tuple(_QUANT)
_PACKED_BY_DECODER = ("Q4_0", "Q4_1", "Q4_K")
# GGML tensor type ids (ggml.h's enum ggml_type; gguf.GGMLQuantizationType), for naming them.
GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4",
    41: "Q1_0",
}


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    type_name: str
    shape: Tuple[int, ...]  # torch order [..., N, K]
    start: int  # absolute file offset
    nbytes: int


# Bit manipulation runs on 64-bit words ("SWAR": eight bytes per operation), because
# numpy and torch shift uint8 arrays an element at a time; this keeps the import near
# memory speed. Every helper below is checked against formats.pack_bits and gguf-py.
_M0F = np.uint64(0x0F0F0F0F0F0F0F0F)
_M01 = np.uint64(0x0101010101010101)
_M03 = np.uint64(0x0303030303030303)
_SPREAD_BITS = np.array([sum(((b >> i) & 1) << (8 * i) for i in range(8)) for b in range(256)], dtype=np.uint64)


def _u64(a: np.ndarray) -> np.ndarray:
    """A (copied if strided) uint8 [n, 8m] array viewed as uint64 [n, m]."""
    if not a.flags.c_contiguous:
        out = np.empty(a.shape, np.uint8)
        np.copyto(out, a)
        a = out
    return a.view(np.uint64)


def _half(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 stored in byte columns [n, 2] -> float32 [n]."""
    return np.ascontiguousarray(b).view("<f2")[:, 0].astype(np.float32)


def swar_pack(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [..., K] (values < 2**bits, K % 8 == 0) -> the canonical LSB-first stream [..., K*bits/8].

    Eight elements (one byte each) form a 64-bit word; three merge steps pack them into
    the word's low 8*bits bits: neighbouring fields are joined in 16-, then 32-, then
    64-bit lanes. Same result as llmq.quant.formats.pack_bits, much faster for 5/6-bit.
    """
    *lead, k = q.shape
    w = np.empty((q.size // k, k), np.uint8)  # a private copy, updated in place
    np.copyto(w, q.reshape(-1, k))
    w = w.view(np.uint64)
    tmp = np.empty(w.shape, np.uint64)
    width = bits
    for lane in (16, 32, 64):
        half = lane // 2
        low = sum(((1 << width) - 1) << (i * lane) for i in range(64 // lane))
        np.right_shift(w, np.uint64(half - width), out=tmp)
        np.bitwise_and(tmp, np.uint64(low << width), out=tmp)
        np.bitwise_and(w, np.uint64(low), out=w)
        np.bitwise_or(w, tmp, out=w)
        width *= 2
    if bits == 4:  # the low half of every word: a uint32 view with stride 2
        src = w.view(np.uint32)[:, 0::2]
    else:
        src = w.view(np.uint8).reshape(-1, k // 8, 8)[:, :, :bits]
    out = np.empty(src.shape, src.dtype)
    np.copyto(out, src)
    return out.view(np.uint8).reshape(*lead, k * bits // 8)


def _nibble_halves(qs: np.ndarray, n_chunks: int) -> np.ndarray:
    """GGUF 4-bit chunks (low nibbles = first half of the elements, high = second half) ->
    one element per byte, in element order, as uint64 words [nb, ...]."""
    w = _u64(qs).reshape(qs.shape[0], n_chunks, -1)
    out = np.empty((w.shape[0], n_chunks, 2, w.shape[2]), np.uint64)
    np.bitwise_and(w, _M0F, out=out[:, :, 0, :])
    np.right_shift(w, np.uint64(4), out=out[:, :, 1, :])
    np.bitwise_and(out[:, :, 1, :], _M0F, out=out[:, :, 1, :])
    return out.reshape(qs.shape[0], -1)


def _pack_nibble_halves(qs: np.ndarray, n_chunks: int) -> np.ndarray:
    """GGUF 4-bit chunks straight to canonical packed bytes (no one-element-per-byte detour).

    Within a chunk of m bytes, the low nibbles hold elements 0..m-1 and the high nibbles
    m..2m-1; canonical byte i holds elements 2i (low) and 2i+1 (high). Isolating each set
    of nibbles and merging neighbouring bytes pairwise does this eight bytes at a time.
    """
    nb = qs.shape[0]
    w = _u64(qs).reshape(nb, n_chunks, -1)
    out = np.empty((nb, n_chunks, 2, w.shape[2]), np.uint32)
    x, tmp = np.empty_like(w), np.empty_like(w)  # reused in place: fewer fresh allocations
    for half in range(2):
        np.right_shift(w, np.uint64(4 * half), out=x)
        np.bitwise_and(x, _M0F, out=x)
        for shift, mask in ((4, 0x00FF00FF00FF00FF), (8, 0x0000FFFF0000FFFF), (16, 0x00000000FFFFFFFF)):
            np.right_shift(x, np.uint64(shift), out=tmp)
            np.bitwise_or(x, tmp, out=x)
            np.bitwise_and(x, np.uint64(mask), out=x)
        out[:, :, half, :] = x
    return out.view(np.uint8).reshape(nb, -1)


def _k_scale_min(s: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The 12-byte K-quant field -> eight 6-bit scales and eight 6-bit mins per block (float32).

    Bytes 0-3: low 6 bits = sc[0..3], top 2 bits = high bits of sc[4..7];
    bytes 4-7: the same for m; bytes 8-11: low nibble = low 4 bits of sc[4..7],
    high nibble = low 4 bits of m[4..7].
    """
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _decode_blocks(type_name: str, blocks: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """uint8 [nb, bytes_per_block] -> (q, scale float32 [nb, groups], bias float32 [nb, groups]).

    q is already packed (uint8 [nb, block/2]) for the 4-bit types, otherwise uint64 words
    [nb, block/8] holding one element per byte, for swar_pack."""
    nb = blocks.shape[0]
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        head = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[type_name]
        d = _half(blocks[:, 0:2])
        if type_name in ("Q4_0", "Q4_1"):
            q = _pack_nibble_halves(blocks[:, head:head + 16], 1)  # byte j: element j (low), j+16 (high)
        else:  # 32 high bits, element j = bit j (little-endian)
            high = _SPREAD_BITS[blocks[:, head - 4:head]]
            q = _nibble_halves(blocks[:, head:head + 16], 1) | (high << np.uint64(4))
        if type_name in ("Q4_0", "Q5_0"):
            bias = np.float32(-8.0 if type_name == "Q4_0" else -16.0) * d
        else:
            bias = _half(blocks[:, 2:4])
        return q, d[:, None], bias[:, None]
    if type_name == "Q8_0":
        d = _half(blocks[:, 0:2])
        q = _u64(blocks[:, 2:34]) ^ np.uint64(0x8080808080808080)  # int8 + 128 == flip the sign bit
        return q, d[:, None], (np.float32(-128.0) * d)[:, None]
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])
        sc, mn = _k_scale_min(blocks[:, 4:16])
        if type_name == "Q4_K":  # 4 chunks of 64: low nibbles 0..31, high 32..63
            q = _pack_nibble_halves(blocks[:, -128:], 4)
        else:
            q = _nibble_halves(blocks[:, -128:], 4)
            qh = _u64(blocks[:, 16:48])  # bit i of byte j is the high bit of element 32*i + j
            high = np.stack([(qh >> np.uint64(i)) & _M01 for i in range(8)], axis=1).reshape(nb, 32)
            q = q | (high << np.uint64(4))
        return q, d[:, None] * sc, -(dmin[:, None] * mn)
    if type_name == "Q6_K":
        low = _nibble_halves(blocks[:, 0:128], 2)  # per half of 128: low nibbles 0..63, high 64..127
        qh = _u64(blocks[:, 128:192]).reshape(nb, 2, 4)  # per half: 2-bit fields at shift 2s -> 32*s + j
        high = np.stack([(qh >> np.uint64(2 * s)) & _M03 for s in range(4)], axis=2).reshape(nb, 32)
        sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
        d = _half(blocks[:, 208:210])
        scale = d[:, None] * sc
        return low | (high << np.uint64(4)), scale, np.float32(-32.0) * scale
    raise AssertionError(type_name)


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
    if type_name not in _QUANT:
        raise UnsupportedCheckpointError(f"GGUF type {type_name} is not importable; supported: {SUPPORTED_TYPES}")
    block, block_bytes, bits, group = _QUANT[type_name]
    k = shape[-1]
    lead = tuple(shape[:-1]) if len(shape) >= 2 else (1,)
    with np.errstate(all="ignore"):  # NaN/Inf scales from a hostile file are caught by the nonfinite check
        q, scale, bias = _decode_blocks(type_name, raw.numpy().reshape(-1, block_bytes))
    if type_name in _PACKED_BY_DECODER:
        qdata = q.reshape(*lead, k // 2)
    else:
        q = q.view(np.uint8).reshape(*lead, k)
        qdata = q if bits == 8 else swar_pack(q, bits)
    return GroupQuantizedWeight(
        qdata=torch.from_numpy(np.ascontiguousarray(qdata)),
        scale=torch.from_numpy(np.ascontiguousarray(scale.reshape(*lead, k // group))),
        bias=torch.from_numpy(np.ascontiguousarray(bias.reshape(*lead, k // group))),
        bits=bits,
        group_size=group,
        shape=tuple(shape),
        dtype=dtype,
    )


class GGUFFile:
    """A parsed, validated GGUF file: metadata, tensor table, and one-tensor-at-a-time reads.

    The header is parsed by ``gguf_header`` (once per process for an unchanged file; large
    metadata arrays stay on disk until used), never by gguf-py.
    """

    def __init__(self, path: os.PathLike):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise CheckpointNotFoundError("no such file", path=self.path)
        if os.path.isdir(self.path):
            raise CorruptCheckpointError("expected a .gguf file, found a directory", path=self.path)
        header = parse_header_cached(self.path)
        self.file_size = header.identity.size
        self.metadata: Dict[str, Any] = {k: list(v) if isinstance(v, list) else v for k, v in header.metadata.items()}
        self.tensors = self._tensor_table(header)
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
                block, block_bytes, _, _ = _QUANT[type_name]
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def close(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)

    def read_raw(self, info: GGUFTensorInfo) -> torch.Tensor:
        raw = alloc_bytes(info.nbytes)
        if info.nbytes:
            pread_exact(self._fd, memoryview(raw.numpy()), info.start, path=self.path, tensor=info.name)
        return raw

    def read(self, info: GGUFTensorInfo, *, dtype: torch.dtype = torch.float32) -> Value:
        try:
            return to_canonical(info.type_name, self.read_raw(info), info.shape, dtype=dtype)
        except ValueError as e:
            if isinstance(e, UnsupportedCheckpointError) and e.path:
                raise
            raise CorruptCheckpointError(str(e), path=self.path, tensor=info.name) from None

    def __iter__(self) -> Iterator[Tuple[str, Value]]:
        for info in sorted(self.tensors, key=lambda t: t.start):  # file order: sequential reads
            yield info.name, self.read(info)


def read_gguf_metadata(path: os.PathLike) -> Dict[str, Any]:
    """The key/value metadata of a GGUF file (architecture, hyper-parameters, tokenizer) as Python values.

    Arrays of more than gguf_header.EAGER_ARRAY_LIMIT elements (a tokenizer's vocabulary) come
    back as a lazy ``GGUFArray`` sequence: ``len()`` is free, ``list()`` / ``tolist()`` decode it."""
    with GGUFFile(path) as f:
        return dict(f.metadata)
