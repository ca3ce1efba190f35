"""Checkpoint names shared by the models: the Hugging Face -> llmq map of a text model inside a
multimodal checkpoint, and GGUF <-> HF name tables built from gguf-py's own tensor-name tables.

Our module names are transformers' ``*ForCausalLM`` names, so an HF name maps to itself except
that the multimodal layouts keep the text stack under a prefix and carry towers the text model
skips. GGUF names come from gguf-py (``gguf.get_tensor_name_map(arch, ...)``, the table llama.cpp's
converter uses): a model lists the HF tensors it has, and only where llama.cpp's converter renames a
tensor before it reaches that table does the model say so (``renamed``).
"""

from __future__ import annotations

import re
from typing import Callable, Dict, Iterable, Mapping, Optional, Tuple

# Where multimodal checkpoints keep the text stack (current, then older transformers layouts).
MULTIMODAL_TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_SUFFIXES = (".weight", ".bias")


def text_key_map(skip_prefixes: Tuple[str, ...]) -> Callable[[str], Optional[str]]:
    """HF name -> llmq state-dict name: None for names under ``skip_prefixes`` (towers, MTP heads),
    the multimodal text prefixes replaced, anything else unchanged."""

    def hf_to_llmq_key(hf_name: str) -> Optional[str]:
        if hf_name.startswith(skip_prefixes):
            return None
        for old, new in MULTIMODAL_TEXT_PREFIXES:
            if hf_name.startswith(old):
                return new + hf_name[len(old):]
        return hf_name

    return hf_to_llmq_key


def gguf_to_hf_table(arch, hf_templates: Iterable[str], renamed: Mapping[str, str] = {}) -> Dict[str, str]:
    """{GGUF name template: HF name template} ({L} = block index) from gguf-py's table for ``arch``
    (a ``gguf.MODEL_ARCH``).

    Each HF name's GGUF name is gguf-py's name for it plus the HF suffix (.weight / .bias / none).
    ``renamed[hf_template]`` is the HF name llama.cpp's converter hands to gguf-py instead (for a
    tensor it renames or stacks first). Raises ValueError naming an HF tensor gguf-py has no name for.
    """
    import gguf

    table = gguf.get_tensor_name_map(arch, 1)
    out: Dict[str, str] = {}
    for hf_template in hf_templates:
        asked = renamed.get(hf_template, hf_template).format(L=0)
        base, suffix = asked, ""
        for s in _SUFFIXES:
            if asked.endswith(s):
                base, suffix = asked[: -len(s)], s
        gguf_name = table.get_name(base)
        if gguf_name is None:
            raise ValueError(f"gguf-py has no {arch.name} tensor name for {asked!r} (from {hf_template!r})")
        gguf_template = re.sub(r"^blk\.0\.", "blk.{L}.", gguf_name + suffix)
        if gguf_template in out:
            raise ValueError(f"{hf_template!r} and {out[gguf_template]!r} both have GGUF name {gguf_template!r}")
        out[gguf_template] = hf_template
    return out


def block_template(gguf_name: str) -> Tuple[Optional[int], str]:
    """``blk.N.rest`` -> (N, ``blk.{L}.rest``); any other name -> (None, name)."""
    m = _BLOCK.match(gguf_name)
    return (int(m.group(1)), f"blk.{{L}}.{m.group(2)}") if m else (None, gguf_name)


_HF_LAYER = re.compile(r"\.layers\.(\d+)\.")


def hf_to_gguf_name(gguf_to_hf: Mapping[str, str]) -> Callable[[str], Optional[str]]:
    """The inverse of a ``gguf_to_hf_table``: HF name -> GGUF name (None: the table has no GGUF name for it)."""
    inverse = {hf: gg for gg, hf in gguf_to_hf.items()}

    def name(hf_name: str) -> Optional[str]:
        m = _HF_LAYER.search(hf_name)
        template = _HF_LAYER.sub(".layers.{L}.", hf_name, count=1) if m else hf_name
        gguf_template = inverse.get(template)
        return None if gguf_template is None else gguf_template.format(L=int(m.group(1)) if m else 0)

    return name


class TableConverter:
    """``convert(gguf_name, value) -> [(model_name, value)]``, one GGUF tensor at a time, by a name table.

    A model's converter sets ``GGUF_ARCH``, ``GGUF_TO_HF`` (see ``gguf_to_hf_table``), ``KEY_MAP`` (HF ->
    llmq names) and ``UNMAPPED`` (what it supports, for the error on an unknown tensor), and overrides
    ``undo`` to reverse llama.cpp's value transforms; ``close()`` checks nothing is left half-done.
    """

    GGUF_ARCH: str = ""
    GGUF_TO_HF: Dict[str, str] = {}
    KEY_MAP: Callable[[str], Optional[str]] = staticmethod(lambda name: name)
    UNMAPPED: str = ""

    def __init__(self, config):
        self.config = config
        self.notes = []

    def convert(self, name: str, value):
        layer, template = block_template(name)
        hf_template = self.GGUF_TO_HF.get(template)
        if hf_template is None:
            raise ValueError(f"GGUF tensor {name!r} has no {self.GGUF_ARCH} mapping ({self.UNMAPPED})")
        hf_name = hf_template.format(L=layer)
        return [(self.KEY_MAP(hf_name), self.undo(hf_name, name, value))]

    def undo(self, hf_name: str, gguf_name: str, value):
        """The HF value of tensor ``hf_name`` stored as ``gguf_name`` (default: as stored)."""
        return value

    def to_gguf(self, hf_name: str, value):
        """The other way, for writing a GGUF: ``[(gguf_name, value)]`` of one HF tensor, by the same table and
        ``redo`` (llama.cpp's value transforms, the inverse of ``undo``); ValueError for an unmapped name."""
        gguf_name = hf_to_gguf_name(self.GGUF_TO_HF)(hf_name)
        if gguf_name is None:
            raise ValueError(f"tensor {hf_name!r} has no {self.GGUF_ARCH} GGUF name ({self.UNMAPPED})")
        return [(gguf_name, self.redo(hf_name, gguf_name, value))]

    def redo(self, hf_name: str, gguf_name: str, value):
        """The value llama.cpp stores for HF tensor ``hf_name`` (default: as is)."""
        return value

    def close(self) -> None:
        pass
