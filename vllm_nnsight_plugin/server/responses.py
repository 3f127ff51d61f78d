"""Saves onto the OpenAI server's responses.

One HTTP request may start several engine requests (a completion with several
prompts starts one per prompt). While the plugin's handler wrap runs, a
:class:`Collector` in a context variable records the engine requests the handler
starts, in prompt order, and the finished outputs of those that carried a block
or ran installed edits (the async engine's ``generate`` seam fills it). If any
did:

- a JSON response gets an ``nnsight`` field: ``{"version": 1, "requests":
  [{"request_id", "saves", "error", "path"}, ...]}``, one entry per prompt in order,
  ``saves`` encoded by ``wire/saves.py``;
- a block that raised turns the response into HTTP 422 ``NNsightBlockError``,
  with the block's error (type, message, traceback) in ``nnsight.error``;
- a stream gets one more event before ``data: [DONE]``: a chunk with empty
  ``choices`` and the same ``nnsight`` field, or an ``error`` event (which the
  ``openai`` client raises as an ``APIError``) when a block raised.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from http import HTTPStatus
from typing import Any

from ..errors import PluginError, http_answer
from ..wire.saves import RESPONSE_FIELD, SAVES_VERSION, encode_request


class BlockRaisedError(PluginError, RuntimeError):
    """A served request's block (or an installed edit) ended it with an error: the
    answer carries the error, and the saves document its traceback."""

    http_status = 422
    kind = "NNsightBlockError"


_CURRENT: contextvars.ContextVar[Collector | None] = contextvars.ContextVar(
    "vllm_nnsight_collector", default=None
)
_DONE = "data: [DONE]"


class Collector:
    """The engine requests of one HTTP request, and the finished outputs of those
    that carried a block or ran installed edits."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.outputs: dict[str, Any] = {}

    def started(self, request_id: str) -> None:
        self.ids.append(request_id)

    def finished(self, output: Any) -> None:
        self.outputs[output.request_id] = output

    def error(self) -> dict | None:
        """The first block error (a ``tracer.stop()`` is not one)."""
        for request_id in self.ids:
            error = getattr(self.outputs.get(request_id), "nnsight_error", None)
            if error and not error.get("is_control_flow"):
                return error
        return None

    def document(self) -> dict:
        requests = [encode_request(self.outputs[rid]) for rid in self.ids if rid in self.outputs]
        return {"version": SAVES_VERSION, "requests": requests}


def current() -> Collector | None:
    return _CURRENT.get()


@contextmanager
def collecting() -> Iterator[Collector]:
    collector = Collector()
    token = _CURRENT.set(collector)
    try:
        yield collector
    finally:
        _CURRENT.reset(token)


def error_text(error: dict) -> str:
    lines = [f"{error.get('type_name', 'Exception')}: {error.get('message', '')}"]
    if error.get("traceback"):
        lines += ["", "Traceback in the block:", error["traceback"].rstrip()]
    return "\n".join(lines)


async def finish(handler: Any, result: Any, collector: Collector) -> Any:
    """Put the collected saves (or the block's error) on the handler's result.

    Encoding saves can take long (``torch.save`` and base64 of every saved
    tensor): it runs on a worker thread, never on the server's event loop."""
    if hasattr(result, "__aiter__"):
        return _stream(result, collector)
    if getattr(result, "error", None) is not None or not collector.outputs:
        return result  # vLLM's own error response, or nothing was traced or edited
    error = collector.error()
    if error is not None:
        raised = BlockRaisedError("the request's nnsight block raised: " + error_text(error))
        response = handler.create_error_response(
            str(raised), err_type=raised.kind, status_code=HTTPStatus(raised.http_status)
        )
        setattr(response, RESPONSE_FIELD, {"version": SAVES_VERSION, "error": error})
        return response
    setattr(result, RESPONSE_FIELD, await asyncio.to_thread(collector.document))
    return result


def _final_event(collector: Collector, last: str | None) -> str:
    error = collector.error()
    if error is not None:
        _, body = http_answer(BlockRaisedError("the request's nnsight block raised: " + error_text(error)))
        body[RESPONSE_FIELD] = {"version": SAVES_VERSION, "error": error}
    else:
        body = {}
        if last is not None:  # the stream's id, object, model: a well-formed chunk
            try:
                previous = json.loads(last[len("data: ") :])
                body = {k: previous[k] for k in ("id", "object", "created", "model") if k in previous}
            except (ValueError, TypeError):
                body = {}
        body.update(choices=[], **{RESPONSE_FIELD: collector.document()})
    return f"data: {json.dumps(body)}\n\n"


async def _stream(chunks: Any, collector: Collector) -> AsyncIterator[str]:
    last = None
    try:
        async for chunk in chunks:
            if isinstance(chunk, str) and chunk.startswith(_DONE):
                if collector.outputs:
                    yield await asyncio.to_thread(_final_event, collector, last)
            elif isinstance(chunk, str) and chunk.startswith("data: {"):
                last = chunk
            yield chunk
    finally:
        await chunks.aclose()
