"""The compiled FP quantizers (cpp/quant/fp_quant.h via llmq.quant._native_fp) against the torch references of
formats/fp8.py, mx.py and nvfp4.py: every code byte and every scale bit pattern identical, on every ISA path the
CPU has and several thread counts, for float32/bfloat16/float16 inputs that cover every
exponent (subnormals, extremes), exact ties on the E2M1 and E4M3 grids, zeros and -0.0,
stacked experts and caller-given scales. NaN/Inf make the kernel decline (the reference then
raises its message)."""

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch

from llmq.quant import _native, _native_fp
from llmq.quant.codecs import E2M1_VALUES
from llmq.quant.formats import fp8 as fp8_fmt, mx as mx_fmt, nvfp4 as nvfp4_fmt

_ORDER = ("scalar", "avx2", "avx512")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _require_kernel():
    if not _native.native_kernel_available():
        pytest.fail(f"the quantization kernel is not loaded ({_native.native_kernel_error()}); build "
                    "//cpp/quant:_quant_kernel.so (bazel test does) or set LLMQ_QUANT_KERNEL to it")


def _isas():
    _require_kernel()
    return list(_ORDER[: _ORDER.index(_native.best_isa()) + 1])


@contextlib.contextmanager
def _reference_only():
    none = lambda *a, **k: None  # noqa: E731
    with mock.patch.object(_native_fp, "quantize_fp8", none), mock.patch.object(_native_fp, "quantize_mx", none), \
            mock.patch.object(_native_fp, "quantize_nvfp4", none):
        yield


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _assert_same(got, want, what):
    assert type(got) is type(want), what
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {f.name} {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
            ab, bb = _bits(a), _bits(b)
            assert torch.equal(ab, bb), f"{what}: {f.name} differs at {(ab != bb).nonzero()[:3].tolist()}"
        else:
            assert a == b, f"{what}: {f.name} {a} != {b}"


def _fp8(w, isa, threads, granularity, scale=None):
    r = _native_fp.quantize_fp8(w, granularity, scale, block=128, threads=threads, isa=isa)
    assert r is not None, "kernel declined a finite input"
    return fp8_fmt.FP8Weight(data=r[0], scale=r[1], granularity=granularity, dtype=w.dtype)


def _mx(w, isa, threads, fmt):
    r = _native_fp.quantize_mx(w, mx_fmt.ELEMENTS[fmt].bits, block=32, threads=threads, isa=isa)
    assert r is not None, "kernel declined a finite input"
    return mx_fmt.MXWeight(codes=r[0], scale_e8m0=r[1], fmt=fmt, shape=tuple(w.shape), dtype=w.dtype)


def _nvfp4(w, isa, threads, global_scale=None):
    r = _native_fp.quantize_nvfp4(w, global_scale, block=16, threads=threads, isa=isa)
    assert r is not None, "kernel declined a finite input"
    return nvfp4_fmt.NVFP4Weight(codes=r[0], block_scale=r[1], global_scale=r[2], shape=tuple(w.shape), dtype=w.dtype)


def _check_all(w, what, fp8=True, threads=(1, 2), fp8_scale=None, nv_global=None):
    """Every format (FP8 granularities the shape allows) on every ISA path and thread count."""
    cases = []
    if fp8:
        for g in fp8_fmt.GRANULARITIES:
            if g == "block128" and (w.dim() < 2 or w.shape[-2] % 128 or w.shape[-1] % 128):
                continue
            cases.append((f"fp8-{g}", lambda g=g: fp8_fmt.quantize_fp8(w, g), lambda i, t, g=g: _fp8(w, i, t, g)))
    if w.shape[-1] % 32 == 0:
        for f in mx_fmt.NAMES:
            cases.append((f, lambda f=f: mx_fmt.quantize_mx(w, f), lambda i, t, f=f: _mx(w, i, t, f)))
    if w.shape[-1] % 16 == 0:
        cases.append(("nvfp4", lambda: nvfp4_fmt.quantize_nvfp4(w), lambda i, t: _nvfp4(w, i, t)))
    if fp8_scale is not None:
        cases.append(("fp8-tensor-given", lambda: fp8_fmt.quantize_fp8(w, "tensor", scale=fp8_scale),
                      lambda i, t: _fp8(w, i, t, "tensor", fp8_scale)))
    if nv_global is not None:
        cases.append(("nvfp4-given", lambda: nvfp4_fmt.quantize_nvfp4(w, global_scale=nv_global),
                      lambda i, t: _nvfp4(w, i, t, nv_global)))
    for name, ref, native in cases:
        with _reference_only():
            want = ref()
        for isa in _isas():
            for t in threads:
                _assert_same(native(isa, t), want, f"{what} {name} isa={isa} threads={t}")
        _assert_same(ref(), want, f"{what} {name} via the public function")


def _random_finite_bits(shape, dtype, gen):
    """Uniformly random bit patterns (every exponent: subnormals and the largest values),
    non-finite ones replaced by zero."""
    if dtype == torch.float32:
        w = torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(torch.int32).view(torch.float32)
    else:
        w = torch.randint(-(2**15), 2**15 - 1, shape, generator=gen, dtype=torch.int32).to(torch.int16).view(dtype)
    return torch.where(torch.isfinite(w), w, torch.zeros_like(w))


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_random_normal_and_spread_magnitudes(dtype):
    gen = torch.Generator().manual_seed(1)
    lo = -6 if dtype == torch.float16 else -35
    # each column its own magnitude, so blocks range from subnormal to large
    w = torch.randn(128, 256, generator=gen) * torch.logspace(lo, 4, 256)[torch.randperm(256, generator=gen)]
    _check_all(w.to(dtype), f"spread {dtype}")
    _check_all(torch.randn(2, 128, 256, generator=gen).to(dtype), f"experts {dtype}")
    _check_all(torch.randn(512, generator=gen).to(dtype), f"1-D {dtype}")


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_random_bit_patterns(dtype):
    """Every exponent of the input type, so per-block scales hit both clamps and underflow."""
    gen = torch.Generator().manual_seed(2)
    _check_all(_random_finite_bits((128, 256), dtype, gen), f"bits {dtype}")
    # blocks of one random exponent each: tiny blocks (subnormal scales, e8m0 byte 0) and huge ones
    w = _random_finite_bits((128, 256), dtype, gen).float().reshape(128, 16, 16)
    mag = torch.logspace(-44 if dtype == torch.float32 else -7, 4, 16)[torch.randint(0, 16, (128, 16, 1), generator=gen)]
    w = (torch.sign(w) * torch.rand(128, 16, 16, generator=gen) * mag).reshape(128, 256)
    _check_all(w.to(dtype), f"per-block magnitudes {dtype}")


def _e4m3_midpoints():
    """Every e4m3 value and every midpoint between neighbours (subnormal ones included)."""
    vals = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (vals[:-1] + vals[1:]) / 2  # exact in float32
    return torch.cat([vals, mids])


def test_ties_on_the_e4m3_grid():
    x = _e4m3_midpoints()
    x = torch.cat([x, -x])
    n = x.numel() // 32 * 32
    x = x[:n]
    x[0] = 448.0  # amax 448: FP8 scale 1, MXFP8 exponent 0, so the grid is hit exactly
    w = x.reshape(-1, 32)
    w[:, 0] = 448.0
    w = w.reshape(-1, 128) if w.numel() % 128 == 0 else w
    _check_all(w, "e4m3 ties", threads=(1, 2))
    for dtype in (torch.bfloat16, torch.float16):
        _check_all(w.to(dtype), f"e4m3 ties {dtype}", threads=(1,))


def test_ties_on_the_e2m1_grid_and_scale_ties():
    grid = torch.tensor(E2M1_VALUES)
    mids = torch.tensor((0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0))
    vals = torch.cat([grid, mids, -grid, -mids, torch.tensor([-0.0, 0.1, -0.1, 5.5, -5.99])])  # 35
    w = torch.zeros(64, 64)
    w.view(-1)[: vals.numel()] = vals
    w[:, ::16] = 6.0  # NVFP4 block amax 6 (with g = 1: s = 1, exact), MXFP4 amax 6: e = 0
    w[::2, 1::16] = -6.0
    rows = torch.randperm(64)
    w = torch.cat([w, w[rows].roll(1, dims=1)])
    _check_all(w, "e2m1 ties", nv_global=torch.tensor(1.0), fp8=False)
    # block amaxes whose NVFP4 scale s = amax / 6 is itself an e4m3 tie (1.0625 between 1 and 1.125)
    ties = _e4m3_midpoints()[127:]
    w2 = torch.randn(ties.numel(), 16)
    w2 = w2 / w2.abs().amax(dim=1, keepdim=True) * (6 * ties[:, None])
    w2 = w2.reshape(-1, 64)[:, :64] if w2.numel() % 64 == 0 else w2[: w2.shape[0] // 4 * 4].reshape(-1, 64)
    _check_all(w2, "nvfp4 scale ties", nv_global=torch.tensor(1.0), fp8=False)


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_zeros_and_negative_zero(dtype):
    _check_all(torch.zeros(128, 128, dtype=dtype), f"all-zero {dtype}")
    w = torch.randn(128, 128)
    w[3] = 0.0
    w[5] = -0.0
    w[:, 32:64] = 0.0
    w[7, :16] = -0.0
    _check_all(w.to(dtype), f"zero rows/blocks {dtype}")
    _check_all(torch.full((2, 128, 128), -0.0, dtype=dtype), f"-0.0 experts {dtype}")


def test_given_scales():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(3, 128, 256, generator=gen)
    _check_all(w, "given", fp8=False, fp8_scale=torch.tensor([0.001, 1e-30, 5.0]), nv_global=torch.tensor([1e-3, 1e-38, 1e20]))
    w2 = torch.randn(64, 64, generator=gen).to(torch.bfloat16)
    _check_all(w2, "given 2-D", fp8=False, fp8_scale=torch.tensor(0.004), nv_global=torch.tensor(2e-4))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_is_declined_and_reference_raises(bad):
    _require_kernel()
    for dtype in _DTYPES:
        w = torch.randn(128, 128).to(dtype)
        w[100, 77] = bad
        assert _native_fp.quantize_fp8(w, "tensor", block=128) is None
        assert _native_fp.quantize_fp8(w, "channel", block=128) is None
        assert _native_fp.quantize_fp8(w, "block128", block=128) is None
        assert _native_fp.quantize_fp8(w, "tensor", torch.tensor(1.0), block=128) is None
        assert _native_fp.quantize_mx(w, 4, block=32) is None
        assert _native_fp.quantize_nvfp4(w, block=16) is None
        assert _native_fp.quantize_nvfp4(w, torch.tensor(1.0), block=16) is None
        with pytest.raises(ValueError, match=r"W: weight has 1 NaN/Inf value\(s\), first at index \[100, 77\]"):
            nvfp4_fmt.quantize_nvfp4(w, name="W")


def test_unsupported_inputs_fall_back():
    _require_kernel()
    assert _native_fp.quantize_fp8(torch.randn(4, 30), "block128", block=128) is None  # K not a multiple of 128
    assert _native_fp.quantize_mx(torch.randn(4, 48), 4, block=32) is None
    assert _native_fp.quantize_nvfp4(torch.randn(4, 16).to(torch.float64), block=16) is None
    assert _native_fp.quantize_nvfp4(torch.randn(4, 32), torch.tensor(-1.0), block=16) is None  # reference raises
    with pytest.raises(ValueError, match="scales must be finite and positive"):
        nvfp4_fmt.quantize_nvfp4(torch.randn(4, 32), global_scale=torch.tensor(-1.0))
    # a non-contiguous view gives the same bytes as its contiguous copy
    w = torch.randn(64, 128).t()
    _assert_same(nvfp4_fmt.quantize_nvfp4(w), nvfp4_fmt.quantize_nvfp4(w.contiguous()), "transposed view")


def test_rows_split_across_threads():
    """Large enough (> 2 x 64k elements) that the kernel really starts threads; uneven splits."""
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(3, 384, 256, generator=gen) * torch.logspace(-20, 3, 256)).to(torch.bfloat16)
    isa = _isas()[-1]
    for name, ref, native in (
        ("fp8-tensor", lambda: fp8_fmt.quantize_fp8(w, "tensor"), lambda t: _fp8(w, isa, t, "tensor")),
        ("fp8-block128", lambda: fp8_fmt.quantize_fp8(w, "block128"), lambda t: _fp8(w, isa, t, "block128")),
        ("mxfp4", lambda: mx_fmt.quantize_mx(w, "mxfp4"), lambda t: _mx(w, isa, t, "mxfp4")),
        ("nvfp4", lambda: nvfp4_fmt.quantize_nvfp4(w), lambda t: _nvfp4(w, isa, t)),
    ):
        with _reference_only():
            want = ref()
        for t in (2, 3, 7):
            _assert_same(native(t), want, f"{name} threads={t}")


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_abs_max_equals_torch(dtype):
    gen = torch.Generator().manual_seed(5)
    for w in (_random_finite_bits((3, 64, 96), dtype, gen), torch.zeros(2, 8, 8, dtype=dtype),
              torch.full((4, 4), -0.0, dtype=dtype), (torch.randn(600, 256, generator=gen) * 1e-3).to(dtype)):
        for isa in _isas():
            for t in (1, 2):
                got = _native_fp.abs_max(w, per_expert=True, threads=t, isa=isa)
                want = w.abs().amax(dim=(-2, -1)).float() if w.dim() == 3 else w.abs().amax().float()
                assert got.shape == want.shape and torch.equal(_bits(got), _bits(want)), (dtype, isa, t)
    w = torch.randn(4, 4).to(dtype)
    w[1, 2] = float("inf")
    assert _native_fp.abs_max(w, per_expert=True) is None
