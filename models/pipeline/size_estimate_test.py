"""The size estimate printed before a run equals the bytes of the tensors the run then writes.

A tiny Gemma 3 goes in as an HF folder and as a GGUF holding the block types of a llama.cpp
Q4_K_M file (Q4_K, Q5_0, Q6_K and Q8_0 matrices, a Q8_0 embedding that the import dequantizes,
F32 norms), written by gguf-py with blocks encoded by llmq's GGUF encoder. For the bundle, MLX and
GGUF backends, `--dry_run`'s estimate is compared with the sum of the tensors' bytes in the written
files, read from the files' own headers (safetensors: each entry's data offsets; GGUF: gguf-py's
reader). The estimate leaves out file headers and side files, so the two are equal.
"""

from __future__ import annotations

import json
import os
import struct

import gguf
import numpy as np
import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import models.pipeline.cli  # noqa: F401  (registers the backends)
from llmq.checkpoint.shard_file import header_reserve
from llmq.quant.formats.gguf_quant import encode_blocks, quantize as gguf_quantize
from models.gemma3.architecture import ARCHITECTURE as GEMMA3
from models.pipeline.quantize_and_save import run

T = gguf.GGMLQuantizationType
# Q4_K_M's mix for Gemma 3 270M (attn_v and ffn_down alternate between layers there)
BLOCK_TYPES = {"q_proj": T.Q5_0, "k_proj": T.Q5_0, "v_proj": T.Q8_0, "o_proj": T.Q4_K, "gate_proj": T.Q5_0,
               "up_proj": T.Q5_0, "down_proj": T.Q6_K, "embed_tokens": T.Q8_0}
VOCAB = 288  # <pad> <eos> <bos> <unk>, 256 byte tokens, fillers: a tokenizer the MLX folder can carry


def _hf_model():
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=128, query_pre_attn_scalar=128,
                              sliding_window=4, eos_token_id=1, pad_token_id=0, bos_token_id=2,
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                               "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1_000_000.0}})
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config)


def _write_gguf(hf, path):
    c = hf.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(1_000_000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(8.0)
    w.add_sliding_window(c.sliding_window)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(VOCAB - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list([t.encode() for t in tokens])
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types([3, 3, 3, 2] + [6] * 256 + [1] * (VOCAB - 260))
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, c.num_hidden_layers)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp does not write it
        gguf_name = names.get_name(name[: -len(".weight")]) + ".weight"
        data = t.detach().float()
        if name.endswith("norm.weight"):
            w.add_tensor(gguf_name, data.numpy() + np.float32(1.0))
            continue
        qtype = next(v for k, v in BLOCK_TYPES.items() if k in name)
        kind = qtype.name.lower()
        w.add_tensor(gguf_name, encode_blocks(kind, gguf_quantize(data, kind)), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tensor_bytes(folder):
    """The bytes of every tensor in the folder's safetensors and GGUF files, from their headers; and
    each safetensors file's size less its tensors' bytes (its header)."""
    total, headers = 0, []
    for root, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(root, f)
            if f.endswith(".safetensors"):
                with open(path, "rb") as fh:
                    (n,) = struct.unpack("<Q", fh.read(8))
                    header = json.loads(fh.read(n))
                data = sum(m["data_offsets"][1] - m["data_offsets"][0] for k, m in header.items()
                           if k != "__metadata__")
                total += data
                headers.append(os.path.getsize(path) - data)
            elif f.endswith(".gguf"):
                total += sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    return total, headers


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    hf = _hf_model()
    hf.save_pretrained(folder / "hf")
    _write_gguf(hf, folder / "model.gguf")
    return {"hf": str(folder / "hf"), "gguf": str(folder / "model.gguf")}


# int4: the embedding 8-bit in groups of 32 (Q8_0's class); int4-e8: per channel (the GGUF's Q8_0
# embedding is imported dequantized, so the recipe's config decides its size; GGUF holds no per-channel int8)
@pytest.mark.parametrize("recipe,backend", [("int4", "bundle"), ("int4", "mlx"), ("int4", "gguf"),
                                            ("int4-e8", "bundle"), ("int4-e8", "mlx")])
@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_estimate_equals_the_tensor_bytes_written(inputs, source, recipe, backend, tmp_path):
    args = dict(checkpoint=inputs[source], recipe=recipe, backend=backend, resume=False, max_shard_size=1 << 30,
                verify=False, seed=0, progress=False)
    estimate = run(GEMMA3, out=str(tmp_path / "dry"), dry_run=True, **args)["estimate"]
    assert not os.path.exists(tmp_path / "dry")  # --dry_run writes nothing
    run(GEMMA3, out=str(tmp_path / "out"), **args)
    written, headers = tensor_bytes(tmp_path / "out")
    assert estimate.bytes_out == written
    # what the estimate leaves out: each safetensors file's header, the reserve llmq's writer keeps for it
    assert all(h == header_reserve(args["max_shard_size"]) for h in headers)
