"""Tap patterns: nnsight's spelling, resolved against a module tree.

A pattern is a module path relative to the model (the root's own ``model.`` is
implied) ending in ``.output``, where ``*`` stands for one path segment:
``"model.layers.*.output"`` is every decoder layer's output, as nnsight writes it.
Only module outputs are taps here; an input or a ``.source`` operation is refused
with what exists instead, never ignored.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from typing import Any

#: Where an engine's taps travel: vLLM's ``additional_config`` (hashed into the
#: compile cache's key, so a tapped and an untapped engine never share graphs).
CONFIG_KEY = "nnsight_taps"
#: Beside them, the plugin release that built the tap operation (also hashed).
VERSION_KEY = "nnsight_taps_plugin"
#: The same list for an engine the client did not build (``vllm serve``): JSON, or
#: comma-separated patterns.
ENV = "VLLM_NNSIGHT_TAPS"
#: Where a worker keeps its runner's tap tables (on the runner).
RUNNER_ATTR = "_vllm_nnsight_taps"


class TapError(ValueError):
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
    return found


def from_env() -> tuple[str, ...]:
    return parse(os.environ.get(ENV))


def resolve(patterns: Iterable[str], module_names: Iterable[str]) -> tuple[str, ...]:
    """The module paths the patterns name, in model order, each once."""
    names = [name for name in module_names if name]
    chosen: set[str] = set()
    for pattern in patterns:
        path, dot, side = pattern.rpartition(".")
        if ".source." in pattern or not dot or side != "output":
            raise TapError(
                f"tap {pattern!r}: a tap is a module's output, 'model.layers.10.output' or "
                "'model.layers.*.output' (* is one path segment); inputs and .source "
                "operations are served by the Python path on any engine."
            )
        regex = re.escape(path).replace(r"\*", r"[^.]+")
        matched = [name for name in names if re.fullmatch(regex, name)]
        if not matched:
            raise TapError(f"tap {pattern!r} names no module of this model. {_what_exists(names)}")
        chosen.update(matched)
    return tuple(name for name in names if name in chosen)


def _what_exists(names: list[str]) -> str:
    """The module paths, with numbered children collapsed to ``*``, bounded."""
    shapes = list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", name) for name in names))
    shown = ", ".join(f"{shape}.output" for shape in shapes[:40])
    more = f" and {len(shapes) - 40} more" if len(shapes) > 40 else ""
    return f"Modules it has: {shown}{more}."


def engine_taps(vllm_config: Any) -> tuple[str, ...]:
    """The patterns an engine was built with (its ``additional_config``)."""
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict):
        return parse(extra.get(CONFIG_KEY))
    return ()
