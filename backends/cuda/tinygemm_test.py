"""The tinygemm int4 layout, computed on CPU: against a written-out spec, round trips,
the canonical -> (scale, zero) conversion, and torch's CPU int4 kernel numerics."""

import numpy as np
import pytest
import torch

from cuda_testutil import gamma, random_canonical, random_q
from llmq.quant.formats import GroupQuantizedWeight, dequantize_canonical, pack_bits, unpack_bits
from llmq_cuda import (
    dequantize_tinygemm,
    expert,
    pack_int4_for_cpu,
    pack_tinygemm_int4,
    stack_experts,
    tile_pack_int4,
    tile_unpack_int4,
    unpack_tinygemm_int4,
)


def spec_tile_pack(q, inner_k_tiles):
    """The layout as the CUDA converter reads it, element by element, from the uint8
    [N, K/2] input it takes (even k in the HIGH nibble of byte k/2):

    block (nt, ks), lane t, word i: row n = 8*nt + t//4 (zero if n >= N); with
    b = 8*(T*ks + 2*i) + t%4 the four source bytes are b, b+4, b+8, b+12, and the word
    is their high nibbles in bits 0..15 (in that order) then their low nibbles in bits 16..31.
    """
    n_rows, k = q.shape
    hi_even = [[(int(q[n, 2 * j]) << 4) | int(q[n, 2 * j + 1]) for j in range(k // 2)] for n in range(n_rows)]
    nt_count = -(-n_rows // 8)
    ks_count = k // (16 * inner_k_tiles)
    out = torch.zeros(nt_count, ks_count, 32, inner_k_tiles // 2, dtype=torch.int64)
    for nt in range(nt_count):
        for ks in range(ks_count):
            for t in range(32):
                n = 8 * nt + t // 4
                for i in range(inner_k_tiles // 2):
                    b = 8 * (inner_k_tiles * ks + 2 * i) + t % 4
                    v = [hi_even[n][b + off] if n < n_rows else 0 for off in (0, 4, 8, 12)]
                    word = 0
                    for pos in range(4):
                        word |= (v[pos] >> 4) << (4 * pos)
                        word |= (v[pos] & 0xF) << (16 + 4 * pos)
                    out[nt, ks, t, i] = word - (1 << 32) if word >= 1 << 31 else word
    return out.to(torch.int32)


@pytest.mark.parametrize("n,k,inner_k_tiles", [(16, 256, 8), (20, 128, 4), (8, 64, 2), (13, 96, 2)])
def test_layout_matches_written_out_spec(n, k, inner_k_tiles):
    q = random_q((n, k), seed=n + k)
    assert torch.equal(tile_pack_int4(q, inner_k_tiles), spec_tile_pack(q, inner_k_tiles))


@pytest.mark.parametrize("n,k,inner_k_tiles", [(16, 256, 8), (24, 512, 4), (8, 64, 2)])
def test_shape_matches_torchs_registration(n, k, inner_k_tiles):
    """torch's meta kernel for _convert_weight_to_int4pack states the CUDA output shape.
    (For N not a multiple of 8 the meta kernel floors N/8 while the CUDA kernel rounds
    up and zero-fills; we follow the CUDA kernel, so only multiples of 8 are compared.)"""
    meta_input = torch.empty(n, k // 2, dtype=torch.uint8, device="meta")
    meta = torch.ops.aten._convert_weight_to_int4pack(meta_input, inner_k_tiles)
    w = pack_tinygemm_int4(random_canonical((n, k), 32), inner_k_tiles=inner_k_tiles)
    assert tuple(w.qdata.shape) == tuple(meta.shape) and w.qdata.dtype == meta.dtype
    assert tuple(w.scale_and_zero.shape) == (k // 32, -(-n // 8) * 8, 2)


@pytest.mark.parametrize("inner_k_tiles", [2, 4, 8])
def test_unpack_inverts_pack(inner_k_tiles):
    q = random_q((3, 21, 256), seed=inner_k_tiles)  # leading expert dim, N not a multiple of 8
    packed = tile_pack_int4(q, inner_k_tiles)
    assert torch.equal(tile_unpack_int4(packed, 21, 256), q)
    for e in range(3):  # per-expert layout: each slice is the 2-D layout of that expert
        assert torch.equal(packed[e], tile_pack_int4(q[e], inner_k_tiles))


@pytest.mark.parametrize("shape,inner_k_tiles", [((21, 256), 8), ((3, 13, 128), 4), ((2, 2, 8, 64), 2),
                                                 ((40, 4096), 8), ((1, 0, 64), 2)])
def test_compiled_tile_pack_equals_the_torch_reference(shape, inner_k_tiles):
    """The one-pass C++ packer (cpp/quant int4_tiles, a Bazel data dependency: missing fails) gives
    the bytes of the torch word-arithmetic reference, padding rows and leading dims included."""
    from llmq.quant import _native
    from llmq_cuda.tinygemm import tile_pack, tile_pack_canonical_bytes

    assert _native.int4_mma_tiles_available(), _native.native_kernel_error()
    g = torch.Generator().manual_seed(sum(shape))
    qdata = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), dtype=torch.uint8, generator=g)
    ref = tile_pack_canonical_bytes(qdata, inner_k_tiles)
    for threads, simd in ((1, True), (3, True), (2, False)):  # the SSSE3 path (where the CPU has it) and the portable one
        got = _native.pack_int4_mma_tiles(qdata, inner_k_tiles, threads=threads, simd=simd)
        assert got.dtype == ref.dtype and got.shape == ref.shape and torch.equal(got, ref), (threads, simd)
    assert torch.equal(tile_pack(qdata, inner_k_tiles), ref)


def test_scale_and_zero_conversion_and_its_bf16_loss():
    w = random_canonical((24, 256), 64, seed=3)
    exact = dequantize_canonical(w).double()
    t32 = pack_tinygemm_int4(w, scale_dtype=torch.float32)
    q, s, z = unpack_tinygemm_int4(t32)
    assert torch.equal(q, unpack_bits(w.qdata, 4, 256)) and torch.equal(s, w.scale)
    assert torch.equal(z, (w.bias.double() + 8 * w.scale.double()).float())  # zero = bias + 8*scale, one rounding
    # padding rows carry zero scale and zero
    assert torch.count_nonzero(t32.scale_and_zero[:, 24:]) == 0
    # float32: only the rounding of zero remains
    d32 = dequantize_tinygemm(t32, torch.float64)
    zr = (z.double() - (w.bias.double() + 8 * w.scale.double())).abs().repeat_interleave(64, -1)
    assert torch.all((d32 - exact).abs() <= zr + exact.abs() * 2**-24)
    # bfloat16 (what the CUDA kernel reads): |dw| <= |q-8| |ds| + |dz|, each rounding <= half a bf16 ulp
    tb = pack_tinygemm_int4(w)  # default bf16
    assert tb.scale_and_zero.dtype == torch.bfloat16
    _, sb, zb = unpack_tinygemm_int4(tb)
    zexact = w.bias.double() + 8 * w.scale.double()
    assert torch.all((sb.double() - w.scale.double()).abs() <= w.scale.double().abs() * 2**-8)
    assert torch.all((zb.double() - zexact).abs() <= zexact.abs() * 2**-8)
    bound = (q.double() - 8).abs() * (w.scale.double().abs() * 2**-8).repeat_interleave(64, -1) + (
        zexact.abs() * 2**-8
    ).repeat_interleave(64, -1)
    err = (dequantize_tinygemm(tb, torch.float64) - exact).abs()
    assert torch.all(err <= bound * (1 + 1e-9) + exact.abs() * 2**-24)


def _check_cpu_mm(y, x, q, s, z, group):
    """|y - x @ W^T| <= gamma_{K+4} |x| @ (|(q-8) s| + |z|)^T with W = (q-8)*s + z in float64."""
    qf = (q.double() - 8).reshape(q.shape[0], -1, group)
    wt = (qf * s.double().unsqueeze(-1) + z.double().unsqueeze(-1)).reshape(q.shape)
    mag = ((qf * s.double().unsqueeze(-1)).abs() + z.double().abs().unsqueeze(-1)).reshape(q.shape)
    ref = x.double() @ wt.T
    bound = gamma(q.shape[1] + 4) * (x.double().abs() @ mag.T)
    err = (y.double() - ref).abs()
    assert torch.all(err <= bound), f"max err {err.max():.3e} vs bound {bound.flatten()[err.argmax()]:.3e}"


@pytest.mark.parametrize("n,k,group", [(32, 256, 32), (48, 512, 128), (16, 1024, 256), (64, 256, 64)])
def test_cpu_int4_kernel_matches_reference_numerics(n, k, group):
    """Our layout's contents (q, scale, zero), repacked with torch's CPU converter, make
    _weight_int4pack_mm_for_cpu compute (q - 8)*scale + zero."""
    w = random_canonical((n, k), group, seed=n)
    t = pack_tinygemm_int4(w, scale_dtype=torch.float32)
    q, s, z = unpack_tinygemm_int4(t)
    cpu_w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(k))
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, cpu_w, group, t.scale_and_zero[:, :n].contiguous())
    _check_cpu_mm(y, x, q, s, z, group)
    # ... and that is the canonical weight scale*q + bias, up to the one rounding of zero
    # (a priori: |zero - (bias + 8 scale)| <= half an fp32 ulp; the rest as in _check_cpu_mm)
    zexact = w.bias.double() + 8 * w.scale.double()
    dz = torch.from_numpy(np.spacing(zexact.abs().float().numpy())).double() / 2
    dz = dz.repeat_interleave(group, -1)
    qs = ((q.double() - 8).reshape(n, -1, group) * w.scale.double().unsqueeze(-1)).abs().reshape(n, k)
    mag = qs + zexact.abs().repeat_interleave(group, -1) + dz
    bound = gamma(k + 4) * (x.double().abs() @ mag.T) + x.double().abs() @ dz.T
    assert torch.all((y.double() - x.double() @ dequantize_canonical(w).double().T).abs() <= bound)
    # the convenience wrapper packs the same thing
    packed, sz, g = pack_int4_for_cpu(w)
    assert g == group and torch.equal(packed, cpu_w) and torch.equal(sz, t.scale_and_zero[:, :n])


def test_coarse_groups_are_regrouped_exactly():
    w = random_canonical((8, 1024), 1024, seed=9)  # one group per row
    t = pack_tinygemm_int4(w, scale_dtype=torch.float32)
    assert t.group_size == 256 and tuple(t.scale_and_zero.shape) == (4, 8, 2)
    q, s, z = unpack_tinygemm_int4(t)
    assert torch.equal(s, w.scale.repeat_interleave(4, -1))


def test_per_expert_layout():
    w = random_canonical((4, 16, 256), 64, seed=11)
    stacked = pack_tinygemm_int4(w, inner_k_tiles=4)
    listed = stack_experts(
        [
            pack_tinygemm_int4(
                GroupQuantizedWeight(w.qdata[e], w.scale[e], w.bias[e], bits=4, group_size=64, shape=(16, 256)),
                inner_k_tiles=4,
            )
            for e in range(4)
        ]
    )
    assert torch.equal(stacked.qdata, listed.qdata) and torch.equal(stacked.scale_and_zero, listed.scale_and_zero)
    e2 = expert(stacked, 2)
    assert e2.qdata.is_contiguous() and e2.shape == (16, 256)
    assert torch.equal(dequantize_tinygemm(e2), dequantize_tinygemm(stacked)[2])
    with pytest.raises(ValueError, match="expert 1"):
        stack_experts([expert(stacked, 0), pack_tinygemm_int4(random_canonical((16, 256), 32), inner_k_tiles=4)])


def test_unrepresentable_weights_raise_clearly():
    zeros = torch.zeros(8, 64, dtype=torch.uint8)
    w8 = GroupQuantizedWeight(pack_bits(zeros, 8), torch.ones(8, 2), torch.zeros(8, 2), 8, 32, (8, 64))
    with pytest.raises(ValueError, match=r"mlp\.down.*4-bit weights only, got bits=8"):
        pack_tinygemm_int4(w8, name="mlp.down")
    with pytest.raises(ValueError, match="K=96 is not a multiple of 16\\*inner_k_tiles=128"):
        pack_tinygemm_int4(random_canonical((8, 96), 32), inner_k_tiles=8)
    with pytest.raises(ValueError, match="group_size=16"):
        pack_tinygemm_int4(random_canonical((8, 128), 16))
    with pytest.raises(ValueError, match="N divisible by 16, got N=24"):
        pack_int4_for_cpu(random_canonical((24, 128), 32), name="w")
    with pytest.raises(ValueError, match="inner_k_tiles must be one of"):
        pack_tinygemm_int4(random_canonical((8, 128), 32), inner_k_tiles=3)


def test_blocked_packing_matches_spec_across_block_and_expert_boundaries(monkeypatch):
    import llmq_cuda.tinygemm as tinygemm

    q = random_q((3, 20, 128), seed=4)  # 3 experts x 3 row tiles (the last padded)
    monkeypatch.setattr(tinygemm, "_BLOCK_BYTES", 2 * 8 * 64)  # two row tiles per block: blocks straddle experts
    packed = tile_pack_int4(q, 4)
    for e in range(3):
        assert torch.equal(packed[e], spec_tile_pack(q[e], 4))
