"""A worker's reply to a collect, one entry per request: the same fields in the
worker that writes it (``worker/_nnsight.py``, ``worker/collect.py``) and the front
end that merges the ranks' entries and puts them on the outputs
(``returns/outputs.py``). Types only; imports nothing of the package."""

from __future__ import annotations

from typing import Any, TypedDict


class SequenceReply(TypedDict):
    """What one sampled sequence of a request kept."""

    saves: dict[str, Any]  # what the request's block saved
    edits: dict[str, Any]  # what the installed edits it ran saved


class RequestReply(TypedDict, total=False):
    """One request's entry in a worker's reply (sequence 0's dicts are also the
    flat ones). ``path``: lowered or Python, and why (``worker/paths.py``)."""

    saves: dict[str, Any]
    edits: dict[str, Any]
    error: Any  # the block's error as nnsight reports it, or None
    sequences: dict[int, SequenceReply]
    path: Any


class Merged(TypedDict):
    """One request's entry merged over the ranks, as the front end attaches it."""

    saves: dict[str, Any]
    edits: dict[str, Any]
    error: Any
    sequences: dict[int, dict[str, Any]]
    edit_sequences: dict[int, dict[str, Any]]
    path: Any


def request_reply() -> RequestReply:
    return {"saves": {}, "error": None, "edits": {}, "sequences": {}}


def sequence_reply() -> SequenceReply:
    return {"saves": {}, "edits": {}}


def merged() -> Merged:
    return {"saves": {}, "error": None, "sequences": {}, "edits": {}, "edit_sequences": {}, "path": None}
