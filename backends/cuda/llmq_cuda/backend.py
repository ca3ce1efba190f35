"""The CUDA backend (--backend=cuda): 4-bit weights in tinygemm's tile-packed layout (what
`torch.ops.aten._weight_int4pack_mm` consumes), stacked experts in the per-expert layout.

Each packed weight `<name>` is stored as three bundle tensors:
    <name>.tinygemm_qdata           int32 [..., ceil(N/8), K/(16*T), 32, T/2]
    <name>.tinygemm_scale_and_zero  bfloat16 [..., K/group, ceil(N/8)*8, 2]
    <name>.tinygemm_shape           int64 [ndim] (the logical [..., N, K]; N is padded above)
Weights tinygemm cannot hold (not 4-bit, K not a multiple of 32) stay canonical, so the
bundle still loads everywhere. The run quantizes 4-bit tiled weights with bfloat16 scales
(CudaBackend.storage), so scale_and_zero holds their scales exactly; an asymmetric zero
(bias + 8*scale) still rounds once to bfloat16 (docs/backends.md).
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, Optional, Tuple

import torch

from llmq.backend import Backend, BundleBackend, WriteJob, register_backend
from llmq.quant import GroupQuantizedWeight, pack_bits
from llmq.quant.storage import Storage, group_tensors
from llmq_cuda.tinygemm import (
    TINYGEMM_GROUP_SIZES,
    TINYGEMM_INNER_K_TILES,
    TinygemmInt4Weight,
    pack_tinygemm_int4,
    padded_out_features,
    unpack_tinygemm_int4,
)

_SUFFIXES = (".tinygemm_qdata", ".tinygemm_scale_and_zero", ".tinygemm_shape")


def _inner_k_tiles(k: int):
    """The widest tile (8, else 4, else 2 inner K tiles) whose span divides K, or None."""
    for t in sorted(TINYGEMM_INNER_K_TILES, reverse=True):
        if k % (16 * t) == 0:
            return t
    return None


def _packs(bits: int, group_size: int, k: int) -> bool:
    """Whether a weight goes into tinygemm tiles (else it stays canonical)."""
    return bits == 4 and group_size in TINYGEMM_GROUP_SIZES and _inner_k_tiles(k) is not None


def cuda_storage(config) -> Storage:
    """What the bundle holds for a weight quantized with `config`: 4-bit weights tinygemm takes as
    int32 tiles [..., ceil(N/8)*8 rows] + bfloat16 scale_and_zero [..., K/group, ceil(N/8)*8, 2] +
    int64 shape [ndim] (bfloat16 scales: the run chooses them exactly representable), the others
    canonical (float32 scale and bias per group)."""
    tile = config.bits == 4 and config.group_size in TINYGEMM_GROUP_SIZES

    def tensors(scale_dtype: torch.dtype, shape):
        *lead, n, k = shape
        group = config.group_size_for(k)
        if not _packs(config.bits, group, k):
            return group_tensors(config.bits, group)(torch.float32, tuple(shape))
        rows = padded_out_features(n)
        return {"qdata": (torch.int32, tuple(lead) + (rows * k // 8,)),
                "scale_and_zero": (scale_dtype, tuple(lead) + (k // group, rows, 2)),
                "shape": (torch.int64, (len(shape),))}

    return Storage(scale_dtype=torch.bfloat16 if tile else torch.float32, tensors=tensors)


def pack_stream(items: Iterable[Tuple[str, object]]) -> Iterator[Tuple[str, object]]:
    for name, value in items:
        t = _inner_k_tiles(value.shape[-1]) if isinstance(value, GroupQuantizedWeight) else None
        if t is None or not _packs(value.bits, value.group_size, value.shape[-1]):
            yield name, value
            continue
        packed = pack_tinygemm_int4(value, inner_k_tiles=t, name=name)
        yield name + ".tinygemm_qdata", packed.qdata
        yield name + ".tinygemm_scale_and_zero", packed.scale_and_zero
        yield name + ".tinygemm_shape", torch.tensor(value.shape, dtype=torch.int64)


def to_canonical(tensors: Dict[str, object]) -> Dict[str, object]:
    """The inverse for verification: tinygemm entries back to canonical weights (with the
    bf16-rounded scale and zero they carry), everything else unchanged."""
    out = {n: v for n, v in tensors.items() if not n.endswith(_SUFFIXES)}
    for name in [n[: -len(".tinygemm_qdata")] for n in tensors if n.endswith(".tinygemm_qdata")]:
        qdata = tensors[name + ".tinygemm_qdata"]
        sz = tensors[name + ".tinygemm_scale_and_zero"]
        shape = tuple(tensors[name + ".tinygemm_shape"].tolist())
        packed = TinygemmInt4Weight(qdata=qdata, scale_and_zero=sz, group_size=shape[-1] // sz.shape[-3],
                                    inner_k_tiles=2 * qdata.shape[-1], shape=shape)
        q, scale, zero = unpack_tinygemm_int4(packed)
        scale = scale.float()
        out[name] = GroupQuantizedWeight(qdata=pack_bits(q, 4), scale=scale, bias=zero.float() - 8 * scale,
                                         bits=4, group_size=packed.group_size, shape=shape)
    return out


class CudaBackend(Backend):
    """--backend=cuda: the bundle with tinygemm int4 tiles (see the module docstring)."""

    name = "cuda"
    description = "the llmq bundle with 4-bit weights in tinygemm int4 tiles (torch.ops.aten._weight_int4pack_mm)"
    accepts_formats = ("int",)  # tinygemm packs integer weights
    takes_float = False

    def storage(self, config, job: Optional[WriteJob]) -> Storage:
        return cuda_storage(config)

    def write(self, stream: Iterable[Tuple[str, object]], job: WriteJob) -> str:
        return BundleBackend().write(pack_stream(stream), job)

    def reload(self, path: str, job: WriteJob) -> Dict[str, object]:
        return to_canonical(BundleBackend().reload(path, job))


register_backend(CudaBackend())
