"""ExecuTorch .pte export (models/pipeline/export_pte.py): the quantized tiny models run in executorch.runtime.

Runs only where executorch is installed (Bazel target `backend = "executorch"`: SKIPPED elsewhere).

What the .pte computes differs from the eager llmq model in one way only: each quantized linear
quantizes its input to int8 per token (torchao's 8da: asymmetric, scale s = (max(x,0) - min(x,0))/255,
so every input element moves by at most s/2, uniformly distributed in [-s/2, s/2] under the usual
rounding-error model). The weights are the bundle's codes and scales, unchanged.

Error bound used below, derived from that arithmetic:
* one linear, worst case: |dy_n| <= (s/2) * sum_k |W_nk|  (checked exactly on single linears);
* one linear, statistically: dy_n has standard deviation (s / sqrt(12)) * ||W_n||_2;
* the model: to first order the relative errors of the linears in series add up, so the logits'
  error has standard deviation <= max|logit| * sum_l r_l, with r_l = max over tokens of
  (s / sqrt(12)) * max_n ||W_n||_2 / rms(y_l) measured on the eager model's own activations;
  the test allows 6 of those standard deviations (over a few thousand logits, a 6-sigma excursion
  has probability < 1e-5).
Independently, the .pte must match the same exported program run in eager torch (torchao's own
quantize/dequantize ops, the reference numerics of 8da) to a few float32 roundings: XNNPACK
accumulates int8 products exactly in int32, so the remaining differences are float32 rescaling
and summation order, plus an activation code that lands on the other side of a rounding tie.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("executorch.runtime", reason="executorch is not installed (optional: docs/executorch.md)")

from llmq.quant import QuantConfig, QuantizedLinear, dequantize, quantize_weight, to_torchao  # noqa: E402
from models.pipeline import export_pte  # noqa: E402


def _act_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-token step of torchao's int8 asymmetric activation quantization, [..., 1]."""
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True).clamp(min=0)
    return (hi - lo) / 255


def _run_linear_pte(lin: nn.Module, x: torch.Tensor, path) -> torch.Tensor:
    from executorch.runtime import Runtime

    export_pte.export_module_pte(lin, (x,), str(path))
    return Runtime.get().load_program(str(path)).load_method("forward").execute([x])[0]


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 32), (8, None)])
def test_single_linear_within_activation_quantization_bound(tmp_path, bits, group_size):
    torch.manual_seed(bits)
    w = torch.randn(64, 128)
    qw = quantize_weight(w, QuantConfig(bits=bits, group_size=group_size))
    lin = export_pte._ao_linear(qw, None)
    # the .pte's weight is the bundle's: codes, scales and zero points carried over, not requantized
    ref_ao = to_torchao(qw, activation_quantization="int8_asym_per_token")
    assert torch.equal(lin.weight.qdata, ref_ao.qdata) and torch.equal(lin.weight.scale, qw.scale)
    assert not bool(lin.weight.zero_point.any())
    x = torch.randn(6, 128) * torch.linspace(0.1, 3, 6)[:, None]
    y = _run_linear_pte(lin, x, tmp_path / "lin.pte")
    w_hat = dequantize(qw, torch.float32)
    exact = F.linear(x.double(), w_hat.double())
    bound = _act_scale(x).double() / 2 * w_hat.abs().sum(-1).double()  # worst case, per token and output
    slack = 1e-5 * (x.abs().double() @ w_hat.abs().double().T)          # float32 rescaling and summation
    assert bool(((y.double() - exact).abs() <= bound + slack).all())
    # and the activations really were quantized (a float kernel would be far closer than s/2 steps)
    assert (y.double() - exact).abs().max() > 1e-3 * bound.max()


def test_weight_only_lowering_is_refused(tmp_path):
    qw = quantize_weight(torch.randn(32, 64), QuantConfig(bits=4, group_size=32))
    lin = nn.Linear(64, 32, bias=False)
    lin.weight = nn.Parameter(to_torchao(qw), requires_grad=False)  # IntxWeightOnlyConfig's form
    out = tmp_path / "weight_only.pte"
    with pytest.raises(ValueError, match=r"^weight: weight-only torchao weight \(IntxWeightOnlyConfig\) refused"):
        export_pte.export_module_pte(lin, (torch.randn(2, 64),), str(out))
    assert not out.exists()


def _relative_noise(model: nn.Module, steps, prompt, decode_steps) -> float:
    """sum over quantized linears of the statistical relative error r_l (module docstring), measured on the eager
    llmq model's activations over the same prefill + decode steps."""
    worst = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            w = dequantize(module.quantized_weight(), torch.float32)
            w2 = w.norm(dim=-1).max().item()

            def hook(mod, args, out, name=name, w2=w2):
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                rms = out.float().pow(2).mean().sqrt().item()
                r = (_act_scale(x).max().item() / math.sqrt(12)) * w2 / max(rms, 1e-30)
                worst[name] = max(worst.get(name, 0.0), r)

            hooks.append(module.register_forward_hook(hook))
    try:
        export_pte._eager_logits(steps, prompt, decode_steps)
    finally:
        for h in hooks:
            h.remove()
    return sum(worst.values())


def _model_case(arch_module, export_module, tmp_path, recipe=None):
    from models.pipeline.export_pt2 import DecodeStep, PrefillStep

    decode_steps = 4
    result = export_pte.run(arch_module.ARCHITECTURE, export_module.cache_layout,
                            dynamic_prompt=export_module.DYNAMIC_PROMPT, recipe=recipe, out=str(tmp_path / "m.pte"),
                            max_seq_len=32, decode_steps=decode_steps, prompt_len=8, quiet=True)
    assert result["counts"]["linears"] > 0
    for method in ("prefill", "decode"):  # every linear went to XNNPACK
        assert result["stats"][method]["delegates"] > 0 and result["stats"][method]["linear_outside"] == 0
    scale = result["scale"]
    eps = torch.finfo(torch.float32).eps
    # .pte vs torchao's eager 8da numerics: float32 roundings only (see the module docstring)
    assert max(result["vs_ao"]) <= 1e-3 * scale, result["vs_ao"]
    return result, scale, eps, decode_steps


def _check_vs_eager(result, scale, decode_steps, tmp_path, arch_module, export_module):
    # Rebuild the eager llmq model (before the 8da swap) to measure the per-linear noise.
    from models.pipeline import export_pt2
    from models.pipeline.export_pt2 import DecodeStep, PrefillStep

    model, _ = export_pt2.load_quantized_model(arch_module.ARCHITECTURE, bundle=None, checkpoint=None,
                                               recipe=arch_module.ARCHITECTURE.default_recipe, seed=0,
                                               workdir=str(tmp_path / "w"))
    export_pt2.to_float32(model)
    layout = export_module.cache_layout(model, 32)
    steps = {"prefill": PrefillStep(model, layout), "decode": DecodeStep(model, layout)}
    with torch.no_grad():
        rel = _relative_noise(model, steps, result["prompt"], decode_steps)
    tolerance = 6 * scale * rel
    assert tolerance < 0.5 * scale, f"the bound is vacuous: {tolerance} vs max|logit| {scale}"
    assert max(result["vs_eager"]) <= tolerance, (result["vs_eager"], tolerance)


def test_gemma4_pte_prefill_and_decode(tmp_path):
    from models.gemma4 import export as gemma_export
    from models.gemma4 import pipeline as gemma_pipeline

    result, scale, _, steps = _model_case(gemma_pipeline, gemma_export, tmp_path)
    _check_vs_eager(result, scale, steps, tmp_path, gemma_pipeline, gemma_export)


def test_qwen_pte_prefill_and_decode(tmp_path):
    from models.qwen import export as qwen_export
    from models.qwen import pipeline as qwen_pipeline

    result, scale, _, steps = _model_case(qwen_pipeline, qwen_export, tmp_path)
    assert result["counts"]["expert_blocks"] > 0
    _check_vs_eager(result, scale, steps, tmp_path, qwen_pipeline, qwen_export)
