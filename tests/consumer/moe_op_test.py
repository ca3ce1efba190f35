"""llmq.ops from another workspace: the compiled MoE kernel loads and matches plain torch."""

import unittest

import torch
import torch.nn.functional as F

from llmq.ops import load_kernel, moe_kernel_available, pack_moe_experts, quantized_moe_ffn
from llmq.quant import QuantConfig, dequantize, quantize_weight


def torch_moe(x, router, w13, w2, top_k):
    """The plain weight-only-quantized MoE block in float64: softmax over the top-k router
    logits, SwiGLU experts (w13 rows [gate; up]), weighted sum."""
    x = x.to(torch.float64)
    logits = x @ router.to(torch.float64).T
    top = torch.topk(logits, top_k, dim=-1)
    weights = torch.softmax(top.values, dim=-1)
    f = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(top.indices[t, j])
            gate_up = w13[e].to(torch.float64) @ x[t]
            h = F.silu(gate_up[:f]) * gate_up[f:]
            out[t] += weights[t, j] * (w2[e].to(torch.float64) @ h)
    return out


class MoEOpTest(unittest.TestCase):
    def test_kernel_loads(self):
        self.assertTrue(moe_kernel_available())
        self.assertTrue(hasattr(load_kernel(), "__file__"))

    def test_matches_plain_torch(self):
        gen = torch.Generator().manual_seed(0)
        experts, hidden, inter, top_k, tokens = 4, 64, 32, 2, 5
        router = torch.randn(experts, hidden, generator=gen) / hidden**0.5
        cfg = QuantConfig(bits=8, group_size=32)
        w13 = quantize_weight(torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5, cfg, name="w13")
        w2 = quantize_weight(torch.randn(experts, hidden, inter, generator=gen) / inter**0.5, cfg, name="w2")
        x = torch.randn(tokens, hidden, generator=gen)

        packed = pack_moe_experts(w13, w2)
        got = quantized_moe_ffn(x, router, None, packed.w13_qdata, packed.w13_sb, packed.w2_qdata, packed.w2_sb,
                                top_k, packed.bits, packed.group_size)
        want = torch_moe(x, router, dequantize(w13), dequantize(w2), top_k)

        self.assertEqual(tuple(got.shape), (tokens, hidden))
        # The kernel quantizes activations to int8 per group of 32 (relative step ~1/127):
        # a few tenths of a percent of the output's scale.
        rel = float((got.to(torch.float64) - want).norm() / want.norm())
        self.assertLess(rel, 2e-2)
        self.assertGreater(float(want.norm()), 0.0)


if __name__ == "__main__":
    unittest.main()
