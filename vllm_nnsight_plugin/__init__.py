"""nnsight interventions inside a stock vLLM engine.

``pip install vllm-nnsight-plugin`` registers a vLLM plugin: every ``vllm.LLM``
then accepts an nnsight block in ``SamplingParams.extra_args`` and returns what
it saved on the ``RequestOutput``. :class:`VLLM` is the client that writes those
blocks the way nnsight users already do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import PluginError
from .versions import PLUGIN_VERSION as __version__

if TYPE_CHECKING:
    from .client.model import VLLM, PreparedRequests, UntappedLocationWarning, connect
    from .client.remote import ServeError
    from .returns.outputs import BlockError, saves

__all__ = [
    "VLLM",
    "PreparedRequests",
    "UntappedLocationWarning",
    "connect",
    "ServeError",
    "BlockError",
    "PluginError",
    "saves",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # Lazy: vLLM imports this package in every process through the plugin entry
    # point, and the client (nnsight, torch) must not load there.
    if name in ("VLLM", "PreparedRequests", "UntappedLocationWarning", "connect"):
        from .client import model

        return getattr(model, name)
    if name == "ServeError":
        from .client.remote import ServeError

        return ServeError
    if name in ("BlockError", "saves"):
        from .returns import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
