"""The root of the plugin's errors.

Every error the plugin raises on purpose, in the client, the front end or a
worker, is a :class:`PluginError` and keeps the built-in base it had (``except
ValueError`` still catches an envelope refused as malformed). In the process that
raises it, ``except vllm_nnsight_plugin.PluginError`` tells the plugin's refusals
and limits from everything else; an error a worker ends a request with reaches
the client as nnsight raises a block's error there (its type's name, message and
traceback). Imports nothing, so every process can load it.
"""

from __future__ import annotations


class PluginError(Exception):
    """An error of the plugin's own: a request refused, a limit reached, a setting
    or a version it cannot use. A block's own exception is raised as it was.

    ``http_status`` and ``kind``: what a server answers when this error ends an
    HTTP request (:func:`http_answer`); each class says its own."""

    http_status: int = 500
    kind: str = "NNsightError"


class BlocksOffError(PluginError, PermissionError):
    """This server runs no blocks: no operator key, or a setting it cannot use."""

    http_status = 403
    kind = "NNsightBlocksDisabled"


class NoEngineError(PluginError, RuntimeError):
    """A signed command reached a server that runs no engine (nothing to edit)."""

    http_status = 503
    kind = "NNsightEditError"


def http_answer(error: PluginError) -> tuple[int, dict]:
    """The one place a plugin error becomes an HTTP answer: its status and the
    body vLLM's own errors have, ``{"error": {"message", "type", "code"}}``."""
    body = {"message": str(error), "type": error.kind, "code": error.http_status}
    return error.http_status, {"error": body}
