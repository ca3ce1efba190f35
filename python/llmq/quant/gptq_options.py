"""The options of method "gptq" (a recipe rule's "options") and their check: a leaf module, so a
format's config validation (llmq.quant.formats.int_affine) checks them without importing the method."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

# Option name -> default.
OPTIONS: Dict[str, Any] = {
    "damp": 0.01,
    "block_size": 128,
    "act_order": True,
    "fit": "search",
}
FITS = ("search", "minmax")


def check_options(options: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """The options of a gptq rule completed with the defaults; ValueError (one line) naming a
    wrong one."""
    given = dict(options or {})
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise ValueError(f"QuantConfig.options: unknown option(s) {unknown} for method 'gptq'; it takes {sorted(OPTIONS)}")
    out = {**OPTIONS, **given}
    damp, block, act, fit = out["damp"], out["block_size"], out["act_order"], out["fit"]
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0 <= damp < 1e6 or damp != damp:
        raise ValueError(f"QuantConfig.options: 'damp' must be a number >= 0 (a fraction of the mean of diag(H)), got {damp!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"QuantConfig.options: 'block_size' must be a positive int, got {block!r}")
    if not isinstance(act, bool):
        raise ValueError(f"QuantConfig.options: 'act_order' must be true or false, got {act!r}")
    if fit not in FITS:
        raise ValueError(f"QuantConfig.options: 'fit' must be one of {FITS}, got {fit!r}")
    out["damp"] = float(damp)
    return out
