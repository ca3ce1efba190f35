"""The compiled quantization kernel (cpp/quant) against the torch reference path: every
output byte and every scale/bias bit pattern must be identical, on every ISA path the CPU
has, for random and adversarial inputs (ties, zeros, subnormals, extremes, odd shapes)."""


import pytest
import torch
from hypothesis import given, settings, strategies as st

from llmq.quant import QuantConfig, _native, native_kernel_available, quantize_weight
from llmq.quant.formats.int_affine import quantize_weight_torch

_ORDER = ("scalar", "avx2", "avx512")


def _require_kernel():
    """These tests are about the compiled kernel: without it they fail (with how to get it),
    never skip. Under Bazel it is a data dependency of this test."""
    if not native_kernel_available():
        pytest.fail(f"the quantization kernel is not loaded ({_native.native_kernel_error()}); build "
                    "//cpp/quant:_quant_kernel.so (bazel test does) or set LLMQ_QUANT_KERNEL to it")


def _isas():
    """Every ISA path this CPU can run (the others are a platform condition: not tested here)."""
    if not native_kernel_available():
        return ["auto"]
    return list(_ORDER[: _ORDER.index(_native.best_isa()) + 1])


def _assert_same(got, want, what):
    qd, sc, bi = got
    assert torch.equal(qd, want.qdata.reshape(qd.shape)), f"{what}: qdata differs at {(qd != want.qdata.reshape(qd.shape)).nonzero()[:3].tolist()}"
    for name, a, b in (("scale", sc, want.scale), ("bias", bi, want.bias)):
        a, b = a.view(torch.int32), b.reshape(a.shape).view(torch.int32)  # bit patterns, so -0.0 != +0.0
        assert torch.equal(a, b), f"{what}: {name} differs at {(a != b).nonzero()[:3].tolist()}"


def _check_all_paths(w, config, what, threads=(1, 2)):
    _require_kernel()
    want = quantize_weight_torch(w, config)
    gs = want.group_size
    rows = w.reshape(-1, w.shape[-1])
    for isa in _isas():
        for t in threads:
            got = _native.quantize_rows(rows, config.bits, gs, config.symmetric, threads=t, isa=isa)
            assert got is not None, f"{what}: kernel reported an error on finite input"
            _assert_same(got, want, f"{what} isa={isa} threads={t}")
    return want


def _random_finite_bits(shape, dtype, gen):
    """Uniformly random bit patterns of `dtype` with the non-finite ones replaced by zero:
    every exponent (subnormals and the largest values included) shows up."""
    if dtype == torch.float32:
        bits = torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(torch.int32)
        w = bits.view(torch.float32)
    else:
        bits = torch.randint(-(2**15), 2**15 - 1, shape, generator=gen, dtype=torch.int32).to(torch.int16)
        w = bits.view(dtype)
    return torch.where(torch.isfinite(w), w, torch.zeros((), dtype=dtype))


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("symmetric", (True, False))
@pytest.mark.parametrize("bits", range(2, 9))
def test_random_normal_weights(dtype, symmetric, bits):
    gen = torch.Generator().manual_seed(bits * 7 + symmetric)
    w = (torch.randn(24, 192, generator=gen) * 0.05).to(dtype)
    for gs in (16, 32, 64, 96, None):  # 96 leaves vector tails; None = whole row
        _check_all_paths(w, QuantConfig(bits=bits, group_size=gs, symmetric=symmetric), f"{dtype} b{bits} gs{gs}")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("symmetric", (True, False))
def test_every_exponent(dtype, symmetric):
    """Random bit patterns: subnormals, groups of wildly different magnitudes, extremes."""
    gen = torch.Generator().manual_seed(11 + symmetric)
    w = _random_finite_bits((32, 256), dtype, gen)
    if not symmetric and dtype == torch.bfloat16:  # keep max - min finite in float32
        w = w.clamp(-1e38, 1e38)
    for bits in (2, 3, 4, 8):
        for gs in (16, 32, 256):
            _check_all_paths(w, QuantConfig(bits=bits, group_size=gs, symmetric=symmetric), f"{dtype} b{bits} gs{gs}", threads=(2,))


def test_every_exponent_float32_symmetric():
    gen = torch.Generator().manual_seed(5)
    w = _random_finite_bits((16, 256), torch.float32, gen)
    for bits in (2, 4, 5, 8):
        _check_all_paths(w, QuantConfig(bits=bits, group_size=32, symmetric=True), f"fp32 b{bits}", threads=(2,))


@pytest.mark.parametrize("symmetric", (True, False))
@pytest.mark.parametrize("bits", range(2, 9))
def test_rounding_ties(symmetric, bits):
    """Groups whose w/scale land exactly on k + 1/2 (and whose zero point is a tie too):
    torch.round rounds half to even, so must the kernel."""
    gen = torch.Generator().manual_seed(bits)
    qmax = (1 << bits) - 1
    rows = []
    for r in range(16):
        step = 2.0 ** int(torch.randint(-12, 4, (1,), generator=gen))
        if symmetric:  # scale = amax / (qmax/2) = step exactly
            g = torch.randint(-qmax, qmax + 1, (32,), generator=gen).float() * (step / 2)
            g[0] = qmax / 2 * step * (1 if r % 2 else -1)
        else:  # range = qmax * step, so scale = step; min = -(j + 1/2) * step
            lo = -(int(torch.randint(0, qmax, (1,), generator=gen)) + 0.5) * step
            g = lo + torch.randint(0, 2 * qmax + 1, (32,), generator=gen).float() * (step / 2)
            g[0], g[1] = lo, lo + qmax * step
        rows.append(g)
    w = torch.stack(rows)
    ref = _check_all_paths(w, QuantConfig(bits=bits, group_size=32, symmetric=symmetric), f"ties b{bits}")
    assert (ref.scale > 0).all()  # the construction really produced exact scales
    for dtype in (torch.bfloat16, torch.float16):
        _check_all_paths(w.to(dtype), QuantConfig(bits=bits, group_size=32, symmetric=symmetric), f"ties {dtype}")


@pytest.mark.parametrize("symmetric", (True, False))
def test_zero_tiny_and_extreme_groups(symmetric):
    """All-zero and signed-zero groups, subnormal groups (the smallest-normal scale clamp),
    constant groups, one-sided groups and values near the float32 maximum."""
    fmin = torch.finfo(torch.float32).smallest_normal
    big = 1e38 if symmetric else 1.5e38  # asymmetric: max - min must stay finite
    groups = [
        torch.zeros(16),
        -torch.zeros(16),
        torch.full((16,), 1e-45),
        torch.linspace(-fmin, fmin, 16),
        torch.linspace(-3 * fmin, 7 * fmin, 16),
        torch.full((16,), 3.25),
        torch.full((16,), -0.125),
        torch.linspace(0.5, 2.0, 16),
        torch.linspace(-2.0, -0.5, 16),
        torch.linspace(-big, big, 16),
        torch.tensor([big] + [0.0] * 15),
    ]
    w = torch.stack([torch.cat(groups[i:] + groups[:i]) for i in range(len(groups))])  # [11, 176]
    for bits in range(2, 9):
        _check_all_paths(w, QuantConfig(bits=bits, group_size=16, symmetric=symmetric), f"extreme b{bits}")


@pytest.mark.parametrize(
    "shape,bits,gs",
    [((40,), 4, 8), ((6,), 4, None), ((3, 4), 2, None), ((2, 5, 48), 3, 24), ((3, 7, 40), 5, 40),
     ((4, 16, 64), 6, 16), ((2, 3, 24), 7, 8), ((1, 1, 2), 8, None), ((5, 1000), 8, 200)],
)
def test_shapes_and_packings(shape, bits, gs):
    gen = torch.Generator().manual_seed(len(shape) * 100 + bits)
    w = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    for symmetric in (True, False):
        config = QuantConfig(bits=bits, group_size=gs, symmetric=symmetric)
        _check_all_paths(w, config, f"{shape} b{bits}")
        got, want = quantize_weight(w, config), quantize_weight_torch(w, config)  # the public dispatch
        assert got.shape == want.shape and got.qdata.shape == want.qdata.shape and got.dtype == w.dtype
        assert torch.equal(got.qdata, want.qdata) and torch.equal(got.scale, want.scale) and torch.equal(got.bias, want.bias)


def test_many_rows_split_over_threads():
    """Odd row counts split over up to 8 threads (the kernel gives each thread >= 2^16
    elements, so this 3-D expert stack of ~770k elements really uses all 8)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(5, 301, 512, generator=gen).to(torch.bfloat16)
    _check_all_paths(w, QuantConfig(bits=4, group_size=32, symmetric=False), "stack", threads=(1, 2, 3, 8))


@settings(max_examples=60, deadline=None)
@given(
    bits=st.integers(2, 8),
    symmetric=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 5),
    groups=st.integers(1, 6),
    gs=st.sampled_from([8, 16, 24, 32, 40, 48, 64, 80]),
    log_mag=st.integers(-140, 30),
    seed=st.integers(0, 2**31 - 1),
)
def test_hypothesis_layouts(bits, symmetric, dtype, rows, groups, gs, log_mag, seed):
    """Random layouts and magnitudes (down to subnormal groups): kernel == torch, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, groups * gs, generator=gen, dtype=torch.float64) * 2.0**log_mag
    w = w.to(torch.float32).to(dtype)  # fp16 saturates large magnitudes to +-inf: keep it finite
    w = torch.where(torch.isfinite(w), w, torch.zeros((), dtype=dtype))
    _check_all_paths(w, QuantConfig(bits=bits, group_size=gs, symmetric=symmetric), f"b{bits} gs{gs} 2^{log_mag}", threads=(2,))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_not_finite_raises_the_reference_error(bad, dtype):
    _require_kernel()
    w = torch.randn(4, 3, 64).to(dtype)
    w[2, 1, 37] = bad
    config = QuantConfig(bits=4, group_size=32)
    with pytest.raises(ValueError) as want:
        quantize_weight_torch(w, config, name="layers.0.mlp.experts")
    with pytest.raises(ValueError) as got:
        quantize_weight(w, config, name="layers.0.mlp.experts")
    assert str(got.value) == str(want.value)
    assert "layers.0.mlp.experts" in str(got.value) and "[2, 1, 37]" in str(got.value)
    for isa in _isas():
        assert _native.quantize_rows(w.reshape(-1, 64), 4, 32, True, threads=2, isa=isa) is None


def test_range_overflow_raises_the_reference_error():
    _require_kernel()
    w = torch.zeros(2, 32)
    w[1, 3], w[1, 4] = -3e38, 3e38  # max - min overflows float32
    config = QuantConfig(bits=4, group_size=32, symmetric=False)
    with pytest.raises(ValueError, match="overflows float32") as got:
        quantize_weight(w, config, name="lm_head.weight")
    assert "lm_head.weight" in str(got.value)
    assert _native.quantize_rows(w, 4, 32, False) is None


def test_without_the_kernel_the_torch_path_is_used(monkeypatch):
    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.setattr(_native, "_error", "disabled for this test")
    assert not native_kernel_available() and _native.native_kernel_error() == "disabled for this test"
    w = torch.randn(8, 64)
    config = QuantConfig(bits=4, group_size=32)
    got, want = quantize_weight(w, config), quantize_weight_torch(w, config)
    assert torch.equal(got.qdata, want.qdata) and torch.equal(got.scale, want.scale)


def test_bad_arguments_are_rejected_by_the_kernel():
    _require_kernel()
    w = torch.randn(2, 48)
    with pytest.raises(ValueError, match="does not divide"):
        _native.quantize_rows(w, 4, 32, True)
    with pytest.raises(ValueError, match="unknown isa"):
        _native.quantize_rows(w, 4, 16, True, isa="neon")
    with pytest.raises(ValueError):
        _native.set_num_threads(-1)


_CONCURRENT_FIRST_LOAD = """
import importlib.util, threading, time
real, inside, most = importlib.util.module_from_spec, [0], [0]
def counted(spec):  # how many threads initialise an extension at once; the sleep widens the window
    inside[0] += 1
    most[0] = max(most[0], inside[0])
    time.sleep(0.05)
    try:
        return real(spec)
    finally:
        inside[0] -= 1
importlib.util.module_from_spec = counted
from llmq.quant import _native
barrier, got = threading.Barrier(6), []
def first_use():
    barrier.wait()
    got.append(_native._load())
threads = [threading.Thread(target=first_use) for _ in range(6)]
[t.start() for t in threads]
[t.join() for t in threads]
assert got[0] is not None, _native.native_kernel_error()
assert most[0] == 1, f"{most[0]} threads initialised the kernel at once"
assert all(m is got[0] for m in got), "the kernel was loaded more than once"
assert all(hasattr(m, "count_nonfinite") and hasattr(m, "quantize_nvfp4") for m in got)
print("one module")
"""


def test_first_uses_from_several_threads_load_the_kernel_once():
    """The reader's read-ahead thread and the consumer can reach for the kernel at the same
    moment: in a fresh interpreter, six threads asking at once initialise it one at a time and
    all get the one complete module."""
    import os
    import subprocess
    import sys

    _require_kernel()
    env = dict(os.environ, LLMQ_QUANT_KERNEL=_native._module.__file__, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", _CONCURRENT_FIRST_LOAD], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0 and "one module" in proc.stdout, proc.stderr[-2000:]
