"""Named recipes, so a command line can say ``--recipe=int4``.

The generic presets here quantize every Linear-like weight with the preset's format except the
ones that are known to hurt (or to be tiny): MoE routers / gates, norms and convs are kept. The
token embedding and the output head (tied to it or not) are quantized at 8 bits (`EMBEDDING_8BIT`:
int8 g32 for the integer presets, FP8 or MXFP8 for the floating-point ones): kept in float they are
most of a small model's bytes (Gemma 3 270M: 671 of 729 MB in float32), and 8 bits moves their
values by under 0.4 % of each group's range. A recipe that lists them with config null keeps them. A caller with
its own presets (a model's recipe files) passes them to `load_recipe(name, presets=...)`, where
they take precedence over these without changing them; a name may also be a path to a recipe
file. `register_preset` adds a preset for the whole process.
"""

from __future__ import annotations

import os
from typing import Dict, List, Mapping, Optional, Union

from llmq.did_you_mean import did_you_mean
from llmq.quant.recipe import QuantConfig, QuantRecipe, QuantRule

# Modules no generic preset quantizes. Anchored on a dot so that "gate" (a MoE router) is
# kept while "gate_proj" (an FFN projection) is quantized.
KEEP_PATTERNS = (
    r"(.*\.)?(gate|router|shared_expert_gate)",
    r".*norm.*",
    r".*conv.*",
)

# The token embedding (and position embeddings) and the output head: 8-bit in every generic preset.
EMBEDDING_PATTERNS = (
    r"(.*\.)?(embed_tokens|embed|embeddings|embedding|wte|wpe|tok_embeddings)",
    r"(.*\.)?(lm_head|output)",
)

ATTENTION_PATTERN = r".*\.(self_attn|attn|attention)\.(q_proj|k_proj|v_proj|o_proj|qkv_proj|out_proj)"

INT4 = QuantConfig(bits=4, group_size=32, symmetric=True)
INT4_ASYM = QuantConfig(bits=4, group_size=32, symmetric=False)
INT8_PER_CHANNEL = QuantConfig(bits=8, group_size=None, symmetric=True)
INT8_G32 = QuantConfig(bits=8, group_size=32, symmetric=True)
# The floating-point formats (docs/formats.md): FP8 E4M3 with one scale per output row, the OCP MX
# formats (E8M0 scale per 32 elements) and NVFP4 (FP8 scale per 16 elements, one FP32 tensor scale).
FP8_PER_CHANNEL = QuantConfig(format="fp8", granularity="channel")
MXFP8 = QuantConfig(format="mxfp8", bits=8, group_size=32)
MXFP4 = QuantConfig(format="mxfp4", bits=4, group_size=32)
NVFP4 = QuantConfig(format="nvfp4", bits=4, group_size=16)


def _keep_rules(embedding: QuantConfig) -> List[QuantRule]:
    return [QuantRule(p, None) for p in KEEP_PATTERNS] + [QuantRule(p, embedding) for p in EMBEDDING_PATTERNS]


def embedding_config(config: QuantConfig) -> QuantConfig:
    """The 8-bit config a preset of `config`'s format gives embeddings and the output head: the integer
    formats int8 g32 (GGUF's q8_0, an MLX 8-bit group of 32), FP8 per channel for fp8 and nvfp4, MXFP8
    for the MX formats (so every backend that writes the preset's format writes its embedding too)."""
    if config.format == "int":
        return INT8_G32
    if config.format in ("mxfp4", "mxfp8"):
        return MXFP8
    return FP8_PER_CHANNEL


def _uniform(config: QuantConfig) -> QuantRecipe:
    return QuantRecipe(_keep_rules(embedding_config(config)) + [QuantRule(".*", config)])


def _int4_mixed() -> QuantRecipe:
    # 8-bit where errors cost most: attention projections everywhere, and the whole first
    # and last decoder layers (negative indices are bound to the model's depth at use).
    return QuantRecipe(
        _keep_rules(INT8_G32)
        + [
            QuantRule(ATTENTION_PATTERN, INT8_G32),
            QuantRule(r".*", INT8_G32, layers=[0, -1]),
            QuantRule(r".*", INT4),
        ]
    )


PRESETS: Dict[str, QuantRecipe] = {
    "int4": _uniform(INT4),
    "int4-asym": _uniform(INT4_ASYM),
    "int8": _uniform(INT8_PER_CHANNEL),
    "int4-mixed": _int4_mixed(),
    "fp8": _uniform(FP8_PER_CHANNEL),
    "mxfp8": _uniform(MXFP8),
    "mxfp4": _uniform(MXFP4),
    "nvfp4": _uniform(NVFP4),
}


def register_preset(name: str, recipe: QuantRecipe, *, overwrite: bool = False) -> None:
    """Make `recipe` available as get_preset(name); refuses to silently replace a preset."""
    if not isinstance(recipe, QuantRecipe):
        raise ValueError(f"preset {name!r} must be a QuantRecipe, got {type(recipe).__name__}")
    if not name or not isinstance(name, str):
        raise ValueError(f"preset name must be a non-empty string, got {name!r}")
    if name in PRESETS and not overwrite:
        raise ValueError(f"preset {name!r} already exists; pass overwrite=True to replace it")
    PRESETS[name] = recipe


def get_preset(name: str) -> QuantRecipe:
    """The preset called `name`; an unknown name lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown recipe preset {name!r}{did_you_mean(name, PRESETS)}; known presets: "
                         f"{', '.join(sorted(PRESETS))}") from None


def load_recipe(name_or_path: Union[str, os.PathLike], *,
                presets: Optional[Mapping[str, QuantRecipe]] = None) -> QuantRecipe:
    """What a ``--recipe`` flag means: a preset name (`presets` first, then PRESETS), or else a path
    to a JSON/YAML recipe file. Nothing global changes."""
    spec = os.fspath(name_or_path)
    known = all_presets(presets)
    if spec in known:
        return known[spec]
    if os.path.exists(spec):
        return QuantRecipe.from_file(spec)
    raise ValueError(
        f"--recipe {spec!r} is neither a known preset{did_you_mean(spec, known)} ({', '.join(sorted(known))}) nor an "
        "existing recipe file"
    )


def all_presets(presets: Optional[Mapping[str, QuantRecipe]] = None) -> Dict[str, QuantRecipe]:
    """PRESETS with `presets` (e.g. a model's recipe files) in front: same name, theirs."""
    return {**PRESETS, **dict(presets or {})}
