"""How a request's saves travel back over HTTP, inside the OpenAI JSON.

A finished request's saves are ``torch.save``'d and base64'd into one string per
request (tensors keep dtype and shape; no float goes through JSON). The block's
error, if any, is nnsight's own wire-safe dict (type, message, the block's
traceback), so the client re-raises it exactly as a local run would.

The client reads the blob with ``torch.load(weights_only=True)``: a server can
hand back tensors, containers, numbers, strings and vLLM's ``RequestOutput``
(for ``tracer.result``; read as a :class:`Record` of the same fields where the
client has no vLLM) but not arbitrary objects, so a hostile server cannot run
code on the client. ``VLLM_NNSIGHT_TRUST_SERVER=1`` lifts that for saves of
other types, from a server you trust.
"""

from __future__ import annotations

import base64
import importlib
import io
import re
import threading
from typing import Any, NamedTuple

from ..settings import TRUST_SERVER, value

#: The field the saves ride in, on responses and on the final stream event.
RESPONSE_FIELD = "nnsight"
#: Version of the response document below.
SAVES_VERSION = 1
TRUST_SERVER_ENV = TRUST_SERVER


class DecodedSaves(NamedTuple):
    """What one request's document holds: the block's saves (flat and per
    sequence) and the installed edits' saves (flat and per sequence)."""

    saves: dict
    sequences: list
    edits: dict
    edit_sequences: list


def encode_request(output: Any) -> dict:
    """The JSON-ready document for one finished, traced (or edited) ``RequestOutput``."""
    import torch

    buffer = io.BytesIO()
    torch.save(
        {
            "saves": getattr(output, "nnsight_saves", {}),
            "sequences": getattr(output, "nnsight_sequences", []),
            "edits": getattr(output, "nnsight_edit_saves", {}),
            "edit_sequences": getattr(output, "nnsight_edit_sequences", []),
        },
        buffer,
    )
    return {
        "request_id": output.request_id,
        "saves": base64.b64encode(buffer.getvalue()).decode("ascii"),
        "error": getattr(output, "nnsight_error", None),
        "path": getattr(output, "nnsight_path", None),
    }


#: Modules whose classes a client loads from a server: vLLM's plain output
#: records (a saved ``tracer.result`` is made of them), nothing with behaviour.
SAFE_MODULES = ("vllm.outputs", "vllm.logprobs", "vllm.v1.metrics.stats", "vllm.lora.request")


def _allowed(name: str) -> type | None:
    """The class a weights-only load asked for, if it is one of vLLM's output records."""
    module, _, attribute = name.rpartition(".")
    if module not in SAFE_MODULES:
        return None
    try:
        found = getattr(importlib.import_module(module), attribute)
    except ImportError:  # a client without vLLM: the record's fields, as attributes
        return _record_class(module, attribute) if attribute.isidentifier() else None
    except AttributeError:
        return None
    return found if isinstance(found, type) else None


class Record:
    """One of vLLM's output records (a ``RequestOutput``, its ``CompletionOutput``s),
    read by a client that has no vLLM: the same fields, as plain attributes."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in vars(self).items())
        return f"{type(self).__name__}({fields})"


_RECORDS: dict[tuple[str, str], type] = {}


def _record_class(module: str, name: str) -> type:
    found = _RECORDS.get((module, name))
    if found is None:  # named as vLLM names it: that is how a weights-only load asks for it
        found = _RECORDS[(module, name)] = type(name, (Record,), {"__module__": module, "__qualname__": name})
    return found


#: torch's list of admitted classes (``safe_globals``) is one per process, and
#: leaving the context puts back what was there on entry: two threads decoding at
#: once would take each other's admissions away mid-load. One load at a time.
_LOADING = threading.Lock()


def decode_request(document: dict) -> DecodedSaves:
    """The saves in :func:`encode_request`'s document."""
    import torch

    raw = base64.b64decode(document["saves"])

    trusted = bool(value(TRUST_SERVER_ENV))
    allowed: list[type] = []
    while True:
        try:
            with _LOADING, torch.serialization.safe_globals(allowed):
                blob = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=not trusted)
            break
        except Exception as error:
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
            extra = _allowed(found.group(1)) if found else None
            if extra is None or extra in allowed:
                raise ValueError(
                    "the server sent saves holding a type this client does not load from "
                    f"the network ({found.group(1) if found else type(error).__name__}). Save "
                    f"tensors, numbers, strings or containers of them, or set {TRUST_SERVER_ENV}=1 "
                    "if you trust the server."
                ) from None
            allowed.append(extra)
    return DecodedSaves(
        blob.get("saves", {}),
        blob.get("sequences", []),
        blob.get("edits", {}),
        blob.get("edit_sequences", []),
    )
