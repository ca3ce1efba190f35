"""llmq.quant + llmq.checkpoint from another workspace: quantize, write a bundle, read it back."""

import os
import tempfile
import unittest

import torch

import llmq
from llmq.checkpoint import load_bundle, read_manifest, save_bundle
from llmq.quant import GroupQuantizedWeight, QuantConfig, dequantize, quantize_weight, unpack_bits


class QuantCheckpointTest(unittest.TestCase):
    def test_imports_the_library_not_the_repository(self):
        self.assertEqual(os.path.basename(os.path.dirname(llmq.__file__)), "llmq")
        self.assertTrue(llmq.__file__.endswith(os.path.join("python", "llmq", "__init__.py")), llmq.__file__)
        self.assertTrue(llmq.__version__)

    def test_quantize_then_bundle_round_trip(self):
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(64, 128, generator=gen)
        qw = quantize_weight(w, QuantConfig(bits=4, group_size=32), name="proj.weight")
        self.assertIsInstance(qw, GroupQuantizedWeight)

        # Independent check of the canonical convention: w ~ scale * q + bias, q in [0, 15],
        # each element within half a step of its group's scale.
        q = unpack_bits(qw.qdata, 4, 128).to(torch.float64)
        self.assertGreaterEqual(int(q.min()), 0)
        self.assertLessEqual(int(q.max()), 15)
        scale = qw.scale.to(torch.float64).repeat_interleave(32, dim=1)
        bias = qw.bias.to(torch.float64).repeat_interleave(32, dim=1)
        w_hat = scale * q + bias
        err = (w.to(torch.float64) - w_hat).abs()
        self.assertTrue(bool((err <= 0.5 * scale * (1 + 1e-5) + 1e-7).all()), float((err / scale).max()))
        torch.testing.assert_close(dequantize(qw).to(torch.float64), w_hat, rtol=0, atol=1e-6)

        norm = torch.rand(128, generator=gen)
        with tempfile.TemporaryDirectory() as tmp:
            out = save_bundle([("proj.weight", qw), ("norm.weight", norm)], os.path.join(tmp, "bundle"), fsync=False)
            self.assertEqual(sorted(t["name"] if isinstance(t, dict) else t for t in read_manifest(out)["tensors"]),
                             ["norm.weight", "proj.weight"])
            got = load_bundle(out)
        self.assertTrue(torch.equal(got["norm.weight"], norm))
        back = got["proj.weight"]
        self.assertEqual((back.bits, back.group_size, tuple(back.shape)), (4, 32, (64, 128)))
        for field in ("qdata", "scale", "bias"):
            self.assertTrue(torch.equal(getattr(back, field), getattr(qw, field)), field)


if __name__ == "__main__":
    unittest.main()
