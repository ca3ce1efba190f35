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
* the model: the rounding-error model makes each rounding above an independent uniform error (an
  activation element moved by U[-s/2, s/2] with its own step s, a 4-bit group scale by a relative
  U[-2^-9, 2^-9]). The test runs the eager llmq model under several draws of exactly that model
  (`_rounding_model`: the same steps, per token for 8da linears and per row and weight group for the
  experts, computed from the model's own activations) and takes each draw's max |logit difference|
  over prefill and the decode steps; the .pte, one realisation of the real roundings, must stay
  within 3 times the median draw, a bound that must itself be below 25% of max|logit| (a wrong cache
  slot or a garbage kernel moves logits by about max|logit|). Measured on the tiny models: Gemma's
  draws 4.7e-2..5.8e-2 at max|logit| 8.4, its .pte 4.6e-2; Qwen's draws 6.4e-3..4.1e-2 at 0.87 (its
  random router has near-ties, and most draws flip a routing choice somewhere), its .pte 6.5e-3. The same holds against the exported program run
  in eager torch (torchao's 8da numerics): XNNPACK rounds activations itself (with its own zero point)
  and stores bfloat16 scales, so what differs is rounding of the same kinds.
"""

import contextlib
import os
import subprocess
import sys

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


def _noise(x: torch.Tensor, step: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """x plus one draw of the rounding-error model: independent U[-step/2, step/2] per element."""
    return x + (torch.rand(x.shape, generator=g, dtype=torch.float64).to(x.dtype) - 0.5) * step


def _group_step(x: torch.Tensor, group: int) -> torch.Tensor:
    """The MoE kernel's activation step per row and weight group, symmetric: amax/127, broadcast to x."""
    rows, k = x.shape
    step = x.reshape(rows, k // group, group).abs().amax(-1, keepdim=True) / 127
    return step.expand(rows, k // group, group).reshape(rows, k)


@contextlib.contextmanager
def _rounding_model(model: nn.Module, g: torch.Generator):
    """The eager llmq model with one draw of the .pte's roundings as independent uniform errors (module
    docstring): every quantized linear's input by torchao's per-token step, its 4-bit group scales by a relative
    U[-2^-9, 2^-9] (XNNPACK's bfloat16 scales), and each routed expert's gate_up and down inputs by the MoE
    kernel's per-row, per-group step."""
    hooks, scales, experts = [], [], []
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            hooks.append(module.register_forward_pre_hook(
                lambda mod, args: (_noise(args[0], _act_scale(args[0]), g),) + args[1:]))
            if module.bits == 4:
                scales.append((module.weight_scale, module.weight_scale.clone()))
                module.weight_scale.mul_(1 + (torch.rand(module.weight_scale.shape, generator=g) * 2 - 1) * 2.0**-9)
        elif isinstance(module, QuantizedExperts):

            def noisy_expert(x, e, mod=module):
                x = _noise(x, _group_step(x, mod.gate_up.group_size), g)
                gate, up = F.linear(x, mod.gate_up.expert(e).to(x.dtype)).chunk(2, dim=-1)
                h = F.silu(gate) * up
                return F.linear(_noise(h, _group_step(h, mod.down.group_size), g), mod.down.expert(e).to(x.dtype))

            module._expert = noisy_expert
            experts.append(module)
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for buffer, original in scales:
            buffer.copy_(original)
        for module in experts:
            del module._expert


def _logits_fed(steps, prompt, tokens):
    """Prefill + one decode step per token of `tokens` (the tokens the .pte was fed); the logits of each step."""
    logits, cache = steps["prefill"](prompt)
    out, position = [logits], prompt.shape[1]
    for token in tokens:
        logits, cache = steps["decode"](torch.tensor([[token]]), torch.tensor(position, dtype=torch.long), cache)
        out.append(logits)
        position += 1
    return out


def _model_case(arch_module, export_module, tmp_path, recipe=None):
    decode_steps = 4
    result = export_pte.run(arch_module.ARCHITECTURE, export_module.cache_layout,
                            dynamic_prompt=export_module.DYNAMIC_PROMPT, recipe=recipe, out=str(tmp_path / "m.pte"),
                            max_seq_len=32, decode_steps=decode_steps, prompt_len=8, quiet=True)
    assert result["counts"]["linears"] > 0
    for method in ("prefill", "decode"):  # every linear went to XNNPACK
        assert result["stats"][method]["delegates"] > 0 and result["stats"][method]["linear_outside"] == 0
    return result, result["scale"], None, decode_steps


def _check_vs_eager(result, scale, decode_steps, tmp_path, arch_module, export_module, draws=7):
    # Rebuild the eager llmq model (before the 8da swap) and run it under draws of the rounding model.
    from models.pipeline import export_pt2
    from models.pipeline.export_pt2 import DecodeStep, PrefillStep

    model, _ = export_pt2.load_quantized_model(arch_module.ARCHITECTURE, bundle=None, checkpoint=None,
                                               recipe=arch_module.ARCHITECTURE.default_recipe, seed=0,
                                               workdir=str(tmp_path / "w"))
    export_pt2.to_float32(model)
    layout = export_module.cache_layout(model, 32)
    steps = {"prefill": PrefillStep(model, layout), "decode": DecodeStep(model, layout)}
    tokens = result["ao"]["tokens"]
    assert len(tokens) == decode_steps
    with torch.no_grad():
        eager = _logits_fed(steps, result["prompt"], tokens)
        assert max(_max_abs(a, b) for a, b in zip(eager, result["eager"]["logits"])) <= 1e-5 * scale  # same model
        g = torch.Generator().manual_seed(0)
        simulated = []
        for _ in range(draws):
            with _rounding_model(model, g):
                noisy = _logits_fed(steps, result["prompt"], tokens)
            simulated.append(max(_max_abs(a, b) for a, b in zip(noisy, eager)))
    # the .pte is one realisation of the same roundings: its deviation is of the simulated draws' size
    tolerance = 3 * sorted(simulated)[draws // 2]
    assert tolerance < 0.25 * scale, f"the bound is vacuous: {tolerance} vs max|logit| {scale}"
    assert max(result["vs_eager"]) <= tolerance, (result["vs_eager"], simulated)
    # against torchao's eager 8da numerics (the same program run in eager torch) what differs is XNNPACK's own
    # rounding of the same kinds (its activation quantization, bfloat16 scales): within the same bound
    assert max(result["vs_ao"]) <= tolerance, (result["vs_ao"], simulated)
    # and activations really were quantized in the .pte (float kernels would agree to ~1e-6 of max|logit|)
    assert max(result["vs_eager"]) > 0.05 * min(simulated), (result["vs_eager"], simulated)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("model", ["gemma4", "gemma3"])
def test_gemma_pte_prefill_and_decode(tmp_path, model):
    import importlib

    architecture, export = (importlib.import_module(f"models.{model}.{part}") for part in ("architecture", "export_pt2"))
    result, scale, _, steps = _model_case(architecture, export, tmp_path)
    _check_vs_eager(result, scale, steps, tmp_path, architecture, export)


def test_qwen_pte_prefill_and_decode(tmp_path):
    # the experts run llmq's MoE kernel inside the .pte (every MoE layer, both methods); the rest as for Gemma
    from models.qwen import architecture as qwen_architecture, export_pt2 as qwen_export

    result, scale, _, steps = _model_case(qwen_architecture, qwen_export, tmp_path)
    assert result["counts"]["moe_op_blocks"] > 0 and result["counts"]["expert_blocks"] == 0
    assert result["op_calls"] == {"prefill": result["counts"]["moe_op_blocks"],
                                  "decode": result["counts"]["moe_op_blocks"]}
    _check_vs_eager(result, scale, steps, tmp_path, qwen_architecture, qwen_export)


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
    # without the kernel library (a fresh process), llmq says what to load instead of ExecuTorch's "error: 0x14"
    code = ("import sys\nfrom executorch.runtime import Runtime\nfrom llmq.ops import executorch_kernel as ek\n"
            "program = Runtime.get().load_program(sys.argv[1])\n"
            "try:\n    ek.load_method(program, 'forward', sys.argv[1])\n"
            "except ek.MoEExecuTorchKernelUnavailable as e:\n    print('CLEAR:', e)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env, timeout=600)
    assert "CLEAR:" in run.stdout and "load_executorch_kernel()" in run.stdout, run.stdout + run.stderr
    moe_pte.load_executorch_kernel()
    method = Runtime.get().load_program(str(path)).load_method("forward")
    for t in (5, 1, 16):
        x = torch.randn(1, t, 64, generator=torch.Generator().manual_seed(t))
        got = method.execute([x])[0]
        assert torch.equal(got, block(x)), (t, (got - block(x)).abs().max())
    # and the op is not a float path in disguise: the float64 reference differs by its activation quantization
    assert (got.double() - block.reference_forward(x).double()).abs().max() > 0
