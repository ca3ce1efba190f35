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


def reference_weighted_error(w, a, s, z, bits, symmetric):
    """Importance-weighted squared error in float64 of one group quantized with scale s and
    zero z (sum a_j (deq_j - w_j)^2; a = None: unweighted)."""
    scaled = np.round((w * (F32(1) / s)).astype(np.float32))
    if symmetric:
        q = np.clip(scaled, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1) + z
    else:
        q = np.clip(scaled + z, 0, 2**bits - 1)
    recon = (np.float64(s) * (q.astype(np.float64) - z)).astype(np.float32).astype(np.float64)
    terms = (recon - w.astype(np.float64)) ** 2
    return float((terms if a is None else terms * a.astype(np.float64)).sum())


def reference_error(w, s, z, bits, symmetric):
    """Squared error in float64 of one group quantized with scale s and zero z."""
    return reference_weighted_error(w, None, s, z, bits, symmetric)


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
def test_compiled_search_is_bit_identical_to_torch(kind, bits, symmetric, gs):
    from llmq.quant import _native, search

    if not _native.search_available():  # a data dependency under Bazel: its absence is a failure, as in native_test
        pytest.fail(f"the quantization kernel with method 'search' is not loaded ({_native.native_kernel_error()}); "
                    "build //cpp/quant:_quant_kernel.so (bazel test does) or set LLMQ_QUANT_KERNEL to it")
    w = weights(kind, (24, 128), seed=bits + gs).to(torch.bfloat16).float() * 0.03
    g = w.reshape(24, -1, gs)
    ts, tz = search.search_qparams_torch(g, g.amin(-1), g.amax(-1), bits, symmetric)
    for isa in ["scalar"] + (["avx2"] if _native.best_isa() in ("avx2", "avx512") else []):
        for threads in (1, 2):
            ns, nz = _native.search_qparams(w, gs, bits, symmetric, threads=threads, isa=isa)
            assert torch.equal(ns.view(torch.int32), ts.view(torch.int32)), (isa, threads)
            assert (nz is None) == (tz is None) and (nz is None or torch.equal(nz, tz)), (isa, threads)


def _require_search_quantize():
    from llmq.quant import _native

    if not _native.search_quantize_available():  # a data dependency under Bazel: its absence is a failure
        pytest.fail(f"the quantization kernel with search_quantize is not loaded ({_native.native_kernel_error()}); "
                    "build //cpp/quant:_quant_kernel.so (bazel test does) or set LLMQ_QUANT_KERNEL to it")


def torch_reference(w, cfg, monkeypatch, importance=None):
    """(qdata, scale, bias) of the torch reference alone: the int family's torch path with the
    kernel's search step switched off (search.search_qparams_torch chooses)."""
    from llmq.quant import _native
    from llmq.quant.formats import int_affine

    with monkeypatch.context() as m:
        m.setattr(_native, "search_available", lambda: False)
        gs = cfg.group_size_for(w.shape[-1])
        imp = None if importance is None else importance.float().contiguous()
        return int_affine.quantize_rows_torch(w, cfg.bits, gs, cfg.symmetric, cfg.method, "w", imp)


NATIVE_CASES = [  # bits, symmetric, group size, K: odd and large groups, every width
    (2, False, 16, 64), (2, True, 7, 56), (3, False, 24, 96), (3, True, 32, 128), (4, True, 32, 256),
    (4, False, 32, 256), (4, False, 20, 80), (5, True, 40, 80), (5, False, 128, 256), (6, False, 8, 64),
    (7, True, 16, 96), (8, False, 32, 96), (8, True, 128, 128), (4, True, 256, 256),
]


@pytest.mark.parametrize("bits,symmetric,gs,k", NATIVE_CASES)
@pytest.mark.parametrize("kind", ["normal", "heavy"])
def test_native_search_quantize_is_bit_identical_to_torch(bits, symmetric, gs, k, kind, monkeypatch):
    """The end-to-end kernel (search, codes, packing, bias) on both ISA paths and 1 or 2
    threads gives the torch reference's bytes; so does quantize_weight."""
    from llmq.quant import _native

    _require_search_quantize()
    w = (weights(kind, (12, k), seed=bits * 100 + gs) * 0.02).to(torch.bfloat16)
    cfg = QuantConfig(bits=bits, group_size=gs, symmetric=symmetric, method="search")
    ref = torch_reference(w, cfg, monkeypatch)
    isas = ["scalar"] + (["avx2"] if _native.best_isa() in ("avx2", "avx512") else [])
    for isa in isas:
        for threads in (1, 2):
            got = _native.search_quantize_rows(w, bits, gs, symmetric, threads=threads, isa=isa)
            assert got is not None
            for a, b, what in zip(got, ref, ("qdata", "scale", "bias")):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (isa, threads, what)
    qw = quantize_weight(w, cfg, name="w")
    assert torch.equal(qw.qdata, ref[0]) and torch.equal(qw.scale, ref[1]) and torch.equal(qw.bias, ref[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_native_search_quantize_other_dtypes_and_bad_values(dtype, monkeypatch):
    from llmq.quant import _native

    _require_search_quantize()
    w = (weights("heavy", (6, 64), seed=21) * 0.05).to(dtype)
    cfg = QuantConfig(bits=4, group_size=32, symmetric=False, method="search")
    ref = torch_reference(w, cfg, monkeypatch)
    got = _native.search_quantize_rows(w, 4, 32, False, threads=2)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    bad = w.clone()
    bad[3, 5] = float("inf")
    assert _native.search_quantize_rows(bad, 4, 32, False) is None  # the caller's reference path raises
    with pytest.raises(ValueError, match=r"w.up: weight has 1 NaN/Inf value\(s\), first at index \[3, 5\]"):
        quantize_weight(bad, cfg, name="w.up")
    huge = torch.tensor([[-3e38, 3e38] + [0.0] * 30])
    assert _native.search_quantize_rows(huge, 4, 32, False) is None
    with pytest.raises(ValueError, match="overflows float32"):
        quantize_weight(huge, cfg, name="w")



def log_normal_importance(k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(k, generator=g) * 1.5).float()


@pytest.mark.parametrize("bits,symmetric", [(2, False), (3, True), (4, True), (4, False), (8, False)])
def test_weighted_search_finds_exhaustive_weighted_minimum(bits, symmetric):
    gs = 32
    w = weights("heavy", (16, 64), seed=40 + bits)
    a = log_normal_importance(64, seed=bits)
    cfg = QuantConfig(bits=bits, group_size=gs, symmetric=symmetric, method="search")
    qw = quantize_weight(w, cfg, name="w", importance=a)
    d = (dequantize(qw, torch.float32).double() - w.double()).square() * a.double()
    got = d.reshape(-1, gs).sum(-1)
    groups = w.numpy().astype(np.float32).reshape(-1, gs)
    imps = np.tile(a.numpy().reshape(-1, gs), (16, 1))
    for i, grp in enumerate(groups):
        errs = [reference_weighted_error(grp, imps[i], s, z, bits, symmetric)
                for s, z in reference_candidates(grp, bits, symmetric)]
        best = min(errs)
        assert abs(float(got[i]) - best) <= 1e-12 * best + 1e-300, (i, float(got[i]), best)
    # the weights matter: somewhere a different candidate than the unweighted choice wins
    plain = quantize_weight(w, cfg, name="w")
    assert not torch.equal(plain.scale, qw.scale)


@pytest.mark.parametrize("bits,symmetric,gs,k", [(4, False, 32, 128), (3, True, 24, 96), (2, False, 16, 64), (8, True, 64, 128)])
def test_weighted_native_search_is_bit_identical_to_torch(bits, symmetric, gs, k, monkeypatch):
    from llmq.quant import _native, search

    _require_search_quantize()
    w = (weights("heavy", (10, k), seed=k + bits) * 0.03).to(torch.bfloat16)
    a = log_normal_importance(k, seed=gs)
    cfg = QuantConfig(bits=bits, group_size=gs, symmetric=symmetric, method="search")
    ref = torch_reference(w, cfg, monkeypatch, importance=a)
    isas = ["scalar"] + (["avx2"] if _native.best_isa() in ("avx2", "avx512") else [])
    for isa in isas:
        for threads in (1, 2):
            got = _native.search_quantize_rows(w, bits, gs, symmetric, importance=a, threads=threads, isa=isa)
            assert all(torch.equal(x, y) for x, y in zip(got, ref)), (isa, threads)
            g = w.float().reshape(10, -1, gs)
            ts, tz = search.search_qparams_torch(g, g.amin(-1), g.amax(-1), bits, symmetric, a.reshape(-1, gs))
            ns, nz = _native.search_qparams(w.float(), gs, bits, symmetric, importance=a, threads=threads, isa=isa)
            assert torch.equal(ns, ts) and (nz is None or torch.equal(nz, tz))
    qw = quantize_weight(w, cfg, name="w", importance=a)
    assert torch.equal(qw.qdata, ref[0]) and torch.equal(qw.scale, ref[1]) and torch.equal(qw.bias, ref[2])


@pytest.mark.parametrize("symmetric", [True, False])
def test_all_ones_importance_gives_unweighted_bytes_and_weights_help(symmetric):
    w = weights("heavy", (32, 128), seed=9).to(torch.bfloat16)
    cfg = QuantConfig(bits=4, group_size=32, symmetric=symmetric, method="search")
    plain = quantize_weight(w, cfg, name="w")
    ones = quantize_weight(w, cfg, name="w", importance=torch.ones(128))
    assert torch.equal(plain.qdata, ones.qdata) and torch.equal(plain.scale, ones.scale) and torch.equal(plain.bias, ones.bias)
    a = log_normal_importance(128, seed=3)
    weighted = quantize_weight(w, cfg, name="w", importance=a)

    def werr(qw):
        return ((dequantize(qw, torch.float32).double() - w.double()).square() * a.double()).reshape(-1, 32).sum(-1)

    e_w, e_p = werr(weighted), werr(plain)
    assert bool((e_w <= e_p * (1 + 1e-12)).all()) and float(e_w.sum()) < float(e_p.sum())


def test_importance_is_refused_for_minmax_and_checked():
    w = weights("normal", (4, 64), seed=1)
    with pytest.raises(ValueError, match="method 'hqq' or 'search' only"):
        quantize_weight(w, QuantConfig(bits=4, group_size=32), name="w", importance=torch.ones(64))
    with pytest.raises(ValueError, match="finite and > 0"):
        quantize_weight(w, QuantConfig(bits=4, group_size=32, method="search"), name="w", importance=torch.zeros(64))


def _adversarial(kind, shape, gen):
    if kind == "tiny":  # subnormal float32: the estimate's underflow slack
        return torch.randn(shape, generator=gen) * 1e-39
    if kind == "huge":
        return torch.randn(shape, generator=gen) * 1e37
    if kind == "grid":  # groups exactly on a grid: many candidates tie at error 0
        return torch.randint(-8, 8, shape, generator=gen).float() * 0.125
    w = torch.zeros(shape)  # sparse: mostly zeros, a few Student-t values
    n = torch.randn(shape, generator=gen) / torch.randn(shape + (2,), generator=gen).square().mean(-1).sqrt()
    w[..., ::7] = n[..., ::7]
    return w


@pytest.mark.parametrize("kind", ["tiny", "huge", "grid", "sparse"])
@pytest.mark.parametrize("bits,symmetric", [(2, False), (3, True), (4, True), (4, False), (8, False)])
def test_vector_path_matches_exact_path_on_adversarial_groups(kind, bits, symmetric):
    """The AVX2 path (bounded float32 estimates, skipped scales, exact recheck) chooses what the
    portable path (every candidate exactly, the reference's arithmetic) chooses, where the
    bounds are tightest: ties, subnormals, huge values, weights over many magnitudes."""
    from llmq.quant import _native

    _require_search_quantize()
    if _native.best_isa() not in ("avx2", "avx512"):
        pytest.skip("no AVX2 on this CPU: only the portable path exists")
    gen = torch.Generator().manual_seed(bits * 10 + symmetric)
    for gs in (13, 32):
        w = _adversarial(kind, (8, gs * 16), gen).contiguous()
        for imp in (None, torch.exp(torch.randn(gs * 16, generator=gen) * 3)):
            a = _native.search_qparams(w, gs, bits, symmetric, importance=imp, isa="scalar", threads=1)
            b = _native.search_qparams(w, gs, bits, symmetric, importance=imp, isa="avx2", threads=2)
            assert torch.equal(a[0].view(torch.int32), b[0].view(torch.int32)), (gs, imp is None)
            assert a[1] is None or torch.equal(a[1], b[1]), (gs, imp is None)
