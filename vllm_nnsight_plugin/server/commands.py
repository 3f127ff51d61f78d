"""The operator's signed commands: the check every operator route makes first.

A route such as ``/v1/nnsight/edits`` or ``/v1/nnsight/model`` runs only for a
request signed with the operator's key in the ``x-nnsight-signature`` header
(``wire/edits.sign_command``: method, path, body, expiry, nonce; each signature
good once), on a server started with that key. A refusal runs nothing and echoes
nothing of the request.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from ..settings import blocks_off
from ..wire.edits import COMMAND_HEADER, check_command
from ..wire.trust import OPERATOR_KEY_ENV, OPERATOR_KEY_FILE_ENV, UntrustedBlockError, operator_key
from .gate import _NONCES

try:  # the server has it (FastAPI reads the handlers' annotations); a client need not
    from starlette.requests import Request
except ImportError:  # pragma: no cover
    Request = Any  # type: ignore[misc,assignment]


def error_response(status: HTTPStatus, kind: str, message: str) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status.value}}, status.value)


class Refused(Exception):
    def __init__(self, status: HTTPStatus, kind: str, message: str) -> None:
        super().__init__(message)
        self.response = error_response(status, kind, message)


def signed_path(request: Request) -> str:
    """What a command's signature covers of its URL: the path and any query."""
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


async def authorized(request: Request, body: bytes) -> Any:
    """The engine this server runs, once the request is signed with the operator's key."""
    off = blocks_off()
    if off is not None:
        raise Refused(HTTPStatus.FORBIDDEN, "NNsightBlocksDisabled", off)
    key = operator_key()
    if key is None:
        raise Refused(
            HTTPStatus.FORBIDDEN,
            "NNsightBlocksDisabled",
            "this server does not take nnsight commands over HTTP. The operator can turn them "
            f"on by starting it with {OPERATOR_KEY_ENV} (or {OPERATOR_KEY_FILE_ENV}) set.",
        )
    try:
        check_command(
            request.headers.get(COMMAND_HEADER), request.method, signed_path(request), body, key, _NONCES
        )
    except UntrustedBlockError as error:
        raise Refused(HTTPStatus.FORBIDDEN, "NNsightUntrustedBlock", str(error)) from None
    engine = getattr(request.app.state, "engine_client", None)
    if engine is None or not hasattr(engine, "input_processor"):
        raise Refused(HTTPStatus.SERVICE_UNAVAILABLE, "NNsightEditError", "this server runs no engine.")
    return engine
