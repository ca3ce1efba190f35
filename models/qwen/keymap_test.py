"""GGUF <-> HF names checked against gguf-py's own tensor-name mapping (an independent reference)."""

import gguf

from models.qwen.keymap import GGUF_EXPERT_PAIRS, GGUF_TO_HF

# Names llama.cpp's converter renames before gguf-py's table sees them (qwen3next/qwen3.5 converter facts).
RENAMED_BEFORE_MAPPING = {"model.layers.{L}.linear_attn.dt_bias": "model.layers.{L}.linear_attn.dt_proj.bias"}


def test_gguf_names_agree_with_gguf_py():
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35MOE, 8)
    for gguf_name, hf_name in GGUF_TO_HF.items():
        hf = RENAMED_BEFORE_MAPPING.get(hf_name, hf_name).format(L=5)
        expected = table.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert expected is not None, hf
        mine = gguf_name.format(L=5)
        assert mine == expected or mine == expected + ".weight", (hf, mine, expected)
    (gate, up), fused = next(iter(GGUF_EXPERT_PAIRS.items()))
    assert table.get_name("model.layers.5.mlp.experts.gate_proj") + ".weight" == gate.format(L=5)
    assert table.get_name("model.layers.5.mlp.experts.up_proj") + ".weight" == up.format(L=5)
