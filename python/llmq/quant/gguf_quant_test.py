"""The gguf-quant formats (q4_0 .. q6_k) against gguf-py, the independent reference.

Every quantized weight, written as GGUF blocks by encode_blocks, dequantizes with gguf-py's own
`gguf.quants.dequantize` to exactly llmq's `dequantize_canonical` values, and llmq's GGUF import
(gguf_blocks.decode) reads those blocks back to the same codes, scales and biases. Blocks written by
gguf-py's quantizer (Q4_0 .. Q8_0) are re-encoded byte for byte after llmq imports them.
"""

import gguf
import numpy as np
import pytest
import torch

from llmq.quant import QuantConfig, quantize_weight
from llmq.quant.formats import GroupQuantizedWeight, dequantize_canonical, gguf_quant as gq
from llmq.quant.formats.gguf_blocks import decode

T = gguf.GGMLQuantizationType
KINDS = list(gq.BLOCK_TYPES)


def weight(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * 0.05
    w.view(-1, shape[-1])[0, :256] = 0.0  # an all-zero super-block
    w.view(-1, shape[-1])[1, :32] = 3.0  # a constant, outlying group
    w.view(-1, shape[-1])[2, 5] = -1.5  # a negative extreme
    return w


def config(kind):
    t = gq.BLOCK_TYPES[kind]
    return QuantConfig(format=kind, bits=t.bits, group_size=t.group, symmetric=t.symmetric)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_dequantize_like_gguf_py(kind, dtype):
    t = gq.BLOCK_TYPES[kind]
    w = weight((3, 8, 512)).to(dtype)
    v = quantize_weight(w, config(kind), name="w")
    blocks = gq.encode_blocks(kind, v, name="w")
    block, nbytes = gguf.GGML_QUANT_SIZES[T[t.ggml]]
    assert blocks.shape == (3, 8, 512 // block * nbytes)
    ref = gguf.quants.dequantize(blocks, T[t.ggml])
    ours = dequantize_canonical(v).numpy()
    assert np.array_equal(ref, ours)
    back = decode(t.ggml, torch.from_numpy(np.ascontiguousarray(blocks)), (3, 8, 512), native=False)
    assert torch.equal(back.qdata, v.qdata) and torch.equal(back.scale, v.scale) and torch.equal(back.bias, v.bias)
    # the scales are the block type's: float16 d (K-quants: d times small integers)
    assert torch.equal(v.scale.abs().amax(), v.scale.abs().amax().half().float()) or kind.endswith("_k")
    rel = float(((dequantize_canonical(v) - w.float()) ** 2).mean() / (w.float() ** 2).mean())
    assert rel < {2: 0.3, 3: 8e-2, 4: 2e-2, 5: 5e-3, 6: 2e-3, 8: 1e-4}[t.bits]


@pytest.mark.parametrize("ggml", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_gguf_py_blocks_reencode_byte_for_byte(ggml):
    w = weight((16, 256)).numpy()
    blocks = gguf.quants.quantize(w, T[ggml])
    imported = decode(ggml, torch.from_numpy(blocks.copy()), (16, 256), native=False)
    assert np.array_equal(gq.encode_blocks(gq.BY_GGML[ggml], imported, name="w"), blocks)


def test_k_quant_import_reencodes_to_same_values():
    """Random K-quant blocks (every code and sub-scale pattern) imported by llmq encode back to blocks of the
    same values (a factorisation of the sub-block scales may differ, the products do not)."""
    rng = np.random.default_rng(1)
    for ggml, (nbytes, half_at) in {"Q2_K": (84, [80, 82]), "Q3_K": (110, [108]), "Q4_K": (144, [0, 2]),
                                    "Q5_K": (176, [0, 2]), "Q6_K": (210, [208])}.items():
        raw = rng.integers(0, 256, size=(32, nbytes), dtype=np.uint8)
        for off in half_at:
            raw[:, off:off + 2] = (np.exp2(rng.uniform(-14, 2, 32)) * rng.choice([-1, 1], 32)).astype(
                "<f2").view(np.uint8).reshape(32, 2)
        if ggml in ("Q4_K", "Q5_K", "Q2_K"):  # d, dmin >= 0 as ggml writes them
            at = half_at[0]
            raw[:, at:at + 4] = np.abs(raw[:, at:at + 4].copy().view("<f2")).view(np.uint8)
        imported = decode(ggml, torch.from_numpy(raw.copy()), (4, 8 * 256), native=False)
        again = gq.encode_blocks(gq.BY_GGML[ggml], imported, name="w")
        assert np.array_equal(gguf.quants.dequantize(again, T[ggml]), gguf.quants.dequantize(raw, T[ggml]).reshape(
            4, -1)), ggml


def test_not_exact_is_refused_in_one_line():
    v = quantize_weight(weight((4, 256)), QuantConfig(bits=4, group_size=32, symmetric=True), name="m.w")  # float32 d
    with pytest.raises(gq.NotExact, match=r"^m\.w: not exactly Q4_0: a scale is not a float16 value$"):
        gq.encode_blocks("q4_0", v, name="m.w")
    with pytest.raises(gq.NotExact, match="are not Q6_K blocks"):
        gq.encode_blocks("q6_k", v, name="m.w")


def test_config_and_shape_checks():
    with pytest.raises(ValueError, match=r"'q4_k' \(Q4_K\) is bits=4, group_size=32, symmetric=False"):
        QuantConfig(format="q4_k", bits=4, group_size=32, symmetric=True)
    fmt = gq.GGUFQuantFormat()
    assert fmt.shape_problem(config("q4_k"), (8, 640)) == "q4_k (Q4_K) needs rows of a multiple of 256 elements, got K=640"
    assert fmt.shape_problem(config("q4_0"), (8, 640)) is None
    with pytest.raises(ValueError, match="K=640"):
        quantize_weight(torch.zeros(2, 640), config("q6_k"), name="w")


@pytest.mark.parametrize("kind", KINDS)
def test_packed_bits_are_the_blocks(kind):
    v = quantize_weight(weight((4, 512)), config(kind))
    assert gq.GGUFQuantFormat().packed_bits(v, config(kind)) == gq.encode_blocks(kind, v).nbytes * 8


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", ["search", "hqq"])
def test_methods_are_exact_and_never_worse_than_minmax(kind, method):
    """search and hqq (plain and importance-weighted) write blocks gguf-py reads back to llmq's values, and per
    block (super-block) their weighted squared error under the stored values is never above minmax's; over the
    tensor it is lower."""
    t = gq.BLOCK_TYPES[kind]
    w = torch.randn(16, 512, generator=torch.Generator().manual_seed(3)) * 0.05
    w[:, ::37] *= 6.0  # heavy-tailed columns
    imp = torch.rand(512, generator=torch.Generator().manual_seed(4)) ** 4 + 0.01
    cfg = QuantConfig(format=kind, bits=t.bits, group_size=t.group, symmetric=t.symmetric, method=method)
    m = quantize_weight(w, config(kind))
    for importance in (None, imp):
        v = quantize_weight(w, cfg, importance=importance)
        blocks = gq.encode_blocks(kind, v)
        assert np.array_equal(gguf.quants.dequantize(blocks, T[t.ggml]), dequantize_canonical(v).numpy())
        weight_of = 1.0 if importance is None else importance.double()

        def err(q, weight_of=weight_of):
            return (((dequantize_canonical(q).double() - w.double()) ** 2) * weight_of).reshape(16, -1, t.block).sum(-1)

        assert bool((err(v) <= err(m) * (1 + 1e-12)).all())
        assert float(err(v).sum()) < (0.97 if method == "search" else 1.0) * float(err(m).sum()), (kind, method)


def _with_exact_halves(shape, seed):
    """Random groups of 32, and groups whose values sit exactly half way between two codes under llama.cpp's
    own d (d = 1: the extreme is -2^(b-1) for q*_0, 127 for q8_0; q*_1 min 0 and max 2^b - 1)."""
    w = weight(shape, seed)
    g = w.view(-1, 32)
    halves = torch.arange(32, dtype=torch.float32) % 7 - 3.5  # -3.5 .. 2.5, all halves
    g[3] = halves
    g[3, 0] = -8.0  # q4_0: d = 1
    g[4] = halves
    g[4, 0] = -16.0  # q5_0: d = 1
    g[5] = halves.abs()
    g[5, 0], g[5, 1] = 0.0, 15.0  # q4_1: d = 1, m = 0
    g[6] = halves.abs()
    g[6, 0], g[6, 1] = 0.0, 31.0  # q5_1
    g[7] = halves * 3
    g[7, 0] = 127.0  # q8_0: d = 1
    g[8] = -g[7]
    g[9] = 0.0  # an all-zero group (d = -0.0 for q*_0)
    return w


@pytest.mark.parametrize("ggml", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_minmax_is_llama_cpp_reference_byte_for_byte(ggml, seed):
    """llmq's minmax of the blocks of 32 writes exactly the bytes of gguf-py's quantizer (llama.cpp's reference
    rounding: truncated x / d + 2^(b-1) + 0.5, half away from zero for Q8_0), exact halves included."""
    kind = gq.BY_GGML[ggml]
    w = _with_exact_halves((6, 8, 256), seed) * (1.0 if seed < 2 else 300.0)
    v = quantize_weight(w, config(kind), name="w")
    ours = gq.encode_blocks(kind, v, name="w")
    ref = gguf.quants.quantize(w.numpy(), T[ggml])
    assert ours.shape == ref.shape and np.array_equal(ours, ref)
    if seed == 0 and ggml != "Q8_0":  # the exact halves round up, not to even
        g = w.view(-1, 32)
        row = {"Q4_0": 3, "Q5_0": 4, "Q4_1": 5, "Q5_1": 6}[ggml]
        deq = dequantize_canonical(v).view(-1, 32)[row]
        assert bool((deq[2:] - g[row, 2:] == 0.5).all())


@pytest.mark.parametrize("kind", KINDS)
def test_fit_then_round_columns_is_the_quantizer(kind):
    """The two steps a column-wise method (GPTQ) uses: fit a run's stored parameters, then round any columns with
    them held fixed; column by column they give the quantizer's own codes and values, and the fitted parameters
    are ones the block stores (encode_blocks takes them)."""
    from llmq.quant.formats import gguf_fit
    from llmq.quant.formats.int_affine import pack_bits

    t = gq.BLOCK_TYPES[kind]
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(5)) * 0.02
    imp = torch.rand(512, generator=torch.Generator().manual_seed(6)) + 0.05
    for method in ("minmax", "search", "hqq"):
        scale, bias = gguf_fit.fit(kind, x, method=method, importance=None if method == "minmax" else imp)
        whole = gguf_fit.round_codes(kind, x, scale, bias)
        cols = [gguf_fit.round_columns(kind, x[:, j:j + 1], scale, bias, j) for j in range(512)]
        assert torch.equal(torch.cat([c[0] for c in cols], 1), whole)
        v = GroupQuantizedWeight(qdata=pack_bits(whole.to(torch.uint8), t.bits), scale=scale, bias=bias, bits=t.bits,
                                 group_size=t.group, shape=(8, 512), dtype=torch.float32)
        assert torch.equal(torch.cat([c[1] for c in cols], 1), dequantize_canonical(v))
        blocks = gq.encode_blocks(kind, v)
        assert np.array_equal(gguf.quants.dequantize(blocks, T[t.ggml]), dequantize_canonical(v).numpy())
        if method != "minmax" or t.sub is not None:  # (minmax of the blocks of 32 takes llama.cpp's own codes)
            q = quantize_weight(x, QuantConfig(format=kind, bits=t.bits, group_size=t.group, symmetric=t.symmetric,
                                               method=method), importance=None if method == "minmax" else imp)
            assert torch.equal(q.scale, scale) and torch.equal(q.bias, bias) and torch.equal(q.qdata, v.qdata)
