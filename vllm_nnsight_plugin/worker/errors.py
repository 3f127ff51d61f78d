"""The errors a request's block can end with on the engine (its own request only).

Each reaches the caller as the request's deferred error, re-raised by the client
with the class name and the message, which says what to change.
"""

from __future__ import annotations

from ..errors import PluginError


class ChunkedPromptError(PluginError, RuntimeError):
    """A block's prompt was split across steps by chunked prefill."""


class SaveLimitError(PluginError, RuntimeError):
    """A request's saves were over the engine's limit."""


class UnsendableSaveError(PluginError, RuntimeError):
    """A saved value could not be pickled to go back to the front end."""


class CompiledForwardError(PluginError, RuntimeError):
    """A block asked for a module location in a forward that ran compiled."""


class KeptRowsError(PluginError, RuntimeError):
    """A lowered request produced more rows at its tap than its region holds."""


class PreemptedError(PluginError, RuntimeError):
    """A request was preempted after its block had run, and vLLM recomputed it."""
