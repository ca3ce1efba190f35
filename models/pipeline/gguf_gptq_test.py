"""--backend=gguf with method "gptq" rules, end to end on the tiny default Gemma 3, read back by gguf-py.

A recipe with a q4_k gptq rule (down_proj: its rows of 256 are the only ones the K-quants tile) and an "int"
gptq rule of Q4_0's layout (the backend's recipe_for makes it q4_0, options kept), run with
--calibration_text: every GGUF tensor, read with gguf.GGUFReader and dequantized by gguf.quants.dequantize,
equals bit for bit llmq's dequantization of quantize_weight(checkpoint weight, the rule, hessian=the H the
run's calibration measured for that linear); --verify's reload through llmq's GGUF import passes.
"""

import json
import os

import gguf
import numpy as np
import pytest
from safetensors.torch import load_file

from llmq.quant import GroupQuantizedWeight, QuantConfig, quantize_weight
from llmq.quant.formats import dequantize_canonical
from models.gemma3.architecture import ARCHITECTURE as GEMMA3
from models.pipeline import calibration as calibration_module, inputs
from models.pipeline.default_model import write_default_checkpoint, write_tiny_tokenizer
from models.pipeline.gguf_output import gguf_fields
from models.pipeline.quantize_and_save import UsageError, run

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TEXT = "In the beginning the quantizer knew nothing of the text; then it read a few hundred tokens. " * 12
Q4_K = {"format": "q4_k", "method": "gptq", "options": {"block_size": 64}}
Q4_0_INT = {"bits": 4, "group_size": 32, "symmetric": True, "method": "gptq", "options": {"act_order": False}}
RECIPE = {"name": "gguf-gptq", "rules": [{"pattern": r".*\.mlp\.down_proj", "config": Q4_K},
                                         {"pattern": r".*_proj", "config": Q4_0_INT}]}


def _weights(folder):
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def test_gptq_rules_write_gguf_blocks_gguf_py_reads_back_exactly(tmp_path):
    checkpoint = write_default_checkpoint(GEMMA3, str(tmp_path / "ckpt"))
    write_tiny_tokenizer(checkpoint, 512)
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(RECIPE))
    text = tmp_path / "calibration.txt"
    text.write_text(TEXT)
    args = dict(checkpoint=checkpoint, recipe=str(recipe), backend="gguf", resume=True, max_shard_size=1 << 20,
                seed=0, progress=False)
    with pytest.raises(UsageError, match=r"^--recipe rule .* uses method 'gptq', .*: pass --calibration_text=FILE$"):
        run(GEMMA3, out=str(tmp_path / "refused"), verify=False, **args)
    assert not (tmp_path / "refused").exists()

    seen = {}
    real = calibration_module.calibrate_layerwise

    def spy(model, ids, **kw):
        seen["calibration"] = real(model, ids, **kw)
        return seen["calibration"]

    calibration_module.calibrate_layerwise = spy
    try:
        result = run(GEMMA3, out=str(tmp_path / "out"), verify=True, calibration_text=str(text),
                     calibration_tokens=256, **args)
    finally:
        calibration_module.calibrate_layerwise = real
    assert result["verification_failure"] is None and result["cosine"] > 0.9
    hessians = seen["calibration"].hessians

    to_gguf = gguf_fields(GEMMA3, inputs.open_input(GEMMA3, checkpoint, "hf"))["to_gguf"]
    reader = gguf.GGUFReader(str(tmp_path / "out" / "model.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    types = {}
    checked = 0
    for name, w in _weights(checkpoint).items():
        module = name[: -len(".weight")]
        if not module.endswith("_proj"):
            continue
        rule = Q4_K if module.endswith("mlp.down_proj") else {**Q4_0_INT, "format": "q4_0"}
        rule = {k: v for k, v in rule.items() if k not in ("bits", "group_size", "symmetric")}
        assert module in hessians, module
        want = quantize_weight(w, QuantConfig.from_dict(rule), name=name, hessian=hessians[module])
        for gname, gvalue in to_gguf(name, want).items():
            assert isinstance(gvalue, GroupQuantizedWeight)
            t = tensors[gname]
            got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
            assert np.array_equal(got.astype(np.float32), dequantize_canonical(gvalue).numpy()), gname
            types[gname] = t.tensor_type.name
            checked += 1
    assert checked == len([t for t in tensors.values() if t.tensor_type.name in ("Q4_0", "Q4_K")]) > 0
    assert {types[f"blk.{i}.ffn_down.weight"] for i in range(GEMMA3.num_layers(
        GEMMA3.config_from_hf(GEMMA3.tiny_hf_config())))} == {"Q4_K"}
    assert types["blk.0.attn_q.weight"] == types["blk.0.ffn_gate.weight"] == "Q4_0"
    # gptq, not the rule's plain fit: the down_proj blocks differ from q4_k search's
    w = _weights(checkpoint)["model.layers.0.mlp.down_proj.weight"]
    plain = quantize_weight(w, QuantConfig(format="q4_k", method="search"))
    t = tensors["blk.0.ffn_down.weight"]
    got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(plain.shape)
    assert not np.array_equal(got.astype(np.float32), dequantize_canonical(plain).numpy())
