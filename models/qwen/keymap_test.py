"""Qwen3.5-MoE's GGUF name table (from gguf-py's QWEN35MOE table) covers every model tensor, one name each."""

from models.common.parity import check_gguf_names_round_trip
from models.qwen.architecture import ARCHITECTURE
from models.qwen.keymap import GGUF_EXPERT_PAIRS


def test_gguf_names_cover_the_model():
    check_gguf_names_round_trip(ARCHITECTURE, {
        "blk.{L}.ssm_a": "model.layers.{L}.linear_attn.A_log",
        "blk.{L}.ssm_dt.bias": "model.layers.{L}.linear_attn.dt_bias",
        "blk.{L}.ffn_gate_up_exps.weight": "model.layers.{L}.mlp.experts.gate_up_proj",
        "blk.{L}.ffn_gate_inp_shexp.weight": "model.layers.{L}.mlp.shared_expert_gate.weight",
        "output.weight": "lm_head.weight",
    })
    assert GGUF_EXPERT_PAIRS == {("blk.{L}.ffn_gate_exps.weight", "blk.{L}.ffn_up_exps.weight"):
                                 "model.layers.{L}.mlp.experts.gate_up_proj"}
