"""ExecuTorch .pte export (models/pipeline/export_pte.py): the quantized tiny models run in executorch.runtime.

Runs only where executorch is installed (Bazel target `backend = "executorch"`: SKIPPED elsewhere).

What the .pte computes differs from the eager llmq model in three ways:
1. each quantized linear quantizes its input to int8 per token (torchao's 8da: asymmetric, step
   s = (max(x,0) - min(x,0)) / 255), so every input element moves by at most s/2 (uniform in
   [-s/2, s/2] under the usual rounding-error model);
2. XNNPACK stores 4-bit group scales as bfloat16 (8 significant bits): each group's scale moves by
   a relative <= 2^-9 (8-bit per-channel scales stay float32). Codes are the bundle's, unchanged;
3. Qwen's routed experts run llmq's MoE kernel (llmq::quantized_moe_ffn.out), which quantizes the
   input of each expert's gate_up and down projections to int8 per row and weight group, symmetric:
   step s = amax/127 (<= the row's amax/127), weights exact (float32 scale and bias). The kernel is
   the torch op's, so a single block's .pte output equals torch.ops.llmq.quantized_moe_ffn bit for bit.

Error bounds used below, derived from that arithmetic (x one token's input, W_n one output row):
* one linear, worst case: |dy_n| <= (s/2) * ||W_n||_1 + 2^-9 * sum_k |x_k W_nk|  (single-linear test);
* one linear, statistically: dy_n has standard deviation <= (s/sqrt(12)) ||W_n||_2 + (2^-9/sqrt(3)) ||x||_2 ||W_n||_2;
* an expert projection under the op, the same with step amax/127 (per row, over the tokens routed
  to that expert);
* the model: the linears' rounding errors are independent, so their contributions to the logits add
  in quadrature; to first order each reaches the logits with its relative size, so the logits' error
  has standard deviation <= max|logit| * sqrt(sum_l r_l^2), with r_l the above divided by rms(y_l),
  maximised over tokens and rows and measured on the eager model's own activations (every linear,
  and for Qwen every routed expert's gate_up and down in every MoE layer); the test allows 6 standard
  deviations. Against the same exported program run in eager torch (torchao's 8da reference numerics
  and the torch op: identical activation quantization, float32 scales) only term 2 remains.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("executorch.runtime", reason="executorch is not installed (optional: docs/executorch.md)")

from llmq.quant import QuantConfig, QuantizedLinear, dequantize, quantize_weight, to_torchao  # noqa: E402
from models.pipeline import export_pte  # noqa: E402
from models.pipeline.quantized_model import QuantizedExperts  # noqa: E402


def _act_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-token step of torchao's int8 asymmetric activation quantization, [..., 1]."""
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True).clamp(min=0)
    return (hi - lo) / 255


def _run_linear_pte(lin: nn.Module, x: torch.Tensor, path) -> torch.Tensor:
    from executorch.runtime import Runtime

    export_pte.export_module_pte(lin, (x,), str(path))
    return Runtime.get().load_program(str(path)).load_method("forward").execute([x])[0]


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, None)])
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
    bf16 = 2.0**-9 if bits == 4 else 0.0                                 # XNNPACK's bfloat16 group scales
    slack = (bf16 + 1e-5) * (x.abs().double() @ w_hat.abs().double().T)  # + float32 rescaling and summation
    assert bool(((y.double() - exact).abs() <= bound + slack).all())
    # and the activations really were quantized (a float kernel would be far closer than s/2 steps)
    assert (y.double() - exact).abs().max() > 1e-3 * bound.max()


@pytest.mark.parametrize("case,message", [
    ("weight_only", r"^weight: weight-only torchao weight \(IntxWeightOnlyConfig\) refused: XNNPACK lowers it to a "
                    r"\.pte that returns garbage"),
    ("asymmetric", r"^weight: asymmetric weight \(non-zero zero points\) refused"),
    ("int8_grouped", r"^weight: 8-bit weight in groups of 32 refused: XNNPACK lowers 8-bit weights only per channel"),
])
def test_unlowerable_weights_are_refused(tmp_path, case, message):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 64, generator=g) + (0.8 if case == "asymmetric" else 0.0)
    config = {"weight_only": QuantConfig(bits=4, group_size=32), "asymmetric": QuantConfig(bits=4, group_size=32, symmetric=False),
              "int8_grouped": QuantConfig(bits=8, group_size=32)}[case]
    qw = quantize_weight(w, config)
    lin = nn.Linear(64, 32, bias=False)
    activation = None if case == "weight_only" else "int8_asym_per_token"
    lin.weight = nn.Parameter(to_torchao(qw, activation_quantization=activation), requires_grad=False)
    out = tmp_path / f"{case}.pte"
    with pytest.raises(ValueError, match=message):
        export_pte.export_module_pte(lin, (torch.randn(2, 64, generator=g),), str(out))
    assert not out.exists()


def test_refused_forms_really_are_wrong_in_the_pte(tmp_path):
    # Why the refusals exist: lowered anyway (bypassing check_lowerable), executorch 1.5.1 accepts an asymmetric
    # weight and its .pte returns values far from the linear it claims to compute (XNNPACK drops the zero point).
    from executorch.runtime import Runtime

    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(4)) + 0.8
    qw = quantize_weight(w, QuantConfig(bits=4, group_size=32, symmetric=False))
    lin = nn.Linear(64, 32, bias=False)
    lin.weight = nn.Parameter(to_torchao(qw, activation_quantization="int8_asym_per_token"), requires_grad=False)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    manager = export_pte.lower_programs({"forward": torch.export.export(lin, (x,), strict=False)})
    path = tmp_path / "asym.pte"
    path.write_bytes(manager.buffer)
    y = Runtime.get().load_program(str(path)).load_method("forward").execute([x])[0]
    exact = F.linear(x, dequantize(qw, torch.float32))
    assert (y - exact).abs().max() > 0.1 * exact.abs().max()


def _relative_noise(model: nn.Module, steps, prompt, decode_steps):
    """({linear: statistical relative error r_l}, {linear: the bfloat16-scale term of r_l alone}) (module
    docstring), maximised over the eager llmq model's activations over the same steps. Routed experts (the
    MoE kernel's symmetric per-row activation quantization) count each expert's gate_up and down."""
    worst, worst_bf16 = {}, {}

    def keep(name, act, scl=0.0):
        worst[name] = max(worst.get(name, 0.0), act + scl)
        worst_bf16[name] = max(worst_bf16.get(name, 0.0), scl)

    def rms(y):
        return max(y.float().pow(2).mean().sqrt().item(), 1e-30)

    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            w = dequantize(module.quantized_weight(), torch.float32)
            w2 = w.norm(dim=-1).max().item()
            bf16 = 2.0**-9 / math.sqrt(3) if module.bits == 4 else 0.0

            def hook(mod, args, out, name=name, w2=w2, bf16=bf16):
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                act = (_act_scale(x).max().item() / math.sqrt(12)) * w2 / rms(out)
                keep(name, act, bf16 * x.norm(dim=-1).max().item() * w2 / rms(out))

            hooks.append(module.register_forward_hook(hook))
        elif isinstance(module, QuantizedExperts):

            def experts_hook(mod, args, out, name=name):
                x, _, index = args
                x = x.float()
                for e in torch.unique(index).tolist():
                    xe = x[torch.where(index == e)[0]]
                    w13, w2 = mod.gate_up.expert(e).float(), mod.down.expert(e).float()
                    gate_up = F.linear(xe, w13)
                    gate, up = gate_up.chunk(2, dim=-1)
                    h = F.silu(gate) * up
                    for part, inp, w, y in (("gate_up", xe, w13, gate_up), ("down", h, w2, F.linear(h, w2))):
                        step = inp.abs().amax(-1).max().item() / 127
                        keep(f"{name}.{e}.{part}", step / math.sqrt(12) * w.norm(dim=-1).max().item() / rms(y))

            hooks.append(module.register_forward_hook(experts_hook))
    try:
        export_pte._eager_logits(steps, prompt, decode_steps)
    finally:
        for h in hooks:
            h.remove()
    return worst, worst_bf16


def _model_case(arch_module, export_module, tmp_path, recipe=None):
    decode_steps = 4
    result = export_pte.run(arch_module.ARCHITECTURE, export_module.cache_layout,
                            dynamic_prompt=export_module.DYNAMIC_PROMPT, recipe=recipe, out=str(tmp_path / "m.pte"),
                            max_seq_len=32, decode_steps=decode_steps, prompt_len=8, quiet=True)
    assert result["counts"]["linears"] > 0
    for method in ("prefill", "decode"):  # every linear went to XNNPACK
        assert result["stats"][method]["delegates"] > 0 and result["stats"][method]["linear_outside"] == 0
    return result, result["scale"], None, decode_steps


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
        terms, terms_bf16 = _relative_noise(model, steps, result["prompt"], decode_steps)
    experts = [n for n in terms if ".experts." in n]
    assert bool(experts) == (result["counts"].get("moe_op_blocks", 0) > 0), experts  # experts counted iff the op ran
    rel = math.sqrt(sum(r * r for r in terms.values()))
    rel_bf16 = math.sqrt(sum(r * r for r in terms_bf16.values()))
    tolerance = 6 * scale * rel
    assert tolerance < 0.5 * scale, f"the bound is vacuous: {tolerance} vs max|logit| {scale}"
    assert max(result["vs_eager"]) <= tolerance, (result["vs_eager"], tolerance)
    # vs torchao's eager 8da numerics (same activation quantization): only the bfloat16 scales remain
    assert max(result["vs_ao"]) <= 6 * scale * rel_bf16 + 1e-4 * scale, (result["vs_ao"], rel_bf16)


def test_gemma4_pte_prefill_and_decode(tmp_path):
    from models.gemma4 import export as gemma_export
    from models.gemma4 import spec as gemma_spec

    result, scale, _, steps = _model_case(gemma_spec, gemma_export, tmp_path)
    _check_vs_eager(result, scale, steps, tmp_path, gemma_spec, gemma_export)


def test_qwen_pte_prefill_and_decode(tmp_path):
    # the experts run llmq's MoE kernel inside the .pte (every MoE layer, both methods); the rest as for Gemma
    from models.qwen import export as qwen_export
    from models.qwen import spec as qwen_spec

    result, scale, _, steps = _model_case(qwen_spec, qwen_export, tmp_path)
    assert result["counts"]["moe_op_blocks"] > 0 and result["counts"]["expert_blocks"] == 0
    assert result["op_calls"] == {"prefill": result["counts"]["moe_op_blocks"],
                                  "decode": result["counts"]["moe_op_blocks"]}
    _check_vs_eager(result, scale, steps, tmp_path, qwen_spec, qwen_export)


def test_moe_block_pte_equals_the_torch_op(tmp_path):
    # One MoE block (routed + shared expert, INT4 g32) through the .pte: the out variant is in the program and its
    # ExecuTorch kernel (//cpp/moe:_moe_executorch_kernel.so) computes exactly what torch.ops.llmq.quantized_moe_ffn
    # computes (the same C++ kernel), bit for bit, for several token counts of one program.
    from executorch.runtime import Runtime

    from llmq.ops import pack_moe_experts
    from llmq.ops.moe_testing import random_moe
    from llmq.ops.transform import QuantizedMoEBlock
    from models.pipeline import moe_pte

    router, w13, w2, shared = random_moe(8, 64, 32, 4, 32, seed=1, shared_inter=32)
    block = QuantizedMoEBlock(router, 2, pack_moe_experts(w13, w2), shared=pack_moe_experts(shared[0], shared[1]),
                              shared_gate=shared[2])
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(2))
    tokens = torch.export.Dim("tokens", min=1, max=16)
    program = torch.export.export(block, (x,), dynamic_shapes={"hidden_states": {1: tokens}}, strict=False)
    manager = export_pte.lower_programs({"forward": program})
    targets = [str(n.target) for n in manager.exported_program("forward").graph.nodes if n.op == "call_function"]
    assert targets.count("llmq.quantized_moe_ffn.out") == 1, targets
    path = tmp_path / "block.pte"
    path.write_bytes(manager.buffer)
    moe_pte.load_executorch_kernel()
    method = Runtime.get().load_program(str(path)).load_method("forward")
    for t in (5, 1, 16):
        x = torch.randn(1, t, 64, generator=torch.Generator().manual_seed(t))
        got = method.execute([x])[0]
        assert torch.equal(got, block(x)), (t, (got - block(x)).abs().max())
    # and the op is not a float path in disguise: the float64 reference differs by its activation quantization
    assert (got.double() - block.reference_forward(x).double()).abs().max() > 0
