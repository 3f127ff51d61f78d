"""Who may send a block, and how an engine tells.

A block is code. An engine runs one only when the request carries a signature
made with the engine's *local key*: a random secret created in the process that
builds the engine (before its engine-core and worker processes start, which
inherit it through the environment). Whoever holds it already runs code in the
engine's process, so trusting them adds nothing:

- in the user's own process (``vllm.LLM``, ``AsyncLLM``), the client signs each
  block with the local key when it seals it;
- on a server, nothing on the network knows the local key. A block sent over
  HTTP is refused unless the operator turned remote blocks on by setting an
  *operator key*, and the envelope is signed with that key, unexpired and not
  seen before. The server's HTTP layer checks that (``server/gate.py``) and only
  then adds the local signature.

Any other way in (another endpoint, a crafted ``extra_args``) has no local
signature, so the worker refuses the block before decoding any of it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time

from .envelope import Envelope, operator_signature

#: The environment variable holding the engine's local key.
LOCAL_KEY_ENV = "VLLM_NNSIGHT_LOCAL_KEY"
#: The ``extra_args`` key carrying the local signature.
LOCAL_SIGNATURE_KEY = "nnsight_local_sig"
#: The operator's key: set on a server to accept signed blocks over HTTP; a
#: client reads the same variable to sign.
OPERATOR_KEY_ENV = "VLLM_NNSIGHT_KEY"
#: Or a file holding it, read on every request: a mounted secret, rotated (or
#: emptied, which turns blocks off) without restarting the server.
OPERATOR_KEY_FILE_ENV = "VLLM_NNSIGHT_KEY_FILE"
#: The longest lifetime a server accepts on a signed envelope, in seconds.
MAX_TTL_ENV = "VLLM_NNSIGHT_MAX_TTL_S"
DEFAULT_MAX_TTL_S = 900.0
#: Shortest operator key accepted: a short secret is a guessable one.
MIN_KEY_CHARS = 32


class UntrustedBlockError(PermissionError):
    """A block arrived without a signature this engine accepts."""


def ensure_local_key() -> str:
    """This process's local key, created on first use (before engine processes start)."""
    return os.environ.setdefault(LOCAL_KEY_ENV, secrets.token_hex(32))


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
            "this engine runs a block only when it was signed in the engine's own "
            "process (the vllm_nnsight_plugin client does that) or accepted by the "
            "server's HTTP layer with the operator's key; this one was neither, so "
            "none of it was run."
        )


def operator_key(value: str | None = None) -> str | None:
    """The operator key: ``value`` if given, else ``VLLM_NNSIGHT_KEY``, else the
    contents of ``VLLM_NNSIGHT_KEY_FILE``; None when none is set (blocks off)."""
    if value:
        return value
    if os.environ.get(OPERATOR_KEY_ENV):
        return os.environ[OPERATOR_KEY_ENV]
    path = os.environ.get(OPERATOR_KEY_FILE_ENV)
    if path:
        try:
            with open(path, encoding="utf-8") as handle:
                return handle.read().strip() or None
        except OSError:
            return None
    return None


def max_ttl_s() -> float:
    return float(os.environ.get(MAX_TTL_ENV) or DEFAULT_MAX_TTL_S)


class NonceBook:
    """Nonces of accepted envelopes, kept until they expire: each is good once."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}
        self._prune_at = 1024
        self._lock = threading.Lock()

    def claim(self, nonce: str, expires: float, now: float) -> bool:
        with self._lock:
            if len(self._seen) >= self._prune_at:
                self._seen = {n: t for n, t in self._seen.items() if t >= now}
                self._prune_at = max(1024, 2 * len(self._seen))
            if nonce in self._seen:
                return False
            self._seen[nonce] = expires
            return True


def check_operator(envelope: Envelope, key: str, nonces: NonceBook, now: float | None = None) -> None:
    """Raise :class:`UntrustedBlockError` unless the envelope is signed with ``key``,
    unexpired, within the server's lifetime limit, and not seen before."""
    now = time.time() if now is None else now
    if len(key) < MIN_KEY_CHARS:
        raise UntrustedBlockError(
            f"the server's operator key is shorter than {MIN_KEY_CHARS} characters, so "
            "it accepts no blocks (operator: set a longer VLLM_NNSIGHT_KEY, e.g. "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`)."
        )
    if envelope.sig is None:
        raise UntrustedBlockError(
            "the block is not signed. This server runs blocks signed with its operator "
            "key only: pass key=... to the client or set VLLM_NNSIGHT_KEY where it runs."
        )
    if not hmac.compare_digest(operator_signature(envelope, key), envelope.sig):
        raise UntrustedBlockError(
            "the block's signature does not match this server's operator key (a wrong "
            "key, or the envelope was changed on the way)."
        )
    if envelope.expires is None or envelope.nonce is None:
        raise UntrustedBlockError("a signed block needs an expiry and a nonce; build it again.")
    if envelope.expires < now:
        raise UntrustedBlockError("the signed block has expired; build the request again.")
    if envelope.expires - now > max_ttl_s():
        raise UntrustedBlockError(
            f"the signed block is valid for {envelope.expires - now:.0f} s, over this "
            f"server's limit of {max_ttl_s():.0f} s ({MAX_TTL_ENV}); sign with a shorter ttl."
        )
    if not nonces.claim(envelope.nonce, envelope.expires, now):
        raise UntrustedBlockError(
            "this signed block was already used (a replay); every request needs a fresh one."
        )
