"""End to end: an HF folder streams through quantize_stream into a bundle and back, unchanged.

The reference is quantize_weight applied to the whole in-memory state dict: the streaming
path (one tensor at a time, sharded, crash-safe writer) must give the identical weights.
"""

import json
import os

import torch
from safetensors.torch import save_file

from llmq.checkpoint import iter_checkpoint, load_bundle, read_manifest, save_bundle
from llmq.quant import GroupQuantizedWeight, QuantConfig, QuantRecipe, QuantRule, quantize_stream, quantize_weight


def write_checkpoint(folder):
    g = torch.Generator().manual_seed(0)
    sd = {"model.embed_tokens.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16)}
    for i in range(3):
        sd[f"model.layers.{i}.mlp.up_proj.weight"] = torch.randn(48, 32, generator=g).to(torch.bfloat16)
        sd[f"model.layers.{i}.mlp.down_proj.weight"] = torch.randn(32, 48, generator=g).to(torch.bfloat16)
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(32, dtype=torch.bfloat16)
    os.makedirs(folder)
    names = sorted(sd)
    weight_map = {}
    for s in range(2):
        shard = f"model-{s + 1:05d}-of-00002.safetensors"
        save_file({n: sd[n] for n in names[s::2]}, os.path.join(folder, shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in names[s::2]})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    return sd


def test_streamed_bundle_equals_in_memory_quantization(tmp_path):
    sd = write_checkpoint(tmp_path / "hf")
    config = QuantConfig(bits=4, group_size=16, symmetric=False)
    recipe = QuantRecipe([QuantRule(r"model\.layers\.\d+\.mlp\.\w+_proj", config)])
    out = save_bundle(quantize_stream(iter_checkpoint(tmp_path / "hf"), recipe), tmp_path / "out",
                      recipe=recipe, max_shard_bytes=2048, fsync=False)
    got = load_bundle(out)
    assert set(got) == set(sd)
    for name, w in sd.items():
        if name.endswith("_proj.weight"):
            want = quantize_weight(w, config, name=name)
            assert isinstance(got[name], GroupQuantizedWeight)
            for field in ("qdata", "scale", "bias"):
                assert torch.equal(getattr(got[name], field), getattr(want, field)), (name, field)
            assert (got[name].bits, got[name].group_size, got[name].dtype) == (4, 16, torch.bfloat16)
        else:
            assert torch.equal(got[name], w)
    manifest = read_manifest(out)
    assert manifest["recipe"] == json.loads(json.dumps(recipe.to_dict(), sort_keys=True))
    assert len(manifest["shards"]) > 1
