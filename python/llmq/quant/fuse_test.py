"""fuse_along_output: exact concatenation of quantized siblings."""

import pytest
import torch

from llmq.quant import QuantConfig, dequantize, fuse_along_output, quantize_weight


def bits_of(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_fuse_2d_is_exact(bits, symmetric):
    g = torch.Generator().manual_seed(bits)
    cfg = QuantConfig(bits=bits, group_size=16, symmetric=symmetric)
    parts = [quantize_weight(torch.randn(n, 64, generator=g), cfg, name=f"p{n}") for n in (24, 8, 8)]  # q|k|v
    fused = fuse_along_output(parts)
    assert fused.shape == (40, 64)
    ref = torch.cat([dequantize(p, torch.float32) for p in parts], dim=0)
    assert torch.equal(bits_of(dequantize(fused, torch.float32)), bits_of(ref))


def test_fuse_stacked_experts_along_n():
    g = torch.Generator().manual_seed(0)
    cfg = QuantConfig(bits=4, group_size=32)
    gate = quantize_weight(torch.randn(4, 16, 64, generator=g).bfloat16(), cfg)
    up = quantize_weight(torch.randn(4, 16, 64, generator=g).bfloat16(), cfg)
    fused = fuse_along_output([gate, up])
    assert fused.shape == (4, 32, 64) and fused.dtype == torch.bfloat16
    ref = torch.cat([dequantize(gate, torch.float32), dequantize(up, torch.float32)], dim=1)
    assert torch.equal(bits_of(dequantize(fused, torch.float32)), bits_of(ref))
    assert torch.equal(fused.qdata[:, 16:], up.qdata)


def test_mismatches_are_refused():
    g = torch.Generator().manual_seed(0)
    a = quantize_weight(torch.randn(8, 64, generator=g), QuantConfig(bits=4, group_size=32))
    with pytest.raises(ValueError, match="bits 8 != 4"):
        fuse_along_output([a, quantize_weight(torch.randn(8, 64, generator=g), QuantConfig(bits=8, group_size=32))])
    with pytest.raises(ValueError, match="group_size 16 != 32"):
        fuse_along_output([a, quantize_weight(torch.randn(8, 64, generator=g), QuantConfig(bits=4, group_size=16))])
    with pytest.raises(ValueError, match="all but N"):
        fuse_along_output([a, quantize_weight(torch.randn(8, 96, generator=g), QuantConfig(bits=4, group_size=32))])
    with pytest.raises(ValueError, match="all but N"):
        fuse_along_output([a, quantize_weight(torch.randn(2, 8, 64, generator=g), QuantConfig(bits=4, group_size=32))])
    with pytest.raises(ValueError, match="dtype"):
        fuse_along_output([a, quantize_weight(torch.randn(8, 64, generator=g).half(), QuantConfig(bits=4, group_size=32))])
    with pytest.raises(ValueError, match="at least one"):
        fuse_along_output([])
    with pytest.raises(ValueError, match="GroupQuantizedWeight"):
        fuse_along_output([a, torch.zeros(8, 64)])
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        fuse_along_output([quantize_weight(torch.randn(64, generator=g), QuantConfig(bits=4, group_size=32))])
