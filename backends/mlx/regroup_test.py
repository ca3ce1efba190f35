"""Regrouping coarse canonical groups into MLX groups, and the explicit fallback."""

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="the MLX runtime (mlx, or mlx[cpu] on Linux) is not installed here")

from llmq.quant.formats import dequantize_canonical  # noqa: E402
from llmq_mlx import fallback_params, mlx_group_size_for, pack_mlx_affine, regroup  # noqa: E402
from mlx_testutil import random_canonical  # noqa: E402


@pytest.mark.parametrize(
    "group,k,expected",
    [(32, 256, 32), (64, 256, 64), (128, 256, 128), (256, 512, 128), (5376, 5376, 128), (96, 192, 32), (192, 384, 64)],
)
def test_largest_legal_group(group, k, expected):
    assert mlx_group_size_for(group, k) == expected


@pytest.mark.parametrize("group,k", [(16, 256), (48, 96), (8, 64), (5000, 5000)])
def test_unrepresentable_groups_raise(group, k):
    with pytest.raises(ValueError, match=f"group_size={group}.*cannot be represented"):
        mlx_group_size_for(group, k, name="blk.0.ffn_down")


@pytest.mark.parametrize("bits,group,k", [(4, 256, 512), (3, 5376, 5376), (8, 96, 192), (2, 384, 768)])
def test_regrouping_preserves_every_dequantized_value(bits, group, k):
    w = random_canonical((6, k), bits, group, seed=group)
    m = pack_mlx_affine(w)
    assert m.group_size == mlx_group_size_for(group, k)
    # exact in our own arithmetic ...
    assert torch.equal(dequantize_canonical(regroup(w, m.group_size)), dequantize_canonical(w))
    # ... and in MLX's: mx.dequantize of the regrouped buffers equals the fp32 formula
    # evaluated with the ORIGINAL coarse groups' parameters.
    got = np.array(mx.dequantize(*m.to_mx(), group_size=m.group_size, bits=bits))
    from llmq.quant.formats import unpack_bits

    q = unpack_bits(w.qdata, bits, k).numpy().astype(np.float32).reshape(6, k // group, group)
    want = (w.scale.numpy()[..., None] * q + w.bias.numpy()[..., None]).reshape(6, k)
    np.testing.assert_array_equal(got, want)


def test_regroup_to_a_finer_legal_group_on_request():
    w = random_canonical((4, 256), 4, 128)
    m = pack_mlx_affine(w, group_size=32)
    assert m.group_size == 32 and tuple(m.scales.shape) == (4, 8)
    assert torch.equal(dequantize_canonical(regroup(w, 32)), dequantize_canonical(w))


def test_fallback_requantizes_only_when_asked():
    g = torch.Generator().manual_seed(0)
    high = torch.randn(8, 256, generator=g)
    w16 = random_canonical((8, 256), 4, 16)  # stands in for e.g. a GGUF Q6_K-style group of 16
    with pytest.raises(ValueError, match="group_size=16"):
        pack_mlx_affine(w16, name="w")
    m = pack_mlx_affine(w16, requantize_from=high, name="w")
    assert (m.bits, m.group_size) == (4, 32)
    got = np.array(mx.dequantize(*m.to_mx(), group_size=32, bits=4))
    # min-max re-quantization: every value within half a step of the original
    step = np.repeat(m.scales.numpy(), 32, axis=-1)
    assert np.all(np.abs(got - high.numpy()) <= step / 2 * (1 + 1e-5) + 1e-6)
    with pytest.raises(ValueError, match="requantize_from has shape"):
        pack_mlx_affine(w16, requantize_from=high[:4])


def test_fallback_params():
    assert fallback_params(7, 32, 256) == (8, 32)
    assert fallback_params(4, 16, 256) == (4, 32)
    assert fallback_params(4, 48, 192) == (4, 32)
    with pytest.raises(ValueError, match="K=40"):
        fallback_params(4, 40, 40)


def test_7bit_falls_back_to_8bit_only_when_asked():
    from llmq.quant.formats import GroupQuantizedWeight, pack_bits

    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 128, (4, 64), generator=g)
    scale, bias = torch.full((4, 2), 0.01), torch.zeros(4, 2)
    w7 = GroupQuantizedWeight(pack_bits(q, 7), scale, bias, bits=7, group_size=32, shape=(4, 64))
    with pytest.raises(ValueError, match="no 7-bit mode"):
        pack_mlx_affine(w7)
    high = dequantize_canonical(w7)
    m = pack_mlx_affine(w7, requantize_from=high)
    assert (m.bits, m.group_size) == (8, 32)
    got = np.array(mx.dequantize(*m.to_mx(), group_size=32, bits=8))
    step = np.repeat(m.scales.numpy(), 32, axis=-1)
    assert np.all(np.abs(got - high.numpy()) <= step / 2 * (1 + 1e-5) + 1e-7)
