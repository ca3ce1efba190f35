"""real_shapes: the real configs cut to fewer layers, and the checkpoints written tensor by tensor.

Independent references: transformers' own models built from the same cut configs on the meta device
(parameter counts), and the embedded tiny model's tensors (value statistics)."""

import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import Gemma4ForCausalLM, Gemma4TextConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from models.common.parity import hf_parameter_count
from models.common.tokenizer import load_tokenizer
from models.pipeline import real_shapes

HF = {"gemma4_31b": (Gemma4ForCausalLM, Gemma4TextConfig), "qwen3_5_35b_a3b": (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig)}


@pytest.mark.parametrize("model", sorted(HF))
@pytest.mark.parametrize("layers", [4, 8])
def test_cut_real_config_matches_transformers(model, layers):
    hf = real_shapes.real_config(model, layers)
    text = hf["text_config"]
    assert text["num_hidden_layers"] == layers and len(text["layer_types"]) == layers
    other = "sliding_attention" if model == "gemma4_31b" else "linear_attention"
    assert text["layer_types"][-1] == "full_attention" and other in text["layer_types"]  # both layer kinds
    planned = list(real_shapes.planned_tensors(real_shapes._architecture(model), hf))
    total = sum(math.prod(shape) for _, shape, _ in planned)
    cls, config_cls = HF[model]
    scalars = sum(1 for name, _, _ in planned if name.endswith("layer_scalar"))  # buffers, not parameters
    assert total - scalars == hf_parameter_count(cls, config_cls(**text))
    shapes = {name: tuple(shape) for name, shape, _ in planned}
    last = layers - 1
    if model == "gemma4_31b":
        assert shapes["model.embed_tokens.weight"] == (262144, 5376)
        assert shapes[f"model.layers.{last}.self_attn.q_proj.weight"] == (32 * 512, 5376)  # global head dim
        assert f"model.layers.{last}.self_attn.v_proj.weight" not in shapes  # K = V on full layers
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (5376, 21504)
    else:
        assert shapes["lm_head.weight"] == (248320, 2048)
        experts = [n for n in shapes if n.startswith("model.layers.0.mlp.experts.")]
        assert len(experts) == 256 * 3 and shapes["model.layers.0.mlp.experts.255.down_proj.weight"] == (2048, 512)


@pytest.mark.parametrize("model", sorted(HF))
def test_written_checkpoint(model, tmp_path, monkeypatch):
    """Tiny dimensions (so the test is small), the real writer: every planned tensor once, bf16, the
    tiny default model's statistics, large tensors through the row-block path, a usable tokenizer."""
    monkeypatch.setattr(real_shapes, "BLOCK_ELEMENTS", 4096)  # the embedding (and Qwen's head) by rows
    arch = real_shapes._architecture(model)
    tiny = arch.tiny_hf_config()
    out = tmp_path / "ckpt"
    result = real_shapes.write_real_shapes(model, 4, str(out), hf_config=tiny)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and config["layer_types"][-1] == "full_attention"
    planned = {name: tuple(shape) for name, shape, _ in real_shapes.planned_tensors(arch, config)}
    got = {}
    for shard in out.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                got[name] = f.get_tensor(name)
    assert set(got) == set(planned) and result["tensors"] == len(planned)
    assert all(tuple(t.shape) == planned[n] and t.dtype == torch.bfloat16 for n, t in got.items() if t.is_floating_point())
    stats = real_shapes._tiny_stats(arch, config["layer_types"])
    for name, t in got.items():
        mean, std, _, constant = stats[real_shapes._EXPERT.sub(".experts.*.", name)]
        if constant:
            assert torch.equal(t, torch.full_like(t, mean)), name
        elif t.numel() >= 4096:  # same dimensions as the tiny model: the same spread
            assert abs(t.float().std().item() / std - 1) < 0.1, name
    embed = got["model.embed_tokens.weight"].float()
    assert embed.shape[0] > 1 and not torch.equal(embed[0], embed[-1])  # every row block drawn afresh
    ids = load_tokenizer(str(out)).encode("The capital of France is")
    assert 0 < len(ids) and max(ids) < config["vocab_size"]


@pytest.mark.parametrize("model", sorted(HF))
def test_grown_checkpoint_copies_each_layer_from_one_of_the_same_type(model, tmp_path, monkeypatch):
    """--grow_from: the planned tensors of the larger count, each the bytes of its source tensor (a layer
    from the same index where the type matches, else the first source layer of its type)."""
    monkeypatch.setattr(real_shapes, "BLOCK_ELEMENTS", 4096)  # the embedding by rows, copied by rows
    arch = real_shapes._architecture(model)
    tiny = arch.tiny_hf_config()
    small, big = tmp_path / "small", tmp_path / "big"
    real_shapes.write_real_shapes(model, 2, str(small), hf_config=tiny)
    result = real_shapes.write_real_shapes(model, 4, str(big), hf_config=tiny, grow_from=str(small))

    def tensors(folder):
        out = {}
        for shard in folder.glob("*.safetensors"):
            with safe_open(str(shard), "pt") as f:
                out.update({name: f.get_tensor(name) for name in f.keys()})
        return out

    src, got = tensors(small), tensors(big)
    config = json.loads((big / "config.json").read_text())
    types = config["layer_types"]
    src_types = json.loads((small / "config.json").read_text())["layer_types"]
    assert len(types) == 4 and types[-1] == "full_attention" and src_types[-1] == "full_attention"
    planned = {name: tuple(shape) for name, shape, _ in real_shapes.planned_tensors(arch, config)}
    assert set(got) == set(planned) and result["tensors"] == len(planned)
    for name, t in got.items():
        m = real_shapes._LAYER.search(name)
        i = int(m.group(1)) if m else None
        j = i if i is None or (i < 2 and src_types[i] == types[i]) else src_types.index(types[i])
        source = name if m is None else name[:m.start(1)] + str(j) + name[m.end(1):]
        assert torch.equal(t, src[source]), name
    with pytest.raises(ValueError, match="no layer of type"):
        real_shapes._Source(str(small), ["no_such_attention"])
