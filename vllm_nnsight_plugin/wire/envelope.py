"""The envelope: how a block travels from the client to the worker, and nothing else.

A block is nnsight's serialized ``Mediator`` (its source, its captured names).
It rides a stock ``SamplingParams.extra_args`` entry, which vLLM carries from the
front end to every worker untouched, and which the OpenAI server fills from
``vllm_xargs``. Over HTTP those values must be strings, so the envelope is one
ASCII string: a short prefix, base64 of a JSON document, and for a server a dot
and the operator's signature over everything before it (HMAC-SHA256, hex). The
signature is outside the document so that a server checks it on the string as
it arrived, before decoding anything in it (:func:`split_signature`): a sender
without the key costs the server one HMAC over a string of bounded length.

The JSON document is validated by pydantic in :func:`open_envelope`, the one
place a worker decodes anything a client sent. It carries:

- ``v``: the envelope format version. A worker refuses a version it does not
  speak, with a message naming both versions.
- ``nnsight``: the nnsight version that serialized the block. The payload is
  nnsight's own pickle of its classes, which only the same version can read.
- ``plugin``: the client's plugin version, for error messages.
- ``payload``: base64 of the serialized block.
- ``created``: when it was sealed (a server refuses one sealed before it started).
- ``expires``/``nonce``: for a server, what keeps a signed envelope from being
  used twice (``wire/trust.py``). The offline path needs none.

Sizes are bounded before anything is decoded (:class:`Limits`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import PluginError
from ..settings import MAX_PAYLOAD_BYTES, MAX_SAVE_BYTES, value

#: The ``extra_args`` key (and ``vllm_xargs`` key) a block rides under.
EXTRA_ARGS_KEY = "nnsight"
#: Format version this code writes. Version 3 payloads may rebuild captured tensors
#: with ``wire/canonical.rebuild_tensor``, which an engine reading only version 2
#: lacks: it refuses them with this module's message instead of failing to load.
ENVELOPE_VERSION = 3
#: Format versions this code reads (a version 2 payload is torch's pickles alone).
READ_VERSIONS = (2, 3)
_PREFIX = "nns2:"
_SIGNATURE_CHARS = 64


class EnvelopeError(PluginError, ValueError):
    """A request's envelope was refused; the message says why and what to do."""

    http_status = 400
    kind = "NNsightBadEnvelope"


class EnvelopeTooLarge(EnvelopeError):
    """The envelope is over the engine's payload limit."""

    http_status = 413
    kind = "NNsightPayloadTooLarge"


class EnvelopeExpired(EnvelopeError):
    """The envelope's expiry has passed."""

    http_status = 403
    kind = "NNsightUntrustedBlock"


class Limits(BaseModel):
    """Size limits a worker enforces per request.

    Environment variables override the defaults in the engine's processes:
    ``VLLM_NNSIGHT_MAX_PAYLOAD_BYTES`` and ``VLLM_NNSIGHT_MAX_SAVE_BYTES``.
    """

    max_payload_bytes: int = 64 * 1024 * 1024
    max_save_bytes: int = 1024 * 1024 * 1024

    @classmethod
    def from_env(cls) -> Limits:
        return cls(
            max_payload_bytes=value(MAX_PAYLOAD_BYTES),
            max_save_bytes=value(MAX_SAVE_BYTES),
        )


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

    def block_bytes(self) -> bytes:
        try:
            return base64.b64decode(self.payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise EnvelopeError(f"the envelope's payload is not valid base64 ({error})") from None


def operator_signature(body: str, key: str) -> str:
    """The operator's signature over an envelope's text (everything before the dot)."""
    return hmac.new(key.encode("utf-8"), body.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()


def split_signature(value: str) -> tuple[str, str | None]:
    """``(body, signature)`` of an envelope's text; None when it carries none. Reads
    nothing inside the body (base64 has no dot)."""
    body, dot, signature = value.partition(".")
    return body, (signature if dot else None)


def sign(body: str, key: str) -> str:
    """An envelope's text, signed for a server."""
    return f"{body}.{operator_signature(body, key)}"


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
    raw = json.dumps(document.model_dump(exclude_none=True), separators=(",", ":"))
    body = _PREFIX + base64.b64encode(raw.encode("utf-8")).decode("ascii")
    return sign(body, key) if key else body


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


def too_large(value: object, limits: Limits) -> None:
    """Raise :class:`EnvelopeTooLarge` if the text is longer than any envelope under
    the payload limit can be. The block is base64 inside a JSON document that is
    base64 again (4/3 twice), beside a few hundred bytes of fields and a signature."""
    length = len(value) if isinstance(value, (str, bytes)) else 0
    if length > (limits.max_payload_bytes * 4 // 3 + _FIELDS_BYTES) * 4 // 3 + _SIGNATURE_CHARS + 1:
        raise EnvelopeTooLarge(
            f"the block is {length} bytes encoded, over this engine's limit of "
            f"{limits.max_payload_bytes} bytes (VLLM_NNSIGHT_MAX_PAYLOAD_BYTES). Build "
            "large tensors inside the block (from the model or from a seed) rather than "
            "capturing them, or ask the operator to raise the limit."
        )


def _short(value: object, *, quoted: bool = True) -> str:
    """A value from the input, as a refusal may show it: short."""
    shown = repr(value) if quoted or not isinstance(value, str) else value
    return shown if len(shown) <= 40 else shown[:37] + "..."


#: Room for an envelope's fields besides the payload (versions, times, nonce,
#: signature), JSON-encoded.
_FIELDS_BYTES = 1024


def payload_of(value: object) -> str | None:
    """The payload of an envelope the front end already vouched for (the block's
    bytes, base64), or None where it has none: what names the block itself,
    whenever and however often it was sealed."""
    if not isinstance(value, str) or not value.startswith(_PREFIX):
        return None
    body, _ = split_signature(value)
    try:
        document = json.loads(base64.b64decode(body[len(_PREFIX) :], validate=True))
    except (binascii.Error, ValueError, RecursionError):
        return None
    payload = document.get("payload") if isinstance(document, dict) else None
    return payload if isinstance(payload, str) else None


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
    too_large(value, limits)
    if not value.startswith(_PREFIX):
        head, colon, _ = value[:12].partition(":")
        if colon and head.startswith("nns") and head[3:].isdigit():
            raise EnvelopeError(
                f"the envelope is format {head!r}; this engine reads {_PREFIX[:-1]!r} "
                f"(plugin {plugin_version}). Install the same vllm-nnsight-plugin version on "
                "the client and the server."
            )
        raise EnvelopeError(
            f"extra_args[{EXTRA_ARGS_KEY!r}] is not a vllm-nnsight envelope (it should "
            f"start with {_PREFIX!r}); it may be corrupt or come from another tool."
        )
    body, _ = split_signature(value)
    try:
        raw = base64.b64decode(body[len(_PREFIX) :], validate=True)
        document = json.loads(raw)
    except (binascii.Error, ValueError) as error:
        raise EnvelopeError(f"the envelope is corrupt: {type(error).__name__}") from None
    except RecursionError:
        raise EnvelopeError("the envelope is corrupt: it nests too deeply") from None
    if isinstance(document, dict) and document.get("v") not in READ_VERSIONS:
        raise EnvelopeError(
            f"the envelope is format version {_short(document.get('v'))} (client plugin "
            f"{_short(document.get('plugin'))}); this engine reads versions "
            f"{' and '.join(map(str, READ_VERSIONS))} "
            f"(plugin {plugin_version}). Install the same vllm-nnsight-plugin version "
            "on the client and the server."
        )
    try:
        envelope = Envelope.model_validate(document)
    except ValidationError as error:
        raise EnvelopeError(f"the envelope is malformed: {_problems(error)}") from None
    if envelope.nnsight != nnsight_version:
        raise EnvelopeError(
            f"the block was written with nnsight {_short(envelope.nnsight, quoted=False)} but this engine runs "
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
