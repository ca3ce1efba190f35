"""quality_eval's off-grid reference on a tiny Gemma 3: the rescaling keeps the model's function
(logits equal to float32 rounding) and moves every group of a weight quantized on an int4 grid
off any grid, the two facts the real-model table (docs/quality.md) rests on."""

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from llmq.quant import QuantConfig, dequantize, quantize_weight
from models.gemma3.architecture import ARCHITECTURE
from models.gemma3.config import ModelConfig
from models.gemma3.quality_eval import Evaluator, off_grid, on_grid_fraction, projection_names
from models.pipeline.quantized_model import build_quantized_model


def _tiny():
    hf_config = Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                                 sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                 initializer_range=0.1)
    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(hf_config).eval()
    tensors = {n: p.detach().clone() for n, p in hf.state_dict().items()}
    for n in tensors:
        if "norm" in n:
            tensors[n] += torch.randn_like(tensors[n]) * 0.3
    return ModelConfig.from_hf_dict(hf_config.to_dict()), tensors


def test_off_grid_keeps_the_function_and_leaves_no_group_on_a_grid():
    config, tensors = _tiny()
    names = projection_names(config)
    int4 = QuantConfig(bits=4, group_size=32, symmetric=False)
    for n in names:  # the plain model sits on an int4 g32 grid, as a Q4 GGUF's weights do
        tensors[n] = dequantize(quantize_weight(tensors[n], int4), torch.float32)
    moved = off_grid(tensors, config, seed=1)

    assert all(on_grid_fraction(tensors[n]) == 1.0 for n in names)
    assert all(on_grid_fraction(moved[n]) == 0.0 for n in names)
    assert all(not moved[n].equal(tensors[n]) for n in names)

    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = build_quantized_model(ARCHITECTURE.build_model(config, device="meta"), dict(tensors))(ids).double()
        b = build_quantized_model(ARCHITECTURE.build_model(config, device="meta"), dict(moved))(ids).double()
    # float32 forward passes of two exactly equivalent weight sets: a few ulps per product, summed
    # over ~10 roundings per layer, relative to the logits' scale
    assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())
    pa, pb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    assert float((pa.exp() * (pa - pb)).sum(-1).mean()) < 1e-9


def test_evaluating_variants_leaves_the_reference_as_it_was():
    # each window's reference log-probabilities must come from the reference weights, whatever variant
    # was swapped in before: the same reference numbers with and without variants, and its tensors intact
    config, tensors = _tiny()
    names = projection_names(config)
    original = {n: t.clone() for n, t in tensors.items()}
    noisy = {n: tensors[n] + 0.05 * torch.randn_like(tensors[n]) for n in names}

    def build(weights):
        return build_quantized_model(ARCHITECTURE.build_model(config, device="meta"), dict(weights))

    windows = [torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    alone = Evaluator(build, tensors, windows).run({})
    both = Evaluator(build, tensors, windows).run({"noisy": noisy, "same": {n: tensors[n] for n in names}})
    assert all(tensors[n].equal(original[n]) for n in tensors)
    assert both["reference"]["ppl"] == alone["reference"]["ppl"]
    assert both["noisy"]["mean_kl"] > 1e-4
    assert abs(both["same"]["mean_kl"]) < 1e-9 and both["same"]["top1"] == 1.0
