"""The mlx-lm folder writer, end to end: tiny llama (dense, mixed precision, sharded) and
tiny qwen3_moe (stacked experts in switch layers) load offline with `mlx_lm.load`, and
their logits equal transformers' logits computed from our dequantized weights."""

import json
import os

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="the MLX runtime (mlx, or mlx[cpu] on Linux) is not installed here")
mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed here")

from llmq.checkpoint import CheckpointError  # noqa: E402
from llmq.quant.formats import dequantize_canonical  # noqa: E402
from llmq_mlx import pack_mlx_affine, write_mlx_lm_folder  # noqa: E402
from llmq_mlx.mlx_lm_writer import quantization_section  # noqa: E402
from mlx_testutil import hf_logits, logits_tolerance, random_canonical  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB = 96


def write_tokenizer(folder):
    """A WordLevel tokenizer ("t0".."t92" plus specials), made offline with `tokenizers`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i + 3 for i in range(VOCAB - 3)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    with open(folder / "tokenizer_config.json", "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
            },
            f,
        )
    return [folder / "tokenizer.json", folder / "tokenizer_config.json"]


def test_quantization_section_overrides_and_kept_layers():
    p4 = {"group_size": 64, "bits": 4, "mode": "affine"}
    p8 = {"group_size": 32, "bits": 8, "mode": "affine"}
    s = quantization_section({"a": p4, "b": p4, "c": p8}, kept=["emb", "a"])
    assert s == {"group_size": 64, "bits": 4, "mode": "affine", "c": p8, "emb": False}
    assert quantization_section({}, kept=["emb"]) is None


def test_tiny_llama_mixed_precision_sharded(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="eager")).float().eval()
    # mixed recipe: default 4-bit g64; layer 0's MLP 8-bit g32 (an override); down_proj of
    # layer 1 is 3-bit with a coarse group of 128 over K=128 (whole row, kept as 128);
    # lm_head 6-bit; layer 1 o_proj and the embedding kept in high precision.
    recipe = {
        "model.layers.0.mlp.gate_proj": (8, 32), "model.layers.0.mlp.up_proj": (8, 32),
        "model.layers.0.mlp.down_proj": (8, 32), "model.layers.1.mlp.down_proj": (3, 128),
        "lm_head": (6, 64), "model.layers.1.self_attn.o_proj": None, "model.embed_tokens": None,
    }
    items, expected_params = [], {}
    state = model.state_dict()
    for i, (name, t) in enumerate(state.items()):
        module = name[: -len(".weight")]
        if t.dim() != 2 or recipe.get(module, (4, 64)) is None:
            items.append((name, t.clone()))
            continue
        bits, group = recipe.get(module, (4, 64))
        w = random_canonical(tuple(t.shape), bits, group, seed=i)
        with torch.no_grad():
            state[name].copy_(dequantize_canonical(w))  # the torch reference uses our dequantize
        items.append((name, pack_mlx_affine(w, name=name)))
        expected_params[module] = {"group_size": group, "bits": bits, "mode": "affine"}

    tok_files = write_tokenizer(tmp_path / "tok")
    out = write_mlx_lm_folder(
        tmp_path / "llama-mlx", iter(items), {"model_type": "llama", **cfg}, tokenizer_files=tok_files,
        max_shard_bytes=64 << 10,
    )
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in files and "tokenizer.json" in files
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert "model.layers.0.self_attn.q_proj.scales" in index["weight_map"]

    config = json.loads((out / "config.json").read_text())
    q = config["quantization"]
    assert (q["group_size"], q["bits"], q["mode"]) == (64, 4, "affine")
    assert q["model.layers.0.mlp.gate_proj"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    assert q["model.layers.1.mlp.down_proj"] == {"group_size": 128, "bits": 3, "mode": "affine"}
    assert q["model.layers.1.self_attn.o_proj"] is False and q["model.embed_tokens"] is False
    assert "model.layers.0.self_attn.q_proj" not in q  # default params: no override

    mlx_model, tokenizer = mlx_lm.load(str(out))
    text = "t1 t5 t9 t40 t2 t77 t3 t3 t60"
    ids = tokenizer.encode(text)
    assert ids == [int(w[1:]) + 3 for w in text.split()]
    # every quantized module became QuantizedLinear with the params we wrote
    layer0 = mlx_model.model.layers[0]
    assert (layer0.mlp.gate_proj.bits, layer0.mlp.gate_proj.group_size) == (8, 32)
    down1 = mlx_model.model.layers[1].mlp.down_proj
    assert (down1.bits, down1.group_size) == (3, 128)
    assert not hasattr(mlx_model.model.layers[1].self_attn.o_proj, "scales")

    got = np.array(mlx_model(mx.array([ids]))[0].astype(mx.float32))
    ref32, ref64 = hf_logits(model, ids)
    tol = logits_tolerance(ref64, [64, 128, 64, 128, 64])
    assert np.abs(ref32 - ref64).max() <= tol  # the bound holds for torch's own fp32 too
    err = np.abs(got - ref64).max()
    print(f"max|mlx - ref64| {err:.3e}, max|torch fp32 - ref64| {np.abs(ref32 - ref64).max():.3e}, tol {tol:.3e}")
    assert err <= tol, f"max |mlx - ref| = {err:.3e} > {tol:.3e}"


def test_tiny_qwen3_moe_stacked_experts(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(1)
    e, inter, hidden = 4, 192, 64  # down_proj: K = 192, one group per row -> regrouped to 64
    cfg = dict(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=128, moe_intermediate_size=inter,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=e,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(**cfg, attn_implementation="eager", experts_implementation="eager")
    ).float().eval()
    state = model.state_dict()
    items = []
    for i, (name, t) in enumerate(state.items()):
        if name.endswith("mlp.experts.gate_up_proj"):  # HF [E, 2I, H] (gate rows, then up rows)
            prefix = name[: -len("experts.gate_up_proj")] + "switch_mlp."
            gate = random_canonical((e, inter, hidden), 4, 64, seed=i)
            up = random_canonical((e, inter, hidden), 4, 64, seed=i + 1000)
            with torch.no_grad():
                t.copy_(torch.cat([dequantize_canonical(gate), dequantize_canonical(up)], dim=1))
            items.append((prefix + "gate_proj.weight", pack_mlx_affine(gate)))
            items.append((prefix + "up_proj.weight", pack_mlx_affine(up)))
        elif name.endswith("mlp.experts.down_proj"):  # HF [E, H, I]; a whole-row group regrouped to 64
            prefix = name[: -len("experts.down_proj")] + "switch_mlp."
            down = random_canonical((e, hidden, inter), 8, inter, seed=i)
            with torch.no_grad():
                t.copy_(dequantize_canonical(down))
            items.append((prefix + "down_proj.weight", pack_mlx_affine(down)))
        elif t.dim() == 2 and "embed" not in name and not name.endswith("mlp.gate.weight"):
            w = random_canonical(tuple(t.shape), 4, 32, seed=i)
            with torch.no_grad():
                t.copy_(dequantize_canonical(w))
            items.append((name, w))  # the writer packs canonical weights itself
        else:
            items.append((name, t.clone()))

    out = write_mlx_lm_folder(
        tmp_path / "moe-mlx", items, {"model_type": "qwen3_moe", **cfg},
        tokenizer_files=write_tokenizer(tmp_path / "tok"),
    )
    assert (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists()
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert q["model.layers.0.mlp.switch_mlp.down_proj"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    assert q["model.layers.0.mlp.gate"] is False

    mlx_model, tokenizer = mlx_lm.load(str(out))
    switch = mlx_model.model.layers[0].mlp.switch_mlp
    assert type(switch.gate_proj).__name__ == "QuantizedSwitchLinear"
    assert switch.gate_proj.weight.shape == (e, inter, hidden * 4 // 32)
    ids = tokenizer.encode("t4 t8 t15 t16 t23 t42 t0 t90")
    got = np.array(mlx_model(mx.array([ids]))[0].astype(mx.float32))
    ref32, ref64 = hf_logits(model, ids)
    tol = logits_tolerance(ref64, [64, 64, 64, 192, 64])
    assert np.abs(ref32 - ref64).max() <= tol
    err = np.abs(got - ref64).max()
    print(f"max|mlx - ref64| {err:.3e}, max|torch fp32 - ref64| {np.abs(ref32 - ref64).max():.3e}, tol {tol:.3e}")
    assert err <= tol, f"max |mlx - ref| = {err:.3e} > {tol:.3e}"


def test_writer_rejects_bad_input(tmp_path):
    w = pack_mlx_affine(random_canonical((8, 64), 4, 32))
    with pytest.raises(ValueError, match="model_type"):
        write_mlx_lm_folder(tmp_path / "a", [("x.weight", w)], {})
    with pytest.raises(ValueError, match="written twice"):
        write_mlx_lm_folder(tmp_path / "b", [("x.weight", w), ("x", w)], {"model_type": "llama"})
    with pytest.raises(TypeError, match="y.weight"):
        write_mlx_lm_folder(tmp_path / "c", [("y.weight", np.zeros(3))], {"model_type": "llama"})
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no half-written folders left behind
    write_mlx_lm_folder(tmp_path / "d", [("x.weight", w)], {"model_type": "llama"})
    with pytest.raises(CheckpointError, match="output already exists; pass overwrite=True"):
        write_mlx_lm_folder(tmp_path / "d", [("x.weight", w)], {"model_type": "llama"})


def test_same_input_gives_byte_identical_folders(tmp_path):
    def items():
        yield "model.embed_tokens.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4)
        yield "model.layers.0.mlp.down_proj.weight", random_canonical((16, 128), 4, 64, seed=1)
        yield "model.layers.0.mlp.up_proj", pack_mlx_affine(random_canonical((16, 128), 8, 128, seed=2))

    a = write_mlx_lm_folder(tmp_path / "a", items(), {"model_type": "llama"}, max_shard_bytes=2048)
    b = write_mlx_lm_folder(tmp_path / "b", items(), {"model_type": "llama"}, max_shard_bytes=2048)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and len(names) > 2
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
