"""Checkpoint names for Gemma 3 text: Hugging Face -> llmq, and GGUF <-> HF names.

Our module names are HF's ``Gemma3ForCausalLM`` names. The multimodal checkpoints
(``Gemma3ForConditionalGeneration``) keep the text stack under ``model.language_model.`` (older:
``language_model.model.``) next to the vision tower and projector, which the text model skips;
Gemma 4's map does exactly that, so it is reused.

GGUF (llama.cpp arch "gemma3") names are Gemma 4's without the per-layer output scale (both come
from gguf-py's constants; keymap_test checks them against gguf-py's MODEL_ARCH.GEMMA3 table).
"""

from __future__ import annotations

from models.gemma4 import keymap as gemma4_keymap

hf_to_llmq_key = gemma4_keymap.hf_to_llmq_key

GGUF_TO_HF = {g: h for g, h in gemma4_keymap.GGUF_TO_HF.items() if not h.endswith(".layer_scalar")}
