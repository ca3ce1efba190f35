"""quantized_linear (the MoE kernel's tiles on a dense matrix) against dequantize + matmul.

Reference: the canonical weight dequantized exactly (float64) times the activations quantized
exactly as the kernel does (moe_reference.fake_quantize_activations: per row and weight group,
int8, scale amax/127, fp32 rounding steps reproduced), in float64. What is left is the kernel's
fp32 arithmetic: per group an exact int32 dot, then two roundings of the scale products and two
fma roundings on the running sum, G groups in all, so
|err| <= 4 * (G + 4) * eps32 * sum_k |x_deq| * (|scale| q + |bias|)   (+ one bf16 rounding of y).
The int8 activations themselves are the kernel's documented approximation of float activations
(docs/moe_kernel.md): bounded separately against the float dequantize path.
"""

import pytest
import torch

from llmq.ops import dense_op, set_kernel_isa
from llmq.ops.dense_op import check_linear_args, quantized_linear
from llmq.ops.moe_reference import fake_quantize_activations
from llmq.ops.packing import pack_linear
from llmq.quant import QuantizedLinear, modules
from llmq.quant.formats import GroupQuantizedWeight, dequantize_canonical
from llmq.quant.quantize import quantize_weight
from llmq.quant.recipe import QuantConfig

EPS32 = torch.finfo(torch.float32).eps

needs_kernel = pytest.mark.skipif(not dense_op.quantized_linear_available(),
                                  reason="the compiled //cpp/moe:_moe_kernel.so is not built/loadable here")


@pytest.fixture
def installed():
    old = modules.set_linear_kernel(None)
    assert dense_op.install_dense_kernel()
    assert isinstance(modules.linear_kernel(), dense_op.DenseKernel)
    yield
    modules.set_linear_kernel(old)


def test_nothing_installed_on_import():
    assert not isinstance(modules.linear_kernel(), dense_op.DenseKernel)


def _weight(n, k, bits, group_size, symmetric, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, :: max(1, k // 7)] *= 6.0  # a few outlier columns
    cfg = QuantConfig(format="int", bits=bits, group_size=group_size, symmetric=symmetric)
    return quantize_weight(w, cfg, name="w")


def _reference(x, qw):
    gs = qw.group_size
    xd = fake_quantize_activations(x.float(), gs)
    wd = dequantize_canonical(qw).to(torch.float64)
    absw = dequantize_canonical(GroupQuantizedWeight(qw.qdata, qw.scale.abs(), qw.bias.abs(), qw.bits, gs, qw.shape,
                                                     qw.dtype)).to(torch.float64)
    groups = qw.shape[1] // gs
    bound = 4 * (groups + 4) * EPS32 * (xd.abs() @ absw.T)
    return xd @ wd.T, bound


FORMATS = [(4, 32, True), (4, 64, False), (4, 128, True), (4, 128, False), (8, 32, False), (8, 128, True),
           (4, None, True), (8, None, False)]


@needs_kernel
@pytest.mark.parametrize("bits,group_size,symmetric", FORMATS)
@pytest.mark.parametrize("t,n,k", [(1, 48, 256), (7, 17, 256), (13, 100, 512), (3, 1, 128), (6, 33, 384)])
def test_matches_dequantize_matmul(bits, group_size, symmetric, t, n, k):
    gs = group_size
    assert gs is None or k % gs == 0  # every K here is a multiple of every group size: no case is left out
    qw = _weight(n, k, bits, gs, symmetric, seed=n + k + t)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)) * 2.0
    y = quantized_linear(x, pack_linear(qw))
    ref, bound = _reference(x, qw)
    assert y.shape == (t, n) and y.dtype == torch.float32
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max err {err.max():.3g}, bound there {bound.flatten()[err.argmax()]:.3g}"


@needs_kernel
def test_bfloat16_input_and_leading_dims():
    qw = _weight(40, 256, 4, 64, False)
    x = torch.randn(2, 3, 256).to(torch.bfloat16)
    y = quantized_linear(x, pack_linear(qw))
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
    ref, bound = _reference(x.reshape(6, 256), qw)
    err = (y.reshape(6, 40).double() - ref).abs()
    assert (err <= bound + ref.abs() * 2.0**-8).all()


@needs_kernel
def test_threads_isa_and_token_blocking_bit_identical():
    qw = _weight(80, 512, 4, 128, True)
    x = torch.randn(11, 512)
    packed = pack_linear(qw)
    base = quantized_linear(x, packed, num_threads=1)
    assert torch.equal(base, quantized_linear(x, packed, num_threads=2))
    # one token at a time: same bits as inside a register block of many
    assert torch.equal(base, torch.cat([quantized_linear(x[i:i + 1], packed, num_threads=1) for i in range(11)]))
    old = set_kernel_isa("scalar")
    try:
        assert torch.equal(base, quantized_linear(x, packed, num_threads=2))
    finally:
        set_kernel_isa(old)


@needs_kernel
def test_int8_activations_close_to_float_path():
    """The activation rounding, against float activations: relative Frobenius error (~0.5-1.5% at
    these groups, docs/moe_kernel.md), bounded by 3% here."""
    qw = _weight(256, 1024, 4, 128, False)
    x = torch.randn(32, 1024)
    y = quantized_linear(x, pack_linear(qw)).double()
    exact = x.double() @ dequantize_canonical(qw).double().T
    assert ((y - exact).norm() / exact.norm()).item() < 0.03


@needs_kernel
def test_quantized_linear_module_uses_kernel_and_reference_switch(installed):
    qw = _weight(50, 256, 4, 32, True)
    bias = torch.randn(50)
    m = QuantizedLinear.from_quantized(qw, bias=bias)
    x = torch.randn(4, 9, 256)
    with torch.no_grad():
        y = m(x)
        assert torch.equal(y, quantized_linear(x, pack_linear(qw)) + bias)
        with modules.reference_linears():
            ref = m(x)
        assert torch.equal(ref, torch.nn.functional.linear(x, m._dequantized(256), bias))
        # new weights through load_state_dict: repacked, not the stale tiles
        qw2 = _weight(50, 256, 4, 32, True, seed=9)
        m2 = QuantizedLinear.from_quantized(qw2, bias=bias)
        m.load_state_dict(m2.state_dict())
        assert torch.equal(m(x), quantized_linear(x, pack_linear(qw2)) + bias)
    # grad needed: the reference path (the op has no backward)
    xg = x.clone().requires_grad_(True)
    y = m(xg)
    with modules.reference_linears(), torch.no_grad():
        assert torch.equal(y.detach(), m(x))
    y.sum().backward()
    assert xg.grad is not None


@needs_kernel
def test_formats_the_kernel_does_not_take_dequantize(installed):
    for bits, gs, k in [(3, 32, 128), (4, 16, 128), (6, 64, 128), (4, None, 48)]:
        qw = _weight(20, k, bits, gs, True)
        m = QuantizedLinear.from_quantized(qw)
        x = torch.randn(3, k)
        with torch.no_grad():
            y = m(x)
            with modules.reference_linears():
                assert torch.equal(y, m(x))


@needs_kernel
def test_export_keeps_the_dequantize_graph(installed):
    m = QuantizedLinear.from_quantized(_weight(32, 128, 4, 32, True))
    ep = torch.export.export(m, (torch.randn(2, 128),))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not any("quantized_linear" in t for t in targets), targets


BAD = [
    (dict(x=torch.zeros(2, 128, dtype=torch.float16)), "x must be float32 or bfloat16"),
    (dict(bits=3), "bits must be 4 or 8"),
    (dict(group_size=48), "group_size 48 must be a positive multiple of 32 dividing K=128"),
    (dict(qdata=torch.zeros(2, 100, dtype=torch.uint8)), "qdata must be torch.uint8 [N/16, 1024]"),
    (dict(sb=torch.zeros(2, 64, dtype=torch.float32)), "sb must be float32 or bfloat16 [2, 128]"),
    (dict(out_features=16), "out_features=16 does not fit 32 packed rows"),
    (dict(num_threads=-1), "num_threads must be >= 0"),
]


@needs_kernel
@pytest.mark.parametrize("change,message", BAD)
def test_bad_arguments_same_message_in_fake_and_cpu_kernel(change, message):
    args = dict(x=torch.zeros(2, 128), qdata=torch.zeros(2, 1024, dtype=torch.uint8),
                sb=torch.zeros(2, 128, dtype=torch.float32), out_features=30, bits=4, group_size=32, num_threads=0)
    args.update(change)
    with pytest.raises(ValueError) as fake:
        check_linear_args(**args)
    with pytest.raises(ValueError) as real:
        torch.ops.llmq.quantized_linear(*args.values())
    assert message in str(fake.value) and message in str(real.value)
    assert str(fake.value) == str(real.value).split("\n")[0]
