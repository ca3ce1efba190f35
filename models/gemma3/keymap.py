"""Checkpoint names for Gemma 3 text: Hugging Face -> llmq, and GGUF <-> HF names.

Our module names are HF's ``Gemma3ForCausalLM`` names. The multimodal checkpoints
(``Gemma3ForConditionalGeneration``) keep the text stack under ``model.language_model.`` (older:
``language_model.model.``) next to the vision tower and projector, which the text model skips;
Gemma 4's map does exactly that, so it is reused.

GGUF (llama.cpp arch "gemma3") names come from gguf-py's MODEL_ARCH.GEMMA3 table, which covers
every tensor (Gemma 4's text tensors without the per-layer output scale); nothing is renamed.
"""

from __future__ import annotations

import gguf

from models.common.keymap import gguf_to_hf_table
from models.gemma4 import keymap as gemma4_keymap

hf_to_llmq_key = gemma4_keymap.hf_to_llmq_key

GGUF_TO_HF = gguf_to_hf_table(gguf.MODEL_ARCH.GEMMA3, gemma4_keymap.HF_TENSORS)
