"""The envelope: how a block travels from the client to the worker, and nothing else.

A block is nnsight's serialized ``Mediator`` (its source, its captured names).
It rides a stock ``SamplingParams.extra_args`` entry, which vLLM carries from the
front end to every worker untouched, and which the OpenAI server fills from
``vllm_xargs``. Over HTTP those values must be strings, so the envelope is one
ASCII string: a short prefix, then base64 of a JSON document.

The JSON document is validated by pydantic in :func:`open_envelope`, the one
place a worker decodes anything a client sent. It carries:

- ``v``: the envelope format version. A worker refuses a version it does not
  speak, with a message naming both versions.
- ``nnsight``: the nnsight version that serialized the block. The payload is
  nnsight's own pickle of its classes, which only the same version can read.
- ``plugin``: the client's plugin version, for error messages.
- ``payload``: base64 of the serialized block.
- ``sig``/``expires``/``nonce``: for a server, the operator's signature
  (HMAC-SHA256 over every other field, see :func:`signed_bytes`) and what
  keeps a signed envelope from being used twice. The offline path needs none.

Sizes are bounded before anything is decoded (:class:`Limits`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
import time

from pydantic import BaseModel, ConfigDict, Field, ValidationError

#: The ``extra_args`` key (and ``vllm_xargs`` key) a block rides under.
EXTRA_ARGS_KEY = "nnsight"
#: Format version this code writes and reads.
ENVELOPE_VERSION = 1
_PREFIX = "nns1:"


class EnvelopeError(ValueError):
    """A request's envelope was refused; the message says why and what to do."""


class EnvelopeTooLarge(EnvelopeError):
    """The envelope is over the engine's payload limit."""


class EnvelopeExpired(EnvelopeError):
    """The envelope's expiry has passed."""


class Limits(BaseModel):
    """Size limits a worker enforces per request.

    Environment variables override the defaults in the engine's processes:
    ``VLLM_NNSIGHT_MAX_PAYLOAD_BYTES`` and ``VLLM_NNSIGHT_MAX_SAVE_BYTES``.
    """

    max_payload_bytes: int = 64 * 1024 * 1024
    max_save_bytes: int = 1024 * 1024 * 1024

    @classmethod
    def from_env(cls) -> Limits:
        values = {}
        for field, var in (
            ("max_payload_bytes", "VLLM_NNSIGHT_MAX_PAYLOAD_BYTES"),
            ("max_save_bytes", "VLLM_NNSIGHT_MAX_SAVE_BYTES"),
        ):
            if os.environ.get(var):
                values[field] = int(os.environ[var])
        return cls(**values)


class Envelope(BaseModel):
    """The decoded document; see the module docstring for each field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: int
    nnsight: str
    plugin: str
    payload: str = Field(min_length=1)
    created: float = 0.0
    expires: float | None = None
    nonce: str | None = None
    sig: str | None = None

    def block_bytes(self) -> bytes:
        try:
            return base64.b64decode(self.payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise EnvelopeError(f"the envelope's payload is not valid base64 ({error})") from None


def signed_bytes(envelope: Envelope) -> bytes:
    """What an operator signature covers: every field but ``sig``, as canonical JSON.

    Both ends build this from the parsed document, so key order and spacing on
    the wire do not matter, and no field can be changed without breaking it.
    """
    fields = envelope.model_dump(exclude={"sig"}, exclude_none=True)
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("utf-8")


def operator_signature(envelope: Envelope, key: str) -> str:
    return hmac.new(key.encode("utf-8"), signed_bytes(envelope), hashlib.sha256).hexdigest()


def seal(
    block: bytes,
    *,
    nnsight_version: str,
    plugin_version: str,
    key: str | None = None,
    ttl_s: float = 300.0,
) -> str:
    """Wrap a serialized block into the string that rides ``extra_args``.

    With ``key`` (an operator's key, for a server) the envelope is signed, expires
    ``ttl_s`` seconds from now and carries a fresh nonce, so it can be used once.
    """
    now = time.time()
    document = Envelope(
        v=ENVELOPE_VERSION,
        nnsight=nnsight_version,
        plugin=plugin_version,
        payload=base64.b64encode(block).decode("ascii"),
        created=now,
        expires=now + ttl_s if key else None,
        nonce=secrets.token_hex(16) if key else None,
    )
    if key:
        document = document.model_copy(update={"sig": operator_signature(document, key)})
    raw = json.dumps(document.model_dump(exclude_none=True), separators=(",", ":"))
    return _PREFIX + base64.b64encode(raw.encode("utf-8")).decode("ascii")


def _problems(error: ValidationError, shown: int = 3) -> str:
    """A bounded account of what is wrong, naming fields but never echoing values
    (a refusal must cost less than the request, and say nothing of its input)."""
    problems = error.errors(include_input=False, include_url=False, include_context=False)
    parts = []
    for problem in problems[:shown]:
        where = ".".join(str(part)[:40] for part in problem.get("loc", ())[:4]) or "the document"
        parts.append(f"{where}: {problem.get('type', 'invalid')}")
    more = f" and {len(problems) - shown} more" if len(problems) > shown else ""
    return f"{len(problems)} problem(s): {'; '.join(parts)}{more}"


#: Room for an envelope's fields besides the payload (versions, times, nonce,
#: signature), JSON-encoded.
_FIELDS_BYTES = 1024


def open_envelope(
    value: object,
    *,
    nnsight_version: str,
    plugin_version: str,
    limits: Limits | None = None,
    expiry: bool = True,
) -> Envelope:
    """Check and decode an envelope; raise :class:`EnvelopeError` with the reason.

    Nothing in the payload is executed here: this only validates framing, size
    and versions, so a refusal provably runs none of the sender's code. Expiry is
    the door's check (``expiry=False`` in the worker, which the front end's local
    signature tells that the request was admitted while it was valid).
    """
    limits = limits or Limits()
    if isinstance(value, bytes):
        value = value.decode("ascii", errors="replace")
    if not isinstance(value, str):
        raise EnvelopeError(
            f"extra_args[{EXTRA_ARGS_KEY!r}] must be the string made by "
            f"vllm_nnsight_plugin (got {type(value).__name__}). Build requests with "
            "VLLM.trace or model.requests(...)."
        )
    # The block is base64 inside a JSON document that is base64 again (4/3 twice),
    # beside a few hundred bytes of fields; bound the string before decoding anything.
    if len(value) > (limits.max_payload_bytes * 4 // 3 + _FIELDS_BYTES) * 4 // 3:
        raise EnvelopeTooLarge(
            f"the block is {len(value)} bytes encoded, over this engine's limit of "
            f"{limits.max_payload_bytes} bytes (VLLM_NNSIGHT_MAX_PAYLOAD_BYTES). Build "
            "large tensors inside the block (from the model or from a seed) rather than "
            "capturing them, or ask the operator to raise the limit."
        )
    if not value.startswith(_PREFIX):
        raise EnvelopeError(
            f"extra_args[{EXTRA_ARGS_KEY!r}] is not a vllm-nnsight envelope (it should "
            f"start with {_PREFIX!r}); it may be corrupt or come from another tool."
        )
    try:
        raw = base64.b64decode(value[len(_PREFIX) :], validate=True)
        document = json.loads(raw)
    except (binascii.Error, ValueError) as error:
        raise EnvelopeError(f"the envelope is corrupt: {str(error)[:200]}") from None
    except RecursionError:
        raise EnvelopeError("the envelope is corrupt: it nests too deeply") from None
    if isinstance(document, dict) and document.get("v") != ENVELOPE_VERSION:
        raise EnvelopeError(
            f"the envelope is format version {document.get('v')!r} (client plugin "
            f"{document.get('plugin')!r}); this engine reads version {ENVELOPE_VERSION} "
            f"(plugin {plugin_version}). Install the same vllm-nnsight-plugin version "
            "on the client and the server."
        )
    try:
        envelope = Envelope.model_validate(document)
    except ValidationError as error:
        raise EnvelopeError(f"the envelope is malformed: {_problems(error)}") from None
    if envelope.nnsight != nnsight_version:
        raise EnvelopeError(
            f"the block was written with nnsight {envelope.nnsight} but this engine runs "
            f"nnsight {nnsight_version}; nnsight can only read blocks from its own "
            f"version. Install nnsight=={nnsight_version} on the client."
        )
    if expiry and envelope.expires is not None and envelope.expires < time.time():
        raise EnvelopeExpired("the envelope has expired; build the request again.")
    if len(envelope.payload) > limits.max_payload_bytes * 4 // 3 + 4:
        raise EnvelopeTooLarge(
            f"the block is over this engine's limit of {limits.max_payload_bytes} bytes "
            "(VLLM_NNSIGHT_MAX_PAYLOAD_BYTES)."
        )
    return envelope
