"""Who may send a block: only the process that owns the engine, for now.

A block is code. An engine must never run one that arrived from somewhere it
does not trust, and with this plugin installed a stock ``vllm serve`` receives
``extra_args`` from any HTTP client (``vllm_xargs``). So a worker runs a block
only when the request also carries a signature made with the engine's local
key: a random secret created in the front-end process when the engine config
is built and inherited by the engine's own processes through the environment.
The offline ``LLM`` path signs its requests in-process; nothing on the network
knows the key, so a block sent over HTTP is refused before anything in it is
decoded.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

#: The environment variable holding the engine's local key.
LOCAL_KEY_ENV = "VLLM_NNSIGHT_LOCAL_KEY"
#: The ``extra_args`` key carrying the in-process signature.
LOCAL_SIGNATURE_KEY = "nnsight_local_sig"


class UntrustedBlockError(PermissionError):
    """A block arrived without the engine's local signature."""


def ensure_local_key() -> None:
    """Create this engine family's key (front end, before engine processes start)."""
    os.environ.setdefault(LOCAL_KEY_ENV, secrets.token_hex(32))


def local_signature(envelope: str) -> str | None:
    key = os.environ.get(LOCAL_KEY_ENV)
    if not key:
        return None
    return hmac.new(key.encode(), envelope.encode("utf-8", "replace"), hashlib.sha256).hexdigest()


def check_local(envelope: object, signature: object) -> None:
    """Raise :class:`UntrustedBlockError` unless ``signature`` is the local one."""
    expected = local_signature(envelope) if isinstance(envelope, str) else None
    if expected is None or not isinstance(signature, str) or not hmac.compare_digest(expected, signature):
        raise UntrustedBlockError(
            "this engine runs blocks only from its own process (an offline vllm.LLM with "
            "the plugin installed); a block that arrived any other way, such as over "
            "HTTP, is refused and none of it is run."
        )
