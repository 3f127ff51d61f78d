"""Replacing a vLLM method with a wrapped one, once per process, and the one
cheap test every wrap starts with: does this request carry a block."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from ..wire.envelope import EXTRA_ARGS_KEY

logger = logging.getLogger("vllm_nnsight_plugin")

_MARK = "_vllm_nnsight_wrapped"


def carries_block(params: Any) -> bool:
    """Whether a ``SamplingParams`` carries a block (cheap: one dict lookup)."""
    extra = getattr(params, "extra_args", None)
    return bool(extra) and EXTRA_ARGS_KEY in extra


def wrap(owner: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` with ``make(original)`` once per process."""
    original = owner.__dict__.get(name)
    if original is None:
        where = getattr(owner, "__qualname__", None)
        where = f"{owner.__module__}.{where}" if where else owner.__name__
        raise AttributeError(
            f"vllm-nnsight-plugin: {where}.{name} is gone; "
            "this vLLM release moved a seam the plugin relies on."
        )
    if getattr(original, _MARK, False):
        return
    wrapped = functools.wraps(original)(make(original))
    setattr(wrapped, _MARK, True)
    setattr(owner, name, wrapped)
