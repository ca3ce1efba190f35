"""A suggestion for a mistyped name (a recipe preset, a format, a backend, a flag value)."""

from __future__ import annotations

import difflib
from typing import Iterable


def did_you_mean(value: object, choices: Iterable[str]) -> str:
    """" (did you mean 'x'?)" for the choice closest to `value` (difflib, ratio >= 0.6), else ""."""
    if not isinstance(value, str):
        return ""
    choices = [c for c in choices if isinstance(c, str)]
    close = difflib.get_close_matches(value, choices, n=1) or difflib.get_close_matches(
        value.lower(), {c.lower(): c for c in choices}, n=1)
    if not close:
        return ""
    best = next((c for c in choices if c.lower() == close[0].lower()), close[0])
    return f" (did you mean {best!r}?)"
