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


def test_windows_from_a_kld_file_are_llama_perplexitys_and_only_their_second_half_counts(tmp_path):
    import numpy as np
    import pytest

    from models.gemma3.quality_eval import kld_windows

    n_ctx, n_chunk = 8, 3
    ids = np.random.default_rng(0).integers(3, 96, n_ctx * n_chunk).astype("<i4")
    path = tmp_path / "base.kld"
    path.write_bytes(b"_logits_" + np.array([n_ctx, 96, n_chunk], "<i4").tobytes() + ids.tobytes() + b"\0" * 64)
    windows, ctx = kld_windows(str(path), bos=2)
    assert ctx == n_ctx and len(windows) == n_chunk
    for i, w in enumerate(windows):
        assert w[0] == 2 and w[1:].tolist() == ids[i * n_ctx + 1:(i + 1) * n_ctx].tolist()
    (tmp_path / "bad.kld").write_bytes(b"_notlog_" + b"\0" * 12)
    with pytest.raises(SystemExit, match="_logits_"):
        kld_windows(str(tmp_path / "bad.kld"), bos=2)

    # scored from position n_ctx // 2: the KL is the mean over those positions only, computed directly here
    config, tensors = _tiny()
    names = projection_names(config)
    noisy = {n: tensors[n] + 0.05 * torch.randn_like(tensors[n]) for n in names}

    def build(weights):
        return build_quantized_model(ARCHITECTURE.build_model(config, device="meta"), dict(weights))

    got = Evaluator(build, tensors, windows, score_from=n_ctx // 2).run({"noisy": noisy})["noisy"]
    kl, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            a = torch.log_softmax(build(tensors)(w[None, :-1])[0].double(), -1)[n_ctx // 2:]
            b = torch.log_softmax(build({**tensors, **noisy})(w[None, :-1])[0].double(), -1)[n_ctx // 2:]
            kl += float((a.exp() * (a - b)).sum())
            count += len(a)
    assert got["tokens"] == count == n_chunk * (n_ctx - 1 - n_ctx // 2)
    assert abs(got["mean_kl"] - kl / count) <= 1e-4 * kl / count


def test_gguf_table_reads_bits_from_the_file_and_llama_perplexitys_numbers(tmp_path):
    import gguf
    import numpy as np

    from models.gemma3.quality_eval_gguf import file_bits, parse_kld_log, running_kl

    w = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gemma3")
    writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.add_tensor("blk.0.ffn_down.weight", gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight", w)  # not a projection: not counted
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    bits = file_bits(str(tmp_path / "m.gguf"))
    # Q4_0: 18 bytes per 32 weights (4.5 bits), Q8_0: 34 bytes per 32 (8.5 bits), equal weight counts
    assert bits["bpw"] == (4.5 + 8.5) / 2 and bits["types"] == {"Q4_0": 1, "Q8_0": 1}
    assert bits["file_bytes"] == (tmp_path / "m.gguf").stat().st_size

    log = tmp_path / "kld.log"
    log.write_text("   1      41.6432 ±    8.4236       0.28757 ±    0.05116       0.30641 ±    0.01313    10.903 ±  0.870 %"
                   "    72.157 ±  2.812 %\n"
                   "   2      31.2725 ±    4.1976       0.33814 ±    0.03840       0.31738 ±    0.01086    12.568 ±  0.760 %"
                   "    71.176 ±  2.008 %\n"
                   "Mean PPL(Q)                   :  18.973258 ±   1.264008\n"
                   "Mean PPL(base)                :  13.931814 ±   0.881733\n"
                   "Mean    KLD:   0.300689 ±   0.006243\nMaximum KLD:   2.449433\n"
                   "Same top p: 71.716 ± 0.997 %\n")
    r = parse_kld_log(str(log))
    assert (r["mean_kl"], r["mean_kl_err"], r["ppl"], r["ppl_base"]) == (0.300689, 0.006243, 18.973258, 13.931814)
    assert abs(r["top1"] - 0.71716) < 1e-12
    assert running_kl(str(log), 1) == 0.30641 and running_kl(str(log), 2) == 0.31738


def test_sequential_gptq_variant_rounds_later_layers_against_the_quantized_ones_before():
    # gptq-seq: layer 0 meets the same (float) inputs as plain gptq's, so it rounds alike; layer 1's H
    # comes from the quantized layer 0, so it rounds differently. The bits are the storage's count.
    from llmq.quant.importance import collect_calibration, token_batches
    from llmq.quant.storage import CANONICAL
    from models.gemma3.quality_eval import sequential_gptq

    config, tensors = _tiny()
    names = projection_names(config)
    ids = torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(4))
    gptq = QuantConfig(bits=4, group_size=32, symmetric=False, method="gptq", options={"block_size": 16})
    seq, bpw = sequential_gptq(ARCHITECTURE, config, tensors, names, ids, gptq, lambda c: CANONICAL)
    assert sorted(seq) == sorted(names)
    assert bpw == 4 + 2 * 32 / 32  # int4 codes, a float32 scale and bias per 32 weights
    whole = build_quantized_model(ARCHITECTURE.build_model(config, device="meta"), {n: t.clone() for n, t in tensors.items()})
    hessians = collect_calibration(whole, token_batches(ids, 512), sample_rows=0, hessians=True).hessians
    moved = {}
    for n in names:
        plain = dequantize(quantize_weight(tensors[n], gptq, name=n, hessian=hessians[n[: -len(".weight")]]),
                           torch.float32)
        moved[n] = float((plain != seq[n]).double().mean())
    layer0 = [moved[n] for n in names if ".layers.0." in n]
    layer1 = [moved[n] for n in names if ".layers.1." in n]
    assert max(layer0) < 0.01  # the same H up to float rounding (layer by layer vs the whole model)
    assert min(layer1) > 0.05  # another H: other roundings
