"""Parity of models.qwen with transformers' Qwen3_5MoeForCausalLM on a tiny random config.

Both models read the same save_pretrained folder and run in float32 on CPU, within
models.common.parity's FP32_REL_TOL (derived there from fp32 rounding).
"""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from models.common import parity
from models.common.loading import load_model
from models.qwen import keymap
from models.qwen.architecture import ARCHITECTURE
from models.qwen.config import ModelConfig
from models.qwen.delta_rule import delta_rule
from models.qwen.model import build_model


def tiny_hf_config(**overrides):
    values = dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        initializer_range=0.1,  # larger than the default 0.02 so logits are O(1) and routing is decisive
    )
    values.update(overrides)
    return Qwen3_5MoeTextConfig(**values)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    hf = Qwen3_5MoeForCausalLM(tiny_hf_config()).eval()
    with torch.no_grad():  # HF initialises norms to their identity; randomise them so they are tested
        for name, p in hf.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp("qwen_tiny")
    hf.save_pretrained(folder)
    return folder, hf


def test_prefill_and_decode_match_transformers(checkpoint):
    parity.check_prefill_and_decode(ARCHITECTURE, *checkpoint, vocab=96)


def test_long_prefill_crosses_delta_rule_chunks(checkpoint):
    """A 70-token prompt spans two 64-token chunks of the DeltaNet prefill."""
    folder, hf = checkpoint
    ours = load_model(ARCHITECTURE, folder, device="cpu", dtype=torch.float32).eval()
    prompt = torch.randint(0, 96, (1, 70), generator=torch.Generator().manual_seed(2))
    expected, actual = parity.hf_logits(hf, prompt, 1), parity.llmq_logits(ours, prompt, 1)
    scale = max(e.abs().max().item() for e in expected)
    worst = max((a - e).abs().max().item() for a, e in zip(actual, expected))
    assert worst <= parity.FP32_REL_TOL * scale, f"max abs error {worst} > {parity.FP32_REL_TOL} * {scale}"


def test_chunked_delta_rule_equals_recurrent():
    g = torch.Generator().manual_seed(3)
    b, s, hk, hv, dk, dv = 2, 37, 2, 4, 8, 6
    q, k = torch.randn(b, s, hk, dk, generator=g), torch.randn(b, s, hk, dk, generator=g)
    v = torch.randn(b, s, hv, dv, generator=g)
    log_decay = -torch.rand(b, s, hv, generator=g) * 3
    beta = torch.rand(b, s, hv, generator=g)
    state = torch.randn(b, hv, dk, dv, generator=g)
    ref_out, ref_state = delta_rule(q, k, v, log_decay, beta, state, chunk_size=None)
    for chunk in (8, 16, 64):
        out, final = delta_rule(q, k, v, log_decay, beta, state, chunk_size=chunk)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final, ref_state, rtol=1e-5, atol=1e-5)


def test_fused_multimodal_layout_loads_the_same(checkpoint, tmp_path):
    """The released layout: model.language_model.* prefix, fused experts, plus vision and MTP tensors to skip."""
    folder, hf = checkpoint
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    fused = keymap.stack_experts({keymap.hf_to_llmq_key(n): t for n, t in tensors.items()})
    parity.check_multimodal_layout_loads_the_same(ARCHITECTURE, folder, tmp_path, "qwen3_5_moe", {
        "model.visual.blocks.0.attn.qkv.weight": torch.zeros(3, 3),
        "mtp.layers.0.input_layernorm.weight": torch.zeros(3)}, tensors=fused)


def test_key_map_and_stacking():
    assert keymap.hf_to_llmq_key("model.language_model.layers.3.mlp.gate.weight") == "model.layers.3.mlp.gate.weight"
    assert keymap.hf_to_llmq_key("model.visual.merger.linear_fc1.weight") is None
    assert keymap.hf_to_llmq_key("mtp.fc.weight") is None
    assert keymap.hf_to_llmq_key("lm_head.weight") == "lm_head.weight"
    gate, up, down = torch.randn(2, 5, 3), torch.randn(2, 5, 3), torch.randn(2, 3, 5)
    per_expert = {}
    for e in range(2):
        per_expert[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = gate[e]
        per_expert[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = up[e]
        per_expert[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = down[e]
    stacked = keymap.stack_experts(per_expert)
    assert torch.equal(stacked["model.layers.0.mlp.experts.gate_up_proj"], torch.cat((gate, up), dim=1))
    assert torch.equal(stacked["model.layers.0.mlp.experts.down_proj"], down)
    del per_expert["model.layers.0.mlp.experts.1.up_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts"):
        keymap.stack_experts(per_expert)


def _per_expert(n_experts=3, f=5, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(n_experts):  # checkpoint (alphabetical) order: down, gate, up of each expert
        out[f"model.layers.2.mlp.experts.{e}.down_proj.weight"] = torch.randn(d, f, generator=g).bfloat16()
        out[f"model.layers.2.mlp.experts.{e}.gate_proj.weight"] = torch.randn(f, d, generator=g).bfloat16()
        out[f"model.layers.2.mlp.experts.{e}.up_proj.weight"] = torch.randn(f, d, generator=g).bfloat16()
    return out


def test_expert_stacks_filled_tensor_by_tensor_equal_stack_experts():
    per_expert = _per_expert()
    stacks = keymap.ExpertStacks.for_tensor(next(iter(per_expert)), 3)
    for name, t in per_expert.items():
        assert not stacks.complete
        stacks.add(name, t)
    assert stacks.complete
    want = keymap.stack_experts(per_expert)
    got = stacks.stacks()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)

    name = "model.layers.2.mlp.experts.1.up_proj.weight"
    bad = [(name, per_expert[name], "given twice"),
           ("model.layers.2.mlp.experts.3.up_proj.weight", per_expert[name], "outside 0..2"),
           ("model.layers.2.mlp.experts.0.gate_proj.weight", per_expert[name][:, :3], "inconsistent shapes"),
           ("model.layers.2.mlp.experts.0.gate_proj.weight", per_expert[name].float(), "inconsistent shapes"),
           ("model.layers.3.mlp.experts.0.gate_proj.weight", per_expert[name], "not a per-expert tensor of")]
    for bad_name, tensor, message in bad:
        fresh = keymap.ExpertStacks.for_tensor(bad_name, 3)
        if "layers.2" in bad_name and "outside" not in message:  # the block's first tensor fixes its shapes
            fresh.add(name, per_expert[name])
        target = stacks if "layers.3" in bad_name else fresh
        with pytest.raises(ValueError, match=message) as e:
            target.add(bad_name, tensor)
        assert bad_name in str(e.value)
    with pytest.raises(ValueError, match="incomplete"):
        keymap.ExpertStacks.for_tensor(name, 3).stacks()


def test_streamed_experts_are_not_held_until_the_layer_completes():
    """merge_experts_stream copies each per-expert tensor into the stacks at once: none is still
    referenced when the next is asked for, so a layer costs its stacks, not twice that."""
    import weakref

    from models.pipeline.streaming import merge_experts_stream

    per_expert = _per_expert()
    want = keymap.stack_experts(per_expert)
    refs = []

    def source():
        for name in list(per_expert):
            t = per_expert.pop(name)
            if refs:
                assert refs[-1]() is None, "the previous per-expert tensor is still held"
            refs.append(weakref.ref(t))
            yield name, t
            del t

    got = dict(merge_experts_stream(source(), ARCHITECTURE, 3))
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert len(refs) == 9 and all(r() is None for r in refs)


def test_generate_matches_transformers_greedy(checkpoint):
    parity.check_greedy_generate(ARCHITECTURE, *checkpoint, [5, 17, 3, 42, 8])


def test_meta_build_and_bad_config():
    model = build_model(ModelConfig.from_hf_dict(tiny_hf_config().to_dict()), device="meta")
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf_dict({"model_type": "llama"})


def test_shape_mismatch_names_the_tensor(checkpoint, tmp_path):
    folder, _ = checkpoint
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    tensors["model.norm.weight"] = torch.zeros(7)
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    os.link(os.path.join(folder, "config.json"), os.path.join(tmp_path, "config.json"))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(7,\)"):
        load_model(ARCHITECTURE, tmp_path)


def test_dense_expert_path_equals_sparse():
    """The static-shape path used under torch.export computes the same mixture as the eager one."""
    config = ModelConfig.from_hf_dict(tiny_hf_config().to_dict())
    torch.manual_seed(4)
    moe = build_model(config, device="cpu").model.layers[0].mlp
    x = torch.randn(7, config.hidden_size)
    weights, index = moe.gate(x)
    torch.testing.assert_close(moe.experts.dense_forward(x, weights, index), moe.experts(x, weights, index),
                               rtol=1e-5, atol=1e-6)


def test_prefill_exports(checkpoint):
    """torch.export captures the cache-free prefill (DeltaNet, gated attention, MoE) with eager's logits."""
    folder, _ = checkpoint
    ours = load_model(ARCHITECTURE, folder).eval()
    prompt = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(5))
    program = torch.export.export(ours, (prompt,))
    with torch.no_grad():
        torch.testing.assert_close(program.module()(prompt), ours(prompt), rtol=1e-5, atol=1e-5)


def test_bfloat16_runs_and_tracks_float32(checkpoint):
    folder, _ = checkpoint
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        ref = load_model(ARCHITECTURE, folder, dtype=torch.float32)(prompt)
        low = load_model(ARCHITECTURE, folder, dtype=torch.bfloat16)(prompt).float()
    cosine = torch.nn.functional.cosine_similarity(ref.flatten(), low.flatten(), dim=0).item()
    assert cosine > 0.99, cosine  # bf16 keeps ~8 bits of mantissa; logits stay aligned, not equal
