"""CUDA backend: terminal packers from llmq's canonical integer weights to the layouts
NVIDIA-GPU kernels consume. Everything here runs on CPU; only tests of the real
kernels need a CUDA device.

Imports `llmq` only.
"""

from .tinygemm import (
    TINYGEMM_GROUP_SIZES,
    TINYGEMM_INNER_K_TILES,
    TinygemmInt4Weight,
    dequantize_tinygemm,
    expert,
    pack_int4_for_cpu,
    pack_tinygemm_int4,
    padded_out_features,
    stack_experts,
    tile_pack_canonical_bytes,
    tile_pack_int4,
    tile_unpack_int4,
    tinygemm_scale_and_zero,
    unpack_tinygemm_int4,
)

__all__ = [
    "TINYGEMM_GROUP_SIZES",
    "TINYGEMM_INNER_K_TILES",
    "TinygemmInt4Weight",
    "dequantize_tinygemm",
    "expert",
    "pack_int4_for_cpu",
    "pack_tinygemm_int4",
    "padded_out_features",
    "stack_experts",
    "tile_pack_canonical_bytes",
    "tile_pack_int4",
    "tile_unpack_int4",
    "tinygemm_scale_and_zero",
    "unpack_tinygemm_int4",
]
