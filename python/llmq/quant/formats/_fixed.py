"""Config checks shared by the fixed-shape FP families (MX, NVFP4): bits and group are set by the format."""

from __future__ import annotations

from typing import Any, Optional


def check_fixed(config: Any, name: str, bits: int, group: Optional[int]) -> None:
    """Raise ValueError unless config has the format's element width and (if fixed) group size."""
    gs = config.group_size
    if gs is not None and (not isinstance(gs, int) or isinstance(gs, bool) or gs <= 0):
        raise ValueError(f"QuantConfig.group_size must be a positive int, -1 or None (whole row), got {gs!r}")
    if config.bits != bits:
        raise ValueError(f"format {name!r} has {bits}-bit elements, got bits={config.bits}")
    if group is not None and gs != group:
        raise ValueError(f"format {name!r} uses group_size={group}, got {gs}")
