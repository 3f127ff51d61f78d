"""The return path: a finished request's saves, onto its ``RequestOutput``.

The worker answers ``nnsight_collect`` with, per request, the names its block
saved, its deferred error (with the block's own traceback), and per-sequence
values when ``n > 1``. nnsight's ``merge_collected``/``attach`` put those on the
output, so a stock ``LLM`` user reads:

- ``output.saves``: a dict of every saved name;
- ``output.outputs[i].saves``: the same, per sampled sequence;
- ``output.nnsight_error``: the block's error, or None.

:func:`saves` reads them and re-raises a failed block's error in the caller,
which is what the ``VLLM`` client does for a trace.
"""

from __future__ import annotations

from typing import Any


class BlockError(RuntimeError):
    """Raised by :func:`saves` when a request's block failed on the engine."""


def attach_collected(outputs: list, replies: list) -> None:
    """Put what the workers returned on the finished outputs."""
    from nnsight.modeling.vllm.engines.engine import attach, merge_collected

    collected = merge_collected(replies)
    for output in outputs:
        entry = collected.get(output.request_id)
        if entry is None:
            entry = {"saves": {}, "error": None, "registered": {}, "sequences": {}}
        attach(output, entry)


def saves(output: Any) -> dict:
    """The saves of one finished ``RequestOutput``; raises the block's error if it failed."""
    from nnsight.intervention.errors import raise_deferred

    if not hasattr(output, "saves"):
        raise BlockError(
            f"request {getattr(output, 'request_id', '?')} carried no block (or is not "
            "finished), so it has no saves. Build its SamplingParams with "
            "vllm_nnsight_plugin.sampling_params(...)."
        )
    raise_deferred(getattr(output, "nnsight_error", None))
    return output.saves
