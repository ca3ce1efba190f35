"""Gemma 4's GGUF name table (from gguf-py's GEMMA4 table) covers every model tensor, one name each."""

from models.common.parity import check_gguf_names_round_trip
from models.gemma4.architecture import ARCHITECTURE


def test_gguf_names_cover_the_model():
    check_gguf_names_round_trip(ARCHITECTURE, {
        "blk.{L}.attn_q.weight": "model.layers.{L}.self_attn.q_proj.weight",
        "blk.{L}.ffn_norm.weight": "model.layers.{L}.pre_feedforward_layernorm.weight",
        "blk.{L}.layer_output_scale.weight": "model.layers.{L}.layer_scalar",
        "token_embd.weight": "model.embed_tokens.weight",
    })
