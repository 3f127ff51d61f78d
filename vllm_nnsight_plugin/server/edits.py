"""The operator's routes for installed edits on ``vllm serve``.

Added beside the OpenAI routes (``seams.frontend.patch_build_app``):

=======  ===========================  ============================================
method   path                         does
=======  ===========================  ============================================
POST     ``/v1/nnsight/edits``        install an edit: ``{"id", "name", "block"}``,
                                      the block sealed by the client
GET      ``/v1/nnsight/edits``        list the installed edits: ``{"edits": [...]}``
DELETE   ``/v1/nnsight/edits/{id}``   clear one edit
DELETE   ``/v1/nnsight/edits``        clear every edit
=======  ===========================  ============================================

Every call is refused unless it carries the operator's signature in the
``x-nnsight-signature`` header (``wire/edits.sign_command``: method, path, body,
expiry, nonce; each signature good once), and the server was started with an
operator key: with none, the routes answer 403 like the block door does. A
refusal runs nothing and echoes nothing of the request.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from .. import edits
from ..errors import BlocksOffError, NoEngineError, PluginError
from ..seams.frontend import parallel_config_of, server_args, unsupported_parallelism
from ..versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT
from ..wire.envelope import EnvelopeError, EnvelopeTooLarge, Limits, open_envelope
from ..wire.trust import UntrustedBlockError
from .commands import Request, authorized, error_response

PATH = "/v1/nnsight/edits"
#: Room for an install's JSON fields besides the block.
_FIELDS_BYTES = 4096


def attach(app: Any) -> None:
    """Add the routes to a FastAPI app."""
    app.add_api_route(PATH, _install, methods=["POST"], include_in_schema=False)
    app.add_api_route(PATH, _list, methods=["GET"], include_in_schema=False)
    app.add_api_route(PATH, _clear_all, methods=["DELETE"], include_in_schema=False)
    app.add_api_route(PATH + "/{edit_id}", _clear_one, methods=["DELETE"], include_in_schema=False)


def _refusal_of_layout(request: Request, engine: Any) -> str | None:
    args = server_args(request.app.state)
    if int(getattr(args, "api_server_count", 1) or 1) > 1:
        return (
            "this server runs several API server processes (--api-server-count > 1), and an "
            "edit installed through one would not be seen by the others; serve edits with one."
        )
    return unsupported_parallelism(parallel_config_of(engine))


async def _install(request: Request) -> Any:
    limits = Limits.from_env()
    too_long = limits.max_payload_bytes * 2 + _FIELDS_BYTES  # base64 twice, with room
    if int(request.headers.get("content-length") or 0) > too_long:
        return error_response(EnvelopeTooLarge("the edit is too large."))
    body = await request.body()
    try:
        if len(body) > too_long:
            raise EnvelopeTooLarge("the edit is too large.")
        engine = await authorized(request, body)
        refusal = _refusal_of_layout(request, engine)
        if refusal is not None:
            raise edits.EditLayoutError(refusal)
        edit_id, name, block = _fields(body)
        open_envelope(block, nnsight_version=SUPPORTED_NNSIGHT, plugin_version=PLUGIN_VERSION, limits=limits)
        await edits.ainstall(engine, edit_id, block, edits.check_name(name))
    except EnvelopeTooLarge as error:
        return error_response(error)
    except edits.EditError as error:  # its message can quote the block's own error at length
        return error_response(type(error)(str(error)[:2000]))
    except (BlocksOffError, UntrustedBlockError, NoEngineError) as error:
        return error_response(error)
    except (EnvelopeError, TypeError, ValueError) as error:  # any other refusal here is a bad body
        return error_response(EnvelopeError(str(error)[:500]))
    return {"id": edit_id, "name": name}


def _fields(body: bytes) -> tuple[str, str | None, str]:
    """``(id, name, block)`` of an install's body; a missing id is made here."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        raise ValueError("the body is not a JSON object with a block") from None
    if not isinstance(document, dict) or not isinstance(document.get("block"), str):
        raise ValueError("the body is not a JSON object with a block")
    edit_id = document.get("id") or f"edit-{secrets.token_hex(16)}"
    if not isinstance(edit_id, str) or len(edit_id) > 128 or not edit_id.isprintable() or "," in edit_id:
        raise ValueError("an edit's id is a short printable string without commas")
    return edit_id, document.get("name"), document["block"]


async def _list(request: Request) -> Any:
    try:
        engine = await authorized(request, await request.body())
    except PluginError as error:
        return error_response(error)
    return {"edits": [{"id": i, "name": name} for i, name in edits.installed(engine).items()]}


async def _clear_all(request: Request) -> Any:
    return await _clear(request, None)


async def _clear_one(request: Request, edit_id: str) -> Any:
    return await _clear(request, edit_id)


async def _clear(request: Request, edit_id: str | None) -> Any:
    try:
        engine = await authorized(request, await request.body())
    except PluginError as error:
        return error_response(error)
    before = edits.installed(engine)
    ids = None if edit_id is None else [edit_id]
    if ids is not None and edit_id not in before:
        return error_response(edits.NoEditError("no edit is installed under that id."))
    await edits.aclear(engine, ids)
    return {"cleared": list(before) if ids is None else ids}
