"""Method "search" against a plain exhaustive reference over the same candidate set.

The reference below rebuilds every candidate of every group independently (numpy, one group
at a time, float32 arithmetic for the scale/codes as docs/formats.md prescribes, the mantissa
rounding by frexp/ldexp instead of bit tricks) and computes each candidate's squared error in
float64; the error of what quantize_weight returns must equal the smallest of them.
"""

import numpy as np
import pytest
import torch

from llmq.quant import QuantConfig, QuantRecipe, dequantize, quantize_weight
from llmq.quant.search import SEARCH_FACTORS

F32 = np.float32


def round_significant(s, sig_bits):
    """Round a positive float32 to sig_bits significant bits, nearest-even (frexp/ldexp)."""
    m, e = np.frexp(np.float64(s))  # s = m * 2^e, m in [0.5, 1)
    return F32(np.ldexp(np.round(m * 2.0**sig_bits), e - sig_bits))


def reference_candidates(w, bits, symmetric):
    """All (scale, zero) candidates of one float32 group w (zero is the integer offset)."""
    eps = F32(np.finfo(np.float32).tiny)
    lo, hi = min(F32(w.min()), F32(0)), max(F32(w.max()), F32(0))
    out = []
    if symmetric:
        base = max(F32(max(-lo, hi) / F32((2**bits - 1) / 2)), eps)
        for f in SEARCH_FACTORS:
            out.append((max(F32(base * F32(f)), eps), 2 ** (bits - 1)))
        return out
    qmax = 2**bits - 1
    base = max(F32((hi - lo) / F32(qmax)), eps)
    for f in SEARCH_FACTORS:
        s = round_significant(max(F32(base * F32(f)), eps), 24 - bits)
        for z in (-np.round(lo / s), qmax - np.round(hi / s), np.round(F32(qmax / 2) - F32((lo + hi) * F32(0.5)) / s)):
            out.append((s, int(min(max(z, 0), qmax))))
    return out


def reference_error(w, s, z, bits, symmetric):
    """Squared error in float64 of one group quantized with scale s and zero z."""
    scaled = np.round((w * (F32(1) / s)).astype(np.float32))
    if symmetric:
        q = np.clip(scaled, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1) + z
    else:
        q = np.clip(scaled + z, 0, 2**bits - 1)
    recon = (np.float64(s) * (q.astype(np.float64) - z)).astype(np.float32).astype(np.float64)
    return float(((recon - w.astype(np.float64)) ** 2).sum())


def group_errors(w, qw, gs):
    """float64 [groups] squared error of dequantize(qw) against w."""
    d = dequantize(qw, torch.float32).double() - w.float().double()
    return d.reshape(-1, gs).square().sum(-1)


def weights(kind, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(shape, generator=g)
    # heavy-tailed: Student-t with 2 degrees of freedom, a few groups all-zero or constant
    n = torch.randn(shape, generator=g)
    chi = torch.randn(shape + (2,), generator=g).square().sum(-1)
    w = n / (chi / 2).sqrt()
    w.view(-1)[:8] = 0.0
    w.view(-1)[8:16] = 0.25
    return w


@pytest.mark.parametrize("bits,symmetric", [(2, False), (3, False), (3, True), (4, True), (4, False), (8, False)])
def test_search_finds_exhaustive_minimum(bits, symmetric):
    gs = 32  # small enough to enumerate, large enough that every kind of candidate wins somewhere
    w = weights("heavy", (16, 64), seed=bits)
    qw = quantize_weight(w, QuantConfig(bits=bits, group_size=gs, symmetric=symmetric, method="search"), name="w")
    got = group_errors(w, qw, gs)
    groups = w.numpy().astype(np.float32).reshape(-1, gs)
    for i, grp in enumerate(groups):
        errs = [reference_error(grp, s, z, bits, symmetric) for s, z in reference_candidates(grp, bits, symmetric)]
        best = min(errs)
        assert abs(float(got[i]) - best) <= 1e-12 * best + 1e-300, (i, float(got[i]), best)


@pytest.mark.parametrize("kind", ["normal", "heavy"])
@pytest.mark.parametrize("bits,symmetric,gs", [(4, True, 32), (4, False, 32), (3, False, 64), (8, True, None), (2, True, 16)])
def test_search_never_worse_than_minmax(kind, bits, symmetric, gs):
    w = weights(kind, (32, 256), seed=7)
    rtn = quantize_weight(w, QuantConfig(bits=bits, group_size=gs, symmetric=symmetric), name="w")
    srch = quantize_weight(w, QuantConfig(bits=bits, group_size=gs, symmetric=symmetric, method="search"), name="w")
    size = gs or w.shape[-1]
    e_rtn, e_srch = group_errors(w, rtn, size), group_errors(w, srch, size)
    assert bool((e_srch <= e_rtn * (1 + 1e-12)).all())
    assert float(e_srch.sum()) < float(e_rtn.sum())  # and it does find better scales somewhere
    # same storage as any int weight: shapes, dtypes and the bias exactness of the format
    assert srch.qdata.shape == rtn.qdata.shape and srch.scale.dtype == rtn.scale.dtype == torch.float32
    if not symmetric:
        zero = -srch.bias.double() / srch.scale.double()
        assert torch.equal(zero, zero.round())


def test_search_of_bf16_and_3d_matches_float32_rows():
    w = weights("normal", (2, 8, 64), seed=3).to(torch.bfloat16)
    cfg = QuantConfig(bits=4, group_size=32, symmetric=False, method="search")
    a = quantize_weight(w, cfg, name="w")
    b = quantize_weight(w.float().reshape(16, 64), cfg, name="w")
    assert torch.equal(a.qdata.reshape(16, -1), b.qdata) and torch.equal(a.scale.reshape(16, -1), b.scale)
    assert torch.equal(a.bias.reshape(16, -1), b.bias) and a.shape == (2, 8, 64)


def test_minmax_unaffected_by_search_rows():
    # the default method's bytes do not depend on this feature: a weight quantized alone and
    # inside a recipe that also uses "search" elsewhere gives the same fields
    w = weights("normal", (8, 64), seed=5)
    a = quantize_weight(w, QuantConfig(bits=4, group_size=32), name="w")
    r = QuantRecipe.from_dict({"rules": [{"pattern": "a", "config": {"bits": 4, "group_size": 32, "method": "search"}},
                                         {"pattern": ".*", "config": {"bits": 4, "group_size": 32}}]})
    b = quantize_weight(w, r.get_config("b"), name="w")
    assert torch.equal(a.qdata, b.qdata) and torch.equal(a.scale, b.scale) and torch.equal(a.bias, b.bias)
    assert r.get_config("a").method == "search" and r.get_config("b").method == "minmax"


def test_recipe_method_round_trips_and_bad_methods_are_refused():
    cfg = QuantConfig.from_dict({"bits": 4, "group_size": 32, "method": "search"})
    assert QuantConfig.from_dict(cfg.to_dict()) == cfg and cfg.describe() == "int4 g32 sym search"
    with pytest.raises(ValueError, match="method='best' unknown"):
        QuantConfig(method="best")
    with pytest.raises(ValueError, match="does not apply to format 'mxfp4'; it takes 'minmax'"):
        QuantConfig(format="mxfp4", bits=4, group_size=32, method="search")


def test_search_names_bad_input():
    with pytest.raises(ValueError, match="w.down: weight has 1 NaN"):
        quantize_weight(torch.tensor([1.0, float("nan")] + [0.0] * 30), QuantConfig(method="search"), name="w.down")


def test_recipe_file_selects_search_per_rule(tmp_path):
    import json

    from llmq.quant import quantize_stream

    path = tmp_path / "recipe.json"
    path.write_text(json.dumps({"rules": [
        {"pattern": r".*\.down_proj", "config": {"bits": 4, "group_size": 32, "symmetric": False, "method": "search"}},
        {"pattern": ".*", "config": {"bits": 4, "group_size": 32, "symmetric": False}}]}))
    recipe = QuantRecipe.from_file(str(path))
    w = weights("heavy", (16, 64), seed=11)
    out = dict(quantize_stream(iter([("m.down_proj.weight", w), ("m.up_proj.weight", w)]), recipe))
    srch = quantize_weight(w, QuantConfig(bits=4, group_size=32, symmetric=False, method="search"), name="w")
    rtn = quantize_weight(w, QuantConfig(bits=4, group_size=32, symmetric=False), name="w")
    for got, want in ((out["m.down_proj.weight"], srch), (out["m.up_proj.weight"], rtn)):
        assert torch.equal(got.qdata, want.qdata) and torch.equal(got.scale, want.scale) and torch.equal(got.bias, want.bias)
    assert not torch.equal(srch.scale, rtn.scale)
    path.write_text(json.dumps({"rules": [{"pattern": ".*", "config": {"method": "mse"}}]}))
    with pytest.raises(ValueError, match="method='mse' unknown") as e:
        QuantRecipe.from_file(str(path))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["normal", "heavy"])
@pytest.mark.parametrize("bits,symmetric,gs", [(2, False, 16), (3, True, 32), (4, True, 32), (4, False, 32), (5, False, 64), (8, True, 128), (8, False, 32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_search_is_bit_identical_to_torch(kind, bits, symmetric, gs, threads):
    from llmq.quant import _native, search

    if not _native.search_available():  # a data dependency under Bazel: its absence is a failure, as in native_test
        pytest.fail(f"the quantization kernel with method 'search' is not loaded ({_native.native_kernel_error()}); "
                    "build //cpp/quant:_quant_kernel.so (bazel test does) or set LLMQ_QUANT_KERNEL to it")
    w = weights(kind, (24, 128), seed=bits + gs).to(torch.bfloat16).float() * 0.03
    g = w.reshape(24, -1, gs)
    ts, tz = search.search_qparams_torch(g, g.amin(-1), g.amax(-1), bits, symmetric)
    ns, nz = _native.search_qparams(w, gs, bits, symmetric, threads=threads)
    assert torch.equal(ns.view(torch.int32), ts.view(torch.int32))
    assert (nz is None) == (tz is None) and (nz is None or torch.equal(nz, tz))
