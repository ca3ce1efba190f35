"""Gemma 4 (dense text) as the quantize_and_save pipeline sees it (models/pipeline/arch.py)."""

from __future__ import annotations

from models.gemma4 import gguf_checkpoint, keymap
from models.gemma4.config import MULTIMODAL_MODEL_TYPES, TEXT_MODEL_TYPES, ModelConfig
from models.gemma4.model import build_model
import os

from models.pipeline.arch import Architecture, recipe_file_descriptions, recipe_files

LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]


def tiny_hf_config() -> dict:
    """A tiny Gemma 4 text config in the 31B's shape: 5 sliding : 1 full layers, K=V on full
    layers, soft-capped logits, tied embeddings; every K a multiple of 64."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, global_head_dim=64, num_global_key_value_heads=1,
        attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=8, final_logit_softcapping=30.0,
        layer_types=LAYER_TYPES,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        },
    ).to_dict()


def prepare_default(model) -> None:
    """Make the random embedded-default model behave like a trained one in two known ways.

    - Gemma 4 attends with scaling 1.0 after q/k RMSNorms: with unit gains the attention logits
      have variance head_dim, softmax is near one-hot and any perturbation flips it. Trained
      models learn small q/k gains; use head_dim**-0.25 each (1/sqrt(head_dim) overall).
    - Each block's output passes a post-norm, so with unit gains every block adds a unit-RMS
      random vector to the residual stream and errors of all 2L blocks add up undamped. Use the
      scaled residual init of GPT-2/Megatron: post-norm gains 1/sqrt(2L), and embeddings of unit
      RMS after Gemma's sqrt(hidden) input scaling (std 1/sqrt(hidden)), as in trained Gemmas.
    """
    residual_gain = (2 * len(model.model.layers)) ** -0.5
    embed = model.model.embed_tokens.weight
    embed.normal_(0.0, embed.shape[1] ** -0.5)
    for name, module in model.named_modules():
        if name.endswith(("q_norm", "k_norm")):
            module.weight.mul_(module.weight.shape[0] ** -0.25)
        elif name.endswith(("post_attention_layernorm", "post_feedforward_layernorm")):
            module.weight.mul_(residual_gain)


RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipes")

ARCHITECTURE = Architecture(
    name="gemma4",
    tiny_hf_config=tiny_hf_config,
    config_from_hf=ModelConfig.from_hf_dict,
    build_model=build_model,
    key_map=keymap.hf_to_llmq_key,
    presets=recipe_files(RECIPES),
    prepare_default=prepare_default,
    gguf_import=gguf_checkpoint,
    hf_model_types=TEXT_MODEL_TYPES + MULTIMODAL_MODEL_TYPES,
    target="//models/gemma4:quantize_and_save",
    recipe_descriptions=recipe_file_descriptions(RECIPES),
)
