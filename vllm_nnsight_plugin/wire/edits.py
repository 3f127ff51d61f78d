"""How edits (blocks installed on an engine) and a request's choice of them travel.

Three small things, each a pure function of its inputs:

- **The choice** a request makes: ``extra_args["nnsight_edits"]`` (``edits=`` on
  a trace, an invoke or a plain ``generate``; ``vllm_xargs`` over HTTP, where
  vLLM 0.25 takes no lists, so a JSON string of the list is accepted too).
  :func:`wanted` reads it and :func:`select` applies the rule: no choice runs
  every installed edit; a list runs the edits named in it and every unnamed one;
  an empty list runs the unnamed ones only; a name nothing is installed under is
  refused.
- **The mark** the front end puts on a request it salted and will collect
  (:func:`mark`): the ids of the edits it runs, signed with the engine's local
  key, so a worker gives copies of edits only to requests a front end prepared
  for them (:func:`read_mark`), and nothing a client sends can ask for more.
- **Control commands** over HTTP (install, list, clear): an operator signature
  in a header over the method, the path, the body, an expiry and a nonce
  (:func:`sign_command`, :func:`check_command`), checked like a block's.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import secrets
import time
from collections.abc import Mapping
from typing import Any

from ..errors import PluginError
from .trust import EDITS_KEY as EDITS_KEY  # defined beside the other keys the front end inspects
from .trust import MARK_KEY as MARK_KEY
from .trust import MIN_KEY_CHARS, NonceBook, UntrustedBlockError, local_key, made_since_serving, max_ttl_s

#: The HTTP header carrying a control command's operator signature.
COMMAND_HEADER = "x-nnsight-signature"
_COMMAND_VERSION = "v2"

#: Bounds on a choice: a request names a few edits, each by a short name.
MAX_NAMES, MAX_NAME_CHARS = 64, 128


class EditChoiceError(PluginError, ValueError):
    """A request's ``edits=`` is malformed or names an edit nothing is installed under."""


def wanted(value: Any) -> list[str] | None:
    """A request's choice of edits as a list of names; None when it made none."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.lstrip().startswith("["):
            raise EditChoiceError(
                f"{EDITS_KEY} takes a list of edit names, not a string; write "
                f"edits=[{value[:MAX_NAME_CHARS]!r}] (over HTTP, a JSON list, or that list as a string)."
            )
        if len(value) > MAX_NAMES * (MAX_NAME_CHARS + 4) + 2:
            raise EditChoiceError(f"{EDITS_KEY} names more than {MAX_NAMES} edits.")
        try:
            value = json.loads(value)
        except ValueError:
            raise EditChoiceError(f"{EDITS_KEY} is not a JSON list of names.") from None
    if not isinstance(value, (list, tuple)):
        raise EditChoiceError(f"{EDITS_KEY} takes a list of edit names, not {type(value).__name__}.")
    if len(value) > MAX_NAMES:
        raise EditChoiceError(f"{EDITS_KEY} names more than {MAX_NAMES} edits.")
    names = []
    for name in value:
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
            raise EditChoiceError(
                f"edit names are non-empty strings of at most {MAX_NAME_CHARS} characters "
                f"(got {type(name).__name__})."
            )
        names.append(name)
    return names


def select(installed: Mapping[str, str | None], names: list[str] | None) -> list[str]:
    """The ids of the installed edits (id -> name, None when unnamed) that a request
    choosing ``names`` runs, in the order they were installed."""
    if names is None:
        return list(installed)
    known = {name for name in installed.values() if name is not None}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise EditChoiceError(
            f"edits={names!r} asks for {unknown!r}, but no edit is installed under "
            f"{'that name' if len(unknown) == 1 else 'those names'} "
            f"(installed: {sorted(known)!r}). Install one with model.edit(name=...), or "
            "leave the name out."
        )
    chosen = set(names)
    return [edit_id for edit_id, name in installed.items() if name is None or name in chosen]


def encode_choice(names: list[str]) -> str:
    """A choice as ``vllm_xargs`` carries it on every vLLM release (a JSON string)."""
    return json.dumps(list(names), separators=(",", ":"))


# ---------------------------------------------------------------------- the mark
def _mark_mac(key: str, body: str) -> str:
    return hmac.new(key.encode(), f"edit-mark:{body}".encode(), hashlib.sha256).hexdigest()


def mark(edit_ids: list[str]) -> str | None:
    """The front end's mark for a request that runs ``edit_ids`` (None without a local key)."""
    key = local_key()
    if not key:
        return None
    body = f"{secrets.token_hex(8)}:{','.join(edit_ids)}"
    return f"{body}:{_mark_mac(key, body)}"


def read_mark(value: Any) -> list[str]:
    """The edit ids a worker runs for a request carrying ``value`` as its mark: none
    unless the mark was made by this engine's front end."""
    key = local_key()
    if not key or not isinstance(value, str) or len(value) > 64 * 1024:
        return []
    body, _, mac = value.rpartition(":")
    if not body or not hmac.compare_digest(_mark_mac(key, body).encode(), mac.encode("utf-8", "replace")):
        return []
    ids = body.partition(":")[2]
    return [edit_id for edit_id in ids.split(",") if edit_id]


# ---------------------------------------------------------------------- commands
def _command_mac(
    key: str, method: str, path: str, body: bytes, created: float, expires: float, nonce: str
) -> str:
    digest = hashlib.sha256(body).hexdigest()
    message = (
        f"nnsight-command-{_COMMAND_VERSION}\n{method.upper()}\n{path}\n{created!r}\n{expires!r}\n"
        f"{nonce}\n{digest}"
    )
    return hmac.new(key.encode("utf-8"), message.encode("utf-8"), hashlib.sha256).hexdigest()


def sign_command(key: str, method: str, path: str, body: bytes = b"", ttl_s: float = 60.0) -> str:
    """The signature header's value for one control request (good once, for ``ttl_s``)."""
    created = round(time.time(), 3)
    expires = round(created + ttl_s, 3)
    nonce = secrets.token_hex(16)
    mac = _command_mac(key, method, path, body, created, expires, nonce)
    return f"{_COMMAND_VERSION}:{created!r}:{expires!r}:{nonce}:{mac}"


def check_command(
    header: Any, method: str, path: str, body: bytes, key: str, nonces: NonceBook, now: float | None = None
) -> None:
    """Raise :class:`UntrustedBlockError` unless ``header`` signs this request with
    ``key``, unexpired, within the lifetime limit, and not seen before."""
    now = time.time() if now is None else now
    if len(key) < MIN_KEY_CHARS:
        raise UntrustedBlockError(
            f"the server's operator key is shorter than {MIN_KEY_CHARS} characters, so it "
            "accepts no commands (operator: set a longer VLLM_NNSIGHT_KEY or VLLM_NNSIGHT_KEY_FILE)."
        )
    if not isinstance(header, str) or not header:
        raise UntrustedBlockError(
            f"the request is not signed: send the {COMMAND_HEADER} header made with the "
            "operator's key (the client does this when given key=...)."
        )
    parts = header.split(":")
    if len(parts) != 5 or parts[0] != _COMMAND_VERSION or len(header) > 512:
        raise UntrustedBlockError(f"the {COMMAND_HEADER} header is malformed.")
    _, created_text, expires_text, nonce, mac = parts
    try:
        created, expires = float(created_text), float(expires_text)
    except ValueError:
        raise UntrustedBlockError(f"the {COMMAND_HEADER} header is malformed.") from None
    if not (math.isfinite(expires) and math.isfinite(created)) or not nonce:
        raise UntrustedBlockError(f"the {COMMAND_HEADER} header is malformed.")
    expected = _command_mac(key, method, path, body, created, expires, nonce)
    if not hmac.compare_digest(expected.encode(), mac.encode("utf-8", "replace")):
        raise UntrustedBlockError(
            "the command's signature does not match this server's operator key (a wrong "
            "key, or the request was changed on the way)."
        )
    if expires < now:
        raise UntrustedBlockError("the signed command has expired; send it again.")
    if expires - now > max_ttl_s():
        raise UntrustedBlockError("the signed command's lifetime is over this server's limit.")
    if not made_since_serving(created):
        raise UntrustedBlockError(
            "the signed command was made before this server started serving (a replay across "
            "a restart, or a clock far behind the server's); send it again."
        )
    if not nonces.claim(nonce, expires, now):
        raise UntrustedBlockError("this signed command was already used (a replay).")
