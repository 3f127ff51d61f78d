"""``GET /v1/nnsight/model``: what a client with no vLLM needs to write blocks.

The served model's name, its module tree as the workers hold it, and its
tokenizer's files (``wire/tree.py``). Read-only, and behind the operator's
signature like the edit routes (``server/edits.py``): the tree says nothing a
block could not, but a server that takes no blocks has no reason to show it.
Built once, on the first call, by asking the workers, and kept.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import PluginError
from ..seams.frontend import model_path_of, server_args
from ..wire import rpc
from .commands import Request, authorized, error_response

PATH = "/v1/nnsight/model"
_KEPT = "vllm_nnsight_tree"


class TreeUnavailableError(PluginError, RuntimeError):
    """The workers could not describe the model (no plugin extension, or a failure)."""

    http_status = 503
    kind = "NNsightTreeError"


def attach(app: Any) -> None:
    app.add_api_route(PATH, _model, methods=["GET"], include_in_schema=False)


async def _model(request: Request) -> Any:
    try:
        engine = await authorized(request, await request.body())
    except PluginError as error:
        return error_response(error)
    state = request.app.state
    kept = getattr(state, _KEPT, None)
    if kept is None:
        try:
            answers = await engine.collective_rpc(rpc.TREE)
        except Exception as error:  # a worker without the plugin's extension, or one that failed
            message = f"the workers could not describe the model ({type(error).__name__})."
            return error_response(TreeUnavailableError(message))
        document = {**answers[0], "model": _served_name(state, engine)}
        kept = json.dumps(document, separators=(",", ":")).encode("utf-8")
        setattr(state, _KEPT, kept)
    from fastapi.responses import Response

    return Response(kept, media_type="application/json")


def _served_name(state: Any, engine: Any) -> str:
    """The name requests use for the model (``--served-model-name``, else its path)."""
    args = server_args(state)
    names = getattr(args, "served_model_name", None)
    if isinstance(names, (list, tuple)) and names:
        return str(names[0])
    if isinstance(names, str) and names:
        return names
    return model_path_of(engine)
