"""The return path: a finished request's saves, onto its ``RequestOutput``.

The worker answers ``nnsight_collect`` with, per request, the names its block
saved, those the installed edits it ran saved, its deferred error (with the
block's own traceback), and per-sequence values when ``n > 1``. This module puts
those on the output (the shape nnsight's own collect reads), so a stock ``LLM``
user reads:

- ``output.saves``: a dict of every saved name, the edits' and the block's (the
  block's win a name both saved);
- ``output.nnsight_saves`` and ``output.nnsight_edit_saves``: the block's alone,
  and the edits' alone;
- ``output.outputs[i].saves``: the same as ``output.saves``, per sampled sequence;
- ``output.nnsight_error``: the block's (or an edit's) error, or None;
- ``output.nnsight_path``: whether the block ran on the tap tables, in the
  compiled forward (``{"lowered": True, "form": "steer"}``), or as Python, and
  the first reason why (``{"lowered": False, "reason": "..."}``).

An output whose request carried no block and ran no edit gets none of these.

:func:`saves` reads them and re-raises a failed block's error in the caller,
which is what the ``VLLM`` client does for a trace.

Nothing here imports nnsight: this runs in the server's front end, where
importing it would put nnsight's ``.save`` on every object, which breaks
pydantic models vLLM builds at request time.
"""

from __future__ import annotations

import asyncio
import pickle
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..errors import PluginError
from ..wire import rpc
from ..wire.reply import Merged, merged
from .metrics import StepCounts, count, observe
from .pool import Pool, Resolver
from .stacked import uncollected

#: Where a client says that no block of a request reads ``tracer.result``
#: (``extra_args``; ``vllm_xargs`` for a server). The front end then keeps that
#: request's finished output out of what it sends the workers to collect, a
#: pickle of every prompt token each way: the one cost of a collect that grows
#: with the prompt. A block that reads it after all finds it never served, an
#: error of that request alone. Ignored where installed edits were on the engine
#: when the request came in (an edit's copy may read it).
RESULT_KEY = "nnsight_result"
#: The value that says it.
UNREAD = "unread"


def note_result_unread(engine: Any, request_id: str, params: Any, edits_installed: bool) -> None:
    """Remember a request whose finished output no block reads (see :data:`RESULT_KEY`)."""
    extra = getattr(params, "extra_args", None) or {}
    if extra.get(RESULT_KEY) == UNREAD and not edits_installed:
        engine.__dict__.setdefault("_nnsight_unread", set()).add(request_id)


def finished_for_workers(engine: Any, outputs: list) -> bytes:
    """The finished outputs the workers may serve as ``tracer.result`` (pickled);
    the requests are forgotten as unread. A request its input processing marked
    for installed edits gets its output whatever its block said (an edit
    installed between the request's start and its processing gave it copies)."""
    from ..edits import book_of
    from ..seams.frontend import processor_of

    unread = engine.__dict__.get("_nnsight_unread") or ()
    book = book_of(processor_of(engine)) if unread else None
    marked = book.marked if book is not None else ()
    sent = {o.request_id: o for o in outputs if o.request_id not in unread or o.request_id in marked}
    forget_unread(engine, [o.request_id for o in outputs])
    return pickle.dumps(sent)


def forget_unread(engine: Any, request_ids: list[str]) -> None:
    unread = engine.__dict__.get("_nnsight_unread")
    if unread:
        unread.difference_update(request_ids)


class BlockError(PluginError, RuntimeError):
    """Raised by :func:`saves` for an output that has no saves to give: its request
    carried no block, or has not finished. (A block that failed raises its own
    error, as nnsight reports it.)"""


def merge_replies(replies: list) -> dict[str, Merged]:
    """Per request id, what the workers returned, over all ranks (each rank
    answers a list of pickled parts: one ``{request_id: entry}`` per request, the
    collect's :class:`~.pool.Pool` of saved tensors, if any, and from the engine's
    first rank its step counts, which go to the metrics: ``metrics.py``).

    Under tensor parallelism every rank ran the block and holds the same gathered
    values; the first rank's copy is kept.
    """
    with uncollected():  # (a probe's replies make hundreds of thousands of tensors)
        loaded = [pickle.loads(part) for reply in replies or () if reply is not None for part in reply]
        for counts in [part for part in loaded if isinstance(part, StepCounts)]:
            observe(counts)
        loaded = [part for part in loaded if not isinstance(part, StepCounts)]
        pools = {part.id: part for part in loaded if isinstance(part, Pool)}
        try:
            return _merge(loaded, pools)
        finally:
            for pool in pools.values():
                pool.close()  # shared memory nobody read (another rank's copy)


def _merge(loaded: list, pools: dict) -> dict[str, Merged]:
    found: dict[str, Merged] = {}
    for part in loaded:
        if isinstance(part, Pool):
            continue
        for request_id, entry in part.items():
            resolve = Resolver(pools, entry)  # the request's tensors, in storage of its own
            into = found.setdefault(request_id, merged())
            _first_copy(into["saves"], entry.get("saves"), resolve)
            _first_copy(into["edits"], entry.get("edits"), resolve)
            for index, sequence in (entry.get("sequences") or {}).items():
                _first_copy(into["sequences"].setdefault(index, {}), sequence.get("saves"), resolve)
                _first_copy(into["edit_sequences"].setdefault(index, {}), sequence.get("edits"), resolve)
            if into["error"] is None:
                into["error"] = entry.get("error")
            if into["path"] is None:
                into["path"] = entry.get("path")
    return found


def _first_copy(into: dict, saves: dict | None, resolve: Any) -> None:
    """Add one rank's saved values to a merged dict (the first rank's copy wins)."""
    for name, value in (saves or {}).items():
        if name not in into:
            into[name] = resolve(value)


def attach(output: Any, entry: Merged) -> None:
    """One request's saves onto its output: per request, and per sampled sequence."""
    edits = entry.get("edits") or {}
    output.saves = {**edits, **entry["saves"]}
    output.nnsight_saves = entry["saves"]
    output.nnsight_edit_saves = edits
    output.nnsight_error = entry["error"]
    output.nnsight_path = entry.get("path")
    sequences = entry["sequences"]
    edit_sequences = entry.get("edit_sequences") or {}
    for completion in getattr(output, "outputs", None) or ():
        index = getattr(completion, "index", 0)
        if index in sequences or index in edit_sequences:
            completion.saves = {**edit_sequences.get(index, {}), **sequences.get(index, {})}
    output.nnsight_sequences = [sequences[index] for index in sorted(sequences)]
    output.nnsight_edit_sequences = [edit_sequences[index] for index in sorted(edit_sequences)]


def attach_collected(outputs: list, replies: list) -> None:
    """Put what the workers returned on the finished outputs."""
    collected = merge_replies(replies)
    for output in outputs:
        attach(output, collected.get(output.request_id) or merged())
    count(outputs)


class CollectError(PluginError, RuntimeError):
    """The workers could not return a finished request's saves (the engine ran out
    of device memory building them, say); the request's tokens stand."""


def attach_failed(outputs: list, error: BaseException) -> None:
    """The error of a collect that failed, on each of its finished outputs, as a
    block's error reads there: their generation stands, and the engine, which
    answered the call, serves on."""
    failed = {
        "type_name": CollectError.__name__,
        "message": f"the engine could not return this request's saves: {error}",
        "traceback": None,
        "is_control_flow": False,
    }
    for output in outputs:
        attach(output, {**merged(), "error": failed})
    count(outputs)


def saves(output: Any) -> dict:
    """The saves of one finished ``RequestOutput``; raises the block's error if it failed."""
    from nnsight.intervention.errors import raise_deferred

    if not hasattr(output, "saves"):
        raise BlockError(
            f"request {getattr(output, 'request_id', '?')} carried no block (or is not "
            "finished), so it has no saves. Build its SamplingParams with "
            "model.requests(...) and pass tracer.prepared.params to generate."
        )
    raise_deferred(getattr(output, "nnsight_error", None))
    return output.saves


class _Collector:
    """``AsyncLLM``'s collect, batched: the outputs that finish together (delivered
    in one turn of the event loop, as vLLM does for one engine step) are
    collected with one RPC, not one each."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.waiting: list[tuple[Any, Any]] = []

    async def collect(self, output: Any) -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self.waiting.append((output, done))
        if len(self.waiting) == 1:  # the first of this turn: flush once the turn's others are in
            loop.call_soon(lambda: _keep(loop.create_task(self._flush())))
        await done

    async def _flush(self) -> None:
        from ..seams.frontend import rpc_every_engine

        batch, self.waiting = self.waiting, []
        outputs = [output for output, _ in batch]
        try:
            replies = await rpc_every_engine(
                self.engine,
                rpc.COLLECT,
                ([o.request_id for o in outputs], finished_for_workers(self.engine, outputs)),
            )
            attach_collected(outputs, replies)
        except BaseException as error:
            for _, done in batch:
                if not done.done():
                    done.set_exception(error)
            if not isinstance(error, Exception):
                raise
            return
        for _, done in batch:
            if not done.done():
                done.set_result(None)


def _collector(engine: Any) -> _Collector:
    """The engine's collector for the running event loop."""
    by_loop = engine.__dict__.setdefault("_nnsight_collectors", weakref.WeakKeyDictionary())
    loop = asyncio.get_running_loop()
    collector = by_loop.get(loop)
    if collector is None:
        collector = by_loop[loop] = _Collector(engine)
    return collector


async def collect_async(engine: Any, output: Any) -> None:
    """``AsyncLLM``'s form of the offline collect: the finished output's saves onto it."""
    await _collector(engine).collect(output)


_WIND_UPS: set = set()


def _keep(task: Any) -> None:
    """Hold a fire-and-forget task until it is done (the loop keeps only weak refs)."""
    _WIND_UPS.add(task)
    task.add_done_callback(_WIND_UPS.discard)


def wind_up_later(engine: Any, request_id: str) -> None:
    """Free an abandoned request's block in the workers, without waiting for it.

    Called where awaiting is not possible (a stream being closed or cancelled);
    the worker would drop it on its own later, this makes it prompt.
    """
    from ..seams.frontend import rpc_every_engine

    try:
        task = asyncio.get_running_loop().create_task(
            rpc_every_engine(engine, rpc.COLLECT, ([request_id], None))
        )
    except RuntimeError:  # no loop left: the worker's own expiry frees it
        return
    _keep(task)


async def traced_stream(
    engine: Any,
    stream: Any,
    request_id: str,
    on_finished: Callable[[Any], None] | None = None,
    in_flight: set | None = None,
    collected: Callable[[], bool] | None = None,
) -> AsyncIterator[Any]:
    """vLLM's output stream for a traced request, with saves on the finished output.

    ``collected`` (for a request without a block) says at the end whether there is
    anything to collect: whether it ran installed edits.
    """
    finished = False
    try:
        async for output in stream:
            if output.finished:
                finished = True
                if collected is None or collected():
                    await collect_async(engine, output)
                    if on_finished is not None:
                        on_finished(output)
            yield output
    finally:
        forget_unread(engine, [request_id])
        if in_flight is not None:
            in_flight.discard(request_id)
        if not finished:
            await stream.aclose()  # vLLM aborts the request
            wind_up_later(engine, request_id)
