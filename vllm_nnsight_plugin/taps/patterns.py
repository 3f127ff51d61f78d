"""Tap patterns as an operator or a client writes them: a list, a JSON list or a
comma-separated string, and the two words that stand for lists. Imports nothing
of the package but its error root, so the settings can check a value with it
(``settings.py``) and ``spec.py`` resolves what it returns."""

from __future__ import annotations

import json
from collections.abc import Iterable

from ..errors import PluginError

#: Every decoder layer's output, wherever the model keeps them (``spec.decoder_layers``).
LAYERS = "layers"
#: No taps, where a default would give some.
NONE = "none"


class TapError(PluginError, ValueError):
    """A tap pattern that names nothing this model has."""


def parse(patterns: Iterable[str] | str | None) -> tuple[str, ...]:
    """Patterns from a list, a JSON list or a comma-separated string."""
    if patterns is None:
        return ()
    if isinstance(patterns, str):
        text = patterns.strip()
        if not text:
            return ()
        patterns = json.loads(text) if text.startswith("[") else text.split(",")
    items = list(patterns)
    found = tuple(p.strip() for p in items if isinstance(p, str) and p.strip())
    if len(found) != len(items):
        raise TapError(f"taps must be strings naming module outputs, got {items!r}")
    return () if found == (NONE,) else found
