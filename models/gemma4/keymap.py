"""Checkpoint names for Gemma 4 text: Hugging Face -> llmq, and GGUF <-> HF names.

Our module names are HF's ``Gemma4ForCausalLM`` names. The released checkpoints are multimodal
(``Gemma4ForConditionalGeneration``): the text stack lives under ``model.language_model.``, next to
the vision/audio towers and their embedders, which the text model skips.
"""

from __future__ import annotations

from typing import Optional

# Also Gemma 3's multimodal layouts (``model.multi_modal_projector.``; older ``language_model.lm_head.``).
_SKIP_PREFIXES = (
    "model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.",
    "model.multi_modal_projector.", "vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.",
    "multi_modal_projector.",
)
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))


def hf_to_llmq_key(hf_name: str) -> Optional[str]:
    """llmq state-dict name for an HF tensor name, or None for tensors the text model does not use."""
    if hf_name.startswith(_SKIP_PREFIXES):
        return None
    for old, new in _TEXT_PREFIXES:
        if hf_name.startswith(old):
            return new + hf_name[len(old):]
    return hf_name


# GGUF (llama.cpp arch "gemma4") tensor NAMES for the dense text stack, from gguf-py's constants
# (MODEL_ARCH.GEMMA4); {L} is the block index. Names only: value conventions of llama.cpp's
# converter (e.g. norm offsets, rope_freqs) are the GGUF importer's concern and not verified here.
GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{L}.attn_norm.weight": "model.layers.{L}.input_layernorm.weight",
    "blk.{L}.post_attention_norm.weight": "model.layers.{L}.post_attention_layernorm.weight",
    "blk.{L}.ffn_norm.weight": "model.layers.{L}.pre_feedforward_layernorm.weight",
    "blk.{L}.post_ffw_norm.weight": "model.layers.{L}.post_feedforward_layernorm.weight",
    "blk.{L}.layer_output_scale.weight": "model.layers.{L}.layer_scalar",
    "blk.{L}.attn_q.weight": "model.layers.{L}.self_attn.q_proj.weight",
    "blk.{L}.attn_k.weight": "model.layers.{L}.self_attn.k_proj.weight",
    "blk.{L}.attn_v.weight": "model.layers.{L}.self_attn.v_proj.weight",
    "blk.{L}.attn_output.weight": "model.layers.{L}.self_attn.o_proj.weight",
    "blk.{L}.attn_q_norm.weight": "model.layers.{L}.self_attn.q_norm.weight",
    "blk.{L}.attn_k_norm.weight": "model.layers.{L}.self_attn.k_norm.weight",
    "blk.{L}.ffn_gate.weight": "model.layers.{L}.mlp.gate_proj.weight",
    "blk.{L}.ffn_up.weight": "model.layers.{L}.mlp.up_proj.weight",
    "blk.{L}.ffn_down.weight": "model.layers.{L}.mlp.down_proj.weight",
}
