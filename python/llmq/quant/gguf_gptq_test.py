"""Method "gptq" on the GGUF block types (q4_0 .. q8_0, q2_k .. q6_k): lower output error than the same
type's own search and minmax rounding on correlated inputs, values that are exactly the block type's
(gguf-py's `gguf.quants.dequantize` of the written blocks equals llmq's dequantization bit for bit),
the degenerate case of a diagonal H (no error to move: exactly the type's importance-weighted search),
and the refusals."""

import gguf
import numpy as np
import pytest
import torch

from llmq.quant import QuantConfig, dequantize, quantize_weight
from llmq.quant.budget import output_error
from llmq.quant.formats import dequantize_canonical, gguf_quant as gq

KINDS = list(gq.BLOCK_TYPES)


def _spd(k, seed):
    """A random SPD X^T X: a Wishart-like matrix of correlated inputs plus a small ridge, with columns of
    different scale (as real activations have)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(k, k, generator=g) / k ** 0.5
    d = torch.exp(0.5 * torch.randn(k, generator=g))
    return (d[:, None] * (a @ a.T + 0.05 * torch.eye(k)) * d[None, :]).float()


def _weight(n, k, seed):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(100 + seed)) * 0.05


def _error(w, q, h):
    return output_error(w, dequantize(q, torch.float32), h)


@pytest.mark.parametrize("kind", ["q4_0", "q4_k"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("act_order", [True, False])
def test_lower_output_error_than_the_types_own_rounding(kind, seed, act_order):
    """tr((W - Q) H (W - Q)^T) of gptq below that of search (plain and importance-weighted by diag(H), the
    imatrix idea) and minmax, for the same block type, on a tiny matrix and a random SPD H."""
    k, n = 256, 16
    h, w = _spd(k, seed), _weight(n, k, seed)
    options = {"act_order": act_order, "block_size": 96}  # a super-block spans lazy blocks
    got = _error(w, quantize_weight(w, QuantConfig(format=kind, method="gptq", options=options), hessian=h), h)
    minmax = _error(w, quantize_weight(w, QuantConfig(format=kind, method="minmax")), h)
    search = _error(w, quantize_weight(w, QuantConfig(format=kind, method="search")), h)
    weighted = _error(w, quantize_weight(w, QuantConfig(format=kind, method="search"), importance=h.diagonal()), h)
    # measured: gptq 0.47-0.75x the better search's error on these inputs, 0.37-0.53x minmax's
    assert got < 0.85 * min(search, weighted), (got, search, weighted)
    assert got < 0.85 * minmax, (got, minmax)


@pytest.mark.parametrize("kind", KINDS)
def test_written_blocks_dequantize_like_gguf_py(kind):
    """gptq's result is exactly the block type: encode_blocks writes it without re-quantizing (it refuses
    values the type cannot hold), and gguf-py dequantizes those bytes to llmq's own values bit for bit."""
    t = gq.BLOCK_TYPES[kind]
    k, n = 512, 8
    h, w = _spd(k, 3), _weight(n, k, 3)
    w[0, :256] = 0.0  # an all-zero super-block
    w[1, 32:64] = 0.2  # a constant, outlying block
    for options in ({"block_size": 96}, {"act_order": False, "fit": "minmax", "block_size": 128}):
        q = quantize_weight(w, QuantConfig(format=kind, method="gptq", options=options), hessian=h, name="w")
        assert (q.bits, q.group_size, q.shape) == (t.bits, t.group, (n, k))
        blocks = gq.encode_blocks(kind, q, name="w")
        block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.ggml]]
        assert blocks.shape == (n, k // block * nbytes)
        ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[t.ggml])
        assert np.array_equal(ref, dequantize_canonical(q).numpy()), (kind, options)


@pytest.mark.parametrize("kind", ["q4_0", "q5_1", "q4_k", "q6_k"])
def test_a_diagonal_hessian_is_the_types_importance_weighted_search(kind):
    """With uncorrelated inputs (H diagonal) no rounding error moves to other columns (U is diagonal): gptq
    without activation order is exactly the block type's search weighted by diag(H)."""
    k, n = 256, 8
    g = torch.Generator().manual_seed(7)
    h = torch.diag(torch.exp(torch.randn(k, generator=g)))
    w = _weight(n, k, 7)
    q = quantize_weight(w, QuantConfig(format=kind, method="gptq", options={"act_order": False}), hessian=h)
    want = quantize_weight(w, QuantConfig(format=kind, method="search"), importance=h.diagonal())
    assert torch.equal(q.scale, want.scale) and torch.equal(q.bias, want.bias)
    assert torch.equal(q.qdata, want.qdata)


def test_refusals_are_one_line():
    w = torch.randn(8, 320)
    h = torch.eye(320)
    with pytest.raises(ValueError, match=r"^w: q4_k \(Q4_K\) needs rows of a multiple of 256 elements, got K=320$"):
        quantize_weight(w, QuantConfig(format="q4_k", method="gptq"), name="w", hessian=h)
    with pytest.raises(ValueError, match=r"^w: method 'gptq' rounds against the layer's inputs: .*--calibration_text\)$"):
        quantize_weight(w, QuantConfig(format="q4_0", method="gptq"), name="w")
    with pytest.raises(ValueError, match=r"^w: hessian= applies to method 'gptq' only"):
        quantize_weight(w, QuantConfig(format="q4_0", method="search"), name="w", hessian=h)
    with pytest.raises(ValueError, match=r"^QuantConfig\.method='gptq' does not apply to format 'fp8'"):
        QuantConfig(format="fp8", method="gptq")
    with pytest.raises(ValueError, match=r"^QuantConfig\.options: 'fit' must be one of"):
        QuantConfig(format="q4_k", method="gptq", options={"fit": "hqq"})
