"""The operator's signed commands: the check every operator route makes first.

A route such as ``/v1/nnsight/edits`` or ``/v1/nnsight/model`` runs only for a
request signed with the operator's key in the ``x-nnsight-signature`` header
(``wire/edits.sign_command``: method, path, body, expiry, nonce; each signature
good once), on a server started with that key. A refusal runs nothing and echoes
nothing of the request.
"""

from __future__ import annotations

from typing import Any

from ..errors import BlocksOffError, NoEngineError, PluginError, http_answer
from ..seams.frontend import served_engine
from ..settings import blocks_off
from ..wire.edits import COMMAND_HEADER, check_command
from ..wire.trust import OPERATOR_KEY_ENV, OPERATOR_KEY_FILE_ENV, UntrustedBlockError, operator_key
from .gate import _NONCES

try:  # the server has it (FastAPI reads the handlers' annotations); a client need not
    from starlette.requests import Request
except ImportError:  # pragma: no cover
    Request = Any  # type: ignore[misc,assignment]


def error_response(error: PluginError) -> Any:
    """The JSON answer for ``error`` (its class's status and kind)."""
    from fastapi.responses import JSONResponse

    status, body = http_answer(error)
    return JSONResponse(body, status)


def signed_path(request: Request) -> str:
    """What a command's signature covers of its URL: the path and any query."""
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


async def authorized(request: Request, body: bytes) -> Any:
    """The engine this server runs, once the request is signed with the operator's
    key; otherwise a :class:`PluginError` for :func:`error_response`."""
    off = blocks_off()
    if off is not None:
        raise BlocksOffError(off)
    key = operator_key()
    if key is None:
        raise BlocksOffError(
            "this server does not take nnsight commands over HTTP. The operator can turn them "
            f"on by starting it with {OPERATOR_KEY_ENV} (or {OPERATOR_KEY_FILE_ENV}) set."
        )
    try:
        check_command(
            request.headers.get(COMMAND_HEADER), request.method, signed_path(request), body, key, _NONCES
        )
    except UntrustedBlockError as error:
        raise UntrustedBlockError(str(error)) from None  # nothing of the request's parsing kept
    engine = served_engine(request.app.state)
    if engine is None:
        raise NoEngineError("this server runs no engine.")
    return engine
