"""The compiled GGUF block decoder (cpp/quant/gguf_blocks.h) against two independent references.

1. The numpy reference in llmq.quant.formats.gguf_blocks (native=False): the same codes, scales
   and biases byte for byte (float32 bit patterns, NaN/Inf fields included).
2. gguf-py's own dequantizer (gguf.quants.dequantize): scale * q + bias equals its float32
   values bit for bit (exact zeros compared by value: gguf-py's d*(q-8) can give -0.0).

Blocks are random bytes with random float16 super-scales (every bit pattern of codes and
sub-scales), and, for the types gguf-py can quantize, blocks written by gguf-py's quantizer.
"""

import gguf
import numpy as np
import pytest
import torch

from llmq.quant import _native
from llmq.quant.formats import dequantize_canonical
from llmq.quant.formats.gguf_blocks import BLOCK_TYPES, decode, decode_into

T = gguf.GGMLQuantizationType
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# byte offsets of the float16 fields inside one block (all other bytes are free bits)
HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
GGUF_PY_QUANTIZES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


def random_blocks(type_name, shape, rng, specials=False):
    """uint8 [..., N, K/block*block_bytes] of random bytes with finite float16 fields (and, with
    specials, some Inf / -Inf / quiet NaN fields)."""
    block, block_bytes, _, _ = BLOCK_TYPES[type_name]
    *lead, k = shape
    n = int(np.prod(lead)) * (k // block)
    raw = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    for off in HALF_FIELDS[type_name]:
        mag = np.exp2(rng.uniform(-24, 10, size=n)) * rng.choice([-1.0, 1.0], size=n)
        bits = mag.astype(np.float16).view(np.uint16)
        if specials:
            pick = rng.integers(0, 8, size=n)
            bits = np.where(pick == 0, np.uint16(0x7C00), bits)
            bits = np.where(pick == 1, np.uint16(0xFC00), bits)
            bits = np.where(pick == 2, np.uint16(0x7E00), bits)
            bits = np.where(pick == 3, np.uint16(0x0000), bits)
        raw[:, off:off + 2] = bits.astype("<u2").reshape(-1, 1).view(np.uint8)
    return raw.reshape(*lead, k // block * block_bytes)


def bits_of(t):
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def assert_same(native, ref):
    assert native.bits == ref.bits and native.group_size == ref.group_size and native.shape == ref.shape
    for field in ("qdata", "scale", "bias"):
        a, b = getattr(native, field), getattr(ref, field)
        assert a.shape == b.shape and a.dtype == b.dtype, field
        assert torch.equal(bits_of(a), bits_of(b)), field


def assert_matches_gguf_py(got, raw, type_name):
    ref = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, T[type_name]), dtype=np.float32))
    ours = dequantize_canonical(got)
    assert ours.shape == ref.shape
    assert torch.equal(ours, ref)
    nonzero = ref != 0
    assert torch.equal(ours.view(torch.int32)[nonzero], ref.view(torch.int32)[nonzero])


def test_the_compiled_decoder_is_loaded():
    assert _native.gguf_decode_available(), _native.native_kernel_error()


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("shape", [(3, 256), (2, 5, 512), (1536, 1024)])
def test_native_equals_python_reference_and_gguf_py(type_name, shape):
    # (1536, 1024) is over 1 MiB of blocks for every type: the decoder splits it over threads
    rng = np.random.default_rng([TYPES.index(type_name), *shape])
    raw = random_blocks(type_name, shape, rng)
    native = decode(type_name, torch.from_numpy(raw), shape, native=True)
    ref = decode(type_name, torch.from_numpy(raw), shape, native=False)
    assert_same(native, ref)
    assert_matches_gguf_py(native, raw, type_name)


@pytest.mark.parametrize("type_name", TYPES)
def test_inf_and_nan_fields_decode_like_the_reference(type_name):
    rng = np.random.default_rng(7)
    raw = random_blocks(type_name, (64, 512), rng, specials=True)
    native = decode(type_name, torch.from_numpy(raw), (64, 512), native=True)
    ref = decode(type_name, torch.from_numpy(raw), (64, 512), native=False)
    assert_same(native, ref)
    assert not torch.isfinite(native.scale).all()  # the specials are there


@pytest.mark.parametrize("type_name", GGUF_PY_QUANTIZES)
def test_blocks_written_by_gguf_py_quantizer(type_name):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((48, 1024)) * rng.uniform(0.01, 3, size=(48, 1))).astype(np.float32)
    raw = gguf.quants.quantize(w, T[type_name])
    native = decode(type_name, torch.from_numpy(raw), (48, 1024), native=True)
    assert_same(native, decode(type_name, torch.from_numpy(raw), (48, 1024), native=False))
    assert_matches_gguf_py(native, raw, type_name)


@pytest.mark.parametrize("type_name", ["Q5_1", "Q6_K"])
@pytest.mark.parametrize("native", [True, False])
def test_chunked_decode_into_equals_one_whole_decode(type_name, native):
    block, block_bytes, bits, group = BLOCK_TYPES[type_name]
    rng = np.random.default_rng(11)
    raw = random_blocks(type_name, (7, 768), rng).reshape(-1)
    n_blocks = raw.size // block_bytes
    qdata = torch.empty(n_blocks * block * bits // 8, dtype=torch.uint8)
    scale = torch.empty(n_blocks * block // group)
    bias = torch.empty(n_blocks * block // group)
    qb, g = block * bits // 8, block // group
    for b0 in range(0, n_blocks, 5):  # uneven chunks that cut rows in the middle
        b1 = min(n_blocks, b0 + 5)
        decode_into(type_name, torch.from_numpy(raw[b0 * block_bytes:b1 * block_bytes]), qdata[b0 * qb:b1 * qb],
                    scale[b0 * g:b1 * g], bias[b0 * g:b1 * g], native=native)
    whole = decode(type_name, torch.from_numpy(raw), (7, 768), native=False)
    assert torch.equal(qdata, whole.qdata.reshape(-1))
    assert torch.equal(bits_of(scale), bits_of(whole.scale.reshape(-1)))
    assert torch.equal(bits_of(bias), bits_of(whole.bias.reshape(-1)))


@pytest.mark.parametrize("native", [True, False])
def test_truncated_block_data_is_one_clear_error(native):
    raw = random_blocks("Q4_K", (2, 256), np.random.default_rng(0)).reshape(-1)[:-10]
    with pytest.raises(ValueError) as e:
        decode("Q4_K", torch.from_numpy(raw), (2, 256), native=native)
    assert "Q4_K [2, 256] needs 288 bytes of blocks, got 278" in str(e.value) and "\n" not in str(e.value)
    qdata, scale = torch.empty(128, dtype=torch.uint8), torch.empty(8)
    with pytest.raises(ValueError, match="not a whole number of 144-byte blocks"):
        decode_into("Q4_K", torch.from_numpy(raw), qdata, scale, scale.clone(), native=native)
