"""What --backend=gguf needs from the model, handed over in the WriteJob (the backend never imports models/).

The model's GGUF import module (`Architecture.gguf_import`: models/<m>/gguf_checkpoint.py) is read the other
way: its converter's name table and value transforms (`GGUFConverter.to_gguf`, models/common/keymap.py) turn
each model-layout tensor into the GGUF tensors llama.cpp loads; its `gguf_metadata(hf_config, config)` gives the
architecture's `<arch>.*` keys for an HF input (a GGUF input's keys are carried over by the backend itself),
and its optional `gguf_extra_tensors(hf_config, config)` the tensors llama.cpp needs that are no model tensor
(Gemma 4's rope_freqs). An architecture without them gets no fields, and the backend refuses it in one line.
"""

from __future__ import annotations

from typing import Any, Dict

from models.pipeline.arch import Architecture


def gguf_fields(arch: Architecture, source) -> Dict[str, Any]:
    """WriteJob fields gguf_arch, to_gguf, gguf_metadata, from_gguf for `arch` (empty where it has no GGUF export)."""
    module = arch.gguf_import
    converter_class = getattr(module, "GGUFConverter", None)
    metadata = getattr(module, "gguf_metadata", None)
    if converter_class is None or metadata is None or not hasattr(converter_class, "to_gguf"):
        return {}
    converter = converter_class(source.config)
    extra = getattr(module, "gguf_extra_tensors", lambda hf_config, config: {})
    pending = [True]  # the model's extra tensors (e.g. rope_freqs) go out with the first tensor
    tied = bool(source.hf_config.get("tie_word_embeddings", (source.hf_config.get("text_config") or {}).get(
        "tie_word_embeddings", True)))

    def to_gguf(name: str, value: Any) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        if pending:
            pending.clear()
            out.update(extra(dict(source.hf_config), source.config))
        if tied and name == "lm_head.weight":
            return out  # llama.cpp reads the tied output projection from token_embd
        # model-layout names are the HF text model's (the tables' names); expert stacks stay stacked
        out.update(converter.to_gguf(name, value))
        return out

    def from_gguf(path: str) -> Dict[str, Any]:
        from models.pipeline import gguf_input

        return dict(gguf_input.model_tensors(arch, path, source.config))

    return {"gguf_arch": module.GGUF_ARCH, "to_gguf": to_gguf, "from_gguf": from_gguf,
            "gguf_metadata": lambda: metadata(dict(source.hf_config), source.config)}
