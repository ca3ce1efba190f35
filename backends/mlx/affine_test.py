"""llmq_mlx.affine against mlx.core itself: bit layout, dequantize, quantized_matmul, gather_qmm."""

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="the MLX runtime (mlx, or mlx[cpu] on Linux) is not installed here")

from llmq.quant.formats import GroupQuantizedWeight, dequantize_canonical, pack_bits, unpack_bits  # noqa: E402
from llmq_mlx import (  # noqa: E402
    MLX_BITS,
    dequantize_like_mlx,
    pack_mlx_affine,
    pack_mlx_fp,
    stack_experts,
    unpack_mlx_affine,
)
from mlx_testutil import abs_weight_f64, exact_weight_f64, gamma, random_canonical  # noqa: E402

BITS_GROUPS = [(b, g) for b in MLX_BITS for g in (32, 64, 128)]


@pytest.mark.parametrize("bits,group_size", BITS_GROUPS)
def test_mx_dequantize_equals_fp32_formula_exactly(bits, group_size):
    """mx.dequantize of our buffers == scales*q + biases evaluated in fp32, bit for bit."""
    w = random_canonical((24, 256), bits, group_size, seed=bits * 1000 + group_size)
    m = pack_mlx_affine(w)
    got = np.array(mx.dequantize(*m.to_mx(), group_size=group_size, bits=bits))
    # independent fp32 evaluation in numpy from the canonical q (not from our packed words)
    q = unpack_bits(w.qdata, bits, 256).numpy().astype(np.float32).reshape(24, -1, group_size)
    want = (w.scale.numpy()[..., None] * q + w.bias.numpy()[..., None]).reshape(24, 256)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, dequantize_like_mlx(m).numpy())


@pytest.mark.parametrize("bits", MLX_BITS)
def test_mx_dequantize_vs_exact_canonical_within_one_rounding(bits):
    """MLX rounds scale*q before adding the bias; our exact dequantize rounds once.
    They differ by at most half an ulp of scale*q plus half an ulp of the result."""
    w = random_canonical((16, 512), bits, 64, seed=bits)
    m = pack_mlx_affine(w)
    got = np.array(mx.dequantize(*m.to_mx(), group_size=64, bits=bits)).astype(np.float64)
    exact = exact_weight_f64(w)
    ours = dequantize_canonical(w).numpy().astype(np.float64)
    sq = np.abs(exact - np.repeat(w.bias.double().numpy(), 64, axis=-1))
    bound = np.spacing(sq.astype(np.float32)).astype(np.float64) / 2 + np.spacing(np.abs(ours).astype(np.float32)) / 2
    assert np.all(np.abs(got - exact) <= bound + 1e-300)
    assert np.all(np.abs(ours - exact) <= np.spacing(np.abs(ours).astype(np.float32)) / 2)


@pytest.mark.parametrize("bits,group_size", [(2, 32), (3, 64), (4, 128), (5, 32), (6, 64), (8, 128)])
def test_mx_quantize_bytes_read_back_as_canonical(bits, group_size):
    """The other direction: what mx.quantize packs, our canonical unpacker reads correctly."""
    rng = np.random.default_rng(bits)
    x = mx.array(rng.standard_normal((8, 256)).astype(np.float32))
    wq, s, b = mx.quantize(x, group_size=group_size, bits=bits)
    canon = GroupQuantizedWeight(
        qdata=torch.from_numpy(np.array(wq).view(np.uint8).copy()),
        scale=torch.from_numpy(np.array(s)),
        bias=torch.from_numpy(np.array(b)),
        bits=bits,
        group_size=group_size,
        shape=(8, 256),
    )
    m = pack_mlx_affine(canon)
    np.testing.assert_array_equal(m.weight.numpy(), np.array(wq))  # same words
    np.testing.assert_array_equal(
        dequantize_like_mlx(m).numpy(), np.array(mx.dequantize(wq, s, b, group_size=group_size, bits=bits))
    )


def test_4bit_canonical_bytes_are_mlx_words_without_copy():
    w = random_canonical((8, 128), 4, 32)
    m = pack_mlx_affine(w)
    assert m.weight.data_ptr() == w.qdata.data_ptr()
    # element 2i in the low nibble of byte i, byte 0 the least significant of word 0
    q = unpack_bits(w.qdata, 4, 128)
    word0 = int(m.weight[0, 0])
    assert [(word0 >> (4 * j)) & 0xF for j in range(8)] == q[0, :8].tolist()


def test_unpack_round_trip():
    w = random_canonical((2, 16, 256), 3, 128, seed=5)
    back = unpack_mlx_affine(pack_mlx_affine(w))
    assert torch.equal(back.qdata, w.qdata) and torch.equal(back.scale, w.scale) and torch.equal(back.bias, w.bias)


def _check_matmul(y, x64, w: GroupQuantizedWeight):
    """|y - x @ W^T| <= gamma_{K+4} * |x| @ (|s q| + |b|)^T, W exact in float64.

    Any summation order of K products, each built from at most 3 roundings (product
    s*q, sum with b, product with x), plus the final sum, stays inside gamma_{K+4}."""
    k = w.shape[-1]
    ref = x64 @ exact_weight_f64(w).swapaxes(-1, -2)
    bound = gamma(k + 4) * (np.abs(x64) @ abs_weight_f64(w).swapaxes(-1, -2))
    err = np.abs(np.asarray(y, dtype=np.float64) - ref)
    assert np.all(err <= bound), f"max err {err.max():.3e}, bound there {bound.flat[err.argmax()]:.3e}"


@pytest.mark.parametrize("bits,group_size", [(2, 64), (3, 32), (4, 64), (4, 128), (5, 128), (6, 32), (8, 64)])
def test_mx_quantized_matmul_matches_float64(bits, group_size):
    w = random_canonical((48, 256), bits, group_size, seed=17 + bits)
    m = pack_mlx_affine(w)
    x = np.random.default_rng(bits).standard_normal((5, 256)).astype(np.float32)
    y = mx.quantized_matmul(mx.array(x), *m.to_mx(), transpose=True, group_size=group_size, bits=bits)
    _check_matmul(np.array(y), x.astype(np.float64), w)


@pytest.mark.parametrize("bits,group_size", [(4, 64), (3, 128), (8, 32)])
def test_mx_gather_qmm_on_stacked_experts(bits, group_size):
    """Experts stacked [E, N, K'] (from one canonical [E, N, K] and from a list) feed gather_qmm."""
    e, n, k, t = 6, 40, 256, 7
    w = random_canonical((e, n, k), bits, group_size, seed=bits)
    from_stacked = pack_mlx_affine(w)
    per_expert = [
        pack_mlx_affine(
            GroupQuantizedWeight(w.qdata[i], w.scale[i], w.bias[i], bits=bits, group_size=group_size, shape=(n, k))
        )
        for i in range(e)
    ]
    from_list = stack_experts(per_expert)
    assert torch.equal(from_list.weight, from_stacked.weight) and from_list.shape == (e, n, k)
    assert tuple(from_list.weight.shape) == (e, n, k * bits // 32)
    assert tuple(from_list.scales.shape) == (e, n, k // group_size)

    rng = np.random.default_rng(1)
    x = rng.standard_normal((t, 1, k)).astype(np.float32)
    idx = np.array([3, 0, 5, 5, 1, 2, 4], dtype=np.uint32)
    y = mx.gather_qmm(
        mx.array(x), *from_list.to_mx(), rhs_indices=mx.array(idx), transpose=True, group_size=group_size, bits=bits
    )
    y = np.array(y)
    assert y.shape == (t, 1, n)
    for i in range(t):
        wi = GroupQuantizedWeight(
            w.qdata[idx[i]], w.scale[idx[i]], w.bias[idx[i]], bits=bits, group_size=group_size, shape=(n, k)
        )
        _check_matmul(y[i], x[i].astype(np.float64), wi)


def test_reduced_precision_scales_are_an_explicit_choice():
    w = random_canonical((8, 128), 4, 64)
    m = pack_mlx_affine(w, scale_dtype=torch.bfloat16)
    assert m.scales.dtype == torch.bfloat16
    got = np.array(mx.dequantize(*m.to_mx(), group_size=64, bits=4).astype(mx.float32))
    assert got.shape == (8, 128)
    with pytest.raises(ValueError, match="scale_dtype"):
        pack_mlx_affine(w, scale_dtype=torch.float64)


def test_unrepresentable_weights_are_rejected_by_name():
    w7 = GroupQuantizedWeight(
        qdata=pack_bits(torch.zeros(4, 64, dtype=torch.uint8), 7),
        scale=torch.ones(4, 2),
        bias=torch.zeros(4, 2),
        bits=7,
        group_size=32,
        shape=(4, 64),
    )
    with pytest.raises(ValueError, match=r"layers\.3\.q_proj.*7-bit"):
        pack_mlx_affine(w7, name="layers.3.q_proj")
    with pytest.raises(ValueError, match="group_size=16"):
        pack_mlx_affine(random_canonical((4, 64), 4, 16), name="x")
    with pytest.raises(ValueError, match="cannot regroup group_size=64 into groups of 128"):
        pack_mlx_affine(random_canonical((4, 128), 4, 64), group_size=128)
    with pytest.raises(ValueError, match="must be one of"):
        pack_mlx_affine(random_canonical((4, 128), 4, 64), group_size=16)
    with pytest.raises(ValueError, match="mxfp4/mxfp8"):
        pack_mlx_fp(random_canonical((4, 128), 4, 64), name="x")


def test_stack_experts_rejects_mismatched_experts():
    a = pack_mlx_affine(random_canonical((8, 128), 4, 64))
    b = pack_mlx_affine(random_canonical((8, 128), 4, 32))
    with pytest.raises(ValueError, match="expert 1"):
        stack_experts([a, b])
    with pytest.raises(ValueError, match="no experts"):
        stack_experts([])
