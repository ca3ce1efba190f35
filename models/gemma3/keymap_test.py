"""Gemma 3 names: GGUF <-> HF against gguf-py's own GEMMA3 table, and HF names round-trip through the model."""

import gguf

from models.gemma3 import keymap
from models.gemma3.config import ModelConfig
from models.gemma3.model import build_model


def _model_names():
    config = ModelConfig.from_hf_dict({"model_type": "gemma3_text", "num_hidden_layers": 6, "hidden_size": 64,
                                      "intermediate_size": 96, "vocab_size": 128, "head_dim": 16})
    return set(build_model(config, device="meta").state_dict())


def test_gguf_names_agree_with_gguf_py():
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, 8)
    for gguf_name, hf_name in keymap.GGUF_TO_HF.items():
        expected = table.get_name(hf_name.format(L=5), try_suffixes=(".weight", ".bias"))
        mine = gguf_name.format(L=5)
        assert mine in (expected, f"{expected}.weight"), (hf_name, mine, expected)


def test_every_model_tensor_has_one_gguf_name_and_back():
    """HF name -> GGUF name (gguf-py) -> HF name (our table) is the identity on every model tensor."""
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, 6)
    inverse = {}
    for gguf_name, hf_name in keymap.GGUF_TO_HF.items():
        for layer in range(6) if "{L}" in gguf_name else [None]:
            inverse[gguf_name.format(L=layer)] = hf_name.format(L=layer)
    names = _model_names()
    for name in names:
        assert name.endswith(".weight"), name
        gguf_name = table.get_name(name[: -len(".weight")])
        assert gguf_name is not None, name
        assert inverse[gguf_name + ".weight"] == name
    assert set(inverse.values()) == names


def test_hf_key_map():
    assert keymap.hf_to_llmq_key("model.language_model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.up_proj.weight"
    assert keymap.hf_to_llmq_key("language_model.model.norm.weight") == "model.norm.weight"
    assert keymap.hf_to_llmq_key("language_model.lm_head.weight") == "lm_head.weight"
    assert keymap.hf_to_llmq_key("model.layers.0.self_attn.q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    for skipped in ("model.vision_tower.vision_model.post_layernorm.weight", "vision_tower.x",
                    "model.multi_modal_projector.mm_soft_emb_norm.weight", "multi_modal_projector.y"):
        assert keymap.hf_to_llmq_key(skipped) is None
