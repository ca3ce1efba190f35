"""Runs only where the MLX runtime is present (mlx[cpu] on Linux, Metal on Apple)."""

import numpy as np


def test_mlx_dequantize_matches_affine_formula():
    import mlx.core as mx

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    wq, scales, biases = mx.quantize(mx.array(w), group_size=32, bits=4)
    deq = np.array(mx.dequantize(wq, scales, biases, group_size=32, bits=4))
    # Independent re-implementation of MLX's documented affine form: w = scales*q + biases.
    words = np.array(wq).astype(np.uint32)
    q = np.stack([(words >> (4 * j)) & 0xF for j in range(8)], axis=-1).reshape(8, 64)
    ref = np.array(scales).repeat(32, axis=1) * q + np.array(biases).repeat(32, axis=1)
    np.testing.assert_allclose(deq, ref, rtol=0, atol=1e-6)
    assert np.abs(deq - w).max() <= np.abs(np.array(scales)).max() / 2 + 1e-6
