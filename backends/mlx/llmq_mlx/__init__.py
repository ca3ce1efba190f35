"""MLX backend: terminal packer from llmq's canonical integer weights to MLX affine
tensors, and a writer for folders that mlx-lm loads (`mlx_lm.load(folder)`).

Imports `llmq` only; mlx itself is imported lazily, where arrays are made.
"""

from .affine import (
    FP_MODES,
    MLX_BITS,
    MLX_GROUP_SIZES,
    MLXQuantizedWeight,
    canonical_bytes_as_uint32,
    dequantize_like_mlx,
    exact_dequantize,
    pack_mlx_affine,
    pack_mlx_fp,
    stack_experts,
    torch_to_mx,
    unpack_mlx_affine,
)
from .mlx_lm_writer import write_mlx_lm_folder
from .regroup import fallback_params, mlx_group_size_for, regroup, requantize_affine

__all__ = [
    "FP_MODES",
    "MLX_BITS",
    "MLX_GROUP_SIZES",
    "MLXQuantizedWeight",
    "canonical_bytes_as_uint32",
    "dequantize_like_mlx",
    "exact_dequantize",
    "fallback_params",
    "mlx_group_size_for",
    "pack_mlx_affine",
    "pack_mlx_fp",
    "regroup",
    "requantize_affine",
    "stack_experts",
    "torch_to_mx",
    "unpack_mlx_affine",
    "write_mlx_lm_folder",
]
