"""Checkpoint names for Gemma 4 text: Hugging Face -> llmq, and GGUF <-> HF names.

Our module names are HF's ``Gemma4ForCausalLM`` names. The released checkpoints are multimodal
(``Gemma4ForConditionalGeneration``): the text stack lives under ``model.language_model.``, next to
the vision/audio towers and their embedders, which the text model skips.

GGUF (llama.cpp arch "gemma4") names come from gguf-py's MODEL_ARCH.GEMMA4 table; gguf-py covers
every tensor of the dense text stack. Not covered by that table: llama.cpp's converter stores the
per-layer output scalar as ``layer_scalar.weight`` (RENAMED). Names only: value conventions (norm
offsets, rope_freqs) are the GGUF importer's concern (gguf_checkpoint.py).
"""

from __future__ import annotations

import gguf

from models.common.keymap import gguf_to_hf_table, text_key_map

# Also Gemma 3's multimodal layouts (``model.multi_modal_projector.``).
hf_to_llmq_key = text_key_map((
    "model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.",
    "model.multi_modal_projector.", "vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.",
    "multi_modal_projector.",
))

# The text stack's tensors ({L}: layer index); Gemma 3 has the same less the layer scalar.
HF_TENSORS = (
    "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
    "model.layers.{L}.input_layernorm.weight", "model.layers.{L}.post_attention_layernorm.weight",
    "model.layers.{L}.pre_feedforward_layernorm.weight", "model.layers.{L}.post_feedforward_layernorm.weight",
    "model.layers.{L}.self_attn.q_proj.weight", "model.layers.{L}.self_attn.k_proj.weight",
    "model.layers.{L}.self_attn.v_proj.weight", "model.layers.{L}.self_attn.o_proj.weight",
    "model.layers.{L}.self_attn.q_norm.weight", "model.layers.{L}.self_attn.k_norm.weight",
    "model.layers.{L}.mlp.gate_proj.weight", "model.layers.{L}.mlp.up_proj.weight",
    "model.layers.{L}.mlp.down_proj.weight",
)
LAYER_SCALAR = "model.layers.{L}.layer_scalar"
RENAMED = {LAYER_SCALAR: LAYER_SCALAR + ".weight"}

GGUF_TO_HF = gguf_to_hf_table(gguf.MODEL_ARCH.GEMMA4, HF_TENSORS + (LAYER_SCALAR,), RENAMED)
