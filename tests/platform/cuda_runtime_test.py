"""Runs only where a CUDA device is present: the device computes what the CPU computes."""

import torch


def test_cuda_matmul_matches_cpu():
    assert torch.cuda.is_available(), "gated on CUDA by Bazel, yet torch sees no CUDA device"
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 96, generator=g, dtype=torch.float64)
    b = torch.randn(96, 32, generator=g, dtype=torch.float64)
    got = (a.cuda() @ b.cuda()).cpu()
    torch.testing.assert_close(got, a @ b, rtol=1e-12, atol=1e-12)
