"""Gemma 3 from a GGUF file equals Gemma 3 from the HF folder it was converted from.

The GGUF is written with gguf-py the way llama.cpp's converter writes a Gemma 3: gguf-py's own
GEMMA3 tensor-name table (not ours), norms stored as 1 + w, no output.weight (tied), llama.cpp's
metadata keys (no layer pattern: llama.cpp fixes it at 6). Float tensors must come back exactly; a
Q8_0 tensor must come back as gguf-py dequantizes it; norms as w up to float32 rounding of 1 + w,
with the scale 1 + w bit-identical.
"""

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from llmq.checkpoint import load_bundle
from llmq.quant import GroupQuantizedWeight
from llmq.quant.formats import dequantize_canonical
from models.common.loading import load_model
from models.gemma3.architecture import ARCHITECTURE
from models.gemma3.config import ModelConfig
from models.pipeline import gguf_input
from models.pipeline.quantize_and_save import run

Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _hf_folder(folder):
    config = Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                              sliding_window=4, initializer_range=0.1, eos_token_id=1, pad_token_id=0, bos_token_id=2,
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                               "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1_000_000.0}})
    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3)
        hf.model.layers[0].input_layernorm.weight[:4] = torch.tensor([1e-7, -3e-6, 2.0**-20, 0.0])  # tiny |w|
    hf.save_pretrained(folder)
    return hf


def _write_gguf(hf, path):
    c = hf.config
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(c.rope_parameters["full_attention"]["factor"])
    writer.add_sliding_window(c.sliding_window)
    writer.add_token_list([f"t{i}".encode() for i in range(c.vocab_size)])
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_pad_token_id(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, c.num_hidden_layers)
    quantized = {}
    for name, w in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp does not write it
        gguf_name = names.get_name(name[: -len(".weight")]) + ".weight"
        data = w.detach().float().numpy()
        if name.endswith("norm.weight"):
            writer.add_tensor(gguf_name, data + np.float32(1.0))
        elif name.endswith("mlp.down_proj.weight"):
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, Q8_0), raw_dtype=Q8_0)
            quantized[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, Q8_0), Q8_0))
        else:
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return quantized


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3_hf")
    hf = _hf_folder(folder)
    path = folder / "model.gguf"
    quantized = _write_gguf(hf, path)
    return folder, path, quantized


def test_gguf_config_equals_hf_config(converted):
    folder, path, _ = converted
    from_hf = load_model(ARCHITECTURE, folder).config
    from_gguf = ModelConfig.from_hf_dict(gguf_input.hf_config(ARCHITECTURE, str(path)))
    assert from_gguf.rms_norm_eps == float(np.float32(from_hf.rms_norm_eps))  # GGUF stores float32 (as used)
    same = dict(eos_token_id=1, rms_norm_eps=from_hf.rms_norm_eps)
    assert dataclasses.replace(from_gguf, **same) == dataclasses.replace(from_hf, **same)


def test_gguf_weights_equal_hf_weights(converted):
    folder, path, quantized = converted
    expected = load_model(ARCHITECTURE, folder).state_dict()
    config = ModelConfig.from_hf_dict(gguf_input.hf_config(ARCHITECTURE, str(path)))
    got = dict(gguf_input.model_tensors(ARCHITECTURE, str(path), config))
    assert set(got) == set(expected) - {"lm_head.weight"}
    for name, value in got.items():
        if name in quantized:
            assert isinstance(value, GroupQuantizedWeight) and value.bits == 8, name
            assert torch.equal(dequantize_canonical(value), quantized[name]), name
        elif name.endswith("norm.weight"):
            assert torch.equal(value + 1.0, expected[name] + 1.0), name  # the scale the model applies
            assert (value - expected[name]).abs().max().item() <= 2.0**-24, name
        else:
            assert value.dtype == torch.float32 and torch.equal(value, expected[name]), name
    assert len(quantized) == 6


def test_quantize_and_save_from_gguf_and_default(converted, tmp_path):
    _, path, quantized = converted
    result = run(ARCHITECTURE, checkpoint=str(path), recipe="int8", backend="bundle", out=str(tmp_path / "gguf"),
                 resume=False, max_shard_size=1 << 20, verify=True, seed=0, progress=False)
    bundle = load_bundle(result["bundle"])
    assert all(bundle[n].group_size == 32 for n in quantized)  # GGUF-quantized weights keep their Q8_0 groups
    assert bundle["model.layers.0.self_attn.q_proj.weight"].group_size == 64  # float ones: the recipe's per-channel int8
    # int8 per channel: weight error ~0.3 % relative, so logits of a random model agree to ~1e-4 in cosine;
    # under Bazel --verify's quantized side runs the compiled kernel, which also rounds the activations to
    # int8 per group (about as much error again): 1e-3
    assert result["cosine"] > 0.998
    default = run(ARCHITECTURE, checkpoint=None, recipe="int8", backend="bundle", out=str(tmp_path / "default"),
                  resume=False, max_shard_size=1 << 20, verify=True, seed=0, progress=False)
    # 7 projections in each of 6 layers, and the tied embedding (the int8 recipe quantizes it too)
    assert default["quantized"] == 6 * 7 + 1 and default["cosine"] > 0.998
