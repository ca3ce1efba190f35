"""On a CUDA device: our CPU-computed tinygemm layout equals torch's own CUDA packing
bit for bit, and `torch.ops.aten._weight_int4pack_mm` on it computes
(q - 8)*scale + zero. Gated to the CUDA platform in BUILD, and skipped here when no
device is visible (the layout itself is tested on CPU in tinygemm_test.py)."""

import pytest
import torch

from cuda_testutil import BF16_UNIT_ROUNDOFF, gamma, random_canonical
from llmq.quant.formats import unpack_bits
from llmq_cuda import expert, pack_tinygemm_int4, unpack_tinygemm_int4

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: torch.cuda.is_available() is False on this machine"
)


@pytest.mark.parametrize("n,k,inner_k_tiles", [(64, 1024, 8), (24, 256, 4), (16, 128, 2)])
def test_cpu_layout_equals_torch_cuda_packing(n, k, inner_k_tiles):
    w = random_canonical((n, k), 64, seed=n)
    q = unpack_bits(w.qdata, 4, k)
    hi_even = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).cuda()  # the CUDA converter's input
    theirs = torch.ops.aten._convert_weight_to_int4pack(hi_even.contiguous(), inner_k_tiles).cpu()
    ours = pack_tinygemm_int4(w, inner_k_tiles=inner_k_tiles).qdata
    assert torch.equal(ours, theirs)


def _check(y, x, t):
    """bf16 activations, scales and zeros; the kernel dequantizes each weight in bf16
    (<= 2 roundings), accumulates in fp32 and rounds the output to bf16 once:
    |y - ref| <= (2u_b + gamma_K) S + u_b |ref| with S = |x| @ (|(q-8)s| + |z|)^T."""
    q, s, z = unpack_tinygemm_int4(t)
    n, k = t.shape
    g = t.group_size
    qf = (q.double() - 8).reshape(n, -1, g)
    w = (qf * s.double().unsqueeze(-1) + z.double().unsqueeze(-1)).reshape(n, k)
    mag = ((qf * s.double().unsqueeze(-1)).abs() + z.double().abs().unsqueeze(-1)).reshape(n, k)
    ref = x.double() @ w.T
    bound = (2 * BF16_UNIT_ROUNDOFF + gamma(k + 4)) * (x.double().abs() @ mag.T) + BF16_UNIT_ROUNDOFF * ref.abs()
    err = (y.double() - ref).abs()
    assert torch.all(err <= bound), f"max err {err.max():.3e}"


@pytest.mark.parametrize("n,k,group,inner_k_tiles", [(64, 1024, 128, 8), (32, 512, 32, 4), (24, 256, 256, 2)])
def test_weight_int4pack_mm_on_our_layout(n, k, group, inner_k_tiles):
    w = random_canonical((n, k), group, seed=k)
    t = pack_tinygemm_int4(w, inner_k_tiles=inner_k_tiles)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm(x.cuda(), t.qdata.cuda(), group, t.scale_and_zero.cuda()).cpu()
    assert y.shape == (5, t.scale_and_zero.shape[1])  # padded N columns
    _check(y[:, :n], x, t)


def test_per_expert_slices_run_directly():
    w = random_canonical((3, 32, 512), 64, seed=2)
    stacked = pack_tinygemm_int4(w, inner_k_tiles=8)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for e in range(3):
        te = expert(stacked, e)
        y = torch.ops.aten._weight_int4pack_mm(x.cuda(), te.qdata.cuda(), 64, te.scale_and_zero.cuda()).cpu()
        _check(y, x, te)
