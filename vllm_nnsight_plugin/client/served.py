"""What a request carries to a server, and with which key: shared by the client's
model, its edits and its server connection (none of them imports another for it)."""

from __future__ import annotations

import contextvars

from ..prefix import CLAIM_KEY
from ..returns.outputs import RESULT_KEY
from ..wire.edits import EDITS_KEY, encode_choice
from ..wire.envelope import EXTRA_ARGS_KEY

#: The key to sign blocks with while requests for a server are being built (a
#: context variable: traces may be built on several threads or tasks at once).
SERVER_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "vllm_nnsight_server_key", default=None
)


def served_xargs(extra: dict) -> dict:
    """What of a request's ``extra_args`` travels to a server as ``vllm_xargs``: the
    block, a choice of edits as a JSON string (vLLM 0.25 takes no lists there), and
    what the client says of the block (its prefix claim, its unread result)."""
    xargs = {EXTRA_ARGS_KEY: extra[EXTRA_ARGS_KEY]} if EXTRA_ARGS_KEY in extra else {}
    if extra.get(EDITS_KEY) is not None:
        xargs[EDITS_KEY] = encode_choice(extra[EDITS_KEY])
    for key in (CLAIM_KEY, RESULT_KEY):
        if extra.get(key) is not None:
            xargs[key] = extra[key]
    return xargs


def key_spelling(key: str | None, kwargs: dict) -> str | None:
    """``key=``, or ``api_key=`` (taken out of ``kwargs``); both, only if they agree."""
    api_key = kwargs.pop("api_key", None)
    if api_key is not None and key is not None and api_key != key:
        raise ValueError("pass the operator's key once: key=... or api_key=..., not two different keys")
    return key if key is not None else api_key
