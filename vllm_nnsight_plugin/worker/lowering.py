"""Requests whose blocks run on the tap tables instead of as Python (``taps/``).

At admission a block whose source is one of the lowered forms, and whose captured
values pass its checks, is put on the tables and its mediator dropped: nothing of
it runs as Python. At collection its entry comes off the tables, and what it
saved (kept rows, the finished output) joins the request's reply as the Python
path would have built it.
"""

from __future__ import annotations

from typing import Any

from .. import seams
from .errors import KeptRowsError

#: Stands in a lowered request's saves for its finished output (``tracer.result``)
#: until the output is at hand.
OUTPUT = object()


class Lowering:
    """Per-runner counts of lowered requests, and the two ends of their life."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.count = 0
        self.by_form = {"steer": 0, "keep": 0, "read": 0}

    def lower(self, request: Any, tables: Any, model: Any, rows: int, most: int) -> bool:
        """Put a request on the tap tables when its block is exactly a form they
        express; ``rows`` is how many token rows its first step has, ``most`` how
        many it can have (0: unknown)."""
        from ..taps.lower import lower
        from . import _nnsight as nns

        mediator = request.mediator
        if mediator is None or request.copies or request.index != 0 or request.engine_id != request.stem:
            return False
        if seams.speculates(self.runner):
            return False  # a step's rows are then not the ones a block sees step by step
        lowering = lower(
            nns.block_source(mediator),
            nns.block_scope(mediator),
            model,
            nns.InterleavingTracer,
            tables,
            seams.model_dtype(self.runner),
            rows,
        )
        if lowering is None:
            return False
        room = 0
        if lowering.lowered.code:
            room = rows if lowering.lowered.single else most
            if room <= 0:
                return False
        if not tables.add(request.id, lowering.lowered, lowering.vector, room):
            return False
        request.mediator = None  # nothing of it runs as Python
        self.count += 1
        code, single = lowering.lowered.code, lowering.lowered.single
        self.by_form["steer" if not code else "read" if single else "keep"] += 1
        return True

    def forget(self, tables: Any, index: Any, requests: Any, request_ids: list[str]) -> dict[str, dict]:
        """Take the lowered requests asked about off the tables; per engine id, what
        their blocks saved: kept rows, and :data:`OUTPUT` under the result's name
        for a block that got that far (as Python, the line after the loop runs only
        once the loop's last step has)."""
        from . import _nnsight as nns

        if tables is None or not tables.requests:
            return {}
        saved: dict[str, dict[str, Any]] = {}
        for asked in request_ids:
            for internal in index.answering(asked):
                taken = tables.forget(internal)
                if taken is None:
                    continue
                lowered, steps = taken
                request = requests.requests.get(internal)
                try:
                    if request is None:
                        continue
                    if tables.overflowed(lowered):
                        request.error = nns.capture_exception(_overflow(lowered, internal))
                        continue
                    try:
                        saves = tables.saves(lowered)
                    except Exception as error:  # that request's failure, no other's
                        request.error = nns.capture_exception(error)
                        continue
                    loop_ended = lowered.stop is not None and steps >= lowered.stop
                    if lowered.result is not None and (loop_ended or lowered.single):
                        saves[lowered.result] = OUTPUT
                    if saves:
                        saved.setdefault(request.engine_id, {}).update(saves)
                finally:
                    tables.release(lowered)
        return saved

    def stats(self) -> dict[str, Any]:
        return {"lowered": self.count, "lowered_by": dict(self.by_form)}


def _overflow(lowered: Any, request_id: str) -> Exception:
    return KeptRowsError(
        f"request {request_id} computed more rows at its tap than its prompt and "
        f"max_tokens ({lowered.rows}), so the rows its block kept are incomplete (a "
        "preempted request recomputes its tokens). Run it again, or on an engine "
        "with room for every running request's KV cache."
    )
