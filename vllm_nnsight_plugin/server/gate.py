"""The server's door: which blocks arriving over HTTP may reach the engine.

A request to ``/v1/completions`` or ``/v1/chat/completions`` carries a block in
``vllm_xargs["nnsight"]``. Before vLLM sees the request, :func:`admit` decides,
without decoding the payload (so a refusal provably runs nothing):

====  ===========================  ==============================================
code  type                         when
====  ===========================  ==============================================
403   ``NNsightBlocksDisabled``    no operator key (``VLLM_NNSIGHT_KEY`` or
                                   ``VLLM_NNSIGHT_KEY_FILE``), or a setting the
                                   engine reads holds a bad value
403   ``NNsightUntrustedBlock``    unsigned, wrong key, expired, replayed, or a
                                   lifetime over ``VLLM_NNSIGHT_MAX_TTL_S``
400   ``NNsightBadEnvelope``       corrupt, another envelope/nnsight version, or
                                   with beam search
413   ``NNsightPayloadTooLarge``   over ``VLLM_NNSIGHT_MAX_PAYLOAD_BYTES``
====  ===========================  ==============================================

An admitted request gets a :class:`~vllm_nnsight_plugin.wire.trust.Vouched`
marker, which no JSON can carry; the front end's input processing turns it into
the workers' signature (``wire/trust.py``). Anything a client sent under those
keys is dropped first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from ..errors import BlocksOffError, PluginError, http_answer
from ..settings import blocks_off
from ..versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT
from ..wire.envelope import (
    EXTRA_ARGS_KEY,
    EnvelopeError,
    Limits,
    open_envelope,
    too_large,
)
from ..wire.trust import (
    LOCAL_SIGNATURE_KEY,
    OPERATOR_KEY_ENV,
    OPERATOR_KEY_FILE_ENV,
    VOUCHED_KEY,
    NonceBook,
    UntrustedBlockError,
    Vouched,
    check_lifetime,
    check_operator_signature,
    operator_key,
)

_NONCES = NonceBook()


@dataclass(frozen=True)
class Refusal:
    """What a refused request is answered: the status and kind of the error's class."""

    status: HTTPStatus
    kind: str
    message: str

    @classmethod
    def of(cls, error: PluginError) -> Refusal:
        return cls(HTTPStatus(error.http_status), error.kind, str(error))


def large(xargs: Any) -> bool:
    """Whether checking this request's block costs enough to move off the event loop."""
    value = xargs.get(EXTRA_ARGS_KEY) if isinstance(xargs, dict) else None
    return isinstance(value, str) and len(value) > _LARGE_CHARS


#: An envelope longer than this is checked on a worker thread (an HMAC over 1 MB
#: is about a millisecond).
_LARGE_CHARS = 1 << 20


def admit(xargs: dict, *, beam_search: bool = False) -> Refusal | None:
    """Check a request's ``vllm_xargs``; vouch for its block, or say why not."""
    xargs.pop(LOCAL_SIGNATURE_KEY, None)
    xargs.pop(VOUCHED_KEY, None)
    if EXTRA_ARGS_KEY not in xargs:
        return None
    if beam_search:
        return Refusal.of(
            EnvelopeError(
                "beam search runs many engine requests per prompt, which one block cannot "
                "follow; send blocks with plain sampling."
            )
        )
    off = blocks_off()
    if off is not None:
        return Refusal.of(BlocksOffError(off))
    key = operator_key()
    if key is None:
        return Refusal.of(
            BlocksOffError(
                "this server does not run nnsight blocks sent over HTTP. The operator can "
                f"turn them on by starting it with {OPERATOR_KEY_ENV} (or {OPERATOR_KEY_FILE_ENV}) "
                "set to a secret key, which clients then sign with."
            )
        )
    value = xargs[EXTRA_ARGS_KEY]
    limits = Limits.from_env()
    try:
        too_large(value, limits)
        check_operator_signature(value, key)  # on the text as it came: nothing decoded before
        envelope = open_envelope(
            value, nnsight_version=SUPPORTED_NNSIGHT, plugin_version=PLUGIN_VERSION, limits=limits
        )
        check_lifetime(envelope, _NONCES)
    except (EnvelopeError, UntrustedBlockError) as error:  # too large, expired, untrusted, bad
        return Refusal.of(error)
    xargs[VOUCHED_KEY] = Vouched(value)
    return None


# ---------------------------------------------------------------------- other routes
#: Routes that take ``vllm_xargs`` but answer in a shape the saves cannot ride
#: (the Responses API, Anthropic's Messages API): a block sent to one is refused
#: before vLLM reads the request, so a stream is never started and then cut.
NO_BLOCK_ROUTES = ("/v1/responses", "/v1/messages")


def names_a_block(body: bytes) -> bool:
    """Whether a request body carries a block in ``vllm_xargs`` (read only when the
    key's name appears in it at all; a body that does not parse is vLLM's to refuse)."""
    if EXTRA_ARGS_KEY.encode() not in body:
        return False
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return False
    xargs = document.get("vllm_xargs") if isinstance(document, dict) else None
    return isinstance(xargs, dict) and EXTRA_ARGS_KEY in xargs


class NoBlocksElsewhere:
    """ASGI middleware: a POST to one of :data:`NO_BLOCK_ROUTES` carrying a block
    gets a 400 ``NNsightBadEnvelope`` naming the routes that take blocks."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if (
            scope.get("type") != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in NO_BLOCK_ROUTES
        ):
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message.get("type") != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if names_a_block(body):
            from fastapi.responses import JSONResponse

            message = (
                f"{scope['path']} does not take nnsight blocks (its answer has no place for their "
                "saves); send them to /v1/completions or /v1/chat/completions."
            )
            status, body = http_answer(EnvelopeError(message))
            await JSONResponse(body, status)(scope, receive, send)
            return
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
