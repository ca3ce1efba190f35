"""QuantizedExperts through the compiled dense kernel: each expert's matmuls are llmq::quantized_linear
exactly, and reference_linears() gives back the dequantize path."""

import pytest
import torch
import torch.nn.functional as F

from llmq.ops import dense_op
from llmq.ops.dense_op import quantized_linear
from llmq.ops.packing import pack_linear
from llmq.quant import modules
from llmq.quant.formats import GroupQuantizedWeight
from llmq.quant.quantize import quantize_weight
from llmq.quant.recipe import QuantConfig
from models.pipeline.quantized_model import QuantizedExperts

pytestmark = pytest.mark.skipif(not dense_op.quantized_linear_available(),
                                reason="the compiled //cpp/moe:_moe_kernel.so is not built/loadable here")


def _slice(qw: GroupQuantizedWeight, e: int) -> GroupQuantizedWeight:
    return GroupQuantizedWeight(qw.qdata[e], qw.scale[e], qw.bias[e], qw.bits, qw.group_size, tuple(qw.shape[1:]))


def test_experts_use_the_kernel_per_expert():
    g = torch.Generator().manual_seed(0)
    cfg = QuantConfig(format="int", bits=4, group_size=32, symmetric=False)
    gate_up = quantize_weight(torch.randn(4, 128, 64, generator=g) * 0.1, cfg, name="gate_up")
    down = quantize_weight(torch.randn(4, 64, 64, generator=g) * 0.1, cfg, name="down")
    experts = QuantizedExperts(gate_up, down)
    x = torch.randn(10, 64, generator=g)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(10)])  # distinct experts per token
    weights = torch.rand(10, 2, generator=g)
    old = modules.set_linear_kernel(None)
    try:
        assert dense_op.install_dense_kernel()
        with torch.no_grad():
            y = experts(x, weights, index)
            expected = torch.zeros_like(x)
            for e in torch.unique(index).tolist():
                token, slot = torch.where(index == e)
                gate, up = quantized_linear(x[token], pack_linear(_slice(gate_up, e))).chunk(2, dim=-1)
                h = quantized_linear(F.silu(gate) * up, pack_linear(_slice(down, e)))
                expected.index_add_(0, token, h * weights[token, slot, None])
            assert torch.equal(y, expected)
            with modules.reference_linears():
                ref = experts(x, weights, index)
            assert not torch.equal(y, ref) and ((y - ref).norm() / ref.norm()).item() < 0.03
    finally:
        modules.set_linear_kernel(old)
    with torch.no_grad():
        assert torch.equal(experts(x, weights, index), ref)  # uninstalled: the dequantize path again
