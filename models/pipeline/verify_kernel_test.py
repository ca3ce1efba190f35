"""--verify's quantized side through the compiled integer kernel (llmq::quantized_linear).

Three verifications of one written output (a tiny Gemma 3, int4 g32 and int8 g32 matrices):

* kernel: the compiled kernel installed by verify itself (`quantized_linears`);
* emulated: a Python LinearKernel doing what the kernel's contract says (docs/moe_kernel.md: the
  activations rounded to int8 per row and weight group, scale amax/127, times the exactly
  dequantized weight), in float64 then rounded to the activations' dtype;
* dequantized: no kernel (every QuantizedLinear dequantizes: the path before the kernel).

kernel == emulated within float rounding: the kernel's fp32 accumulation differs from float64 by
~4 (G + 4) eps32 relative (dense_op_test), far below one bfloat16 step of the hidden states, so the
two differ only where a value lies within that distance of a bfloat16 rounding boundary (a one-ulp
flip, 2^-8 relative, that the following layers carry on): the noise figures agree to a few percent,
the numbers measured against the same reference. kernel vs dequantized: the int8 activations add
their own error (about 2^-8 of a group's largest activation), small against int4 weights' error and
comparable to int8's; both stay far under the verify rule's 4x margin. The reference side never
uses the kernel (its linears dequantize exactly): its logits are the same in all three runs.

Needs the compiled //cpp/moe:_moe_kernel.so (a Bazel data dependency); skipped where it is absent.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

import models.architectures  # noqa: F401
from llmq.ops import dense_op
from llmq.ops.moe_reference import fake_quantize_activations
from llmq.quant.formats import dequantize_canonical
from models.gemma3.architecture import ARCHITECTURE as GEMMA3
from models.pipeline import verify as verification
from models.pipeline.quantize_and_save import run

pytestmark = pytest.mark.skipif(not dense_op.quantized_linear_available(),
                                reason="the compiled //cpp/moe:_moe_kernel.so is not built/loadable here")

RECIPE = {"rules": [{"pattern": r".*mlp\..*_proj", "config": {"bits": 8, "group_size": 32, "symmetric": True}},
                    {"pattern": r".*_proj", "config": {"bits": 4, "group_size": 32, "symmetric": False}}]}


class EmulatedKernel:
    """The kernel's contract in Python (module docstring)."""

    def pack(self, qw):
        return None if dense_op.DenseKernel().pack(qw) is None else qw  # the weights the kernel takes

    def linear(self, x, qw):
        xq = fake_quantize_activations(x.float(), qw.group_size)
        return (xq @ dequantize_canonical(qw).to(torch.float64).T).to(x.dtype)


def _verify(monkeypatch, tmp_path, name, mode):
    with monkeypatch.context() as m:
        if mode == "dequantized":
            m.setattr(verification, "verify", functools.partial(verification.verify, use_kernel=False))
        elif mode == "emulated":
            def install():
                verification.modules.set_linear_kernel(EmulatedKernel())
                return True
            m.setattr(dense_op, "install_dense_kernel", install)
        return run(GEMMA3, checkpoint=None, recipe=str(tmp_path / "recipe.json"), backend="bundle",
                   out=str(tmp_path / name), resume=False, max_shard_size=1 << 20, verify=True, seed=0,
                   progress=False)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kernel")
    (tmp / "recipe.json").write_text(json.dumps(RECIPE))
    monkeypatch = pytest.MonkeyPatch()
    try:
        return {mode: _verify(monkeypatch, tmp, mode, mode) for mode in ("kernel", "emulated", "dequantized")}
    finally:
        monkeypatch.undo()


def _figures(result):
    rows = [("logits", result["noise"], result["rtn"]["noise"])]
    rows += [(f"layer {r['layer']}", r["noise"], r["rtn_noise"]) for r in result["layers"]]
    return rows


def test_the_kernel_serves_the_quantized_side_and_nothing_stays_installed(three):
    assert three["kernel"]["quantized_linears"].startswith("llmq::quantized_linear")
    assert three["dequantized"]["quantized_linears"] == "dequantized weights on every call"
    assert verification.modules.linear_kernel() is None  # verify restored what was there
    for r in three.values():
        assert r["verification_failure"] is None


def test_kernel_equals_its_contract_within_float_rounding(three):
    kernel, emulated = three["kernel"], three["emulated"]
    assert kernel["signal"] == emulated["signal"]  # the reference side is the same model, dequantized exactly
    for (what, n1, r1), (_, n2, r2) in zip(_figures(kernel), _figures(emulated)):
        assert n1 == pytest.approx(n2, rel=0.05), what
        assert r1 == pytest.approx(r2, rel=0.05), what
    assert kernel["kl_mean"] == pytest.approx(emulated["kl_mean"], rel=0.05)
    assert kernel["tokens_quantized"] == emulated["tokens_quantized"]


def test_kernel_against_dequantized_weights(three):
    kernel, plain = three["kernel"], three["dequantized"]
    assert kernel["signal"] == plain["signal"]
    assert kernel["tokens_reference"] == plain["tokens_reference"]
    differs = False
    for (what, n1, r1), (_, n2, r2) in zip(_figures(kernel), _figures(plain)):
        # int8 activations add their own noise: a fraction of the weights' own, never a multiple of it
        assert 0.5 * n2 <= n1 <= 1.5 * n2 + 1e-12, what
        assert 0.5 * r2 <= r1 <= 1.5 * r2 + 1e-12, what
        differs |= n1 != n2
    assert differs  # the kernel really computed (its int8 activations leave a trace)
