"""The return path: a finished request's saves, onto its ``RequestOutput``.

The worker answers ``nnsight_collect`` with, per request, the names its block
saved, its deferred error (with the block's own traceback), and per-sequence
values when ``n > 1``. This module puts those on the output (the shape nnsight's
own collect reads), so a stock ``LLM`` user reads:

- ``output.saves``: a dict of every saved name;
- ``output.outputs[i].saves``: the same, per sampled sequence;
- ``output.nnsight_error``: the block's error, or None.

:func:`saves` reads them and re-raises a failed block's error in the caller,
which is what the ``VLLM`` client does for a trace.

Nothing here imports nnsight: this runs in the server's front end, where
importing it would put nnsight's ``.save`` on every object, which breaks
pydantic models vLLM builds at request time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any


class BlockError(RuntimeError):
    """Raised by :func:`saves` when a request's block failed on the engine."""


def empty_entry() -> dict:
    """One request's reply from the workers, before anything is in it."""
    return {"saves": {}, "error": None, "sequences": {}}


def merge_replies(replies: list) -> dict:
    """Per request id, what the workers returned, over all ranks (each rank
    answers a list of pickled ``{request_id: entry}`` parts).

    Under tensor parallelism every rank ran the block and holds the same gathered
    values; the first rank's copy is kept.
    """
    import pickle

    merged: dict[str, dict] = {}
    parts = [part for reply in replies or () if reply is not None for part in reply]
    for part in parts:
        for request_id, entry in pickle.loads(part).items():
            into = merged.setdefault(request_id, empty_entry())
            for name, value in (entry.get("saves") or {}).items():
                into["saves"].setdefault(name, value)
            for index, sequence in (entry.get("sequences") or {}).items():
                kept = into["sequences"].setdefault(index, {})
                for name, value in (sequence.get("saves") or {}).items():
                    kept.setdefault(name, value)
            if into["error"] is None:
                into["error"] = entry.get("error")
    return merged


def attach(output: Any, entry: dict) -> None:
    """One request's saves onto its output: per request, and per sampled sequence."""
    output.saves = dict(entry["saves"])
    output.nnsight_saves = entry["saves"]
    output.nnsight_error = entry["error"]
    sequences = entry["sequences"]
    for completion in getattr(output, "outputs", None) or ():
        sequence = sequences.get(getattr(completion, "index", 0))
        if sequence is not None:
            completion.saves = dict(sequence)
    output.nnsight_sequences = [sequences[index] for index in sorted(sequences)]


def attach_collected(outputs: list, replies: list) -> None:
    """Put what the workers returned on the finished outputs."""
    collected = merge_replies(replies)
    for output in outputs:
        attach(output, collected.get(output.request_id) or empty_entry())


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


async def collect_async(engine: Any, output: Any) -> None:
    """``AsyncLLM``'s form of the offline collect: one finished output, one RPC."""
    import pickle

    request_id = output.request_id
    replies = await engine.collective_rpc(
        "nnsight_collect", args=([request_id], pickle.dumps({request_id: output}))
    )
    attach_collected([output], replies)


_WIND_UPS: set = set()


def wind_up_later(engine: Any, request_id: str) -> None:
    """Free an abandoned request's block in the workers, without waiting for it.

    Called where awaiting is not possible (a stream being closed or cancelled);
    the worker would drop it on its own later, this makes it prompt.
    """
    import asyncio

    try:
        task = asyncio.get_running_loop().create_task(
            engine.collective_rpc("nnsight_collect", args=([request_id], None))
        )
    except RuntimeError:  # no loop left: the worker's own expiry frees it
        return
    _WIND_UPS.add(task)
    task.add_done_callback(_WIND_UPS.discard)


async def traced_stream(
    engine: Any,
    stream: Any,
    request_id: str,
    on_finished: Callable[[Any], None] | None = None,
    in_flight: set | None = None,
) -> AsyncIterator[Any]:
    """vLLM's output stream for a traced request, with saves on the finished output."""
    finished = False
    try:
        async for output in stream:
            if output.finished:
                finished = True
                await collect_async(engine, output)
                if on_finished is not None:
                    on_finished(output)
            yield output
    finally:
        if in_flight is not None:
            in_flight.discard(request_id)
        if not finished:
            await stream.aclose()  # vLLM aborts the request
            wind_up_later(engine, request_id)
